"""The engine benchmark suite on CPU: a dry run on a tiny preset (fp16, the ops' references), so the HF twin
with shared weights, every row builder and the report rendering run without a GPU."""

import pytest
import torch

import lmkernels.bench as bench
from lmkernels.bench import harness, report
from lmkernels.bench.suites import engine as suite

pytest.importorskip("transformers")


@pytest.fixture
def dry_run(monkeypatch):
    monkeypatch.setattr(harness, "DEVICE", "cpu")
    for name, value in dict(CONTEXTS=(20, 33), DECODE_TOKENS=3, HF_DECODE_TOKENS=2, PREFILL=40, BATCH=3,
                            BATCH_CONTEXT=9, BATCH_TOKENS=3, HF_BATCH_TOKENS=2, REPEATS=1).items():
        monkeypatch.setattr(suite, name, value)


def test_engine_suite_registered():
    assert bench.load_suite("engine") is suite


def test_hf_twin_shares_our_weights(dry_run):
    from lmkernels.loading import load_preset

    model = load_preset("tiny-qwen3", dtype=torch.float32, seed=1)
    model.preset_name = "tiny-qwen3"
    hf = suite.hf_twin(model)
    ours = {p.data_ptr() for p in model.parameters()}
    assert all(p.untyped_storage().data_ptr() in ours for p in hf.parameters())  # views, no copies
    q = hf.model.layers[1].self_attn.k_proj.weight
    assert torch.equal(q, model.layers[1].self_attn.qkv_proj.weight[model.config.q_size: model.config.q_size
                                                                   + model.config.kv_size])
    assert suite.weight_bytes_per_token(model) == sum(p.numel() * 4 for p in model.parameters())  # tied


def test_engine_suite_dry_run(dry_run):
    result = {"suite": "engine", "ceilings": {"copy_gbps": 3000.0}, "rows": []}
    saves = []
    suite.run(result, quick=True, save=lambda: saves.append(len(result["rows"])))
    rows = result["rows"]
    assert saves == [1, 2, 3, 4, 5]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ours"]["gbps"] > 0 and row["note"] and row["unit"]
        assert all("gbps" in p for p in row["peers"]), row["peers"]
    d512, d4096, prefill, batch, launches = rows
    assert d512["pct_copy"] > 0 and d512["goal"]["copy"] is not None and d512["goal"]["peer"] is not None
    assert d512["ours_no_cuda_graph"]["tokens_per_s"] > 0
    assert prefill["ours"]["err"] < 1e-2 and prefill["goal"]["peer"] is not None
    assert [p["name"] for p in batch["peers"]] == ["ours, graphs, not pipelined", "ours, no CUDA graph", "HF generate"]
    assert d512["ours_not_pipelined"]["tokens_per_s"] > 0
    assert launches["ours"]["kernels"] > 0 and launches["peers"][0]["kernels"] > 0
    md = report.render_markdown([{**result, "gpu": "dry", "versions": {}}])
    assert "engine_decode" in md and "engine_prefill" in md
