"""Absorbed MLA decode (Triton kernel through the interpreter, fp16) against the float64 reference."""

import random

import pytest
import torch

from lmkernels.ops.mla import (kernels, kernels_few, kernels_fp8, kernels_seesaw_t, kernels_ws, mla_decode,
                               mla_decode_schedule, reference, schedule)
from tests.helpers import compile_in_fresh_process, nan_empty

SCALE = 192 ** -0.5


def _setup(lens, heads, n_new, page, dtype=torch.float16, fp8=False, spare_pages=3):
    batch = len(lens)
    width = max(1, max(-(-n // page) for n in lens))
    num_pages = batch * width + spare_pages
    tables = torch.randperm(num_pages)[: batch * width].view(batch, width).to(torch.int32)
    rows = torch.randn(num_pages, page, 576, dtype=torch.float32)
    rows[..., :512] *= 1.0
    scales = None
    if fp8:
        cache, scales = reference.quantize_rows(rows)
    else:
        cache = rows.to(dtype)
    q_nope = (torch.randn(batch, n_new, heads, 512) / 512 ** 0.25).to(dtype)
    q_pe = (torch.randn(batch, n_new, heads, 64) / 64 ** 0.25).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q_nope, q_pe, cache, scales, tables, seq_lens


def _check(q_nope, q_pe, cache, scales, tables, seq_lens, tol=2e-3, **kw):
    o, lse = mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, cache_scales=scales, **kw)
    want_o, want_lse = reference.mla_decode(q_nope, q_pe, cache, tables, seq_lens, SCALE, scales)
    assert o.shape == q_nope.shape and o.dtype == q_nope.dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    err = (o.double() - want_o).norm() / want_o.norm().clamp(min=1e-30)
    assert err < tol, err
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], rtol=0, atol=1e-4)
    assert (o[~fin] == 0).all()
    return o, lse


def _nan_past_ends(cache, tables, lens, page):
    """Every cache row past each sequence's end set to NaN (a tile read without its mask shows)."""
    for b, n in enumerate(lens):
        for j in range(n, tables.shape[1] * page):
            cache[tables[b, j // page], j % page] = float("nan")


def _check_two_calls(call, q_nope, q_pe, cache, tables, seq_lens):
    """Two calls in a row against the reference; the merge counters are back at 0 after each."""
    want, want_lse = reference.mla_decode(q_nope, q_pe, cache, tables, seq_lens, SCALE)
    fin = torch.isfinite(want_lse)
    for _ in range(2):
        o, lse = call()
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert (o.double() - want).norm() / want.norm() < 2e-3
        torch.testing.assert_close(lse[fin].double(), want_lse[fin], rtol=0, atol=1e-4)
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and (o[~fin] == 0).all()
        assert not kernels._counters(o.device, 1).any()  # every counter back at 0


@pytest.mark.parametrize("page", [1, 16, 64])
def test_decode_ragged_pages(page):
    """Different context per sequence, lengths not multiples of the page size, a shuffled page table."""
    _check(*_setup([1, 45, 130, 77], heads=16, n_new=1, page=page))


@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_splits_mtp(num_splits):
    """Two query tokens per sequence (MTP), causal among them; a length-1 sequence leaves its first query
    with no key (o = 0, lse = −inf); a length-0 sequence (padding) gives zeros."""
    _check(*_setup([150, 1, 0, 67], heads=16, n_new=2, page=16), num_splits=num_splits, max_seqlen_k=160)


@pytest.mark.parametrize("sms", [1, 64, 32])
def test_decode_many_splits(monkeypatch, sms):
    """More splits than one merge step reads, with the merge in whole rows (many rows per SM) and in
    column blocks (few rows: sms=64 and 32; 16 rows × 8 column blocks take the larger step at 64 SMs)."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: sms)
    monkeypatch.setattr(kernels, "decode_config", lambda rows, fp8=False: dict(
        BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, KEYS_MAJOR=True, PROGRAMS_PER_SM=1))
    n_splits = {64: kernels.MERGE_CHUNK_S_FEW, 32: kernels.MERGE_CHUNK_S}.get(sms, 32) + 5
    _check(*_setup([16 * n_splits - 3, 20], heads=16, n_new=1, page=16), num_splits=n_splits)


@pytest.mark.parametrize("n_splits", [13, 27])
def test_decode_merge_whole_rows(monkeypatch, n_splits):
    """Few rows, few chunks: the column-block merge takes whole rows and every chunk of a sequence in one round
    (CHUNK_S 16 up to 16 chunks, else 32), as for 128 heads at B=1 on the H100; its row thresholds are lowered to
    reach it with 16 heads, and the launch is checked to be that one."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 32)
    monkeypatch.setattr(kernels, "MERGE_WHOLE_ROWS_16", 32)
    monkeypatch.setattr(kernels, "MERGE_WHOLE_ROWS_32", 32)
    monkeypatch.setattr(kernels, "decode_config", lambda rows, fp8=False: dict(
        BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, KEYS_MAJOR=True, PROGRAMS_PER_SM=1))
    launches, merge = [], kernels._mla_merge_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((kw["BLOCK_D"], kw["CHUNK_S"]))
                return merge[grid](*args, **kw)
            return launch

    monkeypatch.setattr(kernels, "_mla_merge_kernel", Spy())
    _check(*_setup([16 * n_splits - 3, 40], heads=16, n_new=1, page=16), num_splits=n_splits)
    assert launches == [(512, 16 if n_splits <= 16 else 32)]


@pytest.mark.parametrize("page", [16, 64])
def test_decode_128_heads(page):
    """128 heads: two 64-row blocks per sequence; page 64 takes the default TMA tiles (a full 64-key tile and a
    partial one), page 16 the pointer tiles."""
    _check(*_setup([100, 19], heads=128, n_new=1, page=page), num_splits=2)


def test_decode_rows_not_multiple_of_block():
    """24 rows (12 heads × 2 tokens) in a 32-row tile; a small max_seqlen_k below the real lengths only makes
    the split chunks longer."""
    _check(*_setup([100, 33], heads=12, n_new=2, page=16), max_seqlen_k=40)


@pytest.mark.parametrize("heads", [16, 128])
def test_decode_fp8(heads):
    """FP8 cache (16 rows: whole 512-column tiles, 64 rows: halves): exact against the reference on the
    dequantised cache; against the unquantised rows within the stated tolerance (5e-2 relative: e4m3 keeps 3
    mantissa bits)."""
    q_nope, q_pe, cache, scales, tables, seq_lens = _setup([90, 37, 64], heads=heads, n_new=1, page=16, fp8=True)
    o, _ = _check(q_nope, q_pe, cache, scales, tables, seq_lens, num_splits=2)
    exact = reference.dequantize_rows(cache, scales)  # the rows before quantisation are close to these
    raw_o, _ = reference.mla_decode(q_nope, q_pe, exact.half(), tables, seq_lens, SCALE)
    err = (o.double() - raw_o).norm() / raw_o.norm()
    assert err < 5e-2


def test_decode_fp8_vs_unquantised():
    q_nope, q_pe, rows16, _, tables, seq_lens = _setup([70, 40], heads=16, n_new=1, page=16)
    values, scales = reference.quantize_rows(rows16.float())
    o, _ = mla_decode(q_nope, q_pe, values, tables, seq_lens, scale=SCALE, cache_scales=scales)
    want, _ = reference.mla_decode(q_nope, q_pe, rows16, tables, seq_lens, SCALE)
    err = (o.double() - want).norm() / want.norm()
    assert err < 5e-2, err


def test_split_heuristic():
    cfg = kernels.decode_config(16)
    assert cfg["BLOCK_M"] == 16
    assert kernels.decode_config(128)["BLOCK_M"] == 64
    assert kernels.decode_num_splits(1, 1, 8192, 132, 2) == 64  # B=1: 8192 / 128
    assert kernels.decode_num_splits(32, 1, 1024, 132, 4) == 4  # a batch fills the GPU: 256-key splits
    assert kernels.decode_num_splits(1, 1, 1024, 132, 4) == 32  # short context: 32 splits of 32 keys
    assert kernels.decode_num_splits(1, 1, 32768, 132, 4) == 128  # the automatic cap
    assert kernels.decode_num_splits(128, 2, 8192, 132, 1) == 1
    assert kernels.decode_num_splits(32, 1, 32768, 132, 2) == 8  # one wave of 256 programs on 264 slots
    assert kernels.decode_num_splits(32, 2, 8192, 132, 1) == 2  # 128 heads: 128 programs, not 2.4 waves
    assert kernels.decode_num_splits(1, 1, 100, 132, 2) == 3
    assert kernels.decode_num_splits(1, 1, 20, 132, 2) == 1


def test_decode_bad_inputs():
    q_nope, q_pe, cache, _, tables, seq_lens = _setup([20, 5], heads=16, n_new=1, page=16)
    with pytest.raises(ValueError, match="latent_cache"):
        mla_decode(q_nope, q_pe, cache[..., :512].contiguous(), tables, seq_lens, scale=SCALE)
    with pytest.raises(ValueError, match="page table is too short"):
        mla_decode(q_nope, q_pe, cache, tables, torch.tensor([20, 40], dtype=torch.int32), scale=SCALE)
    with pytest.raises(ValueError, match="q_nope_absorbed"):
        mla_decode(q_nope[..., :128], q_pe, cache, tables, seq_lens, scale=SCALE)
    with pytest.raises(ValueError, match="q_pe"):
        mla_decode(q_nope, q_pe[..., :32], cache, tables, seq_lens, scale=SCALE)
    with pytest.raises(TypeError, match="latent_cache"):
        mla_decode(q_nope, q_pe, cache.float(), tables, seq_lens, scale=SCALE)
    with pytest.raises(ValueError, match="block_tables"):
        mla_decode(q_nope, q_pe, cache, tables[:1], seq_lens, scale=SCALE)
    with pytest.raises(ValueError, match="block_tables\\[0\\]"):
        mla_decode(q_nope, q_pe, cache, torch.full_like(tables, 99), seq_lens, scale=SCALE)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode(q_nope, q_pe, cache, tables, seq_lens[:1], scale=SCALE)
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, num_splits=257)
    with pytest.raises(ValueError, match="scale"):
        mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=0.0)
    with pytest.raises(ValueError, match="cache_scales"):
        mla_decode(q_nope, q_pe, cache.to(torch.float8_e4m3fn), tables, seq_lens, scale=SCALE)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        mla_decode(q_nope.float(), q_pe.float(), cache.float(), tables, seq_lens, scale=SCALE)


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("page_tile", [False, True])
@pytest.mark.parametrize("keys_major", [False, True])
def test_decode_both_score_orders(keys_major, page_tile, halves):
    """Both tile formulations (scores row-major or keys-major) at 16 and 64 rows, with splits; tiles gathered
    key by key or (page 64, PAGE_TILE) from one page per tile; c_kv as one 512-column tile or two halves."""
    for heads in (16, 64):
        q_nope, q_pe, cache, _, tables, seq_lens = _setup([70, 33], heads=heads, n_new=1, page=64 if page_tile else 16)
        cfg = dict(BLOCK_M=16 if heads == 16 else 64, BLOCK_N=32, num_warps=4, num_stages=1, KEYS_MAJOR=keys_major,
                   PAGE_TILE=page_tile, HALVES=halves)
        o, lse = kernels.mla_decode(q_nope, q_pe, cache, None, tables, seq_lens, SCALE, 2, 80, config=cfg)
        want, want_lse = reference.mla_decode(q_nope, q_pe, cache, tables, seq_lens, SCALE)
        assert (o.double() - want).norm() / want.norm() < 2e-3
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("keys_major,halves", [(False, False), (True, True)])
def test_decode_tma(keys_major, halves, page):
    """TMA tiles (descriptors over the cache as [pages · page_size, 576]) where the page size is a multiple of
    BLOCK_N (64, 128: full tiles through the descriptors, the partial last tile of each split through masked
    pointers), pointer tiles otherwise (16); the stale rows past each sequence's end are NaN, so a tail tile
    read without its mask would show. Splits, two query tokens (causal inside the full tiles)."""
    q_nope, q_pe, cache, _, tables, seq_lens = _setup([200, 64, 1, 97], heads=16, n_new=2, page=page)
    _nan_past_ends(cache, tables, seq_lens.tolist(), page)
    for splits in (1, 3):
        cfg = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2, KEYS_MAJOR=keys_major, TMA=True, HALVES=halves)
        o, lse = kernels.mla_decode(q_nope, q_pe, cache, None, tables, seq_lens, SCALE, splits, 200, config=cfg)
        want, want_lse = reference.mla_decode(q_nope, q_pe, cache, tables, seq_lens, SCALE)
        fin = torch.isfinite(want_lse)
        assert not torch.isnan(o).any()
        assert (o.double() - want).norm() / want.norm() < 2e-3
        torch.testing.assert_close(lse[fin].double(), want_lse[fin], rtol=0, atol=1e-4)


