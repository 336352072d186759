"""MLA prefill (chunked): new tokens attend to their cached context and to themselves through the attention
family's prefill kernel (q/k dim nope + 64, v dim v_head_dim), after up-projecting the latents:
    k_nope = c_kv · W_UKᵀ,  v = c_kv · W_UVᵀ,  k = [k_nope | k_pe] (k_pe shared by all heads).
The new tokens (causal among themselves) and the cached prefix (all visible, in chunks of chunk_size
tokens to bound the up-projected workspace) give partial (o, lse) that merge_attention_states combines.
Prefill synchronises with the host (the lengths size the gathers and the grids): it reads the lengths and the page
table (for its check) once and sends each chunk's key positions over in one transfer; decode never does.
"""

from typing import Optional

import torch

from ..._utils import INDEX_DTYPES, check_same_device, check_tensor, check_unit_stride
from ..attention import attention_prefill, merge_attention_states
from .api import FP8_DTYPE, _check_cache, _int_like
from .reference import KV_LORA_RANK, ROPE_DIM, dequantize_rows

HEAD_DIMS = (64, 96, 128, 192, 256)  # the attention prefill kernel's head dims


def _gather(cache, cache_scales, block_tables, seq_idx, pos, dtype):
    """Latent rows of (sequence, position) pairs, in the compute dtype (FP8 dequantised)."""
    page = cache.shape[1]
    pages = block_tables[seq_idx, pos // page].long()
    rows = cache[pages, pos % page]
    if cache_scales is not None:
        rows = dequantize_rows(rows, cache_scales[pages, pos % page])
    return rows.to(dtype)


def _ranges(starts, ends, device):
    """Packed (sequence index, position) of the key ranges [starts[b], ends[b]) and their cu_seqlens, worked out on
    the host (host tensors) and sent in one transfer."""
    lens = (ends - starts).clamp(min=0)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = lens.cumsum(0)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pos = torch.arange(int(cu[-1])) - cu[:-1][seq] + starts[seq]
    packed = torch.cat((cu, seq, pos)).to(device)
    n = seq.numel()
    return packed[len(lens) + 1:len(lens) + 1 + n], packed[len(lens) + 1 + n:], packed[:len(lens) + 1]


def _keys_values(rows, w_uk, w_uv):
    """Up-projection: rows [N, 576] → k [N, H, nope + 64], v [N, H, v_dim] (contiguous)."""
    c, pe = rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:]
    k_nope = torch.einsum("nd,hkd->nhk", c, w_uk)
    v = torch.einsum("nd,hvd->nhv", c, w_uv).contiguous()
    k = torch.cat((k_nope, pe[:, None, :].expand(-1, k_nope.shape[1], -1)), dim=-1).contiguous()
    return k, v


