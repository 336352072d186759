"""Warp-specialised MLA decode on Hopper, written in Gluon: 64-row blocks (128 heads; 16 × 2 MTP rows padded
to 64, see kernels.decode_config).

Why: with 64 rows the Triton kernel (kernels.py) is one 8-warp program per SM whose QK wgmma, softmax and PV
wgmma run one after the other, at 35–41% of the bf16 GEMM rate; Triton 3.6's own warp specialisation declines
that loop (benchmarks/NOTES.md, issue 6). Here one program (a 64-row block of one sequence and one split of its
keys) has three partitions sharing the shared memory:
- a loader warp streams 64-key tiles of the latent cache ([64, 512] c_kv + [64, 64] k_pe) through TMA into a
  two-stage ring, one page-table read per tile (pages hold whole tiles: page_size % 64 == 0);
- two consumer warpgroups each own half of the 512 output columns. Each computes the full scores
  S = [q_lat | q_pe] · [c_kv | k_pe]ᵀ (64 × 64, wgmma from shared memory), the online softmax in base 2, and
  o_half += P · c_kv[:, half] (P from registers). The score work is done twice (once per warpgroup) so that
  neither ever waits for the other: while one runs its softmax, the other's wgmma has the tensor cores.
Keys past the sequence end inside the last tile are masked in S and their c_kv rows zeroed in shared memory
before P · c_kv (the page may hold anything there, NaN included). Outputs, LSE and split partials follow
kernels._mla_decode_kernel (SPLIT: partials for the merge kernel).
Compiled kernels only: the interpreter cannot run Gluon, so CPU tests run kernels.py and this kernel is checked
against the reference on the GPU (`lmkernels check`)."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

BLOCK_M = 64
BLOCK_N = 64
STAGES = 2
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _split_range(seq_len, split, chunk_min, num_splits, BLOCK_N: gl.constexpr):
    """As kernels._split_range: keys [start, end) of this split and the number of non-empty splits."""
    chunk = gl.maximum(((seq_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N, chunk_min)
    n_valid = gl.where(seq_len > 0, (seq_len + chunk - 1) // gl.maximum(chunk, 1), 0)
    start = split * chunk
    end = gl.minimum(start + chunk, seq_len)
    return start, end, n_valid


@gluon.jit
def _loader(c_ptr, bt_row, kc, kp, ready, empty, start, n_tiles, n_rows, page_size, stride_cr):
    BLOCK_N: gl.constexpr = kc.shape[1]
    KV_LORA: gl.constexpr = kc.shape[2]
    ROPE: gl.constexpr = kp.shape[2]
    layout_c: gl.constexpr = kc.layout
    layout_p: gl.constexpr = kp.layout
    c_desc = tma.make_tensor_descriptor(c_ptr, [n_rows, KV_LORA + ROPE], [stride_cr, 1], [BLOCK_N, KV_LORA], layout_c)
    p_desc = tma.make_tensor_descriptor(c_ptr, [n_rows, KV_LORA + ROPE], [stride_cr, 1], [BLOCK_N, ROPE], layout_p)
    stages: gl.constexpr = kc.shape[0]
    for i in range(n_tiles):
        s = i % stages
        n0 = start + i * BLOCK_N
        row = gl.load(bt_row + n0 // page_size).to(gl.int32) * page_size + n0 % page_size  # read while we wait
        mbarrier.wait(empty.index(s), (i // stages & 1) ^ 1)  # fresh barriers count as released
        bar = ready.index(s)
        mbarrier.expect(bar, BLOCK_N * (KV_LORA + ROPE) * c_ptr.dtype.element_ty.primitive_bitwidth // 8)
        tma.async_copy_global_to_shared(c_desc, [row, 0], bar, kc.index(s))
        tma.async_copy_global_to_shared(p_desc, [row, KV_LORA], bar, kp.index(s))


@gluon.jit
def _load_q(ctx, rows_args, HALF_IDX: gl.constexpr):
    """q rows (row r = new token r // heads, head r % heads) into shared memory: this warpgroup's half of q_lat
    (warpgroup 0 also q_pe), 64 columns at a time, while the loader's first tiles are on their way; then wait for
    the other warpgroup's half."""
    q_args, q_bar, q_smem, qp_smem, kc, kp, ready, empty = ctx
    qn_ptr, qp_ptr, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph = q_args
    m_block, b64, n_new, heads = rows_args
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    HALF: gl.constexpr = q_smem.shape[1] // 2
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    d = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
    row_ok = (r < n_new * heads)[:, None]
    qn_rows = qn_ptr + b64 * stride_qnb + (r // heads)[:, None] * stride_qnt + (r % heads)[:, None] * stride_qnh
    for col in gl.static_range(HALF_IDX * HALF, HALF_IDX * HALF + HALF, 64):
        q_smem.slice(col, 64, dim=1).store(gl.load(qn_rows + col + d[None, :], mask=row_ok, other=0.0))
    if HALF_IDX == 0:
        qp_smem.store(gl.load(qp_ptr + b64 * stride_qpb + (r // heads)[:, None] * stride_qpt
                              + (r % heads)[:, None] * stride_qph + d[None, :], mask=row_ok, other=0.0))
    fence_async_shared()
    mbarrier.arrive(q_bar)
    mbarrier.wait(q_bar, 0)


@gluon.jit
def _scores(q_smem, qp_smem, kct, kpt, s_zero):
    """S = [q_lat | q_pe] · [c_kv | k_pe]ᵀ of one tile, both operands from shared memory."""
    sc = warpgroup_mma(q_smem, kct.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sc = warpgroup_mma(qp_smem, kpt.permute((1, 0)), sc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(sc,))


@gluon.jit
def _maximum(a, b):
    """Reduction combiners of our own: gl.max and gl.sum wrap triton.language's, whose combiners become interpreter
    objects Gluon cannot call when TRITON_INTERPRET=1 (the CPU tests compile this kernel)."""
    return gl.maximum(a, b)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _softmax(sc, m_i, l_i, n0, end, pos, offs_n, qk_scale):
    """Online softmax step in base 2 (keys past the end or after a row's own position masked): P, the new row max
    and sum, and the factor that rescales what was accumulated under the old max."""
    kn = n0 + offs_n
    sc = gl.where((kn[None, :] < end) & (kn[None, :] <= pos[:, None]), sc * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.reduce(sc, 1, _maximum))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, l_i * alpha + gl.reduce(p, 1, _add), alpha


@gluon.jit
def _pv(a, v, acc, n0, end):
    """acc += a · v (a: P in registers; v: this warpgroup's columns of the tile's c_kv). The sequence's partial last
    tile first gets the rows past its end zeroed in v (the page may hold anything there, NaN included)."""
    BLOCK_N: gl.constexpr = v.shape[0]
    if n0 + BLOCK_N > end:
        zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        zr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, zero_layout))
        for c in gl.static_range(v.shape[1] // 64):
            part = v.slice(c * 64, 64, dim=1)
            x = part.load(zero_layout)
            part.store(gl.where((n0 + zr < end)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
    acc = warpgroup_mma(a, v, acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _epilogue(acc, m_i, l_i, out_args, rows_args, HALF_IDX: gl.constexpr):
    """o = acc / l for this warpgroup's columns; warpgroup 0 also stores the LSE."""
    o_ptr, lse_ptr, split, stride_ob, stride_ot, stride_oh, stride_os, stride_lb, stride_lt, stride_lh, stride_ls = \
        out_args
    m_block, b64, n_new, heads = rows_args
    BLOCK_M: gl.constexpr = acc.shape[0]
    HALF: gl.constexpr = acc.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    empty_rows = l_i == 0.0
    l_safe = gl.where(empty_rows, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = HALF_IDX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (o_ptr + b64 * stride_ob + (o_rows // heads)[:, None] * stride_ot + (o_rows % heads)[:, None] * stride_oh
              + split * stride_os + o_cols[None, :])
    gl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(o_rows < n_new * heads)[:, None])
    if HALF_IDX == 0:
        rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=m_i.type.layout)
        lse = gl.where(empty_rows, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
        gl.store(lse_ptr + b64 * stride_lb + (rows // heads) * stride_lt + (rows % heads) * stride_lh
                 + split * stride_ls, lse, mask=rows < n_new * heads)


@gluon.jit
def _consumer(ctx, out_args, rows_args, span, qk_scale, HALF_IDX: gl.constexpr):
    """Columns [HALF_IDX · 256, +256) of the output of one 64-row block over the split's tiles. Every tile's
    scores are computed in both warpgroups: twice the score work, but nothing to exchange (handing P over instead
    was no faster: benchmarks/NOTES.md, issue 6, session i)."""
    q_args, q_bar, q_smem, qp_smem, kc, kp, ready, empty = ctx
    start, end, n_tiles, seq_len = span
    m_block, b64, n_new, heads = rows_args
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    HALF: gl.constexpr = q_smem.shape[1] // 2
    BLOCK_N: gl.constexpr = kc.shape[1]
    stages: gl.constexpr = kc.shape[0]
    dtype: gl.constexpr = kc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)  # P in registers
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    _load_q(ctx, rows_args, HALF_IDX)
    rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
    pos = seq_len - n_new + rows // heads  # causal among the new tokens
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    for i in range(n_tiles):
        s = i % stages
        n0 = start + i * BLOCK_N
        mbarrier.wait(ready.index(s), i // stages & 1)
        sc = _scores(q_smem, qp_smem, kc.index(s), kp.index(s), s_zero)
        p, m_i, l_i, alpha = _softmax(sc, m_i, l_i, n0, end, pos, offs_n, qk_scale)
        acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
        acc = _pv(gl.convert_layout(p.to(dtype), p_layout), kc.index(s).slice(HALF_IDX * HALF, HALF, dim=1), acc,
                  n0, end)
        mbarrier.arrive(empty.index(s))
    _epilogue(acc, m_i, l_i, out_args, rows_args, HALF_IDX)


@gluon.jit
def _consumer_default(ctx, out_args, rows_args, span, qk_scale):
    _consumer(ctx, out_args, rows_args, span, qk_scale, 0)


@gluon.jit
def _consumer_worker(ctx, out_args, rows_args, span, qk_scale):
    _consumer(ctx, out_args, rows_args, span, qk_scale, 1)


@gluon.jit
def _mla_decode_ws_kernel(
    qn_ptr, qp_ptr, c_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr,
    stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph, stride_cr, stride_bt,
    stride_ob, stride_ot, stride_oh, stride_os, stride_lb, stride_lt, stride_lh, stride_ls,
    n_new, heads, page_size, n_rows, qk_scale, chunk_min, num_splits,
    SPLIT: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    m_block = gl.program_id(0)
    split = gl.program_id(1)
    batch = gl.program_id(2)
    seq_len = gl.load(len_ptr + batch)
    start, end, n_valid = _split_range(seq_len, split, chunk_min, num_splits, BLOCK_N)
    if SPLIT:
        if split >= n_valid:  # the merge skips these splits
            return
    b64 = batch.to(gl.int64)
    dtype: gl.constexpr = c_ptr.dtype.element_ty
    wide: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, KV_LORA], wide)
    qp_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], wide)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=2)  # each consumer warpgroup stores its half of q
    kc = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, KV_LORA], wide)
    kp = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], wide)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups release a stage
    n_tiles = (gl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N
    bt_row = bt_ptr + b64 * stride_bt
    q_args = (qn_ptr, qp_ptr, stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph)
    ctx = (q_args, q_bar, q_smem, qp_smem, kc, kp, ready, empty)
    out_args = (o_ptr, lse_ptr, split, stride_ob, stride_ot, stride_oh, stride_os, stride_lb, stride_lt, stride_lh,
                stride_ls)
    rows_args = (m_block, b64, n_new, heads)
    span = (start, end, n_tiles, seq_len)
    gl.warp_specialize([
        (_consumer_default, (ctx, out_args, rows_args, span, qk_scale)),
        (_consumer_worker, (ctx, out_args, rows_args, span, qk_scale)),
        (_loader, (c_ptr, bt_row, kc, kp, ready, empty, start, n_tiles, n_rows, page_size, stride_cr)),
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


def supported(q, cache, block_n=BLOCK_N):
    """Hopper (sm_90), a 16-bit cache in q's dtype, pages holding whole key tiles, TMA-aligned cache, a checked
    triton."""
    return (q.is_cuda and triton_ok() and torch.cuda.get_device_capability(q.device) == (9, 0)
            and q.dtype == cache.dtype and cache.dtype in (torch.bfloat16, torch.float16)
            and cache.shape[1] % block_n == 0 and cache.data_ptr() % 16 == 0)


def mla_decode_ws(q_nope, q_pe, cache, block_tables, seq_lens, out, out_l, os_, ls, qk_scale, chunk_min, num_splits,
                  block_n=BLOCK_N, stages=STAGES):
    """Launch over (m-blocks of 64 rows, splits, batch); out/out_l: the final o/lse (one split, os_/ls split
    strides 0) or fp32 partials [B, Q, H, S, 512] / [B, Q, H, S] for the merge kernel."""
    batch, n_new, heads, _ = q_nope.shape
    m_blocks = triton.cdiv(n_new * heads, BLOCK_M)
    _mla_decode_ws_kernel[(m_blocks, num_splits, batch)](
        q_nope, q_pe, cache, block_tables, seq_lens, out, out_l,
        *q_nope.stride()[:3], *q_pe.stride()[:3], cache.stride(1), block_tables.stride(0), *os_, *ls,
        n_new, heads, cache.shape[1], cache.shape[0] * cache.shape[1], qk_scale, chunk_min, num_splits,
        SPLIT=num_splits > 1, KV_LORA=512, ROPE=64, BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=stages,
        CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAXNREG,
    )
