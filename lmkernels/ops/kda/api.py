"""KDA (Kimi Delta Attention): chunked prefill and recurrent decode; the math is in reference.py.

Layouts: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; packed varlen: B = 1 with cu_seqlens [N + 1].
States: float32 [*, H, K, V] (the state is Sᵀ-free: S[k, v], o = Sᵀ q). A state pool [P, H, K, V] holds one state
per slot; state_indices [N] (int32/int64) names each sequence's slot.
Gate: when A_log [H] is given, g is the raw projection f and the kernel computes
−exp(A_log)·softplus(f + dt_bias) (lower_bound None) or lower_bound·sigmoid(exp(A_log)·(f + dt_bias));
dt_bias [H·K] or [H, K] is optional. Otherwise g is the log-space decay itself (g ≤ 0).
CUDA tensors run the Triton kernels; CPU tensors the reference unless TRITON_INTERPRET=1.
"""

import math
from typing import Optional

import torch

from ..._utils import INDEX_DTYPES, check_same_device, check_tensor, check_unit_stride, use_triton
from . import reference

__all__ = ["kda_prefill", "kda_decode", "HEAD_DIMS"]

HEAD_DIMS = (64, 128)
IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_scalars(scale, lower_bound):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                    or not (-1e4 < lower_bound < 0)):
        raise ValueError(f"lower_bound must be a negative number (e.g. -5.0) or None, got {lower_bound!r}")


def _check_common(q, k, v, g, beta, A_log, dt_bias, lower_bound, lead):
    """q/k/g [*lead, H, K], v [*lead, H, V], beta [*lead, H]."""
    nd = len(lead) + 2
    check_tensor("q", q, dtypes=IN_DTYPES, ndim=nd)
    check_tensor("k", k, dtypes=(q.dtype,), ndim=nd)
    check_tensor("v", v, dtypes=(q.dtype,), ndim=nd)
    H, K = q.shape[-2], q.shape[-1]
    if K not in HEAD_DIMS:
        raise ValueError(f"head dim K of q and k must be one of {HEAD_DIMS}, got {K}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape {tuple(q.shape)} (heads and head dim included), got {tuple(k.shape)}")
    if tuple(v.shape[:-1]) != tuple(q.shape[:-1]):
        raise ValueError(f"v must be [{', '.join(map(str, q.shape[:-1]))}, V] (q's heads), got {tuple(v.shape)}")
    if v.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim V of v must be one of {HEAD_DIMS}, got {v.shape[-1]}")
    check_tensor("g", g, dtypes=(torch.float32, q.dtype), shape=q.shape)
    check_tensor("beta", beta, dtypes=(torch.float32, q.dtype), shape=q.shape[:-1])
    if A_log is not None:
        check_tensor("A_log", A_log, dtypes=(torch.float32, q.dtype))
        if A_log.numel() != H:
            raise ValueError(f"A_log must hold one value per head ({H}), got shape {tuple(A_log.shape)}")
    if dt_bias is not None:
        if A_log is None:
            raise ValueError("dt_bias needs A_log (the fused gate); without A_log g is the log decay itself")
        check_tensor("dt_bias", dt_bias, dtypes=(torch.float32, q.dtype))
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must hold H·K = {H * K} values ([H·K] or [H, K]), got {tuple(dt_bias.shape)}")
    if lower_bound is not None and A_log is None:
        raise ValueError("lower_bound selects the fused safe gate and needs A_log")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        check_unit_stride(name, t)


def _flat_param(x):
    return None if x is None else x.reshape(-1).contiguous()


# ---------------------------------------------------------------------------------------------------
# prefill


def _prefill_run(q, k, v, g, beta, cu, cu_host, scale, A_log, dt_bias, lower_bound, l2, bsig, h0, h0_idx, ht, ht_idx):
    if not use_triton(q):
        o, S = reference.kda(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                             cu_seqlens=cu_host if cu_host is not None else cu,
                             initial_state=h0[h0_idx.long()] if h0 is not None else None, A_log=A_log,
                             dt_bias=dt_bias, lower_bound=lower_bound, l2norm_qk=l2, beta_sigmoid=bsig)
        if ht is not None:
            ht[ht_idx.long()] = S.to(ht.dtype)
        return o[0]
    from . import kernels

    return kernels.prefill(q, k, v, g, beta, cu, scale, A_log, dt_bias, lower_bound, l2, bsig, h0, h0_idx, ht,
                           ht_idx, cu_host)


@torch.library.custom_op("lmkernels::kda_prefill", mutates_args=("ht",))
def _prefill_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu: torch.Tensor,
    cu_host: Optional[torch.Tensor], scale: float, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float],
    l2: bool, bsig: bool, h0: Optional[torch.Tensor], h0_idx: Optional[torch.Tensor], ht: Optional[torch.Tensor],
    ht_idx: Optional[torch.Tensor],
) -> torch.Tensor:
    return _prefill_run(q, k, v, g, beta, cu, cu_host, scale, A_log, dt_bias, lower_bound, l2, bsig, h0, h0_idx, ht,
                        ht_idx)


