"""Attention: FlashAttention-style prefill (dense or packed varlen), paged KV-cache writes, FlashDecoding-style
paged decode with split-KV, and the merge of two attention states by their log-sum-exp.

Math in reference.py. Public functions validate their inputs, then call torch.library custom ops, which run
the Triton kernels for CUDA tensors (or on CPU under TRITON_INTERPRET=1) and the reference otherwise.

Layouts (the flash-attn conventions):
- prefill, packed: q [total_q, Hq, Dqk], k [total_k, Hk, Dqk], v [total_k, Hk, Dv] with int32 offsets
  cu_seqlens_q/k [B + 1]; o [total_q, Hq, Dv]; lse fp32 [Hq, total_q].
- prefill, dense: q [B, Sq, Hq, Dqk], k [B, Sk, Hk, Dqk], v [B, Sk, Hk, Dv]; o [B, Sq, Hq, Dv]; lse fp32 [B, Hq, Sq].
- paged cache: [num_pages, page_size, Hk, D]; token t of a sequence lives in page block_table[t // page_size],
  row t % page_size, i.e. slot = page · page_size + row.
- paged prefill (append): q [total_q, Hq, Dqk] packed new tokens with cu_seqlens_q; keys from the paged
  caches (seq_lens[b] tokens, the new ones included); o [total_q, Hq, Dv]; lse fp32 [Hq, total_q].
- decode: q [B, Q, Hq, Dqk] (Q new tokens per sequence, or [B, Hq, Dqk] for Q = 1); o like q with Dv;
  lse fp32 [B, Q, Hq].
- merge: o [..., H, D], lse o.shape[:-1] (so prefill's lse goes in as lse.transpose(-1, -2)).
LSE is the natural log of Σ exp(score) (scores after scale and softcap); −inf, with o = 0, for a query that
may see no key at all.
"""

import math
from typing import Optional

import torch

from ..._utils import (
    FLOAT_DTYPES, INDEX_DTYPES, check_block_tables, check_index_range, check_same_device, check_tensor,
    check_unit_stride, use_triton,
)
from . import reference

__all__ = ["attention_prefill", "attention_prefill_paged", "write_kv_cache", "attention_decode",
           "merge_attention_states"]

ATTN_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPE = torch.float8_e4m3fn
HEAD_DIMS = (64, 96, 128, 192, 256)  # any q/k dim with any v dim of this set (tested: d/d for 64…256, 192/128)
MAX_SPLITS = 128


def _int_like(name, x, minimum=None):
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be ≥ {minimum}, got {x}")


def _check_window(window, causal):
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"window must be a pair (left, right) of ints ≥ -1, got {window!r}")
    for side, w in zip(("left", "right"), window):
        _int_like(f"window {side}", w, minimum=-1)
    if causal and window[1] > 0:
        raise ValueError(f"window right must be -1 or 0 with causal attention (keys after the query), got {window[1]}")
    return int(window[0]), int(window[1])


def _check_scalars(scale, softcap):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0 or math.isinf(softcap):
        raise ValueError(f"softcap must be a finite number ≥ 0 (0 = off), got {softcap!r}")


def _check_head_dims(dqk, dv):
    if dqk not in HEAD_DIMS:
        raise ValueError(f"head dim of q and k must be one of {HEAD_DIMS}, got {dqk}")
    if dv not in HEAD_DIMS:
        raise ValueError(f"head dim of v must be one of {HEAD_DIMS}, got {dv}")


def _check_heads(hq, hk, hv, k_name="k", v_name="v"):
    if hk == 0 or hq % hk:
        raise ValueError(f"the query heads ({hq}) must be a multiple of the heads of {k_name} ({hk})")
    if hv != hk:
        raise ValueError(f"{v_name} must have as many heads as {k_name} ({hk}), got {hv}")


# ---------------------------------------------------------------------------------------------------
# prefill


def _check_cu_seqlens(name, cu, total):
    """Data checks for CPU offsets (on CUDA they would cost a host sync): start 0, non-decreasing, end total."""
    if cu.numel() == 0 or cu.device.type != "cpu":
        return
    c = cu.tolist()
    if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"{name} must start at 0, never decrease and end at {total} (the packed tokens), got {c}")


