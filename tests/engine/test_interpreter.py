"""One short end-to-end engine run of a tiny random model on the Triton kernels (through the interpreter on the
CPU): chunked prefill, paged append prefill, paged decode on padded static buffers and a preemption, against the
same engine on the ops' PyTorch references. fp16: the interpreter computes bf16 dots wrongly."""

import torch

from lmkernels._utils import interpreting
from lmkernels.engine import Engine, SamplingParams
from lmkernels.engine.cuda_graph import DecodeGraphs
from lmkernels.loading import load_preset


def _run(model, prompts, params, graphs):
    e = Engine(model, num_pages=5, page_size=4, max_num_seqs=4, max_num_batched_tokens=8, eos_token_ids=[])
    if graphs:
        e.graphs = DecodeGraphs(model, e.kv_cache, 4, 32, capture=False, buckets=[4])
    outs = e.generate(prompts, params)
    return [o.token_ids for o in outs], e.stats


def test_engine_on_triton_kernels(monkeypatch):
    model = load_preset("tiny-llama", dtype=torch.float16, seed=3)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 11, 7)]
    params = [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=4),
              SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20, seed=1)]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref, _ = _run(model, prompts, params, graphs=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreting()
    out, stats = _run(model, prompts, params, graphs=True)
    assert out == ref
    assert stats.preemptions > 0 and stats.decode_tokens > 0
