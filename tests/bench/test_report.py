"""The benchmark harness on CPU: byte counts, row summaries, JSON and BENCHMARKS.md generation, the
launch-config filters, `main` without a GPU, and a dry run of the suites through the Triton interpreter
(fake timer, tiny shapes) so every case builder, peer and check is exercised without a GPU."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import lmkernels.bench as bench
from lmkernels.bench import counts, harness, report, sweep, timing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------- counts


def test_norm_bytes():
    # 16384 x 4096 bf16: x read + y written, plus the weight
    assert counts.norm_bytes(16384, 4096, 2) == 2 * 16384 * 4096 * 2 + 4096 * 2
    # residual: x, residual read; y, r written
    assert counts.norm_bytes(16384, 4096, 2, residual=True) == 4 * 16384 * 4096 * 2 + 4096 * 2
    # layer norm: weight and bias; fp32 params
    assert counts.norm_bytes(8, 16, 2, bias=True, param_elem=4) == 2 * 8 * 16 * 2 + 2 * 16 * 4
    assert counts.norm_bytes(8, 16, 4, weight=False) == 2 * 8 * 16 * 4


def test_gated_and_rope_bytes():
    assert counts.gated_bytes(8192, 14336, 2) == 8192 * (2 * 14336 + 14336) * 2
    t, hq, hk, d = 8192, 32, 8, 128
    qk = 2 * t * (hq + hk) * d * 2  # read and written
    assert counts.rope_bytes(t, hq, hk, d, 2) == qk + t * d * 4 + t * 8
    assert counts.rope_bytes(t, hq, hk, d, 2, rotary_dim=64, pos_elem=4) == qk + t * 64 * 4 + t * 4


def test_rates():
    assert counts.gbps(3_000_000, 1.0) == pytest.approx(3.0)
    assert counts.copy_bytes(1 << 30) == 2 << 30
    assert counts.tflops(counts.gemm_flops(8192, 8192, 8192), 1.0) == pytest.approx(2 * 8192**3 / 1e9)


def test_rotation_count():
    assert timing.rotation_count(1 << 30, 50 << 20) == 1
    assert timing.rotation_count(32 << 20, 50 << 20) == 8  # 256 MiB / 32 MiB
    assert timing.rotation_count(32 << 20, 60 << 20) == 8  # 4 x 60 MB < 256 MiB
    assert timing.rotation_count(1 << 20, 50 << 20) == timing.MAX_SETS
    assert timing.rotation_count(100 << 20, 100 << 20) == 4  # 4 x L2 when L2 is large


def test_calls_per_graph():
    """A timed graph holds whole cycles of the input sets, at least MIN_CALLS_PER_GRAPH calls, and enough to span
    MIN_GRAPH_MS of GPU time (no more than MAX_CALLS_PER_GRAPH counted for that)."""
    assert timing.calls_per_graph(1, float("inf")) == timing.MIN_CALLS_PER_GRAPH == 4
    assert timing.calls_per_graph(2, 1.0) == 4 and timing.calls_per_graph(16, 1.0) == 16
    assert timing.calls_per_graph(2, 0.045) == 12  # 0.5 ms / 45 µs
    assert timing.calls_per_graph(3, 0.045) == 12 and timing.calls_per_graph(5, 0.045) == 15  # whole cycles
    assert timing.calls_per_graph(1, 1e-4) == timing.MAX_CALLS_PER_GRAPH == 64
    assert timing.calls_per_graph(48, 1e-4) == 96  # every set, in whole cycles


def test_cycling_rotates_sets():
    seen = []
    call = timing.cycling(lambda a, b: seen.append((a, b)), [(1, 2), (3, 4), (5, 6)])
    for _ in range(4):
        call()
    assert seen == [(1, 2), (3, 4), (5, 6), (1, 2)]
    with pytest.raises(ValueError):
        timing.cycling(lambda: None, [])


@pytest.mark.parametrize("n,programs,block", [(1000, 3, 64), (64, 5, 64), (4097, 2, 256)])
def test_read_kernel_sums_every_value(n, programs, block):
    """The read ceiling's kernel reads every value once (partials NaN-poisoned first; sizes not multiples of a
    block, more programs than blocks)."""
    from lmkernels.bench import ceilings

    x = torch.randn(n, dtype=torch.bfloat16)
    part = ceilings.read_partials(x, programs, block, out=torch.full((programs,), float("nan")))
    assert part.shape == (programs,) and not torch.isnan(part).any()
    torch.testing.assert_close(part.double().sum(), x.double().sum(), rtol=1e-5, atol=1e-3)


# ---------------------------------------------------------------------------------------------- rows


def test_rel_err():
    ref = torch.randn(1000)
    assert harness.rel_err(ref.clone(), ref) == 0.0
    out = ref + 0.01 * torch.randn(1000)
    want = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert harness.rel_err([out, ref], [ref, ref], chunk=7) == pytest.approx(
        math.sqrt((out.double() - ref.double()).pow(2).sum().item() / (2 * ref.double().pow(2).sum().item())))
    assert harness.rel_err(out, ref, chunk=33) == pytest.approx(want)
    bad = ref.clone()
    bad[500] = float("nan")
    assert harness.rel_err(bad, ref) == math.inf
    assert harness.rel_err(ref[:10], ref) == math.inf  # shape mismatch


def _peer(name, kind, ms=None, **kw):
    p = {"name": name, "kind": kind, "note": f"{name} note"}
    if ms is not None:
        p["ms"] = ms
    p.update(kw)
    return p


def sample_row(op="rms_norm", ours_ms=1.0, compile_ms=1.1, liger_ms=0.95, nbytes=3_000_000_000, copy=3200.0):
    peers = [_peer("torch eager", "eager", 0.5), _peer("torch.compile", "compile", compile_ms),
             _peer("liger", "liger", liger_ms) if liger_ms else _peer("liger", "liger", missing="ImportError: no")]
    ours = {"name": "ours", "kind": "ours", "ms": ours_ms, "err": 3e-3, "ms_first": ours_ms, "ms_repeat": ours_ms * 1.01}
    return harness.make_row(op, "16384x4096", [16384, 4096], "bfloat16", nbytes, ours, peers, copy, note="n")


def test_make_row_ratio_and_goals():
    row = sample_row()
    assert row["status"] == "ok"
    assert row["ours"]["gbps"] == pytest.approx(3000.0)
    assert row["pct_copy"] == pytest.approx(100 * 3000 / 3200)
    # the eager peer is faster but does not count for the goal
    assert row["best_peer"] == "liger"
    assert row["ratio"] == pytest.approx(0.95)
    assert row["goal"] == {"copy": True, "peer": False}
    assert harness.goal_text(row) == "miss: peer"
    assert row["ours"]["spread_pct"] == pytest.approx(1.0)

    fast = sample_row(ours_ms=0.9)
    assert harness.goal_text(fast) == "met"
    slow = sample_row(ours_ms=2.0)
    assert harness.goal_text(slow) == "miss: copy, peer"
    no_liger = sample_row(liger_ms=None)
    assert no_liger["best_peer"] == "torch.compile" and no_liger["ratio"] == pytest.approx(1.1)


def test_make_row_failed_and_no_peer():
    ours = {"name": "ours", "kind": "ours", "err": 0.5, "wrong": "rel err 5.00e-01 > 1e-02"}
    row = harness.make_row("rms_norm", "8x8", [8, 8], "bfloat16", 256, ours, [_peer("torch.compile", "compile", 1.0)],
                           3000.0)
    assert row["status"] == "FAILED" and "rel err" in row["failure"]
    assert row["ratio"] is None and row["pct_copy"] is None
    assert harness.goal_text(row) == "FAILED"
    alone = harness.make_row("x", "1", [1], "bfloat16", 10**9, {"name": "ours", "kind": "ours", "ms": 1.0}, [], 1000.0)
    assert harness.goal_text(alone) == "met (peer n/a)"


# ---------------------------------------------------------------------------------------------- report


def sample_result(gpu="NVIDIA H100 80GB HBM3", suite="norm", rows=None):
    return {
        "schema": 1, "suite": suite, "gpu": gpu, "gpu_slug": report.gpu_slug(gpu), "date": "2026-11-22T10:00:00Z",
        "quick": False, "complete": True,
        "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0", "liger_kernel": "0.8.5"},
        "ceilings": {"copy_gbps": 3010.4, "gemm_bf16_tflops": 784.2, "gemm_shape": [8192, 8192, 8192]},
        "rows": rows if rows is not None else [sample_row(), sample_row("rms_norm+residual", liger_ms=None)],
    }


def test_gpu_slug():
    assert report.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert report.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert report.gpu_slug("  ") == "unknown-gpu"


def test_json_and_markdown(tmp_path):
    results = tmp_path / "results"
    p1 = report.write_json(sample_result(), results)
    assert p1 == results / "nvidia-h100-80gb-hbm3" / "norm.json"
    bad_row = sample_row("silu_and_mul")
    bad_row["ours"]["ms"] = float("nan")  # non-finite numbers become null in JSON
    report.write_json(sample_result("NVIDIA H200", "activation", [bad_row]), results)
    sweep_result = sample_result("NVIDIA H200", "sweep", rows=[])
    sweep_result["sweep"] = {"norm": {"kernel": "k", "shapes": [{
        "tokens": 16384, "hidden": 4096, "residual": False,
        "heuristic": {"rows": 2, "block_n": 4096, "num_warps": 8, "gbps": 2800.0},
        "best": {"rows": 4, "block_n": 4096, "num_warps": 16, "gbps": 2950.0, "pct_copy": 98.0},
        "top": [{"rows": 4, "block_n": 4096, "num_warps": 16, "gbps": 2950.0},
                {"rows": 2, "block_n": 4096, "num_warps": 8, "gbps": 2800.0}],
        "best_over_heuristic": 2950 / 2800, "failed": []}]}}
    report.write_json(sweep_result, results)
    (results / "nvidia-h200" / "junk.json").write_text("{not json")
    (results / "README.json").write_text("{}")  # not under a GPU folder: ignored

    loaded = json.loads(p1.read_text())
    assert loaded["rows"][0]["ours"]["gbps"] == pytest.approx(3000.0)
    assert json.loads((results / "nvidia-h200" / "activation.json").read_text())["rows"][0]["ours"]["ms"] is None

    md_path = report.write_markdown(results, tmp_path / "BENCHMARKS.md")
    md = md_path.read_text()
    assert "Generated by `lmkernels bench`" in md and "do not edit" in md
    h100, h200 = md.index("## NVIDIA H100 80GB HBM3"), md.index("## NVIDIA H200")
    assert h100 < h200  # GPUs sorted; suites in their fixed order within a GPU
    assert md.index("### activation") < md.index("### sweep")
    assert "device-to-device copy 3010 GB/s" in md and "bf16 GEMM 8192³ 784 TFLOP/s" in md
    assert "torch 2.11.0+cu130, triton 3.6.0, liger-kernel 0.8.5" in md
    assert "| rms_norm | 16384x4096 | bfloat16 | 3000 | 93.8% |" in md
    assert "| liger 3158 | 0.950x | miss: peer |" in md
    assert "liger n/a (rms_norm+residual): ImportError: no" in md
    assert "| 16384x4096 | no | 2/4096/8 | 2800 | 4/4096/16 | 2950 | 98.0% | 1.054x |" in md
    assert "junk" not in md
    # deterministic: regenerating gives the same bytes
    assert report.render_markdown(report.load_results(results), str(results)) == report.render_markdown(
        report.load_results(results), str(results))


def test_markdown_without_results(tmp_path):
    md = report.write_markdown(tmp_path / "none", tmp_path / "out" / "B.md").read_text()
    assert "No results yet" in md


def test_print_table(capsys):
    report.print_table(sample_result())
    out = capsys.readouterr().out
    assert "ours GB/s" in out and "rms_norm+residual" in out and "miss: peer" in out
    assert "! liger n/a (rms_norm+residual): ImportError: no" in out


# ---------------------------------------------------------------------------------------------- sweep configs


def test_norm_configs():
    cfgs = sweep.norm_configs(2048, heuristic=(4, 2048, 16))
    assert (4, 2048, 16) in cfgs and (1, 2048, 1) in cfgs
    assert all(r * b <= sweep.MAX_PROGRAM_ELEMS for r, b, _ in cfgs)
    assert (8, 2048, 1) not in cfgs  # 512 fp32 values per thread
    big = sweep.norm_configs(7168, heuristic=(1, 8192, 16))
    assert {b for _, b, _ in big} == {8192} and {r for r, _, _ in big} == {1, 2}
    assert (1, 8192, 1) not in big
    assert sweep.norm_configs(8192, heuristic=(16, 8192, 16))[-1] == (16, 8192, 16)  # heuristic always kept


def test_act_configs():
    cfgs = sweep.act_configs(14336, heuristic=(2048, 8))
    assert len(cfgs) == len(set(cfgs))
    assert (512, 16) in cfgs and (4096, 2) in cfgs
    assert all(b <= 4096 for b, _ in cfgs)
    assert all(b <= 128 for b, _ in sweep.act_configs(100))


# ---------------------------------------------------------------------------------------------- main


def test_resolve_suites():
    everything = ["norm", "activation", "rope", "gemv", "attention", "kda", "mla", "engine"]
    assert bench.resolve_suites(["all"]) == everything
    assert bench.resolve_suites(["rope", "all", "sweep"]) == ["rope", *everything[:2], *everything[3:], "sweep"]
    with pytest.raises(ValueError, match="unknown benchmark suite 'nope'"):
        bench.resolve_suites(["nope"])
    assert set(bench.SUITES) == {*everything, "sweep"}
    for name in ("norm", "activation", "rope", "gemv", "attention", "sweep"):  # kda, mla, engine: added with their issues
        assert callable(getattr(bench.load_suite(name), "run", None))


def test_main_without_cuda(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["norm"], results_dir=str(tmp_path / "r"), markdown_path=str(tmp_path / "B.md")) == 2
    err = capsys.readouterr().err
    assert "lmkernels bench needs a CUDA GPU" in err
    assert not (tmp_path / "B.md").exists() and not (tmp_path / "r").exists()
    assert bench.main(["nope"]) == 2
    assert "unknown benchmark suite" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_main_without_cuda_imports_no_kernels():
    code = ("import sys, lmkernels.bench as b; rc = b.main(['all']); "
            "print(rc, sorted(m for m in sys.modules if m.startswith('lmkernels') and m.endswith('.kernels')))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    assert "lmkernels bench needs a CUDA GPU" in out.stderr


# ---------------------------------------------------------------------------------------------- dry run


@pytest.fixture
def cpu_dry_run(monkeypatch):
    """The suites on CPU: ops through the Triton interpreter (conftest turns it on), torch.compile as the
    identity (inductor's CPU compile is slow and not what is measured), a fake timer."""
    from lmkernels.bench.suites import activation, norm, rope

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    calls = []

    def fake_time(fn, sets, **kw):
        call = timing.cycling(fn, sets)
        call()
        calls.append(len(sets))
        return 0.5 + 0.01 * len(calls)

    monkeypatch.setattr(timing, "time_ms", fake_time)
    monkeypatch.setattr(norm, "QUICK", ((5, 64), (3, 80)))
    monkeypatch.setattr(norm, "GELU_SHAPES", ((4, 48),))
    monkeypatch.setattr(activation, "QUICK", ((3, 40),))
    monkeypatch.setattr(rope, "TOKENS", 6)
    monkeypatch.setattr(rope, "MAX_POSITION", 64)
    return calls


@pytest.mark.parametrize("suite", ["norm", "activation", "rope"])
def test_suite_dry_run(cpu_dry_run, suite):
    result = {"suite": suite, "ceilings": {"copy_gbps": 3000.0}, "rows": []}
    saves = []
    bench.load_suite(suite).run(result, quick=True, save=lambda: saves.append(len(result["rows"])))
    rows = result["rows"]
    assert rows and saves == list(range(1, len(rows) + 1))
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ours"]["err"] < 1e-2
        names = [p["name"] for p in row["peers"]]
        assert "torch eager" in names and "torch.compile" in names and any(n.startswith("liger") for n in names)
        for p in row["peers"]:
            # every peer ran and matched the reference, or says why not (Liger is not installed here,
            # or runs into interpreter limits)
            assert ("gbps" in p and p["err"] < 1e-2) or p["kind"] == "liger", p
        assert row["best_peer"] is not None and row["ratio"] is not None
    assert {r["op"] for r in rows} >= {"norm": {"rms_norm", "rms_norm+residual", "layer_norm", "layer_norm_gelu(tanh)"},
                                       "activation": {"silu_and_mul", "gelu_and_mul(tanh)"},
                                       "rope": {"apply_rotary(neox)"}}[suite]
    md = report.render_markdown([{**result, "gpu": "dry", "versions": {}}])
    assert "| ours GB/s |" in md


def test_sweep_dry_run(cpu_dry_run):
    norm = sweep.sweep_norm(hidden=(64,), tokens=5, copy_gbps=3000.0, log=lambda *_: None)
    (plain, res) = norm["shapes"]
    for s in (plain, res):
        assert not s["failed"], s["failed"]
        assert s["heuristic"] is not None and s["best"]["gbps"] >= s["heuristic"]["gbps"]
        assert len(s["configs"]) == len(sweep.norm_configs(64, s["heuristic"] and
                                                           (s["heuristic"]["rows"], 64, s["heuristic"]["num_warps"])))
    act = sweep.sweep_activation(shapes=((3, 40),), acts=("silu",), log=lambda *_: None)
    assert act["shapes"][0]["best"] is not None and not act["shapes"][0]["failed"]


def test_run_rows_keeps_going_after_a_failing_row(capsys):
    from lmkernels.bench import harness

    def broken():
        raise RuntimeError("boom")

    result, saves = {"rows": []}, []
    builders = [lambda: {"op": "x", "label": "a", "status": "ok"}, broken, lambda: {"op": "x", "label": "c", "status": "ok"}]
    harness.run_rows(builders, result, lambda row: f"row {row['label']} {row['status']}", "x",
                     save=lambda: saves.append(len(result["rows"])))
    assert [r["status"] for r in result["rows"]] == ["ok", "FAILED", "ok"]
    assert "boom" in result["rows"][1]["failure"] and saves == [1, 2, 3]
    assert "row ? FAILED" in capsys.readouterr().out
