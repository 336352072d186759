"""The definition of the decode-time linear layer with its fusions, in plain PyTorch (fp32 arithmetic).

For x [M, K] (a few rows: the tokens of a decode step) and W [N_w, K]:

    a = x · rsqrt(mean(x², -1) + eps) · g      if norm_weight g is given (RMSNorm of each row), else a = x
    y = a Wᵀ + b                                 (b: bias, optional)
    y = silu(y[:, :N]) · y[:, N:]                if gated (W = [W_gate; W_up], N = N_w / 2: SwiGLU)
    y = y + r                                    if residual r is given (the residual stream's add)

rounded once to x's dtype.
"""

from typing import Optional

import torch
import torch.nn.functional as F


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, residual: Optional[torch.Tensor] = None,
         gated: bool = False) -> torch.Tensor:
    a = x.float()
    if norm_weight is not None:
        a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = a @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)
