"""Rotary position embedding (RoPE), the definition in plain PyTorch (fp32 math, one rounding to the input dtype).

A token at position p rotates the first R = rotary_dim dims of every head by pairs (x1, x2):
    x1' = x1·cos(p·θ_j) − x2·sin(p·θ_j)
    x2' = x2·cos(p·θ_j) + x1·sin(p·θ_j)        j = 0 … R/2 − 1
i.e. the complex number x1 + i·x2 is multiplied by e^{i·p·θ_j}. The pairs are
    NeoX / Llama (is_neox=True):    (x[j], x[j + R/2])      halves of the rotary dims
    GPT-J (is_neox=False):          (x[2j], x[2j + 1])      interleaved neighbours
Dims R … D−1 (partial rotary) are left as they are. cos_sin_cache[p] = [cos(p·θ_0 … p·θ_{R/2−1}) | sin(…)]
(vLLM's layout), possibly already scaled by an attention factor (YaRN); see cache.py.
"""

import torch


def rotate(x, cos_sin_cache, positions, is_neox):
    """x: [T, H, D] → a new tensor with the first R dims of every head rotated by its token's position."""
    r = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, R/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # the same angles for every head of a token
    xr = x[..., :r].float()
    if is_neox:
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    y = torch.cat((y1, y2), dim=-1) if is_neox else torch.stack((y1, y2), dim=-1).flatten(-2)
    out = x.clone()
    out[..., :r] = y.to(x.dtype)
    return out


def apply_rotary(q, k, cos_sin_cache, positions, is_neox=True):
    """Return rotated copies (q', k') of q [T, Hq, D] and k [T, Hk, D] (k may be None → k' is None)."""
    k_rot = None if k is None else rotate(k, cos_sin_cache, positions, is_neox)
    return rotate(q, cos_sin_cache, positions, is_neox), k_rot
