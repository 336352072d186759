"""Attention, the definition in plain PyTorch (fp32 math, or float64 for float64 inputs).

For one sequence with queries q_i (i < Lq), keys k_j and values v_j (j < Lk), query head h reading
kv head h // (Hq / Hk) (GQA; MQA when Hk = 1):

    s_ij = scale · q_i·k_j                                  (scale defaults to 1/sqrt(D_qk))
    s_ij = softcap · tanh(s_ij / softcap)                   (logit softcap, when softcap > 0)
    p_i  = i + Lk − Lq                                      (query i's position: aligned to the end)
    allowed(i, j) = p_i − left ≤ j ≤ p_i + right            (left/right = −1: unbounded; causal: right = 0)
    lse_i = log Σ_{allowed j} exp(s_ij)                     (natural log; −inf when no key is allowed)
    o_i   = Σ_{allowed j} exp(s_ij − lse_i) · v_j           (0 when no key is allowed)

Paged KV caches hold token t of a sequence in page block_table[t // page_size], row t % page_size;
an FP8 cache stores x / scale per kv head, so reading gives x ≈ cache · scale.
Two attention states over disjoint key sets merge by their LSE:
    lse = log(e^lse_a + e^lse_b),   o = (e^(lse_a − lse) · o_a + e^(lse_b − lse) · o_b).
"""

import math

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _math_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def allowed_mask(q_len, k_len, causal, window, device=None):
    """[q_len, k_len] bool: which keys each query may attend (causal and window aligned to the end)."""
    left, right = window
    if causal:
        right = 0
    pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    j = torch.arange(k_len, device=device)[None, :]
    ok = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= pos - left
    if right >= 0:
        ok &= j <= pos + right
    return ok


def attention(q, k, v, *, causal=True, scale=None, window=(-1, -1), softcap=0.0):
    """One sequence: q [Lq, Hq, Dqk], k [Lk, Hk, Dqk], v [Lk, Hk, Dv] → o [Lq, Hq, Dv] (q.dtype), lse [Hq, Lq]."""
    dt = _math_dtype(q)
    lq, hq, dqk = q.shape
    lk, hk = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(dqk) if scale is None else scale
    group = hq // hk
    kf = k.to(dt).repeat_interleave(group, dim=1)  # [Lk, Hq, Dqk]
    vf = v.to(dt).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(dt), kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed_mask(lq, lk, causal, window, q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Lq]
    p = torch.exp(s - lse[..., None])
    p = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(p), p)
    o = torch.einsum("hqk,khd->qhd", p, vf)
    return o.to(q.dtype), lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """Packed batch: q [total_q, Hq, Dqk] … with offsets cu_seqlens [B+1] → o [total_q, Hq, Dv], lse [Hq, T_q]."""
    o = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_math_dtype(q), device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        o[cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]] = attention(
            q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], **kw
        )
    return o, lse


def attention_dense(q, k, v, **kw):
    """Dense batch: q [B, Sq, Hq, Dqk], k [B, Sk, Hk, Dqk], v [B, Sk, Hk, Dv] → o [B, Sq, Hq, Dv], lse [B, Hq, Sq]."""
    outs = [attention(q[b], k[b], v[b], **kw) for b in range(q.shape[0])]
    if not outs:
        return (q.new_zeros(*q.shape[:3], v.shape[3]),
                torch.zeros(0, q.shape[2], q.shape[1], dtype=_math_dtype(q), device=q.device))
    return torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs])


def gather_pages(cache, block_table, length, scale=None, dtype=torch.float32):
    """The first `length` tokens of one sequence from a paged cache [pages, page_size, H, D], dequantised."""
    page_size = cache.shape[1]
    pages = block_table[: -(-length // page_size)].long()
    x = cache[pages].reshape(-1, *cache.shape[2:])[:length].to(dtype)
    if scale is not None:
        x = x * scale.to(dtype).reshape(-1)[None, :, None]  # per kv head (or one scalar)
    return x


def attention_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, window=(-1, -1), softcap=0.0,
                     k_scale=None, v_scale=None):
    """Paged decode: q [B, Q, Hq, D] are the last Q tokens of each sequence (causal among them).

    Sequence b holds seq_lens[b] tokens (the Q new ones included) in pages block_tables[b]. Returns
    o [B, Q, Hq, Dv] in q.dtype and lse [B, Q, Hq].
    """
    dt = _math_dtype(q)
    b_, nq, hq, _ = q.shape
    o = q.new_zeros(b_, nq, hq, v_cache.shape[3])
    lse = torch.full((b_, nq, hq), float("-inf"), dtype=dt, device=q.device)
    for b, length in enumerate(seq_lens.tolist()):
        k = gather_pages(k_cache, block_tables[b], length, k_scale, dt)
        v = gather_pages(v_cache, block_tables[b], length, v_scale, dt)
        ob, lb = attention(q[b].to(dt), k, v, causal=True, scale=scale, window=window, softcap=softcap)
        o[b], lse[b] = ob.to(q.dtype), lb.transpose(0, 1)
    return o, lse


def attention_prefill_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, causal=True, scale=None,
                            window=(-1, -1), softcap=0.0, k_scale=None, v_scale=None):
    """Paged (append) prefill: sequence b's queries q[cu[b]:cu[b+1]] are its last tokens; its keys are the
    first seq_lens[b] tokens of its pages. → o [total_q, Hq, Dv] in q.dtype, lse [Hq, total_q]."""
    dt = _math_dtype(q)
    o = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[3])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dt, device=q.device)
    cq = cu_seqlens_q.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        k = gather_pages(k_cache, block_tables[b], length, k_scale, dt)
        v = gather_pages(v_cache, block_tables[b], length, v_scale, dt)
        ob, lb = attention(q[cq[b]:cq[b + 1]].to(dt), k, v, causal=causal, scale=scale, window=window,
                           softcap=softcap)
        o[cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]] = ob.to(q.dtype), lb
    return o, lse


def quantize_fp8(x, scale):
    """x [..., H, D] → float8_e4m3fn of x / scale (per head), saturated to ±448."""
    s = scale.float().reshape(-1)[:, None]
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """In place: token t goes to page slot // page_size, row slot % page_size; slot −1 is skipped."""
    page_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    page, row = slots[keep] // page_size, slots[keep] % page_size
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = x[keep]
        cache[page, row] = quantize_fp8(x, scale) if scale is not None else x.to(cache.dtype)


def merge_states(o_a, lse_a, o_b, lse_b):
    """o [..., D], lse [...] (natural log) over disjoint key sets → the state over their union (o in o_a.dtype)."""
    dt = _math_dtype(o_a)
    la, lb = lse_a.to(dt), lse_b.to(dt)
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    total = wa + wb
    o = (wa[..., None] * o_a.to(dt) + wb[..., None] * o_b.to(dt)) / torch.where(total == 0, 1, total)[..., None]
    return o.to(o_a.dtype), m_safe + torch.log(total)  # log(0) = −inf for two empty states
