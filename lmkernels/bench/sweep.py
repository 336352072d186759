"""Launch-configuration sweeps for the norm and gated-activation kernels, to fix their heuristics.

`sweep_norm()` times `_norm_kernel` directly (RMSNorm with weight, bf16, with and without residual) over
ROWS × num_warps at 16384 tokens; `sweep_activation()` times `_gated_kernel` over BLOCK × num_warps.
Each prints the best configurations per shape beside the heuristic's choice and returns them as a
dict; `main(["sweep"])` puts that dict in the suite's JSON (and BENCHMARKS.md).
"""

import torch

from . import harness, timing
from .counts import gated_bytes, gbps, norm_bytes
from .harness import rel_err, short_error

DTYPE = torch.bfloat16
NORM_TOKENS = 16384
NORM_HIDDEN = (2048, 4096, 5120, 7168, 8192)
NORM_ROWS = (1, 2, 4, 8)
NORM_WARPS = (1, 2, 4, 8, 16)
MAX_PROGRAM_ELEMS = 16384  # ROWS · BLOCK_N: 64 KB of fp32 per program for one input
MAX_THREAD_ELEMS = 128  # fp32 values of one input per thread; more spills registers
ACT_SHAPES = ((8192, 14336), (4096, 11008))
ACT_BLOCKS = (512, 1024, 2048, 4096)
ACT_WARPS = (2, 4, 8, 16)
EPS = 1e-6
TOP = 5


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def norm_configs(n_cols: int, heuristic=None, rows=NORM_ROWS, warps=NORM_WARPS) -> list:
    """(ROWS, BLOCK_N, num_warps) worth timing for a row of n_cols: skip programs holding more than
    MAX_PROGRAM_ELEMS fp32 values of one input, threads holding more than MAX_THREAD_ELEMS (spills) or
    less than one value. The heuristic's own choice is always included."""
    block_n = _next_pow2(n_cols)
    out = []
    for r in rows:
        for w in warps:
            elems = r * block_n
            if elems > MAX_PROGRAM_ELEMS or elems > MAX_THREAD_ELEMS * 32 * w or elems < 32 * w:
                continue
            out.append((r, block_n, w))
    if heuristic is not None and tuple(heuristic) not in out:
        out.append(tuple(heuristic))
    return out


def act_configs(d: int, heuristic=None, blocks=ACT_BLOCKS, warps=ACT_WARPS) -> list:
    """(BLOCK, num_warps): at least one value per thread, at most MAX_THREAD_ELEMS; blocks no wider than
    the next power of two of d. The heuristic's choice is always included."""
    out = []
    for b in blocks:
        if b > _next_pow2(d):
            continue
        for w in warps:
            if b < 32 * w or b > MAX_THREAD_ELEMS * 32 * w:
                continue
            out.append((b, w))
    if heuristic is not None and tuple(heuristic) not in out:
        out.append(tuple(heuristic))
    return out


def _entry(cfg_keys, cfg, ms, nbytes, copy_gbps, err):
    e = dict(zip(cfg_keys, cfg))
    e.update(ms=ms, gbps=gbps(nbytes, ms), err=err)
    if copy_gbps:
        e["pct_copy"] = 100 * e["gbps"] / copy_gbps
    return e


def _summary(shape_info: dict, entries: list, heuristic: dict | None, failed: list) -> dict:
    ranked = sorted(entries, key=lambda e: -e["gbps"])
    out = dict(shape_info)
    out.update(heuristic=heuristic, best=ranked[0] if ranked else None, top=ranked[:TOP],
               configs=ranked, failed=failed)
    if heuristic and ranked:
        out["best_over_heuristic"] = ranked[0]["gbps"] / heuristic["gbps"]
    return out


