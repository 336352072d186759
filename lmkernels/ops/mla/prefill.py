"""MLA prefill (chunked): new tokens attend to their cached context and to themselves through the attention
family's prefill kernel (q/k dim nope + 64, v dim v_head_dim), after up-projecting the latents:
    k_nope = c_kv · W_UKᵀ,  v = c_kv · W_UVᵀ,  k = [k_nope | k_pe] (k_pe shared by all heads).
The cached prefix is cut in chunks of chunk_size tokens (to bound the up-projected workspace); the new tokens and
their prefix's last chunk form one causal pass, the earlier chunks (all keys visible) one pass each, and
merge_attention_states combines their partial (o, lse) (a prefix within one chunk: one pass, nothing to merge).
On Hopper the attention reads q = [q_nope | q_pe] and k = [k_nope | k_pe] where the parts lie (no concatenated
copies).
Which cache rows each pass gathers depends on the lengths, so it is worked out on the host: mla_prefill_plan reads the
lengths and the page table once (one host sync), checks them, and sends the passes' cache rows over in one transfer;
a model's layers share that plan within a step, so that their mla_prefill calls only enqueue kernels. Decode never
syncs.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..._utils import INDEX_DTYPES, check_block_tables, check_same_device, check_tensor, check_unit_stride
from ..attention import attention_prefill, merge_attention_states
from .api import FP8_DTYPE, _check_cache, _int_like
from .reference import KV_LORA_RANK, ROPE_DIM, dequantize_rows

HEAD_DIMS = (64, 96, 128, 192, 256)  # the attention prefill kernel's head dims


@dataclass(frozen=True)
class MLAPrefillPlan:
    """The gathers of one prefill step (mla_prefill_plan), shared by the step's mla_prefill calls.
    made_for: (batch, packed new tokens, page size, pages, chunk_size); max_q: the longest new-token run;
    cu_q: cu_seqlens_q as int32 on the device; passes: per attention pass (the new tokens, causal, then each chunk of
    the cached prefix) the cache rows to gather (page · page_size + offset, int64) and the keys' cu_seqlens (int32),
    both on the device."""
    made_for: tuple
    max_q: int
    cu_q: torch.Tensor
    passes: tuple


def _ranges(starts, ends):
    """Packed (sequence index, position) of the key ranges [starts[b], ends[b]) and their cu_seqlens (numpy: on
    arrays of a prompt's length its ops cost a fraction of torch's per-op overhead on the host)."""
    lens = np.maximum(ends - starts, 0)
    cu = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    seq = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(cu[-1]) + (starts - cu[:-1])[seq]
    return seq, pos, cu


def _check_step(latent_cache, block_tables, cu_seqlens_q, seq_lens):
    """Argument checks mla_prefill_plan and mla_prefill share; returns the batch size."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, ndim=1)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q must have B + 1 ≥ 1 entries")
    check_tensor("block_tables", block_tables, dtypes=INDEX_DTYPES, ndim=2)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have one row per sequence ({batch}), got shape {tuple(block_tables.shape)}")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(batch,))
    check_tensor("latent_cache", latent_cache, ndim=3)
    if latent_cache.shape[1] == 0:
        raise ValueError("latent_cache must have a page size ≥ 1")
    return batch


