"""One benchmark case: check every implementation against the fp32 reference, then time the ones that
are right on the same rotated input sets, and summarise the row (GB/s, % of copy, ratio to the best peer).

Goal (the issue's): ours ≥ 90% of the measured copy bandwidth and ≥ 1.0x the best of the peers whose
kind counts (torch.compile, Liger Kernel). Eager peers are shown for reference only.
"""

import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .counts import gbps

DEVICE = "cuda"  # a CPU dry run (tests) sets "cpu": ops then run through the Triton interpreter
COPY_GOAL = 0.90
PEER_GOAL = 1.0
GOAL_KINDS = ("compile", "liger")  # the peers the goal is measured against
TOL_BF16 = 1e-2


def log_line(*args) -> None:
    """print, flushed: progress survives a run that is killed at its time limit."""
    print(*args, flush=True)


def device() -> str:
    return DEVICE


def synchronize() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


@dataclass
class Impl:
    """One implementation of a case. `fn(*inputs)` is exactly what gets timed; `prepare(*inputs)` turns a
    case's input set into this implementation's arguments outside the timing (a different layout, say);
    `canon(out)` turns its output into a tuple of tensors shaped like the reference's."""

    name: str
    kind: str  # "ours" | "eager" | "compile" | "liger"
    fn: Optional[Callable] = None
    prepare: Optional[Callable] = None
    canon: Optional[Callable] = None
    note: str = ""
    missing: Optional[str] = None  # why it is unavailable (import or compile error)


@dataclass
class Case:
    op: str
    label: str  # shape as shown in the tables
    shape: list
    dtype: str
    nbytes: int
    make_inputs: Callable[[], tuple]  # one fresh random input set (CUDA tensors)
    reference: Callable[..., Any]  # fp32 outputs, as a tuple matching canon(out)
    ours: Impl
    peers: list = field(default_factory=list)
    tol: float = TOL_BF16
    note: str = ""


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def rel_err(outs, refs, chunk: int = 1 << 24) -> float:
    """‖out − ref‖ / ‖ref‖ over all output tensors, accumulated in float64 chunk by chunk (the big rows
    hold 10^8 elements: no full float64 copies). Non-finite output or a shape mismatch gives inf."""
    import torch

    outs, refs = as_tuple(outs), as_tuple(refs)
    if len(outs) != len(refs):
        return math.inf
    num = den = 0.0
    for o, r in zip(outs, refs):
        if tuple(o.shape) != tuple(r.shape):
            return math.inf
        o, r = o.reshape(-1), r.reshape(-1)
        for i in range(0, o.numel(), chunk):
            oc, rc = o[i:i + chunk].double(), r[i:i + chunk].double()
            if not torch.isfinite(oc).all():
                return math.inf
            num += (oc - rc).pow(2).sum().item()
            den += rc.pow(2).sum().item()
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def clone_inputs(inputs) -> tuple:
    import torch

    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)


def short_error(e: BaseException, limit: int = 160) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    line = text[0] if text else type(e).__name__
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _check(impl: Impl, inputs, ref, tol):
    """(error, failure text or None): run impl once on a clone of `inputs` and compare with `ref`."""
    args = clone_inputs(inputs)
    if impl.prepare is not None:
        args = impl.prepare(*args)
    out = impl.fn(*args)
    synchronize()
    outs = impl.canon(out) if impl.canon is not None else as_tuple(out)
    err = rel_err(outs, ref)
    return err, (None if err <= tol else f"rel err {err:.2e} > {tol:.0e}")


