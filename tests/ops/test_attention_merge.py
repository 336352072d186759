"""merge_attention_states: the Triton kernel (interpreter) vs the float64 reference, and attention over a
union of key sets rebuilt from its parts (prefill and decode LSE feeding the merge)."""

import pytest
import torch

from lmkernels.ops.attention import (attention_decode, attention_prefill, kernels, merge_attention_states,
                                     reference)
from tests.helpers import TOL, rel_err


@pytest.fixture
def poison(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 4, 64), (2, 3, 5, 128), (1, 96)])
def test_merge_matches_reference(poison, dtype, shape):
    o_a, o_b = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    lse_a, lse_b = torch.randn(shape[:-1]) * 3, torch.randn(shape[:-1]) * 3
    flat_a, flat_b = lse_a.view(-1), lse_b.view(-1)
    flat_a[0] = float("-inf")  # an empty part
    if flat_a.numel() > 2:
        flat_a[1] = flat_b[1] = float("-inf")  # both empty
    o, lse = merge_attention_states(o_a, lse_a, o_b, lse_b)
    ro, rl = reference.merge_states(o_a.double(), lse_a.double(), o_b.double(), lse_b.double())
    assert o.dtype == dtype and o.shape == o_a.shape and lse.dtype == torch.float32 and lse.shape == lse_a.shape
    assert rel_err(o, ro) < TOL[dtype]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert rel_err(lse[fin], rl[fin]) < 1e-6
    assert torch.equal(o.view(-1, shape[-1])[0], o_b.view(-1, shape[-1])[0])  # e^0 · o_b exactly
    if flat_a.numel() > 2:
        assert (o.view(-1, shape[-1])[1] == 0).all()


def test_merge_strided_lse_from_prefill(monkeypatch):
    """Attention over keys [0, n) = merge of prefill over a prefix and over the rest; prefill's lse
    [Hq, T] enters transposed (a strided view), the dense layout's [B, Hq, S] likewise."""
    monkeypatch.setattr(kernels, "prefill_config",
                        lambda dqk, dv, m: dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    dt = torch.float16
    q = torch.randn(2, 9, 4, 64, dtype=dt)  # dense: 9 queries attending all 50 keys
    k, v = torch.randn(2, 50, 2, 64, dtype=dt), torch.randn(2, 50, 2, 64, dtype=dt)
    o1, l1 = attention_prefill(q, k[:, :21], v[:, :21], causal=False, return_lse=True)
    o2, l2 = attention_prefill(q, k[:, 21:], v[:, 21:], causal=False, return_lse=True)
    o, lse = merge_attention_states(o1, l1.transpose(1, 2), o2, l2.transpose(1, 2))
    ro, rl = reference.attention_dense(q.double(), k.double(), v.double(), causal=False)
    assert rel_err(o, ro) < TOL[dt]
    assert rel_err(lse, rl.transpose(1, 2)) < 1e-5
    # packed layout: lse [Hq, T] → .t()
    cu_q = torch.tensor([0, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 21], dtype=torch.int32)
    cu_k2 = torch.tensor([0, 29], dtype=torch.int32)
    p1, m1 = attention_prefill(q[0], k[0, :21], v[0, :21], causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               return_lse=True)
    p2, m2 = attention_prefill(q[0], k[0, 21:], v[0, 21:], causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k2,
                               return_lse=True)
    o, lse = merge_attention_states(p1, m1.t(), p2, m2.t())
    assert rel_err(o, ro[0]) < TOL[dt] and rel_err(lse, rl[0].t()) < 1e-5


def test_cascade_decode_plus_suffix(monkeypatch):
    """Decode over a paged prefix merged with prefill over the new tokens = decode over everything."""
    monkeypatch.setattr(kernels, "decode_config",
                        lambda dqk, dv, rows, **kw: dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    monkeypatch.setattr(kernels, "prefill_config",
                        lambda dqk, dv, m: dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    dt, page = torch.float16, 16
    n_prefix, n_new, hq, hk = 37, 3, 4, 1
    k, v = torch.randn(n_prefix + n_new, hk, 64, dtype=dt), torch.randn(n_prefix + n_new, hk, 64, dtype=dt)
    q = torch.randn(1, n_new, hq, 64, dtype=dt)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    k_cache = torch.zeros(4, page, hk, 64, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    for t in range(n_prefix + n_new):
        k_cache[table[0, t // page], t % page], v_cache[table[0, t // page], t % page] = k[t], v[t]
    # prefix part: every new token sees the whole prefix. As n_new one-token sequences of length n_prefix
    # sharing the table, each query sits at position n_prefix − 1 and sees keys [0, n_prefix).
    o_pre, l_pre = attention_decode(q[0][:, None], k_cache, v_cache, table.expand(n_new, 3).contiguous(),
                                    torch.full((n_new,), n_prefix, dtype=torch.int32), return_lse=True,
                                    num_splits=2)
    # new part: causal among the new tokens
    cu_q = torch.tensor([0, n_new], dtype=torch.int32)
    o_new, l_new = attention_prefill(q[0], k[n_prefix:], v[n_prefix:], causal=True, cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_q, return_lse=True)
    o, lse = merge_attention_states(o_pre[:, 0], l_pre[:, 0], o_new, l_new.t())
    full, full_lse = attention_decode(q, k_cache, v_cache, table, torch.tensor([n_prefix + n_new], dtype=torch.int32),
                                      return_lse=True)
    ro, rl = reference.attention_decode(q.double(), k_cache, v_cache, table,
                                        torch.tensor([n_prefix + n_new], dtype=torch.int32))
    assert rel_err(o, ro[0]) < TOL[dt] and rel_err(lse, rl[0]) < 1e-5
    assert rel_err(full, ro) < TOL[dt]


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda a: {**a, "o_b": a["o_b"].half()}, TypeError, "o_b must have dtype"),
        (lambda a: {**a, "o_b": a["o_b"][:2]}, ValueError, "o_b must have shape"),
        (lambda a: {**a, "lse_a": a["lse_a"].half()}, TypeError, "lse_a must have dtype"),
        (lambda a: {**a, "lse_b": a["lse_b"][:, :1]}, ValueError, "lse_b must have shape"),
        (lambda a: {**a, "o_a": a["o_a"].long()}, TypeError, "o_a must have dtype"),
        (lambda a: {**a, "o_a": a["o_a"].transpose(1, 2)}, ValueError, "o_b must have shape|o_a must be contiguous"),
    ],
)
def test_merge_bad_inputs(change, exc, match):
    args = dict(o_a=torch.randn(3, 4, 64), lse_a=torch.randn(3, 4), o_b=torch.randn(3, 4, 64), lse_b=torch.randn(3, 4))
    with pytest.raises(exc, match=match):
        merge_attention_states(**change(args))


def test_torch_compile_fullgraph():
    def f(o_a, l_a, o_b, l_b):
        o, lse = merge_attention_states(o_a, l_a, o_b, l_b)
        return o * 2, lse + 1

    args = (torch.randn(5, 2, 64), torch.randn(5, 2), torch.randn(5, 2, 64), torch.randn(5, 2))
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(*args), f(*args))
