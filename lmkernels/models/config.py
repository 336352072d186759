"""ModelConfig: the few numbers a Llama-family model needs, read from a Hugging Face config.

Accepts a `transformers.PretrainedConfig` or the `config.json` dict (either the transformers-5 form with
`rope_parameters` or the older one with `rope_theta` / `rope_scaling` at the top level). Unsupported
architectures raise ValueError naming the supported ones.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

# model_type → (the HF class name, whether q/k/v carry a bias by default, per-head q/k RMSNorm)
SUPPORTED = {
    "llama": "LlamaForCausalLM",     # Llama 2/3, SmolLM2, and most llama-shaped models
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ARCHITECTURES = {cls: mt for mt, cls in SUPPORTED.items()}


def supported_text() -> str:
    return ", ".join(f"{cls} (model_type {mt!r})" for mt, cls in SUPPORTED.items())


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None           # HF rope_parameters (rope_type, factor, …), None: default RoPE
    rope_freq_factors: Optional[list] = None      # GGUF rope_freqs: θ_j / factor_j (llama.cpp's Llama 3 scaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: list = field(default_factory=list)  # per layer: None (full attention) or window size
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None
    torch_dtype: Optional[str] = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config) -> "ModelConfig":
        """From a transformers PretrainedConfig or a config.json dict."""
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        if not isinstance(config, dict):
            raise TypeError(f"config must be a transformers PretrainedConfig or a dict, got {type(config).__name__}")
        d = config
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type not in SUPPORTED:
            known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
            if known and model_type is None:
                model_type = known[0]
            else:
                what = f"model_type {model_type!r}" + (f" (architectures {archs})" if archs else "")
                raise ValueError(f"unsupported architecture: {what}; supported: {supported_text()}")
        for a in archs:
            if a not in ARCHITECTURES:
                raise ValueError(f"unsupported architecture {a!r}; supported: {supported_text()}")

        def need(key):
            if d.get(key) is None:
                raise ValueError(f"the config has no {key!r} (needed for a {model_type} model)")
            return d[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        n_layers = int(need("num_hidden_layers"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if rope and not ("rope_type" in rope or "type" in rope or "rope_theta" in rope):
            raise ValueError(f"per-layer-type rope parameters are not supported, got {rope}")
        theta = float(rope.get("rope_theta", d.get("rope_theta") or 10000.0))
        rope["rope_theta"] = theta
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings are not supported for the Llama family")
        rope_scaling = None if rope_type == "default" else rope

        bias = d.get("attention_bias")
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(bias)

        window = d.get("sliding_window")
        layer_types = d.get("layer_types")
        if model_type == "mistral":
            windows = [window] * n_layers
        elif layer_types and (d.get("use_sliding_window", True)):
            windows = [window if t == "sliding_attention" else None for t in layer_types]
        else:
            windows = [None] * n_layers
        if len(windows) != n_layers:
            raise ValueError(f"layer_types has {len(windows)} entries for {n_layers} layers")
        windows = [int(w) if w else None for w in windows]

        dtype = d.get("dtype", d.get("torch_dtype"))
        return cls(
            model_type=model_type, vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")), num_layers=n_layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            rope_theta=theta, rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias")), qk_norm=model_type == "qwen3", sliding_windows=windows,
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            torch_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
        )

    def validate(self) -> "ModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_kv_heads})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        return self

    def eos_token_ids(self) -> list:
        e = self.eos_token_id
        return [] if e is None else [int(x) for x in (e if isinstance(e, (list, tuple)) else [e])]