def run_case(case: Case, copy_gbps: float, *, l2: int, time_fn=None, reset=None, log=log_line) -> dict:
    """Check, then time, every implementation of `case`; returns the row (never raises for a peer)."""
    import torch

    from . import timing

    time_fn = time_fn or timing.time_ms
    if reset is not None:
        reset()  # e.g. torch._dynamo.reset(): each case compiles its own static-shape graph
    impls = [case.ours] + list(case.peers)
    results = {id(i): {"name": i.name, "kind": i.kind, "note": i.note} for i in impls}
    for impl in impls:
        if impl.missing is not None:
            results[id(impl)]["missing"] = impl.missing

    inputs = case.make_inputs()
    ref = as_tuple(case.reference(*inputs))
    for impl in impls:
        res = results[id(impl)]
        if "missing" in res:
            continue
        try:
            res["err"], wrong = _check(impl, inputs, ref, case.tol)
            if wrong:
                res["wrong"] = wrong
        except Exception as e:  # a peer that fails to compile or run is reported, never fatal
            res["missing"] = short_error(e)
            if impl.kind == "ours":
                log(traceback.format_exc())
    del ref
    torch.cuda.empty_cache()

    n_sets = timing.rotation_count(case.nbytes, l2)
    sets = [inputs] + [case.make_inputs() for _ in range(n_sets - 1)]
    timed = [i for i in impls if "missing" not in results[id(i)] and "wrong" not in results[id(i)]]
    prepared = {}
    for impl in timed:
        try:
            prepared[id(impl)] = [impl.prepare(*s) for s in sets] if impl.prepare is not None else sets
        except Exception as e:
            results[id(impl)]["missing"] = f"preparing inputs failed: {short_error(e)}"
    # Two rounds, every implementation once per round, each keeping its better median: a transient
    # disturbance (host load, clocks) in one round then costs nobody the comparison. The spread of
    # our two rounds is recorded, so it says what difference is noise.
    for round_ in range(2):
        for impl in timed:
            res = results[id(impl)]
            if id(impl) not in prepared or "missing" in res:
                continue
            try:
                info = {}
                ms = time_fn(impl.fn, prepared[id(impl)], info=info)
                res["timing"] = info.get("method")
            except Exception as e:
                res["missing"] = f"timing failed: {short_error(e)}"
                continue
            res["ms"] = min(ms, res.get("ms", ms))
            if impl is case.ours:
                res["ms_first" if round_ == 0 else "ms_repeat"] = ms
    del prepared
    ours = results[id(case.ours)]
    del sets, inputs
    torch.cuda.empty_cache()
    row = summarize(case, ours, [results[id(p)] for p in case.peers], copy_gbps)
    row["sets"] = n_sets
    return row


def summarize(case: Case, ours: dict, peers: list, copy_gbps: Optional[float]) -> dict:
    """The row dict from the per-implementation results (pure: no torch). Each result may hold ms, err,
    wrong (text), missing (text), ms_first and ms_repeat (ours: the two timing rounds)."""
    return make_row(case.op, case.label, case.shape, case.dtype, case.nbytes, ours, peers, copy_gbps,
                    note=case.note)


def make_row(op, label, shape, dtype, nbytes, ours, peers, copy_gbps, *, note="") -> dict:
    def speed(res):
        res = dict(res)
        if "ms" in res:
            res["gbps"] = gbps(nbytes, res["ms"])
        return res

    ours, peers = speed(ours), [speed(p) for p in peers]
    failure = ours.get("wrong") or ours.get("missing")
    if failure is None and "gbps" not in ours:
        failure = "not timed"
    row = {
        "op": op, "label": label, "shape": list(shape), "dtype": dtype, "bytes": nbytes, "note": note,
        "status": "FAILED" if failure else "ok", "failure": failure,
        "ours": ours, "peers": peers,
        "pct_copy": None, "best_peer": None, "best_peer_gbps": None, "ratio": None,
        "goal": {"copy": None, "peer": None},
    }
    if "ms_first" in ours and "ms_repeat" in ours:  # the two timing rounds of ours
        row["ours"]["spread_pct"] = 100 * abs(ours["ms_repeat"] - ours["ms_first"]) / ours["ms"]
    candidates = [p for p in peers if p["kind"] in GOAL_KINDS and "gbps" in p]
    if candidates:
        best = max(candidates, key=lambda p: p["gbps"])
        row["best_peer"], row["best_peer_gbps"] = best["name"], best["gbps"]
    if failure:
        return row
    if copy_gbps:
        row["pct_copy"] = 100 * ours["gbps"] / copy_gbps
        row["goal"]["copy"] = row["pct_copy"] >= 100 * COPY_GOAL
    if row["best_peer_gbps"]:
        row["ratio"] = ours["gbps"] / row["best_peer_gbps"]
        row["goal"]["peer"] = row["ratio"] >= PEER_GOAL
    return row


def goal_text(row: dict) -> str:
    """"met", "FAILED", or "miss: copy, peer" (a goal that cannot be judged, e.g. no peer ran, is "n/a")."""
    if row.get("status") != "ok":
        return "FAILED"
    goal = row.get("goal") or {}  # kind (copy, peer, gemm, ...) → True / False / None (not judged)
    if not goal:  # a row reported for information, with no goal
        return "–"
    misses = [k for k, v in goal.items() if v is False]
    unknown = [k for k, v in goal.items() if v is None]
    if misses:
        return "miss: " + ", ".join(misses)
    if unknown:
        return "met (" + ", ".join(f"{k} n/a" for k in unknown) + ")"
    return "met"


def check_then_time(name, kind, fn, sets, check, nbytes, flops=None, tol=TOL_BF16) -> dict:
    """For suites with their own row builders: check fn's output on the first input set (check → rel err),
    then time it over all sets; the result dict (never raises) carries err, ms, timing method, gbps and
    tflops when flops is given, or "wrong"/"missing" with the reason."""
    from . import timing
    from .counts import tflops as tflops_of

    res = {"name": name, "kind": kind}
    try:
        err = check(fn(*sets[0]))
        res["err"] = err
        if not err <= tol:
            res["wrong"] = f"rel err {err:.2e} > {tol:.0e}"
            return res
        info = {}
        res["ms"] = timing.time_ms(fn, sets, info=info)
        res["timing"] = info.get("method")
        res["gbps"] = gbps(nbytes, res["ms"])
        if flops:
            res["tflops"] = tflops_of(flops, res["ms"])
    except Exception as e:
        res["missing"] = short_error(e)
        if kind == "ours":
            log_line(traceback.format_exc())
    return res


