"""Gated activations on a concatenated [gate | up] tensor, the definition in plain PyTorch.

x = [g | u] along the last dim (2·d values), out = act(g) · u with d values, computed in fp32 and
rounded once to the input dtype.
SwiGLU: act = silu(g) = g · sigmoid(g).   GeGLU: act = gelu(g), tanh or erf ("none") form as in torch.
"""

import torch.nn.functional as F


def silu_and_mul(x):
    g, u = x.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(x.dtype)


def gelu_and_mul(x, approximate="tanh"):
    g, u = x.float().chunk(2, dim=-1)
    return (F.gelu(g, approximate=approximate) * u).to(x.dtype)
