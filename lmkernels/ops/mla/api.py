"""Public MLA ops: argument checks, then torch.library custom ops that run the Triton kernels for CUDA tensors
(or on CPU under TRITON_INTERPRET=1) and the float64 references otherwise. Math and layouts: reference.py."""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..._utils import (
    FLOAT_DTYPES, INDEX_DTYPES, check_block_tables, check_index_range, check_same_device, check_tensor,
    check_unit_stride, use_triton,
)
from . import reference
from .reference import KV_LORA_RANK, LATENT_DIM, N_SCALES, ROPE_DIM

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn
MAX_SPLITS = 256


def _int_like(name, x, minimum=None, maximum=None):
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be ≥ {minimum}, got {x}")
    if maximum is not None and x > maximum:
        raise ValueError(f"{name} must be ≤ {maximum}, got {x}")


def _check_cache(latent_cache, cache_scales):
    check_tensor("latent_cache", latent_cache, dtypes=CACHE_DTYPES + (FP8_DTYPE,), ndim=3)
    if latent_cache.shape[2] != LATENT_DIM:
        raise ValueError(f"latent_cache must be [num_pages, page_size, {LATENT_DIM}] (kv_lora_rank {KV_LORA_RANK} + "
                         f"rope dim {ROPE_DIM}), got latent width {latent_cache.shape[2]}")
    if latent_cache.shape[1] == 0:
        raise ValueError("latent_cache must have a page size ≥ 1")
    if not latent_cache.is_contiguous():
        raise ValueError(f"latent_cache must be contiguous, got strides {latent_cache.stride()}")
    fp8 = latent_cache.dtype == FP8_DTYPE
    if fp8 and cache_scales is None:
        raise ValueError(f"an FP8 latent_cache needs cache_scales (float32 [num_pages, page_size, {N_SCALES}])")
    if not fp8 and cache_scales is not None:
        raise ValueError(f"cache_scales apply to an FP8 latent_cache only; latent_cache is {latent_cache.dtype}")
    if fp8:
        check_tensor("cache_scales", cache_scales, dtypes=(torch.float32,),
                     shape=(*latent_cache.shape[:2], N_SCALES))
        if not cache_scales.is_contiguous():
            raise ValueError("cache_scales must be contiguous")


def new_latent_cache(num_pages: int, page_size: int, *, dtype=torch.bfloat16, device=None):
    """An empty latent cache: (cache [num_pages, page_size, 576], scales or None). dtype float8_e4m3fn gives
    scales float32 [num_pages, page_size, 5] (one per 128 values)."""
    _int_like("num_pages", num_pages, minimum=1)
    _int_like("page_size", page_size, minimum=1)
    if dtype not in CACHE_DTYPES + (FP8_DTYPE,):
        raise TypeError(f"dtype must be one of float16, bfloat16, float32, float8_e4m3fn; got {dtype}")
    cache = torch.zeros(num_pages, page_size, LATENT_DIM, dtype=dtype, device=device)
    scales = (torch.ones(num_pages, page_size, N_SCALES, dtype=torch.float32, device=device)
              if dtype == FP8_DTYPE else None)
    return cache, scales


# ---------------------------------------------------------------------------------------------------
# fused latent-cache write


@torch.library.custom_op("lmkernels::mla_write_latent_cache", mutates_args=("latent_cache", "cache_scales"))
def _write_op(kv: torch.Tensor, weight: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
              slot_mapping: torch.Tensor, latent_cache: torch.Tensor, cache_scales: Optional[torch.Tensor],
              eps: float) -> None:
    check_index_range("slot_mapping", slot_mapping, -1, latent_cache.shape[0] * latent_cache.shape[1], "−1 = skip")
    check_index_range("positions", positions, 0, cos_sin_cache.shape[0], "the rows of cos_sin_cache")
    if not use_triton(kv):
        reference.write_latent_cache(kv, weight, cos_sin_cache, positions, slot_mapping, latent_cache, cache_scales,
                                     eps)
        return
    from . import kernels

    kernels.write_latent_cache(kv, weight, cos_sin_cache, positions, slot_mapping, latent_cache, cache_scales, eps)


