"""Warp-specialised attention prefill on Hopper, written in Gluon (FlashAttention-3's structure).

Why: the Triton prefill kernel (kernels._prefill_kernel) runs each 128-row block as 8 warps that load, score,
softmax and accumulate in one instruction stream; on the H100 it reached 0.83–0.88x of SDPA cuDNN at head dims
192/128 and 128 (benchmarks/NOTES.md, sessions s–u), and Triton 3.6's own warp specialisation does not compile that
loop. Here a program (128 or 192 query rows of one head and sequence) has partitions sharing the shared memory:
- a loader warp: Q once (at 192 = 128 + 64 its first 128 columns; the consumers hold the rest in registers), then
  K and V tiles of BLOCK_N keys through TMA into a ring of STAGES buffers (K and V with a ready barrier each, so the
  scores start before V lands), 64 columns a TMA message;
- two or three consumer warpgroups of 64 rows each, with FlashAttention-3's intra-warpgroup overlap: the scores of
  tile j (wgmma from shared memory) and P_{j−1} · V_{j−1} (P from registers) are issued together, the softmax of
  tile j runs while the tensor cores finish P_{j−1} · V_{j−1}, and only then is o rescaled. A stage goes back to
  the loader once every warpgroup is past its V. (FA3's ping-pong between warpgroups gained nothing on top.)
config picks warpgroups, tile and stages. Causal masks and the sequence end are applied only on the tiles that cut
them (the middle tiles run unmasked); rows past a sequence's queries and keys past its end arrive as zeros from
TMA and are masked or not stored. o leaves through the warpgroup's own Q buffer (free after its last scores), so
that whole rows are stored in 16-byte pieces. Outputs and LSE follow kernels._prefill_kernel (dense [B, S, H, D] or
packed varlen).
Scope: 16-bit q/k/v, q/k head dim 64, 128, 192 (128 + 64) or 256, v head dim 64 or 128 (≤ q/k's), causal or not;
windows, softcap, paged and FP8 keys stay on the Triton kernel.
Compiled kernels only: the interpreter cannot run Gluon, so CPU tests run kernels.py and this kernel is checked
against the reference on the GPU (`lmkernels check`)."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .kernels import head_dim_blocks

WG_ROWS = gl.constexpr(64)  # rows a consumer warpgroup (a program: 2 or 3 of them, config)
PIECE = gl.constexpr(64)  # columns a TMA message (128 bytes of 16-bit values: the swizzle width)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _maximum(a, b):
    """Reduction combiners of our own (as kernels_ws in the MLA family): gl.max / gl.sum's combiners become
    interpreter objects Gluon cannot call when TRITON_INTERPRET=1."""
    return gl.maximum(a, b)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _softmax(sc, m_i, l_i, n0, pos, offs_n, k_len, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """Online softmax step in base 2 on raw scores (the row max of q·k times the scale, then one FMA per score, as
    the FlashAttention tutorial does); MASK: keys past k_len or (CAUSAL) after the row's position are −inf."""
    if MASK:
        kn = n0 + offs_n
        ok = kn[None, :] < k_len
        if CAUSAL:
            ok = ok & (kn[None, :] <= pos[:, None])
        sc = gl.where(ok, sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.reduce(sc, 1, _maximum) * qk_scale)
    m_use = m_new
    if MASK:  # a row may have no key yet: keep exp2 away from (−inf) − (−inf)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, l_i * alpha + gl.reduce(p, 1, _add), alpha


