"""attention_prefill_paged (append prefill over a paged KV cache) vs the float64 reference, and chunked
prefill through the cache equal to one prefill of the whole sequences (interpreter, fp16)."""

import pytest
import torch

from lmkernels.ops.attention import (attention_prefill, attention_prefill_paged, kernels, reference,
                                     write_kv_cache)
from tests.helpers import TOL, rel_err
from tests.ops.test_attention_decode import FP8_TOL, paged

DT = torch.float16


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(kernels, "prefill_config",
                        lambda dqk, dv, m: dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))


@pytest.fixture
def poison(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))


def check(o, lse, ro, rl, tol=TOL[DT]):
    assert o.shape == ro.shape and lse.shape == rl.shape and lse.dtype == torch.float32
    assert rel_err(o, ro) < tol
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert torch.isfinite(lse[fin]).all() and rel_err(lse[fin], rl[fin]) < 1e-5


SEQ_LENS = [40, 1, 70, 3, 17]  # cached prefix + new tokens
Q_LENS = [5, 1, 30, 0, 17]  # new tokens: after a prefix of 35, 0, 40, 3, 0


def cu(lens):
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (True, (12, -1), 20.0),
                                                   (False, (-1, -1), 0.0), (False, (6, 9), 0.0)])
@pytest.mark.parametrize("hq,hk,page_size", [(2, 2, 16), (8, 1, 32)])
def test_paged_prefill(small_tiles, poison, causal, window, softcap, hq, hk, page_size):
    k_cache, v_cache, tables, seq_lens = paged(SEQ_LENS, hk, page_size=page_size)
    q = torch.randn(sum(Q_LENS), hq, 64, dtype=DT)
    o, lse = attention_prefill_paged(q, k_cache, v_cache, tables, cu(Q_LENS), seq_lens, max_seqlen_q=30,
                                     causal=causal, window=window, softcap=softcap, return_lse=True)
    ro, rl = reference.attention_prefill_paged(q.double(), k_cache, v_cache, tables, cu(Q_LENS), seq_lens,
                                               causal=causal, window=window, softcap=softcap)
    check(o, lse, ro, rl)


def test_production_tiles_and_dims(poison):
    for d, dv in ((128, 128), (192, 128)):
        k_cache, v_cache, tables, seq_lens = paged([80, 9], 1, d, dv, page_size=16)
        q = torch.randn(50, 2, d, dtype=DT)
        cu_q = cu([41, 9])
        o, lse = attention_prefill_paged(q, k_cache, v_cache, tables, cu_q, seq_lens, return_lse=True)
        ro, rl = reference.attention_prefill_paged(q.double(), k_cache, v_cache, tables, cu_q, seq_lens)
        check(o, lse, ro, rl)


def test_fp8_cache(small_tiles, poison):
    k_hi, v_hi, tables, seq_lens = paged(SEQ_LENS, 2, page_size=16)
    k_scale, v_scale = torch.tensor([0.02, 0.04]), torch.tensor([0.03])
    k8 = reference.quantize_fp8(k_hi.nan_to_num(0.0), k_scale)
    v8 = reference.quantize_fp8(v_hi.nan_to_num(0.0), v_scale)
    q = torch.randn(sum(Q_LENS), 4, 64, dtype=DT)
    for kw in ({}, dict(window=(10, -1), softcap=4.0)):
        o, lse = attention_prefill_paged(q, k8, v8, tables, cu(Q_LENS), seq_lens, k_scale=k_scale, v_scale=v_scale,
                                         return_lse=True, **kw)
        ro, rl = reference.attention_prefill_paged(q.double(), k8, v8, tables, cu(Q_LENS), seq_lens, k_scale=k_scale,
                                                   v_scale=v_scale, **kw)
        check(o, lse, ro, rl)
        exact, _ = reference.attention_prefill_paged(q.double(), k_hi, v_hi, tables, cu(Q_LENS), seq_lens, **kw)
        assert rel_err(o, exact) < FP8_TOL


