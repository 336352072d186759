"""GGUF files (llama.cpp): the config from the file's metadata, the weights dequantized at load with the `gguf`
package (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and whatever else gguf.quants.dequantize knows).

llama.cpp's converter reorders the rows of the q and k projections of `llama` models within each head, so
that its (GPT-J style, adjacent pairs) rope sees the pairs the NeoX style rotates: row 2i of a head holds
original row i and row 2i + 1 original row i + half. We put them back and rotate NeoX style, as Hugging
Face does. Qwen2/Qwen3 files keep the original order (llama.cpp uses NeoX rope for them).
"""

import os
import re
from pathlib import Path

import numpy as np
import torch

from ..models.config import ModelConfig
from ..models.llama import LlamaForCausalLM

# GGUF general.architecture → HF model_type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PERMUTED_QK = {"llama"}

_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str):
    """The Hugging Face name of a llama.cpp tensor name (None if it has none)."""
    m = _BLK.match(gguf_name)
    if m:
        layer, base, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER[base]}.{kind}" if base in _LAYER else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL[base]}.{kind}" if base in _GLOBAL else None


def open_gguf(path):
    """A gguf.GGUFReader for path, with clear errors for a missing or unreadable file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    from gguf import GGUFReader

    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        return GGUFReader(os.fspath(path))
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors … on a truncated file
        raise ValueError(f"{path} is a corrupt or truncated GGUF file: {type(e).__name__}: {e}") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return default if value is None else value


def config_from_gguf(reader, path="") -> dict:
    """A Hugging Face style config dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(ARCHITECTURES)}")
    a = arch

    def need(key):
        v = _field(reader, f"{a}.{key}")
        if v is None:
            raise ValueError(f"{path} lacks the GGUF metadata {a}.{key}")
        return v

    names = {t.name: t for t in reader.tensors}
    heads = int(need("attention.head_count"))
    kv = _field(reader, f"{a}.attention.head_count_kv", heads)
    if isinstance(kv, list):
        if len(set(kv)) != 1:
            raise ValueError(f"{path}: per-layer kv head counts {kv} are not supported")
        kv = kv[0]
    hidden = int(need("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{a}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None and "token_embd.weight" in names:
        vocab = int(names["token_embd.weight"].shape[-1])
    rope = {"rope_type": "default", "rope_theta": float(_field(reader, f"{a}.rope.freq_base", 10000.0))}
    scaling = _field(reader, f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", "", None):
        if scaling not in ("linear", "yarn"):
            raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (linear, yarn)")
        rope.update(rope_type=scaling, factor=float(need("rope.scaling.factor")))
        orig = _field(reader, f"{a}.rope.scaling.original_context_length")
        if orig:
            rope["original_max_position_embeddings"] = int(orig)
    ff = need("feed_forward_length")
    if isinstance(ff, list):
        ff = ff[0]
    window = _field(reader, f"{a}.attention.sliding_window")
    cfg = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": int(vocab) if vocab else None,
        "hidden_size": hidden,
        "intermediate_size": int(ff),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": int(_field(reader, f"{a}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "max_position_embeddings": int(_field(reader, f"{a}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if window and arch != "llama":
        cfg.update(sliding_window=int(window), use_sliding_window=True)
    return cfg


def dequantize(tensor) -> torch.Tensor:
    """A GGUF tensor as float32 torch, in PyTorch's [out, in] order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qtype = tensor.tensor_type
    try:
        if qtype == GGMLQuantizationType.F32:
            arr = np.asarray(tensor.data, dtype=np.float32)
        elif qtype == GGMLQuantizationType.F16:
            arr = np.asarray(tensor.data, dtype=np.float16).astype(np.float32)
        else:
            arr = gguf_dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {tensor.name}: quantization {qtype.name} cannot be dequantized") from None
    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    arr = np.asarray(arr).reshape(shape)
    if not arr.flags.writeable:  # a view of the read-only memory map
        arr = arr.copy()
    return torch.from_numpy(arr)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head reordering of q/k rows: within each head, rows (0, 1, 2, 3, …) hold original
    rows (0, half, 1, half + 1, …)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf(reader, config: ModelConfig, arch: str):
    """(HF name, float32 tensor) pairs; rope_freqs is read separately."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"unexpected GGUF tensor {t.name!r} for a {arch} model")
        w = dequantize(t)
        if arch in PERMUTED_QK:
            if ".self_attn.q_proj." in name:
                w = unpermute_qk(w, config.num_heads)
            elif ".self_attn.k_proj." in name:
                w = unpermute_qk(w, config.num_kv_heads)
        yield name, w


def load_gguf(path, *, dtype=torch.float32, device=None, max_model_len=None) -> LlamaForCausalLM:
    """A LlamaForCausalLM from a GGUF file, dequantized to `dtype`."""
    reader = open_gguf(path)
    hf_cfg = config_from_gguf(reader, path)
    cfg = ModelConfig.from_hf(hf_cfg)
    freqs = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    if freqs:
        cfg.rope_freq_factors = dequantize(freqs[0]).double().tolist()
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device, max_model_len=max_model_len)
    model.load_hf_weights(iter_gguf(reader, cfg, hf_cfg["model_type"]))
    return model.eval()
