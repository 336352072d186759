"""Triton kernel for gated activations: out[:, j] = act(x[:, j]) · x[:, d + j].

Grid (rows, column blocks): every program reads one block of gate and up values and writes one block
of output, so the op streams at memory bandwidth for any row count.
"""

import torch
import triton
import triton.language as tl

from ..norm.kernels import gelu

ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1, "gelu_erf": 2}


@triton.jit
def _gated_kernel(x_ptr, out_ptr, d, x_stride, out_stride, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate * tl.sigmoid(gate)
    else:
        act = gelu(gate, ACT)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def launch_config(d: int, elem_size: int):
    """(BLOCK, num_warps): up to 2048 columns per program, 16-byte accesses per thread."""
    block = min(2048, triton.next_power_of_2(d))
    per_thread = 16 // elem_size
    return block, max(1, min(8, block // (per_thread * 32)))


def gated(x2d, activation):
    """x2d: [rows, 2·d] with unit column stride. Returns out [rows, d], contiguous."""
    n_rows, d = x2d.shape[0], x2d.shape[1] // 2
    out = torch.empty((n_rows, d), dtype=x2d.dtype, device=x2d.device)
    if n_rows == 0:
        return out
    block, num_warps = launch_config(d, x2d.element_size())
    grid = (n_rows, triton.cdiv(d, block))
    _gated_kernel[grid](x2d, out, d, x2d.stride(0), out.stride(0),
                        ACT=ACTIVATION_CODES[activation], BLOCK=block, num_warps=num_warps)
    return out
