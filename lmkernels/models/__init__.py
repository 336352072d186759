"""Model definitions built from lmkernels ops: the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)."""

from .config import SUPPORTED, ModelConfig
from .llama import LlamaForCausalLM
from .metadata import AttentionMetadata, KVCache, decode_metadata, prefill_metadata
from .simple import greedy_generate, prefill_logits

__all__ = [
    "AttentionMetadata", "KVCache", "LlamaForCausalLM", "ModelConfig", "SUPPORTED", "decode_metadata",
    "greedy_generate", "prefill_logits", "prefill_metadata",
]
