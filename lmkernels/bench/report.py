"""Results: JSON per GPU and suite, a compact stdout table, and BENCHMARKS.md regenerated from all JSON.

Layout: <results_dir>/<gpu-slug>/<suite>.json, e.g. benchmarks/results/nvidia-h100-80gb-hbm3/norm.json.
Everything here except `environment()` is pure Python on dicts, so it runs (and is tested) on CPU;
regenerate the markdown after fetching JSON with
    python -c "from lmkernels.bench.report import write_markdown; write_markdown('benchmarks/results', 'BENCHMARKS.md')"
"""

import datetime
import json
import math
import os
import platform
import re
import sys
from pathlib import Path

from .harness import COPY_GOAL, GOAL_KINDS, PEER_GOAL, goal_text

SUITE_ORDER = ("norm", "activation", "rope", "attention", "kda", "mla", "engine", "sweep")
SCHEMA = 1


def gpu_slug(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-gpu"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def environment() -> dict:
    """GPU name and versions (call on the GPU machine)."""
    import torch
    import triton

    from .. import __version__
    from .peers import dist_version, liger_version

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": torch.cuda.get_device_name(),
        "sm_count": props.multi_processor_count,
        "l2_bytes": int(getattr(props, "L2_cache_size", 0) or 0),
        "memory_bytes": int(props.total_memory),
        "versions": {
            "torch": torch.__version__, "triton": triton.__version__, "liger_kernel": liger_version(),
            "flashinfer": dist_version("flashinfer-python"),
            "cuda": torch.version.cuda, "python": platform.python_version(), "lmkernels": __version__,
        },
    }


def new_result(suite: str, env: dict, ceilings: dict, quick: bool) -> dict:
    return {
        "schema": SCHEMA, "suite": suite, "gpu": env["gpu"], "gpu_slug": gpu_slug(env["gpu"]),
        "date": utc_now(), "quick": quick, "complete": False, **{k: v for k, v in env.items() if k != "gpu"},
        "ceilings": ceilings, "goals": {"copy_fraction": COPY_GOAL, "peer_ratio": PEER_GOAL,
                                        "peer_kinds": list(GOAL_KINDS)},
        "rows": [],
    }


def json_path(result: dict, results_dir) -> Path:
    return Path(results_dir) / (result.get("gpu_slug") or gpu_slug(result["gpu"])) / f"{result['suite']}.json"


