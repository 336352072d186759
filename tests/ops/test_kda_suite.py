"""The KDA benchmark suite on CPU: a dry run through the Triton interpreter (fp16, tiny shapes, a fake timer), so
every row builder, check and the report rendering run without a GPU (fla, a GPU peer, shows as missing)."""

import pytest

import lmkernels.bench as bench
from lmkernels.bench import harness, report, timing
from lmkernels.bench.suites import kda as suite


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
    monkeypatch.setattr(suite, "HEAD", 64)
    monkeypatch.setattr(suite, "DECODE_HEADS", 2)
    monkeypatch.setattr(suite, "QUICK_PREFILL", (("T=70 H=1", 1, (70,), True), ("varlen", 1, (65, 1, 30), False)))
    monkeypatch.setattr(suite, "QUICK_DECODE", (3,))
    return calls


def test_kda_suite_registered():
    assert bench.load_suite("kda") is suite


def test_kda_suite_dry_run(dry_run):
    result = {"suite": "kda", "ceilings": {"copy_gbps": 3000.0}, "rows": []}
    saves = []
    suite.run(result, quick=True, save=lambda: saves.append(len(result["rows"])))
    rows = result["rows"]
    assert len(rows) == 3 and saves == [1, 2, 3]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ours"]["err"] < 1e-2 and row["ours"]["gbps"] > 0 and row["note"]
        assert [p["name"] for p in row["peers"]][0].startswith("fla")
    prefill, decode = rows[:2], rows[2]
    for row in prefill:
        assert row["unit"] == "TFLOP/s" and row["ours"]["tflops"] > 0 and row["ours"]["state_err"] < 1e-2
    assert decode["unit"] == "GB/s" and decode["pct_copy"] > 0
    assert decode["bytes"] == 2 * 3 * 2 * 64 * 64 * 4 + (4 * 3 * 2 * 64 + 3 * 2) * 2
    md = report.render_markdown([{**result, "gpu": "dry", "versions": {}}])
    assert "kda_prefill" in md and "kda_decode" in md


def test_accuracy_check_no_worse():
    assert suite.no_worse(1.6548353407e-3, [1.6548353397e-3, 2e-3])  # equal to six digits (a real H100 row)
    assert not suite.no_worse(1.66e-3, [1.65e-3])
    assert suite.no_worse(1.0e-3, [1.65e-3])