@_write_op.register_fake
def _(kv, weight, cos_sin_cache, positions, slot_mapping, latent_cache, cache_scales, eps):
    return None


def write_latent_cache(
    kv: torch.Tensor, weight: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
    slot_mapping: torch.Tensor, latent_cache: torch.Tensor, *, cache_scales: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
) -> None:
    """In place, one launch: latent_cache[slot_mapping[t]] = [RMSNorm(kv[t, :512])·weight | RoPE(kv[t, 512:])].

    kv: the wkv_a (kv_a_proj_with_mqa) output [T, 576], float16/bfloat16/float32 (rows may be strided, e.g.
    a slice of a fused projection); weight: the kv_a_layernorm weight [512]; cos_sin_cache: [max_position, 64]
    = [cos | sin] per position (lmkernels.ops.rope.build_cos_sin_cache(64, …), YaRN factor included);
    positions [T] and slot_mapping [T] int32/int64 (slot = page · page_size + row, −1 skips the token).
    RoPE: interleaved pairs (x[2j], x[2j+1]), DeepSeek style, written back interleaved (q_pe must be rotated
    the same way: apply_rotary(..., is_neox=False)). latent_cache [num_pages, page_size, 576] of any float
    dtype, or float8_e4m3fn with cache_scales float32 [num_pages, page_size, 5] (one scale per 128 values,
    max|x|/448, written by this op). Range checks of slots/positions run for CPU tensors only.
    """
    check_tensor("kv", kv, dtypes=FLOAT_DTYPES, ndim=2)
    if kv.shape[1] != LATENT_DIM:
        raise ValueError(f"kv must be the wkv_a output [tokens, {LATENT_DIM}], got latent width {kv.shape[1]}")
    check_unit_stride("kv", kv)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, shape=(KV_LORA_RANK,))
    check_unit_stride("weight", weight)
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=FLOAT_DTYPES, ndim=2)
    if cos_sin_cache.shape[1] != ROPE_DIM:
        raise ValueError(f"cos_sin_cache must be [max_position, {ROPE_DIM}] ([cos | sin] of the rope dims), got "
                         f"{tuple(cos_sin_cache.shape)}")
    check_unit_stride("cos_sin_cache", cos_sin_cache)
    n = kv.shape[0]
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(n,))
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, shape=(n,))
    _check_cache(latent_cache, cache_scales)
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number ≥ 0, got {eps!r}")
    check_same_device(kv=kv, weight=weight, cos_sin_cache=cos_sin_cache, positions=positions,
                      slot_mapping=slot_mapping, latent_cache=latent_cache, cache_scales=cache_scales)
    _write_op(kv, weight, cos_sin_cache, positions, slot_mapping, latent_cache, cache_scales, float(eps))


# ---------------------------------------------------------------------------------------------------
# absorbed decode


def _decode_run(q_nope, q_pe, latent_cache, cache_scales, block_tables, seq_lens, scale, num_splits, max_context,
                schedule):
    check_block_tables(block_tables, seq_lens, latent_cache.shape[1], latent_cache.shape[0])
    if not use_triton(q_nope):
        o, lse = reference.mla_decode(q_nope, q_pe, latent_cache, block_tables, seq_lens, scale, cache_scales)
        return o.to(q_nope.dtype), lse.float()
    from . import kernels

    return kernels.mla_decode(q_nope, q_pe, latent_cache, cache_scales, block_tables, seq_lens, scale,
                              num_splits or None, max_context, schedule=schedule)