def test_decode_fake_shapes():
    """The custom op's fake implementation (torch.compile tracing) gives the real op's shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lmkernels.ops.mla import api

    args = _setup([20, 5], heads=16, n_new=2, page=16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        q_nope, q_pe, cache, scales, tables, seq_lens = fake
        o, lse = api._decode_op(q_nope, q_pe, cache, scales, tables, seq_lens, SCALE, 0, 32, None)
        table = api._schedule_op(seq_lens, 32, 9, 9, 9, 1, 0)
    assert o.shape == (2, 2, 16, 512) and o.dtype == torch.float16
    assert lse.shape == (2, 2, 16) and lse.dtype == torch.float32
    assert table.shape == (schedule.schedule_size(2, 9),) and table.dtype == torch.int32


@pytest.mark.parametrize("fused,merge_rows", [(True, None), (False, True), (False, False)])
@pytest.mark.parametrize("splits", [2, 4, 7])
def test_decode_merge_paths(monkeypatch, fused, merge_rows, splits):
    """The split merge inside the decode kernel (≤ FUSED_MAX_SPLITS splits, 16-bit partials; the last split of a
    sequence to arrive merges, its counter is reset for the next call) and the two separate merge kernels (whole
    rows × all splits per program, or one row walking its splits). Outputs and
    partials start as NaN (torch.empty poisoned), cache rows past each sequence's end are NaN; ragged lengths
    leave some sequences with fewer non-empty splits than launched (and one with none: o = 0, lse = −inf); two
    calls in a row."""
    monkeypatch.setattr(torch, "empty", nan_empty)
    q_nope, q_pe, cache, _, tables, seq_lens = _setup([130, 7, 0, 64, 33], heads=16, n_new=2, page=16)
    _nan_past_ends(cache, tables, seq_lens.tolist(), 16)
    cfg = dict(kernels.decode_config(32), FUSED_MERGE=fused, MERGE_ROWS=merge_rows)
    _check_two_calls(lambda: kernels.mla_decode(q_nope, q_pe, cache, None, tables, seq_lens, SCALE, splits, 130,
                                                config=cfg), q_nope, q_pe, cache, tables, seq_lens)


def test_generic_merge_sums_inside_each_thread():
    """The generic merge kernel's sm_90 build, as merge_partials launches it (merge_warps a program), sums a row's
    partials inside each thread: no shared memory for the sum. At 4 warps the [chunks, columns] block was split over
    warps along the chunks and the sum crossed them through 1–4 KB of it, which cost 128 heads B=4 × 4k 8% of a call
    and B=1 × 8k 11% (H200, NOTES, issue 6, session al)."""
    C = "lmkernels.ops.mla.compile_check"
    shapes = [(512, 16), (512, 32), (kernels.MERGE_BLOCK_D, 64), (kernels.MERGE_BLOCK_D, kernels.MERGE_CHUNK_S_FEW)]
    for r in compile_in_fresh_process("[" + ", ".join(f"{C}.merge({d}, {s})" for d, s in shapes) + "]"):
        assert r["smem_kb"] == 0 and r["stack"] == 0, r


@pytest.mark.skipif(not kernels_ws.triton_ok(), reason="the Gluon kernel runs only on the triton it was checked with")
def test_warp_specialised_kernel_compiles_for_hopper():
    """The Gluon kernel has no interpreter path (the GPU check, `lmkernels check`, runs it against the reference):
    here it must at least build for sm_90 with its seesaw intact: two warpgroups × (36 wgmma for one tile's
    scores + 2 × 4 for P · V, its own tile's P and the other's), one TMA message per 64-column piece and stage
    (and of q, where the loader brings it), within the shared memory of one SM; its epilogue takes a reciprocal a
    row of a thread (2 rows a thread in the wgmma layout, 2 warpgroups), not a division an element (256: H200, 5% of
    a 128-head B=32 × 1k call, NOTES, session ak); each of its four rescales of o a pair (two a warpgroup) is the
    warp's vote and skip (session ao).
    In a fresh process: the interpreter tests patch triton.language in this one, and Gluon compiles
    through it."""
    C = "lmkernels.ops.mla.compile_check"
    builds = compile_in_fresh_process(f"[{C}.ws(True, 'bf16'), {C}.ws(False, 'fp16', q_tma=False)]")
    for r, q_tma in zip(builds, (True, False)):
        assert r["wgmma"] == 2 * (576 // 16 + 2 * 64 // 16) and r["tma"] == 2 * 9 + 9 * q_tma and r["mma"] == 0, r
        assert r["smem_kb"] <= 227 and r["stack"] < 256 and r["div"] <= 2 * 2 and r["vote"] == 2 * 2, r


def test_q_by_tma_only_where_rows_share_one_stride():
    """The 64-row kernel's loader brings q by TMA as [B·Q·H, 512] / [B·Q·H, 64] rows of one 16-byte-aligned stride;
    any other layout must go through the consumers' loads, or the TMA boxes would read other rows."""
    rows_uniform = kernels_ws._q_rows_uniform
    b, q, h = 3, 2, 16
    qn, qp = (torch.randn(b, q, h, d, dtype=torch.bfloat16) for d in (512, 64))
    assert rows_uniform(qn, qp)
    fused = torch.randn(b, q, h, 576, dtype=torch.bfloat16)  # views of one [.., 576] row: 1,152 bytes apart
    assert rows_uniform(fused[..., :512], fused[..., 512:])
    assert not rows_uniform(qn.transpose(1, 2).contiguous().transpose(1, 2), qp)  # heads outside tokens
    assert not rows_uniform(torch.randn(b, q + 1, h, 512, dtype=torch.bfloat16)[:, :q], qp)  # a gap between sequences
    assert not rows_uniform(torch.randn(b, q, h, 516, dtype=torch.bfloat16)[..., :512], qp)  # rows 1,032 bytes apart
    assert not rows_uniform(torch.randn(b * q * h * 512 + 1, dtype=torch.bfloat16)[1:].view(b, q, h, 512), qp)
    assert not rows_uniform(qn, torch.randn(b, q, h, 64, 2, dtype=torch.bfloat16)[..., 0])  # columns 4 bytes apart


