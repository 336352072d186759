"""The MLA benchmark suite on CPU: a dry run through the Triton interpreter (fp16, tiny shapes, a fake timer)."""

import pytest

import lmkernels.bench as bench
from lmkernels.bench import harness, report, timing
from lmkernels.bench.suites import mla as suite
from lmkernels.ops.mla import kernels


@pytest.fixture
def dry_run(monkeypatch):
    monkeypatch.setattr(harness, "DEVICE", "cpu")

    def fake_time(fn, sets, **kw):
        timing.cycling(fn, sets)()
        if kw.get("info") is not None:
            kw["info"]["method"] = "fake"
        return 0.5

    monkeypatch.setattr(timing, "time_ms", fake_time)
    monkeypatch.setattr(timing, "rotation_count", lambda *a, **k: 2)
    monkeypatch.setattr(suite, "PAGE", 16)
    monkeypatch.setattr(suite, "QUICK", ((1, 40, 4, 1), (2, 33, 8, 2), (2, 20, 128, 1)))


def test_mla_suite_registered():
    assert bench.load_suite("mla") is suite


def test_mla_suite_dry_run(dry_run):
    result = {"suite": "mla", "ceilings": {"copy_gbps": 3000.0, "gemm_bf16_tflops": 700.0}, "rows": []}
    saves = []
    suite.run(result, quick=True, save=lambda: saves.append(len(result["rows"])))
    rows = result["rows"]
    assert saves == [1, 2, 3]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ours"]["err"] < 1e-2 and row["ours"]["gbps"] > 0 and row["note"]
        assert [p["name"] for p in row["peers"]] == ["sdpa-math"] and row["peers"][0]["err"] < 1e-2
        assert list(row["goal"]) == (["gemm"] if row["unit"] == "TFLOP/s" else ["copy"])
        assert None not in row["goal"].values()
    mem, mtp, compute = rows
    assert mem["unit"] == "GB/s" and mem["pct_copy"] > 0 and mem["bytes"] == 40 * 576 * 2 + 4 * 1088 * 2
    assert compute["unit"] == "TFLOP/s" and compute["pct_gemm"] > 0
    assert compute["flops"] == 2 * 128 * 20 * 2176
    md = report.render_markdown([{**result, "gpu": "dry", "versions": {}}])
    assert "mla_decode" in md
