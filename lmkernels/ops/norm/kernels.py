"""Triton kernels for RMSNorm and LayerNorm (optionally with a residual add in front and GeLU behind).

One program normalises ROWS rows held whole in registers (hidden sizes up to 65536), so each
input is read once and each output written once: the op runs at memory bandwidth.
"""

import torch
import triton
import triton.language as tl

GELU_CODES = {"none": 0, "tanh": 1, "erf": 2}


@triton.jit
def gelu(y, MODE: tl.constexpr):
    """MODE 1: tanh approximation, written with a sigmoid (tanh(z) = 2·sigmoid(2z) − 1); MODE 2: erf."""
    if MODE == 1:
        z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = y * tl.sigmoid(2.0 * z)
    elif MODE == 2:
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    return y


@triton.jit
def _norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, r_ptr,
    n_rows, n_cols, x_stride, res_stride, y_stride, r_stride,
    eps, weight_offset,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    GELU: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    rows = rows[:, None]
    x = tl.load(x_ptr + rows * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows * res_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = (x + res).to(r_ptr.dtype.element_ty)
        tl.store(r_ptr + rows * r_stride + cols[None, :], r, mask=mask)
        x = r.to(tl.float32)  # normalise the rounded sum, exactly what the caller keeps
    if IS_RMS:
        mean_sq = tl.sum(x * x, axis=1) / n_cols
        y = x * tl.rsqrt(mean_sq + eps)[:, None]
    else:
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / n_cols
        y = xc * tl.rsqrt(var + eps)[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = gelu(y, GELU)
    tl.store(y_ptr + rows * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def launch_config(n_cols: int, elem_size: int):
    """(ROWS, BLOCK_N, num_warps): about 16 KB of input per program, four 16-byte accesses per thread.

    Swept on an H100 (benchmarks/NOTES.md): within 1% of the best configuration at hidden 2048–8192.
    """
    block_n = triton.next_power_of_2(n_cols)
    rows = max(1, min(16, 16384 // (block_n * elem_size)))
    per_thread = 16 // elem_size  # elements in one 16-byte access
    num_warps = max(1, min(16, rows * block_n // (per_thread * 32 * 4)))
    return rows, block_n, triton.next_power_of_2(num_warps)


def norm(x2d, residual2d, weight, bias, eps, kind, weight_offset, gelu_mode):
    """x2d, residual2d: [rows, n] with unit column stride. Returns y (and r with a residual), contiguous."""
    n_rows, n_cols = x2d.shape
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    r = torch.empty_like(y) if residual2d is not None else None
    if n_rows == 0:
        return y, r
    rows, block_n, num_warps = launch_config(n_cols, x2d.element_size())
    _norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2d, residual2d, weight, bias, y, r,
        n_rows, n_cols, x2d.stride(0), residual2d.stride(0) if residual2d is not None else 0,
        y.stride(0), r.stride(0) if r is not None else 0,
        eps, weight_offset,
        IS_RMS=kind == "rms", HAS_RESIDUAL=residual2d is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, GELU=GELU_CODES[gelu_mode], ROWS=rows, BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y, r
