"""Gated activations (SwiGLU, GeGLU) on a concatenated [gate | up] last dimension."""

import torch

from ..._utils import FLOAT_DTYPES, as_rows, check_tensor, use_triton
from . import reference


def _run(x, activation):
    if not use_triton(x):
        if activation == "silu":
            return reference.silu_and_mul(x)
        return reference.gelu_and_mul(x, "tanh" if activation == "gelu_tanh" else "none")
    from . import kernels  # late, so TRITON_INTERPRET can still be set by the caller

    return kernels.gated(as_rows("x", x), activation).view(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("lmkernels::gated_activation", mutates_args=())
def _gated_op(x: torch.Tensor, activation: str) -> torch.Tensor:
    return _run(x, activation)


def _call(x, activation):
    if torch.compiler.is_compiling():
        return _gated_op(x, activation)
    return _run(x, activation)  # eager: skip the dispatcher, ~50 µs of host time per call


@_gated_op.register_fake
def _(x, activation):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _validate(x):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    if x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even, non-zero last dimension [gate | up], got shape {tuple(x.shape)}")
    if x.numel() > 0 and x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: x = [gate | up] (last dim 2·d) → silu(gate) · up (last dim d)."""
    _validate(x)
    return _call(x, "silu")


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU: x = [gate | up] → gelu(gate) · up; `approximate` is "tanh" or "none" (erf), as in torch."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f'approximate must be "tanh" or "none", got {approximate!r}')
    _validate(x)
    return _call(x, "gelu_tanh" if approximate == "tanh" else "gelu_erf")
