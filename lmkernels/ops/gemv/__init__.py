"""The decode-time linear layer: y = x Wᵀ for a few rows of x (the tokens of a decode step), with the RMSNorm
before it, the bias, SwiGLU and the residual add after it fused into the same pass over the weights.

At batch 1 a decoder layer is four such products, each bound by streaming its weight from memory; fusing the
norm, the activation and the residual add into them leaves four launches per layer for the MLP and the
projections instead of eight (see reference.py for the math, kernels.py for the kernel).
"""

from typing import Optional

import torch

from ..._utils import FLOAT_DTYPES, check_same_device, check_tensor, check_unit_stride, use_triton
from . import reference

MAX_ROWS = 8  # rows of x per call: each row's accumulators live in registers


def _run(x, weight, bias, norm_weight, eps, residual, gated, l2_prefetch):
    if not use_triton(x):
        return reference.gemv(x, weight, bias, norm_weight, eps, residual, gated)
    from . import kernels  # late, so TRITON_INTERPRET can still be set by the caller

    return kernels.gemv(x, weight, bias, norm_weight, eps, residual, gated, l2_prefetch=l2_prefetch)


@torch.library.custom_op("lmkernels::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
             eps: float, residual: Optional[torch.Tensor], gated: bool, l2_prefetch: bool) -> torch.Tensor:
    return _run(x, weight, bias, norm_weight, eps, residual, gated, l2_prefetch)


@_gemv_op.register_fake
def _(x, weight, bias, norm_weight, eps, residual, gated, l2_prefetch):
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
         gated: bool = False, l2_prefetch: bool = False) -> torch.Tensor:
    """y = x Wᵀ (+ bias) for x [M ≤ 8, K] and weight [N, K] (torch's Linear layout), fused with its neighbours:

    norm_weight: RMSNorm each row of x first (eps), with this scale;
    gated: weight stacks [W_gate; W_up] (2·N rows) and y = silu(x W_gateᵀ) · (x W_upᵀ) (SwiGLU);
    residual [M, N]: added last (y is then the new residual stream).
    l2_prefetch: a scheduling hint, no change to the result. On Hopper (programmatic dependent launch) the
    kernel starts while the kernel before it still runs and first pulls its whole weight into L2; worth it
    right after a latency-bound kernel (decode attention) for a weight well under the L2 size.
    fp32 accumulation, one rounding to x's dtype. See reference.py for the definition.
    """
    _validate(x, weight, bias, norm_weight, eps, residual, gated)
    args = (x, weight, bias, norm_weight, float(eps), residual, bool(gated), bool(l2_prefetch))
    if torch.compiler.is_compiling():
        return _gemv_op(*args)
    return _run(*args)  # eager: skip the dispatcher's host cost


__all__ = ["MAX_ROWS", "gemv"]