@_prefill_op.register_fake
def _(q, k, v, g, beta, cu, cu_host, scale, A_log, dt_bias, lower_bound, l2, bsig, h0, h0_idx, ht, ht_idx):
    return v.new_empty(v.shape)


def _check_indices(name, idx, n, pool_name, pool, allow_negative):
    check_tensor(name, idx, dtypes=INDEX_DTYPES, shape=(n,))
    if idx.device.type == "cpu" and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if hi >= pool.shape[0] or lo < (-1 if allow_negative else 0):
            rng = f"[{-1 if allow_negative else 0}, {pool.shape[0]})"
            raise ValueError(f"{name} must lie in {rng} ({pool_name} has {pool.shape[0]} slots), got values in "
                             f"[{lo}, {hi}]")


def _check_pool(name, pool, H, K, V, device):
    check_tensor(name, pool, dtypes=(torch.float32,), ndim=4)
    if tuple(pool.shape[1:]) != (H, K, V):
        raise ValueError(f"{name} must be float32 [slots, {H}, {K}, {V}], got {tuple(pool.shape)}")
    if not pool[0:1].is_contiguous() or (pool.shape[0] and pool.stride(1) != K * V):
        raise ValueError(f"{name} must be contiguous within each slot, got strides {pool.stride()}")
    if pool.device != device:
        raise ValueError(f"{name} is on {pool.device} but q is on {device}; they must share a device")


def kda_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    state_pool: Optional[torch.Tensor] = None, state_indices: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_cpu: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None, lower_bound: Optional[float] = None, l2norm_qk: bool = False,
    beta_sigmoid: bool = False,
):
    """KDA over whole sequences (chunks of 16 or 32 tokens); returns (o, final_state).

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; K, V ∈ {64, 128}; fp16/bf16 (fp32 accepted);
    g and beta may be fp32. Packed varlen: B = 1 and cu_seqlens [N + 1] (int32/int64, start 0, non-decreasing,
    end T). o is [B, T, H, V] in v's dtype.
    States (fp32 [N, H, K, V], N = B or the number of packed sequences): initial_state starts each sequence
    from a given state; output_final_state returns the final states (else final_state is None).
    Or a state pool: state_pool fp32 [P, H, K, V] with state_indices [N]: each sequence starts from
    state_pool[state_indices[n]] and its final state is written back there in place (final_state is None);
    zero a slot first for a fresh sequence.
    l2norm_qk: q, k ← x / sqrt(|x|² + 1e-6) in the kernel; beta_sigmoid: β = sigmoid(beta) in the kernel;
    A_log/dt_bias/lower_bound: the fused gate (module docstring). scale defaults to K^−1/2.
    With cu_seqlens on CUDA the launch reads the offsets on the host (one sync) unless cu_seqlens_cpu holds the
    same offsets on the CPU (then a call can be captured in a CUDA graph after one warm-up call).
    """
    _check_scalars(scale, lower_bound)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        check_tensor("q", q, ndim=4)
    B, T, H, K = q.shape
    _check_common(q, k, v, g, beta, A_log, dt_bias, lower_bound, (B, T))
    V = v.shape[-1]
    dev = q.device
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
        if B != 1:
            raise ValueError(f"packed varlen input (cu_seqlens) needs batch size 1, got q of shape {tuple(q.shape)}")
        if cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens must have N + 1 ≥ 1 entries")
        if cu_seqlens.device.type == "cpu":
            c = cu_seqlens.tolist()
            if c[0] != 0 or c[-1] != T or any(b < a for a, b in zip(c, c[1:])):
                raise ValueError(f"cu_seqlens must start at 0, never decrease and end at {T} (the tokens), got {c}")
        n_seqs = cu_seqlens.shape[0] - 1
        cu = cu_seqlens
        cu_host = None
        if cu_seqlens_cpu is not None:
            check_tensor("cu_seqlens_cpu", cu_seqlens_cpu, dtypes=INDEX_DTYPES, shape=cu_seqlens.shape)
            if cu_seqlens_cpu.device.type != "cpu":
                raise ValueError(f"cu_seqlens_cpu must be a CPU tensor, got one on {cu_seqlens_cpu.device}")
            cu_host = cu_seqlens_cpu
            if cu_seqlens.device.type == "cpu" and not torch.equal(cu_seqlens.long(), cu_seqlens_cpu.long()):
                raise ValueError("cu_seqlens_cpu must hold the offsets of cu_seqlens")
    else:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu goes with cu_seqlens (packed varlen input)")
        n_seqs = B
        cu = cu_host = torch.arange(B + 1, dtype=torch.int32) * T
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)
    if cu_seqlens is not None:
        check_same_device(q=q, cu_seqlens=cu_seqlens)
    if state_pool is not None and (initial_state is not None or output_final_state):
        raise ValueError("give either state_pool (in place) or initial_state/output_final_state, not both")
    if (state_pool is None) != (state_indices is None):
        raise ValueError("state_pool and state_indices must be given together")
    h0 = h0_idx = ht = ht_idx = None
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,), shape=(n_seqs, H, K, V))
        if initial_state.device != dev:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {dev}")
        h0 = initial_state.contiguous()
        h0_idx = torch.arange(n_seqs, dtype=torch.int32, device=dev)
    final = None
    if output_final_state:
        final = torch.empty(n_seqs, H, K, V, dtype=torch.float32, device=dev)
        ht, ht_idx = final, torch.arange(n_seqs, dtype=torch.int32, device=dev)
    if state_pool is not None:
        _check_pool("state_pool", state_pool, H, K, V, dev)
        _check_indices("state_indices", state_indices, n_seqs, "state_pool", state_pool, allow_negative=False)
        if state_indices.device != dev:
            raise ValueError(f"state_indices is on {state_indices.device} but q is on {dev}")
        h0 = ht = state_pool
        h0_idx = ht_idx = state_indices
    scale = K ** -0.5 if scale is None else float(scale)
    o = _prefill_op(q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, H, V), g.reshape(B * T, H, K),
                    beta.reshape(B * T, H), cu, cu_host, scale, _flat_param(A_log), _flat_param(dt_bias),
                    None if lower_bound is None else float(lower_bound), bool(l2norm_qk), bool(beta_sigmoid), h0,
                    h0_idx, ht, ht_idx)
    return o.view(B, T, H, V), final


