"""MLA (Multi-head Latent Attention, DeepSeek-V2/V3), the definition in plain PyTorch (float64 math where it
matters; tests compare the kernels with these in float64).

Latent cache. One row of 576 values per token, shared by all heads:
    row = [c_kv (kv_lora_rank = 512) | k_pe (rope dim = 64)]
    c_kv = RMSNorm(kv[:512]) · w = kv[:512] / sqrt(mean(kv[:512]²) + eps) · w
    k_pe = RoPE(kv[512:], position)   interleaved pairs (x[2j], x[2j+1]) rotated by p·θ_j (GPT-J / DeepSeek
                                      style), written back interleaved; cos_sin_cache[p] = [cos | sin] (R/2 each)
where kv = x · W_kv_a is the wkv_a (kv_a_proj_with_mqa) output [tokens, 576]. Pages: [num_pages, page_size,
576]; token t of a sequence lives in page block_table[t // page_size], row t % page_size (slot = page ·
page_size + row). FP8 cache: float8_e4m3fn values plus float32 scales [num_pages, page_size, 5], one per
group of 128 values (groups 0–3: c_kv; group 4: the 64 values of k_pe): scale_g = max|x_g| / 448 (1 for an
all-zero group), value = round_to_nearest(x / scale_g), dequantised as value · scale_g.

Decode with weight absorption (W_UK, W_UV: wkv_b viewed as [H, nope + v, 512]):
    q_lat[h] = q_nope[h] · W_UK[h]                                            (512 per head, the caller's job)
    s[h, t]  = scale · ([q_lat[h] | q_pe[h]] · row_t)                          key dim 576
    o_lat[h] = Σ_t softmax_t(s[h, ·]) · c_kv_t                                 value dim 512
i.e. multi-query attention with one KV head. Query token i of Q new tokens sits at position
seq_len − Q + i and sees keys 0 … that position (causal among the new tokens, MTP / speculative decoding).
lse[h] = ln Σ_t e^{s[h, t]} (−inf and o = 0 for a query with no visible key).
"""

import torch

