"""MLA decode over an FP8 (e4m3) latent cache on Hopper, written in Gluon, for up to 32 rows (16 heads, one or two
new tokens): the memory-bound shapes, where an FP8 cache should halve the time of a bf16 one.

Why: the Triton kernel (kernels.py) dequantises each value to fp32, scales it, rounds it to 16 bits and stages the
tile through shared memory again in each dot's layout, ~2.2x the work of a bf16 tile: FP8 ran at ~30% of copy,
slower per call than bf16 (benchmarks/NOTES.md, issue 6, session v). Here:
- a loader warp streams 64-key tiles (9 TMA pieces of 64 e4m3 columns) into STAGES stages;
- one consumer warpgroup converts a tile to float16 in shared memory (e4m3 → f16 is exact, one cvt per two
  values) scaled by ratio = scale / c, c the tile's largest scale (ratios ≤ 1: no f16 overflow), then computes the
  scores transposed, Sᵀ = K · Qᵀ [64 keys, rows] (wgmma M is 64: keys, not the 16–32 rows, fill it), and
  Oᵀ += Vᵀ · Pᵀ [512, rows] from the same f16 tile (A operand transposed), with c folded into the softmax scale and
  into the accumulator's rescale (the accumulator holds O / c of the last tile);
- q is stored as f16 after a power-of-two scale per row (its largest value → ≤ 2^14, undone in the softmax scale),
  so a bf16 query of any range converts exactly (f16 keeps 11 significant bits, bf16 8).
f16 operands (exact from e4m3) keep more precision than the Triton kernel's bf16 ones; P is f16 in [0, 1].
Keys past the sequence end inside the last tile are zeroed in the f16 tile and their scales taken as 0 (the page
may hold NaN there). Outputs, LSE, partials and the schedule as kernels_ws.py (one program a chunk, whole rows).
Compiled kernels only (the interpreter cannot run Gluon): CPU tests run kernels.py; `lmkernels check` compares
this kernel with the reference on the GPU."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from ..._utils import gdc_launch_dependents, gdc_wait
from .kernels_ws import _add, _maximum, triton_ok
from .schedule import ROW
from triton.language.extra.cuda import globaltimer

BLOCK_N = 64  # keys per tile: the M of the score wgmma
STAGES = 3  # e4m3 tiles in flight (36 KB each); with the f16 tile (72 KB) and q, 205–225 KB of shared memory
MAX_ROWS = 32  # rows (heads × new tokens) one program takes: the Oᵀ accumulator is 512 × rows fp32
N_SCALES = gl.constexpr(5)  # scales a cache row: 4 for c_kv (128 values each), 1 for k_pe
Q_MAX_EXP = gl.constexpr(14.0)  # q rows scaled so that their largest |value| is ≤ 2^14 (f16 max 65504)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _tile_row(bt_row, n, end, page_size):
    """The cache row of key n (0 where n ≥ end: a tile past the chunk, never read)."""
    page = gl.load(bt_row + n // page_size, mask=n < end, other=0).to(gl.int32)
    return page * page_size + n % page_size


@gluon.jit
def _loader(c_ptr, bt_row, f8c, f8p, ready, empty, start, end, n_tiles, n_rows, page_size, stride_cr,
            LATE_TRIGGER: gl.constexpr):
    """Tile t into stage t % STAGES: the 512 c_kv columns as 8 pieces of 64, then k_pe, one barrier a stage."""
    NSTAGE: gl.constexpr = f8c.shape[0]
    BLOCK_N: gl.constexpr = f8c.shape[1]
    KV_LORA: gl.constexpr = f8c.shape[2]
    ROPE: gl.constexpr = f8p.shape[2]
    desc = tma.make_tensor_descriptor(c_ptr, [n_rows, KV_LORA + ROPE], [stride_cr, 1], [BLOCK_N, ROPE], f8p.layout)
    for t in range(n_tiles):
        s = t % NSTAGE
        n0 = start + t * BLOCK_N
        row0 = _tile_row(bt_row, n0, end, page_size)
        mbarrier.wait(empty.index(s), ((t // NSTAGE) & 1) ^ 1)  # fresh barriers count as released
        bar = ready.index(s)
        mbarrier.expect(bar, BLOCK_N * (KV_LORA + ROPE))
        for j in gl.static_range(KV_LORA // ROPE):
            tma.async_copy_global_to_shared(desc, [row0, ROPE * j], bar, f8c.index(s).slice(ROPE * j, ROPE, dim=1))
        tma.async_copy_global_to_shared(desc, [row0, KV_LORA], bar, f8p.index(s))
    if LATE_TRIGGER:  # every load issued: the merge kernel after this one may launch
        gdc_launch_dependents()


@gluon.jit
def _tile_scales(s_ptr, row0, n0, end, keys):
    """The tile's 5 scales per key (0 past the end) in the dequantisation layout, as a tuple."""
    ok = n0 + keys < end
    base = s_ptr + (row0 + keys).to(gl.int64) * N_SCALES
    return (gl.load(base, mask=ok, other=0.0), gl.load(base + 1, mask=ok, other=0.0),
            gl.load(base + 2, mask=ok, other=0.0), gl.load(base + 3, mask=ok, other=0.0),
            gl.load(base + 4, mask=ok, other=0.0))


