"""`lmkernels bench`: our kernels against their peers and the measured ceilings, in one process and one run.

    import lmkernels.bench as b
    b.main(["norm", "activation", "rope"])          # or ["all"]; ["sweep"] for launch-config sweeps
    b.main(["norm"], quick=True, results_dir="/tmp/out/results", markdown_path="/tmp/out/BENCHMARKS.md")

Each suite writes <results_dir>/<gpu-slug>/<suite>.json (rewritten after every row, so a run cut short
keeps what it measured), then BENCHMARKS.md is regenerated from all JSON files under results_dir and a
compact table per suite is printed last. Exit code: 0, 1 if a row FAILED its correctness check or a
suite raised, 2 for no CUDA GPU or an unknown suite name.

Modules: ceilings (copy bandwidth, bf16 GEMM), timing (do_bench medians over rotated input sets), peers
(torch eager, torch.compile, Liger), harness (check + time one case, row summary), suites/ (norm,
activation, rope), sweep (launch-configuration sweeps), counts (bytes per op), report (JSON, markdown).
Nothing here imports a Triton kernel until a suite runs on a GPU.
"""

import importlib
import sys
import traceback

# suite name → module (imported when the suite runs); each module has run(result, quick, save)
SUITES = {"norm": ".suites.norm", "activation": ".suites.activation", "rope": ".suites.rope",
          "attention": ".suites.attention", "kda": ".suites.kda", "mla": ".suites.mla", "engine": ".suites.engine",
          "gemv": ".suites.gemv", "sweep": ".sweep"}
ALL = ("norm", "activation", "rope", "gemv", "attention", "kda", "mla", "engine")  # "all"; the sweep is asked for by name


def load_suite(name: str):
    """The module of one benchmark suite."""
    return importlib.import_module(SUITES[name], __name__)

NO_GPU = ("lmkernels bench needs a CUDA GPU; torch.cuda.is_available() is False here. The benchmarks time "
          "the Triton kernels against their peers and the GPU's measured limits, so there is nothing to "
          "measure on a CPU: run `lmkernels check` or `make test` to check correctness instead.")


def resolve_suites(names) -> list:
    """Expand "all", drop duplicates, keep order; ValueError naming unknown suites."""
    if isinstance(names, str):
        names = [names]
    out = []
    for name in names:
        for n in (ALL if name == "all" else (name,)):
            if n not in SUITES:
                raise ValueError(f"unknown benchmark suite {n!r}; choose from {', '.join([*SUITES, 'all'])}")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError(f"no benchmark suite given; choose from {', '.join([*SUITES, 'all'])}")
    return out


def main(suites, results_dir: str = "benchmarks/results", markdown_path: str = "BENCHMARKS.md",
         quick: bool = False) -> int:
    try:
        names = resolve_suites(suites)
    except ValueError as e:
        print(f"lmkernels bench: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2

    from . import ceilings, report

    env = report.environment()
    v = env["versions"]
    print(f"lmkernels bench {' '.join(names)}{' (quick)' if quick else ''} on {env['gpu']}: torch {v['torch']}, "
          f"triton {v['triton']}, liger-kernel {v['liger_kernel'] or 'not installed'}", flush=True)
    status = 0
    results = []
    with torch.no_grad():
        try:
            ceil = ceilings.measure()
        except Exception:  # rows then show no % of copy, but the peers still compare
            traceback.print_exc()
            ceil = {}
        for name in names:
            result = report.new_result(name, env, ceil, quick)
            results.append(result)
            save = lambda result=result: report.write_json(result, results_dir)  # noqa: E731
            try:
                load_suite(name).run(result, quick=quick, save=save)
                result["complete"] = True
            except Exception as e:  # keep the other suites and what this one measured
                traceback.print_exc()
                result["error"] = f"{type(e).__name__}: {e}"
                status = 1
            path = save()
            print(f"wrote {path}", flush=True)
            torch.cuda.empty_cache()
    md = report.write_markdown(results_dir, markdown_path)
    print(f"wrote {md}", flush=True)
    for result in results:
        report.print_table(result)
    if any(row.get("status") != "ok" for r in results for row in r.get("rows", [])):
        status = 1
    return status


__all__ = ["ALL", "SUITES", "load_suite", "main", "resolve_suites"]
