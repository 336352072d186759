"""The attention benchmark suite on CPU: a dry run through the Triton interpreter (fp16, tiny shapes, a fake
timer), so every row builder, peer, check and the report rendering run without a GPU."""

import pytest
import torch

import lmkernels.bench as bench
from lmkernels.bench import harness, report, timing
from lmkernels.bench.suites import attention as suite
from lmkernels.ops.attention import kernels


@pytest.fixture
def dry_run(monkeypatch):
    monkeypatch.setattr(harness, "DEVICE", "cpu")
    calls = []

    def fake_time(fn, sets, **kw):
        timing.cycling(fn, sets)()
        calls.append(len(sets))
        if kw.get("info") is not None:
            kw["info"]["method"] = "fake"
        return 0.5 + 0.01 * len(calls)

    monkeypatch.setattr(timing, "time_ms", fake_time)
    monkeypatch.setattr(suite, "HQ", 4)
    monkeypatch.setattr(suite, "HK", 2)
    monkeypatch.setattr(suite, "HEAD_DIM", 64)
    monkeypatch.setattr(suite, "QUICK_PREFILL", ((40, 64, True, 4, 2), (33, 64, False, 2, 1),
                                                 (24, 192, True, 2, 2, 128)))
    monkeypatch.setattr(suite, "QUICK_MLA_PREFILL", ((2, 20, 70),))
    monkeypatch.setattr(suite, "QUICK_DECODE", (("B=1 ctx=70", (70,), 16, False),
                                                ("skewed", (90, 5, 0), 16, False),
                                                ("B=2 fp8", (33, 33), 16, True)))
    small = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    monkeypatch.setattr(kernels, "prefill_config", lambda dqk, dv, m: dict(small))
    monkeypatch.setattr(kernels, "decode_config", lambda dqk, dv, rows, **kw: dict(small, BLOCK_M=16, PROGRAMS_PER_SM=1))
    return calls


def test_attention_suite_registered():
    assert bench.load_suite("attention") is suite


def test_attention_suite_dry_run(dry_run):
    result = {"suite": "attention", "ceilings": {"copy_gbps": 3000.0}, "rows": []}
    saves = []
    suite.run(result, quick=True, save=lambda: saves.append(len(result["rows"])))
    rows = result["rows"]
    assert len(rows) == 7 and saves == [1, 2, 3, 4, 5, 6, 7]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ours"]["err"] < 1e-2 and row["ours"]["gbps"] > 0
        assert row["unit"] in ("TFLOP/s", "GB/s") and row["note"]
    prefill = [r for r in rows if r["op"] == "attention_prefill"]
    decode = [r for r in rows if r["op"] == "attention_decode"]
    mla_layer = [r for r in rows if r["op"] == "mla_prefill"]
    assert len(prefill) == 3 and len(decode) == 3 and len(mla_layer) == 1
    mla = prefill[2]  # MLA prefill's attention: q/k dim 192, v dim 128
    assert mla["label"] == "B=1 S=24 2/2 heads d192/128 causal" and mla["flops"] == 2 * 24 * 24 * 2 * 320 // 2
    for row in prefill:
        assert row["ours"]["tflops"] > 0 and row["pct_copy"] is None
        assert [p["name"] for p in row["peers"]] == ["sdpa-math"] and row["peers"][0]["err"] < 1e-2
        assert row["ratio"] is not None
    layer = mla_layer[0]  # a whole MLA prefill layer: 20 new tokens after 70 cached ones (two pages of 64)
    assert layer["label"] == "B=1 2 heads, 20 new tokens after 70 cached"
    assert layer["flops"] == 2 * 2 * 320 * (20 * 70 + 20 * 20 // 2) + 2 * 90 * 512 * 2 * 256
    assert [p["name"] for p in layer["peers"]] == ["torch + sdpa-math"] and layer["peers"][0]["err"] < 1e-2
    assert layer["own_plan"]["err"] < 1e-2 and layer["ours"]["tflops"] > 0 and layer["ratio"] is not None
    assert layer["goal"] == {} and suite.progress_line(layer).endswith("no goal")
    b1, skewed, fp8 = decode
    assert b1["peers"] and b1["peers"][0]["err"] < 1e-2
    assert set(b1["goal"]) == {"peer"} and b1["goal"]["peer"] is not None  # B=1: ≥ 2x SDPA only
    assert not skewed["peers"] and skewed["goal"]["copy"] is not None and skewed["pct_copy"] > 0
    assert not fp8["peers"] and fp8["bytes"] == 66 * 2 * 64 * 2  # fp8: one byte per element
    md = report.render_markdown([{**result, "gpu": "dry", "versions": {}}])
    assert "attention_decode" in md and "TFLOP/s" in md
