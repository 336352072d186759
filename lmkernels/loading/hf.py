"""Hugging Face checkpoint directories: config.json + model.safetensors or sharded *.safetensors with
model.safetensors.index.json. Tensors stream one at a time into the (fused) parameters."""

import json
import os
from pathlib import Path

import torch

from ..models.config import ModelConfig
from ..models.llama import LlamaForCausalLM

INDEX = "model.safetensors.index.json"


def read_config(path) -> dict:
    path = Path(path)
    f = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"model directory not found: {path}")
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory (a Hugging Face checkpoint is a directory with config.json)")
    if not f.is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face checkpoint directory")
    try:
        with open(f, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{f} must hold a JSON object")
    return cfg


def safetensors_files(path) -> list:
    path = Path(path)
    index = path / INDEX
    if index.is_file():
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e})") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} names {f.name}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def iter_safetensors(files, dtype=None):
    """(name, tensor) pairs from safetensors files, one tensor in memory at a time."""
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(os.fspath(f), framework="pt") as fh:
                for name in fh.keys():
                    t = fh.get_tensor(name)
                    yield name, (t if dtype is None else t.to(dtype))
        except SafetensorError as e:
            raise ValueError(f"{f} is not a readable safetensors file: {e}") from None


def _dtype_of(config: ModelConfig, dtype):
    if dtype is not None:
        return dtype
    return {"float32": torch.float32, "float16": torch.float16}.get(config.torch_dtype or "", torch.bfloat16)


def load_hf_dir(path, *, dtype=None, device=None, max_model_len=None) -> LlamaForCausalLM:
    """A LlamaForCausalLM from a Hugging Face checkpoint directory (dtype default: the config's, else bf16)."""
    cfg = ModelConfig.from_hf(read_config(path))
    files = safetensors_files(path)
    model = LlamaForCausalLM(cfg, dtype=_dtype_of(cfg, dtype), device=device, max_model_len=max_model_len)
    model.load_hf_weights(iter_safetensors(files))
    return model.eval()
