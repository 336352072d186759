"""The issue-6 GPU run in one process: correctness at real sizes (gpu_tune.checks), a short A/B of decode
launch configurations (the winners are printed and used for the suite; decode_config's defaults are then set
to them in the code), then the "mla" benchmark suite. `python -m lmkernels.ops.mla.gpu_final OUT_DIR`."""

import json
import math
import os
import sys
import time

import torch

from lmkernels.bench import timing
from lmkernels.ops.mla import gpu_tune, kernels

T0 = time.time()
SCALE = 192 ** -0.5


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def _time(batch, ctx, heads, n_new, cfg):
    cfg = dict(cfg)
    per_sm = cfg.pop("PROGRAMS_PER_SM")
    min_keys = cfg.pop("MIN_KEYS", kernels.MIN_KEYS_PER_SPLIT)
    nbytes = batch * ctx * 1152
    n_sets = timing.rotation_count(nbytes, timing.l2_bytes())
    sets = []
    for _ in range(n_sets):
        q_nope, q_pe, cache, _, tables, lens = gpu_tune.setup([ctx] * batch, heads, n_new)
        sets.append((q_nope, q_pe, cache, tables, lens))
    mb = -(-heads * n_new // cfg["BLOCK_M"])
    splits = kernels.decode_num_splits(batch, mb, ctx, kernels.sm_count(sets[0][0].device), per_sm, min_keys)
    fn = lambda qn, qp, c, t, l: kernels.mla_decode(qn, qp, c, None, t, l, SCALE, splits, ctx, config=cfg)  # noqa
    ms = timing.time_ms(fn, sets)
    del sets
    torch.cuda.empty_cache()
    return ms, splits


def ab(name, shapes, candidates):
    """Geometric mean of time ratios against the first candidate (the current default); returns the best."""
    table = {}
    for i, cfg in enumerate(candidates):
        ratios = []
        for shape in shapes:
            try:
                ms, splits = _time(*shape, cfg)
            except Exception as e:  # noqa: BLE001
                log(f"  {name} cand {i} {cfg} {shape}: {type(e).__name__} {str(e)[:80]}")
                ratios = None
                break
            b, s, h, q = shape
            flops, nbytes = b * q * h * s * 2176, b * s * 1152 + b * q * h * 2176
            log(f"  {name} cand {i} {shape}: {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s, "
                f"{flops / ms / 1e9:.1f} TFLOP/s, {splits} splits")
            table.setdefault(shape, []).append(ms)
            ratios.append(ms / table[shape][0])
        if ratios is not None:
            cfg["_score"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    ok = [c for c in candidates if "_score" in c]
    best = min(ok, key=lambda c: c["_score"])
    log(f"{name}: best {best} (scores {[round(c.get('_score', float('nan')), 3) for c in candidates]})")
    return {k: v for k, v in best.items() if k != "_score"}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    gpu_tune.OUT["copy"] = 0.0
    gpu_tune.checks()
    log("checks " + ("all ok" if all(c["ok"] for c in gpu_tune.OUT["checks"]) else "FAILED"))
    d16, d32, d64 = (kernels.decode_config(r) for r in (16, 32, 128))
    mem = ab("16 rows", [(32, 8192, 16, 1), (128, 8192, 16, 1), (1, 32768, 16, 1)], [
        dict(d16),
        dict(d16, num_stages=2),
        dict(d16, KEYS_MAJOR=False, num_stages=2),
        dict(d16, BLOCK_N=16),
        dict(d16, PROGRAMS_PER_SM=2),
        dict(d16, MIN_KEYS=512)])
    comp = ab("128 rows", [(32, 8192, 128, 1), (128, 1024, 128, 1)], [
        dict(d64),
        dict(d64, BLOCK_N=32, num_stages=2),
        dict(d64, num_stages=2),
        dict(d64, BLOCK_N=32, num_stages=3, PROGRAMS_PER_SM=1)])
    mtp = ab("32 rows", [(32, 8192, 16, 2)], [dict(d32), dict(d16, BLOCK_M=16), dict(d32, num_warps=4, num_stages=2)])
    chosen = {"16": mem, "32": mtp, "64": comp}
    log(f"chosen configs {chosen}")
    original = kernels.decode_config

    def tuned(rows, fp8=False):
        if fp8:
            return original(rows, fp8)
        bm = max(16, min(64, 1 << max(0, (rows - 1).bit_length())))
        return dict(chosen[str(bm)])

    kernels.decode_config = tuned
    with open(os.path.join(out, "mla_final_tune.json"), "w") as f:
        json.dump({"checks": gpu_tune.OUT["checks"], "chosen": chosen}, f, indent=1)
    import lmkernels.bench as bench

    rc = bench.main(["mla"], results_dir=os.path.join(out, "results"), markdown_path=os.path.join(out, "BENCHMARKS.md"))
    log(f"suite rc {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
