"""Rotary position embeddings: rotate q and k in place by their tokens' positions (NeoX or GPT-J pairs,
full or partial rotary), from a cos/sin cache built for the default, linear, llama3 or YaRN scaling.

The public function validates its inputs, then calls a torch.library custom op that mutates q and k: the
Triton kernel for CUDA tensors (or on CPU under TRITON_INTERPRET=1), the reference otherwise.
"""

from typing import Optional

import torch

from ..._utils import (
    FLOAT_DTYPES, INDEX_DTYPES, check_index_range, check_same_device, check_tensor, check_unit_stride, use_triton,
)
from . import reference
from .cache import build_cos_sin_cache, rope_frequencies

__all__ = ["apply_rotary", "build_cos_sin_cache", "rope_frequencies"]


def _rotate(q, k, cos_sin_cache, positions, is_neox):
    # Here rather than in apply_rotary: it reads the values, which torch.compile cannot do while tracing.
    check_index_range("positions", positions, 0, cos_sin_cache.shape[0], "the rows of cos_sin_cache")
    if not use_triton(q):
        q_rot, k_rot = reference.apply_rotary(q, k, cos_sin_cache, positions, is_neox)
        q.copy_(q_rot)
        if k is not None:
            k.copy_(k_rot)
        return
    from . import kernels  # late, so TRITON_INTERPRET can still be set by the caller

    kernels.apply_rotary(q, k, cos_sin_cache, positions, is_neox)


@torch.library.custom_op("lmkernels::apply_rotary", mutates_args=("q", "k"))
def _rotary_op(
    q: torch.Tensor, k: Optional[torch.Tensor], cos_sin_cache: torch.Tensor, positions: torch.Tensor, is_neox: bool,
) -> None:
    _rotate(q, k, cos_sin_cache, positions, is_neox)


@_rotary_op.register_fake
def _(q, k, cos_sin_cache, positions, is_neox):
    return None


def _validate(q, k, cos_sin_cache, positions):
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    n_tokens, head_dim = q.shape[0], q.shape[2]
    if k is not None:
        check_tensor("k", k, dtypes=(q.dtype,), ndim=3)
        if k.shape[0] != n_tokens or k.shape[2] != head_dim:
            raise ValueError(
                f"k must have shape [T, Hk, D] with T = {n_tokens} and D = {head_dim} as in q, got {tuple(k.shape)}"
            )
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=tuple(dict.fromkeys((torch.float32, q.dtype))), ndim=2)
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos_sin_cache must have rotary_dim columns (its last dim), even and between 2 and the head dim "
            f"{head_dim}; got rotary_dim = {rotary_dim}"
        )
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(n_tokens,))
    check_same_device(q=q, k=k, cos_sin_cache=cos_sin_cache, positions=positions)
    check_unit_stride("q", q)
    if k is not None:
        check_unit_stride("k", k)
    check_unit_stride("cos_sin_cache", cos_sin_cache)


def apply_rotary(
    q: torch.Tensor, k: Optional[torch.Tensor], cos_sin_cache: torch.Tensor, positions: torch.Tensor,
    *, is_neox: bool = True,
):
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place by RoPE and return (q, k); k may be None.

    Token t's pairs of the first R dims of every head turn by the angles in cos_sin_cache[positions[t]]:
    x1' = x1·cos − x2·sin, x2' = x2·cos + x1·sin in fp32, rounded once (math in reference.py). Pairs are
    (j, j + R/2) with is_neox=True (NeoX, Llama) and (2j, 2j + 1) otherwise (GPT-J); dims R … D−1 are
    untouched. cos_sin_cache: [max_position, R], float32 or q's dtype, from build_cos_sin_cache.
    Token and head strides are free (q and k may be views into a fused qkv tensor); last dims need stride 1.
    positions: [T] int32/int64 in [0, max_position), checked for CPU tensors; on CUDA the check would cost
    a host sync, so there keeping them in range is the caller's job.
    """
    _validate(q, k, cos_sin_cache, positions)
    if torch.compiler.is_compiling():
        _rotary_op(q, k, cos_sin_cache, positions, bool(is_neox))
    else:  # eager: skip the dispatcher, ~50 µs of host time per call
        _rotate(q, k, cos_sin_cache, positions, bool(is_neox))
    return q, k
