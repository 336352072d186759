"""The gemv kernel on a CUDA GPU: `python -m lmkernels.ops.gemv.gpu_tune OUT_DIR [--engine]`.

1. Correctness at the Llama-3-8B decode shapes (bf16, each layer's fusion, with and without PDL) against fp32 math.
   --decode-check: one decode step of a 4-layer model of that shape, bf16 on the GPU (gemv path and matmul
   path), against the same weights in fp32 on the CPU.
2. --attn: B=1 paged decode at the engine's capacity-sized launch: split floor × pipeline depth.
   --sweep-rows: launch configurations for 2, 4 and 8 rows of x on the layer shapes, beside cuBLAS.
   --sweep: a launch-configuration sweep per shape (GB/s of weights streamed), beside cuBLAS (F.linear, no fusion) on the
   same rotated weights and the copy ceiling of the same run.
3. --engine: the llama3-8b engine's B=1 decode at contexts 512 and 4096 (graph replay ms per token and tokens/s
   of generate) with the matmul path, the gemv path without PDL, with PDL but rotary and the KV write not fused
   into the qkv pass, and the default (all of it); greedy tokens with and without PDL must agree; one decode
   step's logits against the matmul path's; the kernels of one eager step.
Writes OUT_DIR/gemv_tune.json and prints a short table last.
"""

import json
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton

from . import kernels, reference

SHAPES = {  # Llama-3-8B, one token: (output rows, K, fusion)
    "qkv": (6144, 4096, dict(norm=True)),
    "o": (4096, 4096, dict(residual=True)),
    "gate_up": (14336, 4096, dict(norm=True, gated=True)),
    "down": (4096, 14336, dict(residual=True)),
    "lm_head": (128256, 4096, dict(norm=True)),
}
COARSE = [dict(BLOCK_N=bn, BLOCK_K=512, num_warps=w, STAGES=st) for bn in (4, 8, 16) for w in (4, 8) for st in (1, 2, 4)]


