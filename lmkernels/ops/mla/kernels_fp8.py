"""MLA decode over an FP8 (e4m3) latent cache on Hopper, written in Gluon: 16, 32 or 64 rows (heads × new tokens) a
program, m-blocks of 64 for more (128 heads).

Why: the Triton kernel (kernels.py) dequantises each value to fp32, scales it, rounds it to 16 bits and stages the
tile through shared memory again in each dot's layout, ~2.2x the work of a bf16 tile: FP8 ran at ~30% of copy,
slower per call than bf16 (benchmarks/NOTES.md, issue 6, sessions v and x). Here one program (an m-block of one
sequence and one chunk of its keys, the schedule of kernels_ws.py) has three partitions:
- a loader warp streams 64-key tiles by TMA into 2–3 stages (c_kv as 8 pieces of 64 columns, k_pe as 2 of 32);
- two consumer warpgroups, each converting half of a tile's columns (256 of c_kv, 32 of k_pe) to float16 in
  shared memory (e4m3 → f16 is exact; each value times scale / c, c the tile's largest scale, so nothing overflows
  f16; keys past the sequence end zeroed as bytes: the page may hold NaN there). Scores and P · V are computed
  transposed, Sᵀ = K · Qᵀ [64 keys, rows] (wgmma M is 64: the keys, not the 16–32 rows, fill it) and
  Oᵀ += Vᵀ · Pᵀ (A transposed). c is folded into the softmax scale and the accumulator's rescale (the accumulator
  holds O / c of the last tile). How the warpgroups share the rest:
  - up to 32 rows (_consumer_cols), by columns: each scores over its own columns, adds the other's partial scores
    through shared memory (one exchange a tile; both then run the same softmax) and multiplies its own copy of Pᵀ
    by its own columns, Oᵀ [256, rows];
  - 64 rows (_consumer_keys), by keys: each converts 32 keys of a tile (all columns) and scores all 64 rows
    against them untransposed, S [64 rows, 32 keys] (rows in wgmma's M: a row's max and sum stay inside a warp;
    transposed, they crossed the warps through shared memory each tile); the two exchange their partial row max
    (one wait) and P (a second), then each accumulates O [64, its 256 columns] over all 64 keys. So a tile is
    converted once for 64 heads, not once for each 32: beside q of 64 rows, the f16 tile and 2 e4m3 stages, the
    column split's score exchange would not fit (session y: 1.5–2x the 32-row blocks).
q is stored as f16 after a power-of-two scale per row (its largest value ≤ 2^14, undone in the softmax scale), so a
bf16 query of any range converts exactly; with f16 operands (exact from e4m3) and f16 P in [0, 1] this keeps more
precision than the Triton kernel's bf16 ones. Outputs, LSE and partials as kernels_ws.py. H100 against ours on a
bf16 cache (NOTES, issue 6, sessions x and y): 16 heads 1.04–1.33x, 16 × 2 rows 1.0x, 64 heads 1.05x, 128 heads
0.65–0.91x (compute-bound there: the conversion and the exchanges come on top of the same wgmma work); 1.6–3.5x the
Triton FP8 kernel.
Compiled kernels only (the interpreter cannot run Gluon): CPU tests run kernels.py; `lmkernels check` compares
this kernel with the reference on the GPU."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..._utils import gdc_launch_dependents, gdc_wait
from .kernels_ws import _add, _maximum, _slot_chunk, triton_ok
from .schedule import ROW

BLOCK_N = 64  # keys per tile: the M of the score wgmma
MAX_ROWS = 64  # rows (heads × new tokens) a program takes (more: m-blocks, each reading the tiles, from L2 after the
# first); q of 64 rows, the f16 tile and 2 e4m3 stages take 216 KB
MAX_COLS_ROWS = gl.constexpr(32)  # up to this many rows a program the warpgroups split the columns, above the keys
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
    """Tile t into stage t % NSTAGE: the 512 c_kv columns as 8 pieces of 64, then k_pe as two pieces of 32 (one for
    each consumer warpgroup), one barrier a stage."""
    NSTAGE: gl.constexpr = f8c.shape[0]
    BLOCK_N: gl.constexpr = f8c.shape[1]
    KV_LORA: gl.constexpr = f8c.shape[2]
    PE_HALF: gl.constexpr = f8p.shape[2]
    PIECE: gl.constexpr = 64
    desc = tma.make_tensor_descriptor(c_ptr, [n_rows, KV_LORA + 2 * PE_HALF], [stride_cr, 1], [BLOCK_N, PIECE],
                                      f8c.layout)
    desc_pe = tma.make_tensor_descriptor(c_ptr, [n_rows, KV_LORA + 2 * PE_HALF], [stride_cr, 1], [BLOCK_N, PE_HALF],
                                         f8p.layout)
    for t in range(n_tiles):
        s = t % NSTAGE
        n0 = start + t * BLOCK_N
        row0 = _tile_row(bt_row, n0, end, page_size)
        mbarrier.wait(empty.index(s), ((t // NSTAGE) & 1) ^ 1)  # fresh barriers count as released
        bar = ready.index(s)
        mbarrier.expect(bar, BLOCK_N * (KV_LORA + 2 * PE_HALF))
        for j in gl.static_range(KV_LORA // PIECE):
            tma.async_copy_global_to_shared(desc, [row0, PIECE * j], bar, f8c.index(s).slice(PIECE * j, PIECE, dim=1))
        for h in gl.static_range(2):
            tma.async_copy_global_to_shared(desc_pe, [row0, KV_LORA + PE_HALF * h], bar, f8p.index(2 * s + h))
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
def _dequant(x, ratio, keep, layout: gl.constexpr):
    """e4m3 bytes x (as int8) → f16 · ratio (per key); keys with keep == 0 (past the sequence end: the page may hold
    NaN there, and P = 0 times NaN is not 0) zeroed as bytes. Per 4 values one and, two cvt, two f16x2 multiplies
    (triton's own conversion also shuffled bytes, ~3 PRMT a pair)."""
    r = gl.full(x.shape, 1.0, gl.float16, layout) * ratio[:, None]
    k = gl.full(x.shape, 0, gl.int32, layout) + keep[:, None]
    return gl.inline_asm_elementwise(
        "{ .reg .b32 v; .reg .b16 lo, hi; and.b32 v, $2, $5; mov.b32 {lo, hi}, v; cvt.rn.f16x2.e4m3x2 $0, lo; "
        "cvt.rn.f16x2.e4m3x2 $1, hi; mul.rn.f16x2 $0, $0, $3; mul.rn.f16x2 $1, $1, $4; }",
        "=r,=r,r,r,r,r,r,r,r", [x, r, k], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _dequant_piece(src, dst, ratio, keep, layout: gl.constexpr):
    """An e4m3 piece in shared memory → dst as f16 · ratio (_dequant)."""
    dst.store(_dequant(src.load(layout).to(gl.int8, bitcast=True), ratio, keep, layout))


@gluon.jit
def _convert_half(f8c_s, f8p_s, kfc, kfp, sc, n0, end, HALF_IDX: gl.constexpr):
    """Warpgroup HALF_IDX's half of the e4m3 tile in stage f8c_s (c_kv columns [256 · HALF_IDX, +256); f8p_s: its
    half of k_pe) into the f16 tile kfc / kfp as value · scale / c, c the tile's largest scale (returned: the f16
    tile holds K / c). sc: the tile's scales (_tile_scales); keys past the end zeroed."""
    BLOCK_N: gl.constexpr = f8c_s.shape[0]
    HALF: gl.constexpr = f8c_s.shape[1] // 2
    GROUP: gl.constexpr = 128  # values a scale
    # 16 e4m3 (16 bytes) a thread, a warp's quarter on one 64-byte row piece (no bank conflicts); [64, 128] and
    # [64, 64] pieces alike
    dq: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    dq_pe: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # [64, 32]: the same keys a thread
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dq))
    big = gl.maximum(gl.maximum(gl.maximum(sc[0], sc[1]), gl.maximum(sc[2], sc[3])), sc[4])
    c = gl.reduce(big, 0, _maximum)
    c = gl.where(c > 0.0, c, 1.0)
    inv_c = 1.0 / c
    keep = gl.where(n0 + keys < end, -1, 0)
    # a scale group (128 columns) at a time: the compiler puts a barrier between stores into one buffer
    for g in gl.static_range(HALF_IDX * HALF // GROUP, (HALF_IDX + 1) * HALF // GROUP):
        _dequant_piece(f8c_s.slice(g * GROUP, GROUP, dim=1), kfc.slice(g * GROUP, GROUP, dim=1),
                       (sc[g] * inv_c).to(gl.float16), keep, dq)
    _dequant_piece(f8p_s, kfp, gl.convert_layout((sc[4] * inv_c).to(gl.float16), gl.SliceLayout(1, dq_pe)),
                   gl.convert_layout(keep, gl.SliceLayout(1, dq_pe)), dq_pe)
    return c


@gluon.jit
def _q_rows(q_args, row0, ROWS: gl.constexpr, HALF: gl.constexpr, PE_HALF: gl.constexpr):
    """For q rows row0 … row0 + ROWS (row r = new token r // heads, head r % heads) of sequence b64: (pointers to
    each row's q_lat and q_pe [ROWS, 1], which rows exist [ROWS, 1], column offsets of half of q_lat and of q_pe),
    in the blocked layout the q loads use."""
    qn_ptr, qp_ptr, b64, n_new, heads, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph = q_args
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
    row_ok = (r < n_new * heads)[:, None]
    d = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
    e = gl.arange(0, PE_HALF, layout=gl.SliceLayout(0, ld))
    qn_row = qn_ptr + b64 * stride_qnb + (r // heads)[:, None] * stride_qnt + (r % heads)[:, None] * stride_qnh
    qp_row = qp_ptr + b64 * stride_qpb + (r // heads)[:, None] * stride_qpt + (r % heads)[:, None] * stride_qph
    return qn_row, qp_row, row_ok, d, e


@gluon.jit
def _load_q(q_args, row0, q_smem, qp_own, qp_other, q_bar, HALF_IDX: gl.constexpr, ALL_COLUMNS: gl.constexpr):
    """q rows row0 … (row r = new token r // heads, head r % heads) as f16 · 2^k per row into shared memory (its
    largest value ≤ 2^14: the whole row is read). ALL_COLUMNS: all of q_lat, and q_pe's halves into qp_own (half
    HALF_IDX) and qp_other; else this warpgroup's half of q_lat and of q_pe (qp_own), then wait for the other
    warpgroup's half. Returns 2^-k per row (0-rows: 1)."""
    HALF: gl.constexpr = q_smem.shape[1] // 2
    PE_HALF: gl.constexpr = qp_own.shape[1]
    qn_row, qp_row, row_ok, d, e = _q_rows(q_args, row0, q_smem.shape[0], HALF, PE_HALF)
    own = gl.load(qn_row + HALF_IDX * HALF + d[None, :], mask=row_ok, other=0.0).to(gl.float32)
    other = gl.load(qn_row + (1 - HALF_IDX) * HALF + d[None, :], mask=row_ok, other=0.0).to(gl.float32)
    own_pe = gl.load(qp_row + HALF_IDX * PE_HALF + e[None, :], mask=row_ok, other=0.0).to(gl.float32)
    other_pe = gl.load(qp_row + (1 - HALF_IDX) * PE_HALF + e[None, :], mask=row_ok, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.maximum(gl.reduce(gl.abs(own), 1, _maximum), gl.reduce(gl.abs(other), 1, _maximum)),
                      gl.maximum(gl.reduce(gl.abs(own_pe), 1, _maximum), gl.reduce(gl.abs(other_pe), 1, _maximum)))
    k = gl.where(amax > 0.0, Q_MAX_EXP - gl.ceil(gl.log2(amax)), 0.0)
    q_smem.slice(HALF_IDX * HALF, HALF, dim=1).store((own * gl.exp2(k)[:, None]).to(gl.float16))
    qp_own.store((own_pe * gl.exp2(k)[:, None]).to(gl.float16))
    if ALL_COLUMNS:
        q_smem.slice((1 - HALF_IDX) * HALF, HALF, dim=1).store((other * gl.exp2(k)[:, None]).to(gl.float16))
        qp_other.store((other_pe * gl.exp2(k)[:, None]).to(gl.float16))
        fence_async_shared()
    else:
        fence_async_shared()
        mbarrier.arrive(q_bar)
        mbarrier.wait(q_bar, 0)
    return gl.exp2(-k)


@gluon.jit
def _softmax_t(st, m_i, l_k, n0, end, pos, offs_n, scale):
    """Online softmax of a transposed tile Sᵀ [keys, rows] in base 2 (scale: per row; keys past the end or after a
    row's own position masked): Pᵀ, the new row max, the per-key-slot sums and the old max's rescale factor."""
    kn = n0 + offs_n
    x = gl.where((kn[:, None] < end) & (kn[:, None] <= pos[None, :]), st * scale[None, :], float("-inf"))
    m_new = gl.maximum(m_i, gl.reduce(x, 0, _maximum))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(x - m_use[None, :])
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, l_k * alpha[None, :] + p, alpha


@gluon.jit
def _scores_exchanged(kc, kp, q_smem, qp, sx, x_full, x_free, ph, s_zero, HALF_IDX: gl.constexpr):
    """Sᵀ [keys, rows] of a tile over all 576 columns (the column-halves consumers): warpgroup HALF_IDX's over its
    256 c_kv columns of kc [keys, 512] and its k_pe half kp against q_smem [rows, 512] and qp, in two independent
    accumulation chains (pieces alternate: half the dependent wgmma latency), plus the other warpgroup's, exchanged
    through sx (x_full / x_free: each warpgroup's barriers, phase ph)."""
    HALF: gl.constexpr = kc.shape[1] // 2
    PIECE: gl.constexpr = 64  # columns a score wgmma
    st_a = s_zero
    st_b = s_zero
    for j in gl.static_range(HALF_IDX * HALF // PIECE, (HALF_IDX + 1) * HALF // PIECE, 2):
        st_a = warpgroup_mma(kc.slice(j * PIECE, PIECE, dim=1), q_smem.slice(j * PIECE, PIECE, dim=1).permute(
            (1, 0)), st_a, use_acc=j > HALF_IDX * HALF // PIECE, is_async=True)
        st_b = warpgroup_mma(kc.slice((j + 1) * PIECE, PIECE, dim=1), q_smem.slice(
            (j + 1) * PIECE, PIECE, dim=1).permute((1, 0)), st_b, use_acc=j > HALF_IDX * HALF // PIECE,
            is_async=True)
    st_a = warpgroup_mma(kp, qp.permute((1, 0)), st_a, is_async=True)
    st_a, st_b = warpgroup_mma_wait(num_outstanding=0, deps=(st_a, st_b))
    st = st_a + st_b
    mbarrier.wait(x_free.index(HALF_IDX), ph ^ 1)  # fresh barriers count as released
    sx.index(HALF_IDX).store(st)
    fence_async_shared()
    mbarrier.arrive(x_full.index(HALF_IDX))
    mbarrier.wait(x_full.index(1 - HALF_IDX), ph)
    st = st + sx.index(1 - HALF_IDX).load(s_zero.type.layout)
    mbarrier.arrive(x_free.index(1 - HALF_IDX))
    return st


@gluon.jit
def _consumer_cols(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale, HALF_IDX: gl.constexpr):
    """16 or 32 rows a program. Warpgroup HALF_IDX converts its half of each tile's c_kv and of its k_pe, computes
    the scores over those columns, adds the other warpgroup's through shared memory (both then hold the same Sᵀ
    and run the same softmax: no further exchange) and multiplies its own P copy by its own columns into its half
    of Oᵀ. So each warpgroup reads only the f16 columns it wrote, and a tile costs one exchange between them."""
    q_buf, qp_buf, f8c, f8p, kfc_buf, kfp_buf, pt_buf, sx = smem
    ready, empty, q_bar, x_full, x_free = bars
    start, end, n_tiles, seq_len, row0 = span
    n_new = q_args[3]
    heads = q_args[4]
    ROWS: gl.constexpr = q_buf.shape[1]
    NSTAGE: gl.constexpr = f8c.shape[0]
    BLOCK_N: gl.constexpr = f8c.shape[1]
    KV_LORA: gl.constexpr = f8c.shape[2]
    HALF: gl.constexpr = KV_LORA // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per row of q (a column of Sᵀ and Oᵀ)
    inv_qs = gl.convert_layout(_load_q(q_args, row0, q_buf.index(0), qp_buf.index(HALF_IDX), qp_buf.index(HALF_IDX),
                                       q_bar, HALF_IDX, False), col_layout)
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    pos = seq_len - n_new + (row0 + gl.arange(0, ROWS, layout=col_layout)) // heads  # causal among the new tokens
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=col_layout)
    l_k = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=s_layout)  # the softmax sums per key slot, summed at the end
    c_acc = gl.full([ROWS], 1.0, gl.float32, layout=col_layout)  # acc holds O / c_acc
    acc = gl.zeros([HALF, ROWS], gl.float32, layout=s_layout)
    s_zero = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=s_layout)
    # scales one tile ahead, the next tile's page row two ahead (two dependent loads)
    sc = _tile_scales(s_ptr, _tile_row(bt_row, start, end, page_size), start, end, keys)
    row_next = _tile_row(bt_row, start + BLOCK_N, end, page_size)
    for t in range(n_tiles):
        s = t % NSTAGE
        n0 = start + t * BLOCK_N
        sc_next = _tile_scales(s_ptr, row_next, n0 + BLOCK_N, end, keys)
        row_next = _tile_row(bt_row, n0 + 2 * BLOCK_N, end, page_size)
        mbarrier.wait(ready.index(s), (t // NSTAGE) & 1)
        # the f16 buffers indexed by z = 0, which the compiler cannot prove constant: otherwise it computes the
        # wgmma descriptors of these fixed buffers once before the loop and spills them
        z = n0 >> 31  # n0 ≥ 0
        kfc = kfc_buf.index(z)
        kfp = kfp_buf.index(2 * z + HALF_IDX)
        c = _convert_half(f8c.index(s), f8p.index(2 * s + HALF_IDX), kfc, kfp, sc, n0, end, HALF_IDX)
        mbarrier.arrive(empty.index(s))
        fence_async_shared()
        st = _scores_exchanged(kfc, kfp, q_buf.index(z), qp_buf.index(2 * z + HALF_IDX), sx, x_full, x_free, t & 1,
                               s_zero, HALF_IDX)
        p, m_i, l_k, alpha = _softmax_t(st, m_i, l_k, n0, end, pos, offs_n, c * qk_scale * inv_qs)
        pt = pt_buf.index(2 * z + HALF_IDX)
        pt.store(p.to(gl.float16))
        fence_async_shared()
        acc = acc * (alpha * c_acc / c)[None, :]
        c_acc = gl.full([ROWS], 1.0, gl.float32, layout=col_layout) * c
        acc = warpgroup_mma(kfc.slice(HALF_IDX * HALF, HALF, dim=1).permute((1, 0)), pt, acc, is_async=True)
        # waited here: left in flight into the next tile, ptxas serialised every wgmma of the kernel (C7515)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        sc = sc_next
    l_i = gl.reduce(l_k, 0, _add)
    # each warpgroup stages its half of o in the f16 columns it owns
    staging = kfc_buf.index(0)._reinterpret(gl.float16, [2, BLOCK_N, HALF], gl.SwizzledSharedLayout(
        vec=1, per_phase=1, max_phase=1, order=[1, 0])).index(HALF_IDX)
    _epilogue(acc, m_i, l_i, c_acc, out_args, row0, n_new * heads, staging, HALF_IDX * HALF, KV_LORA, HALF_IDX == 0)


@gluon.jit
def _convert_keys(f8c_s, f8p_s0, f8p_s1, kfc, kfp0, kfp1, sc, inv_c, keep):
    """Rows (keys) of an e4m3 tile, all 576 columns, into the f16 tile as value · scale / c (sc: their 5 scales in
    the conversion layout, keep: −1 for keys before the end, else 0). Every piece is loaded before the first store:
    stored group by group, the compiler put a barrier between groups (5 a tile) and the loads went one group at a
    time; this way −3 to −6% a call (H100, session y)."""
    dq: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    dq_pe: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    x0 = f8c_s.slice(0, 128, dim=1).load(dq).to(gl.int8, bitcast=True)
    x1 = f8c_s.slice(128, 128, dim=1).load(dq).to(gl.int8, bitcast=True)
    x2 = f8c_s.slice(256, 128, dim=1).load(dq).to(gl.int8, bitcast=True)
    x3 = f8c_s.slice(384, 128, dim=1).load(dq).to(gl.int8, bitcast=True)
    p0 = f8p_s0.load(dq_pe).to(gl.int8, bitcast=True)
    p1 = f8p_s1.load(dq_pe).to(gl.int8, bitcast=True)
    r = gl.convert_layout((sc[4] * inv_c).to(gl.float16), gl.SliceLayout(1, dq_pe))
    k = gl.convert_layout(keep, gl.SliceLayout(1, dq_pe))
    kfc.slice(0, 128, dim=1).store(_dequant(x0, (sc[0] * inv_c).to(gl.float16), keep, dq))
    kfc.slice(128, 128, dim=1).store(_dequant(x1, (sc[1] * inv_c).to(gl.float16), keep, dq))
    kfc.slice(256, 128, dim=1).store(_dequant(x2, (sc[2] * inv_c).to(gl.float16), keep, dq))
    kfc.slice(384, 128, dim=1).store(_dequant(x3, (sc[3] * inv_c).to(gl.float16), keep, dq))
    kfp0.store(_dequant(p0, r, k, dq_pe))
    kfp1.store(_dequant(p1, r, k, dq_pe))


@gluon.jit
def _consumer_keys(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale, HALF_IDX: gl.constexpr):
    """64 rows a program. Warpgroup HALF_IDX converts keys [32 · HALF_IDX, +32) of each tile (all columns),
    scores all 64 rows against them (S [64, 32], as kernels_ws: rows in wgmma's M), exchanges its partial row max
    with the other (one wait), writes its P [64, 32] and, after a second wait, accumulates O [64, its 256 columns]
    += P · V over both halves of the keys, the other's first: that wgmma done, the other may convert its next keys
    over them (its only reader besides their owner). k_pe is read only by its owner's scores."""
    q_buf, qp_buf, f8c, f8p, kfc_buf, kfp_buf, p_buf, xs = smem
    ready, empty, q_bar, m_bar, p_ready, free = bars
    start, end, n_tiles, seq_len, row0 = span
    n_new = q_args[3]
    heads = q_args[4]
    ROWS: gl.constexpr = q_buf.shape[1]  # 64
    NSTAGE: gl.constexpr = f8c.shape[0]
    BLOCK_N: gl.constexpr = f8c.shape[1]
    KEYS: gl.constexpr = BLOCK_N // 2  # a warpgroup's
    KV_LORA: gl.constexpr = f8c.shape[2]
    HALF: gl.constexpr = KV_LORA // 2
    PIECE: gl.constexpr = 64  # columns a score wgmma
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    OTHER: gl.constexpr = 1 - HALF_IDX
    # q: each warpgroup stores 32 rows (all columns), then both wait; 2^-k per row exchanged
    HALF_ROWS: gl.constexpr = ROWS // 2
    OWN_ROW0: gl.constexpr = HALF_IDX * HALF_ROWS
    inv_own = _load_q(q_args, row0 + OWN_ROW0, q_buf.index(0).slice(OWN_ROW0, HALF_ROWS, dim=0),
                      qp_buf.index(HALF_IDX).slice(OWN_ROW0, HALF_ROWS, dim=0),
                      qp_buf.index(OTHER).slice(OWN_ROW0, HALF_ROWS, dim=0), q_bar, HALF_IDX, True)
    xs.index(4).slice(OWN_ROW0, HALF_ROWS).store(inv_own)
    mbarrier.arrive(q_bar)
    mbarrier.wait(q_bar, 0)
    inv_qs = xs.index(4).load(row_layout)
    rows = row0 + gl.arange(0, ROWS, layout=row_layout)
    pos = seq_len - n_new + rows // heads  # causal among the new tokens
    offs_k = HALF_IDX * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    dq: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dq))  # the tile's, for c
    own_keys = HALF_IDX * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, dq))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
    c_acc = qk_scale * 0.0 + 1.0  # acc holds O / c_acc (c of the last tile)
    acc = gl.zeros([ROWS, HALF], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, KEYS], gl.float32, layout=s_layout)
    # scales one tile ahead (all 64 keys' for c, its own keys' for the conversion), the page row two ahead
    row_t = _tile_row(bt_row, start, end, page_size)
    sc = _tile_scales(s_ptr, row_t, start, end, keys)
    sc_own = _tile_scales(s_ptr, row_t, start, end, own_keys)
    row_next = _tile_row(bt_row, start + BLOCK_N, end, page_size)
    for t in range(n_tiles):
        s = t % NSTAGE
        n0 = start + t * BLOCK_N
        ph = t & 1
        sc_next = _tile_scales(s_ptr, row_next, n0 + BLOCK_N, end, keys)
        sc_own_next = _tile_scales(s_ptr, row_next, n0 + BLOCK_N, end, own_keys)
        row_next = _tile_row(bt_row, n0 + 2 * BLOCK_N, end, page_size)
        big = gl.maximum(gl.maximum(gl.maximum(sc[0], sc[1]), gl.maximum(sc[2], sc[3])), sc[4])
        c = gl.reduce(big, 0, _maximum)
        c = gl.where(c > 0.0, c, 1.0)
        mbarrier.wait(ready.index(s), (t // NSTAGE) & 1)
        z = n0 >> 31  # as in _consumer_cols
        kfc = kfc_buf.index(z)
        mbarrier.wait(free.index(HALF_IDX), ph ^ 1)  # the other's last P · V is past these keys' V
        f8c_s = f8c.index(s).slice(HALF_IDX * KEYS, KEYS, dim=0)
        _convert_keys(f8c_s, f8p.index(2 * s).slice(HALF_IDX * KEYS, KEYS, dim=0),
                      f8p.index(2 * s + 1).slice(HALF_IDX * KEYS, KEYS, dim=0),
                      kfc.slice(HALF_IDX * KEYS, KEYS, dim=0),
                      kfp_buf.index(2 * z).slice(HALF_IDX * KEYS, KEYS, dim=0),
                      kfp_buf.index(2 * z + 1).slice(HALF_IDX * KEYS, KEYS, dim=0), sc_own, 1.0 / c,
                      gl.where(n0 + own_keys < end, -1, 0))
        mbarrier.arrive(empty.index(s))
        fence_async_shared()
        kown = kfc.slice(HALF_IDX * KEYS, KEYS, dim=0)
        q_smem = q_buf.index(z)
        st_a = s_zero
        st_b = s_zero
        for j in gl.static_range(0, KV_LORA // PIECE, 2):
            st_a = warpgroup_mma(q_smem.slice(j * PIECE, PIECE, dim=1), kown.slice(j * PIECE, PIECE, dim=1).permute(
                (1, 0)), st_a, use_acc=j > 0, is_async=True)
            st_b = warpgroup_mma(q_smem.slice((j + 1) * PIECE, PIECE, dim=1), kown.slice(
                (j + 1) * PIECE, PIECE, dim=1).permute((1, 0)), st_b, use_acc=j > 0, is_async=True)
        st_a = warpgroup_mma(qp_buf.index(2 * z), kfp_buf.index(2 * z).slice(HALF_IDX * KEYS, KEYS, dim=0).permute(
            (1, 0)), st_a, is_async=True)
        st_b = warpgroup_mma(qp_buf.index(2 * z + 1), kfp_buf.index(2 * z + 1).slice(HALF_IDX * KEYS, KEYS,
                                                                                       dim=0).permute((1, 0)),
                             st_b, is_async=True)
        st_a, st_b = warpgroup_mma_wait(num_outstanding=0, deps=(st_a, st_b))
        kn = n0 + offs_k
        x = gl.where((kn[None, :] < end) & (kn[None, :] <= pos[:, None]),
                     (st_a + st_b) * (c * qk_scale * inv_qs)[:, None], float("-inf"))
        # the row max over both warpgroups' keys
        xs.index(HALF_IDX).store(gl.reduce(x, 1, _maximum))
        mbarrier.arrive(m_bar)
        mbarrier.wait(m_bar, ph)
        m_new = gl.maximum(m_i, gl.maximum(xs.index(0).load(row_layout), xs.index(1).load(row_layout)))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(x - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.reduce(p, 1, _add)
        m_i = m_new
        p_buf.index(2 * z + HALF_IDX).store(p.to(gl.float16))
        fence_async_shared()
        mbarrier.arrive(p_ready)
        mbarrier.wait(p_ready, ph)
        acc = acc * gl.convert_layout(alpha * (c_acc / c), o_row_layout)[:, None]
        c_acc = c
        acc = warpgroup_mma(p_buf.index(2 * z + OTHER), kfc.slice(OTHER * KEYS, KEYS, dim=0).slice(
            HALF_IDX * HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(free.index(OTHER))
        acc = warpgroup_mma(p_buf.index(2 * z + HALF_IDX), kfc.slice(HALF_IDX * KEYS, KEYS, dim=0).slice(
            HALF_IDX * HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # as in _consumer_cols
        sc = sc_next
        sc_own = sc_own_next
    # l: each warpgroup summed its own keys' P (both under the final max)
    xs.index(2 + HALF_IDX).store(l_i)
    mbarrier.arrive(p_ready)
    mbarrier.wait(p_ready, n_tiles & 1)
    l_i = xs.index(2).load(row_layout) + xs.index(3).load(row_layout)
    # o staged in an e4m3 stage (32 KB each): every tile is converted by now, and no load is pending
    staging = f8c.index(HALF_IDX)._reinterpret(gl.float16, [HALF, ROWS], gl.SwizzledSharedLayout(
        vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    _epilogue(acc, gl.convert_layout(m_i, o_row_layout), gl.convert_layout(l_i, o_row_layout), c_acc, out_args,
              row0, n_new * heads, staging, HALF_IDX * HALF, KV_LORA, HALF_IDX == 0, False)


@gluon.jit
def _consumer(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale, HALF_IDX: gl.constexpr):
    if smem[0].shape[1] > MAX_COLS_ROWS:
        _consumer_keys(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale, HALF_IDX)
    else:
        _consumer_cols(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale, HALF_IDX)


@gluon.jit
def _consumer_default(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale):
    _consumer(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale, 0)


@gluon.jit
def _consumer_worker(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale):
    _consumer(q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale, 1)


@gluon.jit
def _epilogue(acc, m_i, l_i, c_acc, out_args, row0, rows, buf, col0, KV_LORA: gl.constexpr, LSE: gl.constexpr,
              TRANSPOSED: gl.constexpr = True):
    """o = c · acc / l for columns [col0, …) of rows row0 … (acc: Oᵀ [columns, rows], or O [rows, columns] where
    not TRANSPOSED) through shared memory (buf: at least [rows, columns] 16-bit) so that rows leave in 16-byte
    pieces; LSE: also the rows' LSE. Rows go to the final output (direct: the sequence's only chunk) or to the
    partials, as kernels_ws."""
    o_ptr, lse_ptr, po_ptr, pl_ptr, final_row0, part_row0, direct = out_args
    COLS: gl.constexpr = acc.shape[0] if TRANSPOSED else acc.shape[1]
    ROWS: gl.constexpr = acc.shape[1] if TRANSPOSED else acc.shape[0]
    o_dtype: gl.constexpr = o_ptr.dtype.element_ty
    VEC: gl.constexpr = 16 // (o_dtype.primitive_bitwidth // 8)
    empty_rows = l_i == 0.0
    l_safe = gl.where(empty_rows, 1.0, l_i)
    staged = buf._reinterpret(o_dtype, [ROWS, COLS], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                                              order=[1, 0]))
    if TRANSPOSED:
        staged.permute((1, 0)).store((acc * (c_acc / l_safe)[None, :]).to(o_dtype))
    else:
        staged.store((acc * (c_acc / l_safe)[:, None]).to(o_dtype))
    rows_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [4, 1], [1, 0])
    out = staged.load(rows_layout)
    o_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, rows_layout))
    o_cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, rows_layout))
    row_ok = (o_rows < rows)[:, None]
    gl.store(o_ptr + (final_row0 + o_rows)[:, None] * KV_LORA + o_cols[None, :], out, mask=row_ok & direct)
    gl.store(po_ptr + (part_row0 + o_rows)[:, None] * KV_LORA + o_cols[None, :], out.to(po_ptr.dtype.element_ty),
             mask=row_ok & (not direct))
    if LSE:
        r = row0 + gl.arange(0, ROWS, layout=m_i.type.layout)
        lse = gl.where(empty_rows, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
        gl.store(lse_ptr + final_row0 + r, lse, mask=(r < rows) & direct)
        gl.store(pl_ptr + part_row0 + r, lse, mask=(r < rows) & (not direct))


@gluon.jit
def _mla_decode_fp8_kernel(
    qn_ptr, qp_ptr, c_ptr, s_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, sched_ptr,
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
    m_block = gl.program_id(0)
    slot = gl.program_id(1)
    seq, seq_len, start, end, n, _ = _slot_chunk(sched_ptr, len_ptr, slot, SPLIT, SCHEDULE_ROW)
    direct = n == 1
    if seq < 0:  # a spare slot
        return
    b64 = seq.to(gl.int64)
    KEY_SPLIT: gl.constexpr = ROWS > MAX_COLS_ROWS  # _consumer_keys, else _consumer_cols
    f16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    f16_pe: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=ROPE, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.float16, [1, ROWS, KV_LORA], f16)  # [1, …]: see _consumer_cols's z
    qp_smem = gl.allocate_shared_memory(gl.float16, [2, ROWS, ROPE // 2], f16_pe)  # q_pe's halves
    f8c = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [NSTAGE, BLOCK_N, KV_LORA], gl.NVMMASharedLayout(
        swizzle_byte_width=64, element_bitwidth=8, rank=2))
    f8p = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [2 * NSTAGE, BLOCK_N, ROPE // 2], gl.NVMMASharedLayout(
        swizzle_byte_width=ROPE // 2, element_bitwidth=8, rank=2))
    kfc = gl.allocate_shared_memory(gl.float16, [1, BLOCK_N, KV_LORA], f16)
    kfp = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, ROPE // 2], f16_pe)
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGE):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both warpgroups convert their half
    mbarrier.init(q_bar, count=2)
    if KEY_SPLIT:  # each warpgroup's P [64 rows, its 32 keys], the row max and l exchange, 2^-k of q's rows
        pt = gl.allocate_shared_memory(gl.float16, [2, ROWS, BLOCK_N // 2], gl.NVMMASharedLayout(
            swizzle_byte_width=BLOCK_N, element_bitwidth=16, rank=2))
        sx = gl.allocate_shared_memory(gl.float32, [5, ROWS], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[0]))
        m_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(m_bar, count=2)
        mbarrier.init(p_ready, count=2)
        mbarrier.init(free.index(0), count=1)
        mbarrier.init(free.index(1), count=1)
        bars = (ready, empty, q_bar, m_bar, p_ready, free)
    else:  # each warpgroup's Pᵀ and partial Sᵀ, and their barriers
        pt = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, ROWS], gl.NVMMASharedLayout(
            swizzle_byte_width=2 * ROWS, element_bitwidth=16, rank=2))
        sx = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, ROWS], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        x_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        x_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(x_full.index(i), count=1)
            mbarrier.init(x_free.index(i), count=1)
        bars = (ready, empty, q_bar, x_full, x_free)
    n_tiles = (gl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N
    bt_row = bt_ptr + b64 * stride_bt
    q_args = (qn_ptr, qp_ptr, b64, n_new, heads, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt,
              stride_qph)
    smem = (q_smem, qp_smem, f8c, f8p, kfc, kfp, pt, sx)
    rows = n_new * heads
    out_args = (o_ptr, lse_ptr, po_ptr, pl_ptr, b64 * rows, slot.to(gl.int64) * rows, direct)
    span = (start, end, n_tiles, seq_len, m_block * ROWS)
    args = (q_args, smem, bars, out_args, span, s_ptr, bt_row, page_size, qk_scale)
    gl.warp_specialize([
        (_consumer_default, args),
        (_consumer_worker, args),
        (_loader, (c_ptr, bt_row, f8c, f8p, ready, empty, start, end, n_tiles, n_rows, page_size, stride_cr,
                   LATE_TRIGGER)),
    ], [4, 1], [CONSUMER_REGS, 24])


# registers: 12 warps (two consumer warpgroups and the loader's, rounded up to a warpgroup) × MAXNREG fill the
# register file; the loader keeps 24, so each consumer warpgroup gets (3 · MAXNREG − 24) / 2 = 240 (as kernels_ws)
MAXNREG = 168
CONSUMER_REGS = gl.constexpr(240)


def stages(rows):
    """e4m3 tiles in flight (36 KB each): beside the f16 tile (72 KB), q and the exchange buffers, 3 fit at 16
    rows (215 KB), 2 at 32 (209 KB) and 64 (225 KB)."""
    return 3 if rows <= 16 else 2


def block_rows(rows):
    """Rows (heads × new tokens) a program takes: 16, 32 or 64 (more rows: m-blocks of 64)."""
    return min(MAX_ROWS, max(16, triton.next_power_of_2(rows)))


def supported(cache):
    """Hopper (sm_90), an e4m3 cache in pages holding whole key tiles, TMA-aligned, a checked triton."""
    return (cache.is_cuda and triton_ok() and torch.cuda.get_device_capability(cache.device) == (9, 0)
            and cache.dtype == torch.float8_e4m3fn and cache.shape[1] % BLOCK_N == 0 and cache.data_ptr() % 16 == 0)


def mla_decode_fp8(q_nope, q_pe, cache, cache_scales, block_tables, seq_lens, o, lse, part_o, part_l, sched,
                   qk_scale, slots, pdl=False, merge_pdl=False):
    """Launch over (m-blocks of block_rows rows, slots), as kernels_ws.mla_decode_ws."""
    batch, n_new, heads, _ = q_nope.shape
    block = block_rows(n_new * heads)
    _mla_decode_fp8_kernel[(triton.cdiv(n_new * heads, block), slots)](
        q_nope, q_pe, cache, cache_scales, block_tables, seq_lens, o, lse, part_o, part_l, sched,
        *q_nope.stride()[:3], *q_pe.stride()[:3], cache.stride(1), block_tables.stride(0),
        n_new, heads, cache.shape[1], cache.shape[0] * cache.shape[1], qk_scale,
        SPLIT=slots > batch, SCHEDULE_ROW=ROW, KV_LORA=512, ROPE=64, ROWS=block,
        BLOCK_N=BLOCK_N, NSTAGE=stages(block), USE_PDL=pdl, LATE_TRIGGER=merge_pdl, num_warps=4, maxnreg=MAXNREG,
        **({"launch_pdl": True} if pdl else {}),
    )