@torch.library.custom_op("lmkernels::mla_decode", mutates_args=())
def _decode_op(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
               cache_scales: Optional[torch.Tensor], block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, num_splits: int, max_context: int,
               schedule: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode_run(q_nope, q_pe, latent_cache, cache_scales, block_tables, seq_lens, scale, num_splits,
                       max_context, schedule)


@_decode_op.register_fake
def _(q_nope, q_pe, latent_cache, cache_scales, block_tables, seq_lens, scale, num_splits, max_context, schedule):
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_nope.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("lmkernels::mla_decode_schedule", mutates_args=())
def _schedule_op(seq_lens: torch.Tensor, block_n: int, slots: int, base: int, wave: int, min_tiles: int,
                 programs: int) -> torch.Tensor:
    from .schedule import build_schedule

    return build_schedule(seq_lens, block_n, slots, min_tiles, base, wave, programs)


@_schedule_op.register_fake
def _(seq_lens, block_n, slots, base, wave, min_tiles, programs):
    from .schedule import schedule_size

    return seq_lens.new_empty(schedule_size(seq_lens.shape[0], slots, programs), dtype=torch.int32)


@dataclass(frozen=True)
class MLADecodeSchedule:
    """Which keys of which sequence each decode program takes in one decode step (mla_decode_schedule). plan:
    (batch, key tile, chunk slots, the heuristic's slots, slots at once, smallest chunk, programs with ranges), what
    the table was made for;
    table: int32 on the device, None where the plan gives one program per sequence or the reference runs (nothing to
    schedule)."""
    plan: tuple
    table: Optional[torch.Tensor]


def _schedule_plan(batch, n_new, heads, latent_cache, max_seqlen_k, num_splits):
    from . import kernels

    plan = kernels.decode_plan((batch, n_new, heads), latent_cache, max_seqlen_k, num_splits)
    return batch, plan.cfg["BLOCK_N"], plan.slots, plan.base, plan.wave, plan.min_tiles, plan.programs


def _check_decode_shapes(latent_cache, cache_scales, block_tables, seq_lens, batch, num_splits, max_seqlen_k):
    """Checks mla_decode and mla_decode_schedule share; returns max_seqlen_k (default: the page table's capacity)."""
    _check_cache(latent_cache, cache_scales)
    check_tensor("block_tables", block_tables, dtypes=INDEX_DTYPES, ndim=2)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have one row per sequence ({batch}), got shape {tuple(block_tables.shape)}")
    if block_tables.numel() and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dimension, got strides {block_tables.stride()}")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(batch,))
    if num_splits is not None:
        _int_like("num_splits", num_splits, minimum=1, maximum=MAX_SPLITS)
    if max_seqlen_k is None:
        max_seqlen_k = block_tables.shape[1] * latent_cache.shape[1]
    _int_like("max_seqlen_k", max_seqlen_k, minimum=0)
    return max_seqlen_k


def mla_decode_schedule(
    latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, *, num_heads: int,
    q_per_seq: int = 1, num_splits: Optional[int] = None, cache_scales: Optional[torch.Tensor] = None,
    max_seqlen_k: Optional[int] = None,
) -> MLADecodeSchedule:
    """The split-KV schedule of one decode step, for mla_decode(..., schedule=): computed once per step on the
    device (one small kernel, no host sync) and shared by every layer whose call has the same shapes and lengths,
    instead of each call computing it again. The arguments are those of the mla_decode calls it serves (num_heads,
    q_per_seq: the queries' heads and tokens per sequence); the table holds the values of seq_lens as they are
    when this runs, so make it again whenever the lengths change (inside a CUDA graph: capture this call too)."""
    for name, v in (("num_heads", num_heads), ("q_per_seq", q_per_seq)):
        _int_like(name, v, minimum=1)
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1)
    max_seqlen_k = _check_decode_shapes(latent_cache, cache_scales, block_tables, seq_lens, seq_lens.shape[0],
                                        num_splits, max_seqlen_k)
    check_same_device(latent_cache=latent_cache, cache_scales=cache_scales, block_tables=block_tables,
                      seq_lens=seq_lens)
    if not use_triton(seq_lens):
        return MLADecodeSchedule(None, None)
    plan = _schedule_plan(seq_lens.shape[0], q_per_seq, num_heads, latent_cache, max_seqlen_k, num_splits)
    batch, block_n, slots, base, wave, min_tiles, programs = plan
    table = _schedule_op(seq_lens, block_n, slots, base, wave, min_tiles, programs) if slots > batch or programs \
        else None
    return MLADecodeSchedule(plan, table)


