"""The KDA layer against transformers' KimiLinearDeltaAttention (random weights, fp32, Triton interpreter):
prefill, and prefill followed by step-by-step decode."""

import pytest
import torch

from lmkernels.ops.kda.layer import KDACache, KDALayer

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
KimiLinearConfig = pytest.importorskip("transformers").KimiLinearConfig


def hf_layer():
    cfg = KimiLinearConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           linear_attn_config={"head_dim": 64, "num_heads": 2, "short_conv_kernel_size": 4},
                           layer_types=["linear_attention"], rms_norm_eps=1e-6, hidden_act="silu")
    m = kimi.KimiLinearDeltaAttention(cfg, 0).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        m.forget_gate.A_log.copy_(torch.rand_like(m.forget_gate.A_log) * 0.5)
        m.o_norm.weight.copy_(1 + torch.randn_like(m.o_norm.weight) * 0.1)
    return m


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_layer_matches_transformers_prefill_and_decode():
    m = hf_layer()
    layer = KDALayer.from_hf(m)
    x = torch.randn(2, 70, 48)
    with torch.no_grad():
        want = m(x)
        got = layer(x)
        assert rel(got, want) < 1e-4
        # prefill 66 tokens into a cache, then decode the last 4 one at a time
        cache = KDACache.empty(2, layer)
        outs = [layer(x[:, :66], cache)]
        for t in range(66, 70):
            outs.append(layer(x[:, t:t + 1], cache))
    assert rel(torch.cat(outs, 1), want) < 1e-4