@gluon.jit
def _dequant_piece(src, dst, ratio, keep, layout: gl.constexpr):
    """e4m3 piece → f16 · ratio (per key); keys with keep == 0 (past the sequence end: the page may hold NaN there,
    and P = 0 times NaN is not 0) zeroed as bytes. Per 4 values one and, two cvt, two f16x2 multiplies (triton's own
    conversion also shuffled bytes, ~3 PRMT a pair)."""
    x = src.load(layout).to(gl.int8, bitcast=True)
    r = gl.full(x.shape, 1.0, gl.float16, layout) * ratio[:, None]
    k = gl.full(x.shape, 0, gl.int32, layout) + keep[:, None]
    y = gl.inline_asm_elementwise(
        "{ .reg .b32 v; .reg .b16 lo, hi; and.b32 v, $2, $5; mov.b32 {lo, hi}, v; cvt.rn.f16x2.e4m3x2 $0, lo; "
        "cvt.rn.f16x2.e4m3x2 $1, hi; mul.rn.f16x2 $0, $0, $3; mul.rn.f16x2 $1, $1, $4; }",
        "=r,=r,r,r,r,r,r,r,r", [x, r, k], dtype=gl.float16, is_pure=True, pack=4)
    dst.store(y)


@gluon.jit
def _load_q(qn_ptr, qp_ptr, q_smem, qp_smem, b64, n_new, heads, stride_qnb, stride_qnt, stride_qnh, stride_qpb,
            stride_qpt, stride_qph):
    """q rows (row r = new token r // heads, head r % heads) as f16 · 2^k per row into shared memory; returns
    2^-k per row (0-rows: 1)."""
    ROWS: gl.constexpr = q_smem.shape[0]
    KV_LORA: gl.constexpr = q_smem.shape[1]
    ROPE: gl.constexpr = qp_smem.shape[1]
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
    row_ok = (r < n_new * heads)[:, None]
    d = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, ld))
    e = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ld))
    qn = gl.load(qn_ptr + b64 * stride_qnb + (r // heads)[:, None] * stride_qnt + (r % heads)[:, None] * stride_qnh
                 + d[None, :], mask=row_ok, other=0.0).to(gl.float32)
    qp = gl.load(qp_ptr + b64 * stride_qpb + (r // heads)[:, None] * stride_qpt + (r % heads)[:, None] * stride_qph
                 + e[None, :], mask=row_ok, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.reduce(gl.abs(qn), 1, _maximum), gl.reduce(gl.abs(qp), 1, _maximum))
    k = gl.where(amax > 0.0, Q_MAX_EXP - gl.ceil(gl.log2(amax)), 0.0)
    q_smem.store((qn * gl.exp2(k)[:, None]).to(gl.float16))
    qp_smem.store((qp * gl.exp2(k)[:, None]).to(gl.float16))
    fence_async_shared()
    return gl.exp2(-k)


@gluon.jit
def _consumer(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale, tlp):
    T0 = globaltimer()
    d0 = T0 - T0
    d1 = d0
    d2 = d0
    d3 = d0
    d4 = d0
    d5 = d0
    qn_ptr, qp_ptr, b64, n_new, heads, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph = q_args
    q_buf, qp_buf, f8c, f8p, kfc_buf, kfp_buf, pt_buf = smem
    ready, empty = bars
    start, end, n_tiles, seq_len = span
    ROWS: gl.constexpr = q_buf.shape[1]
    NSTAGE: gl.constexpr = f8c.shape[0]
    BLOCK_N: gl.constexpr = f8c.shape[1]
    KV_LORA: gl.constexpr = f8c.shape[2]
    ROPE: gl.constexpr = f8p.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per row of q (a column of Sᵀ and Oᵀ)
    GROUP: gl.constexpr = 128  # values a scale
    dq: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # [64, 128]: 16 e4m3 (16 bytes) a thread
    dq_pe: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [64, 64], the same keys a thread
    inv_qs = gl.convert_layout(_load_q(qn_ptr, qp_ptr, q_buf.index(0), qp_buf.index(0), b64, n_new, heads, stride_qnb, stride_qnt,
                                       stride_qnh, stride_qpb, stride_qpt, stride_qph), col_layout)
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dq))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, ROWS, layout=col_layout)
    pos = seq_len - n_new + cols // heads  # causal among the new tokens
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=col_layout)
    l_k = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=s_layout)  # the softmax sums per key slot, summed at the end
    c_acc = gl.full([ROWS], 1.0, gl.float32, layout=col_layout)  # acc holds O / c_acc
    acc = warpgroup_mma_init(gl.zeros([KV_LORA, ROWS], gl.float32, layout=s_layout))  # carried as in flight
    s_zero = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=s_layout)
    # scales one tile ahead, the next tile's page row two ahead (two dependent loads)
    sc = _tile_scales(s_ptr, _tile_row(bt_row, start, end, page_size), start, end, keys)
    row_next = _tile_row(bt_row, start + BLOCK_N, end, page_size)
    for t in range(n_tiles):
        s = t % NSTAGE
        n0 = start + t * BLOCK_N
        sc_next = _tile_scales(s_ptr, row_next, n0 + BLOCK_N, end, keys)
        row_next = _tile_row(bt_row, n0 + 2 * BLOCK_N, end, page_size)
        big = gl.maximum(gl.maximum(gl.maximum(sc[0], sc[1]), gl.maximum(sc[2], sc[3])), sc[4])
        c = gl.reduce(big, 0, _maximum)
        c = gl.where(c > 0.0, c, 1.0)
        inv_c = 1.0 / c
        ta = globaltimer()
        mbarrier.wait(ready.index(s), (t // NSTAGE) & 1)
        tb = globaltimer()
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # the last tile's Pᵀ and f16 tile are free
        # the f16 buffers indexed by z = 0, which the compiler cannot prove constant: otherwise it computes the
        # ~100 wgmma descriptors of these fixed buffers once before the loop and spills them
        tc = globaltimer()
        z = n0 >> 31  # n0 ≥ 0
        kfc = kfc_buf.index(z)
        kfp = kfp_buf.index(z)
        keep = gl.where(n0 + keys < end, -1, 0)
        # a scale group (128 columns) at a time: the compiler puts a barrier between stores into one buffer
        for g in gl.static_range(KV_LORA // GROUP):
            _dequant_piece(f8c.index(s).slice(GROUP * g, GROUP, dim=1), kfc.slice(GROUP * g, GROUP, dim=1),
                           (sc[g] * inv_c).to(gl.float16), keep, dq)
        _dequant_piece(f8p.index(s), kfp, gl.convert_layout((sc[4] * inv_c).to(gl.float16), gl.SliceLayout(1, dq_pe)),
                       gl.convert_layout(keep, gl.SliceLayout(1, dq_pe)), dq_pe)
        mbarrier.arrive(empty.index(s))
        fence_async_shared()
        td = globaltimer()
        q_smem = q_buf.index(z)
        qp_smem = qp_buf.index(z)
        pt = pt_buf.index(z)
        st = warpgroup_mma(kfc.slice(0, ROPE, dim=1), q_smem.slice(0, ROPE, dim=1).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        for j in gl.static_range(1, KV_LORA // ROPE):
            st = warpgroup_mma(kfc.slice(ROPE * j, ROPE, dim=1), q_smem.slice(ROPE * j, ROPE, dim=1).permute((1, 0)),
                               st, is_async=True)
        st = warpgroup_mma(kfp, qp_smem.permute((1, 0)), st, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=0, deps=(st,))
        te = globaltimer()
        kn = n0 + offs_n
        x = gl.where((kn[:, None] < end) & (kn[:, None] <= pos[None, :]), st * (c * qk_scale * inv_qs)[None, :],
                     float("-inf"))
        m_new = gl.maximum(m_i, gl.reduce(x, 0, _maximum))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(x - m_use[None, :])
        alpha = gl.exp2(m_i - m_use)
        l_k = l_k * alpha[None, :] + p
        m_i = m_new
        pt.store(p.to(gl.float16))
        fence_async_shared()
        tf = globaltimer()
        acc = acc * (alpha * c_acc / c)[None, :]
        c_acc = gl.full([ROWS], 1.0, gl.float32, layout=col_layout) * c
        acc = warpgroup_mma(kfc.permute((1, 0)), pt, acc, is_async=True)
        sc = sc_next
        tg = globaltimer()
        d0 += tb - ta
        d1 += tc - tb
        d2 += td - tc
        d3 += te - td
        d4 += tf - te
        d5 += tg - tf
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    l_i = gl.reduce(l_k, 0, _add)
    _epilogue(acc, m_i, l_i, c_acc, out_args, n_new * heads, kfc_buf.index(0))
    gl.store(tlp, d0)
    gl.store(tlp + 1, d1)
    gl.store(tlp + 2, d2)
    gl.store(tlp + 3, d3)
    gl.store(tlp + 4, d4)
    gl.store(tlp + 5, d5)
    gl.store(tlp + 6, n_tiles.to(gl.int64))
    gl.store(tlp + 7, globaltimer() - T0)
    gl.store(tlp + 9, globaltimer())


@gluon.jit
def _epilogue(acc, m_i, l_i, c_acc, out_args, rows, buf):
    """o = c · acc / l (accᵀ), through shared memory (buf: the free f16 tile) so that rows leave in 16-byte pieces;
    LSE. Rows go to the final output (direct: the sequence's only chunk) or to the partials, as kernels_ws."""
    o_ptr, lse_ptr, po_ptr, pl_ptr, final_row0, part_row0, direct = out_args
    KV_LORA: gl.constexpr = acc.shape[0]
    ROWS: gl.constexpr = acc.shape[1]
    o_dtype: gl.constexpr = o_ptr.dtype.element_ty
    VEC: gl.constexpr = 16 // (o_dtype.primitive_bitwidth // 8)
    empty_rows = l_i == 0.0
    l_safe = gl.where(empty_rows, 1.0, l_i)
    out = (acc * (c_acc / l_safe)[None, :]).to(o_dtype)
    staged = buf._reinterpret(o_dtype, [ROWS, KV_LORA], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                                                  order=[1, 0]))
    staged.permute((1, 0)).store(out)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [4, 1], [1, 0])
    out = staged.load(rows_layout)
    o_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, rows_layout))
    o_cols = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, rows_layout))
    row_ok = (o_rows < rows)[:, None]
    gl.store(o_ptr + (final_row0 + o_rows)[:, None] * KV_LORA + o_cols[None, :], out, mask=row_ok & direct)
    gl.store(po_ptr + (part_row0 + o_rows)[:, None] * KV_LORA + o_cols[None, :], out.to(po_ptr.dtype.element_ty),
             mask=row_ok & (not direct))
    r = gl.arange(0, ROWS, layout=m_i.type.layout)
    lse = gl.where(empty_rows, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    gl.store(lse_ptr + final_row0 + r, lse, mask=(r < rows) & direct)
    gl.store(pl_ptr + part_row0 + r, lse, mask=(r < rows) & (not direct))


@gluon.jit
def _mla_decode_fp8_kernel(
    qn_ptr, qp_ptr, c_ptr, s_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, sched_ptr, tl_ptr,
    stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph, stride_cr, stride_bt,
    n_new, heads, page_size, n_rows, qk_scale,
    SPLIT: gl.constexpr, SCHEDULE_ROW: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, NSTAGE: gl.constexpr, USE_PDL: gl.constexpr = False,
    LATE_TRIGGER: gl.constexpr = False,
):
    if USE_PDL:  # as kernels._mla_decode_kernel
        gdc_wait()
        if not LATE_TRIGGER:
            gdc_launch_dependents()
    slot = gl.program_id(0)
    gl.store(tl_ptr + slot * 16 + 8, globaltimer())
    if SPLIT:  # as kernels._mla_decode_kernel: the slot's chunk, from its row of the schedule
        row = sched_ptr + slot * SCHEDULE_ROW
        seq = gl.load(row)
        seq_len = gl.load(row + 1)
        start = gl.load(row + 2)
        end = gl.load(row + 3)
        direct = gl.load(row + 4) == 1
        if seq < 0:  # a spare slot
            return
    else:
        seq = slot
        seq_len = gl.load(len_ptr + seq).to(gl.int32)
        start = 0
        end = seq_len
        direct = True
    b64 = seq.to(gl.int64)
    f8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    f16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * ROWS, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.float16, [1, ROWS, KV_LORA], f16)  # [1, …]: see _consumer's z
    qp_smem = gl.allocate_shared_memory(gl.float16, [1, ROWS, ROPE], f16)
    f8c = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [NSTAGE, BLOCK_N, KV_LORA], f8)
    f8p = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [NSTAGE, BLOCK_N, ROPE], f8)
    kfc = gl.allocate_shared_memory(gl.float16, [1, BLOCK_N, KV_LORA], f16)
    kfp = gl.allocate_shared_memory(gl.float16, [1, BLOCK_N, ROPE], f16)
    pt = gl.allocate_shared_memory(gl.float16, [1, BLOCK_N, ROWS], p16)
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGE):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    n_tiles = (gl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N
    bt_row = bt_ptr + b64 * stride_bt
    q_args = (qn_ptr, qp_ptr, b64, n_new, heads, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt,
              stride_qph)
    smem = (q_smem, qp_smem, f8c, f8p, kfc, kfp, pt)
    rows = n_new * heads
    out_args = (o_ptr, lse_ptr, po_ptr, pl_ptr, b64 * rows, slot.to(gl.int64) * rows, direct)
    span = (start, end, n_tiles, seq_len)
    gl.warp_specialize([
        (_consumer, (q_args, smem, (ready, empty), out_args, span, s_ptr, bt_row, page_size, qk_scale, tl_ptr + slot * 16)),
        (_loader, (c_ptr, bt_row, f8c, f8p, ready, empty, start, end, n_tiles, n_rows, page_size, stride_cr,
                   LATE_TRIGGER)),
    ], [1], [24])


def supported(cache, rows):
    """Hopper (sm_90), an e4m3 cache in pages holding whole key tiles, TMA-aligned, ≤ MAX_ROWS rows, a checked
    triton."""
    return (cache.is_cuda and triton_ok() and torch.cuda.get_device_capability(cache.device) == (9, 0)
            and cache.dtype == torch.float8_e4m3fn and rows <= MAX_ROWS
            and cache.shape[1] % BLOCK_N == 0 and cache.data_ptr() % 16 == 0)


def mla_decode_fp8(q_nope, q_pe, cache, cache_scales, block_tables, seq_lens, o, lse, part_o, part_l, sched,
                   qk_scale, slots, pdl=False, merge_pdl=False):
    """Launch over slots, as kernels_ws.mla_decode_ws (one m-block: all rows in one program)."""
    batch, n_new, heads, _ = q_nope.shape
    _mla_decode_fp8_kernel[(slots,)](
        q_nope, q_pe, cache, cache_scales, block_tables, seq_lens, o, lse, part_o, part_l, sched, TL_BUF,
        *q_nope.stride()[:3], *q_pe.stride()[:3], cache.stride(1), block_tables.stride(0),
        n_new, heads, cache.shape[1], cache.shape[0] * cache.shape[1], qk_scale,
        SPLIT=slots > batch, SCHEDULE_ROW=ROW, KV_LORA=512, ROPE=64, ROWS=max(16, triton.next_power_of_2(n_new * heads)),
        BLOCK_N=BLOCK_N, NSTAGE=STAGES, USE_PDL=pdl, LATE_TRIGGER=merge_pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )


TL_BUF = None
