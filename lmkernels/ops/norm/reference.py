"""Row normalisations, the definition in plain PyTorch (fp32 math, one rounding to the input dtype).

RMSNorm:    y = x / sqrt(mean(x²) + eps) · (w + weight_offset)      (Gemma: weight_offset = 1)
LayerNorm:  y = (x − mean(x)) / sqrt(var(x) + eps) · w + b          (biased variance)
With a residual the input is first r = x + residual, rounded to the input dtype; the op returns (y, r),
and y is the norm of that rounded r (what a pre-norm transformer keeps in its residual stream).
GeLU, when asked: tanh form 0.5·y·(1 + tanh(√(2/π)(y + 0.044715·y³))) or erf form 0.5·y·(1 + erf(y/√2)).
"""

import torch
import torch.nn.functional as F


def add_residual(x, residual):
    """r = x + residual, computed in fp32 and rounded once to x's dtype."""
    return (x.float() + residual.float()).to(x.dtype)


def rms_norm(x, weight, eps, weight_offset=0.0):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + weight_offset)
    return y.to(x.dtype)


def layer_norm(x, weight, bias, eps, gelu="none"):
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    if gelu != "none":  # "tanh" or "erf"
        y = F.gelu(y, approximate="tanh" if gelu == "tanh" else "none")
    return y.to(x.dtype)


def norm(x, residual, weight, bias, eps, kind, weight_offset=0.0, gelu="none"):
    """The whole family in one signature: kind is "rms" or "layer"; returns y, or (y, r) with a residual."""
    r = add_residual(x, residual) if residual is not None else x
    if kind == "rms":
        y = rms_norm(r, weight, eps, weight_offset)
    else:
        y = layer_norm(r, weight, bias, eps, gelu)
    return y if residual is None else (y, r)