@pytest.mark.skipif(not kernels_ws.triton_ok(), reason="the Gluon kernel runs only on the triton it was checked with")
def test_few_rows_kernel_compiles_for_hopper():
    """The few-rows Gluon kernel (16 rows; GPU-checked by `lmkernels check`) builds for sm_90, one chunk a program
    and over a launch of programs, with its column halves: each warpgroup scores over its 256 c_kv columns and 32 of
    k_pe (16 + 2 wgmma of K = 16) and multiplies Pᵀ by its 256 columns (4 m64 blocks × 4 key steps); 8 TMA messages
    of 64 columns and 2 k_pe halves a stage; one SM's shared memory, no spills."""
    C = "lmkernels.ops.mla.compile_check"
    for r in compile_in_fresh_process(f"[{C}.few(True, 'bf16'), {C}.few(False, 'fp16'), {C}.few(ranges=True), "
                                      f"{C}.few(ranges=True, fused=True)]"):
        assert r["wgmma"] == 2 * (16 + 2 + 16) and r["tma"] == 8 + 2 and r["mma"] == 0, r
        assert r["smem_kb"] <= 227 and r["stack"] == 0, r


@pytest.mark.skipif(not kernels_ws.triton_ok(), reason="the Gluon kernel runs only on the triton it was checked with")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_host_cache_descriptors_match_the_kernels_stages(dtype):
    """The few-rows and transposed-seesaw kernels get the cache as TMA descriptors made on the host
    (kernels_few.cache_descriptor): all of the cache's rows, 64-key tiles of 64 columns in the stages' 128-byte
    swizzle, and (few-rows) k_pe halves of 32 columns in its 64-byte one; a mismatch would only show on the GPU."""
    from triton.experimental.gluon import language as gl

    cache = torch.empty(5, 128, 576, dtype=dtype)
    for cols, swizzle in ((64, 128), (kernels_few.ROPE_HALF, 64)):
        d = kernels_few.cache_descriptor(cache, cols)
        assert d.base is cache and list(d.shape) == [5 * 128, 576] and list(d.strides) == [576, 1]
        assert list(d.block_shape) == [kernels_few.BLOCK_N, cols]
        assert d.layout == gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)


@pytest.mark.skipif(not kernels_ws.triton_ok(), reason="the Gluon kernel runs only on the triton it was checked with")
def test_transposed_seesaw_kernel_compiles_for_hopper():
    """The transposed-seesaw Gluon kernel (32 and 16 rows; GPU-checked by `lmkernels check`) builds for sm_90, one
    chunk a program and over a launch of programs: each warpgroup scores its stage's tiles over all 576 columns (36
    wgmma of K = 16) and multiplies both tiles' Pᵀ by its 256 columns (2 × 4 m64 blocks × 4 key steps); one TMA
    message a 64-column piece and stage; one SM's shared memory, no spills (the z index keeps the wgmma descriptors
    out of the loop preheader)."""
    C = "lmkernels.ops.mla.compile_check"
    for r in compile_in_fresh_process(f"[{C}.seesaw_t(True, 'bf16'), {C}.seesaw_t(False, 'fp16'), "
                                      f"{C}.seesaw_t(ranges=True), {C}.seesaw_t(ranges=True, rows=16)]"):
        assert r["wgmma"] == 2 * (36 + 2 * 16) and r["tma"] == 2 * 9 and r["mma"] == 0, r
        assert r["smem_kb"] <= 227 and r["stack"] == 0, r


@pytest.mark.skipif(not kernels_ws.triton_ok(), reason="the Gluon kernel runs only on the triton it was checked with")
def test_fp8_kernel_compiles_for_hopper():
    """The FP8 Gluon kernel (16, 32 and 64 rows; GPU-checked by `lmkernels check`) builds for sm_90 with its two
    warpgroups' shares. Up to 32 rows column halves: each scores over 256 c_kv columns and 32 of k_pe (16 + 2 wgmma
    of K = 16) and multiplies P by its 256 columns (4 m64 blocks × 4 key steps). At 64 rows key halves: each scores
    all 64 rows against its 32 keys over all 576 columns (32 + 4) and multiplies P by its 256 columns over both key
    halves (2 × 2 key steps of m64n256). TMA messages: 8 c_kv pieces of 64 columns and 2 k_pe halves; in one SM's
    shared memory, without spilling (the z index keeps the wgmma descriptors out of the loop preheader)."""
    C = "lmkernels.ops.mla.compile_check"
    built = compile_in_fresh_process(f"[{C}.fp8(16, True, 'bf16'), {C}.fp8(32, False, 'fp16'), {C}.fp8(64)]")
    for r, wgmma in zip(built, (16 + 2 + 16, 16 + 2 + 16, 32 + 4 + 4)):
        assert r["wgmma"] == 2 * wgmma and r["tma"] == 8 + 2 and r["mma"] == 0, r
        assert r["smem_kb"] <= 227 and r["stack"] == 0, r


