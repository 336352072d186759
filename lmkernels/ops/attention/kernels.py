"""Triton kernels for attention: prefill (FlashAttention-2), paged decode (FlashDecoding), KV-cache writes, merges.

Prefill: a program owns BLOCK_M queries of one query head of one sequence (grid: query heads × query
blocks × batch, the longest causal blocks first). It streams the keys of its kv head in BLOCK_N tiles
with the online softmax in base 2 (scale·log2 e folded into the exp2 argument, fp32 accumulators), and visits
only the key tiles its rows may see: tiles above the causal diagonal, right of the right window edge or
left of the left window edge are never loaded. Of the visited tiles, only those that cut the diagonal,
a window edge or the sequence end are masked; the others run a mask-free loop. Tiles come through
per-sequence TMA tensor descriptors (PREFILL_TMA) or pointer tiles (cp.async); the paged variant
(append prefill) gathers its keys through the block table.

Decode: a program owns one kv head of one sequence and one split of its key range. Its M dimension is
all query heads of the kv-head group times the new tokens (q_per_seq), padded to ≥ 16 rows, so each
KV page is read once per group. Pages are gathered through the block table one key tile at a time.
With several splits each program writes an fp32 partial (o, lse) and a second small kernel merges them.
Split boundaries are fixed-size chunks (from the caller's bound on the context) of the sequence's length
read on the device, so the launch depends only on (batch, kv heads, num_splits): CUDA graphs can capture
it. Programs whose split starts past the end of their sequence return at once; the merge kernel knows
from the same length how many splits are real.
"""

import torch
import triton
import triton.language as tl

from ..._utils import gdc_launch_dependents, gdc_wait, interpreting, l2_bytes, pdl_enabled, sm_count

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
FP8_MAX = tl.constexpr(448.0)


# ---------------------------------------------------------------------------------------------------
# shared device helpers


