"""KDA on the GPU: correctness of ours and fla at real sizes against the float64 reference, then timings of launch
configurations (prefill and decode) beside fla, registers/spills of the compiled kernels. Prints a table and
writes JSON to $OUT/kda_selftest.json. `python -m lmkernels.ops.kda.gpu_selftest [--quick]`."""

import json
import os
import sys
import time
import traceback

import torch

from lmkernels.bench import timing
from lmkernels.bench.harness import rel_err
from lmkernels.ops.kda import kda_decode, kda_prefill, kernels, reference

DEV = "cuda"
LB = -5.0
OUT = {"prefill": [], "decode": [], "errors": [], "regs": {}}
# the 32-token configuration (the default for one long sequence over few heads)
BT32 = {"BT": 32, "intra_warps": 4, "BK": 16, "BKW": 64, "BV": 32}


def log(*a):
    print(*a, flush=True)


def inputs(b, t, h, K=128):
    dt = torch.bfloat16
    q, k, v = (torch.randn(b, t, h, K, device=DEV, dtype=dt) for _ in range(3))
    f = (torch.randn(b, t, h, K, device=DEV) * 2 - 3).to(dt)
    beta = torch.randn(b, t, h, device=DEV, dtype=dt)
    a_log = torch.log(torch.empty(h, device=DEV).uniform_(1, 4))
    dtb = torch.randn(h * K, device=DEV) * 0.5
    return q, k, v, f, beta, a_log, dtb


def fla_prefill(q, k, v, f, beta, a_log, dtb, cu=None, cu_cpu=None):
    from fla.ops.kda import chunk_kda

    kw = {} if cu is None else dict(cu_seqlens=cu.long(), cu_seqlens_cpu=cu_cpu.long())
    return chunk_kda(q, k, v, f, beta, A_log=a_log, dt_bias=dtb, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, output_final_state=True, **kw)


def ours_prefill(q, k, v, f, beta, a_log, dtb, cu=None, cu_cpu=None):
    return kda_prefill(q, k, v, f, beta, A_log=a_log, dt_bias=dtb, lower_bound=LB, l2norm_qk=True, beta_sigmoid=True,
                       output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)


def tm(fn, args):
    info = {}
    ms = timing.time_ms(lambda: fn(*args), [()], info=info)
    return ms, info.get("method")


def check_prefill(h, lens, dense):
    b, t = (len(lens), lens[0]) if dense else (1, sum(lens))
    args = inputs(b, t, h)
    cu_cpu = None if dense else torch.tensor([0, *lens]).cumsum(0)
    cu = None if dense else cu_cpu.to(DEV)
    q, k, v, f, beta, a_log, dtb = args
    d = lambda x: x.double()  # noqa: E731
    t0 = time.time()
    wo, ws = reference.kda(d(q), d(k), d(v), d(f), d(beta), cu_seqlens=cu_cpu, A_log=a_log, dt_bias=dtb, lower_bound=LB,
                           l2norm_qk=True, beta_sigmoid=True, chunk=64)
    tref = time.time() - t0
    res = {"h": h, "lens": lens[:3], "dense": dense, "ref_s": tref}
    for name, fn in (("ours", ours_prefill), ("fla", fla_prefill)):
        try:
            o, s = fn(*args, cu, cu_cpu)
            res[name] = (rel_err(o.float(), wo), rel_err(s.float(), ws))
        except Exception as e:  # noqa: BLE001
            res[name] = repr(e)[:200]
    for prec in ("tf32x3", "ieee"):
        kernels.TUNE["prefill"] = {"PREC": prec}
        try:
            o, s = ours_prefill(*args, cu, cu_cpu)
            res["ours_" + prec] = (rel_err(o.float(), wo), rel_err(s.float(), ws))
        except Exception as e:  # noqa: BLE001
            res["ours_" + prec] = repr(e)[:200]
    kernels.TUNE["prefill"] = {"SAFE": 1}
    o, s = ours_prefill(*args, cu, cu_cpu)
    res["ours_safe1"] = (rel_err(o.float(), wo), rel_err(s.float(), ws))
    kernels.TUNE.clear()
    log("CHECK prefill", json.dumps(res))
    OUT["errors"].append(res)


def time_prefill(h, lens, dense, variants):
    b, t = (len(lens), lens[0]) if dense else (1, sum(lens))
    args = inputs(b, t, h)
    cu_cpu = None if dense else torch.tensor([0, *lens]).cumsum(0)
    cu = None if dense else cu_cpu.to(DEV)
    row = {"h": h, "lens": list(lens)[:4], "n": len(lens), "dense": dense}
    try:
        row["fla"] = tm(fla_prefill, (*args, cu, cu_cpu))
    except Exception as e:  # noqa: BLE001
        row["fla"] = repr(e)[:200]
    for name, cfg in variants:
        kernels.TUNE.clear()
        kernels.TUNE["prefill"] = cfg
        try:
            row[name] = tm(ours_prefill, (*args, cu, cu_cpu))
            if name == "base":
                kernels.TUNE["skip_state"] = True
                row["base_intra_only"] = tm(ours_prefill, (*args, cu, cu_cpu))
                for kname, kern in kernels.LAUNCHED.items():
                    OUT["regs"][kname] = (kern.n_regs, kern.n_spills)
        except Exception as e:  # noqa: BLE001
            row[name] = repr(e)[:300]
    kernels.TUNE.clear()
    log("TIME prefill", json.dumps(row))
    OUT["prefill"].append(row)


