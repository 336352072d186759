"""The decode-time linear layer: y = x Wᵀ for a few rows of x (the tokens of a decode step), with the RMSNorm
before it, the bias, SwiGLU and the residual add after it fused into the same pass over the weights; and the
attention's input projection `gemv_qkv`, which also applies the rotary embedding and writes k and v to the
paged cache.

At batch 1 a decoder layer is four such products, each bound by streaming its weight from memory; fusing the
norm, the activation and the residual add into them leaves four launches per layer for the MLP and the
projections instead of eight (see reference.py for the math, kernels.py for the kernel).
"""

from typing import Optional

import torch

from ..._utils import (
    FLOAT_DTYPES, INDEX_DTYPES, check_index_range, check_same_device, check_tensor, check_unit_stride, use_triton,
)
from . import reference

MAX_ROWS = 8  # rows of x per call: each row's accumulators live in registers


def _run(x, weight, bias, norm_weight, eps, residual, gated):
    if not use_triton(x):
        return reference.gemv(x, weight, bias, norm_weight, eps, residual, gated)
    from . import kernels  # late, so TRITON_INTERPRET can still be set by the caller

    return kernels.gemv(x, weight, bias, norm_weight, eps, residual, gated)


@torch.library.custom_op("lmkernels::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
             eps: float, residual: Optional[torch.Tensor], gated: bool) -> torch.Tensor:
    return _run(x, weight, bias, norm_weight, eps, residual, gated)


@_gemv_op.register_fake
def _(x, weight, bias, norm_weight, eps, residual, gated):
    return x.new_empty(x.shape[0], weight.shape[0] // (2 if gated else 1))


def _validate(x, weight, bias, norm_weight, eps, residual, gated):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2)
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows (a decode step's tokens), got {m}; use a matmul for more")
    if weight.shape[1] != k:
        raise ValueError(f"weight must have shape [N, {k}] to match x's last dimension, got {tuple(weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight stacks [gate; up] and needs an even number of rows, got {weight.shape[0]}")
    check_unit_stride("x", x)
    check_unit_stride("weight", weight)
    n_out = weight.shape[0] // (2 if gated else 1)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(x.dtype,), shape=(weight.shape[0],))
        check_unit_stride("bias", bias)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, dtypes=FLOAT_DTYPES, shape=(k,))
        check_unit_stride("norm_weight", norm_weight)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=(m, n_out))
        check_unit_stride("residual", residual)
    check_same_device(x=x, weight=weight, bias=bias, norm_weight=norm_weight, residual=residual)
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, residual: Optional[torch.Tensor] = None,
         gated: bool = False) -> torch.Tensor:
    """y = x Wᵀ (+ bias) for x [M ≤ 8, K] and weight [N, K] (torch's Linear layout), fused with its neighbours:

    norm_weight: RMSNorm each row of x first (eps), with this scale;
    gated: weight stacks [W_gate; W_up] (2·N rows) and y = silu(x W_gateᵀ) · (x W_upᵀ) (SwiGLU);
    residual [M, N]: added last (y is then the new residual stream).
    fp32 accumulation, one rounding to x's dtype. See reference.py for the definition.
    """
    _validate(x, weight, bias, norm_weight, eps, residual, gated)
    args = (x, weight, bias, norm_weight, float(eps), residual, bool(gated))
    if torch.compiler.is_compiling():
        return _gemv_op(*args)
    return _run(*args)  # eager: skip the dispatcher's host cost


def _run_qkv(x, weight, bias, norm_weight, eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, num_heads):
    # the data checks read values: here, inside the op, where torch.compile runs them on real tensors
    check_index_range("positions", positions, 0, cos_sin_cache.shape[0], "the rows of cos_sin_cache")
    check_index_range("slot_mapping", slot_mapping, -1, k_cache.shape[0] * k_cache.shape[1], "−1 = skip")
    if not use_triton(x):
        return reference.gemv_qkv(x, weight, bias, norm_weight, eps, cos_sin_cache, positions, k_cache, v_cache,
                                  slot_mapping, num_heads)
    from . import kernels

    return kernels.gemv_qkv(x, weight, bias, norm_weight, eps, cos_sin_cache, positions, k_cache, v_cache,
                            slot_mapping, num_heads)


@torch.library.custom_op("lmkernels::gemv_qkv", mutates_args=("k_cache", "v_cache"))
def _gemv_qkv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 norm_weight: Optional[torch.Tensor], eps: float, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_heads: int) -> torch.Tensor:
    return _run_qkv(x, weight, bias, norm_weight, eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
                    num_heads)


@_gemv_qkv_op.register_fake
def _(x, weight, bias, norm_weight, eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, num_heads):
    return x.new_empty(x.shape[0], num_heads * k_cache.shape[3])


def gemv_qkv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
             norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, num_heads: int,
             cos_sin_cache: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> torch.Tensor:
    """The attention input of a decode step in one pass over W_qkv: q|k|v = rms_norm(x) W_qkvᵀ (+ bias), NeoX
    rotary on q and k at `positions` (full head dim; cos_sin_cache [max_pos, D] = [cos | sin], float32), k and v
    stored into the paged caches [pages, page_size, Hk, D] at slot_mapping (−1: skip); returns q [M, Hq·D].

    weight: [(num_heads + 2·Hk)·D, K] = [W_q; W_k; W_v]; Hk and D are read off k_cache. See reference.py.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("k_cache", k_cache, dtypes=(x.dtype,), ndim=4)
    check_tensor("v_cache", v_cache, dtypes=(x.dtype,), shape=k_cache.shape)
    hk, d = k_cache.shape[2], k_cache.shape[3]
    if not isinstance(num_heads, int) or num_heads < 1 or num_heads % hk:
        raise ValueError(f"num_heads must be a positive multiple of the cache's {hk} kv heads, got {num_heads!r}")
    if d % 16:
        raise ValueError(f"the head dim (k_cache.shape[3]) must be a multiple of 16, got {d}")
    _validate(x, weight, bias, norm_weight, eps, None, False)
    if weight.shape[0] != (num_heads + 2 * hk) * d:
        raise ValueError(f"weight must have (num_heads + 2·kv_heads)·head_dim = {(num_heads + 2 * hk) * d} rows, "
                         f"got {weight.shape[0]}")
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32,), ndim=2)
    if cos_sin_cache.shape[1] != d:
        raise ValueError(f"cos_sin_cache must cover the full head dim {d} (cos | sin), got width {cos_sin_cache.shape[1]}")
    check_unit_stride("cos_sin_cache", cos_sin_cache)
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(x.shape[0],))
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, shape=(x.shape[0],))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    check_same_device(x=x, cos_sin_cache=cos_sin_cache, positions=positions, k_cache=k_cache, v_cache=v_cache,
                      slot_mapping=slot_mapping)
    args = (x, weight, bias, norm_weight, float(eps), cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
            int(num_heads))
    if torch.compiler.is_compiling():
        return _gemv_qkv_op(*args)
    return _run_qkv(*args)


__all__ = ["MAX_ROWS", "gemv", "gemv_qkv"]