@triton.jit
def _tanh(x):
    """tanh(x) = 1 − 2 / (e^{2x} + 1): exact limits ±1 at ±inf, absolute error ~1e-7 near 0."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _scores(qk, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """Raw q·k (fp32) → scores in log2 units: scale·qk·log2 e, or softcap·tanh(scale·qk / softcap)·log2 e."""
    if SOFTCAP:
        return _tanh(qk * cap_in) * cap_out
    else:
        return qk * qk_scale


@triton.jit
def _round_to_e4m3(x):
    """Round fp32 (|x| ≤ 448) to the nearest-even float8 e4m3 value, so the cast after it is exact.

    The GPU's conversion rounds correctly by itself; the Triton interpreter's does not (a value that
    rounds up to the next power of two comes out halved), and this costs a few integer ops per element
    in a memory-bound kernel. Normal range: round the fp32 mantissa to 3 bits (the carry runs into the
    exponent); below 2^-6 (e4m3 subnormals, step 2^-9): the 1.5·2^23 round-to-integer trick on |x|, with
    the sign bit put back (so tiny negatives give −0, bit for bit what torch's cast gives).
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    # subnormals on |x|, then x's sign put back: a negative value that rounds to zero is −0, as torch casts it
    sub = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    sub_bits = sub.to(tl.int32, bitcast=True) | sign
    return tl.where(tl.abs(x) < 0.015625, sub_bits, rounded).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------------------------------------------
# prefill


@triton.jit
def _load_kv(ptrs, mask, HAS_MASK: tl.constexpr, FP8: tl.constexpr, dtype: tl.constexpr):
    """A K or V tile in the compute dtype; masked lanes are 0 (never NaN from unwritten cache slots)."""
    if FP8:
        if HAS_MASK:  # fp8 loads take no `other` in the interpreter: zero the masked lanes after the cast
            return tl.where(mask, tl.load(ptrs, mask=mask).to(dtype), 0.0).to(dtype)
        else:
            return tl.load(ptrs).to(dtype)
    else:
        if HAS_MASK:
            return tl.load(ptrs, mask=mask, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _prefill_tile(
    acc, l_i, m_i, q, q_hi, k_base, v_base, k_desc, k_hi_desc, v_desc, bt_row, stride_kt, stride_vt, stride_kp,
    stride_vp, page_size, n0, pos, k_len, right, left, qk_scale, cap_in, cap_out, offs_n, offs_dqk, offs_dv,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    PAGED: tl.constexpr, FP8: tl.constexpr, TMA: tl.constexpr,
    HEAD_DQK: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DQK_HI: tl.constexpr,
):
    """One key tile [n0, n0 + BLOCK_N) of the online softmax; MASK: the tile cuts a boundary.

    TMA: K/V come through per-sequence tensor descriptors, which zero-fill rows past k_len and columns
    past the head dim, so no load needs a mask.
    DQK_HI > 0 (head_dims): the q/k head dim is BLOCK_DQK + DQK_HI columns (192 = 128 + 64), scored as two dots
    (q · kᵀ over the first BLOCK_DQK columns, q_hi · k_hiᵀ over the rest) instead of one padded to a power of 2."""
    kn = n0 + offs_n
    in_seq = kn < k_len
    if TMA:
        k_rows = kn
        v_rows = kn
    elif PAGED:  # key j lives in page bt_row[j // page_size], row j % page_size
        if MASK:
            page = tl.load(bt_row + kn // page_size, mask=in_seq, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + kn // page_size).to(tl.int64)
        k_rows = page * stride_kp + (kn % page_size) * stride_kt
        v_rows = page * stride_vp + (kn % page_size) * stride_vt
    else:
        k_rows = kn * stride_kt
        v_rows = kn * stride_vt
    dqk_ok = offs_dqk < HEAD_DQK
    dv_ok = offs_dv < HEAD_DV
    if TMA:
        k = k_desc.load([n0, 0])
    else:
        k = _load_kv(k_base + k_rows[:, None] + offs_dqk[None, :], in_seq[:, None] & dqk_ok[None, :],
                     MASK or HEAD_DQK != BLOCK_DQK + DQK_HI, FP8, q.dtype)
    s = tl.dot(q, tl.trans(k))
    if DQK_HI > 0:
        if TMA:
            k_hi = k_hi_desc.load([n0, BLOCK_DQK])
        else:
            offs_hi = BLOCK_DQK + tl.arange(0, DQK_HI)
            k_hi = _load_kv(k_base + k_rows[:, None] + offs_hi[None, :], in_seq[:, None], MASK, FP8, q.dtype)
        s = tl.dot(q_hi, tl.trans(k_hi), s)
    # Without softcap the scale is applied as the FlashAttention tutorial does: the row max of the raw
    # q·k times the scale (scale > 0), then p = exp2(qk·scale − m) as one FMA per score.
    if SOFTCAP:
        s = _scores(s, qk_scale, cap_in, cap_out, SOFTCAP)
    if MASK:
        ok = in_seq[None, :]
        if HAS_RIGHT:
            ok = ok & (kn[None, :] <= pos[:, None] + right)
        if HAS_LEFT:
            ok = ok & (kn[None, :] >= pos[:, None] - left)
        s = tl.where(ok, s, float("-inf"))
    if SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASK:  # a row may have seen no key yet: keep exp2 away from (−inf) − (−inf)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if SOFTCAP:
        p = tl.exp2(s - m_use[:, None])
    else:
        p = tl.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if TMA:
        v = v_desc.load([n0, 0])
    else:
        v = _load_kv(v_base + v_rows[:, None] + offs_dv[None, :], in_seq[:, None] & dv_ok[None, :],
                     MASK or HEAD_DV != BLOCK_DV, FP8, q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _prefill_span(
    acc, l_i, m_i, q, q_hi, k_base, v_base, k_desc, k_hi_desc, v_desc, bt_row, stride_kt, stride_vt, stride_kp,
    stride_vp, page_size, start, stop, pos, k_len, right, left, qk_scale, cap_in, cap_out, offs_n, offs_dqk, offs_dv,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    PAGED: tl.constexpr, FP8: tl.constexpr, TMA: tl.constexpr,
    HEAD_DQK: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DQK_HI: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Key tiles start, start + BLOCK_N, … < stop. On the GPU a `for` loop (software-pipelined); under the
    interpreter the same tiles in a `while` loop, because with numpy ≥ 2.4 the interpreter cannot turn its
    scalar tensors into range() bounds."""
    if INTERPRET:
        n0 = start
        while n0 < stop:
            acc, l_i, m_i = _prefill_tile(
                acc, l_i, m_i, q, q_hi, k_base, v_base, k_desc, k_hi_desc, v_desc, bt_row, stride_kt, stride_vt,
                stride_kp, stride_vp, page_size, n0, pos, k_len, right, left, qk_scale, cap_in, cap_out, offs_n,
                offs_dqk, offs_dv, MASK, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, FP8, TMA, HEAD_DQK, HEAD_DV, BLOCK_DQK,
                BLOCK_DV, DQK_HI)
            n0 += BLOCK_N
    else:
        for n0 in range(start, stop, BLOCK_N):
            acc, l_i, m_i = _prefill_tile(
                acc, l_i, m_i, q, q_hi, k_base, v_base, k_desc, k_hi_desc, v_desc, bt_row, stride_kt, stride_vt,
                stride_kp, stride_vp, page_size, n0, pos, k_len, right, left, qk_scale, cap_in, cap_out, offs_n,
                offs_dqk, offs_dv, MASK, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, FP8, TMA, HEAD_DQK, HEAD_DV, BLOCK_DQK,
                BLOCK_DV, DQK_HI)
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, ks_ptr, vs_ptr,
    seqlen_q, seqlen_k,  # dense layout only
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, stride_lt,
    stride_kp, stride_vp, stride_bt, page_size, stride_kscale, stride_vscale,  # paged only
    group, qk_scale, cap_in, cap_out, left, right,
    VARLEN: tl.constexpr, PAGED: tl.constexpr, FP8: tl.constexpr, TMA: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, STORE_LSE: tl.constexpr, HEAD_DQK: tl.constexpr,
    HEAD_DV: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr, DQK_HI: tl.constexpr = 0, M_BAND: tl.constexpr = 1,
):
    """Keys: packed (VARLEN, cu_k_ptr = offsets), dense, or paged (PAGED: cu_k_ptr = seq_lens, k/v = caches
    [pages, page_size, Hk, D] addressed through the block tables; stride_kt = a page's row stride).
    DQK_HI > 0: the q/k head dim is BLOCK_DQK + DQK_HI, scored as two dots (_prefill_tile)."""
    # The block scheduler starts programs x-fastest, in launch order, regrouped here into bands of M_BAND query
    # blocks (prefill_m_band), heaviest causal blocks (the last queries) first, so the short ones fill the tail
    # of the grid; within a band one kv head after another, each with its q heads and the band's blocks side by
    # side, so the programs running at once share their keys (DRAM once, then L2). With one block a band (every
    # head's heaviest block first), 128 heads at 8k kept ~1 block of each head running at a time, each reading
    # its keys from DRAM (H100, q/k dim 192: 363 against 496 TFLOP/s with bands of 16; NOTES, session s).
    if M_BAND == 1:
        head = tl.program_id(0)
        m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        n_m = tl.num_programs(1)
        launch = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        band = launch // (tl.num_programs(0) * M_BAND)
        in_band = launch - band * tl.num_programs(0) * M_BAND
        kv_programs = group * tl.minimum(M_BAND, n_m - band * M_BAND)  # (the last band may be short)
        head = in_band // kv_programs * group + in_band % group
        m_block = n_m - 1 - band * M_BAND - in_band % kv_programs // group
    batch = tl.program_id(2)
    k_start = tl.full([], 0, tl.int32)
    if VARLEN:
        q_start = tl.load(cu_q_ptr + batch)
        q_len = tl.load(cu_q_ptr + batch + 1) - q_start
        if PAGED:
            k_len = tl.load(cu_k_ptr + batch)
        else:
            k_start = tl.load(cu_k_ptr + batch)
            k_len = tl.load(cu_k_ptr + batch + 1) - k_start
    else:
        q_start = tl.full([], 0, tl.int32)
        q_len = seqlen_q
        k_len = seqlen_k
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    kv_head = head // group
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qt + head * stride_qh
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    bt_row = bt_ptr
    if PAGED:
        bt_row = bt_ptr + batch.to(tl.int64) * stride_bt
    if FP8:  # the cache holds x / scale: fold k's scale into the scores, v's into the output
        k_sc = tl.load(ks_ptr + kv_head * stride_kscale)
        qk_scale = qk_scale * k_sc
        cap_in = cap_in * k_sc

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < q_len
    if TMA:  # descriptors over this sequence and head: [len, head dim], rows/columns beyond read as 0
        q = tl.make_tensor_descriptor(q_base, [q_len, HEAD_DQK], [stride_qt, 1], [BLOCK_M, BLOCK_DQK]).load([m0, 0])
        rows = tl.maximum(k_len, 1)  # no zero-sized descriptor; with no keys no tile is loaded anyway
        k_desc = tl.make_tensor_descriptor(k_base, [rows, HEAD_DQK], [stride_kt, 1], [BLOCK_N, BLOCK_DQK])
        v_desc = tl.make_tensor_descriptor(v_base, [rows, HEAD_DV], [stride_vt, 1], [BLOCK_N, BLOCK_DV])
        q_hi, k_hi_desc = q, k_desc
        if DQK_HI > 0:
            q_hi = tl.make_tensor_descriptor(q_base, [q_len, HEAD_DQK], [stride_qt, 1],
                                             [BLOCK_M, DQK_HI]).load([m0, BLOCK_DQK])
            k_hi_desc = tl.make_tensor_descriptor(k_base, [rows, HEAD_DQK], [stride_kt, 1], [BLOCK_N, DQK_HI])
    else:
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_dqk[None, :],
                    mask=row_ok[:, None] & (offs_dqk < HEAD_DQK)[None, :], other=0.0)
        q_hi = q
        if DQK_HI > 0:
            q_hi = tl.load(q_base + offs_m[:, None] * stride_qt + (BLOCK_DQK + tl.arange(0, DQK_HI))[None, :],
                           mask=row_ok[:, None], other=0.0)
        k_desc = k_base
        k_hi_desc = k_base
        v_desc = v_base

    # Query i sits at key position i + (k_len − q_len). Key range of the block and its mask-free middle.
    shift = k_len - q_len
    first = m0 + shift
    last = tl.minimum(m0 + BLOCK_M, q_len) - 1 + shift
    pos = offs_m + shift
    if HAS_RIGHT:
        hi = tl.minimum(k_len, last + right + 1)
        full_hi = tl.maximum(tl.minimum(k_len, first + right + 1), 0) // BLOCK_N * BLOCK_N
    else:
        hi = k_len
        full_hi = k_len // BLOCK_N * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(first - left, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last - left, 0), BLOCK_N) * BLOCK_N
    else:
        lo = 0
        full_lo = 0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # left window edge (masked) | mask-free middle | diagonal, right edge and sequence end (masked)
    acc, l_i, m_i = _prefill_span(
        acc, l_i, m_i, q, q_hi, k_base, v_base, k_desc, k_hi_desc, v_desc, bt_row, stride_kt, stride_vt, stride_kp,
        stride_vp, page_size, lo, tl.minimum(full_lo, hi), pos, k_len, right, left, qk_scale, cap_in, cap_out, offs_n,
        offs_dqk, offs_dv, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, FP8, TMA, HEAD_DQK, HEAD_DV, BLOCK_DQK, BLOCK_DV,
        DQK_HI, BLOCK_N, INTERPRET)
    acc, l_i, m_i = _prefill_span(
        acc, l_i, m_i, q, q_hi, k_base, v_base, k_desc, k_hi_desc, v_desc, bt_row, stride_kt, stride_vt, stride_kp,
        stride_vp, page_size, full_lo, full_hi, pos, k_len, right, left, qk_scale, cap_in, cap_out, offs_n, offs_dqk,
        offs_dv, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, FP8, TMA, HEAD_DQK, HEAD_DV, BLOCK_DQK, BLOCK_DV, DQK_HI,
        BLOCK_N, INTERPRET)
    acc, l_i, m_i = _prefill_span(
        acc, l_i, m_i, q, q_hi, k_base, v_base, k_desc, k_hi_desc, v_desc, bt_row, stride_kt, stride_vt, stride_kp,
        stride_vp, page_size, tl.maximum(full_lo, full_hi), hi, pos, k_len, right, left, qk_scale, cap_in, cap_out,
        offs_n, offs_dqk, offs_dv, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, FP8, TMA, HEAD_DQK, HEAD_DV, BLOCK_DQK,
        BLOCK_DV, DQK_HI, BLOCK_N, INTERPRET)

    empty = l_i == 0.0  # no key allowed: o = 0, lse = −inf
    l_safe = tl.where(empty, 1.0, l_i)
    if FP8:
        out = acc * (tl.load(vs_ptr + kv_head * stride_vscale) / l_safe)[:, None]
    else:
        out = acc / l_safe[:, None]
    o_base = o_ptr + batch.to(tl.int64) * stride_ob + q_start.to(tl.int64) * stride_ot + head * stride_oh
    if TMA:  # the descriptor clips rows past q_len and columns past the head dim
        o_desc = tl.make_tensor_descriptor(o_base, [q_len, HEAD_DV], [stride_ot, 1], [BLOCK_M, BLOCK_DV])
        o_desc.store([m0, 0], out.to(o_ptr.dtype.element_ty))
    else:
        tl.store(o_base + offs_m[:, None] * stride_ot + offs_dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dv < HEAD_DV)[None, :])
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        l_base = lse_ptr + batch.to(tl.int64) * stride_lb + head * stride_lh + q_start.to(tl.int64) * stride_lt
        tl.store(l_base + offs_m * stride_lt, lse, mask=row_ok)


def prefill_config(head_dqk: int, head_dv: int, max_seqlen_q: int):
    """Launch parameters of the prefill kernel (the single place they are chosen), from the H100 sweep
    (triton 3.6; benchmarks/NOTES.md, "Issue 3"), at 8k causal unless said otherwise:

    - dims ≤ 128 (q/k 96 as 64 + 32, v 96 padded to 128): 128 queries × 128 keys, 8 warps (two warpgroups of
      64 rows for wgmma), 3 stages, pointer loads (224 KB shared memory, 255 registers, no spills). 480 TFLOP/s
      at 8k (128×64 with 4 stages: 486, within noise), 535 at 32k (128×64: 498–512), 529 non-causal. TMA
      descriptors were 5–8% slower at every tile shape.
    - dim 64: 128 × 64, 8 warps, 4 stages, pointers: 414 TFLOP/s; the old 128 × 128 / 3 stages gave 338.
    - dim 256: 128 × 64, 8 warps, 2 stages, TMA (522; pointers 508); 3 stages do not fit.
    - q/k 192 (scored as 128 + 64, head_dim_blocks) with v ≤ 128 (MLA prefill): 128 × 64, 8 warps, 3 stages,
      pointers (session s, 192/128, 128 heads 8k: 472; 3 stages TMA 439, 2 stages TMA 380).
    Short query runs (chunked-prefill tails, ≤ 64 tokens) take 64-row blocks and 4 warps so fewer rows idle.
    `tl.range(..., warp_specialize=True)` does not compile for this loop on sm_90 with triton 3.6 (the
    Hopper warp-specialisation pass asserts): the warp-specialised kernel is written in Gluon (prefill_ws.py) and
    takes over on Hopper where it applies (_use_ws).
    """
    width = max(triton.next_power_of_2(head_dqk), triton.next_power_of_2(head_dv))
    if head_dim_blocks(head_dqk)[1] and width == 256 and head_dv <= 128:  # 192 (= 128 + 64) / ≤ 128
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=False)
    elif width >= 256:
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, TMA=True)
    elif width == 128:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, TMA=False)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4, TMA=False)
    if max_seqlen_q <= 64:
        cfg.update(BLOCK_M=64, num_warps=4)
        if width >= 256:  # 64 × 64 tiles at dim 256 spill (48 bytes of stack) on the pointer path
            cfg.update(BLOCK_N=32)
        elif width == 128:
            cfg.update(BLOCK_N=64)
    return cfg


# Load q/k/v and store o of the (non-paged) prefill through per-sequence TMA tensor descriptors (Hopper's
# bulk tensor copy engine) instead of pointer tiles with cp.async. None: as prefill_config's TMA says
# (descriptors only where the tensors allow them: 16-byte aligned base and strides); True/False override
# it (gpu_selftest runs its checks both ways).
PREFILL_TMA = None


def _tma_ok(tensors, strides):
    """Device-side descriptors need 16-byte aligned bases and row/head/batch strides."""
    return all(t.data_ptr() % 16 == 0 for t in tensors) and all(
        (st * t.element_size()) % 16 == 0 for t, sts in zip(tensors, strides) for st in sts)


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator():
    """Device-side tensor descriptors need global scratch: give triton a torch-backed allocator unless the
    application installed its own. Triton keeps it in a ContextVar (per thread), so this runs every launch."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator

        if not isinstance(_allocator.get(), NullAllocator):
            return
    except Exception:  # internals moved: install ours
        pass
    triton.set_allocator(_torch_scratch)


def _launch_prefill(q, k, v, o, lse, cu_q, cu_k, block_tables, k_scale, v_scale, seqlen_q, seqlen_k, max_seqlen_q,
                    batch, strides, paged_strides, scale, causal, window, softcap, config):
    """strides: (q, k, v, o, lse) × (batch, token, head); paged_strides: (page k, page v, table row, page size)."""
    hq, dqk, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    hk = k.shape[-2]
    return_lse = lse.numel() > 0
    if batch == 0 or max_seqlen_q == 0 or hq == 0 or o.numel() == 0:
        lse.fill_(float("-inf"))
        return o.zero_(), lse
    cfg = dict(config or prefill_config(dqk, dv, max_seqlen_q))
    cfg.setdefault("M_BAND", prefill_m_band(hk, max(max_seqlen_q, seqlen_k), dqk + dv, q.element_size(), q.device))
    block_dqk, dqk_hi = head_dim_blocks(dqk)
    tma = cfg.pop("TMA", None)
    if PREFILL_TMA is not None:
        tma = PREFILL_TMA
    if tma is None or tma:
        tma = block_tables is None and _tma_ok((q, k, v, o), (strides[0:3], strides[3:6], strides[6:9], strides[9:12]))
    if tma and q.is_cuda:
        _ensure_allocator()
    left, right = window
    if causal:
        right = 0
    if (left < 0 and right <= 0 and softcap <= 0 and max_seqlen_q > 64
            and _use_ws(q, k, v, block_tables, k_scale, strides, config)):
        from . import prefill_ws

        _ensure_allocator()
        prefill_ws.launch(q, k, v, o, lse, cu_q, cu_k, seqlen_q, seqlen_k, max_seqlen_q, batch, strides,
                          scale * LOG2E, right == 0, cfg["M_BAND"])
        return o, lse
    fp8 = k_scale is not None
    qk_scale = scale * LOG2E
    cap_in, cap_out = (scale / softcap, softcap * LOG2E) if softcap > 0 else (0.0, 0.0)
    grid = (hq, triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), batch)
    _prefill_kernel[grid](
        q, k, v, o, lse if return_lse else None, cu_q, cu_k, block_tables, k_scale, v_scale, seqlen_q, seqlen_k,
        *strides, *paged_strides,
        (k_scale.stride(0) if k_scale.numel() > 1 else 0) if fp8 else 0,
        (v_scale.stride(0) if v_scale.numel() > 1 else 0) if fp8 else 0,
        hq // hk, qk_scale, cap_in, cap_out, max(left, 0), max(right, 0),
        VARLEN=cu_q is not None, PAGED=block_tables is not None, FP8=fp8, TMA=tma, HAS_LEFT=left >= 0,
        HAS_RIGHT=right >= 0,
        SOFTCAP=softcap > 0, STORE_LSE=return_lse, HEAD_DQK=dqk, HEAD_DV=dv, BLOCK_DQK=block_dqk, DQK_HI=dqk_hi,
        BLOCK_DV=triton.next_power_of_2(dv), INTERPRET=interpreting(), **cfg,
    )
    return o, lse


# The warp-specialised Gluon prefill (prefill_ws.py) where it applies: None = wherever prefill_ws.supported allows
# and no explicit config was given; True/False override it (A/B and gpu_selftest)
PREFILL_WS = None


def _use_ws(q, k, v, block_tables, k_scale, strides, config) -> bool:
    """Whether a prefill without window or softcap (causal or not) takes the Gluon kernel (the caller also keeps
    query runs of ≤ 64 tokens on the Triton kernel's 64-row blocks: the Gluon kernel's are 128 or 192 rows)."""
    if PREFILL_WS is False or (PREFILL_WS is None and config is not None) or interpreting() or not q.is_cuda:
        return False
    from . import prefill_ws

    return (block_tables is None and k_scale is None and prefill_ws.supported(q, k, v)
            and _tma_ok((q, k, v), (strides[0:3], strides[3:6], strides[6:9])))


def prefill_path(q, k, v, max_seqlen_q, causal=True) -> str:
    """Which kernel and tiles a (non-paged, windowless, softcap-free) prefill of these tensors takes: for benchmark
    notes."""
    strides = [x for t in (q, k, v) for x in ((0, *t.stride()[:2]) if t.dim() == 3 else t.stride()[:3])]
    if max_seqlen_q > 64 and _use_ws(q, k, v, None, None, strides, None):
        from . import prefill_ws

        wgs, block_n, stages = prefill_ws.TILES or prefill_ws.config(q.shape[-1], v.shape[-1], q.element_size())
        return f"Gluon warp-specialised {64 * wgs}x{block_n} s{stages}"
    cfg = prefill_config(q.shape[-1], v.shape[-1], max_seqlen_q)
    return (f"Triton {cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']} "
            f"{'tma' if cfg.get('TMA') else 'ptr'}")


# query blocks a band of the prefill kernel's launch order where its keys come from DRAM too often (_prefill_kernel)
PREFILL_M_BAND = 16
# programs of one kv head that the old order (every head's heaviest block first) runs at once, SMs / kv heads,
# below which its keys are read from DRAM again for most blocks
PREFILL_KV_SHARE = 16


def prefill_m_band(kv_heads: int, keys: int, dqk_dv: int, elem: int, device) -> int:
    """M_BAND of the prefill kernel: PREFILL_M_BAND where fewer than PREFILL_KV_SHARE programs of a kv head would
    run at once (many kv heads: MHA) and the kv heads' keys and values (the longest sequence's; `keys` at least
    the longest query run) outgrow half of L2; else 1, every head's heaviest block first (the shortest tail).
    H100, session s (TFLOP/s, bands of 1 / 16): 192/128 with 128 heads 8k 363 / 496, 16 heads 8k 450 / 471;
    d128 32/8 heads 2k 351 / 317, and no gain on the other GQA rows (16 programs of each of their 8 kv heads
    already run at once)."""
    few = kv_heads * PREFILL_KV_SHARE > sm_count(device)
    return PREFILL_M_BAND if few and kv_heads * keys * dqk_dv * elem > l2_bytes(device) // 2 else 1


def head_dim_blocks(dqk: int):
    """(BLOCK_DQK, DQK_HI) of the prefill kernel: a power-of-2 q/k head dim is one block (DQK_HI = 0); one that is
    the sum of two (96 = 64 + 32, 192 = 128 + 64) is two, scored as two dots, where padding it to the next power
    of 2 did a third more score work at 192 (MLA's q/k dim); any other dim is padded."""
    block = triton.next_power_of_2(dqk)
    hi = dqk - block // 2
    if block != dqk and hi >= 16 and hi & (hi - 1) == 0:
        return block // 2, hi
    return block, 0


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, causal, window, softcap, return_lse,
            config=None):
    """Varlen (q [Tq, Hq, Dqk] with cu_seqlens) or dense (q [B, Sq, Hq, Dqk]) → (o, lse); see attention_prefill."""
    dev = q.device
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
        n_q, hq, _ = q.shape
        o = torch.empty(n_q, hq, v.shape[2], dtype=q.dtype, device=dev)
        lse = torch.empty((hq, n_q) if return_lse else (0,), dtype=torch.float32, device=dev)
        strides = (0, *q.stride()[:2], 0, *k.stride()[:2], 0, *v.stride()[:2], 0, *o.stride()[:2],
                   0, *(lse.stride() if return_lse else (0, 0)))
        seqlen_q = seqlen_k = 0
    else:
        batch, seqlen_q, hq, _ = q.shape
        seqlen_k = k.shape[1]
        max_seqlen_q = seqlen_q
        o = torch.empty(batch, seqlen_q, hq, v.shape[3], dtype=q.dtype, device=dev)
        lse = torch.empty((batch, hq, seqlen_q) if return_lse else (0,), dtype=torch.float32, device=dev)
        strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                   *(lse.stride() if return_lse else (0, 0, 0)))
    return _launch_prefill(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, None, None, None, seqlen_q, seqlen_k,
                           max_seqlen_q, batch, strides, (0, 0, 0, 1), scale, causal, window, softcap, config)


def prefill_split_qk(q_lo, q_hi, k_lo, k_hi, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, causal):
    """Packed varlen prefill → (o [Tq, Hq, Dv], lse [Hq, Tq]) of q = [q_lo | q_hi] against k = [k_lo | k_hi], each
    part a tensor of its own (MLA prefill: q_nope | q_pe and k_nope | k_pe, k_pe shared by the heads with head
    stride 0), so that neither q nor k is concatenated: the Gluon kernel reads the parts where they lie. None where
    that kernel does not take them (not Hopper, a head dim other than a power of 2 plus half of it, query runs ≤ 64,
    parts TMA cannot read): the caller concatenates and calls attention_prefill. The caller checks the arguments."""
    dqk = q_lo.shape[-1] + q_hi.shape[-1]
    if (PREFILL_WS is False or interpreting() or not q_lo.is_cuda or max_seqlen_q <= 64 or q_lo.numel() == 0
            or head_dim_blocks(dqk) != (q_lo.shape[-1], q_hi.shape[-1])):
        return None
    from . import prefill_ws

    batch = cu_seqlens_q.shape[0] - 1
    n_q, hq, _ = q_lo.shape
    parts = (q_lo, k_lo, k_hi, v)
    part_strides = [(0, *t.stride()[:2]) for t in parts]
    if not (prefill_ws.supported(q_lo, k_lo, v, dqk) and q_hi.dtype == k_hi.dtype == q_lo.dtype
            and _tma_ok(parts, part_strides)):
        return None
    o = torch.empty(n_q, hq, v.shape[2], dtype=q_lo.dtype, device=q_lo.device)
    lse = torch.empty(hq, n_q, dtype=torch.float32, device=q_lo.device)
    strides = (*part_strides[0], *part_strides[1], *part_strides[3], 0, *o.stride()[:2], 0, *lse.stride())
    m_band = prefill_m_band(k_lo.shape[1], max_seqlen_q, dqk + v.shape[2], q_lo.element_size(), q_lo.device)
    _ensure_allocator()
    prefill_ws.launch(q_lo, k_lo, v, o, lse, cu_seqlens_q, cu_seqlens_k, 0, 0, max_seqlen_q, batch, strides,
                      scale * LOG2E, causal, m_band, q_hi=q_hi, k_hi=k_hi)
    return o, lse


def prefill_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale, causal, window,
                  softcap, k_scale, v_scale, return_lse, config=None):
    """q [Tq, Hq, Dqk] packed new tokens; keys: the first seq_lens[b] tokens of the paged caches."""
    dev = q.device
    batch = cu_seqlens_q.shape[0] - 1
    n_q, hq, _ = q.shape
    o = torch.empty(n_q, hq, v_cache.shape[3], dtype=q.dtype, device=dev)
    lse = torch.empty((hq, n_q) if return_lse else (0,), dtype=torch.float32, device=dev)
    # a cache row plays the token stride; the page stride and the table come as the paged strides
    strides = (0, *q.stride()[:2], 0, k_cache.stride(1), k_cache.stride(2), 0, v_cache.stride(1), v_cache.stride(2),
               0, *o.stride()[:2], 0, *(lse.stride() if return_lse else (0, 0)))
    paged = (k_cache.stride(0), v_cache.stride(0), block_tables.stride(0), k_cache.shape[1])
    return _launch_prefill(q, k_cache, v_cache, o, lse, cu_seqlens_q, seq_lens, block_tables, k_scale, v_scale, 0, 0,
                           max_seqlen_q, batch, strides, paged, scale, causal, window, softcap, config)


# ---------------------------------------------------------------------------------------------------
# paged KV-cache write


@triton.jit
def _write_rows(x_ptr, cache_ptr, scale_ptr, token, page, row, stride_xt, stride_xh, stride_cp, stride_cs,
                stride_ch, n_heads, stride_scale,
                HEAD_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < n_heads)[:, None] & (d < HEAD_D)[None, :]
    x = tl.load(x_ptr + token * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    if FP8:
        s = tl.load(scale_ptr + h * stride_scale, mask=h < n_heads, other=1.0)
        # IEEE division, as torch divides: `/` on fp32 compiles to div.full.f32 on the GPU (~2 ulp), which
        # moves a value that sits near the midpoint of two e4m3 neighbours to the other side now and then.
        x = tl.math.div_rn(x.to(tl.float32), tl.broadcast_to(s[:, None], x.shape))
        x = _round_to_e4m3(tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX))
    dst = cache_ptr + page * stride_cp + row * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    n_heads, page_size, stride_ks, stride_vs,
    HEAD_DK: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    page = slot // page_size
    row = slot % page_size
    _write_rows(k_ptr, kc_ptr, ks_ptr, token, page, row, stride_kt, stride_kh, stride_kcp, stride_kcs, stride_kch,
                n_heads, stride_ks, HEAD_DK, BLOCK_H, BLOCK_DK, FP8)
    _write_rows(v_ptr, vc_ptr, vs_ptr, token, page, row, stride_vt, stride_vh, stride_vcp, stride_vcs, stride_vch,
                n_heads, stride_vs, HEAD_DV, BLOCK_H, BLOCK_DV, FP8)


def write_kv_config(n_heads: int, dk: int, dv: int):
    """One token per program (its k and v rows, all heads); warps for ~8 elements per thread."""
    elems = triton.next_power_of_2(n_heads) * triton.next_power_of_2(max(dk, dv))
    return dict(num_warps=max(1, min(8, elems // 256)))


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    n_tokens, n_heads, dk = k.shape
    dv = v.shape[2]
    if n_tokens == 0:
        return
    fp8 = k_scale is not None
    _write_kv_kernel[(n_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        n_heads, k_cache.shape[1],
        (k_scale.stride(0) if k_scale.numel() > 1 else 0) if fp8 else 0,
        (v_scale.stride(0) if v_scale.numel() > 1 else 0) if fp8 else 0,
        HEAD_DK=dk, HEAD_DV=dv, BLOCK_H=triton.next_power_of_2(n_heads),
        BLOCK_DK=triton.next_power_of_2(dk), BLOCK_DV=triton.next_power_of_2(dv), FP8=fp8,
        **write_kv_config(n_heads, dk, dv),
    )


# ---------------------------------------------------------------------------------------------------
# paged decode


@triton.jit
def _split_range(seq_len, n_new, left, split, chunk_min, NUM_SPLITS: tl.constexpr, HAS_LEFT: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Keys [start, end) of split `split`, and how many splits are non-empty, from the length alone.

    The range is the keys any of the sequence's new tokens can see (from the first new token's left
    window edge, tile-aligned, to the end), cut into chunks of chunk_min keys (the same for every sequence,
    from the caller's bound on the context: a long sequence gets many splits, a short one few), or
    longer where NUM_SPLITS chunks of chunk_min would not cover the range (a bound that was too low
    costs balance, never keys).
    """
    lo = 0
    if HAS_LEFT:
        lo = tl.maximum(seq_len - n_new - left, 0) // BLOCK_N * BLOCK_N
    span = tl.maximum(seq_len - lo, 0)
    # chunk_min < 0: the floor follows the length (one sequence in a launch sized for its capacity, as CUDA
    # graphs are): up to −chunk_min keys, but short ranges still get SHORT_SPLITS splits of ≥ BLOCK_N keys
    by_length = tl.minimum(-chunk_min, tl.maximum(BLOCK_N, tl.cdiv(tl.cdiv(span, _SHORT_SPLITS), BLOCK_N) * BLOCK_N))
    floor = tl.where(chunk_min < 0, by_length, chunk_min)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N, floor)
    n_valid = tl.where(span > 0, tl.cdiv(span, tl.maximum(chunk, 1)), 0)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    return start, end, n_valid


@triton.jit
def _decode_q(q, FP8: tl.constexpr):
    """The decode kernels' dot dtype. An FP8 cache computes in fp16: e4m3 → fp16 is one conversion
    instruction per two values, e4m3 → bf16 goes through fp32. q beyond fp16's range is clamped (the dots
    accumulate in fp32; a query component above 65504 does not occur in a working model)."""
    if FP8:
        return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        return q


@triton.jit
def _decode_tile(
    acc, l_i, m_i, q, k_head, v_head, bt_row, n0, end, pos, left, page_size, stride_kp, stride_ks, stride_vp,
    stride_vs, qk_scale, cap_in, cap_out, offs_n, offs_dqk, offs_dv,
    HAS_LEFT: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr, HEAD_DQK: tl.constexpr, HEAD_DV: tl.constexpr,
):
    """Keys [n0, n0 + BLOCK_N) ∩ [.., end), gathered page by page through the block table."""
    kn = n0 + offs_n
    valid = kn < end
    page = tl.load(bt_row + kn // page_size, mask=valid, other=0).to(tl.int64)
    slot = kn % page_size
    k_ptrs = k_head + page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_dqk[None, :]
    v_ptrs = v_head + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_dv[None, :]
    k_mask = valid[:, None] & (offs_dqk < HEAD_DQK)[None, :]
    v_mask = valid[:, None] & (offs_dv < HEAD_DV)[None, :]
    if FP8:  # fp8 loads take no `other` (interpreter); zero the masked lanes after the cast
        k = tl.where(k_mask, tl.load(k_ptrs, mask=k_mask).to(q.dtype), 0.0).to(q.dtype)
    else:
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    s = _scores(tl.dot(q, tl.trans(k)), qk_scale, cap_in, cap_out, SOFTCAP)
    ok = valid[None, :] & (kn[None, :] <= pos[:, None])
    if HAS_LEFT:
        ok = ok & (kn[None, :] >= pos[:, None] - left)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        v = tl.where(v_mask, tl.load(v_ptrs, mask=v_mask).to(q.dtype), 0.0).to(q.dtype)
    else:
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, ks_ptr, vs_ptr,
    stride_qb, stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_ot, stride_oh, stride_os, stride_lb, stride_lt, stride_lh, stride_ls,
    n_new, group, page_size, qk_scale, cap_in, cap_out, left, chunk_min, stride_kscale, stride_vscale,
    NUM_SPLITS: tl.constexpr, HAS_LEFT: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
    STORE_LSE: tl.constexpr, HEAD_DQK: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr, USE_PDL: tl.constexpr,
):
    """o_ptr/lse_ptr: the final output (NUM_SPLITS == 1) or the fp32 partials [.., split, ..]."""
    if USE_PDL:  # launched early (PDL): wait for the kernels that wrote q and the cache, let the merge launch
        gdc_wait()
        gdc_launch_dependents()
    batch = tl.program_id(0)
    n_mblocks = tl.cdiv(n_new * group, BLOCK_M)
    kv_head = tl.program_id(1) // n_mblocks
    m_block = tl.program_id(1) % n_mblocks
    split = tl.program_id(2)
    seq_len = tl.load(len_ptr + batch)
    start, end, n_valid = _split_range(seq_len, n_new, left, split, chunk_min, NUM_SPLITS, HAS_LEFT, BLOCK_N)
    if NUM_SPLITS > 1:
        if split >= n_valid:  # the merge kernel skips these splits
            return

    # Row r of the tile: new token r // group, query head kv_head·group + r % group.
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // group
    head = kv_head * group + rows % group
    row_ok = rows < n_new * group
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + batch.to(tl.int64) * stride_qb + tok[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_dqk[None, :], mask=row_ok[:, None] & (offs_dqk < HEAD_DQK)[None, :], other=0.0)
    q = _decode_q(q, FP8)
    pos = seq_len - n_new + tok  # causal among the new tokens

    if FP8:
        k_sc = tl.load(ks_ptr + kv_head * stride_kscale)
        v_sc = tl.load(vs_ptr + kv_head * stride_vscale)
        qk_scale = qk_scale * k_sc
        cap_in = cap_in * k_sc
    bt_row = bt_ptr + batch.to(tl.int64) * stride_bt
    k_head = kc_ptr + kv_head * stride_kh
    v_head = vc_ptr + kv_head * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if INTERPRET:  # see _prefill_span: the interpreter cannot take tensor range() bounds
        n0 = start
        while n0 < end:
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, k_head, v_head, bt_row, n0, end, pos, left, page_size, stride_kp, stride_ks,
                stride_vp, stride_vs, qk_scale, cap_in, cap_out, offs_n, offs_dqk, offs_dv,
                HAS_LEFT, SOFTCAP, FP8, HEAD_DQK, HEAD_DV)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, k_head, v_head, bt_row, n0, end, pos, left, page_size, stride_kp, stride_ks,
                stride_vp, stride_vs, qk_scale, cap_in, cap_out, offs_n, offs_dqk, offs_dv,
                HAS_LEFT, SOFTCAP, FP8, HEAD_DQK, HEAD_DV)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if FP8:
        out = acc * (v_sc / l_safe)[:, None]
    else:
        out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    o_ptrs = (o_ptr + batch.to(tl.int64) * stride_ob + tok[:, None] * stride_ot + head[:, None] * stride_oh
              + split * stride_os + offs_dv[None, :])
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < HEAD_DV)[None, :])
    if STORE_LSE:
        l_ptrs = lse_ptr + batch.to(tl.int64) * stride_lb + tok * stride_lt + head * stride_lh + split * stride_ls
        tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, len_ptr, o_ptr, lse_ptr,
    stride_pb, stride_pt, stride_ph, stride_ps, stride_plb, stride_plt, stride_plh, stride_pls,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh,
    n_new, n_heads, left, chunk_min,
    NUM_SPLITS: tl.constexpr, HAS_LEFT: tl.constexpr, STORE_LSE: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One (sequence, new token, query head) row: o = Σ_s e^(lse_s − lse) o_s over the non-empty splits."""
    if USE_PDL:  # the next kernel (the o projection) may launch and load its first weights while this one waits
        gdc_launch_dependents()
        gdc_wait()
    batch = tl.program_id(0)
    tok = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    seq_len = tl.load(len_ptr + batch)
    _, _, n_valid = _split_range(seq_len, n_new, left, 0, chunk_min, NUM_SPLITS, HAS_LEFT, BLOCK_N)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_DV)
    s_ok = s < n_valid
    part = batch.to(tl.int64) * stride_pb + tok * stride_pt + head * stride_ph
    lse_s = tl.load(part_lse_ptr + batch.to(tl.int64) * stride_plb + tok * stride_plt + head * stride_plh
                    + s * stride_pls, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    o_s = tl.load(part_o_ptr + part + s[:, None] * stride_ps + d[None, :],
                  mask=s_ok[:, None] & (d < HEAD_DV)[None, :], other=0.0)
    out = tl.sum(o_s * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    base = batch.to(tl.int64) * stride_ob + tok * stride_ot + head * stride_oh
    tl.store(o_ptr + base + d, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DV)
    if STORE_LSE:
        lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
        tl.store(lse_ptr + batch.to(tl.int64) * stride_lb + tok * stride_lt + head * stride_lh, lse)


@triton.jit
def _pick(vec, sel):
    """The element of a 1-D tensor where `sel` (one-hot) is true, as a scalar."""
    return tl.sum(tl.where(sel, vec, 0), 0)


@triton.jit
def _decode_persistent_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, part_o_ptr, part_l_ptr, cnt_ptr, ks_ptr, vs_ptr,
    stride_qb, stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh,
    batch, n_new, group, n_kv, n_mblocks, page_size, qk_scale, cap_in, cap_out, left, stride_kscale, stride_vscale,
    HAS_LEFT: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr, STORE_LSE: tl.constexpr,
    HEAD_DQK: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Stream-K decode: the key tiles of all (sequence, kv head, row block) segments, laid end to end, are cut
    into equal contiguous ranges, one per program (a fixed grid of a few programs per SM).

    A program walks its range segment by segment. A segment it covers whole is finished and written at
    once; a piece of a segment is written as an fp32 partial (o, lse) into the program's slot 0 (its first
    segment) or 1 (its last), then the program counts itself in on the segment's counter, and the last of
    the segment's programs to arrive merges the pieces, writes the output and resets the counter to 0.
    Which programs share a segment follows from the ranges: program p owns tiles [p·per, (p+1)·per).
    """
    pid = tl.program_id(0)
    per_b = tl.arange(0, BLOCK_B)
    b_ok = per_b < batch
    lens = tl.load(len_ptr + per_b, mask=b_ok, other=0)
    if HAS_LEFT:  # first key tile any new token can see (the left window edge of the first new token)
        lo_b = tl.maximum(lens - n_new - left, 0) // BLOCK_N * BLOCK_N
    else:
        lo_b = tl.zeros([BLOCK_B], tl.int32)
    # ≥ 1 tile per segment, so that an empty sequence's segment is visited and writes o = 0, lse = −inf
    tiles_b = tl.where(b_ok, tl.maximum(tl.cdiv(lens - lo_b, BLOCK_N), 1), 0)
    n_segs = n_kv * n_mblocks
    work_b = tiles_b.to(tl.int64) * n_segs
    end_b = tl.cumsum(work_b, 0)
    total = tl.sum(work_b, 0)
    per = tl.maximum(tl.cdiv(total, tl.num_programs(0)), 1)
    w_first = pid.to(tl.int64) * per
    w_stop = tl.minimum(w_first + per, total)

    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    dv_ok = offs_dv < HEAD_DV
    w = w_first
    while w < w_stop:
        b = tl.sum((end_b <= w).to(tl.int32), 0)
        sel = per_b == b
        nt = _pick(tiles_b, sel).to(tl.int64)
        seq_len = _pick(lens, sel)
        lo = _pick(lo_b, sel)
        seg_base = _pick(end_b - work_b, sel)
        seg = (w - seg_base) // nt
        t0 = w - seg_base - seg * nt
        t1 = tl.minimum(nt, t0 + (w_stop - w))
        kv_head = (seg // n_mblocks).to(tl.int32)
        m_block = (seg % n_mblocks).to(tl.int32)

        # Row r of the tile: new token r // group, query head kv_head·group + r % group.
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rows // group
        head = kv_head * group + rows % group
        row_ok = rows < n_new * group
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + tok[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_dqk[None, :], mask=row_ok[:, None] & (offs_dqk < HEAD_DQK)[None, :], other=0.0)
        q = _decode_q(q, FP8)
        pos = seq_len - n_new + tok  # causal among the new tokens
        sc_qk = qk_scale
        sc_in = cap_in
        if FP8:
            k_sc = tl.load(ks_ptr + kv_head * stride_kscale)
            sc_qk = qk_scale * k_sc
            sc_in = cap_in * k_sc
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        k_head = kc_ptr + kv_head * stride_kh
        v_head = vc_ptr + kv_head * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        start = lo + (t0 * BLOCK_N).to(tl.int32)
        stop = tl.minimum(lo + (t1 * BLOCK_N).to(tl.int32), seq_len)
        if INTERPRET:  # see _prefill_span: the interpreter cannot take tensor range() bounds
            n0 = start
            while n0 < stop:
                acc, l_i, m_i = _decode_tile(
                    acc, l_i, m_i, q, k_head, v_head, bt_row, n0, seq_len, pos, left, page_size, stride_kp,
                    stride_ks, stride_vp, stride_vs, sc_qk, sc_in, cap_out, offs_n, offs_dqk, offs_dv,
                    HAS_LEFT, SOFTCAP, FP8, HEAD_DQK, HEAD_DV)
                n0 += BLOCK_N
        else:
            for n0 in range(start, stop, BLOCK_N):
                acc, l_i, m_i = _decode_tile(
                    acc, l_i, m_i, q, k_head, v_head, bt_row, n0, seq_len, pos, left, page_size, stride_kp,
                    stride_ks, stride_vp, stride_vs, sc_qk, sc_in, cap_out, offs_n, offs_dqk, offs_dv,
                    HAS_LEFT, SOFTCAP, FP8, HEAD_DQK, HEAD_DV)
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        if FP8:
            out = acc * (tl.load(vs_ptr + kv_head * stride_vscale) / l_safe)[:, None]
        else:
            out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        o_ptrs = (o_ptr + b.to(tl.int64) * stride_ob + tok[:, None] * stride_ot + head[:, None] * stride_oh
                  + offs_dv[None, :])
        o_mask = row_ok[:, None] & dv_ok[None, :]
        if (t0 == 0) & (t1 == nt):  # the whole segment: final output
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=o_mask)
            if STORE_LSE:
                tl.store(lse_ptr + b.to(tl.int64) * stride_lb + tok * stride_lt + head * stride_lh, lse, mask=row_ok)
        else:
            slot = pid * 2 + (w != w_first).to(tl.int32)
            p_rows = tl.arange(0, BLOCK_M)
            tl.store(part_o_ptr + slot.to(tl.int64) * (BLOCK_M * BLOCK_DV) + p_rows[:, None] * BLOCK_DV
                     + offs_dv[None, :], out, mask=o_mask)
            tl.store(part_l_ptr + slot.to(tl.int64) * BLOCK_M + p_rows, lse, mask=row_ok)
            tl.debug_barrier()  # every thread's partial is written before the counter says so (release below)
            g_start = seg_base + seg * nt
            p_first = g_start // per
            n_pieces = (g_start + nt - 1) // per - p_first + 1
            counter = cnt_ptr + b.to(tl.int64) * n_segs + seg
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == n_pieces - 1:  # the last piece of the segment: merge all (this one included)
                first_slot = p_first * 2 + (p_first * per != g_start).to(tl.int64)
                # [BLOCK_R rows × BLOCK_S pieces] per step, loaded at once (one L2 round trip per step, not
                # one per piece; BLOCK_R · BLOCK_S = 32 keeps the tile at 32 registers a thread): BLOCK_R covers
                # this block's valid rows
                r = tl.arange(0, BLOCK_R)
                r_ok = m_block * BLOCK_M + r < n_new * group
                m_all = tl.full([BLOCK_R], float("-inf"), tl.float32)
                l_all = tl.zeros([BLOCK_R], tl.float32)
                o_all = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
                if INTERPRET:
                    j0 = 0
                    while j0 < n_pieces:
                        m_all, l_all, o_all = _merge_pieces(
                            m_all, l_all, o_all, part_o_ptr, part_l_ptr, j0, n_pieces, first_slot, p_first, r, r_ok,
                            offs_dv, dv_ok, BLOCK_M, BLOCK_DV, BLOCK_S)
                        j0 += BLOCK_S
                else:
                    for j0 in range(0, n_pieces, BLOCK_S):
                        m_all, l_all, o_all = _merge_pieces(
                            m_all, l_all, o_all, part_o_ptr, part_l_ptr, j0, n_pieces, first_slot, p_first, r, r_ok,
                            offs_dv, dv_ok, BLOCK_M, BLOCK_DV, BLOCK_S)
                none = l_all == 0.0
                l_all = tl.where(none, 1.0, l_all)
                rows_r = m_block * BLOCK_M + r
                tok_r = rows_r // group
                head_r = kv_head * group + rows_r % group
                tl.store(o_ptr + b.to(tl.int64) * stride_ob + tok_r[:, None] * stride_ot + head_r[:, None] * stride_oh
                         + offs_dv[None, :], (o_all / l_all[:, None]).to(o_ptr.dtype.element_ty),
                         mask=r_ok[:, None] & dv_ok[None, :])
                if STORE_LSE:
                    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
                    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + tok_r * stride_lt + head_r * stride_lh,
                             tl.where(none, float("-inf"), m_all + tl.log(l_all)), mask=r_ok)
                tl.store(counter, 0)  # ready for the next launch
        w += t1 - t0


@triton.jit
def _merge_pieces(m_all, l_all, o_all, part_o_ptr, part_l_ptr, j0, n_pieces, first_slot, p_first, r, r_ok, offs_dv,
                  dv_ok, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    """Fold pieces j0 … j0 + BLOCK_S − 1 of a segment (piece 0 in slot first_slot, piece j > 0 in slot 0 of
    program p_first + j) into the running per-row (max lse, Σ weights, Σ weight · o). One [rows, pieces, dv]
    load; the loads bypass L1 (other SMs wrote these)."""
    j = j0 + tl.arange(0, BLOCK_S)
    slot = tl.where(j == 0, first_slot, (p_first + j) * 2)
    ok = r_ok[:, None] & (j < n_pieces)[None, :]
    lse = tl.load(part_l_ptr + slot[None, :] * BLOCK_M + r[:, None], mask=ok, other=float("-inf"),
                  cache_modifier=".cg")
    o = tl.load(part_o_ptr + slot[None, :, None] * (BLOCK_M * BLOCK_DV) + r[:, None, None] * BLOCK_DV
                + offs_dv[None, None, :], mask=ok[:, :, None] & dv_ok[None, None, :], other=0.0, cache_modifier=".cg")
    m_new = tl.maximum(m_all, tl.max(lse, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_all - m_safe)
    wgt = tl.exp(lse - m_safe[:, None])
    return m_new, l_all * alpha + tl.sum(wgt, 1), o_all * alpha[:, None] + tl.sum(o * wgt[:, :, None], 1)


MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs (q load, partial write, merge) dominate …
SHORT_SPLITS = 8  # … except that short contexts still get up to 8 splits of ≥ 64 keys (B=1 at 512: 13.8 → 9.2 µs)
_SHORT_SPLITS = tl.constexpr(SHORT_SPLITS)  # the same, for _split_range
MIN_CHUNK = 512  # keys per split when splitting only to spread one long sequence
MAX_SPLITS = 64


def decode_merge_warps(block_s: int, dv: int) -> int:
    """Warps of _decode_merge_kernel: ~128 partial values a thread. Its [splits, dv] block lays the warps along the
    splits, so each warp more is a sum crossing warps through shared memory; H200 (benchmarks/NOTES.md, session al,
    al-13), B=1 d128 against block_s · dv / 1024 warps: 32 splits at 1 warp −4 to −5% a call (8k, 32/8, 64/8 and 8/1
    heads), 64 splits at 2 −4% (32k), level at 2k."""
    return max(1, min(8, block_s * triton.next_power_of_2(dv) // 4096))


def decode_num_splits(batch: int, kv_heads: int, m_blocks: int, max_context: int, num_sms: int) -> int:
    """Splits of the key range: the larger of two needs, each program keeping ≥ 256 keys (short contexts:
    up to SHORT_SPLITS splits of ≥ 64 keys).

    fill: a batch of equal sequences gives ~2 programs per SM (B=1 at 8k with 8 kv heads: 32 splits of 256).
    long: the longest possible sequence alone gives ~2 programs per SM with ≥ 512-key chunks, so a
    skewed batch (one 32k sequence among short ones) does not wait on a few programs walking the long
    one (chunks are fixed by max_context, so the short sequences use one split, their other programs exit).
    Depends only on shapes and the caller's bound on the context, never on the lengths (CUDA graphs).
    """
    programs = max(1, batch * kv_heads * m_blocks)
    fill = triton.cdiv(2 * num_sms, programs)
    chunk_long = max(MIN_CHUNK, triton.cdiv(max_context * kv_heads * m_blocks, 2 * num_sms))
    long = triton.cdiv(max_context, chunk_long)
    fit = max(1, max_context // MIN_KEYS_PER_SPLIT, min(SHORT_SPLITS, max_context // 64))
    return max(1, min(max(fill, long), fit, MAX_SPLITS))


def decode_chunk(max_context: int, num_splits: int, block_n: int) -> int:
    """Keys per split for every sequence (0 with one split): max_context cut into num_splits tiles-aligned chunks."""
    if num_splits <= 1:
        return 0
    return triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n


def decode_config(head_dqk: int, head_dv: int, rows: int, fp8: bool = False, single: bool = False):
    """Launch parameters of the decode kernels (memory-bound), from the H100 sweeps in benchmarks/NOTES.md.

    Head dims ≤ 128 with ≤ 8 rows (a GQA group of ≤ 8, one new token): 128-key tiles, 3 stages (72 KB of
    shared memory, ~225 registers, 2 programs per SM); 0–6% faster than 64-key tiles with 5 stages on every
    measured batch. An FP8 cache: 5 stages (105 KB; +7% at B=32, 4k: half the bytes per tile need more
    tiles in flight). A single sequence (split-KV, `single`): 64-key tiles, 5 stages (+8% at 8k over the
    persistent schedule's best). More rows (speculative tokens × group): 64-key tiles, 5 stages (128
    spill); 64 rows or dim 256: 32-key tiles, 5 stages (the 128-key tile at dim 256 would need ~200 KB).
    BLOCK_M holds the kv-head group × new tokens (≥ 16 for tl.dot), at most 64 rows per program.
    PROGRAMS_PER_SM: the persistent (stream-K) grid; 2 = what fits, 1 and 3 were 10–25% slower (one
    program per SM keeps too few loads in flight; three make a second partial wave).
    """
    width = max(triton.next_power_of_2(head_dqk), triton.next_power_of_2(head_dv))
    block_m = max(16, min(64, triton.next_power_of_2(rows)))
    if width >= 256 or block_m >= 64:
        return dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=4, num_stages=5, PROGRAMS_PER_SM=2)
    # 128-key tiles spill with 16–32 rows (ptxas: 56–112 bytes of stack); one sequence: measured best
    if rows > 8 or single:
        return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=4, num_stages=5, PROGRAMS_PER_SM=2)
    return dict(BLOCK_M=block_m, BLOCK_N=128, num_warps=4, num_stages=5 if fp8 else 3, PROGRAMS_PER_SM=2)


# The persistent schedule loads every sequence length into each program (a vector of next_pow2(batch)):
# above this batch the split-KV schedule runs instead (large batches fill the GPU by themselves). A single
# sequence takes split-KV too: nothing to balance, and its separate merge beat the in-kernel one by 5–8%.
PERSISTENT_MAX_BATCH = 1024
_COUNTERS = {}


def _counters(device, n: int):
    """Zeroed int32 segment counters of the persistent decode, one buffer per device, kept between calls:
    the last program of each segment resets its counter, so the buffer is all zeros after every launch
    (no memset per call, CUDA-graph safe). Decode launches on one device must therefore not run
    concurrently on several streams. A buffer first needed during graph capture is made inside the graph
    (its zeroing is then part of every replay) and not kept."""
    key = (device.type, device.index if device.index is not None else
           (torch.cuda.current_device() if device.type == "cuda" else 0))
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _COUNTERS[key] = buf
    return buf


def decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, num_splits, max_context,
           k_scale, v_scale, return_lse, config=None):
    """q [B, Q, Hq, Dqk], caches [pages, page_size, Hk, D] → (o [B, Q, Hq, Dv], lse [B, Q, Hq] or empty).

    num_splits None: the persistent stream-K schedule for 2 … PERSISTENT_MAX_BATCH sequences, split-KV with
    the heuristic's count for one sequence or more than the limit; a number: split-KV with that many splits."""
    batch, n_new, hq, dqk = q.shape
    hk, dv = k_cache.shape[2], v_cache.shape[3]
    group = hq // hk
    o = torch.empty(batch, n_new, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, n_new, hq) if return_lse else (0,), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse.fill_(float("-inf"))
    persistent = num_splits is None and 1 < batch <= PERSISTENT_MAX_BATCH
    cfg = dict(config or decode_config(dqk, dv, n_new * group, fp8=k_scale is not None, single=batch == 1))
    per_sm = cfg.pop("PROGRAMS_PER_SM", 2)
    programs = cfg.pop("PROGRAMS", None)  # an exact grid (tests)
    m_blocks = triton.cdiv(n_new * group, cfg["BLOCK_M"])
    left = window[0]
    fp8 = k_scale is not None
    qk_scale = scale * LOG2E
    cap_in, cap_out = (scale / softcap, softcap * LOG2E) if softcap > 0 else (0.0, 0.0)
    scale_strides = ((k_scale.stride(0) if k_scale.numel() > 1 else 0) if fp8 else 0,
                     (v_scale.stride(0) if v_scale.numel() > 1 else 0) if fp8 else 0)
    common = dict(HAS_LEFT=left >= 0, HEAD_DV=dv)
    if persistent:
        grid = programs or per_sm * sm_count(q.device)
        block_m, block_dv = cfg["BLOCK_M"], triton.next_power_of_2(dv)
        block_r = min(block_m, triton.next_power_of_2(n_new * group))  # the merge's rows: all valid ones of a block
        part_o = torch.empty(grid * 2 * block_m * block_dv, dtype=torch.float32, device=q.device)
        part_l = torch.empty(grid * 2 * block_m, dtype=torch.float32, device=q.device)
        counters = _counters(q.device, batch * hk * m_blocks)
        _decode_persistent_kernel[(grid,)](
            q, k_cache, v_cache, block_tables, seq_lens, o, lse if return_lse else None, part_o, part_l, counters,
            k_scale, v_scale,
            *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
            *o.stride()[:3], *(lse.stride() if return_lse else (0, 0, 0)),
            batch, n_new, group, hk, m_blocks, k_cache.shape[1], qk_scale, cap_in, cap_out, max(left, 0),
            *scale_strides,
            SOFTCAP=softcap > 0, FP8=fp8, STORE_LSE=return_lse, HEAD_DQK=dqk, BLOCK_DQK=triton.next_power_of_2(dqk),
            BLOCK_DV=block_dv, BLOCK_B=triton.next_power_of_2(batch), BLOCK_R=block_r, BLOCK_S=max(1, 32 // block_r),
            INTERPRET=interpreting(), **common, **cfg,
        )
        return o, lse
    explicit_splits = num_splits is not None
    if num_splits is None:
        num_splits = decode_num_splits(batch, hk, m_blocks, max_context, sm_count(q.device))
    chunk_min = decode_chunk(max_context, num_splits, cfg["BLOCK_N"])
    if batch == 1 and num_splits > 1 and not explicit_splits:
        # one sequence: split by its actual length, as decode_num_splits would for max_context = seq_len (a graph
        # captured for the cache's capacity then still gives a 512-key context 8 splits, not 2)
        chunk_min = -MIN_KEYS_PER_SPLIT
    block_s = triton.next_power_of_2(num_splits)
    grid = (batch, hk * m_blocks, num_splits)
    pdl = pdl_enabled(q.device)  # both kernels wait for their inputs first: safe after any kernel
    launch = {"launch_pdl": True} if pdl else {}
    if num_splits == 1:
        out, out_lse, os_, ls = o, lse, (*o.stride()[:3], 0), ((*lse.stride(), 0) if return_lse else (0,) * 4)
    else:
        out = torch.empty(batch, n_new, hq, num_splits, dv, dtype=torch.float32, device=q.device)
        out_lse = torch.empty(batch, n_new, hq, num_splits, dtype=torch.float32, device=q.device)
        os_, ls = out.stride()[:4], out_lse.stride()
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, out_lse if num_splits > 1 or return_lse else None,
        k_scale, v_scale,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        *os_, *ls,
        n_new, group, k_cache.shape[1], qk_scale, cap_in, cap_out, max(left, 0), chunk_min, *scale_strides,
        NUM_SPLITS=num_splits, SOFTCAP=softcap > 0, FP8=fp8, STORE_LSE=num_splits > 1 or return_lse,
        HEAD_DQK=dqk, BLOCK_DQK=triton.next_power_of_2(dqk), BLOCK_DV=triton.next_power_of_2(dv),
        INTERPRET=interpreting(), USE_PDL=pdl, **common, **cfg, **launch,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, n_new * hq)](
            out, out_lse, seq_lens, o, lse if return_lse else None,
            *out.stride()[:4], *out_lse.stride(), *o.stride()[:3], *(lse.stride() if return_lse else (0, 0, 0)),
            n_new, hq, max(left, 0), chunk_min,
            NUM_SPLITS=num_splits, STORE_LSE=return_lse, BLOCK_S=block_s, BLOCK_DV=triton.next_power_of_2(dv),
            BLOCK_N=cfg["BLOCK_N"], num_warps=decode_merge_warps(block_s, dv),
            USE_PDL=pdl, **common, **launch,
        )
    return o, lse


# ---------------------------------------------------------------------------------------------------
# merge of two attention states


@triton.jit
def _merge_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, o_ptr, l_ptr, n_rows, n_heads,
    stride_oan, stride_oah, stride_obn, stride_obh, stride_lan, stride_lah, stride_lbn, stride_lbh,
    HEAD_D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    r_ok = r < n_rows
    n = r // n_heads
    h = r % n_heads
    d = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (d < HEAD_D)[None, :]
    la = tl.load(la_ptr + n * stride_lan + h * stride_lah, mask=r_ok, other=float("-inf")).to(tl.float32)
    lb = tl.load(lb_ptr + n * stride_lbn + h * stride_lbh, mask=r_ok, other=float("-inf")).to(tl.float32)
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    oa = tl.load(oa_ptr + n[:, None] * stride_oan + h[:, None] * stride_oah + d[None, :], mask=mask, other=0.0)
    ob = tl.load(ob_ptr + n[:, None] * stride_obn + h[:, None] * stride_obh + d[None, :], mask=mask, other=0.0)
    inv = 1.0 / tl.where(total == 0.0, 1.0, total)
    o = (oa.to(tl.float32) * (wa * inv)[:, None]) + (ob.to(tl.float32) * (wb * inv)[:, None])
    tl.store(o_ptr + r[:, None] * HEAD_D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=mask)
    lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(l_ptr + r, lse, mask=r_ok)


def merge_config(head_d: int):
    """ROWS rows of one head each per program, ~4096 elements; 16-byte accesses."""
    block_d = triton.next_power_of_2(head_d)
    rows = max(1, min(64, 4096 // block_d))
    return rows, block_d, max(1, min(8, rows * block_d // 512))


def merge(o_a, lse_a, o_b, lse_b):
    """o [N, H, D] (last stride 1), lse [N, H] (any strides) → (o [N, H, D] in o_a.dtype, lse [N, H] fp32)."""
    n, h, d = o_a.shape
    o = torch.empty(n, h, d, dtype=o_a.dtype, device=o_a.device)
    lse = torch.empty(n, h, dtype=torch.float32, device=o_a.device)
    if o.numel() == 0:
        return o, lse.fill_(float("-inf"))
    rows, block_d, num_warps = merge_config(d)
    _merge_kernel[(triton.cdiv(n * h, rows),)](
        o_a, lse_a, o_b, lse_b, o, lse, n * h, h,
        o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        HEAD_D=d, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )
    return o, lse