def unit_row(op, label, shape, nbytes, unit, ours, peers, copy_gbps, goals, note="", *, goal_kinds=None,
             untimed="not timed", **extra) -> dict:
    """A row for suites with their own units and goals (attention, kda, engine). The best peer and the
    ratio use the shared `gbps` figure (bytes counted alike for every implementation, so a time ratio
    whatever the unit); % of copy only for GB/s rows. goals: kind → target (copy: fraction of copy, peer:
    ratio to the best peer); goal_kinds: the goal keys the row carries (default: those of goals)."""
    failure = ours.get("wrong") or ours.get("missing")
    if failure is None and "gbps" not in ours:
        failure = untimed
    timed = [p for p in peers if "gbps" in p]
    best = max(timed, key=lambda p: p["gbps"]) if timed else None
    row = {"op": op, "label": label, "shape": list(shape), "dtype": "bfloat16", "bytes": nbytes, **extra,
           "unit": unit, "note": note, "status": "FAILED" if failure else "ok", "failure": failure,
           "ours": ours, "peers": peers, "pct_copy": None, "best_peer": best and best["name"],
           "best_peer_gbps": best and best["gbps"], "ratio": None,
           "goal": {k: None for k in (goals if goal_kinds is None else goal_kinds)}}
    if failure:
        return row
    if unit == "GB/s" and copy_gbps:
        row["pct_copy"] = 100 * ours["gbps"] / copy_gbps
    if best:
        row["ratio"] = ours["gbps"] / best["gbps"]
    for kind, target in goals.items():
        value = row["ratio"] if kind == "peer" else (row["pct_copy"] / 100 if row["pct_copy"] is not None else None)
        row["goal"][kind] = None if value is None else bool(value >= target)
    return row


def run_rows(builders, result: dict, progress, op: str, save=lambda: None) -> None:
    """For suites with their own row builders (attention, kda, mla, engine): build each row in turn (an
    error becomes a FAILED row and the suite goes on), append it, log progress(row), save, and free the
    allocator's cache before the next row allocates."""
    import torch

    for build in builders:
        try:
            row = build()
        except Exception as e:
            log_line(traceback.format_exc())
            row = {"op": op, "label": "?", "status": "FAILED", "failure": f"error: {short_error(e)}",
                   "ours": {}, "peers": []}
        result["rows"].append(row)
        log_line(progress(row))
        save()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def run_cases(cases, result: dict, *, save=lambda: None, log=log_line, reset=None) -> None:
    """Run `cases` (an iterable of Case, built lazily) into result["rows"], saving after every row. An
    error building or running a case becomes a FAILED row; the suite goes on."""
    import torch

    from .timing import l2_bytes

    l2 = l2_bytes()
    copy = (result.get("ceilings") or {}).get("copy_gbps")
    it = iter(cases)
    while True:
        try:
            case = next(it)
        except StopIteration:
            break
        except Exception as e:
            log(traceback.format_exc())
            result["rows"].append({"op": "?", "label": "?", "status": "FAILED",
                                   "failure": f"building the case: {short_error(e)}", "peers": []})
            save()
            break
        try:
            row = run_case(case, copy, l2=l2, reset=reset, log=log)
        except Exception as e:
            log(traceback.format_exc())
            row = make_row(case.op, case.label, case.shape, case.dtype, case.nbytes,
                           {"name": "ours", "kind": "ours", "missing": f"error: {short_error(e)}"}, [], copy,
                           note=case.note)
            torch.cuda.empty_cache()
        result["rows"].append(row)
        log(progress_line(result.get("suite", ""), row))
        save()


def progress_line(suite: str, row: dict) -> str:
    head = f"[{suite}] {row['op']} {row['label']}:"
    if row["status"] != "ok":
        return f"{head} FAILED ({row['failure']})"
    parts = [f"ours {row['ours']['gbps']:.0f} GB/s"]
    if row["pct_copy"] is not None:
        parts.append(f"{row['pct_copy']:.1f}% of copy")
    for p in row["peers"]:
        if "gbps" in p:
            parts.append(f"{p['name']} {p['gbps']:.0f}")
        else:
            parts.append(f"{p['name']} n/a")
    if row["ratio"] is not None:
        parts.append(f"{row['ratio']:.3f}x {row['best_peer']}")
    return f"{head} " + ", ".join(parts) + f" [{goal_text(row)}]"