def mla_decode(
    q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, *, scale: float, num_splits: Optional[int] = None,
    cache_scales: Optional[torch.Tensor] = None, max_seqlen_k: Optional[int] = None,
    schedule: Optional[MLADecodeSchedule] = None,
):
    """Absorbed MLA decode over the paged latent cache → (o [B, Q, H, 512] in q's dtype, lse fp32 [B, Q, H]).

    q_nope_absorbed [B, Q, H, 512] (q_nope · W_UK per head) and q_pe [B, Q, H, 64] (rotated like the cache's
    k_pe) for the last Q tokens of each sequence (Q > 1: MTP / speculative verification, causal among them);
    float16/bfloat16 (float32 runs through the reference only on CPU; the kernel takes 16-bit queries).
    latent_cache [num_pages, page_size, 576]: q's dtype, or float8_e4m3fn with cache_scales
    ([num_pages, page_size, 5] float32). block_tables [B, max_pages] int32/int64, seq_lens [B]: each
    sequence's length including its Q new tokens (already written). scale: the softmax scale (DeepSeek:
    1/sqrt(192) · mscale²). num_splits: split-KV programs per sequence (1 … 256); None picks it from batch,
    heads, the SM count and max_seqlen_k (a bound on seq_lens; default the block table's capacity), never from
    the lengths' values, so CUDA graphs capture the launch. The kernel then spreads the keys over those programs
    (and, with None, the spare ones of the last wave) by the lengths, on the device: a long sequence among short
    ones gets more of them. That schedule costs a small kernel per call; a decode step's layers share one from
    mla_decode_schedule (same shapes, max_seqlen_k and num_splits; a schedule made for another plan is an error).
    A query with no visible key: o = 0, lse = −inf.
    o_lat → output: o · W_UVᵀ (the caller's job). Data checks (seq_lens fit the page table, pages in range)
    run for CPU tensors only.
    """
    check_tensor("q_nope_absorbed", q_nope_absorbed, dtypes=Q_DTYPES, ndim=4)
    batch, n_new, heads, width = q_nope_absorbed.shape
    if width != KV_LORA_RANK:
        raise ValueError(f"q_nope_absorbed must be [batch, q_per_seq, heads, {KV_LORA_RANK}], got last dim {width}")
    check_tensor("q_pe", q_pe, dtypes=(q_nope_absorbed.dtype,), shape=(batch, n_new, heads, ROPE_DIM))
    max_seqlen_k = _check_decode_shapes(latent_cache, cache_scales, block_tables, seq_lens, batch, num_splits,
                                        max_seqlen_k)
    if latent_cache.dtype not in (q_nope_absorbed.dtype, FP8_DTYPE):
        raise TypeError(f"latent_cache must have the queries' dtype ({q_nope_absorbed.dtype}) or be float8_e4m3fn, "
                        f"got {latent_cache.dtype}")
    if use_triton(q_nope_absorbed) and q_nope_absorbed.dtype == torch.float32:
        raise TypeError("q_nope_absorbed must be float16 or bfloat16 for the Triton kernel, got float32")
    check_same_device(q_nope_absorbed=q_nope_absorbed, q_pe=q_pe, latent_cache=latent_cache,
                      cache_scales=cache_scales, block_tables=block_tables, seq_lens=seq_lens)
    check_unit_stride("q_nope_absorbed", q_nope_absorbed)
    check_unit_stride("q_pe", q_pe)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    table = None
    if schedule is not None:
        if not isinstance(schedule, MLADecodeSchedule):
            raise TypeError(f"schedule must come from mla_decode_schedule, got {type(schedule).__name__}")
        if use_triton(q_nope_absorbed):
            plan = _schedule_plan(batch, n_new, heads, latent_cache, max_seqlen_k, num_splits)
            if schedule.plan != plan:
                raise ValueError(f"schedule was made for (batch, key tile, slots, base slots, wave, smallest chunk, "
                                 f"programs) = "
                                 f"{schedule.plan}, this call needs {plan}: make it with this call's shapes, "
                                 f"max_seqlen_k and num_splits")
            table = schedule.table
            check_same_device(q_nope_absorbed=q_nope_absorbed, schedule=table)
    return _decode_op(q_nope_absorbed, q_pe, latent_cache, cache_scales, block_tables, seq_lens, float(scale),
                      0 if num_splits is None else int(num_splits), int(max_seqlen_k), table)
