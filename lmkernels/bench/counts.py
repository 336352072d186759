"""Bytes each op must move through device memory: every input read once, every output written once.

Every implementation of an op (ours and the peers) is credited with the same count, so GB/s figures
of one row compare like with like (they are the inverse of time, scaled). Pure functions, no torch.
"""


def norm_bytes(tokens: int, hidden: int, elem: int = 2, *, residual: bool = False, weight: bool = True,
               bias: bool = False, param_elem: int | None = None) -> int:
    """RMSNorm / LayerNorm on [tokens, hidden]: x read, y written; with a residual also residual read and
    r = x + residual written; weight (and bias) read once (`param_elem` bytes each, default `elem`)."""
    param_elem = elem if param_elem is None else param_elem
    activations = tokens * hidden * elem * (4 if residual else 2)
    params = hidden * param_elem * (int(weight) + int(bias))
    return activations + params


def gated_bytes(tokens: int, d: int, elem: int = 2) -> int:
    """SwiGLU / GeGLU: x = [gate | up] of [tokens, 2·d] read, out [tokens, d] written."""
    return tokens * 3 * d * elem


def rope_bytes(tokens: int, q_heads: int, kv_heads: int, head_dim: int, elem: int = 2, *,
               rotary_dim: int | None = None, cache_elem: int = 4, pos_elem: int = 8) -> int:
    """Rotary in place: q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] read and written
    (the whole heads, as the in-place op streams them), one cos/sin cache row of `rotary_dim` entries per
    token read, and the positions read."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    qk = tokens * (q_heads + kv_heads) * head_dim * elem * 2
    return qk + tokens * rotary_dim * cache_elem + tokens * pos_elem


def copy_bytes(nbytes: int) -> int:
    """A device-to-device copy of `nbytes` reads and writes each byte once."""
    return 2 * nbytes


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def gbps(nbytes: int, ms: float) -> float:
    """Bytes moved in `ms` milliseconds, in GB/s (1 GB = 1e9 bytes)."""
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
