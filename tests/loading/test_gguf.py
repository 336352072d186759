"""GGUF loading: a tiny Llama written as a GGUF the way llama.cpp writes it (q/k rows permuted, every supported
quantization), loaded by us and compared with Hugging Face transformers holding the same (dequantized) weights."""

import numpy as np
import pytest
import torch

from lmkernels.loading import load_gguf, load_model
from lmkernels.loading.gguf import hf_name
from lmkernels.models import greedy_generate, prefill_logits

from .conftest import rel_err

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

CFG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=512,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)

# llama.cpp name → quantization; every type the loader promises, on q and k too (permuted rows)
QTYPES = {
    "token_embd.weight": Q.F16, "output.weight": Q.Q6_K,
    "blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.Q4_1,
    "blk.0.attn_output.weight": Q.BF16, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q6_K,
    "blk.0.ffn_down.weight": Q.Q8_0,
    "blk.1.attn_q.weight": Q.Q4_K, "blk.1.attn_k.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.F16,
    "blk.1.attn_output.weight": Q.Q4_0, "blk.1.ffn_gate.weight": Q.Q4_1, "blk.1.ffn_up.weight": Q.BF16,
    "blk.1.ffn_down.weight": Q.F32,
}
HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf):
    base, kind = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[rest]}.{kind}"
    return f"{HF_TO_GGUF[base]}.{kind}"


def llamacpp_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute, as written there."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(rows, cols, qtype, rng):
    """Random K-quant blocks with sane fp16 super-block scales (gguf can dequantize but not quantize K types)."""
    block_bytes = {Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
    data = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin lead the block
        data[..., 0:2] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
        data[..., 2:4] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    else:  # Q6_K: d ends the block
        data[..., 208:210] = np.frombuffer(np.float16(0.0002).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write_llama_gguf(path, arch="llama", seed=0):
    """A GGUF of a random tiny Llama; returns the HF state dict whose weights equal what the file holds."""
    rng = np.random.default_rng(seed)
    heads, kv = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    config = transformers.LlamaConfig(**CFG)
    hf = transformers.LlamaForCausalLM(config)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(CFG["num_hidden_layers"])
    w.add_context_length(CFG["max_position_embeddings"])
    w.add_embedding_length(CFG["hidden_size"])
    w.add_feed_forward_length(CFG["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(CFG["rms_norm_eps"])
    w.add_vocab_size(CFG["vocab_size"])
    state = {}
    for name, p in hf.state_dict().items():
        g = gguf_name(name)
        shape = tuple(p.shape)
        if len(shape) == 1:
            x = (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(g, x)
            state[name] = torch.from_numpy(x)
            continue
        n_head = heads if ".attn_q." in g else kv if ".attn_k." in g else None
        qtype = QTYPES[g]
        if qtype in (Q.Q4_K, Q.Q6_K):
            data = random_k_blocks(*shape, qtype, rng)
        else:
            x = (rng.standard_normal(shape) * shape[1] ** -0.5).astype(np.float32)
            if n_head:
                x = llamacpp_permute(x, n_head)
            data = x.astype(np.float16) if qtype == Q.F16 else x if qtype == Q.F32 else gguf.quants.quantize(x, qtype)
        if data.dtype == np.uint8:
            w.add_tensor(g, data, raw_dtype=qtype)
        else:
            w.add_tensor(g, data)
        stored = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(shape)
        if n_head:  # the file holds permuted rows: HF's weight is the inverse permutation of them
            idx = llamacpp_permute(np.arange(shape[0]), n_head)
            unpermuted = np.empty_like(stored)
            unpermuted[idx] = stored
            stored = unpermuted
        state[name] = torch.from_numpy(stored)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf.load_state_dict(state)
    return hf.eval(), state


def test_tensor_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.0.ffn_gate_exps.weight") is None


def test_gguf_all_quant_types_match_hf(tmp_path, reference_ops):
    path = tmp_path / "tiny.gguf"
    hf, state = write_llama_gguf(path)
    ours = load_model(path, dtype=torch.float32)  # a .gguf path goes to the GGUF loader
    c = ours.config
    assert (c.model_type, c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == ("llama", 4, 2, 64, 10000.0)
    assert not c.tie_word_embeddings and c.max_position_embeddings == 512

    # weights land exactly where HF has them: q/k unpermuted, fused slices in order
    qkv = ours.layers[1].self_attn.qkv_proj.weight
    torch.testing.assert_close(qkv[:256], state["model.layers.1.self_attn.q_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(qkv[256:384], state["model.layers.1.self_attn.k_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(ours.layers[0].mlp.gate_up_proj.weight[512:], state["model.layers.0.mlp.up_proj.weight"],
                               rtol=0, atol=0)

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 512, (24,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
        gen = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 24, dtype=torch.long),
                          max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert rel_err(prefill_logits(ours, [prompt])[0], ref) < 1e-4
    assert greedy_generate(ours, [prompt], 8) == [gen[0, 24:].tolist()]


def test_gguf_qwen_rows_are_not_unpermuted(tmp_path):
    """Only llama files carry llama.cpp's q/k permutation; a qwen2 file's rows load as they are."""
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, val in (("block_count", 1), ("context_length", 64), ("embedding_length", 128),
                     ("feed_forward_length", 256)):
        getattr(w, f"add_{key}")(val)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (64, 128), "output_norm.weight": (128,), "blk.0.attn_norm.weight": (128,),
              "blk.0.ffn_norm.weight": (128,), "blk.0.attn_q.weight": (128, 128), "blk.0.attn_q.bias": (128,),
              "blk.0.attn_k.weight": (64, 128), "blk.0.attn_k.bias": (64,), "blk.0.attn_v.weight": (64, 128),
              "blk.0.attn_v.bias": (64,), "blk.0.attn_output.weight": (128, 128),
              "blk.0.ffn_gate.weight": (256, 128), "blk.0.ffn_up.weight": (256, 128), "blk.0.ffn_down.weight": (128, 256)}
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    for n, a in arrays.items():
        w.add_tensor(n, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = load_gguf(path)
    c = model.config
    assert c.model_type == "qwen2" and c.qkv_bias and c.tie_word_embeddings and c.vocab_size == 64
    attn = model.layers[0].self_attn
    torch.testing.assert_close(attn.qkv_proj.weight[:128], torch.from_numpy(arrays["blk.0.attn_q.weight"]))
    torch.testing.assert_close(attn.qkv_proj.bias[128:192], torch.from_numpy(arrays["blk.0.attn_k.bias"]))


def test_rope_freqs_factors_reproduce_llama3_scaling():
    """Llama 3.1 GGUFs carry llama3 rope scaling as a rope_freqs tensor (convert_hf_to_gguf.py: a divisor per
    frequency); the cache built from it equals the one from HF's rope_parameters."""
    import math

    from lmkernels.models import ModelConfig
    from lmkernels.models.llama import rope_cache

    cfg = ModelConfig.from_hf({**CFG, "model_type": "llama", "max_position_embeddings": 4096, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}})
    factor, low, high, old = 8.0, 1.0, 4.0, 1024
    factors = []
    for j in range(cfg.head_dim // 2):  # as convert_hf_to_gguf.py computes them
        wavelen = 2 * math.pi / 500000.0 ** (-2 * j / cfg.head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    gguf_cfg = ModelConfig.from_hf({**CFG, "model_type": "llama", "max_position_embeddings": 4096,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    gguf_cfg.rope_freq_factors = factors
    torch.testing.assert_close(rope_cache(gguf_cfg, 4096), rope_cache(cfg, 4096), rtol=0, atol=1e-6)
