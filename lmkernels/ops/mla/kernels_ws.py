"""Warp-specialised MLA decode on Hopper, written in Gluon: 64-row blocks (128 heads; 16 × 2 MTP rows padded
to 64 where kernels_seesaw_t.py does not take them: an H100, see kernels.seesaw_t_rows).

Why: with 64 rows the Triton kernel (kernels.py) is one 8-warp program per SM whose QK wgmma, softmax and PV
wgmma run one after the other, at 35–41% of the bf16 GEMM rate; Triton 3.6's own warp specialisation declines
that loop (benchmarks/NOTES.md, issue 6). Here one program (a 64-row block of one sequence and one split of its
keys) has three partitions sharing the shared memory, scheduled as the "seesaw" of FlashMLA's write-up
(docs/20250422-new-kernel-deep-dive.md in deepseek-ai/FlashMLA):
- two consumer warpgroups each own half of the 512 output columns (o_L, o_R: 64 × 256 fp32 in registers).
  Warpgroup 0 computes the scores S = [q_lat | q_pe] · [c_kv | k_pe]ᵀ of the even 64-key tiles, warpgroup 1 those
  of the odd ones (wgmma from shared memory), so each score is computed once. One online-softmax chain is handed
  back and forth through shared memory (the running max after each tile); P of a tile goes into that tile's k_pe
  slot, which its scores no longer need, and the other warpgroup multiplies it from there by its half of c_kv.
  While one runs its softmax, the other's wgmma has the tensor cores;
- a loader warp streams the tiles through TMA into two stages (stage 0: even tiles, 1: odd), each tile as nine
  64-column pieces with a ready barrier apiece (the score wgmma of a piece starts once it lands), one page-table
  read per tile (pages hold whole tiles: page_size % 64 == 0). A stage comes back in two parts: the half of c_kv
  its scoring warpgroup multiplies by P from registers, and the other half with the P slot once the other
  warpgroup is done with them; the loader refills in that order.
Keys past the sequence end inside the last tile are masked in S and their c_kv rows zeroed in shared memory
before P · c_kv (the page may hold anything there, NaN included). o leaves through q's shared memory (each
warpgroup its half, once both are past their last wgmma), so that whole rows are stored in 16-byte pieces.
Outputs, LSE and split partials follow kernels._mla_decode_kernel (SPLIT: partials for the merge kernel).
H100 against the duplicated-score kernel it replaces (session m): 128 heads +21–28% at 8k–32k, +20% at B=128 1k;
16 × 2 MTP rows (memory-bound) 1–2.5% slower, since a stage is held for a whole pair of tiles.
Compiled kernels only: the interpreter cannot run Gluon, so CPU tests run kernels.py and this kernel is checked
against the reference on the GPU (`lmkernels check`)."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..._utils import gdc_launch_dependents, gdc_wait, sm_count
from .schedule import ROW

BLOCK_M = 64
BLOCK_N = 64  # keys per tile, = the k_pe width: the k_pe slot takes P [BLOCK_M, BLOCK_N]
PIECES = gl.constexpr(9)  # a tile as 64-column pieces: c_kv 0–7, k_pe 8 (one TMA message and one ready barrier each)
T1_AFTER_PIECE = gl.constexpr(3)  # _loader's T1_AFTER_T0 (NOTES, issue 6: ap-2; piece 8 1.6–3% slower, aq-6)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _load_q(ctx, rows_args, HALF_IDX: gl.constexpr):
    """q rows (row r = new token r // heads, head r % heads) into shared memory where the loader cannot bring them
    (q not rows of one stride): this warpgroup's half of q_lat (warpgroup 0 also q_pe), all loads issued before the
    first store (one round trip), while the loader's first tiles are on their way; then wait for the other
    warpgroup's half."""
    q_args, q_bar, q_smem, qp_smem, kc, kp, ready, empty = ctx
    qn_ptr, qp_ptr, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph = q_args
    m_block, b64, n_new, heads = rows_args
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    HALF: gl.constexpr = q_smem.shape[1] // 2
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    d = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
    dh = HALF_IDX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
    row_ok = (r < n_new * heads)[:, None]
    qn = gl.load(qn_ptr + b64 * stride_qnb + (r // heads)[:, None] * stride_qnt + (r % heads)[:, None] * stride_qnh
                 + dh[None, :], mask=row_ok, other=0.0)
    if HALF_IDX == 0:
        qp_smem.store(gl.load(qp_ptr + b64 * stride_qpb + (r // heads)[:, None] * stride_qpt
                              + (r % heads)[:, None] * stride_qph + d[None, :], mask=row_ok, other=0.0))
    q_smem.slice(HALF_IDX * HALF, HALF, dim=1).store(qn)
    fence_async_shared()
    mbarrier.arrive(q_bar)
    mbarrier.wait(q_bar, 0)


@gluon.jit
def _maximum(a, b):
    """Reduction combiners of our own: gl.max and gl.sum wrap triton.language's, whose combiners become interpreter
    objects Gluon cannot call when TRITON_INTERPRET=1 (the CPU tests compile this kernel)."""
    return gl.maximum(a, b)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _tile_max(sc, m_i, n0, end, pos, offs_n, qk_scale, full_to):
    """The first half of _softmax's step: (scores masked where needed, the new reference max)."""
    if n0 + sc.shape[1] > full_to:
        kn = n0 + offs_n
        sc = gl.where((kn[None, :] < end) & (kn[None, :] <= pos[:, None]), sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.reduce(sc, 1, _maximum) * qk_scale)
    return sc, gl.where(m_new > m_i + 8.0, m_new, m_i)


@gluon.jit
def _tile_p(sc, m_i, m_new, qk_scale):
    """The second half: (P, α) under the new max m_new."""
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    return gl.exp2(sc * qk_scale - m_use[:, None]), gl.exp2(m_i - m_use)


@gluon.jit
def _softmax(sc, m_i, l_i, n0, end, pos, offs_n, qk_scale, full_to):
    """Online softmax step in base 2 (keys past the end or after a row's own position masked): P, the new row max
    and sum, and the factor that rescales what was accumulated under the old max. Only a tile with a key at or past
    full_to needs the mask (a uniform branch), and the scale goes into exp2's FMA (the max is taken on raw scores:
    the scale is positive). The max is lazy (FlashAttention-4's): a row keeps its reference max unless the new one
    exceeds it by more than 8, so P ≤ 256 (exact: o, l and the LSE all use the same reference) and α is 1 on most
    tiles, which _rescale skips. Together −1 to −6.5% on 128-head rows (NOTES, issue 6, ao-2). In two halves
    (_tile_max, _tile_p), so that warpgroup 0 can hand its max over before its exponentials."""
    sc, m_new = _tile_max(sc, m_i, n0, end, pos, offs_n, qk_scale, full_to)
    p, alpha = _tile_p(sc, m_i, m_new, qk_scale)
    return p, m_new, l_i * alpha + gl.reduce(p, 1, _add), alpha


# o · α for a thread's 128 accumulator values ($0–127 out, tied to $128–255 in; α per value $256–383): a vote over
# the warp and a branch around the multiplies. Elements 0–3 of a thread's m64 accumulator share hold both its rows.
_RESCALE_ASM = gl.constexpr(
    "{ .reg .pred p, q; setp.neu.f32 p, $256, 0f3F800000; setp.neu.or.f32 p, $257, 0f3F800000, p; "
    "setp.neu.or.f32 p, $258, 0f3F800000, p; setp.neu.or.f32 p, $259, 0f3F800000, p; "
    "vote.sync.any.pred q, p, 0xffffffff; @!q bra SKIP${:uid}; "
    + " ".join(f"mul.f32 ${i}, ${128 + i}, ${256 + i};" for i in range(128)) + " SKIP${:uid}: }")
_RESCALE_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 128 + [str(i) for i in range(128)] + ["r"] * 128))


@gluon.jit
def _rescale(acc, alpha, o_row_layout: gl.constexpr):
    """o · α, skipped by a warp where none of its 16 rows has α ≠ 1. A branch uniform over the program would need a
    cross-warp reduction (gl.reduce, or each thread reading all 64 α from shared memory), and either made the build
    spill 328–344 bytes (NOTES, issue 6, ao-2); so each warp votes and branches, in inline asm."""
    gl.static_assert(acc.shape[0] * acc.shape[1] == 128 * 128, "128 accumulator values a thread")
    a_b, acc_b = gl.broadcast(gl.convert_layout(alpha, o_row_layout)[:, None], acc)
    return gl.inline_asm_elementwise(_RESCALE_ASM, _RESCALE_CONSTRAINTS, [acc_b, a_b], dtype=gl.float32,
                                     is_pure=True, pack=128)


@gluon.jit
def _load_piece(desc, row, kc_s, kp_s, ready, s: gl.constexpr, j: gl.constexpr, nbytes):
    """Piece j of the tile at cache row `row` into stage s (c_kv columns [64 j, +64), or k_pe for j = 8)."""
    bar = ready.index(s * PIECES + j)
    mbarrier.expect(bar, nbytes)
    if j == 8:
        tma.async_copy_global_to_shared(desc, [row, kc_s.shape[1]], bar, kp_s)
    else:
        tma.async_copy_global_to_shared(desc, [row, 64 * j], bar, kc_s.slice(64 * j, 64, dim=1))


@gluon.jit
def _block_slot(m_blocks):
    """(m-block, slot) of this program. One grid axis, m-blocks fastest: the programs of a slot's m-blocks (which
    read the same tiles, the second from L2) launch next to each other. The same order on a 2-d grid was ~1% slower
    at 128 heads B=1 8k / 32k, B=4 4k and B=32 1k, and a slot's m-blocks 2–16 programs apart 0.3–1.5% slower again
    (NOTES, issue 6, aq-3, aq-4)."""
    return gl.program_id(0) % m_blocks, gl.program_id(0) // m_blocks


@gluon.jit
def _loader(c_ptr, bt_ptr, stride_bt, kc, kp, ready, empty, slot_args, n_rows, page_size, stride_cr,
            LATE_TRIGGER: gl.constexpr, SPLIT: gl.constexpr, SCHEDULE_ROW: gl.constexpr, T1_AFTER_T0: gl.constexpr,
            q_tma, Q_TMA: gl.constexpr):
    """Tile 2k into stage 0, 2k + 1 into stage 1, piece by piece in the order the consumers free them: a stage's
    own columns (the half its scoring warpgroup multiplies by P from registers) come back before its other columns
    and the k_pe slot (which holds P for the other warpgroup) in stage 0, after them in stage 1. empty[2 s]: own,
    empty[2 s + 1]: other. T1_AFTER_T0 (a launch of one wave, whose programs all start at once): the first pair's
    t1 only once t0's piece T1_AFTER_PIECE has landed, so that the start's burst of loads brings t0 first (H200,
    two pairs or fewer a program: −1.8 to −3.6%; level at four; +2% on a second wave's programs, which start while
    the others stream: NOTES, issue 6, ap-2). Q_TMA: q's 9 pieces too, right after the schedule row, so that no
    consumer loads it (8 warps' loads beside the loader's own slowed both at the start; made on the host, the q
    descriptors gain −2% at 128 heads B=1 32k, −1.9% at 128 × 2, −3.5% on a skewed batch; made here, their writes
    cost the short rows 1–4%: ap-6 to ap-9)."""
    BLOCK_N: gl.constexpr = kc.shape[1]
    KV_LORA: gl.constexpr = kc.shape[2]
    ROPE: gl.constexpr = kp.shape[2]
    desc = tma.make_tensor_descriptor(c_ptr, [n_rows, KV_LORA + ROPE], [stride_cr, 1], [BLOCK_N, 64], kp.layout)
    nbytes: gl.constexpr = BLOCK_N * 64 * c_ptr.dtype.element_ty.primitive_bitwidth // 8
    sched_ptr, len_ptr, m_blocks = slot_args
    m_block, slot = _block_slot(m_blocks)
    seq, seq_len, start, end, _, _ = _slot_chunk(sched_ptr, len_ptr, slot, SPLIT, SCHEDULE_ROW)
    if Q_TMA:  # q's rows as [B·Q·H, 512] and [B·Q·H, 64], descriptors made on the host
        q_desc, qp_desc, rows_per_seq, q_bar, q_smem, qp_smem = q_tma
        if seq >= 0:
            q_row = seq * rows_per_seq + m_block * q_smem.shape[0]
            mbarrier.expect(q_bar, 9 * nbytes)
            for j in gl.static_range(8):
                tma.async_copy_global_to_shared(q_desc, [q_row, 64 * j], q_bar, q_smem.slice(64 * j, 64, dim=1))
            tma.async_copy_global_to_shared(qp_desc, [q_row, 0], q_bar, qp_smem)
    n_tiles = gl.where(seq >= 0, (gl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N, 0)  # a spare slot: none
    bt_row = bt_ptr + gl.maximum(seq, 0).to(gl.int64) * stride_bt
    for k in range((n_tiles + 1) // 2):
        ph = (k & 1) ^ 1  # fresh barriers count as released
        n0 = start + 2 * k * BLOCK_N
        row0 = gl.load(bt_row + n0 // page_size).to(gl.int32) * page_size + n0 % page_size
        mbarrier.wait(empty.index(0), ph)  # stage 0 own: columns 0–255 (warpgroup 0's P · V)
        for j in gl.static_range(4):
            _load_piece(desc, row0, kc.index(0), kp.index(0), ready, 0, j, nbytes)
        mbarrier.wait(empty.index(1), ph)  # stage 0 other: columns 256–511 and the k_pe / P slot
        for j in gl.static_range(4, 9):
            _load_piece(desc, row0, kc.index(0), kp.index(0), ready, 0, j, nbytes)
        if 2 * k + 1 < n_tiles:
            n1 = n0 + BLOCK_N
            row1 = gl.load(bt_row + n1 // page_size).to(gl.int32) * page_size + n1 % page_size
            if T1_AFTER_T0:
                if k == 0:
                    mbarrier.wait(ready.index(T1_AFTER_PIECE), 0)
            mbarrier.wait(empty.index(3), ph)  # stage 1 other: columns 0–255 and the k_pe / P slot
            for j in gl.static_range(4):
                _load_piece(desc, row1, kc.index(1), kp.index(1), ready, 1, j, nbytes)
            _load_piece(desc, row1, kc.index(1), kp.index(1), ready, 1, 8, nbytes)
            mbarrier.wait(empty.index(2), ph)  # stage 1 own: columns 256–511 (warpgroup 1's P · V)
            for j in gl.static_range(4, 8):
                _load_piece(desc, row1, kc.index(1), kp.index(1), ready, 1, j, nbytes)
    if LATE_TRIGGER:  # every load issued: the kernel after this one (the merge) may launch
        gdc_launch_dependents()


@gluon.jit
def _qk_piece(sc, q_smem, qp_smem, kc_s, kp_s, ready, s: gl.constexpr, j: gl.constexpr, phase,
              FIRST: gl.constexpr, TRANSPOSED: gl.constexpr = False):
    """S += q · (piece j of the tile in stage s)ᵀ (c_kv columns [64 j, +64), or k_pe for j = 8), once it has
    landed; TRANSPOSED: Sᵀ += piece · qᵀ (kernels_seesaw_t.py)."""
    mbarrier.wait(ready.index(s * PIECES + j), phase)
    if j == 8:
        q = qp_smem
        k = kp_s
    else:
        q = q_smem.slice(64 * j, 64, dim=1)
        k = kc_s.slice(64 * j, 64, dim=1)
    if TRANSPOSED:
        sc = warpgroup_mma(k, q.permute((1, 0)), sc, use_acc=not FIRST, is_async=True)
    else:
        sc = warpgroup_mma(q, k.permute((1, 0)), sc, use_acc=not FIRST, is_async=True)
    return sc


@gluon.jit
def _scores(q_smem, qp_smem, kc, kp, ready, s: gl.constexpr, phase, s_zero, bar_q):
    """S of the tile in stage s, each piece's wgmma issued as soon as that piece has landed (pieces in the
    loader's order). Warpgroup 0 (stage 0) signals bar_q once its nine are issued: warpgroup 1 issues its tile's
    only then, so the tensor cores take t0's scores first and softmax 0 runs under t1's (−1% on most 128-head rows,
    −3% at 128 × 2 MTP, NOTES, issue 6, ao-4)."""
    if s == 0:
        sc = _qk_piece(s_zero, q_smem, qp_smem, kc.index(0), kp.index(0), ready, 0, 0, phase, True)
        for j in gl.static_range(1, 9):
            sc = _qk_piece(sc, q_smem, qp_smem, kc.index(0), kp.index(0), ready, 0, j, phase, False)
        mbarrier.arrive(bar_q)
    else:
        sc = _qk_piece(s_zero, q_smem, qp_smem, kc.index(1), kp.index(1), ready, 1, 0, phase, True)
        for j in gl.static_range(1, 4):
            sc = _qk_piece(sc, q_smem, qp_smem, kc.index(1), kp.index(1), ready, 1, j, phase, False)
        sc = _qk_piece(sc, q_smem, qp_smem, kc.index(1), kp.index(1), ready, 1, 8, phase, False)
        for j in gl.static_range(4, 8):
            sc = _qk_piece(sc, q_smem, qp_smem, kc.index(1), kp.index(1), ready, 1, j, phase, False)
    return warpgroup_mma_wait(num_outstanding=0, deps=(sc,))


@gluon.jit
def _zero_tail(v, n0, end):
    """Rows of v past the sequence end set to 0 (the page may hold NaN there; P is 0 but 0 · NaN is not)."""
    BLOCK_N: gl.constexpr = v.shape[0]
    if n0 + BLOCK_N > end:
        zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        zr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, zero_layout))
        for c in gl.static_range(v.shape[1] // 64):
            part = v.slice(c * 64, 64, dim=1)
            x = part.load(zero_layout)
            part.store(gl.where((n0 + zr < end)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()


@gluon.jit
def _consumer(ctx, out_args, slot_args, qk_scale, HALF_IDX: gl.constexpr, SPLIT: gl.constexpr,
              SCHEDULE_ROW: gl.constexpr, Q_TMA: gl.constexpr):
    """Warpgroup HALF_IDX owns output columns [HALF_IDX · 256, +256) and computes the scores of the tiles of
    stage HALF_IDX (warpgroup 0 the even tiles, 1 the odd ones). Per pair of tiles (t0, t1), with m the running
    max: 0 scores t0, its softmax from m gives m0 and P0 (P0 and m0 to shared memory, P0 into t0's k_pe slot),
    o_L = o_L · α0 + P0 · V0L; 1 scores t1, takes m0, its softmax gives m1 and P1 (P1 into t1's k_pe slot),
    o_R = (o_R · α0 + P0 · V0R) · α1 + P1 · V1R; 0 takes m1: o_L = o_L · α1 + P1 · V1L. One softmax chain, handed
    back and forth, while the other warpgroup's wgmma has the tensor cores. Each partition reads the program's slot
    itself (a spare slot: nothing to do), so the loader's first loads go out without waiting for the fork."""
    q_ctx, bar_m, sm, sl, bar_q, bar_p0 = ctx
    q_args, q_bar, q_smem, qp_smem, kc, kp, ready, empty = q_ctx
    o_ptr, lse_ptr, po_ptr, pl_ptr, n_new, heads = out_args
    sched_ptr, len_ptr, m_blocks = slot_args
    m_block, slot = _block_slot(m_blocks)
    seq, seq_len, start, end, n, _ = _slot_chunk(sched_ptr, len_ptr, slot, SPLIT, SCHEDULE_ROW)
    direct = n == 1
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    HALF: gl.constexpr = q_smem.shape[1] // 2
    BLOCK_N: gl.constexpr = kc.shape[1]
    dtype: gl.constexpr = kc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)  # P in registers
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    if seq >= 0:  # else a spare slot
        b64 = seq.to(gl.int64)
        rows_args = (m_block, b64, n_new, heads)
        n_tiles = (gl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N
        if Q_TMA:
            mbarrier.wait(q_ctx[1], 0)
        else:
            _load_q(q_ctx, rows_args, HALF_IDX)
        rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        pos = seq_len - n_new + rows // heads  # causal among the new tokens
        full_to = gl.minimum(end, seq_len - n_new + (m_block * BLOCK_M) // heads + 1)  # keys below: no row masks any
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
        acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        for k in range((n_tiles + 1) // 2):
            ph = k & 1
            n0 = start + 2 * k * BLOCK_N
            n1 = n0 + BLOCK_N
            has1 = 2 * k + 1 < n_tiles
            if HALF_IDX == 0:
                sc = _scores(q_smem, qp_smem, kc, kp, ready, 0, ph, s_zero, bar_q)
                # m0 handed over right after the max: warpgroup 1's softmax needs nothing else (plain loads: the
                # arrive's release orders the store); P0 goes to shared memory for warpgroup 1 only once this
                # warpgroup's own P0 · V0L is issued, with a barrier of its own (−0.3 to −1.2%, NOTES, issue 6, ap-1)
                sc, m0 = _tile_max(sc, m_i, n0, end, pos, offs_n, qk_scale, full_to)
                sm.slice(0, BLOCK_M).store(m0)
                mbarrier.arrive(bar_m.index(0))
                p, a0 = _tile_p(sc, m_i, m0, qk_scale)
                l_i = l_i * a0 + gl.reduce(p, 1, _add)
                p = p.to(dtype)
                acc = _rescale(acc, a0, o_row_layout)
                _zero_tail(kc.index(0).slice(0, HALF, dim=1), n0, end)
                acc = warpgroup_mma(gl.convert_layout(p, p_layout), kc.index(0).slice(0, HALF, dim=1), acc,
                                    is_async=True)
                kp.index(0).store(p)
                fence_async_shared()
                mbarrier.arrive(bar_p0)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(0))
                m_i = m0
                if has1:
                    mbarrier.wait(bar_m.index(1), ph)
                    m1 = sm.slice(BLOCK_M, BLOCK_M).load(row_layout)
                    a1 = gl.exp2(m0 - gl.where(m1 == float("-inf"), 0.0, m1))
                    l_i = l_i * a1
                    acc = _rescale(acc, a1, o_row_layout)
                    _zero_tail(kc.index(1).slice(0, HALF, dim=1), n1, end)
                    acc = warpgroup_mma(kp.index(1), kc.index(1).slice(0, HALF, dim=1), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index(3))
                    m_i = m1
            else:
                sc = s_zero
                if has1:
                    # t0's scores issued (warpgroup 0 arrives once a pair and cannot get two ahead: it needs m1)
                    mbarrier.wait(bar_q, ph)
                    sc = _scores(q_smem, qp_smem, kc, kp, ready, 1, ph, s_zero, bar_q)
                mbarrier.wait(bar_m.index(0), ph)
                m0 = sm.slice(0, BLOCK_M).load(row_layout)
                a0 = gl.exp2(m_i - gl.where(m0 == float("-inf"), 0.0, m0))
                l_i = l_i * a0
                m_i = m0
                p = s_zero
                a1 = gl.full([BLOCK_M], 1.0, gl.float32, layout=row_layout)
                if has1:
                    p, m_i, l_i, a1 = _softmax(sc, m0, l_i, n1, end, pos, offs_n, qk_scale, full_to)
                    kp.index(1).store(p.to(dtype))
                    sm.slice(BLOCK_M, BLOCK_M).store(m_i)
                    fence_async_shared()
                    mbarrier.arrive(bar_m.index(1))
                acc = _rescale(acc, a0, o_row_layout)
                _zero_tail(kc.index(0).slice(HALF, HALF, dim=1), n0, end)
                mbarrier.wait(bar_p0, ph)
                acc = warpgroup_mma(kp.index(0), kc.index(0).slice(HALF, HALF, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(1))
                if has1:
                    acc = _rescale(acc, a1, o_row_layout)
                    _zero_tail(kc.index(1).slice(HALF, HALF, dim=1), n1, end)
                    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), kc.index(1).slice(HALF, HALF, dim=1),
                                        acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index(2))
        # l: each warpgroup summed its own tiles' P (both under the final max): exchange through shared memory
        sl.slice(HALF_IDX * BLOCK_M, BLOCK_M).store(l_i)
        mbarrier.arrive(bar_m.index(2))
        mbarrier.wait(bar_m.index(2), 0)
        l_i = l_i + sl.slice((1 - HALF_IDX) * BLOCK_M, BLOCK_M).load(row_layout)
        # both warpgroups are past their last wgmma, so q is free: o goes out through this warpgroup's half of it
        rows_total = n_new * heads
        item_out = (o_ptr, lse_ptr, po_ptr, pl_ptr, b64 * rows_total, slot.to(gl.int64) * rows_total, direct)
        _epilogue(acc, m_i, l_i, item_out, rows_args, q_smem.slice(HALF_IDX * HALF, HALF, dim=1), HALF_IDX)


@gluon.jit
def _epilogue(acc, m_i, l_i, out_args, rows_args, buf, HALF_IDX: gl.constexpr):
    """o = acc / l for this warpgroup's columns, through shared memory (buf: [BLOCK_M, 256] of q's, free by now) so
    that each warp stores whole rows in 16-byte pieces: from the accumulator's registers a thread holds 2 columns of a
    row, and those 4- or 8-byte stores took 4–8 µs of a 1k call (H100, session m). Warpgroup 0 also stores the LSE.
    Rows go to the final output (final_row0: the sequence's first row; direct: its only chunk) or to the partials
    (part_row0: the slot's first row), both [rows, 512] / [rows] contiguous."""
    o_ptr, lse_ptr, po_ptr, pl_ptr, final_row0, part_row0, direct = out_args
    m_block, b64, n_new, heads = rows_args
    BLOCK_M: gl.constexpr = acc.shape[0]
    HALF: gl.constexpr = acc.shape[1]
    KV_LORA: gl.constexpr = 2 * HALF
    o_dtype: gl.constexpr = o_ptr.dtype.element_ty
    VEC: gl.constexpr = 16 // (o_dtype.primitive_bitwidth // 8)
    o_layout: gl.constexpr = acc.type.layout
    empty_rows = l_i == 0.0
    l_safe = gl.where(empty_rows, 1.0, l_i)
    # one reciprocal a row, then a multiply an element: a division an element was ~3 instructions each, 400 a lane
    # of this run-once code (NOTES, issue 6, session ak)
    out = (acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))[:, None]).to(o_dtype)
    gl.static_assert(buf.dtype == o_dtype, "o is staged in q's shared memory: same dtype")
    buf.store(out)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [4, 1], [1, 0])
    out = buf.load(rows_layout)
    o_rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))
    o_cols = HALF_IDX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, rows_layout))
    row_ok = (o_rows < n_new * heads)[:, None]
    # one store through the rows it goes to (two masked sets took 144 more instructions a lane: NOTES, issue 6, ak-9)
    gl.static_assert(po_ptr.dtype == o_ptr.dtype, "partials in o's dtype: one store through either")
    if direct:
        dst = o_ptr + final_row0 * KV_LORA
        dst_l = lse_ptr + final_row0
    else:
        dst = po_ptr + part_row0 * KV_LORA
        dst_l = pl_ptr + part_row0
    gl.store(dst + o_rows[:, None] * KV_LORA + o_cols[None, :], out, mask=row_ok)
    if HALF_IDX == 0:
        rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=m_i.type.layout)
        lse = gl.where(empty_rows, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
        gl.store(dst_l + rows, lse, mask=rows < n_new * heads)


@gluon.jit
def _consumer_default(ctx, out_args, slot_args, qk_scale, SPLIT: gl.constexpr, SCHEDULE_ROW: gl.constexpr,
                      Q_TMA: gl.constexpr):
    _consumer(ctx, out_args, slot_args, qk_scale, 0, SPLIT, SCHEDULE_ROW, Q_TMA)


@gluon.jit
def _consumer_worker(ctx, out_args, slot_args, qk_scale, SPLIT: gl.constexpr, SCHEDULE_ROW: gl.constexpr,
                     Q_TMA: gl.constexpr):
    _consumer(ctx, out_args, slot_args, qk_scale, 1, SPLIT, SCHEDULE_ROW, Q_TMA)


@gluon.jit
def _slot_chunk(sched_ptr, len_ptr, slot, SPLIT: gl.constexpr, SCHEDULE_ROW: gl.constexpr):
    """(sequence, its length, first key, end key, its chunk count, its first chunk's slot) of a slot: as
    kernels._mla_decode_kernel, its row of the schedule (SPLIT; sequence < 0: a spare slot), else the whole sequence
    `slot`; the loads in one round."""
    if SPLIT:
        row = sched_ptr + slot * SCHEDULE_ROW
        return gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4), gl.load(row + 5)
    seq_len = gl.load(len_ptr + slot).to(gl.int32)
    return slot, seq_len, 0, seq_len, 1, slot


