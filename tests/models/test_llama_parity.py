"""Tiny random Llama-family models against Hugging Face transformers with the same weights, loaded through our
Hugging Face checkpoint loader (save_pretrained → load_hf_dir)."""

import pytest
import torch

from lmkernels.loading import load_hf_dir, load_preset, preset_config
from lmkernels.models import ModelConfig, greedy_generate, prefill_logits

from .conftest import rel_err

transformers = pytest.importorskip("transformers")

CASES = {
    "qwen3": ("tiny-qwen3", {}),                       # per-head q/k RMSNorm, tied embeddings
    "llama3-rope": ("tiny-llama", {}),                 # llama3 rope scaling, untied
    "qwen2-bias": ("tiny-qwen2", {}),                  # q/k/v bias, MHA-ish GQA (2:1)
    "mistral-window": ("tiny-llama", {                 # sliding window shorter than the prompts
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@torch.no_grad()
def _randomize(hf_model, seed=0):
    """Weights that make a sensitive test: O(1) activations, norm weights away from 1, visible biases."""
    g = torch.Generator().manual_seed(seed)
    for name, p in hf_model.named_parameters():
        if name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        elif p.dim() == 1:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)


def _hf_model(cfg_dict):
    cfg = dict(cfg_dict)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(model)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_matches_hf(case, tmp_path, reference_ops):
    preset, overrides = CASES[case]
    cfg = {**preset_config(preset), **overrides}
    hf = _hf_model(cfg)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")  # sharded, with model.safetensors.index.json
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_hf_dir(tmp_path, dtype=torch.float32)
    assert ours.config.model_type == cfg["model_type"]
    assert ours.config == ModelConfig.from_hf(hf.config)  # a PretrainedConfig reads like its config.json

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg["vocab_size"], (n,), generator=g).tolist() for n in (13, 40, 1)]
    logits = prefill_logits(ours, prompts)  # one packed varlen prefill of all three
    for p, row in zip(prompts, logits):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        assert rel_err(row, ref) < 1e-4

    # 32 greedy tokens through the paged cache, batched, against HF generate one prompt at a time
    new = greedy_generate(ours, prompts, 32)
    for p, toks in zip(prompts, new):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert toks == gen[0, len(p):].tolist()

    # chunked prefill (append prefill over the cached prefix) gives the same tokens
    assert greedy_generate(ours, prompts, 32, prefill_chunk=7, page_size=4) == new


def test_presets_have_the_real_shapes():
    counts = {"llama3-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360, "smollm2-135m": 134_515_008}
    for name, n in counts.items():
        model = load_preset(name, device="meta")
        assert sum(p.numel() for p in model.parameters()) == n, name


def test_random_preset_activations_are_sane(reference_ops):
    model = load_preset("smollm2-135m", dtype=torch.float32, num_hidden_layers=4)
    logits = prefill_logits(model, [list(range(5, 40))])
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 10


def test_legacy_config_keys():
    """config.json of transformers < 5: rope_theta and rope_scaling at the top level."""
    old = {k: v for k, v in preset_config("llama3.1-8b").items() if k != "rope_parameters"}
    old.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    new = ModelConfig.from_hf(preset_config("llama3.1-8b"))
    assert ModelConfig.from_hf(old) == new
    assert new.rope_theta == 500000.0 and new.rope_scaling["rope_type"] == "llama3"
    mistral = ModelConfig.from_hf(preset_config("mistral-7b"))
    assert mistral.sliding_windows == [4096] * 32 and not mistral.qkv_bias
    qwen2 = ModelConfig.from_hf(preset_config("qwen2.5-7b"))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.head_dim == 128
