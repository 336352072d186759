"""The definition of the decode-time linear layer with its fusions, in plain PyTorch (fp32 arithmetic).

For x [M, K] (a few rows: the tokens of a decode step) and W [N_w, K]:

    a = x · rsqrt(mean(x², -1) + eps) · g      if norm_weight g is given (RMSNorm of each row), else a = x
    y = a Wᵀ + b                                 (b: bias, optional)
    y = silu(y[:, :N]) · y[:, N:]                if gated (W = [W_gate; W_up], N = N_w / 2: SwiGLU)
    y = y + r                                    if residual r is given (the residual stream's add)

rounded once to x's dtype.

gemv_qkv: y = a W_qkvᵀ + b split into q [M, Hq, D] | k [M, Hk, D] | v [M, Hk, D]; q and k rotated (NeoX pairs
(d, d + D/2) by the angle of each row's position: cos_sin_cache[pos] = [cos | sin]); k and v stored into the paged
caches at slot_mapping (slot = page · page_size + row; −1: not stored); returns q [M, Hq·D], each rounded once.
"""

from typing import Optional

import torch
import torch.nn.functional as F


def _linear(x, weight, bias, norm_weight, eps):
    a = x.float()
    if norm_weight is not None:
        a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = a @ weight.float().t()
    return y if bias is None else y + bias.float()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, residual: Optional[torch.Tensor] = None,
         gated: bool = False) -> torch.Tensor:
    y = _linear(x, weight, bias, norm_weight, eps)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def gemv_qkv(x, weight, bias, norm_weight, eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
             num_heads: int) -> torch.Tensor:
    m = x.shape[0]
    hk, d = k_cache.shape[2], k_cache.shape[3]
    q, k, v = _linear(x, weight, bias, norm_weight, eps).split([num_heads * d, hk * d, hk * d], dim=-1)
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [M, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(t):
        t1, t2 = t.view(m, -1, d).chunk(2, dim=-1)
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)

    q, k = rotate(q), rotate(k)
    page_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // page_size, slot % page_size] = k[i].to(k_cache.dtype)
            v_cache[slot // page_size, slot % page_size] = v[i].view(hk, d).to(v_cache.dtype)
    return q.reshape(m, num_heads * d).to(x.dtype)