def mla_prefill_plan(latent_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seq_lens: torch.Tensor, *, chunk_size: int = 8192) -> MLAPrefillPlan:
    """The gathers of one prefill step for mla_prefill(..., plan=): the lengths and the page table are read on the
    host once (one sync) and checked, the passes' cache rows made there and sent over in one transfer. The arguments
    are those of the mla_prefill calls it serves; make it again whenever lengths, pages or chunk_size change."""
    batch = _check_step(latent_cache, block_tables, cu_seqlens_q, seq_lens)
    check_same_device(latent_cache=latent_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
                      seq_lens=seq_lens)
    _int_like("chunk_size", chunk_size, minimum=1)
    cu_q, lens = cu_seqlens_q.cpu().numpy().astype(np.int64), seq_lens.cpu().numpy().astype(np.int64)
    tables_cpu = block_tables.cpu()
    tables = tables_cpu.numpy()
    num_pages, page = latent_cache.shape[:2]
    n_q = int(cu_q[-1]) if batch else 0
    q_lens = cu_q[1:] - cu_q[:-1]
    if (q_lens < 0).any():
        raise ValueError(f"cu_seqlens_q must not decrease, got {cu_q.tolist()}")
    if int(cu_q[0]) != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {cu_q.tolist()}")
    if (lens < q_lens).any():
        raise ValueError(f"seq_lens must be ≥ each sequence's new tokens {q_lens.tolist()}: the cache must hold them "
                         f"(write_latent_cache first), got {lens.tolist()}")
    check_block_tables(tables_cpu, torch.from_numpy(lens), page, num_pages)
    # the new tokens with their prefix's last chunk (0 without a prefix): one causal pass, the diagonal aligned to
    # each context's end; then the earlier prefix chunks, all keys visible
    last = np.maximum((lens - q_lens - 1) // chunk_size, 0) * chunk_size
    bounds = [(last, lens)]
    for start in range(0, int(last.max()) if batch else 0, chunk_size):
        s = np.minimum(last, start)
        bounds.append((s, np.minimum(s + chunk_size, last)))
    rows, cus = [], []
    for starts, ends in bounds:
        seq, pos, cu = _ranges(starts, ends)
        rows.append(tables[seq, pos // page].astype(np.int64) * page + pos % page)
        cus.append(cu)
    packed = torch.from_numpy(np.concatenate(rows + cus + [cu_q])).to(latent_cache.device)
    n_rows = sum(r.size for r in rows)
    cu_dev = packed[n_rows:].to(torch.int32).split([c.size for c in cus] + [batch + 1])
    return MLAPrefillPlan((batch, n_q, page, num_pages, chunk_size), int(q_lens.max()) if batch else 0, cu_dev[-1],
                          tuple(zip(packed[:n_rows].split([r.size for r in rows]), cu_dev[:-1])))


def _keys_values(latents, w_kv_b, heads, nope):
    """Up-projection: latent rows [N, 576] → k_nope [N, H, nope], k_pe [N, H, 64] (the rows' own, broadcast over
    the heads: head stride 0), v [N, H, v_dim]: one GEMM against w_kv_b as it lies ([k_nope | v] per head, views of
    its output; einsums over W_UK and W_UV copied their strided slices first)."""
    c, pe = latents[:, :KV_LORA_RANK], latents[:, KV_LORA_RANK:]
    kv = (c @ w_kv_b.T).view(c.shape[0], heads, -1)
    return kv[..., :nope], pe[:, None, :].expand(-1, heads, -1), kv[..., nope:]


def _attention(q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, max_q, scale, causal):
    """One pass's (o, lse [H, T]). On Hopper the Gluon prefill reads q_nope | q_pe and k_nope | k_pe where they lie
    (kernels.prefill_split_qk); else q and k are concatenated for attention_prefill."""
    if q_nope.is_cuda:
        from ..attention import kernels  # (late: TRITON_INTERPRET may still be set by the caller)

        out = kernels.prefill_split_qk(q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, max_q, scale, causal)
        if out is not None:
            return out
    q = torch.cat((q_nope, q_pe), dim=-1)
    k = torch.cat((k_nope, k_pe), dim=-1)
    return attention_prefill(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=max_q, return_lse=True)


def mla_prefill(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, w_kv_b: torch.Tensor, *, scale: float,
    cache_scales: Optional[torch.Tensor] = None, chunk_size: int = 8192, plan: Optional[MLAPrefillPlan] = None,
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its whole latent context → o [T, H, v_dim].

    q_nope [T, H, nope] and q_pe [T, H, 64] (rotated like k_pe), packed by cu_seqlens_q [B + 1]; the new
    tokens must already be in latent_cache (write_latent_cache first) as the last tokens of each sequence,
    whose full length is seq_lens[b]. w_kv_b: the kv_b_proj weight [H · (nope + v_dim), 512] (W_UK rows
    first per head, then W_UV). latent_cache/cache_scales/block_tables as in mla_decode. float16/bfloat16
    (the attention kernel's dtypes); nope + 64 and v_dim must be attention head dims (DeepSeek: 192, 128).
    chunk_size: cached-prefix keys up-projected per pass (workspace (chunk_size + T)·H·(nope + v_dim) values: the last
    chunk shares its pass with the new tokens).
    plan: the step's mla_prefill_plan for these lengths, page table and chunk_size, shared by the layers (no host
    sync in this call); None makes one here (one host sync).
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
    batch = _check_step(latent_cache, block_tables, cu_seqlens_q, seq_lens)
    check_same_device(q_nope=q_nope, q_pe=q_pe, latent_cache=latent_cache, cache_scales=cache_scales,
                      block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, w_kv_b=w_kv_b)
    check_unit_stride("q_nope", q_nope)
    check_unit_stride("q_pe", q_pe)
    _int_like("chunk_size", chunk_size, minimum=1)
    scale = float(scale)
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    if plan is None:
        plan = mla_prefill_plan(latent_cache, block_tables, cu_seqlens_q, seq_lens, chunk_size=chunk_size)
    elif not isinstance(plan, MLAPrefillPlan):
        raise TypeError(f"plan must come from mla_prefill_plan, got {type(plan).__name__}")
    if plan.made_for[1] != n_q:
        raise ValueError(f"cu_seqlens_q must end at {n_q} (the packed tokens of q_nope); the plan was made for "
                         f"cu_seqlens_q ending at {plan.made_for[1]}")
    made_for = (batch, n_q, latent_cache.shape[1], latent_cache.shape[0], chunk_size)
    if plan.made_for != made_for:
        raise ValueError(f"plan was made for (batch, new tokens, page size, pages, chunk_size) = {plan.made_for}, "
                         f"this call has {made_for}: make it with this step's arguments")
    check_same_device(q_nope=q_nope, plan=plan.cu_q)

    dt = q_nope.dtype
    latents = latent_cache.view(-1, latent_cache.shape[-1])
    scales = None if cache_scales is None else cache_scales.view(-1, cache_scales.shape[-1])
    o = lse = None
    for i, (rows, cu_k) in enumerate(plan.passes):  # the new tokens with the last prefix chunk (causal), then the
        # earlier prefix chunks
        gathered = latents[rows] if scales is None else dequantize_rows(latents[rows], scales[rows])
        o_i, lse_i = _attention(q_nope, q_pe, *_keys_values(gathered.to(dt), w_kv_b, heads, nope), plan.cu_q, cu_k,
                                plan.max_q, scale, i == 0)
        lse_i = lse_i.transpose(0, 1)  # [T, H]
        o, lse = (o_i, lse_i) if i == 0 else merge_attention_states(o, lse, o_i, lse_i)
    return o
