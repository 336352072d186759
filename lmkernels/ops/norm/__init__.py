"""RMSNorm and LayerNorm over the last dimension, optionally fused with a residual add and GeLU.

Public functions validate their inputs, then call a torch.library custom op, which runs the Triton
kernel for CUDA tensors (or on CPU under TRITON_INTERPRET=1) and the reference otherwise.
"""

from typing import Optional

import torch

from ..._utils import FLOAT_DTYPES, as_rows, check_same_device, check_tensor, use_triton
from . import reference

MAX_HIDDEN = 65536  # a row is held whole in registers


def _run(x, residual, weight, bias, eps, kind, weight_offset, gelu):
    if not use_triton(x):
        return reference.norm(x, residual, weight, bias, eps, kind, weight_offset, gelu)
    from . import kernels  # imported late so TRITON_INTERPRET can still be set by the caller

    y, r = kernels.norm(
        as_rows("x", x), None if residual is None else as_rows("residual", residual),
        weight, bias, eps, kind, weight_offset, gelu,
    )
    y = y.view(x.shape)
    return y if residual is None else (y, r.view(x.shape))


@torch.library.custom_op("lmkernels::norm", mutates_args=())
def _norm_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
    eps: float, kind: str, weight_offset: float, gelu: str,
) -> torch.Tensor:
    return _run(x, None, weight, bias, eps, kind, weight_offset, gelu)


@_norm_op.register_fake
def _(x, weight, bias, eps, kind, weight_offset, gelu):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("lmkernels::add_norm", mutates_args=())
def _add_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
    eps: float, kind: str, weight_offset: float, gelu: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(x, residual, weight, bias, eps, kind, weight_offset, gelu)


@_add_norm_op.register_fake
def _(x, residual, weight, bias, eps, kind, weight_offset, gelu):
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, torch.empty_like(out)


def _validate(x, residual, params, eps):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    n = x.shape[-1]
    if not 1 <= n <= MAX_HIDDEN:
        raise ValueError(f"x must have a last dimension between 1 and {MAX_HIDDEN}, got {n}")
    if x.stride(-1) != 1 and x.numel() > 0:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")
    for name, p in params.items():
        if p is not None:
            check_tensor(name, p, dtypes=FLOAT_DTYPES, shape=(n,))
            if p.stride(0) != 1:
                raise ValueError(f"{name} must be contiguous")
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=x.shape)
        if residual.stride(-1) != 1 and residual.numel() > 0:
            raise ValueError(f"residual must be contiguous in its last dimension, got strides {residual.stride()}")
    check_same_device(x=x, residual=residual, **params)
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")


def _call(x, residual, weight, bias, eps, kind, weight_offset=0.0, gelu="none"):
    if not torch.compiler.is_compiling():  # eager: skip the dispatcher, ~50 µs of host time per call
        return _run(x, residual, weight, bias, float(eps), kind, float(weight_offset), gelu)
    if residual is None:
        return _norm_op(x, weight, bias, float(eps), kind, float(weight_offset), gelu)
    return _add_norm_op(x, residual, weight, bias, float(eps), kind, float(weight_offset), gelu)


def rms_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], eps: float = 1e-6,
    residual: Optional[torch.Tensor] = None, *, weight_offset: float = 0.0,
):
    """RMSNorm over the last dim: x / sqrt(mean(x²) + eps) · (weight + weight_offset).

    With `residual`, first r = x + residual (rounded to x.dtype) and return (rms_norm(r), r) from one
    pass. `weight_offset=1.0` gives Gemma's (1 + weight). `weight=None` means no scale.
    """
    _validate(x, residual, {"weight": weight}, eps)
    return _call(x, residual, weight, None, eps, "rms", weight_offset)


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float = 1e-5,
    residual: Optional[torch.Tensor] = None,
):
    """LayerNorm over the last dim (biased variance). With `residual`, returns (layer_norm(x + residual), x + residual)."""
    _validate(x, residual, {"weight": weight, "bias": bias}, eps)
    return _call(x, residual, weight, bias, eps, "layer")


def layer_norm_gelu(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float = 1e-5,
    residual: Optional[torch.Tensor] = None, *, approximate: str = "tanh",
):
    """gelu(layer_norm(x)) in one pass; `approximate` is "tanh" or "none" (the exact erf form), as in torch."""
    form = {"tanh": "tanh", "none": "erf"}.get(approximate)
    if form is None:
        raise ValueError(f'approximate must be "tanh" or "none", got {approximate!r}')
    _validate(x, residual, {"weight": weight, "bias": bias}, eps)
    return _call(x, residual, weight, bias, eps, "layer", gelu=form)