def decode_row(batch, h, variants):
    K = 128
    n_sets = timing.rotation_count(2 * batch * h * K * K * 4, timing.l2_bytes())
    sets = []
    for _ in range(n_sets):
        q, k, v, f, beta, a_log, dtb = inputs(batch, 1, h)
        pool = torch.randn(batch + 3, h, K, K, device=DEV) * 0.05
        idx = torch.randperm(batch + 3, device=DEV)[:batch].to(torch.int32)
        sets.append((q, k, v, f, beta, pool, idx))
    a_log, dtb = sets[0][5], sets[0][6]
    a_log = torch.log(torch.empty(h, device=DEV).uniform_(1, 4))
    dtb = torch.randn(h * K, device=DEV) * 0.5
    q, k, v, f, beta, pool, idx = sets[0]
    p0 = pool.clone()
    d = lambda x: x.double()  # noqa: E731
    rp = p0.double()
    wo = reference.kda_decode(d(q), d(k), d(v), d(f), d(beta), rp, idx.cpu(), A_log=a_log, dt_bias=dtb, lower_bound=LB,
                              l2norm_qk=True, beta_sigmoid=True)

    def ours(q, k, v, f, beta, pool, idx):
        return kda_decode(q, k, v, f, beta, pool, idx, A_log=a_log, dt_bias=dtb, lower_bound=LB, l2norm_qk=True,
                          beta_sigmoid=True)

    def fla(q, k, v, f, beta, pool, idx):
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        return fused_recurrent_kda_fwd(q, k, v, f, beta, A_log=a_log, dt_bias=dtb, initial_state=pool,
                                       inplace_final_state=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LB)[0]

    row = {"B": batch, "h": h, "bytes": 2 * batch * h * K * K * 4}
    for name, fn in (("ours", ours), ("fla", fla)):
        try:
            p = p0.clone()
            o = fn(q, k, v, f, beta, p, idx)
            row[name + "_err"] = (rel_err(o.float(), wo), rel_err(p[idx.long()], rp[idx.long()]))
        except Exception as e:  # noqa: BLE001
            row[name + "_err"] = repr(e)[:200]
    try:
        row["fla"] = timing.time_ms(fla, sets)
    except Exception as e:  # noqa: BLE001
        row["fla"] = repr(e)[:200]
    for name, cfg in variants:
        kernels.TUNE.clear()
        kernels.TUNE["decode"] = cfg
        try:
            row[name] = timing.time_ms(ours, sets)
        except Exception as e:  # noqa: BLE001
            row[name] = repr(e)[:200]
    kernels.TUNE.clear()
    log("TIME decode", json.dumps(row))
    OUT["decode"].append(row)


def copy_gbps():
    x = torch.empty(1 << 28, device=DEV, dtype=torch.uint8)
    y = torch.empty_like(x)
    ms = timing.time_ms(lambda: y.copy_(x), [()])
    return 2 * x.numel() / ms / 1e6


def dump():
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "kda_selftest.json"), "w") as fh:
        json.dump(OUT, fh, indent=1)


def main():
    quick = "--quick" in sys.argv
    log(torch.cuda.get_device_name(), torch.__version__)
    OUT["copy_gbps"] = copy_gbps()
    log("copy GB/s", OUT["copy_gbps"])
    t0 = time.time()
    for h, lens, dense in ((32, [8192], True), (32, [1300, 547, 2048, 963, 271, 3063], False)):
        try:
            check_prefill(h, lens, dense)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        dump()
    log("checks", time.time() - t0)
    pv = [("base", {}), ("serial", {"segments": 1, "overlap": False}), ("bt32", BT32),
          ("bt64", {"BT": 64, "intra_warps": 8, "BK": 32, "intra_maxnreg": None}),
          ("iw4", {"intra_warps": 4}), ("is2", {"intra_stages": 2}),
          ("bv16", {"BV": 16}), ("bv64", {"BV": 64}), ("sw8", {"state_warps": 8}), ("ss2", {"state_stages": 2}),
          ("ss1", {"state_stages": 1}), ("x3", {"PREC": "tf32x3"})]
    time_prefill(32, [8192], True, pv)
    dump()
    log("prefill timed", time.time() - t0)
    dv = [("bv16w2", {"BV": 16, "num_warps": 2}), ("bv16w4", {"BV": 16, "num_warps": 4}),
          ("bv32w4", {"BV": 32, "num_warps": 4}), ("bv32w8", {"BV": 32, "num_warps": 8}),
          ("bv64w4", {"BV": 64, "num_warps": 4}), ("bv8w1", {"BV": 8, "num_warps": 1})]
    for b in (1, 16, 64, 256):
        try:
            decode_row(b, 32, dv)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        dump()
    log("decode timed", time.time() - t0)
    OUT["regs"]["decode"] = (kernels.LAUNCHED["decode"].n_regs, kernels.LAUNCHED["decode"].n_spills) \
        if "decode" in kernels.LAUNCHED else None
    log("REGS", json.dumps(OUT["regs"]))
    dump()
    if quick:
        return
    for h, lens, dense in ((96, [8192], True), (32, [1024] * 8, False), (32, [4096] * 8, True)):
        try:
            time_prefill(h, lens, dense, pv[:3] + pv[6:9])
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        dump()
    log("done", time.time() - t0)


