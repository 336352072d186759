"""KDA (Kimi Delta Attention), the definition in plain PyTorch (float64 for float64 inputs, else float32).

Per head, state S ∈ R^{K×V}; for each token t of a sequence (q_t, k_t ∈ R^K, v_t ∈ R^V, log-decay g_t ∈ R^K
per key channel, β_t ∈ R):

    q_t ← q_t / sqrt(|q_t|² + 1e-6),  k_t ← k_t / sqrt(|k_t|² + 1e-6)     (when l2norm_qk)
    β_t ← sigmoid(b_t)                                                   (when beta_sigmoid)
    g_t ← −exp(A_log[h]) · softplus(f_t + dt_bias[h])                    (fused gate, lower_bound None)
    g_t ← lower_bound · sigmoid(exp(A_log[h]) · (f_t + dt_bias[h]))      (fused safe gate)
    S   ← Diag(exp(g_t)) S
    S   ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ
    o_t = Sᵀ (scale · q_t)                                               (scale defaults to K^−1/2)

Chunkwise form (chunks of C tokens, S₀ the state before the chunk, Γ_i = Σ_{s≤i} g_s inside the chunk):

    A[i, j]  = β_i Σ_d k_id k_jd exp(Γ_id − Γ_jd)            (j < i, else 0)
    T        = (I + A)⁻¹
    W        = T diag(β) (K ⊙ exp Γ),   U = T diag(β) V
    Ũ        = U − W S₀                                      (the new values, "v_new")
    Aqk[i,j] = Σ_d q_id k_jd exp(Γ_id − Γ_jd)                 (j ≤ i, q scaled)
    O        = (Q ⊙ exp Γ) S₀ + Aqk Ũ
    S_C      = Diag(exp Γ_C) S₀ + (K ⊙ exp(Γ_C − Γ))ᵀ Ũ

Semantics checked against transformers' kimi_linear (recurrent_kimi_delta_attention, KimiLinearForgetGate,
l2norm with + eps inside the sqrt) and fla's fused gate forms.
"""

import torch
import torch.nn.functional as F


def _dt(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x, eps=1e-6):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(f, A_log, dt_bias=None, lower_bound=None):
    """Log-space decay from the raw gate projection f [..., H, K]; A_log [H]; dt_bias [H*K] or [H, K]."""
    H, K = f.shape[-2:]
    x = f.to(_dt(f))
    if dt_bias is not None:
        x = x + dt_bias.to(x.dtype).reshape(H, K)
    a = A_log.to(x.dtype).reshape(H, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def prepare(q, k, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, l2norm_qk=False, beta_sigmoid=False):
    """The fused pre-processing (L2 norm of q/k, gate, β sigmoid) in the math dtype."""
    dt = _dt(q)
    q, k, g, beta = q.to(dt), k.to(dt), g.to(dt), beta.to(dt)
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    if A_log is not None:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if beta_sigmoid:
        beta = torch.sigmoid(beta)
    return q, k, g, beta


def recurrent(q, k, v, g, beta, scale, S):
    """One sequence, already prepared: q, k, g [T, H, K], v [T, H, V], beta [T, H], S [H, K, V] → o [T, H, V], S."""
    S = S.clone()
    o = v.new_zeros(v.shape)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        kv = torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - kv))
        o[t] = torch.einsum("hk,hkv->hv", q[t] * scale, S)
    return o, S


def chunked(q, k, v, g, beta, scale, S, chunk=64):
    """The chunkwise-parallel form of `recurrent` (same arguments), one exponent exp(Γ_i − Γ_j) per pair."""
    T, H, K = q.shape
    o = v.new_zeros(v.shape)
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(c0 + chunk, T))
        qc, kc, vc, bc = q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), beta[sl].t()
        G = g[sl].transpose(0, 1).cumsum(1)  # [H, C, K]
        n = qc.shape[1]
        E = (G[:, :, None, :] - G[:, None, :, :]).clamp(max=0).exp()  # [H, i, j, K]; i ≥ j never positive
        A = torch.einsum("hid,hjd,hijd->hij", kc, kc, E) * bc[:, :, None]
        A = A * torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device), -1)
        Tm = torch.linalg.solve_triangular(torch.eye(n, dtype=q.dtype, device=q.device) + A,
                                           torch.eye(n, dtype=q.dtype, device=q.device).expand(H, n, n), upper=False)
        W = Tm @ (bc[..., None] * kc * G.exp())
        U = Tm @ (bc[..., None] * vc)
        Un = U - W @ S
        Aqk = torch.einsum("hid,hjd,hijd->hij", qc * scale, kc, E)
        Aqk = Aqk * torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
        o[sl] = ((qc * scale * G.exp()) @ S + Aqk @ Un).transpose(0, 1)
        GC = G[:, -1:, :]  # [H, 1, K]
        S = GC.transpose(1, 2).exp() * S + (kc * (GC - G).exp()).transpose(1, 2) @ Un
    return o, S


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, A_log=None, dt_bias=None,
        lower_bound=None, l2norm_qk=False, beta_sigmoid=False, chunk=None):
    """KDA over [B, T, H, *] inputs (or packed B = 1 with cu_seqlens) → (o like v in v.dtype, final states
    [N, H, K, V] in the math dtype). chunk=None runs the recurrence, else the chunked form."""
    dt = _dt(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, g, beta = prepare(q, k, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                            l2norm_qk=l2norm_qk, beta_sigmoid=beta_sigmoid)
    vf = v.to(dt)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        seqs = [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    else:
        seqs = [(b, 0, T) for b in range(B)]
    o = vf.new_zeros(vf.shape)
    finals = []
    for n, (b, s, e) in enumerate(seqs):
        S = (initial_state[n].to(dt) if initial_state is not None else vf.new_zeros(H, K, V))
        args = (q[b, s:e], k[b, s:e], vf[b, s:e], g[b, s:e], beta[b, s:e], scale, S)
        ob, S = recurrent(*args) if chunk is None else chunked(*args, chunk=chunk)
        o[b, s:e] = ob
        finals.append(S)
    return o.to(v.dtype), torch.stack(finals) if finals else vf.new_zeros(0, H, K, V)


def kda_decode(q, k, v, g, beta, state_pool, state_indices, *, scale=None, A_log=None, dt_bias=None,
               lower_bound=None, l2norm_qk=False, beta_sigmoid=False):
    """q/k/g [N, Q, H, K], v [N, Q, H, V], beta [N, Q, H]; updates state_pool[state_indices[n]] in place
    (index < 0: skipped, output 0) and returns o [N, Q, H, V] in v.dtype."""
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for n, idx in enumerate(state_indices.tolist()):
        if idx < 0:
            continue
        S0 = state_pool[idx:idx + 1].to(_dt(q))
        on, S = kda(q[n:n + 1], k[n:n + 1], v[n:n + 1], g[n:n + 1], beta[n:n + 1], scale=scale, initial_state=S0,
                    A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, l2norm_qk=l2norm_qk,
                    beta_sigmoid=beta_sigmoid)
        o[n] = on[0]
        state_pool[idx] = S[0].to(state_pool.dtype)
    return o
