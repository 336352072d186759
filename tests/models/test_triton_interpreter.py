"""A short end-to-end run of a tiny random model on the Triton kernels (through the interpreter on the CPU),
against the same model on the ops' PyTorch references. fp16: the interpreter computes bf16 dots wrongly and
the attention kernels take fp16/bf16 only."""

import pytest
import torch

from lmkernels._utils import interpreting
from lmkernels.ops.gemv import kernels as gemv_kernels
from lmkernels.loading import load_preset
from lmkernels.models import greedy_generate, prefill_logits

from .conftest import rel_err


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_triton_path_matches_reference(preset, monkeypatch):
    model = load_preset(preset, dtype=torch.float16, seed=3, num_hidden_layers=2)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 11)]

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref_logits = prefill_logits(model, prompts, page_size=4)
    ref_tokens = greedy_generate(model, prompts, 4, page_size=4)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreting()
    logits = prefill_logits(model, prompts, page_size=4)
    calls, qkv_calls = [], []
    launch, launch_qkv = gemv_kernels.gemv, gemv_kernels.gemv_qkv
    monkeypatch.setattr(gemv_kernels, "gemv", lambda *a, **k: calls.append(a[0].shape[0]) or launch(*a, **k))
    monkeypatch.setattr(gemv_kernels, "gemv_qkv", lambda *a, **k: qkv_calls.append(1) or launch_qkv(*a, **k))
    tokens = greedy_generate(model, prompts, 4, page_size=4)
    assert calls and set(calls) <= {1, 2}  # the decode steps (2 rows at most) took the gemv path
    # llama: rotary and the cache write fused into the qkv pass; qwen3's q/k norm sits in between: not fused
    assert bool(qkv_calls) == (preset == "tiny-llama")
    chunked = greedy_generate(model, prompts, 4, page_size=4, prefill_chunk=4)  # paged (append) prefill kernel

    assert torch.isfinite(logits).all()
    assert rel_err(logits, ref_logits) < 5e-3
    assert tokens == ref_tokens
    assert chunked == ref_tokens