def tune():
    """Pick the fastest correct launch configuration among a few (prefill at H=32, T=8192; decode at B=16/256),
    record every timing, and leave the winners in kernels.TUNE for the suite that follows."""
    args = inputs(1, 8192, 32)
    q, k, v, f, beta, a_log, dtb = args
    d = lambda x: x.double()  # noqa: E731
    wo, _ = reference.kda(d(q), d(k), d(v), d(f), d(beta), A_log=a_log, dt_bias=dtb, lower_bound=LB, l2norm_qk=True,
                          beta_sigmoid=True, chunk=64)
    fla_err = rel_err(fla_prefill(*args)[0].float(), wo)
    res = {"fla": tm(fla_prefill, args), "fla_err": fla_err}
    best = None
    for name, cfg in (("default", {}), ("bt32", BT32), ("stages2", {"intra_stages": 2})):
        kernels.TUNE.clear()
        kernels.TUNE["prefill"] = cfg
        try:
            err = rel_err(ours_prefill(*args)[0].float(), wo)
            ms = tm(ours_prefill, args)[0]
            res[name] = (ms, err)
            if err < 1e-2 and (best is None or ms < best[0]):
                best = (ms, cfg)
        except Exception as e:  # noqa: BLE001
            res[name] = repr(e)[:200]
        log("TUNE prefill", name, res[name])
    OUT["tune_prefill"] = res
    dres = {}
    dbest = {}
    for b in (() if "--no-decode-tune" in sys.argv else (1, 16, 256)):
        rows = {}
        K = 128
        n_sets = timing.rotation_count(2 * b * 32 * K * K * 4, timing.l2_bytes())
        sets = []
        for _ in range(n_sets):
            q, k, v, f, beta, a_log, dtb = inputs(b, 1, 32)
            sets.append((q, k, v, f, beta, torch.randn(b + 3, 32, K, K, device=DEV) * 0.05,
                         torch.randperm(b + 3, device=DEV)[:b].to(torch.int32)))

        def ours(q, k, v, f, beta, pool, idx):
            return kda_decode(q, k, v, f, beta, pool, idx, A_log=a_log, dt_bias=dtb, lower_bound=LB, l2norm_qk=True,
                              beta_sigmoid=True)

        for name, cfg in (("default", {}), ("bv8w1", {"BV": 8, "num_warps": 1}), ("bv16w2", {"BV": 16, "num_warps": 2}),
                          ("bv32w4", {"BV": 32, "num_warps": 4}), ("bv64w4", {"BV": 64, "num_warps": 4})):
            kernels.TUNE.clear()
            kernels.TUNE["decode"] = cfg
            try:
                rows[name] = timing.time_ms(ours, sets)
            except Exception as e:  # noqa: BLE001
                rows[name] = repr(e)[:200]
        cfgs = {"default": {}, "bv8w1": {"BV": 8, "num_warps": 1}, "bv16w2": {"BV": 16, "num_warps": 2},
                "bv32w4": {"BV": 32, "num_warps": 4}, "bv64w4": {"BV": 64, "num_warps": 4}}
        timed = {n: ms for n, ms in rows.items() if isinstance(ms, float)}
        dres[b] = rows
        log("TUNE decode", b, rows)
        if timed:
            dbest[b] = cfgs[min(timed, key=timed.get)]
        del sets
    OUT["tune_decode"] = dres
    kernels.TUNE.clear()
    if best is not None:
        kernels.TUNE["prefill"] = best[1]
    # the suite batches: 1, 16, 64 (the B=16 winner), 256
    kernels.TUNE["decode_by_n"] = {n: dbest[src] for n, src in ((1, 1), (16, 16), (64, 16), (256, 256)) if src in dbest}
    OUT["chosen"] = {"prefill": best and best[1], "decode_best_by_batch": dbest}
    log("CHOSEN", json.dumps(OUT["chosen"]))
    dump()


def final():
    """Tune a little (intra W/U block and pipeline depth; decode launch shapes unless --no-decode-tune), then
    run the "kda" bench suite with the chosen configuration (--quick: the H=32 prefill rows and every decode row)."""
    import lmkernels.bench as bench

    t0 = time.time()
    try:
        tune()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        kernels.TUNE.clear()
    log("tuned", time.time() - t0)
    out = os.environ["OUT"]
    rc = bench.main(["kda"], results_dir=out + "/results", markdown_path=out + "/BENCHMARKS.md",
                    quick="--quick" in sys.argv)
    log("suite done", time.time() - t0)
    return rc


if __name__ == "__main__":
    if "--final" in sys.argv:
        sys.exit(final())
    main()
