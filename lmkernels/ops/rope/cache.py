"""cos/sin caches for rotary embeddings: the original RoPE and the scaled variants of Hugging Face's
`rope_parameters` (legacy `rope_scaling`) dicts: "default", "linear", "llama3" and "yarn".

Default (Su et al.):  θ_j = base^(−2j/R),  j = 0 … R/2 − 1, R = rotary_dim
linear:               θ_j / factor                                   (position interpolation)
llama3:               θ_j · (s_j + (1 − s_j)/factor),  s_j = clamp((L/λ_j − low_freq_factor) / (high_freq_factor
                      − low_freq_factor), 0, 1),  λ_j = 2π/θ_j,  L = original_max_position_embeddings
yarn (Peng et al.):   dims rotating more than beta_fast times over L keep θ_j, those rotating less than beta_slow
                      times get θ_j/factor, with a linear ramp r_j between:  θ_j · (1 − r_j + r_j/factor);
                      cos and sin are multiplied by the attention factor 0.1·ln(factor) + 1 (DeepSeek: the ratio
                      of that with mscale to that with mscale_all_dim), so attention needs no extra scale.
cache[p] = [cos(p·θ_0) … cos(p·θ_{R/2−1}) | sin(p·θ_0) … sin(p·θ_{R/2−1})] · attention_factor.

Everything is computed in float64 and rounded once: an fp32 angle p·θ is off by up to p·6e-8 rad, which
at p = 128k is 1e-2 rad; HF and vLLM compute in fp32, so they match this to that precision only.
"""

import math
from typing import Optional

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _param(rope_scaling, key, rope_type):
    value = rope_scaling.get(key)
    if value is None:
        raise ValueError(f"rope_scaling[{key!r}] is required for rope_type {rope_type!r}")
    return value


def _yarn_mscale(factor, mscale=1.0):
    """YaRN's attention temperature: 0.1·mscale·ln(factor) + 1 (1 when factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(rotary_dim: int, max_position: int, base: float = 10000.0, rope_scaling: Optional[dict] = None):
    """(θ [rotary_dim/2] float64, attention_factor) for one of ROPE_TYPES; see the module docstring."""
    rope_scaling = dict(rope_scaling or {})
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type must be one of {', '.join(ROPE_TYPES)}; got {rope_type!r}")
    if rope_scaling.get("rope_theta", base) != base:  # HF 5 keeps the base inside the dict: it must agree
        raise ValueError(f"rope_scaling['rope_theta'] = {rope_scaling['rope_theta']} disagrees with base = {base}")
    j = torch.arange(rotary_dim // 2, dtype=torch.float64)
    theta = base ** (-2 * j / rotary_dim)
    if rope_type == "default":
        return theta, 1.0
    if rope_type == "linear":
        return theta / _param(rope_scaling, "factor", rope_type), 1.0
    # HF falls back to max_position_embeddings, the role of max_position here
    original = rope_scaling.get("original_max_position_embeddings") or max_position
    if rope_type == "llama3":
        factor = _param(rope_scaling, "factor", rope_type)
        low = _param(rope_scaling, "low_freq_factor", rope_type)
        high = _param(rope_scaling, "high_freq_factor", rope_type)
        if not high > low:
            raise ValueError(f"rope_scaling needs high_freq_factor > low_freq_factor, got {high} and {low}")
        # s = 1: short wavelengths, kept; s = 0: long ones, divided by factor; smooth in between
        s = ((original * theta / (2 * math.pi) - low) / (high - low)).clamp(0, 1)
        return theta * (s + (1 - s) / factor), 1.0

    # yarn; with no factor, HF takes the context extension ratio
    factor = rope_scaling.get("factor") or max_position / original
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def dim_of(rotations):  # the (fractional) pair index j whose wavelength fits `rotations` times into L
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if rope_scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    # ramp 0: keep θ_j (extrapolate), 1: θ_j/factor (interpolate); HF's 0.001 avoids a zero-width ramp
    ramp = ((j - lo) / (hi - lo if hi != lo else 0.001)).clamp(0, 1)
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek: the ratio; the model scales its softmax by the rest
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return theta * (1 - ramp + ramp / factor), float(attention_factor)


def build_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float = 10000.0, rope_scaling: Optional[dict] = None,
    *, dtype: torch.dtype = torch.float32, device=None,
) -> torch.Tensor:
    """[max_position, rotary_dim] = [cos(p·θ) | sin(p·θ)] · attention_factor for p = 0 … max_position − 1.

    `rope_scaling` is a Hugging Face `rope_parameters` / `rope_scaling` dict (None: default RoPE).
    `rotary_dim` is the number of rotated dims (head_dim · partial_rotary_factor), so a
    `partial_rotary_factor` in the dict is not applied again.
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"max_position must be a positive int, got {max_position!r}")
    if not base > 1:
        raise ValueError(f"base must be a number > 1, got {base!r}")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    theta, attention_factor = rope_frequencies(rotary_dim, max_position, base, rope_scaling)
    # on the CPU in float64, so every device gets the same cache
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * theta[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_factor
    return cache.to(dtype=dtype, device=device)
