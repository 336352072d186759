"""Triton kernels for MLA: the fused latent-cache write and the absorbed paged decode.

Write: one program per token. It loads the token's wkv_a output row [576] once, RMS-normalises the first
512 values (times the weight), rotates the 64 rope values by interleaved pairs with the cos/sin row of the
token's position, and stores the 576 values at the token's slot (bf16/fp16/fp32 cache), or quantises them
to e4m3 with one float32 scale per 128 values (FP8 cache). One launch for the whole batch.

Decode: multi-query attention with one KV head, key dim 576 = 512 + 64, value dim 512. A program owns
BLOCK_M rows (row r = new token r // H, head r % H: all heads of a sequence and its new tokens, the M
dimension of every dot) of one sequence and one split of its key range. Per BLOCK_N-key tile it gathers
the rows through the block table once, as two tiles: c_kv [BLOCK_N, 512] and k_pe [BLOCK_N, 64];
scores = q_lat · c_kvᵀ + q_pe · k_peᵀ (two dots), then o += p · c_kv (the same c_kv tile is the value); with
config HALVES c_kv comes as two [BLOCK_N, 256] tiles, each with its own score dot and output accumulator.
Where the page size is a multiple of BLOCK_N (a tile lies in one page) and the cache is 16-bit, full tiles can
come through TMA descriptors over the cache viewed as [pages · page_size, 576] (config TMA), the partial last
tile of a split through masked pointer loads.
Online softmax in base 2, fp32 accumulators. Splits: the grid is m-blocks × programs (from shapes only, so CUDA
graphs capture it; no host sync), and each program reads its keys from its row of the step's schedule (schedule.py,
computed on the device from the lengths, once per step): chunks of one size for the whole batch, the smallest that
fits (in a uniform batch decode_num_splits's static split; a long sequence in a skewed batch takes the spare
programs), or, for this kernel and the few-rows Gluon kernel, where that leaves some programs far more work than
others, contiguous ranges of the batch's key tiles cut at sequence ends; a program takes its chunks or pieces (both
"slots") one after another. A sequence of one chunk is written to the output directly; the chunks of a longer one
write partials (o, lse) in their slot's row, merged by their log-sum-exp: inside the decode kernel where the heuristic asks for ≤
FUSED_MAX_SPLITS splits (the last chunk of a sequence to finish, counted by an atomic counter per (sequence,
m-block), merges; o partials in the query dtype; a skewed batch's sequences of more than FUSED_MAX_CHUNKS chunks are
left to the merge kernel after it), else by a second kernel over the list of sequences to merge (fp32 partials; the
Gluon kernel's in the query dtype). The Gluon kernel is launched with programmatic dependent launch (PDL), so that its
programs wait on the SMs while the kernel before them drains; the Triton kernel not (PDL, TRITON_PDL). FP8 cache:
tiles are dequantised (value · scale of its group) to the query dtype in registers before the dots, the scales
loaded once per key and 128-value group.
On Hopper, with a 16-bit cache in 64-key pages, 32 rows and more (decode_config) run the warp-specialised Gluon
kernel of kernels_ws.py instead (a TMA loader warp and two consumer warpgroups in a seesaw, 64-row blocks), and on a
Hopper GPU whose DRAM outruns this kernel's 16-row programs (FAST_DRAM_GBPS_PER_SM) 16 rows the few-rows Gluon kernel
of kernels_few.py where its chunks are long enough (FEW_MIN_TILES) and 17–32 rows the transposed seesaw of
kernels_seesaw_t.py (no padded rows); this kernel remains the path everywhere else and the one the CPU tests run (the
interpreter cannot run Gluon).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..._utils import dram_gbps_per_sm, gdc_launch_dependents, gdc_wait, interpreting, pdl_enabled, sm_count
from ..attention.kernels import _counters, _ensure_allocator, _round_to_e4m3  # split counters; descriptor scratch; e4m3
from .schedule import (PROGRAM_ROW_VALUES, RANGE_BLOCK, SCHEDULE_ROW, SWITCH_TILES, build_schedule,
                       merge_entries, program_rows, schedule_size)

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
FP8_MAX = tl.constexpr(448.0)
KV_LORA = 512
ROPE = 64
N_SCALES = 5


# ---------------------------------------------------------------------------------------------------
# fused latent-cache write


@triton.jit
def _write_latent_kernel(
    kv_ptr, w_ptr, cs_ptr, pos_ptr, slot_ptr, c_ptr, sc_ptr,
    stride_kv, stride_cs, stride_cp, stride_cr, stride_sp, stride_sr,
    page_size, eps,
    FP8: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    page = slot // page_size
    row = slot % page_size
    d = tl.arange(0, KV_LORA)
    x = tl.load(kv_ptr + token * stride_kv + d).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / KV_LORA + eps)
    c = x * inv * tl.load(w_ptr + d).to(tl.float32)
    j = tl.arange(0, ROPE // 2)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + j).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + ROPE // 2 + j).to(tl.float32)
    x1 = tl.load(kv_ptr + token * stride_kv + KV_LORA + 2 * j).to(tl.float32)
    x2 = tl.load(kv_ptr + token * stride_kv + KV_LORA + 2 * j + 1).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    dst = c_ptr + page * stride_cp + row * stride_cr
    if FP8:
        # scales: max|x| / 448 per 128 values (4 groups of c_kv, 1 for the 64 rope values); 1 for a zero group
        g = tl.reshape(tl.abs(c), (KV_LORA // 128, 128))
        s_c = tl.max(g, 1) / FP8_MAX
        s_c = tl.where(s_c > 0, s_c, 1.0)
        s_pe = tl.maximum(tl.max(tl.abs(y1), 0), tl.max(tl.abs(y2), 0)) / FP8_MAX
        s_pe = tl.where(s_pe > 0, s_pe, 1.0)
        gi = tl.arange(0, KV_LORA // 128)
        sdst = sc_ptr + page * stride_sp + row * stride_sr
        tl.store(sdst + gi, s_c)
        tl.store(sdst + KV_LORA // 128, s_pe)
        full = tl.reshape(tl.broadcast_to(s_c[:, None], (KV_LORA // 128, 128)), (KV_LORA,))
        # IEEE division, as torch divides (see attention.kernels._write_rows)
        qc = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(c, full), -FP8_MAX), FP8_MAX))
        s_pe_v = tl.broadcast_to(s_pe, y1.shape)
        q1 = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(y1, s_pe_v), -FP8_MAX), FP8_MAX))
        q2 = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(y2, s_pe_v), -FP8_MAX), FP8_MAX))
        tl.store(dst + d, qc.to(c_ptr.dtype.element_ty))
        tl.store(dst + KV_LORA + 2 * j, q1.to(c_ptr.dtype.element_ty))
        tl.store(dst + KV_LORA + 2 * j + 1, q2.to(c_ptr.dtype.element_ty))
    else:
        tl.store(dst + d, c.to(c_ptr.dtype.element_ty))
        tl.store(dst + KV_LORA + 2 * j, y1.to(c_ptr.dtype.element_ty))
        tl.store(dst + KV_LORA + 2 * j + 1, y2.to(c_ptr.dtype.element_ty))


def write_latent_cache(kv, weight, cos_sin_cache, positions, slot_mapping, cache, cache_scales, eps):
    n = kv.shape[0]
    if n == 0:
        return
    fp8 = cache_scales is not None
    _write_latent_kernel[(n,)](
        kv, weight, cos_sin_cache, positions, slot_mapping, cache, cache_scales,
        kv.stride(0), cos_sin_cache.stride(0), cache.stride(0), cache.stride(1),
        cache_scales.stride(0) if fp8 else 0, cache_scales.stride(1) if fp8 else 0,
        cache.shape[1], float(eps), FP8=fp8, KV_LORA=KV_LORA, ROPE=ROPE, num_warps=4,
    )


# ---------------------------------------------------------------------------------------------------
# absorbed paged decode


@triton.jit
def _tile_slots(bt_row, kn, n0, valid, page_size, PAGE_TILE: tl.constexpr):
    """(page, row in page) of keys kn. PAGE_TILE: the tile lies in one page (page_size a multiple of BLOCK_N and
    tiles BLOCK_N-aligned), so one scalar page-table load serves the whole tile."""
    if PAGE_TILE:
        page = tl.load(bt_row + n0 // page_size).to(tl.int64)
        return page, n0 % page_size + (kn - n0)
    else:
        page = tl.load(bt_row + kn // page_size, mask=valid, other=0).to(tl.int64)
        return page, kn % page_size


@triton.jit
def _page_row(bt_row, n0, full, page_size):
    """Row of key n0 in the cache viewed as [pages · page_size, 576] (0 from n0 = full on: nothing loaded)."""
    return tl.load(bt_row + n0 // page_size, mask=n0 < full, other=0).to(tl.int32) * page_size + n0 % page_size


@triton.jit
def _latent_cols(rows, valid, srow, col0: tl.constexpr, W: tl.constexpr, dtype, FP8: tl.constexpr):
    """c_kv columns [col0, col0 + W) of the tile's rows (masked rows 0), dequantised to `dtype` for an FP8 cache:
    the [keys, W / 128] scales are loaded once and broadcast over their 128-value groups by a reshape (a scale
    load per value made the FP8 decode 3–5x slower: NOTES, issue 6, session l)."""
    cols = col0 + tl.arange(0, W)
    if FP8:  # fp8 loads take no `other` (interpreter): zero the masked lanes after the cast
        G: tl.constexpr = W // 128
        sc = tl.load(srow[:, None] + (col0 // 128 + tl.arange(0, G))[None, :], mask=valid[:, None], other=0.0)
        kc = tl.load(rows[:, None] + cols[None, :], mask=valid[:, None]).to(tl.float32)
        kc = tl.reshape(tl.reshape(kc, [kc.shape[0], G, 128]) * sc[:, :, None], [kc.shape[0], W])
        kc = tl.where(valid[:, None], kc, 0.0).to(dtype)
    else:
        kc = tl.load(rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
    return kc


@triton.jit
def _mla_tile(acc, acc_hi, l_i, m_i, qa, qa_hi, qb, bt_row, c_ptr, s_ptr, c_desc, p_desc, row0, n0, end, pos,
              page_size, stride_cp, stride_cr, stride_sp, stride_sr, qk_scale, offs_n, offs_p,
              FP8: tl.constexpr, KV_LORA: tl.constexpr, PAGE_TILE: tl.constexpr, KEYS_MAJOR: tl.constexpr,
              TMA: tl.constexpr, HALVES: tl.constexpr):
    """One BLOCK_N-key tile of the online softmax. qa, qb: q_lat [BLOCK_M, 512] and q_pe [BLOCK_M, 64], or
    their transposes with KEYS_MAJOR. TMA: a full tile (n0 + BLOCK_N ≤ end) inside one page, loaded through the
    descriptors over the cache viewed as [pages · page_size, 576] from its row row0 (the caller loads it one tile
    ahead, so that the descriptor loads depend on no load of their own iteration): no masks, no per-row addresses.
    KEYS_MAJOR: scores as sᵀ = c_kv · q_latᵀ + k_pe · q_peᵀ [BLOCK_N, BLOCK_M], so the c_kv tile is a dot
    operand in its stored (row-major) layout in both dots (A here, B in p · c_kv): with mma.sync tiles the other
    order copies the 512-wide tile transposed through registers. m_i, l_i are per row of the output.
    HALVES: c_kv comes as two 256-column tiles (qa / qa_hi, acc / acc_hi the matching halves of q_lat and of the
    output): each half's score dot is its own chain of dependent mma.sync steps, which ptxas interleaves, where
    the whole 576-deep dot ran as one chain (36 steps per 16 × 8 output tile, the tiles of a warp one after the
    other at 255 registers); at 16 rows it also frees ~60 registers. H100: +2–4% at 16 rows (NOTES, session l)."""
    W: tl.constexpr = KV_LORA // (1 + HALVES)
    kn = n0 + offs_n
    valid = kn < end
    if TMA:
        kc = c_desc.load([row0, 0])
        if HALVES:
            kc_hi = c_desc.load([row0, W])
        kp = p_desc.load([row0, KV_LORA])
    else:
        page, slot = _tile_slots(bt_row, kn, n0, valid, page_size, PAGE_TILE)
        rows = c_ptr + page * stride_cp + slot * stride_cr
        srow = s_ptr + page * stride_sp + slot * stride_sr if FP8 else rows  # scale rows (FP8 only)
        kc = _latent_cols(rows, valid, srow, 0, W, qa.dtype, FP8)
        if HALVES:
            kc_hi = _latent_cols(rows, valid, srow, W, W, qa.dtype, FP8)
        if FP8:
            spe = tl.load(srow + KV_LORA // 128, mask=valid, other=0.0)
            kp = tl.load(rows[:, None] + KV_LORA + offs_p[None, :], mask=valid[:, None]).to(tl.float32)
            kp = tl.where(valid[:, None], kp * spe[:, None], 0.0).to(qa.dtype)
        else:
            kp = tl.load(rows[:, None] + KV_LORA + offs_p[None, :], mask=valid[:, None], other=0.0)
    if KEYS_MAJOR:
        if HALVES:  # two accumulators (scaled before the sum: triton would fold dot + dot into one chain)
            st = tl.dot(kc, qa) * qk_scale + tl.dot(kc_hi, qa_hi, tl.dot(kp, qb)) * qk_scale  # [BLOCK_N, BLOCK_M]
        else:
            st = tl.dot(kc, qa)
            st = tl.dot(kp, qb, st) * qk_scale
        st = tl.where(valid[:, None] & (kn[:, None] <= pos[None, :]), st, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        pt = tl.exp2(st - m_use[None, :])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(pt, 0)
        p = tl.trans(pt.to(kc.dtype))
    else:
        if HALVES:
            s = (tl.dot(qa, tl.trans(kc)) * qk_scale
                 + tl.dot(qa_hi, tl.trans(kc_hi), tl.dot(qb, tl.trans(kp))) * qk_scale)
        else:
            s = tl.dot(qa, tl.trans(kc))
            s = tl.dot(qb, tl.trans(kp), s) * qk_scale
        s = tl.where(valid[None, :] & (kn[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(kc.dtype)
    acc = tl.dot(p, kc, acc * alpha[:, None])
    if HALVES:
        acc_hi = tl.dot(p, kc_hi, acc_hi * alpha[:, None])
    return acc, acc_hi, l_i, m_new


@triton.jit
def _mla_decode_kernel(
    qn_ptr, qp_ptr, c_ptr, s_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, sched_ptr, prog_ptr, cnt_ptr,
    stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph,
    stride_cp, stride_cr, stride_sp, stride_sr, stride_bt,
    n_new, heads, page_size, n_rows, qk_scale,
    SPLIT: tl.constexpr, FP8: tl.constexpr, KV_LORA: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
    KEYS_MAJOR: tl.constexpr = False, PAGE_TILE: tl.constexpr = False, TMA: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = False, USE_PDL: tl.constexpr = False, HALVES: tl.constexpr = False,
    RANGES: tl.constexpr = False, MERGE_AFTER: tl.constexpr = 0,
):
    """Program (m-block, slot). o_ptr [B, Q, H, 512] / lse_ptr [B, Q, H]: the final output (contiguous).
    SPLIT (more slots than sequences): the slot takes the chunk in its row of the schedule sched_ptr (schedule.py:
    sequence −1 is a spare slot); a sequence of one chunk is written to the final output directly, the chunks of a
    longer one to the partials po_ptr [slots, Q, H, 512] / pl_ptr [slots, Q, H] in the slot's row.
    Without SPLIT the slot is the sequence. n_rows: pages · page_size (the descriptors' row count); TMA needs
    PAGE_TILE and a 16-bit cache.
    RANGES (with SPLIT; a launch of programs, schedule.py): program p takes the slots its row of prog_ptr names
    (first slot, count, that slot's row), one after another: chunks, or its range of the batch's key tiles cut at
    sequence ends.
    FUSED_MERGE (with SPLIT): each chunk's program counts itself in on the (sequence, m-block) counter
    cnt_ptr[sequence · m_blocks + m_block]; the last of the sequence's chunks to arrive merges them into the final
    output and resets the counter to 0. MERGE_AFTER > 0: only sequences of up to MERGE_AFTER chunks; those of more
    (a skewed batch's long ones) are left to the merge kernel after this one.
    USE_PDL: launched with programmatic dependent launch: waits for the kernels before it (the schedule, q, the
    cache) before any load, and lets the next kernel launch early (its CTAs take free slots and wait in turn)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    m_block = tl.program_id(0)  # fastest: the m-blocks of one chunk read the same pages back to back (L2)
    slot = tl.program_id(1)
    if RANGES:  # the program's row: its first slot, its slot count, that slot's row
        prow = prog_ptr + slot * PROGRAM_ROW_VALUES
        slot, count = tl.load(prow), tl.load(prow + 1)
        seq, seq_len, start, end, n_seq, first = _schedule_row(prow + 2, 0)
    elif SPLIT:
        seq, seq_len, start, end, n_seq, first = _schedule_row(sched_ptr, slot)
        count = (seq >= 0).to(tl.int32)  # (−1: a spare slot)
    else:
        seq, seq_len, start, n_seq, first, count = slot, tl.load(len_ptr + slot).to(tl.int32), 0, 1, slot, 1
        end = seq_len
    if count > 0:  # the first slot straight (as one slot a program), then any others one after another
        _decode_chunk(
            qn_ptr, qp_ptr, c_ptr, s_ptr, bt_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, cnt_ptr, stride_qnb, stride_qnt,
            stride_qnh, stride_qpb, stride_qpt, stride_qph, stride_cp, stride_cr, stride_sp, stride_sr, stride_bt,
            n_new, heads, page_size, n_rows, qk_scale, m_block, slot, seq, seq_len, start, end, n_seq, first,
            SPLIT, FP8, KV_LORA, ROPE, BLOCK_M, BLOCK_N, INTERPRET, KEYS_MAJOR, PAGE_TILE, TMA, FUSED_MERGE,
            HALVES, MERGE_AFTER)
        if RANGES:
            last = slot + count
            slot += 1
            while slot < last:
                seq, seq_len, start, end, n_seq, first = _schedule_row(sched_ptr, slot)
                _decode_chunk(
                    qn_ptr, qp_ptr, c_ptr, s_ptr, bt_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, cnt_ptr, stride_qnb,
                    stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph, stride_cp, stride_cr, stride_sp,
                    stride_sr, stride_bt, n_new, heads, page_size, n_rows, qk_scale, m_block, slot, seq, seq_len,
                    start, end, n_seq, first, SPLIT, FP8, KV_LORA, ROPE, BLOCK_M, BLOCK_N, INTERPRET, KEYS_MAJOR,
                    PAGE_TILE, TMA, FUSED_MERGE, HALVES, MERGE_AFTER)
                slot += 1


@triton.jit
def _schedule_row(sched_ptr, slot):
    """The slot's row of the schedule (sequence, its length, first key, end key, its chunks, its first chunk's
    slot): six loads in one round."""
    row = sched_ptr + slot * SCHEDULE_ROW
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4),
            tl.load(row + 5))


@triton.jit
def _decode_chunk(
    qn_ptr, qp_ptr, c_ptr, s_ptr, bt_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, cnt_ptr,
    stride_qnb, stride_qnt, stride_qnh, stride_qpb, stride_qpt, stride_qph,
    stride_cp, stride_cr, stride_sp, stride_sr, stride_bt,
    n_new, heads, page_size, n_rows, qk_scale, m_block, slot, seq, seq_len, start, end, n_seq, first,
    SPLIT: tl.constexpr, FP8: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, KEYS_MAJOR: tl.constexpr, PAGE_TILE: tl.constexpr,
    TMA: tl.constexpr, FUSED_MERGE: tl.constexpr, HALVES: tl.constexpr, MERGE_AFTER: tl.constexpr,
):
    """Keys [start, end) of sequence seq (of n_seq chunks, the first in slot `first`) for m-block m_block
    (_mla_decode_kernel)."""
    rows = n_new * heads
    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = r // heads
    head = r % heads
    row_ok = r < rows
    offs_p = tl.arange(0, ROPE)
    b64 = seq.to(tl.int64)
    W: tl.constexpr = KV_LORA // (1 + HALVES)  # columns of one c_kv tile (_mla_tile)
    offs_w = tl.arange(0, W)
    qn_rows = qn_ptr + b64 * stride_qnb + tok[:, None] * stride_qnt + head[:, None] * stride_qnh
    q_lat = tl.load(qn_rows + offs_w[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = q_lat
    if HALVES:
        q_hi = tl.load(qn_rows + W + offs_w[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(qp_ptr + b64 * stride_qpb + tok[:, None] * stride_qpt + head[:, None] * stride_qph
                   + offs_p[None, :], mask=row_ok[:, None], other=0.0)
    pos = seq_len - n_new + tok  # causal among the new tokens
    bt_row = bt_ptr + b64 * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, W], tl.float32)
    acc_hi = acc
    if KEYS_MAJOR:
        qa, qa_hi, qb = tl.trans(q_lat), tl.trans(q_hi), tl.trans(q_pe)
    else:
        qa, qa_hi, qb = q_lat, q_hi, q_pe
    if TMA:  # full tiles through the descriptors, then the partial last tile (if any) with masked pointer loads
        c_desc = tl.make_tensor_descriptor(c_ptr, [n_rows, KV_LORA + ROPE], [stride_cr, 1], [BLOCK_N, W])
        p_desc = tl.make_tensor_descriptor(c_ptr, [n_rows, KV_LORA + ROPE], [stride_cr, 1], [BLOCK_N, ROPE])
        full = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        row0 = _page_row(bt_row, start, full, page_size)
        if INTERPRET:  # the interpreter cannot take tensor range() bounds
            n0 = start
            while n0 < full:
                row_next = _page_row(bt_row, n0 + BLOCK_N, full, page_size)
                acc, acc_hi, l_i, m_i = _mla_tile(
                    acc, acc_hi, l_i, m_i, qa, qa_hi, qb, bt_row, c_ptr, s_ptr, c_desc, p_desc, row0, n0, end, pos,
                    page_size, stride_cp, stride_cr, stride_sp, stride_sr, qk_scale, offs_n, offs_p, FP8,
                    KV_LORA, PAGE_TILE, KEYS_MAJOR, True, HALVES)
                row0 = row_next
                n0 += BLOCK_N
        else:
            for n0 in range(start, full, BLOCK_N):
                row_next = _page_row(bt_row, n0 + BLOCK_N, full, page_size)
                acc, acc_hi, l_i, m_i = _mla_tile(
                    acc, acc_hi, l_i, m_i, qa, qa_hi, qb, bt_row, c_ptr, s_ptr, c_desc, p_desc, row0, n0, end, pos,
                    page_size, stride_cp, stride_cr, stride_sp, stride_sr, qk_scale, offs_n, offs_p, FP8,
                    KV_LORA, PAGE_TILE, KEYS_MAJOR, True, HALVES)
                row0 = row_next
        if full < end:
            acc, acc_hi, l_i, m_i = _mla_tile(
                acc, acc_hi, l_i, m_i, qa, qa_hi, qb, bt_row, c_ptr, s_ptr, c_desc, p_desc, 0, full, end, pos,
                page_size, stride_cp, stride_cr, stride_sp, stride_sr, qk_scale, offs_n, offs_p, FP8, KV_LORA,
                PAGE_TILE, KEYS_MAJOR, False, HALVES)
    elif INTERPRET:
        n0 = start
        while n0 < end:
            acc, acc_hi, l_i, m_i = _mla_tile(
                acc, acc_hi, l_i, m_i, qa, qa_hi, qb, bt_row, c_ptr, s_ptr, c_ptr, c_ptr, 0, n0, end, pos, page_size,
                stride_cp, stride_cr, stride_sp, stride_sr, qk_scale, offs_n, offs_p, FP8, KV_LORA, PAGE_TILE,
                KEYS_MAJOR, False, HALVES)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            acc, acc_hi, l_i, m_i = _mla_tile(
                acc, acc_hi, l_i, m_i, qa, qa_hi, qb, bt_row, c_ptr, s_ptr, c_ptr, c_ptr, 0, n0, end, pos, page_size,
                stride_cp, stride_cr, stride_sp, stride_sr, qk_scale, offs_n, offs_p, FP8, KV_LORA, PAGE_TILE,
                KEYS_MAJOR, False, HALVES)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    final = b64 * rows + r  # row of the final output; a partial's: slot · rows + r
    direct = n_seq == 1
    _store_rows(o_ptr, lse_ptr, final, row_ok & direct, acc, acc_hi, l_safe, lse, offs_w, HALVES)
    if SPLIT:
        part = slot.to(tl.int64) * rows + r
        _store_rows(po_ptr, pl_ptr, part, row_ok & ~direct, acc, acc_hi, l_safe, lse, offs_w, HALVES)
        if FUSED_MERGE:
            mine = n_seq > 1
            if MERGE_AFTER > 0:  # one program's serial merge of many partials was the tail of a skewed batch
                mine = mine & (n_seq <= MERGE_AFTER)
            if mine:
                tl.debug_barrier()  # every thread's partial is written before the counter says so (release below)
                counter = cnt_ptr + seq * tl.num_programs(0) + m_block
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == n_seq - 1:  # the last chunk of this (sequence, m-block) to finish merges all of them
                    _merge_in_kernel(po_ptr, pl_ptr, first.to(tl.int64) * rows + r, o_ptr, lse_ptr, final, row_ok,
                                     n_seq, rows, KV_LORA, BLOCK_M, MAX_FUSED_SPLITS, 8192 // BLOCK_M, INTERPRET)
                    tl.store(counter, 0)  # ready for the next launch


@triton.jit
def _store_rows(o_ptr, lse_ptr, row, mask, acc, acc_hi, l_safe, lse, offs_w, HALVES: tl.constexpr):
    """o = acc / l (both halves with HALVES) and the LSE of the given rows of [rows, 512] / [rows]."""
    W: tl.constexpr = offs_w.shape[0]
    o_rows = o_ptr + row[:, None] * (W * (1 + HALVES)) + offs_w[None, :]
    inv_l = 1.0 / l_safe  # a reciprocal a row, a multiply an element (kernels_ws._epilogue)
    tl.store(o_rows, (acc * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=mask[:, None])
    if HALVES:
        tl.store(o_rows + W, (acc_hi * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=mask[:, None])
    tl.store(lse_ptr + row, lse, mask=mask)


@triton.jit
def _merge_in_kernel(po_ptr, pl_ptr, part, fo_ptr, flse_ptr, final, row_ok, n, rows,
                     KV_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """o = Σ_j e^(lse_j − lse) o_j over the n partials of BLOCK_M rows (part: each row's first partial row in
    po_ptr [slots · rows, 512] / pl_ptr; partial j is `rows` rows further) → final rows of fo_ptr / flse_ptr.
    The LSE BLOCK_S partials per load (an online max), then BLOCK_D columns × one partial a round, two at 16 rows
    ([BLOCK_M, BLOCK_D] = 8192 values each: the decode loop's registers are free, a tile takes 64 of them a thread
    at 4 warps; H100, session p: 1 × 32k + 31 × 1k at 16 heads, 64 partials, −6%; at 32 rows, where the decode loop
    already takes 255 registers, two a round spilled and cost an FP8 row 5%). The loads bypass L1: other SMs wrote
    these."""
    PER_ROUND: tl.constexpr = 2 if BLOCK_M <= 16 else 1
    s = tl.arange(0, BLOCK_S)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    j0 = 0
    while j0 < n:
        lse_s = tl.load(pl_ptr + part[:, None] + (j0 + s)[None, :] * rows,
                        mask=row_ok[:, None] & (j0 + s < n)[None, :], other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse_s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(lse_s - m_safe[:, None]), 1)
        m = m_new
        j0 += BLOCK_S
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    none = total == 0.0
    t_safe = tl.where(none, 1.0, total)
    tl.store(flse_ptr + final, tl.where(none, float("-inf"), m_safe + tl.log(t_safe)), mask=row_ok)
    for c0 in tl.static_range(0, KV_LORA, BLOCK_D):
        d = c0 + tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if INTERPRET:  # the interpreter cannot take tensor range() bounds
            j = 0
            while j < n:
                acc = _add_partials(acc, po_ptr, pl_ptr, part, j, n, rows, m_safe, t_safe, d, row_ok, KV_LORA,
                                    PER_ROUND)
                j += PER_ROUND
        else:
            for j in range(0, n, PER_ROUND):
                acc = _add_partials(acc, po_ptr, pl_ptr, part, j, n, rows, m_safe, t_safe, d, row_ok, KV_LORA,
                                    PER_ROUND)
        tl.store(fo_ptr + final[:, None] * KV_LORA + d[None, :], acc.to(fo_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _add_partials(acc, po_ptr, pl_ptr, part, j, n, rows, m_safe, t_safe, d, row_ok, KV_LORA: tl.constexpr,
                  PER_ROUND: tl.constexpr):
    """acc + partial j (and j + 1 if < n, with PER_ROUND = 2), weighted: both loaded before either is used, so that a
    round costs one trip to L2, not two (a skewed batch's long sequence merges up to 256 partials here)."""
    o_a, w_a = _weighted_partial(po_ptr, pl_ptr, part + j * rows, m_safe, t_safe, d, row_ok, KV_LORA)
    if PER_ROUND == 2:
        o_b, w_b = _weighted_partial(po_ptr, pl_ptr, part + (j + 1) * rows, m_safe, t_safe, d, row_ok & (j + 1 < n),
                                     KV_LORA)
        acc += o_b.to(tl.float32) * w_b[:, None]
    return acc + o_a.to(tl.float32) * w_a[:, None]


@triton.jit
def _weighted_partial(po_ptr, pl_ptr, row, m_safe, t_safe, d, row_ok, KV_LORA: tl.constexpr):
    """(o, weight) of one partial's rows (masked rows: 0, 0)."""
    w = tl.exp(tl.load(pl_ptr + row, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m_safe) / t_safe
    o_j = tl.load(po_ptr + row[:, None] * KV_LORA + d[None, :], mask=row_ok[:, None], other=0.0,
                  cache_modifier=".cg")
    return o_j, w


@triton.jit
def _merge_chunk(m, total, out, lbase, obase, s0, c, d, n, rows, KV_LORA: tl.constexpr):
    """Partials s0 … s0 + CHUNK_S − 1 folded into (max, sum, output) under the online max: their LSEs and their
    column block loaded in the same round (the LSEs first, then the block, was one trip to L2 more)."""
    ok = s0 + c < n
    lse_s = tl.load(lbase + (s0 + c) * rows, mask=ok, other=float("-inf"))
    o_s = tl.load(obase + (s0 + c)[:, None] * rows * KV_LORA + d[None, :], mask=ok[:, None], other=0.0)
    m_new = tl.maximum(m, tl.max(lse_s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse_s - m_safe)
    return m_new, total * alpha + tl.sum(w, 0), out * alpha + tl.sum(o_s.to(tl.float32) * w[:, None], 0)


@triton.jit
def _mla_merge_kernel(
    po_ptr, pl_ptr, sched_ptr, o_ptr, lse_ptr, rows, min_chunks,
    CHUNK_S: tl.constexpr, KV_LORA: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr, LONG_ENTRIES: tl.constexpr = 0, EARLY_TRIGGER: tl.constexpr = False,
):
    """BLOCK_D columns of one (sequence, row = new token × head): o = Σ_j e^(lse_j − lse) o_j over the sequence's
    chunks (entry program_id(0) of the merge list sched_ptr: (sequence, first chunk, chunks)), CHUNK_S partial rows
    at a time; a sequence of fewer than min_chunks chunks is not merged here (one chunk: the decode kernel wrote its
    o; up to the decode kernel's MERGE_AFTER: it merged them). Column blocks are separate programs: at B=1 the
    merge reads up to 256 partials × 2 KB per row, and 16 heads alone would leave the GPU nearly idle.
    LONG_ENTRIES > 0 (a power of 2 ≥ the merge list's length): program_id(0) is the rank among the sequences of at
    least min_chunks chunks, not the entry, so that the grid has only as many as there can be (a grid over the whole
    list cost 9 µs of programs that only returned, H100 session q). EARLY_TRIGGER: as _mla_merge_rows_kernel."""
    if EARLY_TRIGGER:
        gdc_launch_dependents()
    if LONG_ENTRIES > 0:
        listed, batch, first, n = _long_entry(sched_ptr, tl.program_id(0), min_chunks, LONG_ENTRIES)
    else:
        listed, batch, first, n = _merge_entry(sched_ptr, tl.program_id(0))
    if (not listed) | (n < min_chunks):
        return
    r = tl.program_id(1)
    col = tl.program_id(2)
    lbase = pl_ptr + first * rows + r
    d = col * BLOCK_D + tl.arange(0, BLOCK_D)
    c = tl.arange(0, CHUNK_S)
    obase = po_ptr + (first * rows + r) * KV_LORA
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    out = tl.zeros([BLOCK_D], tl.float32)
    if INTERPRET:  # the interpreter cannot take tensor range() bounds
        s0 = 0
        while s0 < n:
            m, total, out = _merge_chunk(m, total, out, lbase, obase, s0, c, d, n, rows, KV_LORA)
            s0 += CHUNK_S
    else:
        for s0 in range(0, n, CHUNK_S):
            m, total, out = _merge_chunk(m, total, out, lbase, obase, s0, c, d, n, rows, KV_LORA)
    t_safe = tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + (batch * rows + r) * KV_LORA + d, (out * (1.0 / t_safe)).to(o_ptr.dtype.element_ty))
    lse = tl.where(total == 0.0, float("-inf"), tl.where(m == float("-inf"), 0.0, m) + tl.log(t_safe))
    if col == 0:
        tl.store(lse_ptr + batch * rows + r, lse)


@triton.jit
def _merge_entry(sched_ptr, entry):
    """Entry `entry` of the merge list: (listed, sequence, first chunk, chunks). All four loads in one round: an
    entry past the list's length holds garbage, which the caller does not use."""
    count = tl.load(sched_ptr)
    seq = tl.load(sched_ptr + 1 + 3 * entry).to(tl.int64)
    first = tl.load(sched_ptr + 2 + 3 * entry).to(tl.int64)
    n = tl.load(sched_ptr + 3 + 3 * entry)
    return entry < count, seq, first, n


@triton.jit
def _long_entry(sched_ptr, rank, min_chunks, ENTRIES: tl.constexpr):
    """_merge_entry of the merge list's entry of rank `rank` among those of at least min_chunks chunks."""
    count = tl.load(sched_ptr)
    e = tl.arange(0, ENTRIES)
    long = (tl.load(sched_ptr + 3 + 3 * e, mask=e < count, other=0) >= min_chunks).to(tl.int32)
    hit = (long == 1) & (tl.cumsum(long, 0) == rank + 1)
    listed, entry = tl.sum(hit.to(tl.int32), 0) == 1, tl.sum(tl.where(hit, e, 0), 0)
    return (listed, tl.load(sched_ptr + 1 + 3 * entry).to(tl.int64), tl.load(sched_ptr + 2 + 3 * entry).to(tl.int64),
            tl.load(sched_ptr + 3 + 3 * entry))


@triton.jit
def _merge_round(m, total, out, po_ptr, pl_ptr, part, ok, KV_LORA: tl.constexpr):
    """One round of the whole-rows merge: the [ROWS, S] partials `part` folded into (max, sum, output) under the
    online max."""
    d = tl.arange(0, KV_LORA)
    lse_s = tl.load(pl_ptr + part, mask=ok, other=float("-inf"))
    o_s = tl.load(po_ptr + part[:, :, None] * KV_LORA + d[None, None, :], mask=ok[:, :, None], other=0.0)
    m_new = tl.maximum(m, tl.max(lse_s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse_s - m_safe[:, None])
    return m_new, total * alpha + tl.sum(w, 1), out * alpha[:, None] + tl.sum(o_s.to(tl.float32) * w[:, :, None], 1)


@triton.jit
def _mla_merge_rows_kernel(po_ptr, pl_ptr, sched_ptr, o_ptr, lse_ptr, rows,
                           ROWS: tl.constexpr, S: tl.constexpr, KV_LORA: tl.constexpr, USE_PDL: tl.constexpr = False,
                           EARLY_TRIGGER: tl.constexpr = False):
    """ROWS whole rows (new token × head) of one sequence (an entry of the merge list, as _mla_merge_kernel), S of
    its chunks' partials at once (all of them in a uniform batch: every load is issued in one round; the one-row
    kernel walks the chunks in dependent steps), more in further rounds under an online max. USE_PDL: launched
    with programmatic dependent launch behind the Gluon decode kernel: wait for its partials. EARLY_TRIGGER: release
    the next kernel's launch at the start (MERGE_RELEASE)."""
    if EARLY_TRIGGER:
        gdc_launch_dependents()
    if USE_PDL:
        gdc_wait()
    listed, batch, first, n = _merge_entry(sched_ptr, tl.program_id(0))
    if (not listed) | (n < 2):
        return
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    s = tl.arange(0, S)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    m, total, out = _merge_round(m, tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, KV_LORA], tl.float32), po_ptr,
                                 pl_ptr, (first + s)[None, :] * rows + r[:, None], row_ok[:, None] & (s < n)[None, :],
                                 KV_LORA)
    s0 = S
    while s0 < n:  # more chunks than S (a skewed batch)
        m, total, out = _merge_round(m, total, out, po_ptr, pl_ptr, (first + s0 + s)[None, :] * rows + r[:, None],
                                     row_ok[:, None] & (s0 + s < n)[None, :], KV_LORA)
        s0 += S
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    t_safe = tl.where(total == 0.0, 1.0, total)
    d = tl.arange(0, KV_LORA)
    tl.store(o_ptr + (batch * rows + r)[:, None] * KV_LORA + d[None, :],
             (out * (1.0 / t_safe)[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + batch * rows + r, tl.where(total == 0.0, float("-inf"), m_safe + tl.log(t_safe)), mask=row_ok)


MIN_KEYS_PER_SPLIT = 256  # keys per split the heuristic keeps at least …
SMALL_MIN_KEYS = 128  # … unless that leaves under half a program per SM: then ~128 keys per split …
# (the Gluon kernel's 64-row blocks too since session w: with the merge of many partials in one or two rounds, 128
# heads B=1 8k at 64 splits −5% against 32, where 256 had been faster in session q)
SHORT_SPLITS = 32  # … and at least this many splits of ≥ 32 keys (short contexts)
AUTO_MAX_SPLITS = 128  # at most this many (256 was 20% slower than 128 at B=1, 32k)
# merge tile: with few rows (B=1) 8 column blocks of 64 × up to MERGE_CHUNK_S splits per load (32, or 64 for more
# than 32 splits), so that more programs share the reads, and where a sequence's rows × column blocks are at most
# two programs an SM (16 or 32 rows) 128 splits per load, one round for up to 128 chunks; with ≥ 2 rows per SM
# whole 512-wide rows × 4 splits (column blocks there cost B=32 at 1k 25%). H100 (benchmarks/NOTES.md, issue 6,
# session w), against 32 splits per load: 128 at 16 rows B=1 1k / 8k / 32k −5 / −8 / −11%, 32 rows (16 × 2) B=1 8k
# / 32k −4 / −6%; at 128 rows 64 splits −5% at 32k (66 chunks), ±0.5% at 1k and 8k (32 chunks), 128 +6–8% there
MERGE_BLOCK_D, MERGE_CHUNK_S, MERGE_CHUNK_S_FEW = 64, 64, 128
# … but where those column blocks would be more than two programs an SM and a sequence has at most 16 chunks (at
# least MERGE_WHOLE_ROWS_16 rows) or 32 (MERGE_WHOLE_ROWS_32 rows), whole rows × all of them in one round. H100
# (benchmarks/NOTES.md, issue 6, session aa): 128 heads B=1 1k (16 chunks: 1024 programs of 16 × 64 values → 128 of
# 16 × 512) 16.8 → 15.4 µs, 128 × 2 B=1 1k 21.3 → 16.7, 128 heads B=1 2k / 4k (32 chunks) −4%, B=2 1k −19%; 64 heads
# at 32 chunks +4.5%
MERGE_WHOLE_ROWS_16, MERGE_WHOLE_ROWS_32 = 64, 96
# batches of ≥ 2 rows an SM whose sequences have more chunks than the whole-rows kernel takes: whole rows × up to
# this many partials a round (the chunk count's power of 2). H100 A/B (NOTES, issue 6, session aa), against 4 a round:
# 128 heads B=3 / 4 / 8 at 1k −19 / −24 / −14%, B=4 4k / 8k −19 / −14%, 64 heads B=8 1k / 4k −23 / −16%
MERGE_ROUND = 16
# in-kernel merge (the last split of a sequence to finish merges, 16-bit partials) up to this many splits; more
# go through the merge kernel. H100 A/B (benchmarks/NOTES.md, issue 6): 2 and 4 splits +5–6% (16 heads B=128 /
# B=32 at 1k), 128 heads at 2 splits +2–3%; 8 splits −1% (16 heads) and −8% (32 rows, fp32): the merging
# program's serial loads of 8 partials cost as much as the merge kernel they replace
FUSED_MERGE, FUSED_MAX_SPLITS = True, 4
# … and a sequence of up to FUSED_MAX_CHUNKS chunks there (a skewed batch gives a long one more: those merge in the
# merge kernel, which spreads them over many programs; it runs only where a sequence can take more, H100 session q:
# 64 partials merged by one program were a skewed batch's tail; 32 chunks, or 33 pieces where a range cuts one
# more, so that 16 heads B=32 8k, 32 chunks of 8 tiles, launches no merge kernel)
FUSED_MAX_CHUNKS = 33
# the separate merge with many rows and ≤ MERGE_ROWS_SPLITS splits: whole rows × all splits per program
# (MERGE_ROWS_ELEMS row-splits a program). H100 (benchmarks/NOTES.md, issue 6, session j), merge alone, fp32
# partials: 128 rows × 2 splits 10.7 → 8.1 µs, 32 rows × 4 splits 5.7 → 5.2; whole calls: 128 heads B=32 1k
# +7.6%, 8k +1.3%; 8 splits (one row a program) 5.7 → 8.3 µs, so not there
MERGE_ROWS, MERGE_ROWS_SPLITS, MERGE_ROWS_ELEMS = True, 4, 8
MAX_FUSED_SPLITS = tl.constexpr(FUSED_MAX_SPLITS)
# programmatic dependent launch of the decode kernels (Triton and Gluon): their programs take the SMs while the
# kernel before them (the step's schedule, when the call makes it) drains. H100 A/Bs (benchmarks/NOTES.md, issue 6):
# session e, where no merge kernel follows: 16 heads B=32 1k 25.1 → 24.3 µs, 128 heads B=32 1k +1.5%; session o,
# everywhere, with the schedule kernel (also PDL) before it: calls that make their own schedule 0.6–2.4 µs faster,
# a shared schedule ±0.5%. The merge kernel launched so too: +2 µs at B=1 32k, ≤ 1 µs gained elsewhere, so not.
# The Triton kernel not (TRITON_PDL), since session p: two of its programs fit on an SM, and launched early next to
# a kernel that leaves SMs idle they ran as if placed two to an SM: 16 heads B=100 1k 55.1 µs without PDL, 70.2
# with it; B=70 8k in call mode 285 against 328 µs; PDL gained 0.3–1.7% on the suite's rows (B=32 1k 24.1 → 23.7)
PDL, TRITON_PDL = True, False
# the merge kernels after a Gluon decode release the next kernel's launch (griddepcontrol.launch_dependents) at their
# start, so that the next decode's programs are placed as SMs free up rather than once the whole merge grid has
# exited (they still wait for the merge to complete before reading anything; they can be placed only once every
# merge program has started, so they take no SM the merge still needs). H200 A/Bs (NOTES, issue 6, session an):
# whole-rows merge 16 × 2 B=32 8k −1.0%, B=32 1k −5%, 16 heads B=32 8k −1.0%; column-block merge 128 heads B=1 1k /
# 8k / 32k −7.3 / −4.5 / −2.5%, B=4 1k / 4k −8.9 / −3.1%, 16 heads B=1 32k −5.1%, 16 × 2 B=1 8k −7.3%
MERGE_RELEASE = True
MERGE_PDL = True  # the whole-rows merge behind the Gluon kernel launched with PDL (mla_decode)
# the few-rows Gluon kernel's in-kernel merge (kernels_few._merge_if_last: the last of a sequence's pieces to finish
# merges them) where no sequence can be cut into more than this many pieces (contexts up to 1k: chunks and ranges are
# ≥ 4 tiles, and a range may cut one more); the merge kernel otherwise
FEW_FUSED_MAX_CHUNKS = 5
# peak DRAM GB/s per SM from which decode_config's FAST_DRAM_PROGRAMS_PER_SM applies: between an H100 SXM's 25.4 and
# an H200's 36.4 (the 16-row kernel's one program an SM, ~22 GB/s, keeps up with what the first's DRAM delivers, 23,
# not with the second's, 32)
FAST_DRAM_GBPS_PER_SM = 28.0
# 16 rows on such a GPU (Hopper, a 16-bit cache in 64-key pages): the few-rows Gluon kernel (kernels_few.py) where
# its plan's chunks are at least this many 64-key tiles; shorter ones stay with the Triton kernel's finer splits. H200
# A/B (NOTES, issue 6, session af), shared schedules, µs Triton → few rows: B=32 8k 87.5 → 82.3, B=128 1k 50.3 → 47.2,
# B=128 8k 310.9 → 285.9, B=32 32k 309.9 → 286.4, B=32 1k 22.2 → 21.1, B=1 32k 22.5 → 21.9 (chunks of 4 tiles), B=8
# 4k 24.9 → 25.4 (4), B=1 8k 13.1 → 14.4 (2 tiles: 64 chunks against the Triton kernel's 128 of 64 keys)
FEW_MIN_TILES = 4
# 17–32 rows on such a GPU: kernels_seesaw_t.py instead of kernels_ws.py's padded 64-row blocks (seesaw_t_rows). H200
# A/B (NOTES, issue 6, session ah), µs kernels_ws → transposed seesaw on the programs plan: 16 × 2 B=32 8k 88.8 → 86.9,
# B=128 8k 318.0 → 301.4, B=32 1k 24.7 → 23.6, B=32 32k 303.8 → 294.4, 1 × 8k + 127 × 512 64.2 → 43.2; 32 heads B=32
# 8k 89.5 → 87.0. The H100 keeps kernels_ws.py (not measured there).


def decode_config(rows: int, fp8: bool = False):
    """Launch parameters: BLOCK_M rows (heads × new tokens, ≥ 16 for tl.dot, ≤ 64: the fp32 accumulator is
    BLOCK_M × 512), BLOCK_N keys per tile (one tile = BLOCK_N × 1152 bytes of bf16), warps, stages, whether
    scores are computed keys-major (KEYS_MAJOR: the c_kv tile feeds both dots in its stored layout; with
    mma.sync tiles the other order copies the 512-wide tile transposed through registers), c_kv as two 256-column
    tiles (HALVES: two independent score chains, two output accumulators), TMA tile loads (where the page size is
    a multiple of BLOCK_N and the cache 16-bit; pointer tiles otherwise), and the programs that fit on one SM
    (registers, shared memory: the split heuristic fills whole waves of them).
    The page-table load takes a pipeline stage, so with pointer tiles 5 stages give the c_kv tile two buffers
    at 16 rows (2 stages at 64 rows with PAGE_TILE); TMA tiles get num_stages − 1 buffers.
    Chosen by the H100 A/Bs (benchmarks/NOTES.md, issue 6), bf16 cache, page 64:
    16 rows (16 heads, one token): 16×32 rows-major halves, 4 warps, 5 stages, pointer tiles (session l: +2–4%
    over keys-major whole tiles, +10% at B=1 8k; the Gluon kernel, padded to 64 rows, is within ±1% at 32k and
    3–20% slower elsewhere, session r, so 16 rows no longer take it), 197 registers: 2 programs fit per SM, but
    splits are sized for 1 (half the splits: B=32 8k 8 → 4, merged inside the kernel; B=128 1k 2 → 1, no merge);
    32 rows (16 heads × 2 MTP tokens): 32×32 keys-major halves, 4 warps, 3 stages, TMA, 2 per SM;
    ≥ 64 rows (128 heads: two 64-row blocks per sequence, the second reads the pages from L2): 64×64
    rows-major wgmma tiles, 8 warps, 2 stages, TMA (+7–9% over pointer tiles; 216 KB: 1 per SM; halves −1–4%).
    WS: on Hopper with a 16-bit cache in 64-key pages (decode_plan), the warp-specialised Gluon kernel of
    kernels_ws.py instead, for 32 rows and more (its first version, with every score computed twice: 64 rows
    +37–51% at 8k–32k, +18–25% at 1k, 32 rows +5–12%; its seesaw schedule, session m: 128 heads +21–28% at 8k–32k,
    +20% at B=128 1k, 32 rows within −2%): 64-key tiles × 2 stages (32 × 4 −20%, 16 × 8 −45% in session i),
    16-bit partials through the merge kernel (+14% at 128 heads B=32 1k, +2% at 16 × 2 B=32 8k over fp32 ones, once
    the kernel stored o in whole-row pieces; merging inside the kernel was slower, session i); on a fast-DRAM GPU
    17–32 rows the transposed seesaw of kernels_seesaw_t.py on the same tiles (seesaw_t_rows).
    FP8 caches: on Hopper in 64-key pages the Gluon kernel of kernels_fp8.py (WS; 16, 32 or 64 rows a program,
    m-blocks of 64 above; sessions x and y: 16 heads 1.6–2.1x this kernel's FP8 path, 128 heads 2.0–3.5x). This
    kernel's FP8 path (elsewhere): fewer stages, since the dequantised tile is staged in shared memory again
    (104–190 KB); at 16 rows splits sized for 2 programs per SM (104 KB, 255 registers: −20% at B=32 8k and B=128
    1k); halves at 64 rows (+5%, fewer spills), not at 16 (−12%) (session l); ~30% of copy, slower than bf16 per
    call: the per-value dequantisation (e4m3 → fp32 · scale → 16 bit, staged through shared memory again) sets the
    pace.
    FAST_DRAM_PROGRAMS_PER_SM: the programs per SM the splits are sized for on a GPU whose DRAM outruns one program
    an SM (dram_gbps_per_sm ≥ FAST_DRAM_GBPS_PER_SM), where the GPU, not the keys, sets the split count (decode_plan).
    One 16-row program streams ~22 GB/s (H100 2914 GB/s at B=128 8k, H200 3041): an H100's copy rate a SM, 23 GB/s,
    but 70% of an H200's, 32. H200 A/B (NOTES, issue 6, session ac, a call making its own schedule): 2 against 1 a SM
    B=32 8k 110.8 → 96.5 µs, B=128 1k 63.3 → 59.1, B=128 8k 398.4 → 312.4; where keys set the count (B=32 1k, B=1
    32k) 2 was 35% slower; on the H100 2 was 4–6% slower everywhere (session o).
    FAST_DRAM_FEW: on such a GPU, Hopper with a 16-bit cache in 64-key pages, the few-rows Gluon kernel's plan
    (kernels_few.py: 64-key tiles, one program an SM) where its chunks are ≥ FEW_MIN_TILES tiles (decode_plan).
    FAST_DRAM_SMALL_MIN_KEYS: on such a GPU, where a small batch leaves SMs idle and the plan stays at one program an
    SM, splits shrink to this many keys (decode_num_splits's small_keys) rather than SMALL_MIN_KEYS. H200 A/B (NOTES,
    issue 6, session ad; shared schedule, µs): B=1 2k 11.5 → 10.3 (32 → 64 splits), 4k 14.3 → 11.4 (32 → 128), 8k
    14.9 → 13.1 (64 → 128; the H100's pick there was 64, session w), B=2 4k 15.0 → 13.2 (32 → 66); B=1 1k / 32k,
    B=2 8k, B=4 2k / 8k and B=8 4k keep their counts or time."""
    block_m = max(16, min(64, triton.next_power_of_2(rows)))
    if fp8:
        if block_m >= 64:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2, KEYS_MAJOR=False, HALVES=True,
                        PROGRAMS_PER_SM=1, WS=True)
        return dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=4, num_stages=2, KEYS_MAJOR=True,
                    PROGRAMS_PER_SM=2 if block_m == 16 else 1, WS=True)
    if block_m >= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, KEYS_MAJOR=False, TMA=True, PROGRAMS_PER_SM=1,
                    WS=True)
    if block_m == 32:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=3, KEYS_MAJOR=True, HALVES=True, TMA=True,
                    PROGRAMS_PER_SM=2, WS=True)
    return dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=5, KEYS_MAJOR=False, HALVES=True, PROGRAMS_PER_SM=1,
                FAST_DRAM_PROGRAMS_PER_SM=2, FAST_DRAM_SMALL_MIN_KEYS=32, FAST_DRAM_FEW=True)


class DecodePlan(NamedTuple):
    """The launch of a decode call (decode_plan)."""
    cfg: dict  # the kernel's launch parameters
    ws: bool  # the Gluon kernel
    m_blocks: int
    splits: int  # the heuristic's (or the caller's) programs per sequence
    slots: int  # chunk slots per m-block
    base: int  # the slots the heuristic sized; more (one more wave) are for skewed batches (schedule.py)
    wave: int  # slots that run at once
    min_tiles: int  # the smallest chunk, in key tiles
    programs: int = 0  # > 0: a launch of programs taking chunks or ranges (schedule.py); slots = batch + programs − 1


def decode_plan(shape, cache, max_context, num_splits=None, config=None) -> DecodePlan:
    """The launch of a decode call on queries of `shape` (batch, new tokens, heads) over `cache`. The Gluon kernel
    (WS, where decode_config asks for it and kernels_ws.supported allows) takes 64-row blocks (fewer rows padded) of 64
    keys, one program per SM; otherwise the Triton kernel with decode_config's tiles. Shapes only (CUDA graphs): the
    grid is m-blocks × programs, and the schedule (schedule.py) balances the keys over them from the lengths on the
    device. The Triton kernel launches the heuristic's slots (below) as programs, which take chunks or ranges of the
    batch's key tiles across sequence ends, whichever the schedule finds better (schedule.py; slots: the pieces they
    can make, batch + programs − 1 ≤ RANGE_BLOCK; else one chunk a program), and so do the few-rows Gluon kernel
    and the transposed seesaw (16 and 17–32 rows of a 16-bit cache), one program an SM. The other Gluon kernels take
    chunks, one a program: splits:
    decode_num_splits's count per sequence (or the caller's);
    slots: batch × splits, rounded up to whole waves of programs (the spare ones take chunks of long sequences in a
    skewed batch; where keys set the split count, or for one sequence, no schedule uses them, so the Gluon launch
    has exactly the static split's chunks). At one split a sequence of a batch that
    fills the GPU, for contexts longer than SWITCH_TILES + 1 key tiles, one more wave of slots, which the schedule
    uses only where it pays (base: the heuristic's slots), launched as programs of their own (one fits per SM, so
    they run as SMs free up). Smallest chunk (or range):
    the heuristic's chunk (max_context / splits) where keys set the split count, else down to min_keys. Over the
    base slots a uniform batch at max_context gets exactly the heuristic's chunks: where the GPU sets the count,
    splits = wave // batch and slots < batch · (splits + 1), so c = ⌈tiles / splits⌉ is the smallest that fits;
    where keys do, the smallest chunk is the heuristic's and fits (tests/ops/test_mla_decode.py checks this over a
    grid of shapes); the extra wave may still win where the base leaves SMs idle (B=70 at 8k). A caller's
    num_splits: chunks, slots = batch × num_splits, any chunk size."""
    batch, n_new, heads = shape
    fp8 = cache.dtype == torch.float8_e4m3fn
    cfg = dict(config or decode_config(n_new * heads, fp8))
    ws = cfg.pop("WS", False) and not interpreting() and _ws_supported(cache)
    if (cfg.pop("FAST_DRAM_FEW", False) and not ws and not interpreting() and _ws_supported(cache)
            and dram_gbps_per_sm(cache.device) >= FAST_DRAM_GBPS_PER_SM):  # the few-rows Gluon kernel's plan
        few = decode_plan(shape, cache, max_context, num_splits, dict(WS=True))
        if triton.cdiv(triton.cdiv(max_context, few.cfg["BLOCK_N"]), few.splits) >= FEW_MIN_TILES:
            return few
    ranges = not ws  # a launch of programs taking chunks or ranges (below; skewed 16-head batches on the H200 few-rows
    # kernel: 1 × 8k + 127 × 512 −33%, 8 × 4k + 120 × 256 −20% against chunks with an extra wave, NOTES, issue 6, ag)
    if ws:  # the Gluon kernel's key tile also decides the chunk boundaries (both Gluon kernels: 64 keys)
        from . import kernels_few, kernels_fp8, kernels_ws

        # the few-rows kernel and the transposed seesaw take them too
        ranges = not fp8 and (n_new * heads <= kernels_few.MAX_ROWS or seesaw_t_rows(n_new * heads, cache))
        cfg.update(BLOCK_M=kernels_fp8.block_rows(n_new * heads) if fp8 else kernels_ws.BLOCK_M,
                   BLOCK_N=kernels_ws.BLOCK_N, PROGRAMS_PER_SM=1)
    m_blocks = triton.cdiv(n_new * heads, cfg["BLOCK_M"])
    per_sm = cfg.pop("PROGRAMS_PER_SM", 1)
    fast_dram_per_sm = cfg.pop("FAST_DRAM_PROGRAMS_PER_SM", per_sm)
    min_keys = cfg.pop("MIN_KEYS", MIN_KEYS_PER_SPLIT)
    small_keys = cfg.pop("SMALL_MIN_KEYS", SMALL_MIN_KEYS)
    fast_small_keys = cfg.pop("FAST_DRAM_SMALL_MIN_KEYS", small_keys)
    block_n = cfg["BLOCK_N"]
    if num_splits:
        slots = batch * num_splits
        return DecodePlan(cfg, ws, m_blocks, num_splits, slots, slots, slots, 1)
    num_sms = sm_count(cache.device)

    def split_count(per_sm):
        """(splits, wave: chunk slots that run at once, keys_set: whether keys, not the GPU, set the count: min_keys,
        the short-context rules, the cap)."""
        splits = decode_num_splits(batch, m_blocks, max_context, num_sms, per_sm, min_keys, small_keys)
        wave = max(1, num_sms * per_sm // m_blocks)
        return splits, wave, splits < wave // batch

    if dram_gbps_per_sm(cache.device) >= FAST_DRAM_GBPS_PER_SM:
        if fast_dram_per_sm > per_sm and not split_count(fast_dram_per_sm)[2]:
            per_sm = fast_dram_per_sm
        else:  # staying at one program an SM, small batches split finer; only after the test above, or the finer
            # split could tip it to two an SM (16 heads B=4 4k: 66 splits two an SM 9% slower than 33 one an SM)
            small_keys = fast_small_keys
    splits, wave, keys_set = split_count(per_sm)
    tiles = triton.cdiv(max_context, block_n)
    chunk = max(1, triton.cdiv(tiles, splits))  # the heuristic's, in tiles
    # whole tiles can make far fewer chunks than splits (2000 keys, 62 splits: 32 chunks of two 32-key tiles); then a
    # tile less a chunk where its chunks still fit one wave (63 of one tile: 16 heads −10%, NOTES, issue 6, session
    # ae), in the Gluon kernel not below small_keys keys (128 heads B=1 3000: 47 one-tile chunks +7% against 24)
    smallest, one_wave = (triton.cdiv(small_keys, block_n) if ws else 1), wave // batch
    if (chunk > smallest and triton.cdiv(tiles, chunk) < splits <= one_wave
            and triton.cdiv(tiles, chunk - 1) <= one_wave):
        chunk -= 1
        splits = max(splits, triton.cdiv(tiles, chunk))
    slots = triton.cdiv(batch * splits, wave) * wave
    # where keys set the count, chunks stay that long; where the GPU did, long sequences may take shorter ones, down to
    # min_keys
    min_tiles = chunk if keys_set else min(triton.cdiv(min_keys, block_n), chunk)
    if ws:  # no schedule cuts a sequence of ≤ max_context keys into more than ⌈tiles / min_tiles⌉ chunks (one
        # sequence: the static split's), so the Gluon launch stops there: slots past it would only start and return
        # (128 heads B=1 1k–8k −3 to −5%, 64 heads B=2 4k −4%, 16 × 2 B=1 8k −2%, H100 session w); one a sequence at
        # least (max_context 0: each writes its empty output)
        slots = max(batch, min(slots, batch * triton.cdiv(tiles, chunk if batch == 1 else min_tiles)))
    if ranges and batch + slots - 1 <= RANGE_BLOCK:  # the heuristic's slots as programs, taking chunks or ranges
        return DecodePlan(cfg, ws, m_blocks, splits, batch + slots - 1, slots, wave, min_tiles, slots)
    # (one split a sequence because the batch fills the GPU, not because the context is short: there the extra wave
    # could never pay, and its programs would only start and return; nor where no sequence can be longer than
    # SWITCH_TILES + 1 tiles: a slot's further chunk costs the cost rule that much, so it never takes the extra wave
    # there (tests/ops/test_mla_decode.py searches for a counterexample), while the Gluon kernel's spare programs
    # and the merge kernel after them cost uniform 128-head batches 4–6 µs a call: NOTES, issue 6, session q)
    longest = triton.cdiv(max_context, block_n)
    extra = wave if (splits == 1 and 2 * batch > wave and ws and longest > SWITCH_TILES + 1) else 0
    return DecodePlan(cfg, ws, m_blocks, splits, slots + extra, slots, wave, min_tiles)


def seesaw_t_rows(rows, cache):
    """Whether `rows` (> 16) of a 16-bit cache the Gluon kernels take go to kernels_seesaw_t.py (up to its MAX_ROWS on
    a fast-DRAM GPU: FAST_DRAM_GBPS_PER_SM) rather than to kernels_ws.py's 64-row blocks."""
    from .kernels_seesaw_t import MAX_ROWS

    return rows <= MAX_ROWS and dram_gbps_per_sm(cache.device) >= FAST_DRAM_GBPS_PER_SM


def _ws_supported(cache):
    """Whether a warp-specialised Gluon kernel can run on this cache (the queries have its dtype or it is FP8:
    api.mla_decode checks): kernels_ws.py for 16-bit caches, kernels_fp8.py for FP8 ones."""
    if not cache.is_cuda:
        return False
    from . import kernels_fp8, kernels_ws

    return kernels_fp8.supported(cache) if cache.dtype == torch.float8_e4m3fn else kernels_ws.supported(cache)


def decode_num_splits(batch: int, m_blocks: int, max_context: int, num_sms: int, per_sm: int,
                      min_keys: int = MIN_KEYS_PER_SPLIT, small_keys: int = SMALL_MIN_KEYS) -> int:
    """Splits of the key range so that batch × m_blocks × splits programs fill the GPU once (num_sms × per_sm
    programs that fit at a time), rounded down so that no second, nearly empty wave follows, each split keeping
    ≥ min_keys keys, at most AUTO_MAX_SPLITS. Where that leaves fewer programs than half the SMs (small
    batches), splits shrink to ~small_keys keys, and short contexts get SHORT_SPLITS splits of ≥ 32 keys; where it
    leaves fewer programs than SMs (one m-block a sequence), up to one program an SM of ≥ small_keys keys.
    Shapes only (CUDA graphs). From the H100 A/Bs (benchmarks/NOTES.md, issue 6): B=1, 16 heads: 32 splits at
    1k, 64 at 8k, 128 at 32k; B=32 at 1k wants 4 splits of 256 keys (17 splits: −40%); rounding down instead
    of up (B=32 8k, 16 heads: 8 splits = 256 programs on 264 slots, not 17 = 2.06 waves) +9–15% at 16 heads,
    +21–37% at 128 heads."""
    programs = max(1, batch * m_blocks)
    fill = (num_sms * per_sm) // programs
    fit = max(1, max_context // min_keys)
    if programs * fit < num_sms // 2:
        fit = max(fit, max_context // small_keys, min(SHORT_SPLITS, max_context // 32))
    elif programs * fit < num_sms and m_blocks == 1:  # … and where it leaves some SMs idle, up to one program an SM
        # of ≥ small_keys keys (16 heads: B=1 20k 78 → 128 splits −21%, B=3 8k 32 → 44 −10%; 128 heads, two m-blocks
        # a sequence, B=3 4k 16 → 22 was 6% slower; NOTES, issue 6, session ae)
        fit = max(fit, min(num_sms // programs, max_context // small_keys))
    return max(1, min(fill, fit, AUTO_MAX_SPLITS))


def mla_decode(q_nope, q_pe, cache, cache_scales, block_tables, seq_lens, scale, num_splits, max_context,
               config=None, schedule=None):
    """q_nope [B, Q, H, 512], q_pe [B, Q, H, 64] → (o [B, Q, H, 512] in q's dtype, lse fp32 [B, Q, H]). schedule:
    schedule.build_schedule's for these lengths and this plan (api.mla_decode_schedule; built here if None)."""
    batch, n_new, heads, _ = q_nope.shape
    o = torch.empty(batch, n_new, heads, KV_LORA, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(batch, n_new, heads, dtype=torch.float32, device=q_nope.device)
    if o.numel() == 0:
        return o, lse
    fp8 = cache_scales is not None
    cfg, ws, m_blocks, splits, slots, base, wave, min_tiles, programs = decode_plan(
        (batch, n_new, heads), cache, max_context, num_splits, config)
    cfg.setdefault("PAGE_TILE", cache.shape[1] % cfg["BLOCK_N"] == 0)
    cfg["TMA"] = bool(cfg.get("TMA")) and cfg["PAGE_TILE"] and not fp8 and cache.data_ptr() % 16 == 0
    if (cfg["TMA"] or ws) and cache.is_cuda:
        _ensure_allocator()
    split = slots > batch or programs > 0
    # the Gluon kernel's partials go through the merge kernel (merging in the kernel cost it 8–13 µs: NOTES, issue
    # 6, session i)
    fused = cfg.pop("FUSED_MERGE", FUSED_MERGE) and split and splits <= FUSED_MAX_SPLITS and not ws
    # where a sequence may take more than FUSED_MAX_CHUNKS chunks (chunks are ≥ min_tiles tiles; a range may cut
    # one more), those merge in the merge kernel after the decode kernel: one program merging a long sequence's 64
    # partials was a skewed batch's tail (H100, session q: 16 heads 1 × 32k + 31 × 1k 62.7 → 45.3 µs)
    most_chunks = triton.cdiv(triton.cdiv(max_context, cfg["BLOCK_N"]), min_tiles) + (programs > 0)
    merge_after = FUSED_MAX_CHUNKS if fused and most_chunks > FUSED_MAX_CHUNKS else 0
    # the few-rows kernel merges in the kernel where no sequence can take more than FEW_FUSED_MAX_CHUNKS pieces, and
    # no merge kernel runs
    few_fused = ws and programs > 0 and most_chunks <= FEW_FUSED_MAX_CHUNKS and n_new * heads <= _few_rows()
    pdl = cfg.pop("PDL", PDL if ws else TRITON_PDL) and pdl_enabled(q_nope.device)
    # 16-bit partials: half the bytes written and merged (the Gluon kernel's: 128 heads B=32 1k +14%, B=1 32k +3%
    # through the one-row merge, session m); the Triton kernel's separate-merge path keeps fp32 ones (not measured
    # with 16-bit since session j, when the one-row merge was slower on them)
    partial_dtype = q_nope.dtype if fused or ws else torch.float32
    merge_rows = cfg.pop("MERGE_ROWS", None)  # tuning knob: which merge kernel (None: merge_partials decides)
    # the whole-rows merge behind the Gluon kernel launches with PDL, released once every decode program has issued
    # its last load (its launch hides under their last tiles: 128 heads B=32 1k 36.6 → 35.7 µs; behind the column-
    # block merge of B=1 it cost 1–3 µs, NOTES, issue 6, session u)
    merge_pdl = (ws and split and not few_fused and pdl and MERGE_PDL
                 and _rows_merge(batch * n_new * heads, splits, o.device, merge_rows, merge_after + 1))
    sstr = (cache_scales.stride(0), cache_scales.stride(1)) if fp8 else (0, 0)
    part_o, part_l, sched = o, lse, seq_lens  # not read without splits
    if split:
        part_o = torch.empty(slots, n_new, heads, KV_LORA, dtype=partial_dtype, device=o.device)
        part_l = torch.empty(slots, n_new, heads, dtype=torch.float32, device=o.device)
        sched = schedule if schedule is not None else build_schedule(seq_lens, cfg["BLOCK_N"], slots, min_tiles, base,
                                                                     wave, programs)
        if sched.shape != (schedule_size(batch, slots, programs),):
            raise ValueError(f"schedule has {tuple(sched.shape)} values; this call's plan ({slots} slots, {programs} "
                             f"programs) needs {schedule_size(batch, slots, programs)}")
    if ws and fp8:
        from .kernels_fp8 import mla_decode_fp8

        mla_decode_fp8(q_nope, q_pe, cache, cache_scales, block_tables, seq_lens, o, lse, part_o, part_l, sched,
                       scale * LOG2E, slots, pdl, merge_pdl)
    elif ws:  # few rows, the transposed seesaw to 32 rows on a fast-DRAM GPU, else the 64-row blocks
        from .kernels_few import mla_decode_few
        from .kernels_seesaw_t import mla_decode_seesaw_t
        from .kernels_ws import mla_decode_ws

        args = (q_nope, q_pe, cache, block_tables, seq_lens, o, lse, part_o, part_l, sched, scale * LOG2E, slots, pdl,
                merge_pdl)
        if n_new * heads <= _few_rows():
            mla_decode_few(*args, programs=programs, counters=_counters(o.device, 2 * batch) if few_fused else None)
        elif seesaw_t_rows(n_new * heads, cache):
            mla_decode_seesaw_t(*args, programs=programs)
        else:
            mla_decode_ws(*args)
    else:
        counters = _counters(o.device, batch * m_blocks) if fused else None
        _mla_decode_kernel[(m_blocks, programs or slots)](
            q_nope, q_pe, cache, cache_scales, block_tables, seq_lens, o, lse, part_o, part_l, sched,
            program_rows(sched, batch, slots) if programs else sched, counters,
            *q_nope.stride()[:3], *q_pe.stride()[:3], cache.stride(0), cache.stride(1), *sstr, block_tables.stride(0),
            n_new, heads, cache.shape[1], cache.shape[0] * cache.shape[1], scale * LOG2E, SPLIT=split, FP8=fp8,
            KV_LORA=KV_LORA, ROPE=ROPE, INTERPRET=interpreting(), FUSED_MERGE=fused, USE_PDL=pdl, RANGES=programs > 0,
            MERGE_AFTER=merge_after, **cfg, **({"launch_pdl": True} if pdl else {}),
        )
    if split and not few_fused and (merge_after or not fused):
        merge_partials(part_o, part_l, sched[SCHEDULE_ROW * slots:], o, lse, splits, merge_rows, merge_after + 1,
                       pdl=merge_pdl, max_chunks=most_chunks, release=pdl and MERGE_RELEASE)
    return o, lse


def _few_rows():
    """The rows the few-rows Gluon kernel takes (imported here: Gluon loads only where a Gluon kernel runs)."""
    from .kernels_few import MAX_ROWS

    return MAX_ROWS


def _rows_merge(all_rows, splits, device, rows_kernel=None, min_chunks=2) -> bool:
    """Whether merge_partials takes the whole-rows kernel (all_rows = batch × new tokens × heads)."""
    if rows_kernel is None:
        rows_kernel = MERGE_ROWS and all_rows >= 2 * sm_count(device) and splits <= MERGE_ROWS_SPLITS
    return rows_kernel and min_chunks <= 2


def merge_warps(block_d: int, chunk_s: int) -> int:
    """Warps of a generic merge program: as few as keep a row's sum over its partials inside each thread. Whole rows
    (512 columns) take 2, each warp 256 columns; at 4 and more the [chunks, columns] block was split over warps along
    the chunks and the sum crossed them through shared memory. 64-column blocks take 1 warp up to 64 partials (~128
    values a thread), 2 above (1 would hold 255 registers). H200 (benchmarks/NOTES.md, issue 6, session al): 2 warps
    against 4, al-9: 128 heads B=4 × 4k −8%, B=8 × 4k −12%, B=1 × 8k −11%, B=1 × 32k −7%; 1 against 2 on 64 columns ×
    64 partials, al-14: 128 heads B=1 × 8k −2.4%, × 32k −1.4%, and +11% at 16 heads' 128 partials."""
    return 2 if block_d == KV_LORA or chunk_s > 64 else 1


def merge_partials(part_o, part_l, sched, o, lse, splits, rows_kernel=None, min_chunks=2, pdl=False,
                   max_chunks=None, release=False):
    """The separate merge: partials part_o [slots, Q, H, 512], part_l [slots, Q, H] of the sequences in the merge
    list sched (the schedule's) of at least min_chunks chunks → o, lse. Whole rows × `splits` (the typical chunk
    count) partials per load where there are many rows and few splits (rows_kernel: force either kernel), else one
    row (or a column block of it) per program walking its chunks; the latter in column blocks for min_chunks > 2
    (the long sequences the decode kernel's in-kernel merge left: whole rows there were as slow as that merge,
    session q) and for few rows, unless a sequence has so few chunks (max_chunks: the most the plan allows) that
    whole rows take them in one round (MERGE_WHOLE_ROWS_16, _32); whole rows otherwise, up to MERGE_ROUND partials a
    round. pdl: the whole-rows kernel launched with programmatic dependent launch (mla_decode); release: either
    kernel releases the next kernel's launch at its start (MERGE_RELEASE)."""
    batch, n_new, heads, _ = o.shape
    rows = n_new * heads
    entries = merge_entries(batch, part_o.shape[0])
    few_rows = batch * rows < 2 * sm_count(o.device)
    if _rows_merge(batch * rows, splits, o.device, rows_kernel, min_chunks):
        S = max(2, triton.next_power_of_2(min(splits, MERGE_ROWS_SPLITS)))
        rows_per = max(1, MERGE_ROWS_ELEMS // S)
        _mla_merge_rows_kernel[(entries, triton.cdiv(rows, rows_per))](
            part_o, part_l, sched, o, lse, rows, ROWS=rows_per, S=S, KV_LORA=KV_LORA, USE_PDL=pdl,
            EARLY_TRIGGER=release, num_warps=4, **({"launch_pdl": True} if pdl else {}))
        return
    chunks = min(max_chunks or splits, part_o.shape[0] - batch + 1)  # the most a sequence can have
    block_d, chunk_s = KV_LORA, min(MERGE_ROUND, max(4, triton.next_power_of_2(chunks)))
    if few_rows or min_chunks > 2:
        block_d = MERGE_BLOCK_D
        chunk_s = (MERGE_CHUNK_S_FEW if rows * (KV_LORA // block_d) <= 2 * sm_count(o.device)
                   else min(MERGE_CHUNK_S, max(32, triton.next_power_of_2(splits))))
        whole = batch * rows >= (MERGE_WHOLE_ROWS_16 if chunks <= 16 else MERGE_WHOLE_ROWS_32 if chunks <= 32
                                 else float("inf"))
        if chunk_s != MERGE_CHUNK_S_FEW and whole:
            block_d, chunk_s = KV_LORA, max(16, triton.next_power_of_2(chunks))
    long_entries = 0
    if min_chunks > 2:  # at most this many sequences take min_chunks slots each, the others one or more
        long_entries = triton.next_power_of_2(entries)
        entries = max(1, min(entries, (part_o.shape[0] - batch) // (min_chunks - 1)))
    _mla_merge_kernel[(entries, rows, KV_LORA // block_d)](
        part_o, part_l, sched, o, lse, rows, min_chunks, CHUNK_S=chunk_s, KV_LORA=KV_LORA,
        BLOCK_D=block_d, INTERPRET=interpreting(), LONG_ENTRIES=long_entries,
        EARLY_TRIGGER=release, num_warps=merge_warps(block_d, chunk_s),
    )