def _clean(obj):
    """JSON without NaN/inf (written as null)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(result: dict, results_dir) -> Path:
    path = json_path(result, results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(result), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_results(results_dir) -> list:
    """Every <results_dir>/*/*.json that looks like a result, ordered by GPU then suite."""
    out = []
    for path in sorted(Path(results_dir).glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"skipping {path}: {e}", file=sys.stderr)
            continue
        if not isinstance(data, dict) or "suite" not in data or "gpu" not in data:
            print(f"skipping {path}: not a benchmark result", file=sys.stderr)
            continue
        out.append(data)
    return sorted(out, key=lambda r: (r.get("gpu", ""), _suite_key(r.get("suite", ""))))


def _suite_key(name):
    return (SUITE_ORDER.index(name), "") if name in SUITE_ORDER else (len(SUITE_ORDER), name)


# ----------------------------------------------------------------------------------------------------
# formatting


def _num(v, fmt="{:.0f}", none="–"):
    return none if v is None else fmt.format(v)


def peer_names(rows) -> list:
    names = []
    for row in rows:
        for p in row.get("peers", []):
            if p["name"] not in names:
                names.append(p["name"])
    return names


# a row's figure per implementation: the key holding it, from the row's unit (bandwidth rows have no unit)
UNIT_KEYS = {"GB/s": "gbps", "TFLOP/s": "tflops", "tokens/s": "tokens_per_s"}


def value_key(row) -> str:
    return UNIT_KEYS.get(row.get("unit", "GB/s"), "gbps")


def peer_cell(row, name) -> str:
    key = value_key(row)
    for p in row.get("peers", []):
        if p["name"] == name:
            if key in p:
                return f"{p[key]:.0f}"
            if "wrong" in p:
                return "wrong"
            return "n/a"
    return "—"


def ours_cell(row) -> str:
    if row.get("status") != "ok":
        return "FAILED"
    return f"{row['ours'][value_key(row)]:.0f}"


def ratio_cell(row) -> str:
    return "–" if row.get("ratio") is None else f"{row['ratio']:.3f}x"


def best_cell(row) -> str:
    if row.get("best_peer") is None:
        return "–"
    best = next((p for p in row.get("peers", []) if p["name"] == row["best_peer"]), {})
    value = best.get(value_key(row), row.get("best_peer_gbps"))
    return f"{row['best_peer']} {value:.0f}"


def read_cell(row) -> str:
    """The row's read ceiling in its goal's measure (% of copy or of GEMM): what no op over its bytes passes."""
    r = row.get("read_ceiling") or {}
    pct = r.get("pct_gemm", r.get("pct_copy"))
    return "–" if pct is None else f"{pct:.1f}% of {'GEMM' if 'pct_gemm' in r else 'copy'}"


def table_rows(result: dict):
    """(header, rows of cells) for the main table of a suite result; figures in each row's unit."""
    rows = result.get("rows", [])
    names = peer_names(rows)
    units = any("unit" in row for row in rows)
    gemm = any(row.get("pct_gemm") is not None for row in rows)  # suites with compute-bound rows (mla)
    read = any(row.get("read_ceiling") for row in rows)  # suites that measure a read of each row's bytes (mla)
    header = ["op", "shape", "dtype", *(["unit"] if units else []), "ours" if units else "ours GB/s", "% of copy",
              *(["% of GEMM"] if gemm else []), *(["read-only bound"] if read else []), *names,
              "best peer" if units else "best (compile/Liger)", "ours / best", "goal"]
    body = []
    for row in rows:
        body.append([
            row.get("op", "?"), row.get("label", "?"), row.get("dtype", ""),
            *([row.get("unit", "GB/s")] if units else []), ours_cell(row),
            _num(row.get("pct_copy"), "{:.1f}%"),
            *([_num(row.get("pct_gemm") if row.get("unit") == "TFLOP/s" else None, "{:.1f}%")] if gemm else []),
            *([read_cell(row)] if read else []),
            *[peer_cell(row, n) for n in names],
            best_cell(row), ratio_cell(row), goal_text(row),
        ])
    return header, body


def _md_table(header, body) -> list:
    esc = [[str(c).replace("|", "\\|") for c in r] for r in [header] + body]
    lines = ["| " + " | ".join(esc[0]) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return lines


def _text_table(header, body) -> list:
    widths = [max(len(str(r[i])) for r in [header] + body) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in body]


def ceilings_text(result: dict) -> str:
    c = result.get("ceilings") or {}
    parts = []
    if c.get("copy_gbps"):
        parts.append(f"device-to-device copy {c['copy_gbps']:.0f} GB/s")
    if c.get("gemm_bf16_tflops"):
        n = c.get("gemm_shape", [8192])[0]
        parts.append(f"bf16 GEMM {n}³ {c['gemm_bf16_tflops']:.0f} TFLOP/s")
    return ", ".join(parts) if parts else "not measured"


def run_text(result: dict) -> str:
    v = result.get("versions") or {}
    bits = [f"run {result.get('date', '?')}", f"torch {v.get('torch', '?')}", f"triton {v.get('triton', '?')}",
            f"liger-kernel {v.get('liger_kernel') or 'not installed'}"]
    if v.get("flashinfer"):
        bits.append(f"flashinfer {v['flashinfer']}")
    if result.get("quick"):
        bits.append("quick mode")
    if not result.get("complete", True):
        bits.append("INCOMPLETE (the run stopped early)")
    return ", ".join(bits)


def footnotes(result: dict) -> list:
    """Peer notes, missing/wrong peers and failures, deduplicated, as text lines."""
    rows = result.get("rows", [])

    def grouped(pairs):  # (key, op) -> "key" lines with the ops that share it
        ops = {}
        for key, op in pairs:
            ops.setdefault(key, [])
            if op not in ops[key]:
                ops[key].append(op)
        return ops

    lines = []
    notes = grouped(((p["name"], p["note"]), row.get("op", "?")) for row in rows for p in row.get("peers", [])
                    if p.get("note"))
    lines += [f"{name} ({', '.join(ops)}): {note}" for (name, note), ops in notes.items()]
    row_notes = grouped((row["note"], row.get("op", "?")) for row in rows if row.get("note"))
    lines += [f"{', '.join(ops)}: {note}" for note, ops in row_notes.items()]
    for row in rows:
        if row.get("status") != "ok":
            lines.append(f"{row.get('op', '?')} {row.get('label', '?')}: ours FAILED — {row.get('failure')}")
    missing = grouped(((p["name"], p["missing"]), row.get("op", "?")) for row in rows for p in row.get("peers", [])
                      if "missing" in p)
    lines += [f"{name} n/a ({', '.join(ops)}): {why}" for (name, why), ops in missing.items()]
    for row in rows:
        for p in row.get("peers", []):
            if "missing" not in p and "wrong" in p:
                lines.append(f"{row.get('op', '?')} {row.get('label', '?')}: {p['name']} excluded, {p['wrong']}")
    eager = grouped(((impl["name"], impl["timing"]), row.get("op", "?")) for row in rows
                    for impl in [row.get("ours", {}), *row.get("peers", [])]
                    if str(impl.get("timing", "cuda_graph")).startswith("eager"))
    lines += [f"{name} ({', '.join(ops)}): timed call by call, with host launch cost — {how}"
              for (name, how), ops in eager.items()]
    if result.get("error"):
        lines.append(f"suite error: {result['error']}")
    return lines


def spread_text(result: dict) -> str | None:
    spreads = [r["ours"]["spread_pct"] for r in result.get("rows", [])
               if r.get("status") == "ok" and r.get("ours", {}).get("spread_pct") is not None]
    if not spreads:
        return None
    return (f"ours timed twice per row: median spread {sorted(spreads)[len(spreads) // 2]:.1f}%, "
            f"max {max(spreads):.1f}% (differences below that are noise)")


# ----------------------------------------------------------------------------------------------------
# sweeps


def _sweep_tables(sweep: dict) -> list:
    """(title, header, body) for each sweep kind in a sweep result."""
    out = []
    norm = sweep.get("norm")
    if norm:
        body = []
        for s in norm.get("shapes", []):
            keys = ("rows", "block_n", "num_warps")
            body.append([f"{s['tokens']}x{s['hidden']}", "yes" if s["residual"] else "no",
                         *_sweep_cells(s, keys)])
        out.append((f"norm launch configurations ({norm.get('kernel')}, RMSNorm, bf16; config = ROWS/BLOCK_N/warps)",
                    ["shape", "residual", "heuristic", "GB/s", "best", "GB/s", "% of copy", "best / heuristic",
                     "runner-up configs"], body))
    act = sweep.get("activation")
    if act:
        body = []
        for s in act.get("shapes", []):
            body.append([s["act"], f"{s['tokens']}x{s['d']}", *_sweep_cells(s, ("block", "num_warps"))])
        out.append((f"activation launch configurations ({act.get('kernel')}, bf16; config = BLOCK/warps)",
                    ["act", "tokens x d", "heuristic", "GB/s", "best", "GB/s", "% of copy", "best / heuristic",
                     "runner-up configs"], body))
    return out


def _sweep_cells(s, keys):
    cfg = lambda e: "/".join(str(e[k]) for k in keys)  # noqa: E731
    h, b = s.get("heuristic"), s.get("best")
    runners = ", ".join(f"{cfg(e)} {e['gbps']:.0f}" for e in (s.get("top") or [])[1:4])
    return [
        cfg(h) if h else "did not run", _num(h and h["gbps"]),
        cfg(b) if b else "–", _num(b and b["gbps"]), _num(b and b.get("pct_copy"), "{:.1f}%"),
        _num(s.get("best_over_heuristic"), "{:.3f}x"), runners or "–",
    ]


# ----------------------------------------------------------------------------------------------------
# outputs


def goal_summary(result: dict) -> str:
    """The suite's own goal text (suites with other units and peers set result["goal_text"]), else the default."""
    return result.get("goal_text") or (f"≥ {COPY_GOAL:.0%} of copy and ≥ {PEER_GOAL:.1f}x the best of "
                                       "torch.compile / Liger")


def print_table(result: dict, file=None) -> None:
    file = file or sys.stdout
    print(f"\n== {result['suite']} on {result['gpu']} — {run_text(result)}", file=file)
    print(f"   ceilings: {ceilings_text(result)}; goal: {goal_summary(result)}", file=file)
    if result.get("rows"):
        header, body = table_rows(result)
        for line in _text_table(header, body):
            print(line, file=file)
    for title, header, body in _sweep_tables(result.get("sweep") or {}):
        print(f"-- {title}", file=file)
        for line in _text_table(header, body):
            print(line, file=file)
    spread = spread_text(result)
    if spread:
        print(f"   {spread}", file=file)
    for line in footnotes(result):
        if "n/a" in line or "FAILED" in line or "excluded" in line or "error" in line:
            print(f"   ! {line}", file=file)
    file.flush()


def render_markdown(results: list, results_dir: str = "benchmarks/results") -> str:
    """BENCHMARKS.md from loaded results (deterministic: no timestamps of its own)."""
    lines = [
        "# Benchmarks",
        "",
        f"<!-- Generated by `lmkernels bench` from {results_dir}/<gpu>/<suite>.json. Do not edit by hand. -->",
        f"Generated by `lmkernels bench` from the JSON files under `{results_dir}/`; do not edit this file by hand "
        "(rerun the benchmarks, or regenerate it with `python -c \"from lmkernels.bench.report import "
        f"write_markdown; write_markdown('{results_dir}', 'BENCHMARKS.md')\"`).",
        "",
        "Figures are GB/s (unless a row names another unit) with bytes counted once per input read and output "
        "written (the same count for "
        "every implementation of a row, so GB/s ratios are inverse time ratios); timings are "
        "`triton.testing.do_bench` medians of CUDA-graph replays (GPU time, no Python launch cost; every "
        "implementation alike) with inputs rotated through sets larger than L2; runs since 2026-11-23T19:20Z put "
        "at least 4 calls in each graph, so the write-back of the dirty lines that do_bench's L2 flush leaves is "
        "spread over them instead of charged to one call (benchmarks/NOTES.md, session f); runs since "
        "2026-11-29T13:57Z (the H200 mla suite) put enough calls in each graph to span ≥ 0.5 ms of GPU time (up "
        "to 64 calls), so that a replay's own cost (its launch, its first call with no call before it to overlap, its last call's tail; "
        "~13 µs on the H200) is a few % of a short call's figure, not a quarter of it (NOTES, issue 6, session aj). "
        f"Goal per row: ours ≥ {COPY_GOAL:.0%} of the device-to-device copy bandwidth measured in the same run, "
        f"and ≥ {PEER_GOAL:.1f}x the best of torch.compile and Liger Kernel (eager peers are shown for "
        "reference). \"n/a\": the peer could not run here (reason below the table); \"wrong\": its output "
        "failed the correctness check, so it was not timed; \"—\": not a peer of that row. Suites with other "
        "goals (attention, kda, mla, engine) state them under their heading.",
    ]
    if not results:
        lines += ["", "No results yet: run `lmkernels bench <suite>` on a CUDA GPU."]
    by_gpu = {}
    for r in results:
        by_gpu.setdefault(r.get("gpu", "unknown GPU"), []).append(r)
    for gpu, runs in by_gpu.items():
        lines += ["", f"## {gpu}"]
        for r in runs:
            lines += ["", f"### {r.get('suite', '?')}", "", f"{run_text(r)}.  ", f"Ceilings measured in this run: "
                      f"{ceilings_text(r)}."]
            if r.get("goal_text"):
                lines += [f"Goals: {r['goal_text']}."]
            if r.get("rows"):
                header, body = table_rows(r)
                lines += [""] + _md_table(header, body)
            for title, header, body in _sweep_tables(r.get("sweep") or {}):
                lines += ["", f"{title}:", ""] + _md_table(header, body)
            notes = footnotes(r)
            spread = spread_text(r)
            if notes or spread:
                lines += [""] + ([f"- {spread}"] if spread else []) + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_markdown(results_dir="benchmarks/results", markdown_path="BENCHMARKS.md") -> Path:
    """Regenerate `markdown_path` from every JSON result under `results_dir` (runs on CPU)."""
    text = render_markdown(load_results(results_dir), str(results_dir).rstrip("/"))
    path = Path(markdown_path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