# ---------------------------------------------------------------------------------------------------
# decode


def _decode_run(q, k, v, g, beta, pool, idx, scale, A_log, dt_bias, lower_bound, l2, bsig):
    if not use_triton(q):
        return reference.kda_decode(q, k, v, g, beta, pool, idx, scale=scale, A_log=A_log, dt_bias=dt_bias,
                                    lower_bound=lower_bound, l2norm_qk=l2, beta_sigmoid=bsig)
    from . import kernels

    return kernels.decode(q, k, v, g, beta, pool, idx, scale, A_log, dt_bias, lower_bound, l2, bsig)


@torch.library.custom_op("lmkernels::kda_decode", mutates_args=("pool",))
def _decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, pool: torch.Tensor,
    idx: torch.Tensor, scale: float, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float], l2: bool, bsig: bool,
) -> torch.Tensor:
    return _decode_run(q, k, v, g, beta, pool, idx, scale, A_log, dt_bias, lower_bound, l2, bsig)


@_decode_op.register_fake
def _(q, k, v, g, beta, pool, idx, scale, A_log, dt_bias, lower_bound, l2, bsig):
    return v.new_empty(v.shape)


def kda_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, state_indices: torch.Tensor, *, scale: Optional[float] = None,
    A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None, l2norm_qk: bool = False, beta_sigmoid: bool = False,
):
    """Recurrent KDA for a batch of sequences whose states live in a pool (continuous batching); returns o.

    q, k, g [N, Q, H, K] (Q new tokens per sequence, applied in order) or [N, H, K] for Q = 1; v [N, Q, H, V]
    ([N, H, V]); beta [N, Q, H] ([N, H]). state_pool fp32 [P, H, K, V] is updated in place: sequence n reads
    and writes slot state_indices[n] (int32/int64 [N]; −1 = padding, skipped, its output is 0). Slots must be
    distinct. Gate, L2 norm, β sigmoid and scale as in kda_prefill. No host sync (index range checks run for
    CPU tensors only).
    """
    _check_scalars(scale, lower_bound)
    check_tensor("q", q, dtypes=IN_DTYPES)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [N, Q, H, K] or [N, H, K], got shape {tuple(q.shape)}")
    squeeze = q.dim() == 3
    if squeeze:
        for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
            check_tensor(name, t)
        q, k, v, g, beta = q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None]
    N, Q, H, K = q.shape
    _check_common(q, k, v, g, beta, A_log, dt_bias, lower_bound, (N, Q))
    V = v.shape[-1]
    _check_pool("state_pool", state_pool, H, K, V, q.device)
    _check_indices("state_indices", state_indices, N, "state_pool", state_pool, allow_negative=True)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state_indices=state_indices, A_log=A_log, dt_bias=dt_bias)
    scale = K ** -0.5 if scale is None else float(scale)
    o = _decode_op(q, k, v, g, beta, state_pool, state_indices, scale, _flat_param(A_log), _flat_param(dt_bias),
                   None if lower_bound is None else float(lower_bound), bool(l2norm_qk), bool(beta_sigmoid))
    return o[:, 0] if squeeze else o
