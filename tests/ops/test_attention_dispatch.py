"""The two sides of each op's dispatch agree: CPU tensors without the interpreter run reference.py, and
must return what the Triton path returns (shapes, dtypes, LSE layout, values), so code written against
one device works on the other."""

import pytest
import torch

import lmkernels.ops.attention as attn
from lmkernels.ops.attention import kernels
from tests.helpers import TOL, rel_err
from tests.ops.test_attention_decode import paged

DT = torch.float16


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(kernels, "prefill_config",
                        lambda dqk, dv, m: dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    monkeypatch.setattr(kernels, "decode_config",
                        lambda dqk, dv, rows, **kw: dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))


def both(monkeypatch, call):
    """(Triton-path result, reference-path result) of call()."""
    triton_out = call()
    with monkeypatch.context() as m:
        m.setattr(attn, "use_triton", lambda t: False)
        ref_out = call()
    return triton_out, ref_out


def same(a, b, tol=TOL[DT]):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y, tol)
        return
    assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    if a.numel():
        assert torch.equal(torch.isneginf(a), torch.isneginf(b))
        fin = torch.isfinite(b)
        assert rel_err(a[fin], b[fin]) < tol


@pytest.mark.parametrize("return_lse", [False, True])
def test_prefill(monkeypatch, return_lse):
    cu = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
    q, k, v = torch.randn(30, 4, 64, dtype=DT), torch.randn(30, 2, 64, dtype=DT), torch.randn(30, 2, 64, dtype=DT)
    same(*both(monkeypatch, lambda: attn.attention_prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                           return_lse=return_lse)))
    qd, kd, vd = q.view(3, 10, 4, 64), k.view(3, 10, 2, 64), v.view(3, 10, 2, 64)
    same(*both(monkeypatch, lambda: attn.attention_prefill(qd, kd[:, :6], vd[:, :6], causal=False,
                                                           return_lse=return_lse)))


@pytest.mark.parametrize("return_lse", [False, True])
def test_decode_and_paged_prefill(monkeypatch, return_lse):
    k_cache, v_cache, tables, lens = paged([20, 0, 9], 1, page_size=16)
    q = torch.randn(3, 2, 4, 64, dtype=DT)
    same(*both(monkeypatch, lambda: attn.attention_decode(q, k_cache, v_cache, tables, lens, num_splits=2,
                                                          return_lse=return_lse)))
    same(*both(monkeypatch, lambda: attn.attention_decode(q[:, 0], k_cache, v_cache, tables, lens,
                                                          return_lse=return_lse)))
    cu = torch.tensor([0, 5, 5, 9], dtype=torch.int32)
    qp = torch.randn(9, 4, 64, dtype=DT)
    same(*both(monkeypatch, lambda: attn.attention_prefill_paged(qp, k_cache, v_cache, tables, cu, lens,
                                                                 return_lse=return_lse)))


def test_write_kv_cache_and_merge(monkeypatch):
    k, v = torch.randn(5, 2, 64, dtype=DT), torch.randn(5, 2, 64, dtype=DT)
    slots = torch.tensor([3, -1, 40, 7, 0])
    caches = [torch.zeros(3, 16, 2, 64, dtype=DT) for _ in range(4)]
    attn.write_kv_cache(k, v, caches[0], caches[1], slots)
    with monkeypatch.context() as m:
        m.setattr(attn, "use_triton", lambda t: False)
        attn.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    o_a, o_b = torch.randn(3, 4, 64, dtype=DT), torch.randn(3, 4, 64, dtype=DT)
    l_a, l_b = torch.randn(4, 3).t(), torch.randn(3, 4)  # a strided lse
    l_a[0, 0] = l_b[0, 0] = float("-inf")
    same(*both(monkeypatch, lambda: attn.merge_attention_states(o_a, l_a, o_b, l_b)))