def sweep_norm(hidden=NORM_HIDDEN, tokens: int = NORM_TOKENS, copy_gbps: float | None = None,
               residual_modes=(False, True), log=harness.log_line) -> dict:
    """RMSNorm launch configurations: {"shapes": [per (hidden, residual): heuristic, best, top, configs]}."""
    import triton

    from ..ops.norm import kernels

    l2 = timing.l2_bytes()
    results = []
    for n in hidden:
        for residual in residual_modes:
            nbytes = norm_bytes(tokens, n, 2, residual=residual)
            n_sets = timing.rotation_count(nbytes, l2)
            sets = []
            for _ in range(n_sets):
                x = torch.randn(tokens, n, device=harness.device(), dtype=DTYPE)
                res = torch.randn_like(x) if residual else None
                w = (torch.rand(n, device=harness.device()) + 0.5).to(DTYPE)
                y = torch.empty_like(x)
                r = torch.empty_like(x) if residual else None
                sets.append((x, res, w, y, r))
            x0, res0, w0 = sets[0][:3]
            r0 = (x0 + res0) if residual else x0
            ref = [r0.float() * torch.rsqrt(r0.float().pow(2).mean(-1, keepdim=True) + EPS) * w0.float()]
            if residual:
                ref.append(r0.float())

            def launch(x, res, w, y, r, cfg):
                rows, block_n, warps = cfg
                kernels._norm_kernel[(triton.cdiv(tokens, rows),)](
                    x, res, w, None, y, r,
                    tokens, n, x.stride(0), res.stride(0) if res is not None else 0,
                    y.stride(0), r.stride(0) if r is not None else 0,
                    EPS, 0.0,
                    IS_RMS=True, HAS_RESIDUAL=res is not None, HAS_WEIGHT=True, HAS_BIAS=False, GELU=0,
                    ROWS=rows, BLOCK_N=block_n, num_warps=warps,
                )

            heur_cfg = tuple(kernels.launch_config(n, 2))
            entries, failed, heur = [], [], None
            for cfg in norm_configs(n, heur_cfg):
                try:
                    x, res, w, y, r = sets[0]
                    y.fill_(float("nan"))
                    if r is not None:
                        r.fill_(float("nan"))
                    launch(x, res, w, y, r, cfg)
                    harness.synchronize()
                    err = rel_err([y] + ([r] if residual else []), ref)
                    if not err <= 1e-2:
                        failed.append({"config": list(cfg), "why": f"rel err {err:.2e}"})
                        continue
                    ms = timing.time_ms(lambda *s, cfg=cfg: launch(*s, cfg), sets)
                except Exception as e:
                    failed.append({"config": list(cfg), "why": short_error(e)})
                    continue
                e = _entry(("rows", "block_n", "num_warps"), cfg, ms, nbytes, copy_gbps, err)
                entries.append(e)
                if cfg == heur_cfg:
                    heur = e
            summary = _summary({"tokens": tokens, "hidden": n, "residual": residual, "bytes": nbytes},
                               entries, heur, failed)
            results.append(summary)
            log(_norm_line(summary))
            x = res = w = y = r = None
            del sets, ref, x0, res0, w0, r0
            torch.cuda.empty_cache()
    return {"kernel": "lmkernels.ops.norm.kernels._norm_kernel", "dtype": "bfloat16", "shapes": results}


