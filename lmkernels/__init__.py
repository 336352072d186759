"""lmkernels: Triton kernels for LLM inference, each checked against a plain PyTorch reference."""

from .engine import Engine, SamplingParams
from .ops.activation import gelu_and_mul, silu_and_mul
from .ops.attention import (
    attention_decode, attention_prefill, attention_prefill_paged, merge_attention_states, write_kv_cache,
)
from .ops.gemv import gemv, gemv_qkv
from .ops.kda import kda_decode, kda_prefill
from .ops.kda.layer import KDACache, KDALayer
from .ops.mla import (
    DeepseekV3MLA, MLADecodeSchedule, MLAPrefillPlan, mla_decode, mla_decode_schedule, mla_prefill, mla_prefill_plan,
    new_latent_cache, write_latent_cache,
)
from .ops.norm import layer_norm, layer_norm_gelu, rms_norm
from .ops.rope import apply_rotary, build_cos_sin_cache

__version__ = "0.1.0"
__all__ = [
    "DeepseekV3MLA", "Engine", "KDACache", "KDALayer", "SamplingParams", "apply_rotary", "attention_decode", "attention_prefill", "attention_prefill_paged",
    "build_cos_sin_cache", "gelu_and_mul", "gemv", "gemv_qkv", "kda_decode", "kda_prefill", "layer_norm", "layer_norm_gelu", "merge_attention_states",
    "MLADecodeSchedule", "MLAPrefillPlan", "mla_decode", "mla_decode_schedule", "mla_prefill", "mla_prefill_plan", "new_latent_cache", "rms_norm", "silu_and_mul", "write_kv_cache",
    "write_latent_cache",
]