@gluon.jit
def _seesaw_barriers():
    """The seesaw's barriers, initialised: ready (a piece of a stage landed), empty (a stage's half given back: stage
    · 2 + (its scoring warpgroup's columns, the other's)) and bar_m (m0 + P0, m1 + P1, the final l: both; the 64-row
    kernel hands P0 over on a barrier of its own, bar_p0, and m0 alone on bar_m[0])."""
    ready = gl.allocate_shared_memory(gl.int64, [2 * PIECES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    bar_m = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * PIECES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(4):
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(bar_m.index(0), count=1)
    mbarrier.init(bar_m.index(1), count=1)
    mbarrier.init(bar_m.index(2), count=2)
    return ready, empty, bar_m


@gluon.jit
def _mla_decode_ws_kernel(
    qn_ptr, qp_ptr, c_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, sched_ptr,
    stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph, stride_cr, stride_bt,
    n_new, heads, page_size, n_rows, qk_scale, q_desc, qp_desc, m_blocks,
    SPLIT: gl.constexpr, SCHEDULE_ROW: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMER_REGS: gl.constexpr, USE_PDL: gl.constexpr = False,
    LATE_TRIGGER: gl.constexpr = False, T1_AFTER_T0: gl.constexpr = False, Q_TMA: gl.constexpr = False,
):
    if USE_PDL:  # as kernels._mla_decode_kernel
        gdc_wait()
        if not LATE_TRIGGER:
            gdc_launch_dependents()
    dtype: gl.constexpr = c_ptr.dtype.element_ty
    wide: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, KV_LORA], wide)
    qp_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], wide)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1 if Q_TMA else 2)  # the loader's TMA of q, or each consumer warpgroup its half
    kc = gl.allocate_shared_memory(dtype, [2, BLOCK_N, KV_LORA], wide)
    kp = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], wide)
    ready, empty, bar_m = _seesaw_barriers()
    bar_q = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # warpgroup 0's scores issued
    mbarrier.init(bar_q, count=1)
    bar_p0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # P0 stored (after m0)
    mbarrier.init(bar_p0, count=1)
    sm = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], flat)  # m0 | m1
    sl = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], flat)  # each warpgroup's l
    q_args = (qn_ptr, qp_ptr, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph)
    ctx = ((q_args, q_bar, q_smem, qp_smem, kc, kp, ready, empty), bar_m, sm, sl, bar_q, bar_p0)
    q_tma = (q_desc, qp_desc, n_new * heads, q_bar, q_smem, qp_smem)
    out_args = (o_ptr, lse_ptr, po_ptr, pl_ptr, n_new, heads)
    slot_args = (sched_ptr, len_ptr, m_blocks)
    gl.warp_specialize([
        (_consumer_default, (ctx, out_args, slot_args, qk_scale, SPLIT, SCHEDULE_ROW, Q_TMA)),
        (_consumer_worker, (ctx, out_args, slot_args, qk_scale, SPLIT, SCHEDULE_ROW, Q_TMA)),
        (_loader, (c_ptr, bt_ptr, stride_bt, kc, kp, ready, empty, slot_args, n_rows, page_size, stride_cr,
                   LATE_TRIGGER, SPLIT, SCHEDULE_ROW, T1_AFTER_T0, q_tma, Q_TMA)),
    ], [4, 1], [CONSUMER_REGS, 24])