def _prefill_run(q, k, v, cu_q, cu_k, max_seqlen_q, scale, causal, left, right, softcap, return_lse):
    varlen = cu_q is not None
    if varlen and cu_q.device.type == "cpu":
        _check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0])
        _check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0])
        actual = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
        if max_seqlen_q >= 0 and max_seqlen_q < actual:
            raise ValueError(f"max_seqlen_q = {max_seqlen_q} is below the longest query sequence ({actual})")
    kw = dict(causal=causal, scale=scale, window=(left, right), softcap=softcap)
    if not use_triton(q):
        if varlen:
            o, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **kw)
        else:
            o, lse = reference.attention_dense(q, k, v, **kw)
        return o, (lse.float() if return_lse else lse.new_empty(0, dtype=torch.float32))
    from . import kernels  # late, so TRITON_INTERPRET can still be set by the caller

    if varlen and max_seqlen_q < 0:  # not given: one host sync (prefill only; decode never syncs)
        max_seqlen_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
    return kernels.prefill(q, k, v, cu_q, cu_k, max_seqlen_q, scale, causal, (left, right), softcap, return_lse)


@torch.library.custom_op("lmkernels::attention_prefill", mutates_args=())
def _prefill_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _prefill_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, causal, window_left,
                        window_right, softcap, return_lse)


@_prefill_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, causal, window_left, window_right, softcap,
      return_lse):
    o = q.new_empty(*q.shape[:-1], v.shape[-1])
    if not return_lse:
        return o, q.new_empty(0, dtype=torch.float32)
    if cu_seqlens_q is not None:
        return o, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    return o, q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)


def attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: Optional[float] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, return_lse: bool = False,
):
    """softmax(scale · q kᵀ [softcapped, masked]) v per query head, FlashAttention style; returns o or (o, lse).

    Packed varlen: q [total_q, Hq, Dqk], k [total_k, Hk, Dqk], v [total_k, Hk, Dv] with cu_seqlens_q/k
    [B + 1] (int32/int64, start 0, non-decreasing) → o [total_q, Hq, Dv], lse fp32 [Hq, total_q].
    Dense: q [B, Sq, Hq, Dqk], k/v [B, Sk, Hk, D] → o [B, Sq, Hq, Dv], lse fp32 [B, Hq, Sq].
    Query i of a sequence sits at key position i + k_len − q_len (aligned to the end: chunked prefill,
    prefix caches). causal: keys after that position are masked; window = (left, right): only keys in
    [pos − left, pos + right] (−1 = unbounded; right must be −1 or 0 with causal). softcap > 0:
    scores become softcap · tanh(score / softcap). GQA/MQA: Hq a multiple of Hk. dtypes float16 /
    bfloat16; head dims in HEAD_DIMS (e.g. 64, 96, 128, 256, and 192 for q/k with 128 for v).
    scale defaults to 1/sqrt(Dqk). A query with no visible key gets o = 0 and lse = −inf.
    max_seqlen_q: the longest query sequence (sizes the grid); if None on CUDA it costs one host sync.
    max_seqlen_k is accepted for flash-attn compatibility and not needed. Token and head strides are
    free (views of a fused qkv tensor are fine); last dims need stride 1.
    """
    causal = bool(causal)
    left, right = _check_window(window, causal)
    _check_scalars(scale, softcap)
    check_tensor("q", q, dtypes=ATTN_DTYPES)
    check_tensor("k", k, dtypes=(q.dtype,))
    check_tensor("v", v, dtypes=(q.dtype,))
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (packed varlen layout)")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise ValueError(
                    f"{name} must be [total_tokens, heads, dim] with cu_seqlens, got shape {tuple(t.shape)}")
        check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, ndim=1)
        check_tensor("cu_seqlens_k", cu_seqlens_k, dtypes=INDEX_DTYPES, shape=cu_seqlens_q.shape)
        if cu_seqlens_q.shape[0] < 1:
            raise ValueError("cu_seqlens_q must have B + 1 ≥ 1 entries")
        if max_seqlen_q is not None:
            _int_like("max_seqlen_q", max_seqlen_q, minimum=0)
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    else:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{name} must be [batch, seq, heads, dim] (or packed with cu_seqlens), "
                                 f"got shape {tuple(t.shape)}")
        if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must have the same sequence length, got {k.shape[1]} and {v.shape[1]}")
    _check_heads(q.shape[-2], k.shape[-2], v.shape[-2])
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have the head dim of q ({q.shape[-1]}), got {k.shape[-1]}")
    _check_head_dims(q.shape[-1], v.shape[-1])
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_unit_stride(name, t)
    if max_seqlen_k is not None:
        _int_like("max_seqlen_k", max_seqlen_k, minimum=0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, lse = _prefill_op(q, k, v, cu_seqlens_q, cu_seqlens_k, -1 if max_seqlen_q is None else int(max_seqlen_q),
                         scale, causal, left, right, float(softcap), bool(return_lse))
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------------
# paged KV-cache write


@torch.library.custom_op("lmkernels::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
) -> None:
    check_index_range("slot_mapping", slot_mapping, -1, k_cache.shape[0] * k_cache.shape[1], "−1 = skip")
    if not use_triton(k):
        reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    from . import kernels

    kernels.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_write_kv_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    return None


def _check_scales(k_cache, k_scale, v_scale, n_heads):
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 cache needs k_scale and v_scale (float32, one per kv head or one scalar)")
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError(f"k_scale/v_scale apply to FP8 caches only; k_cache is {k_cache.dtype}")
    if fp8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(name, s, dtypes=(torch.float32,))
            if s.dim() > 1 or s.numel() not in (1, n_heads):
                raise ValueError(f"{name} must hold one float32 per kv head ({n_heads}) or one scalar, got shape "
                                 f"{tuple(s.shape)}")


def _check_caches(k_cache, v_cache, n_heads, dk, dv, dtype, names=("k_cache", "v_cache")):
    kn, vn = names
    check_tensor(kn, k_cache, dtypes=tuple(dict.fromkeys((dtype, FP8_DTYPE))), ndim=4)
    check_tensor(vn, v_cache, dtypes=(k_cache.dtype,), ndim=4)
    if k_cache.shape[2] != n_heads or k_cache.shape[3] != dk:
        raise ValueError(f"{kn} must be [num_pages, page_size, {n_heads}, {dk}], got {tuple(k_cache.shape)}")
    if tuple(v_cache.shape) != (k_cache.shape[0], k_cache.shape[1], n_heads, dv):
        raise ValueError(f"{vn} must be [{k_cache.shape[0]}, {k_cache.shape[1]}, {n_heads}, {dv}], "
                         f"got {tuple(v_cache.shape)}")
    if k_cache.shape[1] == 0:
        raise ValueError(f"{kn} must have a page size ≥ 1")
    check_unit_stride(kn, k_cache)
    check_unit_stride(vn, v_cache)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Store token t's k [T, Hk, Dk] and v [T, Hk, Dv] rows at slot_mapping[t] of the paged caches, in place.

    Caches: [num_pages, page_size, Hk, D] of k's dtype, or float8_e4m3fn with k_scale/v_scale (float32,
    per kv head [Hk] or one scalar): the cache holds x / scale rounded to nearest, saturated at ±448.
    slot = page · page_size + row; slot −1 skips the token (padding). One launch writes k and v.
    Slots are range-checked for CPU tensors only (on CUDA the check would cost a host sync).
    """
    check_tensor("k", k, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("v", v, dtypes=(k.dtype,), ndim=3)
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must have k's tokens and heads {tuple(k.shape[:2])}, got {tuple(v.shape[:2])}")
    _check_caches(k_cache, v_cache, k.shape[1], k.shape[2], v.shape[2], k.dtype)
    _check_scales(k_cache, k_scale, v_scale, k.shape[1])
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, shape=(k.shape[0],))
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, k_scale=k_scale,
                      v_scale=v_scale)
    check_unit_stride("k", k)
    check_unit_stride("v", v)
    _write_kv_op(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# ---------------------------------------------------------------------------------------------------
# paged decode


def _check_paged_kv(q, hq, dqk, k_cache, v_cache, k_scale, v_scale):
    """The paged caches of decode and paged prefill against q ([.., hq, dqk]): dtypes, heads, head dims, scales."""
    check_tensor("k_cache", k_cache, dtypes=tuple(dict.fromkeys((q.dtype, FP8_DTYPE))), ndim=4)
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4)
    _check_heads(hq, k_cache.shape[2], v_cache.shape[2], "k_cache", "v_cache")
    if k_cache.shape[3] != dqk:
        raise ValueError(f"k_cache must have the head dim of q ({dqk}), got {k_cache.shape[3]}")
    _check_head_dims(dqk, v_cache.shape[3])
    _check_caches(k_cache, v_cache, k_cache.shape[2], dqk, v_cache.shape[3], q.dtype)
    _check_scales(k_cache, k_scale, v_scale, k_cache.shape[2])


def _decode_run(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, scale, window_left, softcap,
                num_splits, max_context, return_lse):
    check_block_tables(block_tables, seq_lens, k_cache.shape[1], k_cache.shape[0])
    if not use_triton(q):
        o, lse = reference.attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                            window=(window_left, -1), softcap=softcap, k_scale=k_scale,
                                            v_scale=v_scale)
        return o, (lse.float() if return_lse else lse.new_empty(0, dtype=torch.float32))
    from . import kernels

    return kernels.decode(q, k_cache, v_cache, block_tables, seq_lens, scale, (window_left, -1), softcap,
                          num_splits or None, max_context, k_scale, v_scale, return_lse)


@torch.library.custom_op("lmkernels::attention_decode", mutates_args=())
def _decode_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], scale: float,
    window_left: int, softcap: float, num_splits: int, max_context: int, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode_run(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, scale, window_left, softcap,
                       num_splits, max_context, return_lse)


@_decode_op.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, scale, window_left, softcap, num_splits,
      max_context, return_lse):
    o = q.new_empty(*q.shape[:-1], v_cache.shape[-1])
    return o, q.new_empty(q.shape[:-1] if return_lse else (0,), dtype=torch.float32)


def attention_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, *, scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, num_splits: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None, return_lse: bool = False,
):
    """Attention of the newest tokens of each sequence over its paged KV cache (FlashDecoding); o or (o, lse).

    q: [B, Q, Hq, Dqk] — the last Q tokens of each sequence (Q > 1: speculative verification; causal
    among them) — or [B, Hq, Dqk] for Q = 1; o has q's shape with Dv, lse fp32 [B, Q, Hq] ([B, Hq]).
    k_cache/v_cache: [num_pages, page_size, Hk, D], q's dtype or float8_e4m3fn with k_scale/v_scale
    (float32 per kv head, or one scalar: value = cache · scale). block_tables: [B, max_pages] int32;
    seq_lens: [B] int32, each sequence's length including the Q new tokens (which must already be in
    the cache: write_kv_cache first). A sequence shorter than Q leaves its first queries with no key
    (o = 0, lse = −inf); a length-0 slot (a padded batch) gives zeros.
    window = (left, right): keys in [pos − left, pos]; right must be −1 or 0 (decode is causal).
    num_splits: the most key-range splits per sequence (split-KV); None picks them from batch, kv heads,
    the SM count and max_seqlen_k (an upper bound on seq_lens; default: the block table's capacity).
    Every sequence is cut into chunks of ⌈max_seqlen_k / num_splits⌉ keys, so a short sequence uses
    fewer splits than a long one (a skewed batch stays balanced); a bound below the real lengths only
    makes the chunks longer. A single sequence with num_splits None is instead cut by its actual length
    on the device (a 512-key context gets 8 splits even in a launch sized for 8192). Neither depends on
    seq_lens' values for the launch, so the launch is fixed for a batch size and CUDA graphs capture it;
    results do not depend on the splits beyond rounding. No host sync.
    Data checks (seq_lens fit the page table, pages in range) run for CPU tensors only.
    """
    left, right = _check_window(window, causal=True)
    _check_scalars(scale, softcap)
    check_tensor("q", q, dtypes=ATTN_DTYPES)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [batch, q_per_seq, heads, dim] or [batch, heads, dim], got shape {tuple(q.shape)}")
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(1) if squeeze else q
    batch, _, hq, dqk = q4.shape
    _check_paged_kv(q, hq, dqk, k_cache, v_cache, k_scale, v_scale)
    check_tensor("block_tables", block_tables, dtypes=INDEX_DTYPES, ndim=2)
    if block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must have one row per sequence ({batch}), got shape {tuple(block_tables.shape)}")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(batch,))
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                      k_scale=k_scale, v_scale=v_scale)
    check_unit_stride("q", q)
    if block_tables.numel() and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dimension, got strides {block_tables.stride()}")
    if num_splits is not None:
        _int_like("num_splits", num_splits, minimum=1)
        if num_splits > MAX_SPLITS:
            raise ValueError(f"num_splits must be at most {MAX_SPLITS}, got {num_splits}")
    page_size = k_cache.shape[1]
    if max_seqlen_k is None:
        max_seqlen_k = block_tables.shape[1] * page_size
    _int_like("max_seqlen_k", max_seqlen_k, minimum=0)
    scale = 1.0 / math.sqrt(dqk) if scale is None else float(scale)
    o, lse = _decode_op(q4, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, scale, left, float(softcap),
                        0 if num_splits is None else int(num_splits), int(max_seqlen_k), bool(return_lse))
    if squeeze:
        o = o.squeeze(1)
        lse = lse.squeeze(1) if return_lse else lse
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------------
# paged prefill (append)


def _check_new_tokens(cu_seqlens_q, seq_lens, max_seqlen_q):
    if cu_seqlens_q.device.type != "cpu" or seq_lens.numel() == 0:
        return
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    for b, (n_q, n) in enumerate(zip(q_lens, seq_lens.tolist())):
        if n < n_q:
            raise ValueError(f"seq_lens[{b}] = {n} is below that sequence's {n_q} new tokens: the cache must hold "
                             f"them (write_kv_cache first)")
    if max_seqlen_q >= 0 and max_seqlen_q < max(q_lens):
        raise ValueError(f"max_seqlen_q = {max_seqlen_q} is below the longest query sequence ({max(q_lens)})")


def _prefill_paged_run(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, max_seqlen_q,
                       scale, causal, left, right, softcap, return_lse):
    if cu_seqlens_q.device.type == "cpu":
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        _check_new_tokens(cu_seqlens_q, seq_lens, max_seqlen_q)
        check_block_tables(block_tables, seq_lens, k_cache.shape[1], k_cache.shape[0])
    if not use_triton(q):
        o, lse = reference.attention_prefill_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                                   causal=causal, scale=scale, window=(left, right), softcap=softcap,
                                                   k_scale=k_scale, v_scale=v_scale)
        return o, (lse.float() if return_lse else lse.new_empty(0, dtype=torch.float32))
    from . import kernels

    if max_seqlen_q < 0:  # not given: one host sync
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0
    return kernels.prefill_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale,
                                 causal, (left, right), softcap, k_scale, v_scale, return_lse)


@torch.library.custom_op("lmkernels::attention_prefill_paged", mutates_args=())
def _prefill_paged_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor], max_seqlen_q: int, scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _prefill_paged_run(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale,
                              max_seqlen_q, scale, causal, window_left, window_right, softcap, return_lse)


@_prefill_paged_op.register_fake
def _(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, max_seqlen_q, scale, causal,
      window_left, window_right, softcap, return_lse):
    o = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    return o, q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32)


def attention_prefill_paged(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, *, max_seqlen_q: Optional[int] = None, causal: bool = True,
    scale: Optional[float] = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None, return_lse: bool = False,
):
    """Append prefill (chunked prefill, prefix caching): each request's new tokens attend to its cached
    pages plus themselves; returns o or (o, lse).

    q: [total_q, Hq, Dqk] the new tokens, packed with cu_seqlens_q [B + 1]; they must already be in the
    caches (write_kv_cache first) as the last tokens of each sequence, whose full length (cached prefix +
    new tokens) is seq_lens[b]. k_cache/v_cache: [num_pages, page_size, Hk, D], q's dtype or float8_e4m3fn
    with k_scale/v_scale; block_tables [B, max_pages]. Masking, window, softcap, scale and the layout of o
    [total_q, Hq, Dv] and lse fp32 [Hq, total_q] are those of attention_prefill with k_len = seq_lens[b]
    (queries aligned to the end). max_seqlen_q sizes the grid; if None on CUDA it costs one host sync.
    Data checks (offsets, seq_lens ≥ new tokens, page table long enough) run for CPU tensors only.
    """
    causal = bool(causal)
    left, right = _check_window(window, causal)
    _check_scalars(scale, softcap)
    check_tensor("q", q, dtypes=ATTN_DTYPES, ndim=3)
    n_q, hq, dqk = q.shape
    _check_paged_kv(q, hq, dqk, k_cache, v_cache, k_scale, v_scale)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, ndim=1)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have B + 1 ≥ 1 entries")
    batch = cu_seqlens_q.shape[0] - 1
    check_tensor("block_tables", block_tables, dtypes=INDEX_DTYPES, ndim=2)
    if block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must have one row per sequence ({batch}), got shape {tuple(block_tables.shape)}")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(batch,))
    if max_seqlen_q is not None:
        _int_like("max_seqlen_q", max_seqlen_q, minimum=0)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
                      seq_lens=seq_lens, k_scale=k_scale, v_scale=v_scale)
    check_unit_stride("q", q)
    if block_tables.numel() and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dimension, got strides {block_tables.stride()}")
    scale = 1.0 / math.sqrt(dqk) if scale is None else float(scale)
    o, lse = _prefill_paged_op(q, k_cache, v_cache, block_tables, cu_seqlens_q.to(torch.int32), seq_lens, k_scale,
                               v_scale, -1 if max_seqlen_q is None else int(max_seqlen_q), scale, causal, left, right,
                               float(softcap), bool(return_lse))
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------------
# merge


@torch.library.custom_op("lmkernels::merge_attention_states", mutates_args=())
def _merge_op(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(o_a):
        o, lse = reference.merge_states(o_a, lse_a, o_b, lse_b)
        return o.contiguous(), lse.float().contiguous()
    from . import kernels

    h, d = o_a.shape[-2], o_a.shape[-1]
    o, lse = kernels.merge(o_a.reshape(-1, h, d), lse_a.reshape(-1, h), o_b.reshape(-1, h, d), lse_b.reshape(-1, h))
    return o.view(o_a.shape), lse.view(lse_a.shape)


@_merge_op.register_fake
def _(o_a, lse_a, o_b, lse_b):
    return torch.empty_like(o_a, memory_format=torch.contiguous_format), lse_a.new_empty(lse_a.shape)


def merge_attention_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine attention over two disjoint key sets: (o, lse) with lse = log(e^lse_a + e^lse_b) and
    o = e^(lse_a − lse)·o_a + e^(lse_b − lse)·o_b (split-KV, cascades, ring attention).

    o_a, o_b: [..., H, D], float32/float16/bfloat16 (o has o_a's dtype); lse_a, lse_b: float32 of shape
    o_a.shape[:-1] (natural log, any strides: prefill's lse enters as lse.transpose(-1, -2)). An empty
    part has lse = −inf (its o is ignored); two empty parts give o = 0, lse = −inf.
    """
    check_tensor("o_a", o_a, dtypes=FLOAT_DTYPES, min_ndim=2)
    check_tensor("o_b", o_b, dtypes=(o_a.dtype,), shape=o_a.shape)
    check_tensor("lse_a", lse_a, dtypes=(torch.float32,), shape=o_a.shape[:-1])
    check_tensor("lse_b", lse_b, dtypes=(torch.float32,), shape=o_a.shape[:-1])
    check_same_device(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    check_unit_stride("o_a", o_a)
    check_unit_stride("o_b", o_b)
    return _merge_op(o_a, lse_a, o_b, lse_b)