def mla_prefill(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, w_kv_b: torch.Tensor, *, scale: float,
    cache_scales: Optional[torch.Tensor] = None, chunk_size: int = 8192,
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its whole latent context → o [T, H, v_dim].

    q_nope [T, H, nope] and q_pe [T, H, 64] (rotated like k_pe), packed by cu_seqlens_q [B + 1]; the new
    tokens must already be in latent_cache (write_latent_cache first) as the last tokens of each sequence,
    whose full length is seq_lens[b]. w_kv_b: the kv_b_proj weight [H · (nope + v_dim), 512] (W_UK rows
    first per head, then W_UV). latent_cache/cache_scales/block_tables as in mla_decode. float16/bfloat16
    (the attention kernel's dtypes); nope + 64 and v_dim must be attention head dims (DeepSeek: 192, 128).
    chunk_size: cached-prefix keys up-projected per step (workspace 2·chunk_size·H·192 values).
    """
    check_tensor("q_nope", q_nope, dtypes=(torch.float16, torch.bfloat16), ndim=3)
    n_q, heads, nope = q_nope.shape
    check_tensor("q_pe", q_pe, dtypes=(q_nope.dtype,), shape=(n_q, heads, ROPE_DIM))
    _check_cache(latent_cache, cache_scales)
    if latent_cache.dtype not in (q_nope.dtype, FP8_DTYPE):
        raise TypeError(f"latent_cache must have q's dtype ({q_nope.dtype}) or be float8_e4m3fn, got "
                        f"{latent_cache.dtype}")
    check_tensor("w_kv_b", w_kv_b, dtypes=(q_nope.dtype,), ndim=2)
    if w_kv_b.shape[1] != KV_LORA_RANK or w_kv_b.shape[0] % heads or w_kv_b.shape[0] // heads <= nope:
        raise ValueError(f"w_kv_b must be [heads · (nope + v_dim), {KV_LORA_RANK}] = [{heads} · ({nope} + v_dim), "
                         f"{KV_LORA_RANK}], got {tuple(w_kv_b.shape)}")
    v_dim = w_kv_b.shape[0] // heads - nope
    if nope + ROPE_DIM not in HEAD_DIMS or v_dim not in HEAD_DIMS:
        raise ValueError(f"q/k head dim nope + {ROPE_DIM} = {nope + ROPE_DIM} and v_dim = {v_dim} must be in "
                         f"{HEAD_DIMS} (the attention prefill kernel's)")
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, ndim=1)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q must have B + 1 ≥ 1 entries")
    check_tensor("block_tables", block_tables, dtypes=INDEX_DTYPES, ndim=2)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have one row per sequence ({batch}), got shape {tuple(block_tables.shape)}")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(batch,))
    check_same_device(q_nope=q_nope, q_pe=q_pe, latent_cache=latent_cache, cache_scales=cache_scales,
                      block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, w_kv_b=w_kv_b)
    check_unit_stride("q_nope", q_nope)
    check_unit_stride("q_pe", q_pe)
    _int_like("chunk_size", chunk_size, minimum=1)
    scale = float(scale)
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    # the host values this call needs (the lengths size the gathers and grids) and the page table for its check
    cu_q, lens, tables = cu_seqlens_q.cpu().long(), seq_lens.cpu().long(), block_tables.cpu()
    page, width = latent_cache.shape[1], block_tables.shape[1]
    q_lens = cu_q[1:] - cu_q[:-1]
    if q_lens.numel() and (q_lens < 0).any():
        raise ValueError(f"cu_seqlens_q must not decrease, got {cu_q.tolist()}")
    if int(cu_q[-1]) != n_q or int(cu_q[0]) != 0:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at {n_q} (the packed tokens), got {cu_q.tolist()}")
    if (lens < q_lens).any():
        raise ValueError(f"seq_lens must be ≥ each sequence's new tokens {q_lens.tolist()}: the cache must hold them "
                         f"(write_latent_cache first), got {lens.tolist()}")
    if batch and int(lens.max()) > width * page:
        raise ValueError(f"seq_lens must lie in [0, {width * page}] (block_tables holds {width} pages of {page} per "
                         f"sequence): the page table is too short, got seq_lens up to {int(lens.max())}")
    used = torch.arange(width)[None, :] < ((lens + page - 1) // page)[:, None]
    bad_pages = (((tables < 0) | (tables >= latent_cache.shape[0])) & used).any(1)
    if bad_pages.any():
        b = int(bad_pages.nonzero()[0])
        raise ValueError(f"block_tables[{b}] refers to pages outside [0, {latent_cache.shape[0]}): "
                         f"{tables[b, :-(-int(lens[b]) // page)].tolist()}")

    dev, dt = q_nope.device, q_nope.dtype
    w = w_kv_b.view(heads, nope + v_dim, KV_LORA_RANK)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q = torch.cat((q_nope, q_pe), dim=-1).contiguous()
    cu_q_dev = cu_seqlens_q.to(torch.int32)
    max_q = int(q_lens.max()) if batch else 0
    prefix = lens - q_lens

    seq, pos, cu_k = _ranges(prefix, lens, dev)  # the new tokens: causal among themselves
    k, v = _keys_values(_gather(latent_cache, cache_scales, block_tables, seq, pos, dt), w_uk, w_uv)
    o, lse = attention_prefill(q, k, v, causal=True, scale=scale, cu_seqlens_q=cu_q_dev, cu_seqlens_k=cu_k,
                               max_seqlen_q=max_q, return_lse=True)
    lse = lse.transpose(0, 1)  # [T, H]
    longest = int(prefix.max()) if batch else 0
    for start in range(0, longest, chunk_size):  # the cached prefix, chunk by chunk, all keys visible
        s = torch.full_like(prefix, start).minimum(prefix)
        seq, pos, cu_k = _ranges(s, (s + chunk_size).minimum(prefix), dev)
        k, v = _keys_values(_gather(latent_cache, cache_scales, block_tables, seq, pos, dt), w_uk, w_uv)
        o_c, lse_c = attention_prefill(q, k, v, causal=False, scale=scale, cu_seqlens_q=cu_q_dev, cu_seqlens_k=cu_k,
                                       max_seqlen_q=max_q, return_lse=True)
        o, lse = merge_attention_states(o, lse, o_c, lse_c.transpose(0, 1))
    return o