KV_LORA_RANK = 512
ROPE_DIM = 64
LATENT_DIM = KV_LORA_RANK + ROPE_DIM  # 576
SCALE_GROUP = 128
N_SCALES = -(-LATENT_DIM // SCALE_GROUP)  # 5
FP8_MAX = 448.0


def rms_norm(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rope_interleaved(x, cos_sin_cache, positions):
    """x [T, R]: pairs (x[2j], x[2j+1]) rotated by the angles of cache row positions[t]; float64 out."""
    r = x.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].double()[:, : r].chunk(2, dim=-1)
    x = x.double()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def latent_rows(kv, weight, cos_sin_cache, positions, eps):
    """The cache rows [T, 576] in float64 for the wkv_a output kv [T, 576]."""
    c = rms_norm(kv[:, :KV_LORA_RANK], weight, eps)
    pe = rope_interleaved(kv[:, KV_LORA_RANK:], cos_sin_cache, positions)
    return torch.cat((c, pe), dim=-1)


def quantize_rows(rows):
    """rows [..., 576] float → (e4m3 values [..., 576], float32 scales [..., 5]) with a scale per 128 values."""
    x = rows.float()
    groups = torch.split(x, SCALE_GROUP, dim=-1)
    scales = torch.stack([g.abs().amax(-1) for g in groups], dim=-1) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    full = torch.cat([scales[..., i:i + 1].expand_as(g) for i, g in enumerate(groups)], dim=-1)
    q = (x / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_rows(values, scales):
    """e4m3 values [..., 576] and scales [..., 5] → float32 rows."""
    x = values.float()
    full = scales.float().repeat_interleave(SCALE_GROUP, dim=-1)[..., : x.shape[-1]]
    return x * full


def write_latent_cache(kv, weight, cos_sin_cache, positions, slot_mapping, cache, cache_scales=None, eps=1e-6):
    """In place: cache rows of slot_mapping[t] (−1: skipped) ← latent_rows(kv)[t] (quantised for FP8)."""
    rows = latent_rows(kv, weight, cos_sin_cache, positions, eps)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = rows[keep]
    flat = cache.view(-1, cache.shape[-1])
    if cache_scales is None:
        flat[slots] = rows.to(cache.dtype)
    else:
        values, scales = quantize_rows(rows)
        flat[slots] = values
        cache_scales.view(-1, cache_scales.shape[-1])[slots] = scales


def gather_latents(cache, block_tables, seq_lens, cache_scales=None, dtype=torch.float64):
    """The cached rows of every sequence: a list of [seq_len_b, 576] tensors (dequantised for FP8)."""
    page = cache.shape[1]
    out = []
    for b, n in enumerate(seq_lens.tolist()):
        t = torch.arange(n, device=cache.device)
        pages = block_tables[b, t // page].long()
        rows = cache[pages, t % page]
        if cache_scales is not None:
            rows = dequantize_rows(rows, cache_scales[pages, t % page])
        out.append(rows.to(dtype))
    return out


def mla_decode(q_nope_absorbed, q_pe, cache, block_tables, seq_lens, scale, cache_scales=None):
    """(o [B, Q, H, 512] float64, lse [B, Q, H] float64) of absorbed MQA over the latent cache."""
    batch, n_new, heads, _ = q_nope_absorbed.shape
    q = torch.cat((q_nope_absorbed.double(), q_pe.double()), dim=-1)  # [B, Q, H, 576]
    o = torch.zeros(batch, n_new, heads, KV_LORA_RANK, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, n_new, heads), float("-inf"), dtype=torch.float64, device=q.device)
    for b, rows in enumerate(gather_latents(cache, block_tables, seq_lens, cache_scales)):
        n = rows.shape[0]
        if n == 0:
            continue
        s = torch.einsum("qhd,td->qht", q[b], rows) * scale
        pos = n - n_new + torch.arange(n_new, device=q.device)
        visible = torch.arange(n, device=q.device)[None, :] <= pos[:, None]  # [Q, T]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        lse_b = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse_b), 0.0, lse_b)[..., None])
        o[b] = torch.einsum("qht,td->qhd", p, rows[:, :KV_LORA_RANK])
        lse[b] = lse_b
    return o, lse


def mla_attention(q_nope, q_pe, rows, w_kv_b, n_past, scale, nope_dim, v_dim):
    """Plain (non-absorbed) MLA for one sequence: q_nope [T, H, nope], q_pe [T, H, 64] for the last T of its
    n_past + T tokens, rows [n_past + T, 576] its latent rows, w_kv_b [H·(nope + v), 512]. Keys
    k = [c_kv W_UKᵀ | k_pe], values v = c_kv W_UVᵀ; causal with queries aligned to the end.
    Returns (o [T, H, v] float64, lse [T, H] float64)."""
    heads = q_nope.shape[1]
    w = w_kv_b.double().view(heads, nope_dim + v_dim, KV_LORA_RANK)
    c, pe = rows[:, :KV_LORA_RANK].double(), rows[:, KV_LORA_RANK:].double()
    k_nope = torch.einsum("td,hnd->thn", c, w[:, :nope_dim])
    v = torch.einsum("td,hvd->thv", c, w[:, nope_dim:])
    s = (torch.einsum("qhn,thn->qht", q_nope.double(), k_nope) + torch.einsum("qhr,tr->qht", q_pe.double(), pe)) * scale
    t_q, t_k = q_nope.shape[0], rows.shape[0]
    pos = n_past + torch.arange(t_q, device=rows.device)
    visible = torch.arange(t_k, device=rows.device)[None, :] <= pos[:, None]
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("qht,thv->qhv", torch.softmax(s, dim=-1), v), lse
