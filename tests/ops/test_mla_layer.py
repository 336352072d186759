"""DeepSeek-V3 attention layer from lmkernels ops against transformers' DeepseekV3Attention on random weights:
prefill of a ragged batch, decode steps, a two-token (MTP) step; YaRN mscale; with and without a q LoRA.
Ours runs fp16 through the interpreter (bf16 dots are wrong there), transformers fp32."""

import pytest
import torch

from lmkernels.ops.mla import mla_decode_schedule, new_latent_cache
from lmkernels.ops.mla.layer import DeepseekV3MLA

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention, DeepseekV3RotaryEmbedding)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def _hf(q_lora_rank):
    cfg = DeepseekV3Config(hidden_size=96, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                           max_position_embeddings=256, rope_parameters=dict(YARN), rope_interleave=True,
                           num_hidden_layers=1, vocab_size=64, intermediate_size=64, moe_intermediate_size=32,
                           n_routed_experts=4)
    cfg._attn_implementation = "eager"
    attn = DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.05)
        attn.kv_a_layernorm.weight.add_(1.0)
        if attn.q_a_layernorm is not None:
            attn.q_a_layernorm.weight.add_(1.0)
    return cfg, attn, DeepseekV3RotaryEmbedding(cfg)


def _hf_forward(attn, rope, x):
    """x [S, hidden] of one sequence → [S, hidden] (causal, fp32)."""
    s = x.shape[0]
    pos = torch.arange(s)[None]
    cos, sin = rope(x[None], pos)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return attn(x[None], (cos, sin), mask)[0][0]


@pytest.mark.parametrize("q_lora_rank,fp8", [(48, False), (None, False), (48, True)])
def test_layer_matches_transformers(q_lora_rank, fp8):
    """fp8: the latent cache in e4m3 with a scale per 128 values; stated tolerance 5e-2 (3 mantissa bits)."""
    cfg, attn, rope = _hf(q_lora_rank)
    ours = DeepseekV3MLA.from_hf(attn, cfg, dtype=torch.float16)
    assert abs(ours.scale - attn.scaling) < 1e-12  # YaRN mscale² in the softmax scale
    prompts, extra = [13, 6], 4  # then two decode steps of one token and one MTP step of two
    xs = [torch.randn(n + extra, 96) for n in prompts]
    want = [_hf_forward(attn, rope, x) for x in xs]
    page = 16
    cache, scales = new_latent_cache(8, page, dtype=torch.float8_e4m3fn if fp8 else torch.float16)
    tol = 5e-2 if fp8 else 1e-2
    tables = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)

    def slots(b, positions):
        return tables[b, positions // page].long() * page + positions % page

    def check(got, b, positions):
        ref = want[b][positions]
        err = (got.double() - ref.double()).norm() / ref.double().norm()
        assert err < tol, (b, positions.tolist(), float(err))

    # prefill, packed ragged batch
    x = torch.cat([xs[b][:n] for b, n in enumerate(prompts)]).half()
    pos = torch.cat([torch.arange(n) for n in prompts])
    slot = torch.cat([slots(b, torch.arange(n)) for b, n in enumerate(prompts)])
    cu = torch.tensor([0, prompts[0], sum(prompts)], dtype=torch.int32)
    lens = torch.tensor(prompts, dtype=torch.int32)
    out = ours.prefill(x, pos, cu, lens, tables, slot, cache, scales)
    check(out[: prompts[0]], 0, torch.arange(prompts[0]))
    check(out[prompts[0]:], 1, torch.arange(prompts[1]))
    # decode: 1, 1, then 2 tokens per sequence; each step's split schedule made once, as a model's layers share it
    done = list(prompts)
    for n_new in (1, 1, 2):
        positions = torch.stack([torch.arange(d, d + n_new) for d in done])  # [B, Q]
        x = torch.stack([xs[b][positions[b]] for b in range(2)]).half()
        slot = torch.cat([slots(b, positions[b]) for b in range(2)])
        done = [d + n_new for d in done]
        lens = torch.tensor(done, dtype=torch.int32)
        step = mla_decode_schedule(cache, tables, lens, num_heads=4, q_per_seq=n_new, cache_scales=scales)
        out = ours.decode(x, positions, lens, tables, slot, cache, scales, schedule=step)
        for b in range(2):
            check(out[b], b, positions[b])


def test_layer_rejects_other_latent_sizes():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DeepseekV3MLA({"kv_b_proj.weight": torch.zeros(4 * 256, 256)}, num_heads=4, qk_nope_head_dim=128,
                      v_head_dim=128, kv_lora_rank=256)
