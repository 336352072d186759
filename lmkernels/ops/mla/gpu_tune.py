"""One GPU call: check the MLA kernels at real sizes (bf16 and FP8 caches, the fused write, prefill), then
A/B decode launch configurations (each checked first, with NaN past the sequences' ends) on representative
shapes, a table last. `python -m lmkernels.ops.mla.gpu_tune [out.json]`.
A development aid (its findings are in benchmarks/NOTES.md, issue 6), not a test."""

import json
import sys
import time

import torch

from lmkernels.bench import timing
from lmkernels.bench.ceilings import copy_bandwidth
from lmkernels.ops.mla import kernels, mla_decode, mla_prefill, new_latent_cache, reference, write_latent_cache
from lmkernels.ops.rope import build_cos_sin_cache

T0 = time.time()
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run through the interpreter
SHRINK = 1 if DEV == "cuda" else 40
SCALE = 192 ** -0.5
OUT = {"checks": [], "sweep": []}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def setup(lens, heads, n_new, page=64, fp8=False, dt=torch.bfloat16):
    batch = len(lens)
    width = max(1, max(-(-n // page) for n in lens))
    num_pages = batch * width + 1
    tables = torch.randperm(num_pages, device=DEV)[: batch * width].view(batch, width).to(torch.int32)
    rows = torch.randn(num_pages, page, 576, device=DEV)
    scales = None
    if fp8:
        cache, scales = reference.quantize_rows(rows)
    else:
        cache = rows.to(dt)
    q_nope = (torch.randn(batch, n_new, heads, 512, device=DEV) / 512 ** 0.25).to(dt)
    q_pe = (torch.randn(batch, n_new, heads, 64, device=DEV) / 64 ** 0.25).to(dt)
    return q_nope, q_pe, cache, scales, tables, torch.tensor(lens, dtype=torch.int32, device=DEV)


def record(name, o, lse, want, want_lse):
    """Log and store one check (output and LSE against the reference); True when within 1e-2."""
    fin = torch.isfinite(want_lse)
    e = rel(o, want)
    le = float((lse[fin].double() - want_lse[fin]).abs().max()) if fin.any() else 0.0
    ok = e < 1e-2 and le < 1e-2 and not torch.isnan(o).any()
    OUT["checks"].append(dict(name=name, err=e, lse_err=le, ok=bool(ok)))
    log(f"check {name}: rel err {e:.2e}, lse max abs err {le:.2e} {'ok' if ok else 'WRONG'}")
    return bool(ok)


def check_decode(name, lens, heads, n_new, page=64, fp8=False, **kw):
    lens = [max(1, n // SHRINK) for n in lens]
    q_nope, q_pe, cache, scales, tables, seq_lens = setup(lens, heads, n_new, page, fp8)
    o, lse = mla_decode(q_nope, q_pe, cache, tables, seq_lens, scale=SCALE, cache_scales=scales, **kw)
    want, want_lse = reference.mla_decode(q_nope, q_pe, cache, tables, seq_lens, SCALE, scales)
    return record(name, o, lse, want, want_lse)


def checks():
    check_decode("decode ragged B=4 H=16 Q=1 page 64", [1000, 8191, 77, 4096], 16, 1)
    check_decode("decode ragged B=3 H=16 Q=1 page 16 splits 7", [3000, 65, 1], 16, 1, page=16, num_splits=7)
    check_decode("decode B=2 H=128 Q=2 page 64", [3000, 1500], 128, 2)
    check_decode("decode B=3 H=128 Q=1 page 1", [300, 129, 5], 128, 1, page=1)
    check_decode("decode fp8 B=4 H=16 Q=1", [2000, 513, 64, 7], 16, 1, fp8=True)
    check_decode("decode fp8 B=2 H=128 Q=2", [1000, 300], 128, 2, fp8=True)
    # the fused write, bf16 and fp8
    n = 1000
    kv = torch.randn(n, 576, device=DEV, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(512, device=DEV)).to(torch.bfloat16)
    cs = build_cos_sin_cache(64, 4096, 10000.0, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
                             device=DEV)
    pos = torch.randint(0, 4096, (n,), device=DEV)
    slots = torch.randperm(64 * 20, device=DEV)[:n]
    want = reference.latent_rows(kv, w, cs, pos, 1e-6)
    cache, _ = new_latent_cache(20, 64, dtype=torch.bfloat16, device=DEV)
    write_latent_cache(kv, w, cs, pos, slots, cache)
    e = rel(cache.view(-1, 576)[slots], want)
    OUT["checks"].append(dict(name="write bf16", err=e, ok=e < 8e-3))
    log(f"check write bf16: {e:.2e}")
    c8, s8 = new_latent_cache(20, 64, dtype=torch.float8_e4m3fn, device=DEV)
    write_latent_cache(kv, w, cs, pos, slots, c8, cache_scales=s8)
    wv, ws = reference.quantize_rows(want.float())
    mism = float((c8.view(-1, 576)[slots].float() != wv.float()).float().mean())
    se = rel(s8.view(-1, 5)[slots], ws)
    OUT["checks"].append(dict(name="write fp8", mismatch=mism, scale_err=se, ok=mism < 1e-3 and se < 1e-6))
    log(f"check write fp8: value mismatch {mism:.2e}, scale err {se:.2e}")
    # prefill with a cached prefix
    heads, lens, q_lens = 16, [3000 // SHRINK, 700 // SHRINK], [500 // SHRINK, 700 // SHRINK]
    q_nope0, q_pe0, cache, _, tables, seq_lens = setup(lens, heads, 1)
    cu = torch.tensor([0, *q_lens], device=DEV).cumsum(0).to(torch.int32)
    qn = (torch.randn(sum(q_lens), heads, 128, device=DEV) / 128 ** 0.25).bfloat16()
    qp = (torch.randn(sum(q_lens), heads, 64, device=DEV) / 8 ** 0.5).bfloat16()
    wkv = (torch.randn(heads * 256, 512, device=DEV) / 512 ** 0.5).bfloat16()
    o = mla_prefill(qn, qp, cache, tables, cu, seq_lens, wkv, scale=SCALE, chunk_size=1024)
    rows = reference.gather_latents(cache, tables, seq_lens)
    errs = []
    for b in range(2):
        a, z = int(cu[b]), int(cu[b + 1])
        ref, _ = reference.mla_attention(qn[a:z], qp[a:z], rows[b], wkv, lens[b] - q_lens[b], SCALE, 128, 128)
        errs.append(rel(o[a:z], ref))
    OUT["checks"].append(dict(name="prefill chunked", err=max(errs), ok=max(errs) < 1e-2))
    log(f"check prefill chunked: {errs}")


def check_config(name, lens, heads, n_new, cfg, splits):
    """A launch configuration on a ragged batch, page 64, cache rows past each sequence's end poisoned with NaN
    (a TMA tile read without its mask shows), against the reference: before that configuration is timed."""
    lens = [max(1, n // SHRINK) for n in lens]
    q_nope, q_pe, cache, _, tables, seq_lens = setup(lens, heads, n_new)
    pos = torch.arange(tables.shape[1] * 64, device=DEV)
    stale = pos[None, :] >= seq_lens[:, None].long()  # [B, width · 64]
    flat = cache.view(-1, 576)
    rows = (tables.long()[:, pos // 64] * 64 + pos % 64)[stale]
    flat[rows] = float("nan")
    o, lse = kernels.mla_decode(q_nope, q_pe, cache, None, tables, seq_lens, SCALE, splits, max(lens), config=cfg)
    want, want_lse = reference.mla_decode(q_nope, q_pe, cache, tables, seq_lens, SCALE)
    return record(name, o, lse, want, want_lse)


def _splits(batch, heads, n_new, ctx, cand):
    mb = -(-heads * n_new // cand["BLOCK_M"])
    return kernels.decode_num_splits(batch, mb, ctx, kernels.sm_count(torch.device(DEV)), cand["PROGRAMS_PER_SM"],
                                     cand.get("MIN_KEYS", kernels.MIN_KEYS_PER_SPLIT))


def ab(name, shapes, candidates, budget_s):
    """Each candidate (launch config + split rule) checked, then timed on every shape; input sets made once per
    shape (rotated past L2). Prints a table of µs and GB/s / TFLOP/s per candidate and shape."""
    good = []
    for i, c in enumerate(candidates):
        b, s, h, q = shapes[0]
        try:
            if check_config(f"{name} cand {i} {c}", [1000, 8191, 77, 4096, 129], h, q, c, 3):
                good.append(i)
        except Exception as e:  # noqa: BLE001
            log(f"  {name} cand {i}: check failed {type(e).__name__} {str(e)[:200]}")
    for shape in shapes:
        if time.time() - T0 > budget_s:
            log(f"{name}: time budget reached before {shape}")
            break
        batch, ctx, heads, n_new = shape
        nbytes = batch * ctx * 1152 + batch * n_new * heads * 2176
        flops = batch * n_new * heads * ctx * 2176
        n_sets = timing.rotation_count(nbytes, timing.l2_bytes())
        sets = []
        for _ in range(n_sets):
            q_nope, q_pe, cache, _, tables, lens = setup([ctx] * batch, heads, n_new)
            sets.append((q_nope, q_pe, cache, tables, lens))
        for i in good:
            c = dict(candidates[i])
            splits = _splits(batch, heads, n_new, ctx, c)
            fn = lambda qn, qp, c_, t, l: kernels.mla_decode(qn, qp, c_, None, t, l, SCALE, splits, ctx, config=c)  # noqa
            try:
                ms = timing.time_ms(fn, sets)
            except Exception as e:  # noqa: BLE001
                log(f"  {name} cand {i} {shape}: {type(e).__name__} {str(e)[:120]}")
                continue
            r = dict(ab=name, cand=i, cfg=c, batch=batch, ctx=ctx, heads=heads, q=n_new, splits=splits, us=ms * 1e3,
                     gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9)
            OUT["sweep"].append(r)
            log(f"  {name} c{i} B={batch} ctx={ctx} H={heads} Q={n_new} splits {splits}: {ms * 1e3:.1f} us "
                f"{r['gbps']:.0f} GB/s {r['tflops']:.1f} TFLOP/s")
        del sets
        torch.cuda.empty_cache()


def merge_only(shapes):
    """The separate merge kernel alone on ready partials (batch, rows, splits): its share of a decode call."""
    for batch, rows, splits in shapes:
        part_o = torch.randn(batch * splits, 1, rows, 512, device=DEV)
        part_l = torch.randn(batch * splits, 1, rows, device=DEV)
        sched = torch.tensor([[b * splits, splits] for b in range(batch)], dtype=torch.int32, device=DEV)
        o = torch.empty(batch, 1, rows, 512, dtype=torch.bfloat16, device=DEV)
        lse = torch.empty(batch, 1, rows, device=DEV)
        ms = timing.time_ms(lambda: kernels.merge_partials(part_o, part_l, sched, o, lse, splits))
        OUT["sweep"].append(dict(ab="merge only", batch=batch, rows=rows, splits=splits, us=ms * 1e3))
        log(f"  merge kernel alone B={batch} rows {rows} splits {splits}: {ms * 1e3:.1f} us")


def table():
    for name in dict.fromkeys(r["ab"] for r in OUT["sweep"] if r["ab"] != "merge only"):
        rows = [r for r in OUT["sweep"] if r["ab"] == name]
        shapes = list(dict.fromkeys((r["batch"], r["ctx"], r["heads"], r["q"]) for r in rows))
        print(f"== {name}: us (GB/s | TFLOP/s) per shape", flush=True)
        for i in sorted({r["cand"] for r in rows}):
            cells = []
            for sh in shapes:
                r = next((r for r in rows if r["cand"] == i and (r["batch"], r["ctx"], r["heads"], r["q"]) == sh), None)
                unit = f"{r['tflops']:.0f}T" if r and sh[2] * sh[3] >= 128 else (f"{r['gbps']:.0f}" if r else "")
                cells.append(f"{r['us']:.1f}us {unit} s{r['splits']}" if r else "-")
            print(f"c{i}: " + " | ".join(f"{sh[0]}x{sh[1]}: {c}" for sh, c in zip(shapes, cells)), flush=True)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "mla_tune.json"
    OUT["copy"] = copy_bandwidth()["copy_gbps"] if DEV == "cuda" else 0.0
    log(f"copy {OUT['copy']:.0f} GB/s")
    checks()
    if DEV != "cuda":
        return
    d16, d32, d64 = (kernels.decode_config(r) for r in (16, 32, 64))
    sep = dict(FUSED_MERGE=False)  # the separate merge kernel (fp32 partials) against the default in-kernel merge
    ab("16 rows", [(32, 8192, 16, 1), (128, 1024, 16, 1), (32, 1024, 16, 1), (128, 8192, 16, 1)],
       [dict(d16, **sep), d16], 70)
    ab("32 rows", [(32, 8192, 16, 2)], [dict(d32, **sep), d32], 85)
    ab("128 rows", [(32, 1024, 128, 1), (32, 8192, 128, 1)], [dict(d64, **sep), d64], 100)
    merge_only([(32, 16, 8), (128, 16, 2), (32, 16, 4)])
    with open(path, "w") as f:
        json.dump(OUT, f, indent=1)
    table()
    log("done")


if __name__ == "__main__":
    main()