def test_warp_specialised_kernel_chosen_for_hopper_only():
    """32 rows and more of a 16-bit cache, and every row count of an FP8 one (16, 32 or 64 rows a program, m-blocks
    of 64 above), in whole-tile pages take a Gluon kernel on an sm_90 GPU; everything else (16 rows of a 16-bit cache,
    CPU, the interpreter, page sizes that split a 64-key tile) the Triton kernel with its own tiles."""
    assert kernels.decode_config(128)["WS"] and kernels.decode_config(32)["WS"]
    assert not kernels.decode_config(16).get("WS")
    assert all(kernels.decode_config(rows, fp8=True)["WS"] for rows in (16, 32, 128))
    assert [kernels_fp8.block_rows(r) for r in (8, 16, 24, 32, 40, 64, 128)] == [16, 16, 32, 32, 64, 64, 64]
    cache = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    assert not kernels_ws.supported(cache) and not kernels._ws_supported(cache)
    assert not kernels_fp8.supported(cache.to(torch.float8_e4m3fn))
    cfg, ws, m_blocks, *_ = kernels.decode_plan((1, 1, 128), cache, 8192)
    assert not ws and cfg["BLOCK_M"] == 64 and m_blocks == 2


@pytest.mark.parametrize("lens,block_n,slots,min_tiles,base,wave", [
    ([32768] + [1024] * 31, 32, 132, 8, None, None),  # one long sequence among short ones: 64 chunks of 512 keys
    ([8192] + [512] * 127, 32, 132, 8, None, None),  # four spare slots: the long one in 5 chunks
    ([8192] + [512] * 127, 32, 264, 8, 132, None),  # … with a second wave: 16 chunks of 512 keys (busiest 32 tiles)
    ([1024] * 32, 32, 132, 8, None, None),  # uniform: 4 chunks each, as the static split gave
    ([1024] * 128, 32, 264, 8, 132, None),  # uniform with a second wave: a tie (2 × 16 tiles), so one wave of 32
    ([1024] * 70, 32, 264, 8, 132, None),  # uniform, 70 on 132: 3 chunks of 11 tiles, two a slot, cost more than 32
    ([8192] * 70, 32, 264, 8, 132, None),  # … but not 3 chunks of 86: 2 · 86 + 16 < 256
    ([32768] + [1024] * 31, 32, 264, 8, 132, None),  # a tie again: one wave
    ([512] * 5, 32, 8, 16, None, None),  # uniform, one chunk each: no merge, three spare slots
    ([700] * 300, 16, 900, 1, None, None),  # uniform over several blocks of slots and sequences: 3 chunks each
    ([0, 1, 0, 77, 5000, 64, 65, 3000, 1, 2], 64, 40, 1, None, None),  # empty and one-key sequences: one chunk
    ([37], 16, 7, 1, None, None),
    ([5000 + 997 * i % 4099 for i in range(300)], 64, 340, 4, None, None),  # more sequences than one SEQ_BLOCK
    ([20000] * 2 + [100] * 198, 16, 400, 1, 200, None),  # a second wave past SEQ_BLOCK slots (through the table)
    ([70000, 3], 16, 4, 1, None, None),  # a wide search range (4375 tiles)
    ([300000, 10], 16, 300, 1, None, None),  # ≥ 256 chunks wanted: MAX_CHUNKS keeps c ≥ 74 tiles
    ([1 << 24, 1 << 20, 3], 1, 4, 1, None, None),  # a 12M-tile search range (6 rounds): c = 8M
    ([4096] * 8 + [256] * 120, 64, 198, 4, 132, 66),  # the Gluon plan at 128 heads: 66 slots at once, 2 waves + 1
    ([1024] * 128, 64, 198, 4, 132, 66),  # … uniform: the base
    ([8192] + [512] * 127, 64, 198, 4, 132, 66),  # … a third wave of 8-tile chunks would cost more: the base
    ([8192] * 133, 64, 396, 4, 264, 132),  # … 132 + 1 sequences: 2 chunks each over three waves
])
def test_schedule(monkeypatch, lens, block_n, slots, min_tiles, base, wave):
    """The schedule kernel's table (every slot) and merge list against the plain-Python definition
    (schedule.split_schedule): the smallest chunk size that fits the slots (or, with an extra wave, that fits all
    of them where the busiest slot's work drops), chunks numbered in sequence order, every key of every sequence in
    exactly one chunk, spare slots marked −1, the sequences of several chunks listed in order. The table starts as
    garbage (torch.empty poisoned)."""
    monkeypatch.setattr(torch, "empty", nan_empty)
    sched = schedule.build_schedule(torch.tensor(lens, dtype=torch.int32), block_n, slots, min_tiles, base,
                                    wave)
    rows = sched[:schedule.ROW * slots].view(slots, schedule.ROW).tolist()
    merge = sched[schedule.ROW * slots:].tolist()
    c, ranges = schedule.split_schedule(lens, block_n, slots, min_tiles, base, wave)
    several = [(i, first, n) for i, (first, n) in enumerate(ranges) if n > 1]
    assert merge[0] == len(several) and merge[1:1 + 3 * len(several)] == [v for e in several for v in e]
    slot = 0
    for i, (first, n) in enumerate(ranges):
        assert first == slot
        for j in range(n):
            start = j * c * block_n
            assert rows[slot] == [i, lens[i], start, min(start + c * block_n, lens[i]), n, first], slot
            slot += 1
        assert n == 1 or (n - 1) * c * block_n < lens[i] <= n * c * block_n  # the chunks cover the sequence
    assert all(rows[s][0] == -1 for s in range(slot, slots))  # spare slots


