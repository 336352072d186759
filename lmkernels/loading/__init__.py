"""Model loading: Hugging Face checkpoint directories (safetensors), GGUF files, random-weight presets, and the
embedded SmolLM2 GGUF. `load_model(spec)` takes any of them; errors for bad input are FileNotFoundError or
ValueError with a message meant for the user."""

from pathlib import Path

import torch

from .gguf import load_gguf
from .hf import load_hf_dir
from .presets import PRESETS, init_random, load_preset, preset_config
from .smollm2 import NAME as SMOLLM2, smollm2_gguf_path

__all__ = [
    "PRESETS", "SMOLLM2", "init_random", "load_gguf", "load_hf_dir", "load_model", "load_preset", "load_tokenizer",
    "preset_config", "resolve", "smollm2_gguf_path",
]


def default_dtype(device) -> torch.dtype:
    """bfloat16 on GPUs; float32 on the CPU (where the ops run their fp32-accumulating references)."""
    return torch.float32 if torch.device(device or "cpu").type == "cpu" else torch.bfloat16


def resolve(spec=None) -> tuple:
    """(kind, location) for a model spec: ("gguf", file), ("hf", dir) or ("preset", name).
    None or "smollm2" is the embedded SmolLM2-135M-Instruct."""
    if spec is None or spec == SMOLLM2:
        return "gguf", smollm2_gguf_path()
    if isinstance(spec, str) and spec in PRESETS:
        return "preset", spec
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; give a GGUF file or a Hugging Face checkpoint "
                             f"directory")
        return "gguf", path
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        what = f"{len(ggufs)} .gguf files (name one)" if ggufs else "no config.json and no .gguf file"
        raise ValueError(f"{path} has {what}")
    raise FileNotFoundError(f"model not found: {spec!r} is neither an existing path (a Hugging Face checkpoint "
                            f"directory or a .gguf file) nor a preset ({', '.join(PRESETS)}, {SMOLLM2})")


def load_model(spec=None, *, dtype=None, device=None, max_model_len=None, seed: int = 0):
    """A LlamaForCausalLM from a checkpoint directory, a GGUF file, a preset name (random weights) or None /
    "smollm2" (the embedded GGUF). dtype default: float32 on the CPU, bfloat16 elsewhere."""
    kind, where = resolve(spec)
    dtype = dtype or default_dtype(device)
    if kind == "preset":
        return load_preset(where, dtype=dtype, device=device, seed=seed, max_model_len=max_model_len)
    if kind == "hf":
        return load_hf_dir(where, dtype=dtype, device=device, max_model_len=max_model_len)
    return load_gguf(where, dtype=dtype, device=device, max_model_len=max_model_len)


def load_tokenizer(spec=None):
    """The transformers tokenizer (with its chat template) of a checkpoint or GGUF; None for presets."""
    kind, where = resolve(spec)
    if kind == "preset":
        return None
    from transformers import AutoTokenizer

    try:
        if kind == "hf":
            return AutoTokenizer.from_pretrained(str(where))
        return AutoTokenizer.from_pretrained(str(where.parent), gguf_file=where.name)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load the tokenizer of {where}: {e}") from None
