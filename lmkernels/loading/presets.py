"""Presets: real model shapes (from their Hugging Face config.json) with random weights, for benchmarks and
tests, plus tiny configs for CPU tests. Random init keeps activations O(1): embeddings N(0, 1/hidden), every
projection N(0, 1/fan_in) (so x Wᵀ keeps the scale of x), norm weights near 1, small biases.
"""

import copy

import torch

from ..models.llama import LlamaForCausalLM

_LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}

PRESETS = {
    "llama3-8b": _LLAMA3_8B,
    "llama3.1-8b": {
        **_LLAMA3_8B, "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009],
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 32768, "sliding_window": 4096, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    },
    # tiny configs for CPU tests (head dim 64: the smallest the attention kernels take)
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
        "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 1024, "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "tiny-qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 1024, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
}


def preset_config(name: str) -> dict:
    """The Hugging Face style config dict of a preset (a copy)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


@torch.no_grad()
def init_random(model: LlamaForCausalLM, seed: int = 0) -> LlamaForCausalLM:
    """Fill the parameters with random values that keep activations O(1) (see the module docstring)."""
    if model.device.type == "meta":  # shapes only
        return model
    g = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            std, mean = 0.02, 0.0
        elif p.dim() == 1:  # norm weights
            std, mean = 0.1, 1.0
        elif name.startswith("embed_tokens"):  # also the lm_head when tied: logits x Eᵀ stay O(1)
            std, mean = p.shape[1] ** -0.5, 0.0
        else:
            std, mean = p.shape[1] ** -0.5, 0.0
        p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).mul_(std).add_(mean))
    return model


def load_preset(name: str, *, dtype=torch.bfloat16, device=None, seed: int = 0, max_model_len=None,
                **overrides) -> LlamaForCausalLM:
    """A model of the preset's shape with random weights; `overrides` replace config entries (e.g.
    num_hidden_layers=2)."""
    cfg = preset_config(name)
    cfg.update(overrides)
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device, max_model_len=max_model_len)
    return init_random(model, seed).eval()