@pytest.mark.parametrize("lens,block_n,programs,wave,min_tiles,ranges", [
    ([8192] + [512] * 127, 32, 132, 132, 8, True),  # a long sequence among short ones: ranges, 18 tiles a program
    ([1024] * 100, 32, 132, 132, 8, False),  # uniform, 32 tiles a sequence: chunks (a cut costs more than it saves)
    ([1024] * 256, 32, 264, 132, 8, False),  # more sequences than one wave: one chunk a program
    ([8192] * 70, 32, 132, 132, 8, True),  # 70 programs of 256 tiles, or 132 of 136: ranges
    ([100, 0, 3, 64, 65], 32, 8, 8, 1, False),  # an empty sequence; chunks of 2 tiles
    ([6000, 3, 17], 32, 4, 4, 8, True),  # the last program takes three pieces, two of them whole sequences
    ([1000], 32, 132, 132, 1, False),  # one sequence, 32 chunks of one tile
    ([0], 32, 1, 1, 1, False),  # one empty sequence, one program
    ([5000 + 997 * i % 4099 for i in range(300)], 64, 396, 132, 4, None),  # 300 sequences, 695 slots
    ([300000, 10] + [50] * 30, 16, 132, 132, 1, None),  # a long one: ≥ 74 tiles a chunk (≤ MAX_CHUNKS)
])
def test_program_schedule(monkeypatch, lens, block_n, programs, wave, min_tiles, ranges):
    """The schedule of a launch of programs (the Triton kernel's: chunks or ranges, chosen by the cost rule) against
    its plain-Python definition (schedule.program_split): every slot's row, spare slots −1, the merge list, and each
    program's row (its first slot, its count, that slot's row): a program's pieces are consecutive slots, every key
    of every sequence in exactly one piece. The table starts as garbage (torch.empty poisoned)."""
    monkeypatch.setattr(torch, "empty", nan_empty)
    batch = len(lens)
    slots = batch + programs - 1
    sched = schedule.build_schedule(torch.tensor(lens, dtype=torch.int32), block_n, slots, min_tiles, wave=wave,
                                    programs=programs)
    got_ranges, size, spans, pieces = schedule.program_split(lens, block_n, programs, min_tiles, wave)
    assert ranges is None or got_ranges == ranges
    rows = sched[:schedule.ROW * slots].view(slots, schedule.ROW).tolist()
    for k, (i, start, end, _) in enumerate(pieces):
        assert rows[k] == [i, lens[i], start, end, spans[i][1], spans[i][0]], k
    assert all(row[0] == -1 for row in rows[len(pieces):])
    for i, (first, n) in enumerate(spans):  # the pieces cover each sequence, in order
        keys = [(pieces[k][1], pieces[k][2]) for k in range(first, first + n)]
        assert keys[0][0] == 0 and keys[-1][1] == lens[i] and all(a[1] == b[0] for a, b in zip(keys, keys[1:]))
        assert n <= schedule.MAX_CHUNKS
    several = [(i, first, n) for i, (first, n) in enumerate(spans) if n > 1]
    merge = sched[schedule.ROW * slots:].tolist()
    assert merge[0] == len(several) and merge[1:1 + 3 * len(several)] == [v for e in several for v in e]
    prow = schedule.program_rows(sched, batch, slots).view(programs, schedule.PROGRAM_ROW).tolist()
    done = 0
    for p in range(programs):
        mine = [k for k, piece in enumerate(pieces) if piece[3] == p]
        assert prow[p][:2] == [done, len(mine)] and mine == list(range(done, done + len(mine))), p
        if mine:
            assert prow[p][2:] == rows[done]
        done += len(mine)
    assert done == len(pieces)
    if got_ranges:  # every program's range within L tiles
        tiles = [0] * programs
        for i, start, end, p in pieces:
            tiles[p] += -(-max(end - start, 1) // block_n)
        assert max(tiles) <= size


def test_program_cost_rule():
    """Chunks or ranges on an H100's launches (16 heads, 32-key tiles, min_tiles 8; 132 programs, 264 past 132
    sequences, two to an SM): ranges where some programs would take far more than the average (NOTES, issue 6,
    session r: 1 × 8k + 127 × 512 68 → 47 µs, 8 × 4k + 120 × 256 50 → 41, 70 × 8k 284 → 243, 250 random lengths
    559 → 417), chunks where the batch splits evenly (a cut costs its program a start, a partial and a merge) or DRAM
    sets the pace anyway."""
    def ranges(lens):
        programs = 132 if len(lens) <= 132 else 264
        return schedule.program_split(lens, 32, programs, 8, 132)[0]

    assert ranges([8192] + [512] * 127) and ranges([4096] * 8 + [256] * 120) and ranges([8192] * 70)
    assert ranges([16384] + [300] * 60 + [2000] * 20) and ranges([4096] * 100) and ranges([4096] * 200)
    assert ranges([1 + 977 * i % 8192 for i in range(250)])
    for lens in ([1024] * 128, [1024] * 100, [8192] * 32, [8192] * 128, [32768] + [1024] * 31, [1024], [8000] * 3,
                 [1024] * 200, [4096] * 64):
        assert not ranges(lens), lens


def test_extra_wave_never_taken_for_short_sequences():
    """The cost rule never takes the extra wave while no sequence is longer than SWITCH_TILES + 1 tiles (a slot's
    further chunk costs SWITCH_TILES on top of its keys), the bound decode_plan relies on to launch no extra wave for
    such contexts: a seeded search over uniform, skewed and random batches of 1–3 base waves; one tile more and it
    is taken."""
    rng = random.Random(6)
    bound = schedule.SWITCH_TILES + 1
    for _ in range(3000):
        wave = rng.choice([4, 8, 33, 66, 132])
        waves = rng.choice([1, 2, 3])
        batch = rng.randint((waves - 1) * wave + 1, waves * wave)
        longest = rng.randint(1, bound)
        kind = rng.random()
        if kind < 0.3:
            lens = [longest] * batch
        elif kind < 0.6:
            n_long = rng.randint(1, max(1, batch // 8))
            lens = [longest] * n_long + [rng.randint(0, longest // 4)] * (batch - n_long)
        else:
            lens = [longest] + [rng.randint(0, longest) for _ in range(batch - 1)]
        base = waves * wave
        c_base, _ = schedule.split_schedule(lens, 1, base, 1, base, wave)
        assert schedule.split_schedule(lens, 1, base + wave, 1, base, wave)[0] == c_base, (lens, base, wave)
    lens = [bound + 1] + [0] * 65
    assert schedule.split_schedule(lens, 1, 132, 1, 66, 66)[0] < schedule.split_schedule(lens, 1, 66, 1)[0]


def test_extra_wave_only_where_a_sequence_can_take_it(monkeypatch):
    """decode_plan launches the Gluon kernel's extra wave only for contexts longer than SWITCH_TILES + 1 key tiles
    (64 keys, 128 heads, an H100's 132 SMs); the 16-row Triton kernel launches its base slots as programs, with a
    slot for every piece they can make (batch + programs − 1), at every context."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: True)
    cache = torch.empty(1, 64, 576, dtype=torch.bfloat16)
    bound = schedule.SWITCH_TILES + 1
    for ctx, extra in ((bound * 64, False), (bound * 64 + 1, True), (8192, True)):
        plan = kernels.decode_plan((128, 1, 128), cache, ctx)
        assert plan.ws and plan.programs == 0 and (plan.slots > plan.base) == extra, (ctx, plan)
        plan = kernels.decode_plan((128, 1, 16), cache, ctx)
        assert not plan.ws and (plan.programs, plan.base, plan.slots) == (132, 132, 128 + 131), (ctx, plan)


@pytest.mark.parametrize("gluon,dram", [(False, 25.4), (True, 25.4), (False, 36.4)])
def test_uniform_batches_keep_the_heuristic_splits(monkeypatch, gluon, dram):
    """A uniform batch at max_context gets exactly decode_num_splits's chunks from the balanced schedule over the
    plan's base slots (132 SMs with an H100's DRAM GB/s per SM, and an H200's, where 16 rows may size the splits for
    two programs an SM; the Triton and the Gluon kernel's plans; 16 to 128 heads, 1–2 tokens, batch 1–256, contexts
    1–128k). Where the plan has an extra wave, the cost rule may take it instead (B=70 at 8k: 3 chunks each rather
    than 70 programs on 132 SMs; test_schedule)."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: dram)
    monkeypatch.setattr(kernels, "interpreting", lambda: not gluon)
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: gluon)
    cache = torch.empty(1, 64, 576, dtype=torch.bfloat16)
    for heads, n_new in ((16, 1), (16, 2), (64, 1), (128, 1), (128, 2)):
        for batch in (1, 3, 32, 33, 100, 128, 133, 256):
            for ctx in (1, 100, 300, 1000, 1024, 8000, 8192, 32768, 131072):
                plan = kernels.decode_plan((batch, n_new, heads), cache, ctx)
                block_n = plan.cfg["BLOCK_N"]
                chunk = -(-(-(-ctx // plan.splits)) // block_n) * block_n  # the static split's chunk (keys)
                c, ranges = schedule.split_schedule([ctx] * batch, block_n, plan.base, plan.min_tiles)
                assert ranges[0][1] == -(-ctx // chunk), (heads, n_new, batch, ctx)


@pytest.mark.parametrize("dram", [25.4, 36.4])
def test_small_batch_chunks_grow_with_the_context(monkeypatch, dram):
    """One or two sequences (132 SMs, an H100's and an H200's DRAM GB/s per SM, the Triton and the Gluon kernel's
    plans, 16, 16 × 2 and 128 heads): the static split's chunk never shrinks as the context grows (from 96 keys;
    below, the short-context splits of ≥ 32 keys): whole tiles do not undo a split count (a 16-head sequence of 1000
    keys gets 32 one-tile chunks, as one of 1024, not 16 of two), and no context between the small-batch rule and a
    full GPU gets fewer, longer chunks (20000 keys: 125 chunks of 5 tiles, not 70 of 9). The Gluon launch has no
    slot (or program, the few-rows kernel's launch of programs) past batch × ⌈tiles / min_tiles⌉ (no schedule fills
    one)."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: dram)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    cache = torch.empty(1, 64, 576, dtype=torch.bfloat16)
    for gluon in (False, True):
        monkeypatch.setattr(kernels, "_ws_supported", lambda cache: gluon)
        for heads, n_new in ((16, 1), (16, 2), (128, 1)):
            for batch in (1, 2):
                last = (0, 0)
                for ctx in list(range(96, 4096, 37)) + list(range(4096, 140000, 997)):
                    plan = kernels.decode_plan((batch, n_new, heads), cache, ctx)
                    tiles = -(-ctx // plan.cfg["BLOCK_N"])
                    c, _ = schedule.split_schedule([ctx] * batch, plan.cfg["BLOCK_N"], plan.base, plan.min_tiles)
                    keys = c * plan.cfg["BLOCK_N"]  # (in keys: 16 rows switch between 32- and 64-key tiles)
                    assert keys >= last[0], (gluon, heads, n_new, batch, last, ctx, keys)
                    last = (keys, ctx)
                    if plan.ws:
                        launched = plan.programs or plan.slots
                        assert launched <= batch * -(-tiles // plan.min_tiles), (heads, n_new, batch, ctx, plan)
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: False)
    plans = {ctx: kernels.decode_plan((1, 1, 16), cache, ctx) for ctx in (1000, 1024, 2000, 20000)}
    assert [(p.splits, p.min_tiles) for p in plans.values()] == [  # (the H100's small splits: ≥ 128 keys)
        (32, 1), (32, 1), (63, 1) if dram > 28 else (32, 2), (128, 5)]
    # up to one program an SM: B=3 8k 43 chunks of 6 tiles, not 32 of 8; B=32 1000 keys 4 of 8, not 3 of 11
    assert [kernels.decode_plan((b, 1, 16), cache, ctx).min_tiles for b, ctx in ((3, 8192), (32, 1000))] == [6, 8]
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: True)
    # 128 heads (two m-blocks a sequence): 63 chunks of two 64-key tiles at 8000 keys, not 42 of three; at 3000 keys
    # 24 of two, not one-tile chunks (7% slower); B=3 4k keeps 16 chunks of 4 tiles (22 of 3 were 6% slower)
    assert [kernels.decode_plan((b, 1, 128), cache, ctx).min_tiles
            for b, ctx in ((1, 8000), (1, 3000), (3, 4096))] == [2, 2, 4]


@pytest.mark.parametrize("dram", [36.4, 25.4])
def test_decode_routes_rows_to_their_gluon_kernel(monkeypatch, dram):
    """Where the Gluon kernels run (kernels recorded here, not run), mla_decode sends 16 rows (16 heads, or 8 × 2) to
    the few-rows kernel, 17–32 (12 × 2, 16 × 2, 32 heads) to the transposed seesaw and 128 heads to the 64-row
    blocks on a fast-DRAM Hopper (H200: 36.4 GB/s an SM), each with its plan's programs; on an H100 (25.4) 16 rows
    take the Triton kernel (not recorded) and 17–32 rows the 64-row blocks, on chunk slots."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: True)
    monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: dram)
    monkeypatch.setattr(kernels, "merge_partials", lambda *a, **k: None)
    calls = []
    monkeypatch.setattr(kernels_few, "mla_decode_few", lambda *a, programs, counters: calls.append(("few", programs)))
    monkeypatch.setattr(kernels_seesaw_t, "mla_decode_seesaw_t", lambda *a, programs: calls.append(("seesaw_t",
                                                                                                     programs)))
    monkeypatch.setattr(kernels_ws, "mla_decode_ws", lambda *a: calls.append(("ws", 0)))
    monkeypatch.setattr(kernels, "_mla_decode_kernel", None)  # the Triton kernel: not launched here
    cache = torch.zeros(128, 64, 576, dtype=torch.bfloat16)
    tables = torch.arange(128, dtype=torch.int32).repeat(32, 1)  # 32 sequences of 8000 keys, sharing the pages
    lens = torch.full((32,), 8000, dtype=torch.int32)
    want = {36.4: ["few", "few", "seesaw_t", "seesaw_t", "seesaw_t", "ws"],
            25.4: ["ws", "ws", "ws", "ws"]}[dram]
    shapes = ((1, 16), (2, 8), (2, 12), (2, 16), (1, 32), (1, 128)) if dram > 30 else ((2, 12), (2, 16), (1, 32),
                                                                                         (1, 128))
    for n_new, heads in shapes:
        q_nope = torch.zeros(32, n_new, heads, 512, dtype=torch.bfloat16)
        q_pe = torch.zeros(32, n_new, heads, 64, dtype=torch.bfloat16)
        plan = kernels.decode_plan((32, n_new, heads), cache, 8192)
        kernels.mla_decode(q_nope, q_pe, cache, None, tables, lens, SCALE, 0, 8192)
        assert calls[-1][1] == plan.programs and (plan.programs > 0) == (calls[-1][0] != "ws"), (n_new, heads, plan)
    assert [name for name, _ in calls] == want


@pytest.mark.parametrize("heads,n_new", [(16, 1), (8, 2)])
def test_few_rows_kernel_merges_in_the_kernel_at_short_contexts(monkeypatch, heads, n_new):
    """On a fast-DRAM Hopper the few-rows kernel (16 rows) merges a sequence's pieces in the kernel (zeroed counters
    passed, two a sequence; no merge kernel after it) where the plan's chunks and ranges cannot cut a sequence into
    more than FEW_FUSED_MAX_CHUNKS pieces (max_seqlen_k ≤ 1k), and leaves them to the merge kernel beyond (8k); the
    transposed seesaw (32 rows) always does. The bound itself: schedule.program_split (the schedule kernel's
    plain-Python twin, test_program_schedule) on the 1k plans never cuts a sequence of skewed batches into more
    pieces."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: True)
    monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: 36.4)
    merges, launches = [], []
    monkeypatch.setattr(kernels, "merge_partials", lambda *a, **k: merges.append(a))
    monkeypatch.setattr(kernels_few, "mla_decode_few", lambda *a, programs, counters: launches.append(counters))
    monkeypatch.setattr(kernels_seesaw_t, "mla_decode_seesaw_t", lambda *a, programs: launches.append("seesaw_t"))
    cache = torch.zeros(128, 64, 576, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    for batch, ctx, fused in ((128, 1024, True), (32, 1024, True), (100, 700, True), (32, 8192, False)):
        tables = torch.arange(128, dtype=torch.int32).repeat(batch, 1)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        q_nope = torch.zeros(batch, n_new, heads, 512, dtype=torch.bfloat16)
        q_pe = torch.zeros(batch, n_new, heads, 64, dtype=torch.bfloat16)
        plan = kernels.decode_plan((batch, n_new, heads), cache, ctx)
        assert plan.programs > 0, plan
        merges.clear()
        kernels.mla_decode(q_nope, q_pe, cache, None, tables, lens, SCALE, 0, ctx)
        counters = launches[-1]
        assert (counters is not None) == fused and (not merges) == fused, (batch, ctx)
        if fused:
            assert counters.dtype == torch.int32 and counters.numel() >= 2 * batch and not counters.any()
            for _ in range(20):  # skewed batches up to ctx: one long sequence among short ones, and random
                skewed = torch.randint(1, ctx + 1, (batch,), generator=g)
                skewed[torch.randint(batch, (1,), generator=g)] = ctx
                _, _, spans, _ = schedule.program_split(skewed.tolist(), 64, plan.programs, plan.min_tiles, plan.wave)
                assert max(n for _, n in spans) <= kernels.FEW_FUSED_MAX_CHUNKS, (batch, ctx, skewed.tolist())
    q = torch.zeros(128, 2, 16, 512, dtype=torch.bfloat16)  # 32 rows: the transposed seesaw, then the merge kernel
    merges.clear()
    kernels.mla_decode(q, q[..., :64], cache, None, torch.arange(128, dtype=torch.int32).repeat(128, 1),
                       torch.full((128,), 1024, dtype=torch.int32), SCALE, 0, 1024)
    assert launches[-1] == "seesaw_t" and merges


def test_two_programs_an_sm_where_dram_outruns_one(monkeypatch):
    """Where the Gluon kernels cannot run, 16 rows size their splits for two programs an SM on a GPU with an H200's
    DRAM GB/s per SM (36.4), where the GPU, not the keys, sets the split count at two (B=32 8k, B=128 1k / 8k /
    32k); where keys set it the plan stays at one program an SM, and small batches there cut their splits down to 32
    keys instead of 128 (B=1 4k / 8k: 128 splits, B=2 4k: 66, B=4 4k: 33; not B=4 4k at two an SM). On an H100's
    25.4, and for 16 × 2 and 128 heads (with the Gluon kernels too), the plans are the one-program-an-SM plans with
    128-key small splits (16 × 2 as a launch of programs on the fast GPU: the transposed seesaw)."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: False)
    cache = torch.empty(1, 64, 576, dtype=torch.bfloat16)
    shapes = ((32, 8192), (128, 1024), (128, 8192), (128, 32768), (32, 1024), (1, 1024), (1, 32768), (1, 4096),
              (1, 8192), (2, 4096), (4, 4096))

    def plans(dram, heads=16, n_new=1):
        monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: dram)
        return [kernels.decode_plan((batch, n_new, heads), cache, ctx) for batch, ctx in shapes]

    slow, fast = plans(25.4), plans(36.4)
    assert [p.splits for p in slow] == [4, 1, 1, 1, 4, 32, 128, 32, 64, 32, 32]
    assert [p.splits for p in fast] == [8, 2, 2, 2, 4, 32, 128, 128, 128, 66, 33]
    assert [p.wave for p in fast] == [264] * 4 + [132] * 7 and all(p.wave == 132 for p in slow)
    assert fast[4:7] == slow[4:7]
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: True)
    assert plans(36.4, 128, 1) == plans(25.4, 128, 1)
    # 16 × 2: the same chunks, which the transposed seesaw takes as a launch of programs (kernels_ws.py as slots)
    fast, slow = plans(36.4, 16, 2), plans(25.4, 16, 2)
    assert [(p.splits, p.base, p.wave, p.min_tiles) for p in fast] == [(p.splits, p.base, p.wave, p.min_tiles)
                                                                       for p in slow]
    assert all(p.programs == p.base for p in fast) and not any(p.programs for p in slow)


def test_few_rows_kernel_where_dram_outruns_the_triton_kernel(monkeypatch):
    """On a Hopper GPU with an H200's DRAM GB/s per SM, 16 rows of a 16-bit cache take the few-rows Gluon kernel's
    plan (64-key tiles, one program an SM, a launch of programs taking chunks or ranges) where its chunks are
    ≥ FEW_MIN_TILES tiles: B=32 8k 4 splits, B=128 at 1k–32k 1, B=32 1k 4, B=1 32k 128, B=8 4k 16, B=64 1k 2 (a
    batch whose programs and sequences outnumber the schedule's registers keeps one chunk a program, with the extra
    wave); one sequence of 1k, 4k,
    8k or 16k, B=2 / B=4 at 4k and B=3 8k keep the Triton kernel's finer splits; so do an H100 (25.4), the
    interpreter and a caller's num_splits that leaves chunks shorter than FEW_MIN_TILES. 16 × 2 rows and FP8 caches
    keep their own Gluon kernels."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: True)
    monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: 36.4)
    cache = torch.empty(1, 64, 576, dtype=torch.bfloat16)
    few = {(32, 8192): 4, (128, 1024): 1, (128, 8192): 1, (128, 32768): 1, (32, 1024): 4, (1, 32768): 128,
           (8, 4096): 16, (64, 1024): 2}
    for (batch, ctx), splits in few.items():
        plan = kernels.decode_plan((batch, 1, 16), cache, ctx)
        assert plan.ws and plan.cfg["BLOCK_N"] == 64 and plan.m_blocks == 1 and plan.splits == splits, (batch, plan)
        assert plan.wave == 132 and -(-(-(-ctx // 64)) // splits) >= kernels.FEW_MIN_TILES
        # one wave of programs, at least the heuristic's chunks
        assert batch * splits <= plan.programs <= 132 and plan.slots == batch + plan.programs - 1, (batch, plan)
        assert plan == kernels.decode_plan((batch, 1, 16), cache, ctx, config=dict(WS=True))
    plan = kernels.decode_plan((1000, 1, 16), cache, 8192)
    assert plan.ws and plan.programs == 0 and plan.slots == 1056 + 132  # 8 waves and the extra one
    for batch, ctx in ((1, 1024), (1, 4096), (1, 8192), (1, 16384), (2, 4096), (4, 4096), (3, 8192)):
        assert not kernels.decode_plan((batch, 1, 16), cache, ctx).ws, (batch, ctx)
    assert kernels.decode_plan((4, 1, 8), cache, 8192, num_splits=8).ws  # 8 rows: a block of 16
    assert not kernels.decode_plan((4, 1, 16), cache, 8192, num_splits=64).ws  # 2-tile chunks
    # 16 × 2 and FP8 caches: their own kernels (kernels_seesaw_t.py here, kernels_ws.py's 64-row blocks on an H100,
    # kernels_fp8.py)
    assert [bool(kernels.decode_config(rows, fp8).get("FAST_DRAM_FEW")) for rows, fp8 in (
        (8, False), (16, False), (32, False), (16, True))] == [True, True, False, False]
    assert [kernels.seesaw_t_rows(rows, cache) for rows in (24, 32, 64)] == [True, True, False]
    mtp, heads32 = (kernels.decode_plan(shape, cache, 8192) for shape in ((32, 2, 16), (32, 1, 32)))
    assert mtp.ws and mtp == heads32 and mtp.programs == 132 and mtp.slots == 32 + 132 - 1, mtp
    assert kernels.decode_plan((4, 2, 16), cache, 8192, num_splits=4).programs == 0  # a caller's chunks: slots
    monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: 25.4)
    assert not kernels.decode_plan((32, 1, 16), cache, 8192).ws
    assert not kernels.seesaw_t_rows(32, cache) and kernels.decode_plan((32, 2, 16), cache, 8192).programs == 0
    monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: 36.4)
    monkeypatch.setattr(kernels, "interpreting", lambda: True)
    assert not kernels.decode_plan((32, 1, 16), cache, 8192).ws


def test_decode_two_programs_an_sm(monkeypatch):
    """The two-programs-an-SM plan of a fast-DRAM GPU runs right: 4 SMs, 4 sequences of 513–700 keys take two
    splits each (one on a slow-DRAM GPU), merged inside the kernel; NaN-poisoned outputs and partials, NaN past each
    end, two calls."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 4)
    monkeypatch.setattr(torch, "empty", nan_empty)
    lens = [600, 530, 513, 700]
    q_nope, q_pe, cache, _, tables, seq_lens = _setup(lens, heads=16, n_new=1, page=64)
    _nan_past_ends(cache, tables, lens, 64)
    assert kernels.decode_plan((4, 1, 16), cache, 700).splits == 1
    monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: 36.4)
    assert kernels.decode_plan((4, 1, 16), cache, 700).splits == 2
    _check_two_calls(lambda: mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, max_seqlen_k=700),
                     q_nope, q_pe, cache, tables, seq_lens)


@pytest.mark.parametrize("length,max_len,slow_plan,fast_plan", [(2040, 2048, (32, 2), (64, 1)),
                                                                  (1990, 2000, (32, 2), (63, 1))])
def test_decode_small_batch_fast_dram_splits(monkeypatch, length, max_len, slow_plan, fast_plan):
    """The small-batch plan of a fast-DRAM GPU runs right: on 64 SMs one sequence of 2040 keys (up to 2048) takes 64
    chunks of one 32-key tile (32 of two on a slow-DRAM GPU), of 1990 keys (up to 2000: 62 splits, which whole
    tiles would make 32 chunks of two) 63; merged after the kernel; NaN-poisoned outputs and partials, NaN past the
    end, two calls."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 64)
    monkeypatch.setattr(torch, "empty", nan_empty)
    lens = [length]
    q_nope, q_pe, cache, _, tables, seq_lens = _setup(lens, heads=16, n_new=1, page=64)
    _nan_past_ends(cache, tables, lens, 64)
    plan = kernels.decode_plan((1, 1, 16), cache, max_len)
    assert (plan.splits, plan.min_tiles) == slow_plan
    monkeypatch.setattr(kernels, "dram_gbps_per_sm", lambda device: 36.4)
    plan = kernels.decode_plan((1, 1, 16), cache, max_len)
    assert (plan.splits, plan.min_tiles) == fast_plan
    _check_two_calls(lambda: mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, max_seqlen_k=max_len),
                     q_nope, q_pe, cache, tables, seq_lens)


def test_decode_fills_one_program_an_sm(monkeypatch):
    """Where 256-key splits would leave SMs idle (2 sequences × 2 splits on 8 SMs) the plan takes up to one program an
    SM: 4 chunks of 6 tiles a sequence instead of 2 of 11, and they run right; uneven lengths, NaN-poisoned outputs
    and partials, NaN past each end, two calls."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 8)
    monkeypatch.setattr(torch, "empty", nan_empty)
    lens = [700, 613]
    q_nope, q_pe, cache, _, tables, seq_lens = _setup(lens, heads=16, n_new=1, page=64)
    _nan_past_ends(cache, tables, lens, 64)
    plan = kernels.decode_plan((2, 1, 16), cache, 700)
    assert (plan.splits, plan.min_tiles) == (4, 6)
    _check_two_calls(lambda: mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, max_seqlen_k=700),
                     q_nope, q_pe, cache, tables, seq_lens)


@pytest.mark.parametrize("heads,n_new,lens,ranges,pieces", [
    (16, 1, [600, 3, 17, 0, 45], False, [3, 1, 1, 1, 1]), (16, 2, [600, 3, 17, 0, 45], False, [3, 1, 1, 1, 1]),
    (128, 1, [600, 3, 17, 0, 45], False, [2, 1, 1, 1, 1]),
    (16, 1, [6000, 3, 17], True, [4, 1, 1]),  # ranges: the last program takes the long one's end and both others
])
def test_decode_skewed_batch(monkeypatch, heads, n_new, lens, ranges, pieces):
    """The default launch on a skewed batch (a 4-SM GPU: the heuristic's slots as programs, 8 for 5 sequences, 6 at
    two m-blocks, 4 for 3), with the step's schedule made once and used by two calls: chunks where the long
    sequence's fit the spare programs (several chunks, merged; the others one each, written without a merge), ranges
    where the busiest program's work drops (pieces across sequence ends, a program taking several); an empty
    sequence; outputs, partials and the schedule NaN-poisoned, cache rows past each end NaN; the merge counters
    are reset after each call."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 4)
    monkeypatch.setattr(torch, "empty", nan_empty)
    q_nope, q_pe, cache, _, tables, seq_lens = _setup(lens, heads=heads, n_new=n_new, page=64)
    _nan_past_ends(cache, tables, lens, 64)
    sched = mla_decode_schedule(cache, tables, seq_lens, num_heads=heads, q_per_seq=n_new, max_seqlen_k=max(lens))
    batch, block_n, slots, base, wave, min_tiles, programs = sched.plan
    assert programs == base and slots == batch + programs - 1
    got = schedule.program_split(lens, block_n, programs, min_tiles, wave)
    assert got[0] == ranges and [n for _, n in got[2]] == pieces
    if ranges:
        assert [p for *_, p in got[3]].count(programs - 1) == 3
    _check_two_calls(lambda: mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, max_seqlen_k=max(lens),
                                        schedule=sched), q_nope, q_pe, cache, tables, seq_lens)


@pytest.mark.parametrize("sms,lens,pieces", [
    (4, [6000, 3000, 1000], [3, 2, 1]), (4, [4000, 4000, 5], [2, 3, 1]), (8, [2000, 6000, 3000, 1000], [2, 5, 3, 1])])
def test_decode_merge_in_kernel_and_after(monkeypatch, sms, lens, pieces):
    """Skewed batches whose long sequences take more pieces (ranges) than the in-kernel merge takes (FUSED_MAX_CHUNKS
    = 2 here) and shorter ones fewer (16 rows): the decode kernel merges the short ones' partials, the merge kernel
    after it the long ones' (its programs by rank among those: the long one first, second in the merge list, or
    two of them); NaN-poisoned outputs, partials and schedule, NaN past each end, two calls (the counters reset)."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: sms)
    monkeypatch.setattr(kernels, "FUSED_MAX_CHUNKS", 2)
    monkeypatch.setattr(torch, "empty", nan_empty)
    merges = []
    merge = kernels.merge_partials
    monkeypatch.setattr(kernels, "merge_partials", lambda *a, **k: merges.append(a[7:]) or merge(*a, **k))
    q_nope, q_pe, cache, _, tables, seq_lens = _setup(lens, heads=16, n_new=1, page=64)
    _nan_past_ends(cache, tables, lens, 64)
    sched = mla_decode_schedule(cache, tables, seq_lens, num_heads=16, max_seqlen_k=max(lens))
    batch, block_n, slots, base, wave, min_tiles, programs = sched.plan
    got = schedule.program_split(lens, block_n, programs, min_tiles, wave)
    assert got[0] and [n for _, n in got[2]] == pieces
    _check_two_calls(lambda: mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, max_seqlen_k=max(lens),
                                        schedule=sched), q_nope, q_pe, cache, tables, seq_lens)
    assert merges and all(m[-1] == 3 for m in merges)


