"""MLA (Multi-head Latent Attention, DeepSeek-V2/V3): a paged latent cache with a fused RMSNorm + RoPE +
store (bf16 or FP8 e4m3 with a scale per 128 values), absorbed paged decode (MQA with key dim 576, value
dim 512, all heads in one tile, split-KV + LSE merge, MTP query tokens), the prefill path through the
attention family's kernel, and a DeepSeek-V3 attention layer (layer.py). Math in reference.py."""

from .api import MLADecodeSchedule, mla_decode, mla_decode_schedule, new_latent_cache, write_latent_cache
from .layer import DeepseekV3MLA
from .prefill import MLAPrefillPlan, mla_prefill, mla_prefill_plan

__all__ = ["DeepseekV3MLA", "MLADecodeSchedule", "MLAPrefillPlan", "mla_decode", "mla_decode_schedule", "mla_prefill",
           "mla_prefill_plan", "new_latent_cache", "write_latent_cache"]