def inputs(n, k, fusion, m=1):
    gated = fusion.get("gated", False)
    w = (torch.randn(n * (2 if gated else 1), k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    return dict(
        x=torch.randn(m, k, device="cuda").to(torch.bfloat16), weight=w, bias=None,
        norm_weight=(torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16) if fusion.get("norm") else None,
        residual=torch.randn(m, n, device="cuda").to(torch.bfloat16) if fusion.get("residual") else None,
        gated=gated,
    )


def run(c, config=None, use_pdl=None):
    return kernels.gemv(c["x"], c["weight"], c["bias"], c["norm_weight"], 1e-6, c["residual"], c["gated"],
                        config=config, use_pdl=use_pdl)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check_all(log):
    out = {}
    for name, (n, k, fusion) in SHAPES.items():
        for m in (1, 2, 4):
            c = inputs(n, k, fusion, m)
            ref = reference.gemv(c["x"].float(), c["weight"].float(), None,
                                 None if c["norm_weight"] is None else c["norm_weight"].float(), 1e-6,
                                 None if c["residual"] is None else c["residual"].float(), c["gated"])
            for pdl in (False, True):
                err = rel(kernels.gemv(c["x"], c["weight"], c["bias"], c["norm_weight"], 1e-6, c["residual"],
                                       c["gated"], use_pdl=pdl), ref)
                out[f"{name} M={m} pdl={pdl}"] = err
                log(f"[check] {name} M={m} pdl={pdl}: rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}")
    hq, hk, d, k, page = 32, 8, 128, 4096, 16
    for m in (1, 4):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        w = (torch.randn((hq + 2 * hk) * d, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        g = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
        angles = torch.arange(8192.0, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")[None, :]
        cs = torch.cat((angles.cos(), angles.sin()), -1)
        pos = torch.randint(0, 8192, (m,), device="cuda")
        slots = torch.randperm(64 * page, device="cuda")[:m]
        caches = [torch.full((64, page, hk, d), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        for pdl in (False, True):
            for c in caches:
                c.fill_(float("nan"))
            q = kernels.gemv_qkv(x, w, None, g, 1e-6, cs, pos, caches[0], caches[1], slots, hq, use_pdl=pdl)
            q_ref = reference.gemv_qkv(x.float(), w.float(), None, g.float(), 1e-6, cs, pos, caches[2], caches[3],
                                       slots, hq)
            sel = slots.tolist()
            kv = torch.stack([caches[i].view(-1, hk, d)[sel] for i in range(4)]).float()
            err = max(rel(q, q_ref), rel(kv[0], kv[2]), rel(kv[1], kv[3]))
            out[f"gemv_qkv M={m} pdl={pdl}"] = err
            log(f"[check] gemv_qkv M={m} pdl={pdl}: rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}")
    return out


def sweep(log, copy_gbps):
    from ...bench import timing

    l2 = timing.l2_bytes()
    results = {}
    for name, (n, k, fusion) in SHAPES.items():
        c0 = inputs(n, k, fusion)
        nbytes = c0["weight"].numel() * 2
        sets = [c0] + [inputs(n, k, fusion) for _ in range(timing.rotation_count(nbytes, l2) - 1)]

        def time_cfg(cfg, pdl=False):
            return timing.time_ms(lambda c: run(c, cfg, pdl), [(c,) for c in sets])

        rows = []
        for cfg in [] if name == "lm_head" else COARSE:
            try:
                ms = time_cfg(dict(BLOCK_M=1, **cfg))
                rows.append((ms, cfg))
            except Exception as e:
                log(f"[sweep] {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
        if rows:
            rows.sort(key=lambda r: r[0])
            for ms, cfg in rows[:2]:
                for bk in (256, 1024):
                    cfg2 = dict(cfg, BLOCK_K=bk)
                    try:
                        rows.append((time_cfg(dict(BLOCK_M=1, **cfg2)), cfg2))
                    except Exception as e:
                        log(f"[sweep] {name} {cfg2}: {type(e).__name__}: {str(e)[:120]}")
            rows.sort(key=lambda r: r[0])
        default = kernels.gemv_config(1, n, k, fusion.get("gated", False))
        ms_default = time_cfg(default)
        ms_default_pdl = time_cfg(default, True)
        best_ms, best = rows[0] if rows else (ms_default, default)
        ms_best_pdl = time_cfg(dict(best, BLOCK_M=1), True)
        ms_cublas = timing.time_ms(F.linear, [(s["x"], s["weight"]) for s in sets])
        gb = lambda ms: nbytes / ms / 1e6  # noqa: E731
        results[name] = dict(
            n=n, k=k, fusion=fusion, weight_bytes=nbytes, sets=len(sets),
            best=best, best_gbps=gb(best_ms), best_pdl_gbps=gb(ms_best_pdl),
            default=default, default_gbps=gb(ms_default), default_pdl_gbps=gb(ms_default_pdl),
            cublas_gbps=gb(ms_cublas), all=[(gb(ms), cfg) for ms, cfg in rows],
        )
        r = results[name]
        log(f"[sweep] {name} {n}x{k}: best {best} {r['best_gbps']:.0f} GB/s (pdl {r['best_pdl_gbps']:.0f}), "
            f"default {r['default_gbps']:.0f} (pdl {r['default_pdl_gbps']:.0f}), cuBLAS {r['cublas_gbps']:.0f}, "
            f"copy {copy_gbps:.0f}")
        for g, cfg in r["all"][:6]:
            log(f"    {g:7.0f}  {cfg}")
        del sets, c0
        torch.cuda.empty_cache()
    return results


def sweep_rows(log, rows=(2, 4, 8)):
    """Launch configurations for several rows of x (decode batches of 2–8) on the four layer shapes."""
    from ...bench import timing

    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, STAGES=st) for bn in (4, 8) for bk in (256, 512)
            for w in (4, 8) for st in (1, 3)]
    l2 = timing.l2_bytes()
    out = {}
    for name in ("qkv", "o", "gate_up", "down"):
        n, k, fusion = SHAPES[name]
        for m in rows:
            sets = [inputs(n, k, fusion, m)]
            sets += [inputs(n, k, fusion, m) for _ in range(timing.rotation_count(sets[0]["weight"].numel() * 2, l2) - 1)]
            nbytes = sets[0]["weight"].numel() * 2
            res = []
            for cfg in grid:
                full = dict(BLOCK_M=triton.next_power_of_2(m), **cfg)
                try:
                    ms = timing.time_ms(lambda c: run(c, full, True), [(c,) for c in sets])
                    res.append((nbytes / ms / 1e6, cfg))
                except Exception as e:
                    log(f"[rows] {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:100]}")
            ms_default = timing.time_ms(lambda c: run(c, None, True), [(c,) for c in sets])
            ms_cublas = timing.time_ms(lambda c: F.linear(c["x"], c["weight"]), [(c,) for c in sets])
            res.sort(key=lambda r: -r[0])
            out[f"{name} M={m}"] = dict(best=res[0][1], best_gbps=res[0][0], default_gbps=nbytes / ms_default / 1e6,
                                         cublas_gbps=nbytes / ms_cublas / 1e6, top=res[:5])
            r = out[f"{name} M={m}"]
            log(f"[rows] {name} M={m}: best {r['best']} {r['best_gbps']:.0f} GB/s, default {r['default_gbps']:.0f}, "
                f"cuBLAS {r['cublas_gbps']:.0f}; next: " + "; ".join(f"{g:.0f} {c}" for g, c in res[1:4]))
            del sets
            torch.cuda.empty_cache()
    return out


def attn_probe(log):
    """B=1 paged decode as the engine's graphs call it (Llama-3-8B heads, capacity 8192, page 16): µs per call for
    the split floor (keys per split) and pipeline depth, checked against the default's output."""
    from ...bench import timing
    from ..attention import attention_decode
    from ..attention import kernels as attn

    base_cfg, base_floor = attn.decode_config, attn.MIN_KEYS_PER_SPLIT
    hq, hk, d, page, cap = 32, 8, 128, 16, 8192
    out = {}
    for ctx in (512, 2048, 4096, 8192):
        sets = []
        for _ in range(max(1, timing.rotation_count(2 * ctx * hk * d * 2, timing.l2_bytes()))):
            pages = torch.randperm(cap // page, device="cuda").to(torch.int32)[None, :]
            kc = torch.randn(cap // page, page, hk, d, device="cuda").to(torch.bfloat16)
            vc = torch.randn_like(kc)
            q = torch.randn(1, 1, hq, d, device="cuda").to(torch.bfloat16)
            sets.append((q, kc, vc, pages, torch.tensor([ctx], device="cuda", dtype=torch.int32)))
        ref = attention_decode(*sets[0], max_seqlen_k=cap)
        for floor in (256, 128, 64):
            for stages in (5, 3, 2):
                attn.MIN_KEYS_PER_SPLIT = floor
                attn.decode_config = (lambda *a, st=stages, **k: dict(base_cfg(*a, **k), num_stages=st))
                try:
                    fn = lambda *a: attention_decode(*a, max_seqlen_k=cap)  # noqa: E731
                    err = rel(fn(*sets[0]), ref)
                    us = timing.time_ms(fn, sets) * 1e3
                    out[f"ctx={ctx} floor={floor} stages={stages}"] = dict(us=us, err=err)
                    log(f"[attn] B=1 ctx={ctx} floor {floor} stages {stages}: {us:.1f} µs (err vs default {err:.1e})")
                except Exception as e:
                    log(f"[attn] ctx={ctx} floor {floor} stages {stages}: {type(e).__name__}: {str(e)[:100]}")
        attn.decode_config, attn.MIN_KEYS_PER_SPLIT = base_cfg, base_floor
        del sets
        torch.cuda.empty_cache()
    return out


def engine_ab(log):
    from ... import _utils
    from ...bench.suites.engine import engine_decode, median_ms, random_prompts, weight_bytes_per_token
    from ...bench.suites.engine import count_kernels, PROFILES
    from ...engine import Engine, SamplingParams
    from ...loading import load_preset
    from ...models.metadata import decode_metadata

    from ...models import llama

    fused_qkv_ok = llama.Attention.fused_qkv_ok

    def set_variant(model, fused, pdl, qkv):
        model.fused_decode, _utils.ENABLE_PDL = fused, pdl
        llama.Attention.fused_qkv_ok = fused_qkv_ok if qkv else (lambda *a: False)

    model = load_preset("llama3-8b", dtype=torch.bfloat16, device="cuda", seed=0)
    per_token = weight_bytes_per_token(model)
    out = {"bytes_per_token": per_token}
    variants = (("matmul path", False, True, False), ("gemv, no PDL", True, False, True),
                ("gemv + PDL, qkv not fused", True, True, False), ("gemv + PDL", True, True, True))
    for ctx in (512, 4096):
        prompts = random_prompts(1, ctx, model.config.vocab_size, seed=ctx)
        for label, fused, pdl, qkv in variants:
            set_variant(model, fused, pdl, qkv)
            try:
                e = Engine(model, None, num_pages=(ctx + 256) // 16 + 8, page_size=16, max_num_seqs=1,
                           max_num_batched_tokens=ctx + 16, eos_token_ids=[])
                tps, _ = engine_decode(e, prompts, 128)
                tokens = e.generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True))[0].token_ids
                out.setdefault(f"tokens ctx={ctx}", {})[label] = tokens
                replay = median_ms(e.graphs.graphs[1].replay, repeats=30)
                out[f"{label} ctx={ctx}"] = dict(tokens_per_s=tps, replay_ms=replay)
                log(f"[engine] {label} ctx={ctx}: {tps:.1f} tokens/s, graph replay {replay:.3f} ms "
                    f"({per_token / replay / 1e6:.0f} GB/s of weights)")
                del e
            except Exception:
                log(traceback.format_exc())
            torch.cuda.empty_cache()
        seqs = {k: v for k, v in out.get(f"tokens ctx={ctx}", {}).items() if k in ("gemv, no PDL", "gemv + PDL")}
        same = len({tuple(t) for t in seqs.values()}) == 1  # same kernels and math: PDL must change nothing
        out[f"gemv tokens identical ctx={ctx}"] = same
        log(f"[engine] ctx={ctx}: greedy tokens {'identical' if same else 'DIFFER'} across {list(seqs)}")
        if not same:
            for label, t in seqs.items():
                log(f"    {label}: {t[:24]}")
    set_variant(model, True, True, True)
    try:  # kernels of one eager gemv-path decode step at ctx 512, and its logits against the matmul path's
        kv = model.allocate_kv_cache(40, 16)
        for t in (*kv.k, *kv.v):
            t.normal_()
        pos, meta = decode_metadata([list(range(33))], [513], 16, device="cuda")
        tok = torch.tensor([5], device="cuda")
        with torch.inference_mode():
            set_variant(model, False, True, False)
            ref_logits = model(tok, pos, meta, kv).float()
            set_variant(model, True, True, True)
            err = rel(model(tok, pos, meta, kv).float(), ref_logits)
            out["decode logits gemv vs matmul path"] = err
            log(f"[check] one decode step (ctx 512, random cache): gemv path vs matmul path logits rel err {err:.2e}")
            n = count_kernels(lambda: model(tok, pos, meta, kv))
        out["kernels_per_step"] = n
        out["profile"] = PROFILES[-1]
        log(f"[engine] gemv path: {n} kernels per step ({n / model.config.num_layers:.2f} per layer); top: {PROFILES[-1]}")
    except Exception:
        log(traceback.format_exc())
    return out


def decode_check(log, layers=4, context=100):
    """One decode step of a 4-layer Llama-3-8B-shaped model (bf16 on the GPU: the gemv path and the matmul path)
    against the same weights in fp32 on the CPU (the ops' references): last-position logits, rel err."""
    from ...loading import load_preset
    from ...models.metadata import decode_metadata, prefill_metadata

    gpu = load_preset("llama3-8b", dtype=torch.bfloat16, device="cuda", seed=1, num_hidden_layers=layers)
    cpu = load_preset("llama3-8b", dtype=torch.float32, device="meta", num_hidden_layers=layers)
    cpu = cpu.to_empty(device="cpu")
    with torch.no_grad():
        for p, q in zip(cpu.parameters(), gpu.parameters()):
            p.copy_(q.float().cpu())
    cpu.cos_sin_cache = gpu.cos_sin_cache.cpu()
    prompt = torch.randint(3, gpu.config.vocab_size, (context,)).tolist()
    table = list(range(context // 16 + 2))
    logits = {}
    for name, model, dev, fused in (("fp32 cpu", cpu, "cpu", False), ("gemv path", gpu, "cuda", True),
                                    ("matmul path", gpu, "cuda", False)):
        model.fused_decode = fused
        kv = model.allocate_kv_cache(len(table) + 1, 16)
        pos, meta = prefill_metadata([table], [context], 16, device=dev)
        with torch.inference_mode():
            model(torch.tensor(prompt, device=dev), pos, meta, kv)
            pos, meta = decode_metadata([table], [context + 1], 16, device=dev)
            logits[name] = model(torch.tensor([17], device=dev), pos, meta, kv).float().cpu()
    gpu.fused_decode = True
    out = {f"decode step {k} vs fp32": rel(logits[k], logits["fp32 cpu"]) for k in ("gemv path", "matmul path")}
    for k, v in out.items():
        log(f"[check] {layers}-layer llama3-8b shape, {k} (bf16 GPU) vs fp32 CPU logits: rel err {v:.2e}")
    del gpu, cpu
    torch.cuda.empty_cache()
    return out


def main(argv):
    from ...bench import ceilings

    out_dir = argv[0] if argv else "."
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    res["triton"] = triton.__version__
    t0 = time.time()
    res["copy"] = ceilings.copy_bandwidth()
    copy = res["copy"]["copy_gbps"] if "copy_gbps" in res["copy"] else float("nan")
    log(f"copy {copy:.0f} GB/s")
    with torch.no_grad():
        res["check"] = check_all(log)
        if "--decode-check" in argv:
            res["decode_check"] = decode_check(log)
        if "--sweep" in argv:
            res["sweep"] = sweep(log, copy)
        if "--attn" in argv:
            res["attn"] = attn_probe(log)
        if "--sweep-rows" in argv:
            res["sweep_rows"] = sweep_rows(log)
        if "--engine" in argv:
            res["engine"] = engine_ab(log)
    res["seconds"] = time.time() - t0
    with open(f"{out_dir}/gemv_tune.json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    log("\nshape      best cfg                                   GB/s  +PDL  default  cuBLAS")
    for name, r in res.get("sweep", {}).items():
        b = r["best"]
        log(f"{name:9s} BN{b.get('BLOCK_N')} BK{b.get('BLOCK_K')} w{b.get('num_warps')} s{b.get('STAGES')}"
            f"{'':22s} {r['best_gbps']:6.0f} {r['best_pdl_gbps']:6.0f} {r['default_gbps']:7.0f} {r['cublas_gbps']:7.0f}")
    for key, v in (res.get("engine") or {}).items():
        if isinstance(v, dict) and "tokens_per_s" in v:
            log(f"{key:28s} {v['tokens_per_s']:7.1f} tok/s  replay {v['replay_ms']:.3f} ms")
    fails = [k for k, v in res["check"].items() if not v < 1e-2]
    fails += [k for k, v in res.get("decode_check", {}).items() if not v < 2e-2]
    fails += [k for k, v in (res.get("engine") or {}).items() if k.startswith("gemv tokens") and not v]
    log(f"checks: {len(res['check']) - len(fails)} ok, {len(fails)} failed {fails}; {res['seconds']:.0f} s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