def test_chunked_prefill_equals_whole_prefill(small_tiles):
    """Prefill in two chunks — the first by attention_prefill, the second appended through the cache —
    gives what one prefill of the whole sequences gives."""
    lens, first = [50, 23], [18, 23]  # the second sequence arrives whole in the first chunk
    hq, hk, page_size = 4, 2, 16
    q, k, v = (torch.randn(sum(lens), h, 64, dtype=DT) for h in (hq, hk, hk))
    whole = attention_prefill(q, k, v, cu_seqlens_q=cu(lens), cu_seqlens_k=cu(lens), window=(25, -1))

    tables = torch.randperm(10).to(torch.int32)[:8].view(2, 4)
    k_cache = torch.full((10, page_size, hk, 64), float("nan"), dtype=DT)
    v_cache = torch.full_like(k_cache, float("nan"))
    starts = cu(lens)[:-1].tolist()

    def slots(b, lo, hi):
        t = torch.arange(lo, hi)
        return tables[b, t // page_size].long() * page_size + t % page_size

    def rows(b, lo, hi):
        return torch.arange(starts[b] + lo, starts[b] + hi)

    # chunk 1: tokens [0, first[b]) of each sequence
    idx1 = torch.cat([rows(b, 0, first[b]) for b in range(2)])
    write_kv_cache(k[idx1], v[idx1], k_cache, v_cache, torch.cat([slots(b, 0, first[b]) for b in range(2)]))
    o1 = attention_prefill_paged(q[idx1], k_cache, v_cache, tables, cu(first), torch.tensor(first, dtype=torch.int32),
                                 window=(25, -1))
    # chunk 2: the rest, appended (the second sequence has none left: a zero-length query run)
    rest = [n - f for n, f in zip(lens, first)]
    idx2 = torch.cat([rows(b, first[b], lens[b]) for b in range(2)])
    write_kv_cache(k[idx2], v[idx2], k_cache, v_cache, torch.cat([slots(b, first[b], lens[b]) for b in range(2)]))
    o2 = attention_prefill_paged(q[idx2], k_cache, v_cache, tables, cu(rest), torch.tensor(lens, dtype=torch.int32),
                                 window=(25, -1))
    assert rel_err(o1, whole[idx1]) < TOL[DT] and rel_err(o2, whole[idx2]) < TOL[DT]


def _args():
    k_cache, v_cache, tables, seq_lens = paged([20, 6], 2, page_size=16)
    return dict(q=torch.randn(9, 4, 64, dtype=DT), k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                cu_seqlens_q=cu([4, 5]), seq_lens=seq_lens)


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda a: {**a, "seq_lens": torch.tensor([20, 3], dtype=torch.int32)}, ValueError,
         r"seq_lens\[1\] = 3 is below"),
        (lambda a: {**a, "block_tables": a["block_tables"][:, :1]}, ValueError, "page table is too short"),
        (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, "multiple of the heads of k_cache"),
        (lambda a: {**a, "q": a["q"].float()}, TypeError, "q must have dtype"),
        (lambda a: {**a, "cu_seqlens_q": cu([4, 4])}, ValueError, "cu_seqlens_q must start at 0"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, ValueError, "seq_lens must have shape"),
        (lambda a: {**a, "block_tables": a["block_tables"][:1]}, ValueError, "one row per sequence"),
        (lambda a: {**a, "max_seqlen_q": 2}, ValueError, "max_seqlen_q"),
        (lambda a: {**a, "window": (3, 1)}, ValueError, "window right"),
    ],
)
def test_bad_inputs(change, exc, match):
    with pytest.raises(exc, match=match):
        attention_prefill_paged(**change(_args()))


def test_torch_compile_fullgraph(small_tiles):
    a = _args()

    def f(q, k_cache, v_cache):
        o, lse = attention_prefill_paged(q, k_cache, v_cache, a["block_tables"], a["cu_seqlens_q"], a["seq_lens"],
                                         max_seqlen_q=5, return_lse=True)
        return o * 2, lse

    eager = f(a["q"], a["k_cache"], a["v_cache"])
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(a["q"], a["k_cache"], a["v_cache"])
    torch.testing.assert_close(compiled, eager)