# registers: 12 warps (two consumer warpgroups and the loader's, rounded up to a warpgroup) × MAXNREG fill the
# register file; the loader keeps 24, so each consumer warpgroup gets (3 · MAXNREG − 24) / 2 = 240
MAXNREG = 168
CONSUMER_REGS = 240


# Gluon is experimental and its API moves between releases: the kernel runs only on the triton it was built and
# checked with; elsewhere mla_decode takes the Triton kernel (same math)
TRITON_VERSIONS = ("3.6",)


def triton_ok():
    return triton.__version__.startswith(TRITON_VERSIONS)


def supported(cache):
    """Hopper (sm_90), a 16-bit cache (the queries' dtype), pages holding whole key tiles, TMA-aligned cache, a
    checked triton."""
    return (cache.is_cuda and triton_ok() and torch.cuda.get_device_capability(cache.device) == (9, 0)
            and cache.dtype in (torch.bfloat16, torch.float16)
            and cache.shape[1] % BLOCK_N == 0 and cache.data_ptr() % 16 == 0)


def _q_rows_uniform(q_nope, q_pe):
    """Whether q_nope and q_pe are [B·Q·H, 512 / 64] rows of one stride each (TMA: 16-byte aligned rows)."""
    return all(q.stride(3) == 1 and q.stride(1) == q.shape[2] * q.stride(2) and q.stride(0) == q.shape[1] * q.stride(1)
               and (q.stride(2) * q.element_size()) % 16 == 0 and q.data_ptr() % 16 == 0 for q in (q_nope, q_pe))


