"""MLA decode over a 16-bit latent cache on Hopper for up to 32 rows (16 heads × 2 new tokens, 32 heads), written in
Gluon: kernels_ws.py's seesaw on transposed tiles, so that no row is padded.

Why: kernels_ws.py pads 32 rows to its 64-row wgmma blocks, twice the tensor work a tile, and on the H200 a padded
tile's wgmma takes about as long as its 72 KB take to arrive (16 × 2 B=32 8k at 83% of copy); kernels_few.py's
transposed tiles need no padding, but its two warpgroups split every tile's columns and wait on each other once a
tile, and at 32 rows that was slower than the padding (NOTES, issue 6, session af). Here the tiles are transposed
as in kernels_few.py (Sᵀ = K · Qᵀ [64 keys, rows]: the keys fill wgmma's M; Oᵀ += Vᵀ · Pᵀ [columns, rows]) and the
work is split as in kernels_ws.py:
- warpgroup 0 scores the even tiles of a piece (stage 0) and warpgroup 1 the odd ones (stage 1), each over all 576
  columns, so each score is computed once and neither waits for the other's half of it. One online-softmax chain is
  handed back and forth through shared memory (the running max after each tile), with Pᵀ of the tile;
- each warpgroup owns half of the 512 output columns (Oᵀ [256, rows] in registers) and multiplies every tile's Pᵀ
  into it. While one runs its softmax, the other's wgmma has the tensor cores;
- a loader warp streams each pair of tiles by TMA into the two stages, nine 64-column pieces with a ready barrier
  apiece, and takes a stage back in two halves as kernels_ws.py's loader does (its _load_piece).
A program (one an SM) takes its slots one after another, as kernels_few.py's: a launch of programs (schedule.py:
chunks, or a range of the batch's key tiles across sequence ends) or one chunk (kernels_ws.py's schedule). Each
piece starts on stage 0; each loads its sequence's q (once both warpgroups are past the last piece's scores) and
stages its o through a buffer of its own (the stages may already hold the next piece's tiles).
H200 against kernels_ws.py (NOTES, issue 6, session ah; the programs plan): 16 × 2 B=32 8k −2%, B=128 8k −5%, B=32 1k
and B=32 32k −3 to −4%, 32 heads B=32 8k −3%, skewed 16 × 2 batches −22 to −33%; at 16 rows level with kernels_few.py,
which keeps them. Outputs, LSE and partials (q's dtype) as kernels_ws.py. Compiled kernels only (the interpreter
cannot run Gluon): CPU tests run kernels.py; `lmkernels check` compares this kernel with the reference on the GPU."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..._utils import gdc_launch_dependents, gdc_wait
from .kernels_few import (_load_q_half, _piece, _program_pieces, _tiles, _zero_past_end, cache_descriptor,
                          launch_programs)
from .kernels_fp8 import _epilogue, _softmax_t, _tile_row
from .kernels_ws import PIECES, _add, _load_piece, _qk_piece, _seesaw_barriers

MAX_ROWS = 32  # rows a program (fewer padded)


@gluon.jit
def _loader(pieces, desc, bt_ptr, stride_bt, kc, kp, ready, empty, page_size,
            SPLIT: gl.constexpr, RANGES: gl.constexpr, SCHEDULE_ROW: gl.constexpr, LATE_TRIGGER: gl.constexpr):
    """Each piece's tiles 2k into stage 0 and 2k + 1 into stage 1, in the order the consumers give the halves of a
    stage back (kernels_ws._loader). n0 / n1: the tiles stage 0 / 1 has taken so far (their barriers' phases)."""
    BLOCK: gl.constexpr = kc.shape[1]
    nbytes: gl.constexpr = BLOCK * 64 * kc.dtype.primitive_bitwidth // 8
    n0 = 0
    n1 = 0
    for k in range(pieces[3]):
        _, seq, _, start, end, _, _ = _piece(pieces, k, SPLIT, RANGES, SCHEDULE_ROW)
        bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
        n_tiles = _tiles(start, end, BLOCK)
        for t in range((n_tiles + 1) // 2):
            key0 = start + 2 * t * BLOCK
            row0 = _tile_row(bt_row, key0, end, page_size)
            ph = (n0 & 1) ^ 1  # fresh barriers count as released
            mbarrier.wait(empty.index(0), ph)  # stage 0, warpgroup 0's columns
            for j in gl.static_range(4):
                _load_piece(desc, row0, kc.index(0), kp.index(0), ready, 0, j, nbytes)
            mbarrier.wait(empty.index(1), ph)  # stage 0, warpgroup 1's columns and k_pe
            for j in gl.static_range(4, 9):
                _load_piece(desc, row0, kc.index(0), kp.index(0), ready, 0, j, nbytes)
            n0 += 1
            if 2 * t + 1 < n_tiles:
                row1 = _tile_row(bt_row, key0 + BLOCK, end, page_size)
                ph = (n1 & 1) ^ 1
                mbarrier.wait(empty.index(3), ph)  # stage 1, warpgroup 0's columns and k_pe
                for j in gl.static_range(4):
                    _load_piece(desc, row1, kc.index(1), kp.index(1), ready, 1, j, nbytes)
                _load_piece(desc, row1, kc.index(1), kp.index(1), ready, 1, 8, nbytes)
                mbarrier.wait(empty.index(2), ph)  # stage 1, warpgroup 1's columns
                for j in gl.static_range(4, 8):
                    _load_piece(desc, row1, kc.index(1), kp.index(1), ready, 1, j, nbytes)
                n1 += 1
    if LATE_TRIGGER:  # every load issued: the merge kernel after this one may launch
        gdc_launch_dependents()


@gluon.constexpr_function
def _loaded_piece(s, i):
    """The i-th piece the loader puts into stage s: c_kv's 8 in order, k_pe last in stage 0 and fifth in stage 1."""
    return i if s == 0 or i < 4 else (8 if i == 4 else i - 1)


@gluon.jit
def _scores(q_smem, qp_smem, kc_s, kp_s, ready, s: gl.constexpr, phase, s_zero):
    """Sᵀ [keys, rows] of the tile in stage s over all 576 columns, pieces in the loader's order, alternating
    between two accumulation chains (half the dependent wgmma latency)."""
    a = s_zero
    b = s_zero
    for i in gl.static_range(PIECES):
        if i % 2 == 0:
            a = _qk_piece(a, q_smem, qp_smem, kc_s, kp_s, ready, s, _loaded_piece(s, i), phase, i < 2, True)
        else:
            b = _qk_piece(b, q_smem, qp_smem, kc_s, kp_s, ready, s, _loaded_piece(s, i), phase, i < 2, True)
    a, b = warpgroup_mma_wait(num_outstanding=0, deps=(a, b))
    return a + b


@gluon.jit
def _multiply(acc, kc_s, pt, key0, end, col0: gl.constexpr):
    """Oᵀ += (this warpgroup's columns of the tile in kc_s)ᵀ · Pᵀ, their rows past the end zeroed first (the page
    may hold NaN there; P is 0 but 0 · NaN is not)."""
    HALF: gl.constexpr = acc.shape[0]
    v = kc_s.slice(col0, HALF, dim=1)
    if key0 + kc_s.shape[0] > end:
        _zero_past_end(v, end - key0)
    acc = warpgroup_mma(v.permute((1, 0)), pt, acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _rescale(m_i, m_new):
    """The factor exp2(m_i − m_new) that takes what was summed under the running max m_i to m_new."""
    return gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))


@gluon.jit
def _consumer(q_args, smem, bars, out_args, pieces, qk_scale, W: gl.constexpr, SPLIT: gl.constexpr,
              RANGES: gl.constexpr, SCHEDULE_ROW: gl.constexpr):
    """Warpgroup W: columns [256 W, +256) of Oᵀ; scores the tiles of stage W. Per pair of tiles (t0, t1), m the
    running max: 0 scores t0, its softmax from m gives m0 and P0 (both to shared memory), o_L = o_L · α0 + V0Lᵀ P0;
    1 scores t1, takes m0, its softmax gives m1 and P1, o_R = (o_R · α0 + V0Rᵀ P0) · α1 + V1Rᵀ P1; 0 takes m1:
    o_L = o_L · α1 + V1Lᵀ P1 (kernels_ws._consumer, transposed)."""
    q_buf, qp_buf, kc, kp, pt, sm, sl, staging = smem
    ready, empty, bar_m, q_bar = bars
    n_new = q_args[2]
    heads = q_args[3]
    ROWS: gl.constexpr = q_buf.shape[1]
    BLOCK: gl.constexpr = kc.shape[1]
    KV_LORA: gl.constexpr = kc.shape[2]
    HALF: gl.constexpr = KV_LORA // 2
    PE_HALF: gl.constexpr = qp_buf.shape[2] // 2
    dtype: gl.constexpr = kc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per row of q (a column of Sᵀ and Oᵀ)
    offs_n = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, s_layout))
    scale = gl.full([ROWS], 1.0, gl.float32, layout=col_layout) * qk_scale
    ones = gl.full([ROWS], 1.0, gl.float32, layout=col_layout)
    s_zero = gl.zeros([BLOCK, ROWS], gl.float32, layout=s_layout)
    rows = n_new * heads
    n0 = 0  # tiles stage 0 / 1 has taken so far (the loader's counts)
    n1 = 0
    for k in range(pieces[3]):
        slot, seq, seq_len, start, end, n, _ = _piece(pieces, k, SPLIT, RANGES, SCHEDULE_ROW)
        b64 = seq.to(gl.int64)
        # its half of q: both warpgroups are past the last piece's scores (its l exchange below)
        _load_q_half(q_args, b64, 0, q_buf.index(0), qp_buf.index(0).slice(W * PE_HALF, PE_HALF, dim=1), W)
        mbarrier.arrive(q_bar)
        mbarrier.wait(q_bar, k & 1)
        pos = seq_len - n_new + gl.arange(0, ROWS, layout=col_layout) // heads  # causal among the new tokens
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=col_layout)
        l_k = gl.zeros([BLOCK, ROWS], gl.float32, layout=s_layout)  # the softmax sums per key slot, summed at the end
        acc = gl.zeros([HALF, ROWS], gl.float32, layout=s_layout)
        n_tiles = _tiles(start, end, BLOCK)
        for t in range((n_tiles + 1) // 2):
            ph0 = n0 & 1
            ph1 = n1 & 1
            key0 = start + 2 * t * BLOCK
            key1 = key0 + BLOCK
            has1 = 2 * t + 1 < n_tiles
            # buffers indexed by z = 0, which the compiler cannot prove constant: otherwise it computes the wgmma
            # descriptors of the fixed buffers once before the loop and spills them (as kernels_few.py)
            z = key0 >> 31  # key0 ≥ 0
            kc0 = kc.index(z)
            kc1 = kc.index(z + 1)
            pt0 = pt.index(z)
            pt1 = pt.index(z + 1)
            if W == 0:
                st = _scores(q_buf.index(z), qp_buf.index(z), kc0, kp.index(z), ready, 0, ph0, s_zero)
                p, m0, l_k, a0 = _softmax_t(st, m_i, l_k, key0, end, pos, offs_n, scale)
                pt0.store(p.to(dtype))
                sm.slice(0, ROWS).store(m0)
                fence_async_shared()
                mbarrier.arrive(bar_m.index(0))
                acc = _multiply(acc * a0[None, :], kc0, pt0, key0, end, 0)
                mbarrier.arrive(empty.index(0))
                m_i = m0
                if has1:
                    mbarrier.wait(bar_m.index(1), ph1)
                    m1 = sm.slice(ROWS, ROWS).load(col_layout)
                    a1 = _rescale(m0, m1)
                    l_k = l_k * a1[None, :]
                    acc = _multiply(acc * a1[None, :], kc1, pt1, key1, end, 0)
                    mbarrier.arrive(empty.index(3))
                    m_i = m1
            else:
                st = s_zero
                if has1:
                    st = _scores(q_buf.index(z), qp_buf.index(z), kc1, kp.index(z + 1), ready, 1, ph1, s_zero)
                mbarrier.wait(bar_m.index(0), ph0)
                m0 = sm.slice(0, ROWS).load(col_layout)
                a0 = _rescale(m_i, m0)
                l_k = l_k * a0[None, :]
                m_i = m0
                a1 = ones
                if has1:
                    p, m_i, l_k, a1 = _softmax_t(st, m0, l_k, key1, end, pos, offs_n, scale)
                    pt1.store(p.to(dtype))
                    sm.slice(ROWS, ROWS).store(m_i)
                    fence_async_shared()
                    mbarrier.arrive(bar_m.index(1))
                acc = _multiply(acc * a0[None, :], kc0, pt0, key0, end, HALF)
                mbarrier.arrive(empty.index(1))
                if has1:
                    acc = _multiply(acc * a1[None, :], kc1, pt1, key1, end, HALF)
                    mbarrier.arrive(empty.index(2))
            n0 += 1
            if has1:
                n1 += 1
        # l: each warpgroup summed its own tiles' P (both under the final max): exchange through shared memory; past
        # this barrier both warpgroups are done with the piece's scores, so q may be loaded again
        l_i = gl.reduce(l_k, 0, _add)
        sl.slice(W * ROWS, ROWS).store(l_i)
        mbarrier.arrive(bar_m.index(2))
        mbarrier.wait(bar_m.index(2), k & 1)
        l_i = l_i + sl.slice((1 - W) * ROWS, ROWS).load(col_layout)
        o_ptr, lse_ptr, po_ptr, pl_ptr = out_args
        _epilogue(acc, m_i, l_i, ones, (o_ptr, lse_ptr, po_ptr, pl_ptr, b64 * rows, slot.to(gl.int64) * rows, n == 1),
                  0, rows, staging.index(W), W * HALF, KV_LORA, W == 0)


@gluon.jit
def _consumer_default(q_args, smem, bars, out_args, pieces, qk_scale, SPLIT: gl.constexpr, RANGES: gl.constexpr,
                      SCHEDULE_ROW: gl.constexpr):
    _consumer(q_args, smem, bars, out_args, pieces, qk_scale, 0, SPLIT, RANGES, SCHEDULE_ROW)


@gluon.jit
def _consumer_worker(q_args, smem, bars, out_args, pieces, qk_scale, SPLIT: gl.constexpr, RANGES: gl.constexpr,
                     SCHEDULE_ROW: gl.constexpr):
    _consumer(q_args, smem, bars, out_args, pieces, qk_scale, 1, SPLIT, RANGES, SCHEDULE_ROW)


@gluon.jit
def _mla_decode_seesaw_t_kernel(
    qn_ptr, qp_ptr, c_desc, bt_ptr, len_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, sched_ptr, prog_ptr,
    stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph, stride_bt,
    n_new, heads, page_size, qk_scale,
    SPLIT: gl.constexpr, SCHEDULE_ROW: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, RANGES: gl.constexpr = False, PROGRAM_ROW: gl.constexpr = 8,
    USE_PDL: gl.constexpr = False, LATE_TRIGGER: gl.constexpr = False,
):
    """Program p takes its slot (a chunk, kernels_ws.py's schedule) or, RANGES (a launch of programs, schedule.py),
    the slots its row of prog_ptr names, one after another in one pipeline (kernels_few.py)."""
    if USE_PDL:  # as kernels._mla_decode_kernel
        gdc_wait()
        if not LATE_TRIGGER:
            gdc_launch_dependents()
    pieces = _program_pieces(sched_ptr, len_ptr, prog_ptr, SPLIT, RANGES, SCHEDULE_ROW, PROGRAM_ROW)
    if pieces[3] == 0:
        return
    dtype: gl.constexpr = c_desc.dtype
    wide: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    flat1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_smem = gl.allocate_shared_memory(dtype, [1, ROWS, KV_LORA], wide)  # [1, …]: see _consumer's z
    qp_smem = gl.allocate_shared_memory(dtype, [1, ROWS, ROPE], wide)
    kc = gl.allocate_shared_memory(dtype, [2, BLOCK_N, KV_LORA], wide)
    kp = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], wide)
    pt = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROWS], gl.NVMMASharedLayout(
        swizzle_byte_width=2 * ROWS, element_bitwidth=16, rank=2))  # each stage's Pᵀ
    sm = gl.allocate_shared_memory(gl.float32, [2 * ROWS], flat1)  # m0 | m1
    sl = gl.allocate_shared_memory(gl.float32, [2 * ROWS], flat1)  # each warpgroup's l
    # each warpgroup's half of o on its way out (not a stage: the loader fills them with the next piece's tiles)
    staging = gl.allocate_shared_memory(dtype, [2, ROWS, KV_LORA // 2], flat)
    ready, empty, bar_m = _seesaw_barriers()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=2)  # each consumer warpgroup stores its half of q
    q_args = (qn_ptr, qp_ptr, n_new, heads, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph)
    smem = (q_smem, qp_smem, kc, kp, pt, sm, sl, staging)
    bars = (ready, empty, bar_m, q_bar)
    out_args = (o_ptr, lse_ptr, po_ptr, pl_ptr)
    # the constexprs written into each partition's tuple (kernels_few.py says why)
    gl.warp_specialize([
        (_consumer_default, (q_args, smem, bars, out_args, pieces, qk_scale, SPLIT, RANGES, SCHEDULE_ROW)),
        (_consumer_worker, (q_args, smem, bars, out_args, pieces, qk_scale, SPLIT, RANGES, SCHEDULE_ROW)),
        (_loader, (pieces, c_desc, bt_ptr, stride_bt, kc, kp, ready, empty, page_size, SPLIT,
                   RANGES, SCHEDULE_ROW, LATE_TRIGGER)),
    ], [4, 1], [240, 24])


def mla_decode_seesaw_t(q_nope, q_pe, cache, block_tables, seq_lens, o, lse, part_o, part_l, sched, qk_scale, slots,
                        pdl=False, merge_pdl=False, programs=0, rows=MAX_ROWS):
    """Launch over (1, slots) for ≤ `rows` rows (16 or 32; fewer padded), as kernels_ws.mla_decode_ws; programs > 0:
    over (1, programs), a launch of programs (schedule.py)."""
    launch_programs(_mla_decode_seesaw_t_kernel, (cache_descriptor(cache),), q_nope, q_pe, cache, block_tables,
                    seq_lens, o, lse, part_o, part_l, sched, qk_scale, slots, pdl, merge_pdl, programs, ROWS=rows)