def test_decode_schedule_checks():
    """A schedule serves only calls of its own plan (a clear error otherwise, before any launch); one program per
    sequence needs no table; the reference path (CPU without the interpreter) ignores it."""
    q_nope, q_pe, cache, _, tables, seq_lens = _setup([70, 33], heads=16, n_new=1, page=16)
    sched = mla_decode_schedule(cache, tables, seq_lens, num_heads=16, max_seqlen_k=80)
    assert sched.table is not None and sched.plan[0] == 2
    with pytest.raises(ValueError, match="schedule was made for"):
        mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, max_seqlen_k=4000, schedule=sched)
    with pytest.raises(ValueError, match="schedule was made for"):
        mla_decode(q_nope.repeat(1, 1, 8, 1), q_pe.repeat(1, 1, 8, 1), cache, tables, seq_lens, scale=SCALE,
                   max_seqlen_k=80, schedule=sched)
    with pytest.raises(TypeError, match="schedule"):
        mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, max_seqlen_k=80, schedule=sched.table)
    with pytest.raises(ValueError, match="num_heads"):
        mla_decode_schedule(cache, tables, seq_lens, num_heads=0)
    with pytest.raises(TypeError, match="seq_lens"):
        mla_decode_schedule(cache, tables, seq_lens.float(), num_heads=16)
    one = mla_decode_schedule(cache, tables, seq_lens, num_heads=16, num_splits=1)
    assert one.table is None
    _check(q_nope, q_pe, cache, None, tables, seq_lens, num_splits=1, schedule=one)
    _check(q_nope, q_pe, cache, None, tables, seq_lens, max_seqlen_k=80, schedule=sched)