def sweep_activation(shapes=ACT_SHAPES, acts=("silu", "gelu_tanh"), copy_gbps: float | None = None,
                     log=harness.log_line) -> dict:
    """Gated-activation launch configurations: {"shapes": [per (tokens, d, act): heuristic, best, top]}."""
    import triton

    from ..ops.activation import kernels

    l2 = timing.l2_bytes()
    results = []
    for t, d in shapes:
        nbytes = gated_bytes(t, d, 2)
        n_sets = timing.rotation_count(nbytes, l2)
        sets = []
        for _ in range(n_sets):
            x = 2.0 * torch.randn(t, 2 * d, device=harness.device(), dtype=DTYPE)
            sets.append((x, torch.empty(t, d, device=harness.device(), dtype=DTYPE)))
        x0 = sets[0][0]
        for act in acts:
            g, u = x0[:, :d].float(), x0[:, d:].float()
            if act == "silu":
                ref = [torch.nn.functional.silu(g) * u]
            else:
                ref = [torch.nn.functional.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none") * u]
            del g, u
            code = kernels.ACTIVATION_CODES[act]

            def launch(x, out, cfg):
                block, warps = cfg
                kernels._gated_kernel[(triton.cdiv(t * d, block),)](
                    x, out, t * d, x.stride(0), D=d, ACT=code, BLOCK=block, EVEN=t * d % block == 0,
                    num_warps=warps)

            heur_cfg = (kernels.BLOCK, 8)
            entries, failed, heur = [], [], None
            for cfg in act_configs(d, heur_cfg):
                try:
                    x, out = sets[0]
                    out.fill_(float("nan"))
                    launch(x, out, cfg)
                    harness.synchronize()
                    err = rel_err([out], ref)
                    if not err <= 1e-2:
                        failed.append({"config": list(cfg), "why": f"rel err {err:.2e}"})
                        continue
                    ms = timing.time_ms(lambda *s, cfg=cfg: launch(*s, cfg), sets)
                except Exception as e:
                    failed.append({"config": list(cfg), "why": short_error(e)})
                    continue
                e = _entry(("block", "num_warps"), cfg, ms, nbytes, copy_gbps, err)
                entries.append(e)
                if cfg == heur_cfg:
                    heur = e
            summary = _summary({"tokens": t, "d": d, "act": act, "bytes": nbytes}, entries, heur, failed)
            results.append(summary)
            log(_act_line(summary))
            del ref
        x = out = None
        del sets, x0
        torch.cuda.empty_cache()
    return {"kernel": "lmkernels.ops.activation.kernels._gated_kernel", "dtype": "bfloat16", "shapes": results}


def _cfg_text(e, keys) -> str:
    return "/".join(str(e[k]) for k in keys)


def _line(head, s, keys) -> str:
    if not s["best"]:
        return f"{head}: no configuration ran ({len(s['failed'])} failed)"
    best = s["best"]
    text = f"{head}: best {_cfg_text(best, keys)} {best['gbps']:.0f} GB/s"
    if s["heuristic"]:
        h = s["heuristic"]
        text += f"; heuristic {_cfg_text(h, keys)} {h['gbps']:.0f} GB/s ({s['best_over_heuristic']:.3f}x)"
    else:
        text += "; heuristic config did not run"
    others = ", ".join(f"{_cfg_text(e, keys)} {e['gbps']:.0f}" for e in s["top"][1:])
    return text + (f"; next: {others}" if others else "")


def _norm_line(s) -> str:
    return _line(f"[sweep norm] {s['tokens']}x{s['hidden']}{' +res' if s['residual'] else ''} (rows/block/warps)",
                 s, ("rows", "block_n", "num_warps"))


def _act_line(s) -> str:
    return _line(f"[sweep act] {s['act']} {s['tokens']}x{s['d']} (block/warps)", s, ("block", "num_warps"))


def run(result: dict, quick: bool = False, save=lambda: None) -> None:
    """Suite entry: both sweeps into result["sweep"] (quick: three hidden sizes, one activation shape)."""
    copy = (result.get("ceilings") or {}).get("copy_gbps")
    result["sweep"] = {}
    result["sweep"]["norm"] = sweep_norm(hidden=(2048, 5120, 8192) if quick else NORM_HIDDEN, copy_gbps=copy)
    save()
    result["sweep"]["activation"] = sweep_activation(shapes=ACT_SHAPES[:1] if quick else ACT_SHAPES,
                                                     acts=("silu",) if quick else ("silu", "gelu_tanh"),
                                                     copy_gbps=copy)
    save()