def mla_decode_ws(q_nope, q_pe, cache, block_tables, seq_lens, o, lse, part_o, part_l, sched, qk_scale, slots,
                  pdl=False, merge_pdl=False):
    """Launch m-blocks of 64 rows × slots programs (one grid axis, _block_slot); as kernels._mla_decode_kernel:
    o/lse the final output, part_o/part_l [slots, Q, H, 512] (q's dtype) / [slots, Q, H] (fp32) the partials for the
    merge kernel and sched the schedule (schedule.py; slots > batch only)."""
    batch, n_new, heads, _ = q_nope.shape
    m_blocks = triton.cdiv(n_new * heads, BLOCK_M)
    q_descs = (None, None)
    if _q_rows_uniform(q_nope, q_pe):  # q by the loader's TMA (NOTES, issue 6, ap-9)
        from .kernels_few import _PIECE_LAYOUTS  # (kernels_few imports this module)

        rows = batch * n_new * heads
        q_descs = (TensorDescriptor(q_nope, [rows, 512], [q_nope.stride(2), 1], [BLOCK_M, 64], _PIECE_LAYOUTS[64]),
                   TensorDescriptor(q_pe, [rows, 64], [q_pe.stride(2), 1], [BLOCK_M, 64], _PIECE_LAYOUTS[64]))
    _mla_decode_ws_kernel[(m_blocks * slots,)](
        q_nope, q_pe, cache, block_tables, seq_lens, o, lse, part_o, part_l, sched,
        *q_nope.stride()[:3], *q_pe.stride()[:3], cache.stride(1), block_tables.stride(0),
        n_new, heads, cache.shape[1], cache.shape[0] * cache.shape[1], qk_scale, *q_descs, m_blocks,
        SPLIT=slots > batch, SCHEDULE_ROW=ROW, KV_LORA=512, ROPE=64, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        CONSUMER_REGS=CONSUMER_REGS, USE_PDL=pdl, LATE_TRIGGER=merge_pdl,
        T1_AFTER_T0=m_blocks * slots <= sm_count(cache.device), Q_TMA=q_descs[0] is not None,
        num_warps=4, maxnreg=MAXNREG,
        **({"launch_pdl": True} if pdl else {}),
    )