def test_gluon_plan_spare_slots(monkeypatch):
    """The Gluon kernel's launch (as on an H100: 132 SMs) rounds the slots up to whole waves of 66 programs (two
    m-blocks each), at several splits a sequence (128 heads B=32: 64 → 66) and at one (B=128: 128 → 132, and at 8k
    one wave more for skewed batches: 198; not where one split comes from a short context, B=4 × 16 keys, nor where
    no sequence can be long enough to take it, 1k). Where keys, not the GPU, set the split count, and for one
    sequence, exactly the static split's chunks (no schedule can cut more): B=4 × 16 keys 4; one sequence at 8k 64
    (splits of ≥ 128 keys), at 32k 64 (a wave of 66 splits, 512-key chunks), at 1k 16 one-tile chunks, at
    max_seqlen_k 0 one a sequence."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "_ws_supported", lambda cache: True)
    cache = torch.empty(1, 64, 576, dtype=torch.bfloat16)
    for batch, ctx, want_splits, want_slots in ((32, 1024, 2, (66, 66, 66)), (128, 1024, 1, (132, 132, 66)),
                                                (128, 8192, 1, (198, 132, 66)), (4, 16, 1, (4, 4, 66)),
                                                (1, 8192, 64, (64, 64, 66)), (1, 32768, 66, (64, 64, 66)),
                                                (1, 1024, 32, (16, 16, 66)), (1, 0, 1, (1, 1, 66)),
                                                (4, 0, 1, (4, 4, 66))):
        plan = kernels.decode_plan((batch, 1, 128), cache, ctx)
        assert plan.ws and plan.m_blocks == 2 and plan.programs == 0
        assert (plan.splits, (plan.slots, plan.base, plan.wave)) == (want_splits, want_slots)
    assert kernels.decode_plan((1, 2, 16), cache, 8192).splits == 64  # 32 rows (16 × 2): 128 keys a split
