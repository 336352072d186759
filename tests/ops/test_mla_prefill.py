"""MLA prefill (up-projection + attention_prefill + LSE merge of cached-context chunks) against the float64
non-absorbed reference; and absorbed decode against the same non-absorbed math (weight absorption)."""

import pytest
import torch

from lmkernels.ops.mla import mla_decode, mla_prefill, mla_prefill_plan, reference

H, NOPE, VD = 4, 128, 128
SCALE = 192 ** -0.5


def _cache(lens, page, fp8=False):
    width = max(-(-n // page) for n in lens)
    num_pages = len(lens) * width + 2
    tables = torch.randperm(num_pages)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    rows = torch.randn(num_pages, page, 576)
    if fp8:
        cache, scales = reference.quantize_rows(rows)
    else:
        cache, scales = rows.half(), None
    return cache, scales, tables


@pytest.mark.parametrize("chunk", [24, 64])
@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_chunked_context(fp8, chunk):
    """Three sequences: a fresh prompt, one with a cached prefix longer than a chunk of 24, one with a short
    prefix; page size 16, lengths not multiples of it. Context chunk 24 → the new tokens with the prefixes' last
    chunks (causal), then two earlier chunks, merged by LSE; 64 ≥ every prefix → one causal pass over each whole
    context."""
    lens, q_lens = [19, 70, 33], [19, 9, 5]
    cache, scales, tables = _cache(lens, 16, fp8)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    n = sum(q_lens)
    q_nope = (torch.randn(n, H, NOPE) / NOPE ** 0.25).half()
    q_pe = (torch.randn(n, H, 64) / 8 ** 0.5).half()
    w = (torch.randn(H * (NOPE + VD), 512) / 512 ** 0.5).half()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = mla_prefill_plan(cache, tables, cu, seq_lens, chunk_size=chunk)
    assert len(plan.passes) == (1 + 2 if chunk == 24 else 1)  # prefixes 0, 61, 28
    o = mla_prefill(q_nope, q_pe, cache, tables, cu, seq_lens, w, scale=SCALE, cache_scales=scales, chunk_size=chunk,
                    plan=plan)
    rows = reference.gather_latents(cache, tables, seq_lens, scales)
    for b in range(3):
        a, e = int(cu[b]), int(cu[b + 1])
        want, _ = reference.mla_attention(q_nope[a:e], q_pe[a:e], rows[b], w, lens[b] - q_lens[b], SCALE, NOPE, VD)
        err = (o[a:e].double() - want).norm() / want.norm()
        assert err < 3e-3, (b, err)


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_plan_shared_by_layers(fp8):
    """One step's plan serves several layers (other queries, other weights): each call equals the call that makes
    its own plan, bit for bit; a fresh prompt, a prefix of several chunks, a one-token sequence."""
    lens, q_lens = [21, 90, 1], [21, 7, 1]
    cache, scales, tables = _cache(lens, 16, fp8)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = mla_prefill_plan(cache, tables, cu, seq_lens, chunk_size=32)
    assert len(plan.passes) == 1 + 2  # 83 prefix keys in chunks of 32: the new tokens with keys 64–82, then 0–63
    for layer in range(2):
        q_nope = (torch.randn(sum(q_lens), H, NOPE) / NOPE ** 0.25).half()
        q_pe = (torch.randn(sum(q_lens), H, 64) / 8 ** 0.5).half()
        w = (torch.randn(H * (NOPE + VD), 512) / 512 ** 0.5).half()
        args = (q_nope, q_pe, cache, tables, cu, seq_lens, w)
        shared = mla_prefill(*args, scale=SCALE, cache_scales=scales, chunk_size=32, plan=plan)
        own = mla_prefill(*args, scale=SCALE, cache_scales=scales, chunk_size=32)
        assert torch.equal(shared, own), layer
    rows = reference.gather_latents(cache, tables, seq_lens, scales)
    want, _ = reference.mla_attention(q_nope[21:28], q_pe[21:28], rows[1], w, 83, SCALE, NOPE, VD)
    assert (shared[21:28].double() - want).norm() / want.norm() < 3e-3


def test_prefill_plan_must_fit_the_call():
    lens, q_lens = [30, 12], [10, 12]
    cache, _, tables = _cache(lens, 16)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_nope, q_pe = torch.randn(22, H, NOPE).half(), torch.randn(22, H, 64).half()
    w = torch.randn(H * (NOPE + VD), 512).half()
    plan = mla_prefill_plan(cache, tables, cu, seq_lens, chunk_size=16)
    with pytest.raises(ValueError, match="chunk_size"):  # made for another chunk size
        mla_prefill(q_nope, q_pe, cache, tables, cu, seq_lens, w, scale=SCALE, plan=plan)
    with pytest.raises(ValueError, match="cu_seqlens_q must end at 21"):  # made for other new tokens
        mla_prefill(q_nope[:21], q_pe[:21], cache, tables, cu, seq_lens, w, scale=SCALE, chunk_size=16, plan=plan)
    with pytest.raises(TypeError, match="mla_prefill_plan"):
        mla_prefill(q_nope, q_pe, cache, tables, cu, seq_lens, w, scale=SCALE, plan=(cu, seq_lens))
    with pytest.raises(ValueError, match="page table is too short"):  # the plan makes the data checks
        mla_prefill_plan(cache, tables, cu, torch.tensor([30, 300], dtype=torch.int32))


def test_absorbed_decode_equals_plain_mla():
    """Weight absorption: decode with q_lat = q_nope · W_UK and out = o_lat · W_UVᵀ equals plain MLA."""
    lens = [40, 17]
    cache, _, tables = _cache(lens, 16)
    w = (torch.randn(H * (NOPE + VD), 512) / 512 ** 0.5).double()
    wv = w.view(H, NOPE + VD, 512)
    q_nope = torch.randn(2, 1, H, NOPE, dtype=torch.float64) / NOPE ** 0.25
    q_pe = (torch.randn(2, 1, H, 64) / 8 ** 0.5).half()
    q_lat = torch.einsum("bqhn,hnd->bqhd", q_nope, wv[:, :NOPE]).half()
    o_lat, _ = mla_decode(q_lat, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32), scale=SCALE)
    out = torch.einsum("bqhd,hvd->bqhv", o_lat.double(), wv[:, NOPE:])
    rows = reference.gather_latents(cache, tables, torch.tensor(lens))
    for b in range(2):
        want, _ = reference.mla_attention(q_nope[b], q_pe[b], rows[b], w, lens[b] - 1, SCALE, NOPE, VD)
        err = (out[b].double() - want).norm() / want.norm()
        assert err < 5e-3, err


def test_prefill_bad_inputs():
    cache, _, tables = _cache([10], 16)
    q_nope, q_pe = torch.randn(10, H, NOPE).half(), torch.randn(10, H, 64).half()
    w = torch.randn(H * (NOPE + VD), 512).half()
    cu, lens = torch.tensor([0, 10], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    with pytest.raises(ValueError, match="w_kv_b"):
        mla_prefill(q_nope, q_pe, cache, tables, cu, lens, w[:, :256], scale=SCALE)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_prefill(q_nope, q_pe, cache, tables, cu, torch.tensor([5], dtype=torch.int32), w, scale=SCALE)
    with pytest.raises(ValueError, match="page table is too short"):
        mla_prefill(q_nope, q_pe, cache, tables, cu, torch.tensor([40], dtype=torch.int32), w, scale=SCALE)
    bad = tables.clone()
    bad[0, 0] = cache.shape[0]  # one page past the cache: caught, though every other entry is fine
    with pytest.raises(ValueError, match=r"block_tables\[0\] refers to pages outside"):
        mla_prefill(q_nope, q_pe, cache, bad, cu, lens, w, scale=SCALE)
    bad[0, 0] = -1
    with pytest.raises(ValueError, match=r"block_tables\[0\] refers to pages outside"):
        mla_prefill(q_nope, q_pe, cache, bad, cu, lens, w, scale=SCALE)
    with pytest.raises(ValueError, match="latent_cache"):
        mla_prefill(q_nope, q_pe, cache[..., :100].contiguous(), tables, cu, lens, w, scale=SCALE)
    with pytest.raises(TypeError, match="q_nope"):
        mla_prefill(q_nope.float(), q_pe.float(), cache, tables, cu, lens, w, scale=SCALE)
