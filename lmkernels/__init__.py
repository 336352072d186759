"""lmkernels: Triton kernels for LLM inference, each checked against a plain PyTorch reference."""

from .ops.activation import gelu_and_mul, silu_and_mul
from .ops.norm import layer_norm, layer_norm_gelu, rms_norm
from .ops.rope import apply_rotary, build_cos_sin_cache

__version__ = "0.1.0"
__all__ = [
    "apply_rotary", "build_cos_sin_cache", "gelu_and_mul", "layer_norm", "layer_norm_gelu", "rms_norm", "silu_and_mul",
]
