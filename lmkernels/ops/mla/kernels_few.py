"""MLA decode over a 16-bit latent cache on Hopper for 16 rows (heads × new tokens; fewer padded), written in Gluon,
every dot a wgmma with no padded rows beyond them.

Why: the warp-specialised kernel of kernels_ws.py pads its rows to 64-row wgmma blocks, 4x the tensor work a tile at
16 rows, and the 16-row Triton kernel (mma.sync at M = 16) keeps up with an H200's DRAM (32 GB/s an SM, against the
H100's 23) only at two programs an SM, whose loops end up to 4 µs apart (benchmarks/NOTES.md, issue 6, sessions ac,
ad). Here the tiles are transposed, as in kernels_fp8.py's few-rows path: Sᵀ = K · Qᵀ [64 keys, rows] (the 64 keys
fill wgmma's M) and Oᵀ += Vᵀ · Pᵀ [columns, rows] (A transposed), reading each bf16 / fp16 stage as it lands (no
conversion). A program (one an SM) takes its slots of the schedule one after another: a launch of programs
(schedule.py, as kernels.py's Triton kernel: chunks, or a range of the batch's key tiles across sequence ends, so a
skewed batch's long sequences spread over every SM), or one chunk (a batch too large for that schedule's registers:
kernels_ws.py's schedule, with its extra wave). It has three partitions:
- a loader warp streams 64-key tiles by TMA into 2 stages (c_kv as 8 pieces of 64 columns, k_pe as 2 of 32), on
  into the next piece's while the consumers finish one;
- two consumer warpgroups, each owning half of the columns (256 of c_kv, 32 of k_pe): each scores over its own
  columns, adds the other's partial Sᵀ through shared memory (one exchange a tile; both then run the same
  softmax), zeroes its columns of the keys past the chunk's end in the last tile (the page may hold NaN there, and
  P = 0 times NaN is not 0), and multiplies Pᵀ into its half of Oᵀ [256, rows]. A stage is released once both
  have multiplied it. Each piece loads its sequence's q again and stages its o through a buffer of its own.
Where the plan cannot cut a sequence into more than a few pieces (kernels.FEW_FUSED_MAX_CHUNKS: contexts up to 1k),
the last piece of a sequence to finish merges the pieces' partials (_merge_if_last), and no merge kernel follows.
H200 against the Triton kernel (NOTES, issue 6, session af): 16 heads B=32 8k −6%, B=128 1k −6%, B=128 8k and B=32
32k −8%, B=32 1k −5%; at 32 rows (16 × 2) 1–7% slower than the 64-row blocks, so those keep them. Outputs, LSE and
partials (q's dtype) as kernels_ws.py. Compiled kernels only (the interpreter cannot run Gluon): CPU tests run
kernels.py; `lmkernels check` compares this kernel with the reference on the GPU."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..._utils import gdc_launch_dependents, gdc_wait
from .kernels_fp8 import _epilogue, _q_rows, _scores_exchanged, _softmax_t, _tile_row
from .kernels_ws import _add, _slot_chunk
from .schedule import PROGRAM_ROW, ROW, program_rows

BLOCK_N = 64  # keys per tile: the M of the score wgmma
ROPE_HALF = 32  # each consumer warpgroup's k_pe columns (a TMA piece of its own)
NSTAGE = 2  # 72 KB stages; with q, the exchange and o's staging buffers 190 KB at 16 rows
MAX_ROWS = 16  # more rows take kernels_seesaw_t.py (or kernels_ws.py's 64-row blocks): at 32 rows (16 × 2) this
# kernel was 1–7% slower than the 64-row blocks on the H200 (NOTES, issue 6, session af)


@gluon.jit
def _program_pieces(sched_ptr, len_ptr, prog_ptr, SPLIT: gl.constexpr, RANGES: gl.constexpr,
                    SCHEDULE_ROW: gl.constexpr, PROGRAM_ROW: gl.constexpr):
    """The pieces of this program (_piece's first argument): (sched_ptr, len_ptr, its first slot, its slot count,
    that slot's row), all loaded in one round. RANGES: its row of prog_ptr names them (the first slot's row copied
    into it, so that the loader's first tile waits for one round of loads before its page-table read, not two);
    else its own slot, none where it is a spare one (sequence −1)."""
    p = gl.program_id(1)
    if RANGES:
        prow = prog_ptr + p * PROGRAM_ROW
        row0 = (gl.load(prow + 2), gl.load(prow + 3), gl.load(prow + 4), gl.load(prow + 5), gl.load(prow + 6),
                gl.load(prow + 7))
        return sched_ptr, len_ptr, gl.load(prow), gl.load(prow + 1), row0
    row0 = _slot_chunk(sched_ptr, len_ptr, p, SPLIT, SCHEDULE_ROW)
    return sched_ptr, len_ptr, p, (row0[0] >= 0).to(gl.int32), row0


@gluon.jit
def _piece(pieces, k, SPLIT: gl.constexpr, RANGES: gl.constexpr, SCHEDULE_ROW: gl.constexpr):
    """(slot, sequence, its length, first key, end key, its chunk count, its first chunk's slot) of the program's
    piece k: the first as _program_pieces loaded it, a later one (RANGES) from its slot's row."""
    sched_ptr, len_ptr, first, count, row0 = pieces
    seq, seq_len, start, end, n, first_chunk = row0
    if RANGES:
        if k > 0:
            seq, seq_len, start, end, n, first_chunk = _slot_chunk(sched_ptr, len_ptr, first + k, SPLIT, SCHEDULE_ROW)
    return first + k, seq, seq_len, start, end, n, first_chunk


@gluon.jit
def _tiles(start, end, BLOCK: gl.constexpr):
    return (gl.maximum(end - start, 0) + BLOCK - 1) // BLOCK


@gluon.jit
def _loader(pieces, desc, desc_pe, bt_ptr, stride_bt, kc, kp, ready, empty, page_size,
            SPLIT: gl.constexpr, RANGES: gl.constexpr, SCHEDULE_ROW: gl.constexpr, LATE_TRIGGER: gl.constexpr):
    """The program's pieces one after another, its t-th tile into stage t % NSTAGE (so the next piece's first tiles
    load while the consumers finish the last one's): the 512 c_kv columns as 8 pieces of 64, then k_pe as two pieces
    of 32 (one for each consumer warpgroup), one barrier a stage."""
    STAGES: gl.constexpr = kc.shape[0]
    BLOCK: gl.constexpr = kc.shape[1]
    KV_LORA: gl.constexpr = kc.shape[2]
    PE_HALF: gl.constexpr = kp.shape[2]
    PIECE: gl.constexpr = 64
    BYTES: gl.constexpr = BLOCK * (KV_LORA + 2 * PE_HALF) * 2
    it = 0  # tiles so far, over the pieces
    for k in range(pieces[3]):
        _, seq, _, start, end, _, _ = _piece(pieces, k, SPLIT, RANGES, SCHEDULE_ROW)
        bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
        for t in range(_tiles(start, end, BLOCK)):
            s = it % STAGES
            row0 = _tile_row(bt_row, start + t * BLOCK, end, page_size)
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers count as released
            bar = ready.index(s)
            mbarrier.expect(bar, BYTES)
            for j in gl.static_range(KV_LORA // PIECE):
                tma.async_copy_global_to_shared(desc, [row0, PIECE * j], bar,
                                                kc.index(s).slice(PIECE * j, PIECE, dim=1))
            for h in gl.static_range(2):
                tma.async_copy_global_to_shared(desc_pe, [row0, KV_LORA + PE_HALF * h], bar, kp.index(2 * s + h))
            it += 1
    if LATE_TRIGGER:  # every load issued: the merge kernel after this one may launch
        gdc_launch_dependents()


@gluon.jit
def _load_q_half(q_args, b64, row0, q_smem, qp_smem, HALF_IDX: gl.constexpr):
    """This warpgroup's half of q_lat and of q_pe for sequence b64's rows row0 … (row r = new token r // heads, head
    r % heads) into shared memory, as they are (the cache's dtype)."""
    qn_ptr, qp_ptr, n_new, heads, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph = q_args
    HALF: gl.constexpr = q_smem.shape[1] // 2
    PE_HALF: gl.constexpr = qp_smem.shape[1]
    qn_row, qp_row, row_ok, d, e = _q_rows((qn_ptr, qp_ptr, b64, n_new, heads, stride_qnb, stride_qnt, stride_qnh,
                                            stride_qpb, stride_qpt, stride_qph), row0, q_smem.shape[0], HALF, PE_HALF)
    q_smem.slice(HALF_IDX * HALF, HALF, dim=1).store(gl.load(qn_row + HALF_IDX * HALF + d[None, :], mask=row_ok,
                                                             other=0.0))
    qp_smem.store(gl.load(qp_row + HALF_IDX * PE_HALF + e[None, :], mask=row_ok, other=0.0))
    fence_async_shared()


@gluon.jit
def _zero_past_end(kc_half, valid):
    """Keys (rows) from `valid` on of this warpgroup's [64, 256] columns of a stage set to 0, a 64-column piece at a
    time (32 values a thread)."""
    BLOCK: gl.constexpr = kc_half.shape[0]
    PIECE: gl.constexpr = 64
    zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    keep = (gl.arange(0, BLOCK, layout=gl.SliceLayout(1, zl)) < valid)[:, None]
    for j in gl.static_range(kc_half.shape[1] // PIECE):
        piece = kc_half.slice(j * PIECE, PIECE, dim=1)
        x = piece.load(zl)
        piece.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()


@gluon.jit
def _consumer(q_args, smem, bars, out_args, pieces, qk_scale, HALF_IDX: gl.constexpr, SPLIT: gl.constexpr,
              RANGES: gl.constexpr, SCHEDULE_ROW: gl.constexpr, FUSED: gl.constexpr):
    """Warpgroup HALF_IDX, for each of the program's pieces: scores over its columns, the other's added through shared
    memory, the softmax, and its half of Oᵀ (module docstring)."""
    q_buf, qp_buf, kc_st, kp_st, pt_buf, sx, staging = smem
    ready, empty, x_full, x_free = bars
    n_new = q_args[2]
    heads = q_args[3]
    ROWS: gl.constexpr = q_buf.shape[1]
    BLOCK: gl.constexpr = kc_st.shape[1]
    KV_LORA: gl.constexpr = kc_st.shape[2]
    HALF: gl.constexpr = KV_LORA // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per row of q (a column of Sᵀ and Oᵀ)
    offs_n = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, s_layout))
    scale = gl.full([ROWS], 1.0, gl.float32, layout=col_layout) * qk_scale
    s_zero = gl.zeros([BLOCK, ROWS], gl.float32, layout=s_layout)
    rows = n_new * heads
    it = 0  # tiles so far, over the pieces (the loader's count)
    for k in range(pieces[3]):
        slot, seq, seq_len, start, end, n, first_chunk = _piece(pieces, k, SPLIT, RANGES, SCHEDULE_ROW)
        b64 = seq.to(gl.int64)
        # its own half of q: the last piece's wgmmas that read it are waited for
        _load_q_half(q_args, b64, 0, q_buf.index(0), qp_buf.index(HALF_IDX), HALF_IDX)
        pos = seq_len - n_new + gl.arange(0, ROWS, layout=col_layout) // heads  # causal among the new tokens
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=col_layout)
        l_k = gl.zeros([BLOCK, ROWS], gl.float32, layout=s_layout)  # the softmax sums per key slot, summed at the end
        acc = gl.zeros([HALF, ROWS], gl.float32, layout=s_layout)
        it, m_i, l_k, acc = _piece_tiles(q_buf, qp_buf, kc_st, kp_st, pt_buf, sx, ready, empty, x_full, x_free, it,
                                         _tiles(start, end, BLOCK), start, end, pos, offs_n, scale, s_zero, m_i, l_k,
                                         acc, HALF_IDX)
        l_i = gl.reduce(l_k, 0, _add)
        _finish_piece(acc, m_i, l_i, out_args, (slot, b64, n, first_chunk), rows, staging.index(HALF_IDX), HALF_IDX,
                      FUSED)


@gluon.jit
def _finish_piece(acc, m_i, l_i, out_args, piece, rows, buf, HALF_IDX: gl.constexpr, FUSED: gl.constexpr):
    """This warpgroup's half of a piece's o (Oᵀ in acc) and its LSE out (kernels_fp8._epilogue): the final output
    where the piece is its sequence's only one, else a partial. FUSED: then the last of the sequence's pieces to
    finish merges them (_merge_if_last); both warpgroups store the LSE there (the same values: each merges its
    columns by the LSE its counterparts of the other pieces stored), else warpgroup 0 alone."""
    o_ptr, lse_ptr, po_ptr, pl_ptr, cnt_ptr = out_args
    slot, b64, n, first_chunk = piece
    COLS: gl.constexpr = acc.shape[0]
    ones = gl.full(m_i.shape, 1.0, gl.float32, layout=m_i.type.layout)
    _epilogue(acc, m_i, l_i, ones, (o_ptr, lse_ptr, po_ptr, pl_ptr, b64 * rows, slot.to(gl.int64) * rows, n == 1), 0,
              rows, buf, HALF_IDX * COLS, 2 * COLS, HALF_IDX == 0 or FUSED)
    if FUSED:
        if n > 1:
            _merge_if_last(out_args, b64, n, first_chunk, rows, acc.shape[1], HALF_IDX * COLS, COLS, HALF_IDX)


@gluon.jit
def _merge_if_last(out_args, b64, n, first_chunk, rows, ROWS: gl.constexpr, col0, COLS: gl.constexpr,
                   HALF_IDX: gl.constexpr):
    """The in-kernel merge: this warpgroup counts its half of the piece's partial in on the sequence's counter of that
    half (cnt_ptr[2 · sequence + half]); the last of the sequence's n pieces to arrive adds the n partials' columns
    [col0, +COLS) under their LSE into the final o (warpgroup 0 also the final LSE), ROUND partials a round (all
    their loads in flight at once), and zeroes the counter for the next launch. No merge kernel then runs (H200,
    NOTES, issue 6, session aj: 16 heads B=128 1k −1.7%, 8 × 1k + 120 × 64 −6.4%, B=32 1k, four pieces a sequence,
    ±0.1%; at 32 rows in the transposed seesaw, one partial a round, B=32 1k was 15% slower, and the 64-row blocks'
    build with it spilled and ran ~50% slower on every 1k row, even where nothing merged: both keep the merge
    kernel)."""
    o_ptr, lse_ptr, po_ptr, pl_ptr, cnt_ptr = out_args
    KV_LORA: gl.constexpr = 2 * COLS
    ROUND: gl.constexpr = 4  # partials a round: 32 values a thread each
    gl.thread_barrier()  # the warpgroup's partial is all stored before its count (the atomic releases it) …
    counter = cnt_ptr + 2 * b64 + HALF_IDX
    if gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n - 1:  # … and the last reads the others' after it
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        c = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        row_ok = r < rows
        part = first_chunk.to(gl.int64) * rows + r  # row r of the first partial; partial j is j · rows rows on
        m = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, layout))
        total = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, layout))
        out = gl.zeros([ROWS, COLS], gl.float32, layout=layout)
        for j0 in range(0, n, ROUND):
            for j in gl.static_range(ROUND):
                ok = row_ok & (j0 + j < n)
                pj = part + (j0 + j) * rows
                # L2, not L1: other SMs wrote these in this launch
                lse_j = gl.load(pl_ptr + pj, mask=ok, other=float("-inf"), cache_modifier=".cg")
                o_j = gl.load(po_ptr + pj[:, None] * KV_LORA + c[None, :], mask=ok[:, None], other=0.0,
                              cache_modifier=".cg")
                m_new = gl.maximum(m, lse_j)
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp(m - m_safe)
                w = gl.exp(lse_j - m_safe)
                total = total * alpha + w
                out = out * alpha[:, None] + o_j.to(gl.float32) * w[:, None]
                m = m_new
        empty_rows = total == 0.0
        t_safe = gl.where(empty_rows, 1.0, total)
        final = b64 * rows + r
        gl.store(o_ptr + final[:, None] * KV_LORA + c[None, :],
                 (out * (1.0 / t_safe)[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        if HALF_IDX == 0:
            m_safe = gl.where(m == float("-inf"), 0.0, m)
            gl.store(lse_ptr + final, gl.where(empty_rows, float("-inf"), m_safe + gl.log(t_safe)), mask=row_ok)
        gl.store(counter, 0)


@gluon.jit
def _piece_tiles(q_buf, qp_buf, kc_st, kp_st, pt_buf, sx, ready, empty, x_full, x_free, it, n_tiles, start, end, pos,
                 offs_n, scale, s_zero, m_i, l_k, acc, HALF_IDX: gl.constexpr):
    """A piece's tiles (its keys [start, end)), the program's it-th tile first: (it after them, m_i, l_k, acc)."""
    STAGES: gl.constexpr = kc_st.shape[0]
    BLOCK: gl.constexpr = kc_st.shape[1]
    KV_LORA: gl.constexpr = kc_st.shape[2]
    HALF: gl.constexpr = KV_LORA // 2
    dtype: gl.constexpr = kc_st.dtype
    for t in range(n_tiles):
        s = it % STAGES
        n0 = start + t * BLOCK
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        kc = kc_st.index(s)
        # q indexed by z = 0, which the compiler cannot prove constant: otherwise it computes the wgmma descriptors
        # of the fixed q buffers once before the loop and spills them (as kernels_fp8.py)
        z = n0 >> 31  # n0 ≥ 0
        st = _scores_exchanged(kc, kp_st.index(2 * s + HALF_IDX), q_buf.index(z), qp_buf.index(2 * z + HALF_IDX), sx,
                               x_full, x_free, it & 1, s_zero, HALF_IDX)
        p, m_i, l_k, alpha = _softmax_t(st, m_i, l_k, n0, end, pos, offs_n, scale)
        own = kc.slice(HALF_IDX * HALF, HALF, dim=1)
        if n0 + BLOCK > end:  # the chunk's last tile, cut short
            _zero_past_end(own, end - n0)
        pt = pt_buf.index(2 * z + HALF_IDX)
        pt.store(p.to(dtype))
        fence_async_shared()
        acc = acc * alpha[None, :]
        acc = warpgroup_mma(own.permute((1, 0)), pt, acc, is_async=True)
        # waited here: left in flight into the next tile, ptxas serialised every wgmma of the kernel (C7515)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s))
        it += 1
    return it, m_i, l_k, acc


@gluon.jit
def _consumer_default(q_args, smem, bars, out_args, pieces, qk_scale, SPLIT: gl.constexpr, RANGES: gl.constexpr,
                      SCHEDULE_ROW: gl.constexpr, FUSED: gl.constexpr):
    _consumer(q_args, smem, bars, out_args, pieces, qk_scale, 0, SPLIT, RANGES, SCHEDULE_ROW, FUSED)


@gluon.jit
def _consumer_worker(q_args, smem, bars, out_args, pieces, qk_scale, SPLIT: gl.constexpr, RANGES: gl.constexpr,
                     SCHEDULE_ROW: gl.constexpr, FUSED: gl.constexpr):
    _consumer(q_args, smem, bars, out_args, pieces, qk_scale, 1, SPLIT, RANGES, SCHEDULE_ROW, FUSED)


@gluon.jit
def _mla_decode_few_kernel(
    qn_ptr, qp_ptr, c_desc, pe_desc, bt_ptr, len_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, sched_ptr, prog_ptr,
    stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph, stride_bt,
    n_new, heads, page_size, qk_scale, cnt_ptr,
    SPLIT: gl.constexpr, SCHEDULE_ROW: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, NSTAGE: gl.constexpr, RANGES: gl.constexpr = False,
    PROGRAM_ROW: gl.constexpr = 8, USE_PDL: gl.constexpr = False, LATE_TRIGGER: gl.constexpr = False,
    FUSED: gl.constexpr = False,
):
    """Program p takes its slot (a chunk, kernels_ws.py's schedule) or, RANGES (a launch of programs, schedule.py),
    the slots its row of prog_ptr names: chunks, or its range of the batch's key tiles cut at sequence ends, one
    after another in one pipeline. FUSED: pieces of a sequence cut in several merge here (_merge_if_last; cnt_ptr
    the zeroed counters, two a sequence), else in the merge kernel after this one."""
    if USE_PDL:  # as kernels._mla_decode_kernel
        gdc_wait()
        if not LATE_TRIGGER:
            gdc_launch_dependents()
    pieces = _program_pieces(sched_ptr, len_ptr, prog_ptr, SPLIT, RANGES, SCHEDULE_ROW, PROGRAM_ROW)
    if pieces[3] == 0:
        return
    dtype: gl.constexpr = c_desc.dtype
    wide: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    narrow: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=ROPE, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    q_smem = gl.allocate_shared_memory(dtype, [1, ROWS, KV_LORA], wide)  # [1, …]: see _piece_tiles's z
    qp_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROPE // 2], narrow)  # q_pe's halves
    kc = gl.allocate_shared_memory(dtype, [NSTAGE, BLOCK_N, KV_LORA], wide)
    kp = gl.allocate_shared_memory(dtype, [2 * NSTAGE, BLOCK_N, ROPE // 2], narrow)
    pt = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROWS], gl.NVMMASharedLayout(
        swizzle_byte_width=2 * ROWS, element_bitwidth=16, rank=2))  # each warpgroup's Pᵀ
    sx = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, ROWS], flat)  # each warpgroup's partial Sᵀ
    # each warpgroup's half of o on its way out (not a stage: the loader fills them with the next piece's tiles)
    staging = gl.allocate_shared_memory(dtype, [2, ROWS, KV_LORA // 2], flat)
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    x_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGE):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both warpgroups multiply their half
    for i in gl.static_range(2):
        mbarrier.init(x_full.index(i), count=1)
        mbarrier.init(x_free.index(i), count=1)
    q_args = (qn_ptr, qp_ptr, n_new, heads, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph)
    smem = (q_smem, qp_smem, kc, kp, pt, sx, staging)
    bars = (ready, empty, x_full, x_free)
    out_args = (o_ptr, lse_ptr, po_ptr, pl_ptr, cnt_ptr)
    # the constexprs written into each partition's tuple: a tuple assigned to a name holds them as runtime values
    gl.warp_specialize([
        (_consumer_default, (q_args, smem, bars, out_args, pieces, qk_scale, SPLIT, RANGES, SCHEDULE_ROW, FUSED)),
        (_consumer_worker, (q_args, smem, bars, out_args, pieces, qk_scale, SPLIT, RANGES, SCHEDULE_ROW, FUSED)),
        (_loader, (pieces, c_desc, pe_desc, bt_ptr, stride_bt, kc, kp, ready, empty, page_size, SPLIT,
                   RANGES, SCHEDULE_ROW, LATE_TRIGGER)),
    ], [4, 1], [240, 24])


MAXNREG = 168  # as kernels_ws: 12 warps × 168 fill the register file; the consumers get 240, the loader 24


def cache_descriptor(cache, cols=64):
    """A TMA descriptor of the 16-bit cache's rows [pages · page_size, 576] for tiles of BLOCK_N keys × `cols` (64 or
    ROPE_HALF) columns in the stages' layout (a swizzle of cols · 2 bytes), made on the host and passed by value.
    Made in the loader (a 128-byte write to global memory and a proxy fence) it held each program's first load back
    1 µs: 16 heads −0.5 to −4.9% a call, 16 × 2 −0.5 to −1.1%; kernels_ws.py keeps its own, since on the host it
    was 1–2.6% slower at 128 heads (NOTES, issue 6, session ai)."""
    return TensorDescriptor(cache, [cache.shape[0] * cache.shape[1], cache.shape[2]], [cache.stride(1), 1],
                            [BLOCK_N, cols], _PIECE_LAYOUTS[cols])


# the stages' layouts of a 64-column piece and of a k_pe half (16-bit values), made once: each takes ~8 µs of host
# time to build, four times a TensorDescriptor's
_PIECE_LAYOUTS = {cols: gl.NVMMASharedLayout(swizzle_byte_width=2 * cols, element_bitwidth=16, rank=2)
                  for cols in (64, ROPE_HALF)}


def launch_programs(kernel, descs, q_nope, q_pe, cache, block_tables, seq_lens, o, lse, part_o, part_l, sched,
                    qk_scale, slots, pdl, merge_pdl, programs, **kernel_args):
    """Launch a Gluon kernel with this module's kernel's arguments (kernels_seesaw_t.py's too; descs: its cache
    descriptors) over (1, slots), one chunk a program, or over (1, programs), a launch of programs (programs > 0:
    schedule.py); kernel_args: the rows and the kernel's own arguments and constexprs."""
    batch, n_new, heads, _ = q_nope.shape
    kernel[(1, programs or slots)](
        q_nope, q_pe, *descs, block_tables, seq_lens, o, lse, part_o, part_l, sched,
        program_rows(sched, batch, slots) if programs else sched,
        *q_nope.stride()[:3], *q_pe.stride()[:3], block_tables.stride(0), n_new, heads, cache.shape[1], qk_scale,
        SPLIT=slots > batch or programs > 0, SCHEDULE_ROW=ROW, KV_LORA=512, ROPE=64, BLOCK_N=BLOCK_N,
        RANGES=programs > 0, PROGRAM_ROW=PROGRAM_ROW, USE_PDL=pdl, LATE_TRIGGER=merge_pdl, num_warps=4,
        maxnreg=MAXNREG, **kernel_args,
        **({"launch_pdl": True} if pdl else {}),
    )


def mla_decode_few(q_nope, q_pe, cache, block_tables, seq_lens, o, lse, part_o, part_l, sched, qk_scale, slots,
                   pdl=False, merge_pdl=False, programs=0, counters=None):
    """Launch over (1, slots) for ≤ MAX_ROWS rows (a block of 16), as kernels_ws.mla_decode_ws; programs > 0: over
    (1, programs), a launch of programs (schedule.py). counters: zeroed int32, two a sequence, for the in-kernel
    merge (FUSED); None: the merge kernel after this one merges the pieces."""
    descs = (cache_descriptor(cache), cache_descriptor(cache, ROPE_HALF))
    launch_programs(_mla_decode_few_kernel, descs, q_nope, q_pe, cache, block_tables, seq_lens, o, lse, part_o,
                    part_l, sched, qk_scale, slots, pdl, merge_pdl, programs, ROWS=16, NSTAGE=NSTAGE,
                    cnt_ptr=sched if counters is None else counters, FUSED=counters is not None)
