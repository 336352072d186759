"""The gemv benchmark suite on CPU: a dry run through the Triton interpreter (tiny shapes, a fake timer, no
torch.compile), so the cases, their checks and the row summaries run without a GPU."""

import lmkernels.bench as bench
from lmkernels.bench import harness, peers, report, timing
from lmkernels.bench.harness import Impl
from lmkernels.bench.suites import gemv as suite


def test_dry_run(monkeypatch):
    monkeypatch.setattr(harness, "DEVICE", "cpu")

    def fake_time(fn, sets, **kw):
        timing.cycling(fn, sets)()
        return 0.5

    monkeypatch.setattr(timing, "time_ms", fake_time)
    monkeypatch.setattr(peers, "compiled", lambda fn, **kw: Impl("torch.compile", "compile", missing="skipped"))
    monkeypatch.setattr(suite, "SHAPES", {"qkv": (48, 64, dict(norm=True)), "o": (40, 48, dict(residual=True)),
                                          "gate|up": (24, 64, dict(norm=True, gated=True))})
    result = report.new_result("gemv", {"gpu": "cpu", "versions": {}}, {"copy_gbps": 1.0}, quick=False)
    suite.run(result)
    rows = result["rows"]
    assert len(rows) == 3 * len(suite.ROWS)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ours"]["err"] < 1e-2 and "err" in row["peers"][0]  # ours right; the unfused chain checked too
    assert "gemv" in bench.SUITES and "gemv" in bench.ALL