@gluon.jit
def _scores(q_s, k_s, s_zero, DQK_HI: gl.constexpr):
    """Issue S = q · kᵀ (async), one wgmma a 64-column piece; q_s, k_s: (low, high) parts of the head dim (the high
    part DQK_HI columns, none where the dim is a power of 2: shared-memory shapes must be; q's high part is a
    register operand, _q_hi)."""
    q_lo, q_hi = q_s
    k_lo, k_hi = k_s
    sc = warpgroup_mma(q_lo.slice(0, PIECE, dim=1), k_lo.slice(0, PIECE, dim=1).permute((1, 0)), s_zero,
                       use_acc=False, is_async=True)
    for j in gl.static_range(1, q_lo.shape[1] // PIECE):
        sc = warpgroup_mma(q_lo.slice(j * PIECE, PIECE, dim=1), k_lo.slice(j * PIECE, PIECE, dim=1).permute((1, 0)),
                           sc, is_async=True)
    if DQK_HI > 0:
        sc = warpgroup_mma(q_hi, k_hi.permute((1, 0)), sc, is_async=True)
    return sc


@gluon.jit
def _q_hi(q_args, rows, q_len, DQK_HI: gl.constexpr, layout: gl.constexpr):
    """This warpgroup's rows of q's high part (q_args: its base and token stride) as the scores' register operand
    (rows past q_len 0), loaded once: with them out of shared memory three warpgroups × 4 stages fit at 192/128
    (209 KB; H100, session v: +4–10% over two warpgroups with q all in shared memory)."""
    q_base, stride_qt = q_args
    r = gl.convert_layout(rows, gl.SliceLayout(1, layout)).to(gl.int64)
    cols = gl.arange(0, DQK_HI, layout=gl.SliceLayout(0, layout))
    return gl.load(q_base + r[:, None] * stride_qt + cols[None, :], mask=(r < q_len)[:, None], other=0.0)


@gluon.jit
def _stage(bufs, s):
    """(low, high) K buffers of stage s."""
    lo, hi = bufs
    return lo.index(s), hi.index(s)


@gluon.jit
def _step(j, q_s, k_smem, v_smem, ready_k, ready_v, empty, acc, p, m_i, l_i, s_zero, pos, offs_n, k_len, qk_scale,
          MASK: gl.constexpr, CAUSAL: gl.constexpr, DQK_HI: gl.constexpr):
    """Tile j: issue its scores and the previous tile's P · V, softmax tile j while P · V runs, then rescale o."""
    STAGES: gl.constexpr = v_smem.shape[0]
    BLOCK_N: gl.constexpr = v_smem.shape[1]
    s = j % STAGES
    sp = (j - 1) % STAGES
    mbarrier.wait(ready_k.index(s), (j // STAGES) & 1)
    mbarrier.wait(ready_v.index(sp), ((j - 1) // STAGES) & 1)
    sc = _scores(q_s, _stage(k_smem, s), s_zero, DQK_HI)
    acc = warpgroup_mma(p, v_smem.index(sp), acc, is_async=True)
    sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
    p_new, m_i, l_i, alpha = _softmax(sc, m_i, l_i, j * BLOCK_N, pos, offs_n, k_len, qk_scale, MASK, CAUSAL)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
    mbarrier.arrive(empty.index(sp))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return acc, gl.convert_layout(p_new.to(p.dtype), p.type.layout), m_i, l_i


@gluon.jit
def _consumer(smem, bars, out_args, q_args, span, qk_scale, WG: gl.constexpr, CAUSAL: gl.constexpr,
              STORE_LSE: gl.constexpr, DQK_HI: gl.constexpr):
    """Warpgroup WG: rows m0 + 64 WG + [0, 64) of the block, over the block's key tiles (n_full unmasked first)."""
    q_smem, k_smem, v_smem = smem
    q_bar, ready_k, ready_v, empty = bars
    m0, q_len, k_len, n_tiles, n_full = span
    STAGES: gl.constexpr = v_smem.shape[0]
    BLOCK_N: gl.constexpr = v_smem.shape[1]
    DV: gl.constexpr = v_smem.shape[2]
    dtype: gl.constexpr = v_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_s = q_smem[WG]
    rows = m0 + WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=row_layout)
    if DQK_HI > 0:
        q_s = (q_s[0], _q_hi(q_args, rows, q_len, DQK_HI,
                             gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)))
    pos = rows + (k_len - q_len)  # query i sits at key position i + (k_len − q_len)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([WG_ROWS], gl.float32, layout=row_layout)
    acc = gl.zeros([WG_ROWS, DV], gl.float32, layout=o_layout)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    p = gl.zeros([WG_ROWS, BLOCK_N], dtype, layout=p_layout)
    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:  # tile 0: its scores alone (o is still 0)
        mbarrier.wait(ready_k.index(0), 0)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_s, _stage(k_smem, 0), s_zero, DQK_HI),))
        if n_full > 0:
            p0, m_i, l_i, alpha = _softmax(sc, m_i, l_i, 0, pos, offs_n, k_len, qk_scale, False, CAUSAL)
        else:
            p0, m_i, l_i, alpha = _softmax(sc, m_i, l_i, 0, pos, offs_n, k_len, qk_scale, True, CAUSAL)
        p = gl.convert_layout(p0.to(dtype), p_layout)
    for j in range(1, n_full):
        acc, p, m_i, l_i = _step(j, q_s, k_smem, v_smem, ready_k, ready_v, empty, acc, p, m_i, l_i, s_zero, pos,
                                 offs_n, k_len, qk_scale, False, CAUSAL, DQK_HI)
    for j in range(gl.maximum(n_full, 1), n_tiles):
        acc, p, m_i, l_i = _step(j, q_s, k_smem, v_smem, ready_k, ready_v, empty, acc, p, m_i, l_i, s_zero, pos,
                                 offs_n, k_len, qk_scale, True, CAUSAL, DQK_HI)
    if n_tiles > 0:  # the last tile's P · V
        sp = (n_tiles - 1) % STAGES
        mbarrier.wait(ready_v.index(sp), ((n_tiles - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(sp), acc, is_async=True)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
        mbarrier.arrive(empty.index(sp))
    _epilogue(acc, m_i, l_i, q_s[0], out_args, rows, q_len, STORE_LSE)


@gluon.jit
def _epilogue(acc, m_i, l_i, buf, out_args, rows, q_len, STORE_LSE: gl.constexpr):
    """o = acc / l through shared memory (buf: this warpgroup's Q buffer, free after its last scores), stored as
    whole rows in 16-byte pieces; rows past q_len not stored. LSE (natural log) where asked."""
    o_base, stride_ot, l_base, stride_lt = out_args
    WG_M: gl.constexpr = acc.shape[0]
    DV: gl.constexpr = acc.shape[1]
    o_dtype: gl.constexpr = o_base.dtype.element_ty
    VEC: gl.constexpr = 16 // (o_dtype.primitive_bitwidth // 8)
    empty_rows = l_i == 0.0  # no key allowed: o = 0, lse = −inf
    l_safe = gl.where(empty_rows, 1.0, l_i)
    out = (acc / gl.convert_layout(l_safe, gl.SliceLayout(1, acc.type.layout))[:, None]).to(o_dtype)
    staged = buf._reinterpret(o_dtype, [WG_M, DV], gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=o_dtype.primitive_bitwidth, rank=2))
    staged.store(out)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [4, 8], [4, 1], [1, 0])
    out = staged.load(rows_layout)
    r = rows.to(gl.int64)
    o_rows = gl.convert_layout(r, gl.SliceLayout(1, rows_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, rows_layout))
    gl.store(o_base + o_rows[:, None] * stride_ot + cols[None, :], out, mask=(o_rows < q_len)[:, None])
    if STORE_LSE:
        lse = gl.where(empty_rows, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
        gl.store(l_base + r * stride_lt, lse, mask=rows < q_len)


@gluon.jit
def _load_pieces(descs, row, bar, bufs, HI: gl.constexpr):
    """Rows [row, +box) of the (low, high: HI columns) parts of the head dim, 64 columns a TMA message, from the
    (low, high) descriptors into the (low, high) buffers."""
    lo, hi = bufs
    for j in gl.static_range(lo.shape[1] // PIECE):
        tma.async_copy_global_to_shared(descs[0], [row, j * PIECE], bar, lo.slice(j * PIECE, PIECE, dim=1))
    if HI > 0:
        for j in gl.static_range(HI // PIECE):
            tma.async_copy_global_to_shared(descs[1], [row, j * PIECE], bar, hi.slice(j * PIECE, PIECE, dim=1))


@gluon.jit
def _loader(q_base, k_base, kh_base, v_base, stride_qt, stride_kt, stride_kht, stride_vt, smem, bars, span,
            HEAD_DQK: gl.constexpr, DQK_HI: gl.constexpr, WGS: gl.constexpr):
    """Q's low part (every consumer warpgroup's rows) once, then tile t's K (low part from k_base, high part from
    kh_base) and V into stage t % STAGES once every consumer warpgroup has released it; rows past q_len / k_len
    arrive as zeros."""
    q_smem, k_smem, v_smem = smem
    q_bar, ready_k, ready_v, empty = bars
    m0, q_len, k_len, n_tiles, n_full = span
    STAGES: gl.constexpr = v_smem.shape[0]
    BLOCK_N: gl.constexpr = v_smem.shape[1]
    DV: gl.constexpr = v_smem.shape[2]
    elem: gl.constexpr = q_base.dtype.element_ty.primitive_bitwidth // 8
    layout: gl.constexpr = v_smem.layout
    DQK_LO: gl.constexpr = HEAD_DQK - DQK_HI
    q_desc = tma.make_tensor_descriptor(q_base, [q_len, DQK_LO], [stride_qt, 1], [WG_ROWS, PIECE], layout)
    rows = gl.maximum(k_len, 1)  # (no zero-sized descriptor; with no keys no tile is loaded)
    k_desc = tma.make_tensor_descriptor(k_base, [rows, DQK_LO], [stride_kt, 1], [BLOCK_N, PIECE], layout)
    k_descs = (k_desc, k_desc)
    if DQK_HI > 0:
        k_descs = (k_desc, tma.make_tensor_descriptor(kh_base, [rows, DQK_HI], [stride_kht, 1], [BLOCK_N, PIECE],
                                                      layout))
    v_desc = tma.make_tensor_descriptor(v_base, [rows, DV], [stride_vt, 1], [BLOCK_N, PIECE], layout)
    mbarrier.expect(q_bar, WGS * WG_ROWS * (HEAD_DQK - DQK_HI) * elem)  # (q's high part: the consumers, _q_hi)
    for w in gl.static_range(WGS):
        _load_pieces((q_desc, q_desc), m0 + w * WG_ROWS, q_bar, q_smem[w], 0)
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # fresh barriers count as released
        mbarrier.expect(ready_k.index(s), BLOCK_N * HEAD_DQK * elem)
        _load_pieces(k_descs, t * BLOCK_N, ready_k.index(s), _stage(k_smem, s), DQK_HI)
        mbarrier.expect(ready_v.index(s), BLOCK_N * DV * elem)
        _load_pieces((v_desc, v_desc), t * BLOCK_N, ready_v.index(s), (v_smem.index(s), v_smem.index(s)), 0)


@gluon.jit
def _prefill_ws_kernel(
    q_ptr, k_ptr, v_ptr, qh_ptr, kh_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_qhb, stride_qht, stride_qhh, stride_khb, stride_kht, stride_khh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, stride_lt, group, qk_scale,
    VARLEN: gl.constexpr, CAUSAL: gl.constexpr, STORE_LSE: gl.constexpr, HEAD_DQK: gl.constexpr,
    HEAD_DV: gl.constexpr, DQK_LO: gl.constexpr, DQK_HI: gl.constexpr, WGS: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, M_BAND: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    # launch order as kernels._prefill_kernel: bands of M_BAND query blocks, heaviest first, kv heads grouped
    if M_BAND == 1:
        head = gl.program_id(0)
        m_block = gl.num_programs(1) - 1 - gl.program_id(1)
    else:
        n_m = gl.num_programs(1)
        launch = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        band = launch // (gl.num_programs(0) * M_BAND)
        in_band = launch - band * gl.num_programs(0) * M_BAND
        kv_programs = group * gl.minimum(M_BAND, n_m - band * M_BAND)
        head = in_band // kv_programs * group + in_band % group
        m_block = n_m - 1 - band * M_BAND - in_band % kv_programs // group
    batch = gl.program_id(2)
    b64 = batch.to(gl.int64)
    if VARLEN:  # packed: the sequence's first token (stride_*b = 0)
        q_start = gl.load(cu_q_ptr + batch)
        q_len = gl.load(cu_q_ptr + batch + 1) - q_start
        k_start = gl.load(cu_k_ptr + batch)
        k_len = gl.load(cu_k_ptr + batch + 1) - k_start
        q_first = q_start.to(gl.int64)
        k_first = k_start.to(gl.int64)
    else:
        q_len = seqlen_q
        k_len = seqlen_k
        q_first = b64 * 0
        k_first = b64 * 0
    m0 = m_block * (WGS * WG_ROWS)
    if m0 >= q_len:
        return
    kv_head = head // group
    q_base = q_ptr + b64 * stride_qb + q_first * stride_qt + head * stride_qh
    k_base = k_ptr + b64 * stride_kb + k_first * stride_kt + kv_head * stride_kh
    v_base = v_ptr + b64 * stride_vb + k_first * stride_vt + kv_head * stride_vh
    qh_base = qh_ptr + b64 * stride_qhb + q_first * stride_qht + head * stride_qhh  # q's, k's high parts
    kh_base = kh_ptr + b64 * stride_khb + k_first * stride_kht + kv_head * stride_khh
    o_base = o_ptr + b64 * stride_ob + q_first * stride_ot + head * stride_oh
    l_base = lse_ptr + b64 * stride_lb + head * stride_lh + q_first * stride_lt
    # key tiles of the block: all up to the last row's position (causal) or k_len; unmasked: those before the first
    # row's position (causal) and the sequence end
    hi = k_len
    full = k_len
    if CAUSAL:
        shift = k_len - q_len
        hi = gl.minimum(k_len, gl.minimum(m0 + WGS * WG_ROWS, q_len) + shift)
        full = gl.minimum(k_len, m0 + shift + 1)
    n_tiles = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)
    n_full = gl.maximum(full, 0) // BLOCK_N
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # q/k head dim as DQK_LO + DQK_HI columns (192 = 128 + 64): shared-memory shapes are powers of 2
    # (without a high part the low buffers stand in for it, unused); q: its low part per warpgroup, in (low, high)
    # pairs whose high place the consumer fills with its registers (_q_hi)
    q_lo = gl.allocate_shared_memory(dtype, [2, WG_ROWS, DQK_LO], layout)
    k_lo = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DQK_LO], layout)
    k_smem = (k_lo, k_lo)
    if DQK_HI > 0:
        k_smem = (k_lo, gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DQK_HI], layout))
    q_smem = ((q_lo.index(0), q_lo.index(0)), (q_lo.index(1), q_lo.index(1)))
    if WGS == 3:  # a third warpgroup's rows in a buffer of its own (no [3, …] shape)
        q_lo3 = gl.allocate_shared_memory(dtype, [1, WG_ROWS, DQK_LO], layout)
        q_smem = (q_smem[0], q_smem[1], (q_lo3.index(0), q_lo3.index(0)))
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DV], layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_k.index(i), count=1)
        mbarrier.init(ready_v.index(i), count=1)
        mbarrier.init(empty.index(i), count=WGS)  # every consumer warpgroup
    fence_async_shared()
    smem = (q_smem, k_smem, v_smem)
    bars = (q_bar, ready_k, ready_v, empty)
    span = (m0, q_len, k_len, n_tiles, n_full)
    out_args = (o_base, stride_ot, l_base, stride_lt)
    q_args = (qh_base, stride_qht)
    if WGS == 3:
        gl.warp_specialize([
            (_consumer, (smem, bars, out_args, q_args, span, qk_scale, 0, CAUSAL, STORE_LSE, DQK_HI)),
            (_consumer, (smem, bars, out_args, q_args, span, qk_scale, 1, CAUSAL, STORE_LSE, DQK_HI)),
            (_consumer, (smem, bars, out_args, q_args, span, qk_scale, 2, CAUSAL, STORE_LSE, DQK_HI)),
            (_loader, (q_base, k_base, kh_base, v_base, stride_qt, stride_kt, stride_kht, stride_vt, smem, bars, span,
                       HEAD_DQK, DQK_HI, WGS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (smem, bars, out_args, q_args, span, qk_scale, 0, CAUSAL, STORE_LSE, DQK_HI)),
            (_consumer, (smem, bars, out_args, q_args, span, qk_scale, 1, CAUSAL, STORE_LSE, DQK_HI)),
            (_loader, (q_base, k_base, kh_base, v_base, stride_qt, stride_kt, stride_kht, stride_vt, smem, bars, span,
                       HEAD_DQK, DQK_HI, WGS)),
        ], [4, 1], [CONSUMER_REGS, 24])


# registers: as the MLA Gluon kernel (12 warps × MAXNREG; the loader keeps 24, each consumer warpgroup 240)
# registers by consumer warpgroups: all warps (rounded up to warpgroups) × MAXNREG fill the register file; the loader
# keeps 24, each consumer warpgroup the rest: 2 → 12 warps × 168, (3 · 168 − 24) / 2 = 240; 3 → 16 × 128, 160
REGS = {2: (168, 240), 3: (128, 160)}
TILES = None  # (warpgroups, BLOCK_N, STAGES) instead of config's (A/B)
SMEM_BYTES = 227 * 1024  # Hopper's shared memory a block may take
TRITON_VERSIONS = ("3.6",)  # Gluon's API moves between releases: only the triton it was built and checked with


def fits(wgs: int, block_n: int, stages: int, dqk: int, dv: int, elem: int = 2) -> bool:
    q_dim = head_dim_blocks(dqk)[0]  # (q's high part in registers)
    return wgs * WG_ROWS * q_dim * elem + stages * block_n * (dqk + dv) * elem + 1024 <= SMEM_BYTES


def config(dqk: int, dv: int, elem: int = 2):
    """(consumer warpgroups, BLOCK_N, STAGES): the first that fits the shared memory of three warpgroups × 4 stages,
    two × 4, two × 2 (stage counts powers of 2, as shared-memory shapes are); 128-key tiles at d64, else 64.
    H100 (benchmarks/NOTES.md, session u): 4 stages of 64-key tiles beat 2 of 128 by 4–8% at q/k dim ≥ 128 (tiles in
    flight, not their width); three warpgroups (192 rows a program: 1.5x less K/V read from L2 a FLOP) beat two by
    7–12% at d64 / d128 where 4 stages still fit, and lose 10–20% where they fit only 2 (192/128 with q all in shared
    memory; with q's high part in registers they fit 4 stages there: +4–10% at 8k and 4k, session v)."""
    block_n = 128 if dqk <= 64 else 64
    for wgs, stages in ((3, 4), (2, 4), (2, 2)):
        if fits(wgs, block_n, stages, dqk, dv, elem):
            return wgs, block_n, stages
    return None


def supported(q, k, v, dqk=None) -> bool:
    """Hopper, the checked triton, 16-bit q/k/v of one dtype (packed or dense keys: the caller rules out paged and
    FP8 ones, windows and softcap, and checks TMA alignment), q/k head dim 64, 128, 192 (128 + 64) or 256, v head
    dim 64 or 128 (≤ q/k's). dqk: q's and k's head dim where they hold only its low part (launch's q_hi, k_hi)."""
    dqk, dv = dqk or q.shape[-1], v.shape[-1]
    return (q.is_cuda and triton.__version__.startswith(TRITON_VERSIONS)
            and torch.cuda.get_device_capability(q.device) == (9, 0)
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and dqk in (64, 128, 192, 256) and dv in (64, 128) and dv <= dqk)


def launch(q, k, v, o, lse, cu_q, cu_k, seqlen_q, seqlen_k, max_seqlen_q, batch, strides, qk_scale, causal, m_band,
           q_hi=None, k_hi=None):
    """As kernels._launch_prefill's launch (strides: q, k, v, o, lse × (batch, token, head)); o/lse written.
    q_hi, k_hi: the high parts of q's and k's head dim (192 = 128 + 64) as tensors of their own, q and k then holding
    the low parts (kernels.prefill_split_qk); None: the high columns of q and k."""
    hq, hk = q.shape[-2], k.shape[-2]
    dqk, dv = q.shape[-1] + (0 if q_hi is None else q_hi.shape[-1]), v.shape[-1]
    wgs, block_n, stages = TILES or config(dqk, dv, q.element_size())
    maxnreg, consumer_regs = REGS[wgs]
    dqk_lo, dqk_hi = head_dim_blocks(dqk)
    if q_hi is None:  # (views past the low part; empty and never read where there is no high part)
        q_hi, k_hi = q[..., dqk_lo:], k[..., dqk_lo:]
    hi_strides = [x for t in (q_hi, k_hi) for x in ((0, *t.stride()[:2]) if t.dim() == 3 else t.stride()[:3])]
    grid = (hq, triton.cdiv(max_seqlen_q, wgs * WG_ROWS), batch)
    return_lse = lse.numel() > 0
    _prefill_ws_kernel[grid](
        q, k, v, q_hi, k_hi, o, lse if return_lse else o, cu_q, cu_k, seqlen_q, seqlen_k, *strides[:9], *hi_strides,
        *strides[9:], hq // hk, qk_scale,
        VARLEN=cu_q is not None, CAUSAL=causal, STORE_LSE=return_lse, HEAD_DQK=dqk, HEAD_DV=dv,
        DQK_LO=dqk_lo, DQK_HI=dqk_hi, WGS=wgs, BLOCK_N=block_n, STAGES=stages, M_BAND=m_band,
        CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg,
    )
