"""GPU check and benchmark of the attention ops: `python -m lmkernels.ops.attention.gpu_selftest`.

1. Checks every op at real sizes in bf16 (and fp16 / FP8 where they apply) against reference.py (fp32)
   or SDPA, printing the relative error and pass/FAIL per case.
2. Times causal prefill (B=1, 32 q heads, 8 kv heads, dim 128 at 2k/8k/32k tokens; a few other shapes)
   against SDPA's flash and cuDNN backends, and paged decode (32 q / 8 kv heads, dim 128) against SDPA on
   contiguous caches, with the copy bandwidth measured in the same run. `triton.testing.do_bench` medians;
   decode inputs rotate across copies larger than L2.

Options: --check-only, --bench-only, --sweep (also time alternative launch configs: prefill tiles and
decode tiles/stages/splits, for tuning the heuristics), --json PATH (write the rows). Lean enough for a
10-minute budget on one H100/H200 (~1–3 min without --sweep, most of it compilation).
"""

import argparse
import itertools
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from . import (attention_decode, attention_prefill, attention_prefill_paged, merge_attention_states, reference,
               write_kv_cache)

TOL_BF16, TOL_FP16, TOL_FP8 = 1e-2, 2e-3, 5e-2
ROWS = []


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------------
# checks


def _packed(lens_q, lens_k, hq, hk, dqk, dv, dtype, dev):
    cu_q = torch.tensor([0, *lens_q], device=dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=dev).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), hq, dqk, device=dev, dtype=dtype)
    k = torch.randn(sum(lens_k), hk, dqk, device=dev, dtype=dtype)
    v = torch.randn(sum(lens_k), hk, dv, device=dev, dtype=dtype)
    return q, k, v, cu_q, cu_k


def _paged(lens, hk, d, page_size, dtype, dev, extra_pages=0):
    """Shuffled pages; every slot random (unused ones too) so stray reads show."""
    per_seq = [-(-n // page_size) for n in lens]
    width = max(per_seq) + extra_pages
    num_pages = len(lens) * width
    tables = torch.randperm(num_pages, device=dev).to(torch.int32).view(len(lens), width)
    k_cache = torch.randn(num_pages, page_size, hk, d, device=dev, dtype=dtype)
    v_cache = torch.randn(num_pages, page_size, hk, d, device=dev, dtype=dtype)
    return k_cache, v_cache, tables, torch.tensor(lens, device=dev, dtype=torch.int32)


def _report_diff(name, got, want, source=None, limit=6) -> bool:
    """True if equal bit for bit; else print how many elements differ and the first few (index, ours, want,
    and the unrounded value they came from)."""
    a, b = (got.view(torch.uint8), want.view(torch.uint8)) if got.element_size() == 1 else (got, want)
    diff = (a != b)
    if not diff.any():
        return True
    idx = diff.nonzero()[:limit]
    print(f"    {name}: {int(diff.sum())} of {diff.numel()} elements differ; first:")
    for i in idx.tolist():
        g, w = got[tuple(i)].float().item(), want[tuple(i)].float().item()
        src = f" from {source[tuple(i)].item()!r}" if source is not None else ""
        print(f"      {tuple(i)}: ours {g!r} want {w!r}{src}")
    return False


def _checks(dev, small=False):
    """[(name, thunk → (rel err, limit))]. small: tiny shapes and fp16 for the CPU interpreter (a dry run)."""
    from . import kernels

    bf, fp = (torch.float16 if small else torch.bfloat16), torch.float16
    tol = {torch.bfloat16: TOL_BF16, torch.float16: TOL_FP16}
    L = (lambda n: min(n, 3 + n % 40)) if small else (lambda n: n)  # noqa: E731  lengths
    H = (lambda h: max(1, h // 8)) if small else (lambda h: h)  # noqa: E731  heads
    N = (lambda n: max(4, n // 64)) if small else (lambda n: n)  # noqa: E731  sizes of the write/merge checks
    cases = []

    def case(name):
        def add(fn):
            cases.append((name, fn))
            return fn
        return add

    def prefill_case(lens_q, lens_k, hq, hk, dqk, dv, dtype, path, kw):
        lens_q, lens_k = [L(n) for n in lens_q], [L(n) for n in lens_k]
        q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, H(hq), H(hk), dqk, dv, dtype, dev)
        # path ws: the Gluon kernel where it applies (prefill_ws.py; elsewhere the Triton kernel); ptr / tma: the
        # Triton kernel's two load paths
        kernels.PREFILL_WS = None if path == "ws" else False
        kernels.PREFILL_TMA = path == "tma"
        try:
            o, lse = attention_prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                       return_lse=True, **kw)
        finally:
            kernels.PREFILL_TMA = kernels.PREFILL_WS = None
        ro, rl = reference.attention_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, **{"causal": True, **kw})
        fin = torch.isfinite(rl)
        err = max(rel_err(o, ro), rel_err(lse[fin], rl[fin]))
        return (err if torch.equal(torch.isneginf(lse), torch.isneginf(rl)) else float("inf")), tol[dtype]

    ragged = [1, 17, 500, 1023, 2053, 0, 64]
    prefills = [
        ("causal 32/8 d128 ragged", ragged, ragged, 32, 8, 128, 128, bf, {}),
        ("fp16 causal 32/8 d128", ragged, ragged, 32, 8, 128, 128, fp, {}),
        ("non-causal 16/16 d64", ragged, ragged, 16, 16, 64, 64, bf, {"causal": False}),
        ("causal 8/1 d96", [300, 7], [300, 7], 8, 1, 96, 96, bf, {}),
        ("causal 8/2 d256", [700, 129], [700, 129], 8, 2, 256, 256, bf, {}),
        ("causal 16/16 d192/128 (MLA)", [700, 129], [700, 129], 16, 16, 192, 128, bf, {}),
        ("causal 8/2 d256/128", [700, 129], [700, 129], 8, 2, 256, 128, bf, {}),
        ("k<q causal 8/8 d128 (rows without keys)", [300, 65], [50, 65], 8, 8, 128, 128, bf, {}),
        ("q<k (chunk) 32/8 d128", [256, 100, 1], [2000, 101, 900], 32, 8, 128, 128, bf, {}),
        ("window(256,0)+softcap50", [1500, 77], [1500, 77], 16, 4, 128, 128, bf, {"window": (256, 0), "softcap": 50.0}),
        ("window(64,64) non-causal", [900], [900], 8, 2, 128, 128, bf, {"causal": False, "window": (64, 64)}),
    ]
    for path in ("ws", "ptr", "tma"):
        for name, lq, lk, hq, hk, dqk, dv, dt, kw in prefills:
            cases.append((f"prefill[{path}] {name}",
                          lambda a=(lq, lk, hq, hk, dqk, dv, dt, path, kw): prefill_case(*a)))

    @case("prefill dense causal vs SDPA (fp32)")
    def _():
        s_, hq, hk = L(1000), H(32), H(8)
        q = torch.randn(2, s_, hq, 128, device=dev, dtype=bf)
        k, v = torch.randn(2, s_, hk, 128, device=dev, dtype=bf), torch.randn(2, s_, hk, 128, device=dev, dtype=bf)
        o = attention_prefill(q, k, v, causal=True)
        rep = hq // hk
        kt, vt = (x.transpose(1, 2).repeat_interleave(rep, 1).float() for x in (k, v))
        sdpa = F.scaled_dot_product_attention(q.transpose(1, 2).float(), kt, vt, is_causal=True)
        return rel_err(o, sdpa.transpose(1, 2)), tol[bf]

    @case("prefill paged (append), shuffled pages 16")
    def _():
        seq, new = [L(n) for n in (3000, 517, 64, 1)], [L(n) for n in (1000, 517, 1, 1)]
        new = [min(a, b) for a, b in zip(new, seq)]
        kc, vc, tables, seq_lens = _paged(seq, H(8), 128, 16, bf, dev)
        cu = torch.tensor([0, *new], device=dev).cumsum(0).to(torch.int32)
        q = torch.randn(sum(new), H(32), 128, device=dev, dtype=bf)
        o, lse = attention_prefill_paged(q, kc, vc, tables, cu, seq_lens, max_seqlen_q=max(new), return_lse=True)
        ro, rl = reference.attention_prefill_paged(q.float(), kc, vc, tables, cu, seq_lens)
        return max(rel_err(o, ro), rel_err(lse, rl)), tol[bf]

    @case("write_kv_cache bf16 + fp8 (exact: 0 = equal)")
    def _():
        pages, tokens, hk = N(512), N(3000), H(8)
        kn, vn = torch.randn(tokens, hk, 128, device=dev, dtype=bf), torch.randn(tokens, hk, 128, device=dev, dtype=bf)
        slots = torch.randperm(pages * 16, device=dev)[:tokens]
        slots[::7] = -1
        k_cache = torch.randn(pages, 16, hk, 128, device=dev, dtype=bf)
        v_cache = torch.randn_like(k_cache)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        reference.write_kv_cache(kn, vn, want_k, want_v, slots)
        write_kv_cache(kn, vn, k_cache, v_cache, slots)
        same = _report_diff("bf16 k_cache", k_cache, want_k) & _report_diff("bf16 v_cache", v_cache, want_v)
        k8 = torch.zeros(pages, 16, hk, 128, device=dev, dtype=torch.float8_e4m3fn)
        v8 = torch.zeros_like(k8)
        ks, vs = torch.rand(hk, device=dev) * 0.02 + 0.005, torch.rand(hk, device=dev) * 0.02 + 0.005
        want_k, want_v = k8.clone(), v8.clone()
        reference.write_kv_cache(kn, vn, want_k, want_v, slots, ks, vs)
        write_kv_cache(kn, vn, k8, v8, slots, k_scale=ks, v_scale=vs)
        src_k = torch.zeros(pages * 16, hk, 128, device=dev)  # x / scale (fp32, as torch divides) per slot
        src_v = torch.zeros_like(src_k)
        keep = slots >= 0
        src_k[slots[keep]] = kn[keep].float() / ks[:, None]
        src_v[slots[keep]] = vn[keep].float() / vs[:, None]
        same &= _report_diff("fp8 k_cache", k8, want_k, src_k.view(k8.shape))
        same &= _report_diff("fp8 v_cache", v8, want_v, src_v.view(v8.shape))
        return float(not same), 0.5

    lens = [L(n) for n in (1, 17, 4095, 2222, 64, 0, 1000, 3333)]
    hq, hk = H(32), H(8)

    def decode_case(page, n_new, splits):
        kc, vc, tables, seq_lens = _paged(lens, hk, 128, page, bf, dev, extra_pages=2)
        q = torch.randn(len(lens), n_new, hq, 128, device=dev, dtype=bf)
        ro, rl = reference.attention_decode(q.float(), kc, vc, tables, seq_lens)
        o, lse = attention_decode(q, kc, vc, tables, seq_lens, num_splits=splits, return_lse=True)
        fin = torch.isfinite(rl)
        err = max(rel_err(o, ro), rel_err(lse[fin], rl[fin]))
        return (err if torch.equal(torch.isneginf(lse), torch.isneginf(rl)) else float("inf")), tol[bf]

    for page in (16, 64):
        for n_new in (1, 4):
            for splits in (None, 1, 7):
                cases.append((f"decode page {page} q {n_new} splits {splits}",
                              lambda a=(page, n_new, splits): decode_case(*a)))

    @case("decode window 300 + softcap 30")
    def _():
        q = torch.randn(len(lens), 2, hq, 128, device=dev, dtype=bf)
        kc, vc, tables, seq_lens = _paged(lens, hk, 128, 16, bf, dev)
        o = attention_decode(q, kc, vc, tables, seq_lens, window=(L(300), -1), softcap=30.0)
        ro, _ = reference.attention_decode(q.float(), kc, vc, tables, seq_lens, window=(L(300), -1), softcap=30.0)
        return rel_err(o, ro), tol[bf]

    for d in (64, 256):
        @case(f"decode d{d} 16/2")
        def _(d=d):
            kc, vc, tables, seq_lens = _paged(lens, H(2), d, 32, bf, dev)
            q = torch.randn(len(lens), 1, H(16), d, device=dev, dtype=bf)
            ro, _ = reference.attention_decode(q.float(), kc, vc, tables, seq_lens)
            return rel_err(attention_decode(q, kc, vc, tables, seq_lens), ro), tol[bf]

    @case("decode fp8 cache vs bf16 cache")
    def _():
        kc, vc, tables, seq_lens = _paged(lens, hk, 128, 16, bf, dev)
        ks, vs = kc.float().abs().amax((0, 1, 3)) / 448, vc.float().abs().amax((0, 1, 3)) / 448
        k8, v8 = reference.quantize_fp8(kc, ks), reference.quantize_fp8(vc, vs)
        q = torch.randn(len(lens), 1, hq, 128, device=dev, dtype=bf)
        o = attention_decode(q, k8, v8, tables, seq_lens, k_scale=ks, v_scale=vs)
        ro, _ = reference.attention_decode(q.float(), kc, vc, tables, seq_lens)
        return rel_err(o, ro), TOL_FP8

    @case("decode after prefill = prefill")
    def _():
        lens2 = [L(n) for n in (777, 1, 2048)]
        q, k, v, cu, _ = _packed(lens2, lens2, hq, hk, 128, 128, bf, dev)
        o_pre = attention_prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens2))
        kc, vc, tables, seq_lens = _paged(lens2, hk, 128, 16, bf, dev)
        slots = torch.cat([tables[b, torch.arange(n, device=dev) // 16].long() * 16 + torch.arange(n, device=dev) % 16
                           for b, n in enumerate(lens2)])
        write_kv_cache(k, v, kc, vc, slots)
        last = cu[1:].long() - 1
        o = attention_decode(q[last][:, None], kc, vc, tables, seq_lens)
        return rel_err(o[:, 0], o_pre[last]), tol[bf]

    @case("decode persistent, skewed batch, 20 launches (races)")
    def _():
        lens_s = [L(n) for n in (20000, 1, 700, 4095, 64, 0, 333, 9000)]
        kc, vc, tables, seq_lens = _paged(lens_s, hk, 128, 16, bf, dev)
        q = torch.randn(len(lens_s), 2, hq, 128, device=dev, dtype=bf)
        ro, rl = reference.attention_decode(q.float(), kc, vc, tables, seq_lens)
        fin = torch.isfinite(rl)
        worst = 0.0
        for _ in range(20):  # a missing barrier or fence between a partial and the merge shows as a moving error
            o, lse = attention_decode(q, kc, vc, tables, seq_lens, return_lse=True)
            ok = torch.equal(torch.isneginf(lse), torch.isneginf(rl))
            worst = max(worst, rel_err(o, ro), rel_err(lse[fin], rl[fin]), 0.0 if ok else float("inf"))
        return worst, tol[bf]

    @case("decode under CUDA-graph capture = eager")
    def _():
        kc, vc, tables, seq_lens = _paged(lens, hk, 128, 16, bf, dev)
        q = torch.randn(len(lens), 1, hq, 128, device=dev, dtype=bf)
        attention_decode(q, kc, vc, tables, seq_lens)  # compile outside the capture
        if not q.is_cuda:
            return 0.0, tol[bf]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = attention_decode(q, kc, vc, tables, seq_lens)
        seq_lens.copy_(seq_lens.flip(0))  # new lengths, same graph
        g.replay()
        ro, _ = reference.attention_decode(q.float(), kc, vc, tables, seq_lens)
        return rel_err(out, ro), tol[bf]

    @case("merge_attention_states")
    def _():
        n = N(4096)
        o_a, o_b = torch.randn(n, hq, 128, device=dev, dtype=bf), torch.randn(n, hq, 128, device=dev, dtype=bf)
        l_a, l_b = torch.randn(n, hq, device=dev) * 4, torch.randn(n, hq, device=dev) * 4
        l_a[::5] = float("-inf")
        o, lse = merge_attention_states(o_a, l_a, o_b, l_b)
        ro, rl = reference.merge_states(o_a.float(), l_a, o_b.float(), l_b)
        return max(rel_err(o, ro), rel_err(lse, rl)), tol[bf]

    return cases


def run_checks(dev, small=False) -> int:
    g = torch.Generator(device="cpu").manual_seed(int(time.time()))
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))  # fresh inputs on every run
    print(f"\n{'check':<48} {'rel err':>9} {'limit':>7}  result")
    failures = 0
    for name, fn in _checks(dev, small):
        try:
            err, tol = fn()
            ok = err < tol
            txt = f"{err:9.2e} {tol:7.0e}  {'pass' if ok else 'FAIL'}"
        except Exception as e:  # report and go on: one broken case must not hide the others
            ok, err, tol = False, float("nan"), float("nan")
            txt = f"ERROR {type(e).__name__}: {str(e)[:150]}"
        failures += not ok
        print(f"{name:<48} {txt}", flush=True)
        ROWS.append(dict(kind="check", name=name, rel_err=err, limit=tol, ok=ok))
    print(f"{failures} check failure(s)" if failures else "all checks passed")
    return failures


# ---------------------------------------------------------------------------------------------------
# benchmarks


def bench(fn, rep=50):
    """Median ms per call of fn replayed from a CUDA graph (so host overhead does not count: decode kernels
    run for ~10 µs, less than a Python launch); plain do_bench if capture fails."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as e:
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {str(e)[:100]}; timing without a graph)")
        return triton.testing.do_bench(fn, warmup=25, rep=rep * 4, return_mode="median")


def _row(section, name, ms, value, unit, extra=""):
    ROWS.append(dict(kind="bench", section=section, name=name, ms=ms, value=value, unit=unit, note=extra))
    print(f"  {name:<46} {ms:9.3f} ms {value:9.1f} {unit:<7} {extra}", flush=True)


def copy_bandwidth(dev):
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    import triton.testing

    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() / ms / 1e6  # GB/s, read + write


def _sdpa(q, k, v, backend, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def run():
        with sdpa_kernel(b):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def bench_prefill(dev, sweep):
    from . import kernels

    print("\nprefill (bf16, B=1, TFLOP/s; SDPA gets kv heads repeated to the q heads)")
    shapes = [(2048, 32, 8, 128, True), (8192, 32, 8, 128, True), (32768, 32, 8, 128, True),
              (8192, 32, 8, 128, False), (8192, 32, 8, 64, True), (8192, 16, 4, 256, True)]
    for s, hq, hk, d, causal in shapes:
        q = torch.randn(s, hq, d, device=dev, dtype=torch.bfloat16)
        k, v = torch.randn(s, hk, d, device=dev, dtype=torch.bfloat16), torch.randn(s, hk, d, device=dev,
                                                                                    dtype=torch.bfloat16)
        cu = torch.tensor([0, s], device=dev, dtype=torch.int32)
        flops = 4 * s * s * hq * d / (2 if causal else 1)
        tag = f"S={s} {hq}/{hk} d{d} {'causal' if causal else 'full'}"
        best = float("inf")
        for tma in (True, False):  # the two load paths of the prefill kernel (kernels.PREFILL_TMA)
            kernels.PREFILL_TMA = tma
            try:
                ms = bench(lambda: attention_prefill(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                     max_seqlen_q=s))
                _row("prefill", f"ours-{'tma' if tma else 'ptr'} {tag}", ms, flops / ms / 1e9, "TFLOP/s")
                best = min(best, ms)
            except Exception as e:
                print(f"  ours-{'tma' if tma else 'ptr'} {tag}: failed ({type(e).__name__}: {str(e)[:100]})")
            finally:
                kernels.PREFILL_TMA = None
        ours = best
        qt = q[None].transpose(1, 2)
        kt = k[None].transpose(1, 2).repeat_interleave(hq // hk, 1)
        vt = v[None].transpose(1, 2).repeat_interleave(hq // hk, 1)
        for backend in ("cudnn", "flash"):
            try:
                ms = bench(_sdpa(qt, kt, vt, backend, causal))
                _row("prefill", f"sdpa-{backend} {tag}", ms, flops / ms / 1e9, "TFLOP/s", f"best ours {ms / ours:.2f}x")
            except Exception as e:
                print(f"  sdpa-{backend} {tag}: unavailable ({type(e).__name__}: {str(e)[:80]})")
        if sweep and s == 8192 and d == 128 and causal:
            for bm, bn, w, st, tma in itertools.product((128,), (64, 128), (8,), (2, 3, 4), (True, False)):
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, TMA=tma)
                try:
                    ms = bench(lambda: kernels.prefill(q, k, v, cu, cu, s, d ** -0.5, True, (-1, -1), 0.0, False,
                                                       config=cfg))
                    _row("prefill-sweep", f"  {bm}x{bn} w{w} s{st} {'tma' if tma else 'ptr'} {tag}", ms,
                         flops / ms / 1e9, "TFLOP/s")
                except Exception as e:
                    print(f"  cfg {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
        del q, k, v, kt, vt
    # a varlen batch of mixed lengths
    lens = [8192, 4096, 2048, 1024, 512, 300, 100, 7000]
    q, k, v, cu, _ = _packed(lens, lens, 32, 8, 128, 128, torch.bfloat16, dev)
    flops = sum(4 * n * n * 32 * 128 / 2 for n in lens)
    ms = bench(lambda: attention_prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens)))
    _row("prefill", "ours varlen mixed (8 seqs, 23k tok) causal", ms, flops / ms / 1e9, "TFLOP/s")


def bench_decode(dev, copy_gbs, sweep):
    from . import kernels

    print(f"\ndecode (bf16, 32 q / 8 kv heads, d128, GB/s of KV read; copy ceiling {copy_gbs:.0f} GB/s)")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    configs = [(1, 8192, 16), (1, 8192, 64), (32, 4096, 16), (32, 4096, 64), (64, 16384, 16), (64, 16384, 64)]
    for batch, ctx, page in configs:
        kv_bytes = batch * ctx * 8 * 128 * 2 * 2
        copies = max(1, math.ceil(3 * l2 / kv_bytes))  # rotate inputs across > L2
        sets = [_paged([ctx] * batch, 8, 128, page, torch.bfloat16, dev) for _ in range(copies)]
        qs = [torch.randn(batch, 1, 32, 128, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        cyc = itertools.cycle(range(copies))
        tag = f"B={batch} ctx={ctx} page={page}"
        splits = kernels.decode_num_splits(batch, 8, 1, ctx, kernels.sm_count(dev))

        def ours(ns=None):
            i = next(cyc)
            kc, vc, tables, lens = sets[i]
            return attention_decode(qs[i], kc, vc, tables, lens, num_splits=ns, max_seqlen_k=ctx)

        ms = bench(ours)
        _row("decode", f"ours {tag}", ms, kv_bytes / ms / 1e6, "GB/s",
             f"{kv_bytes / ms / 1e6 / copy_gbs:.0%} of copy, splits {splits}")
        if sweep and batch == 1:
            for ns in (4, 8, 16, 32, 64):
                ms2 = bench(lambda: ours(ns))
                _row("decode-sweep", f"  splits {ns} {tag}", ms2, kv_bytes / ms2 / 1e6, "GB/s")
        if page == 16:  # SDPA on contiguous caches (the page size does not apply)
            kt = [torch.randn(batch, 8, ctx, 128, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            vt = [torch.randn(batch, 8, ctx, 128, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            qt = [x.transpose(1, 2) for x in qs]

            from torch.nn.attention import SDPBackend, sdpa_kernel

            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                def sdpa(backend=backend):
                    i = next(cyc)
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(qt[i], kt[i], vt[i], enable_gqa=True)

                try:
                    ms2 = bench(sdpa)
                    _row("decode", f"sdpa-{name}(gqa) B={batch} ctx={ctx} contiguous", ms2, kv_bytes / ms2 / 1e6,
                         "GB/s", f"ours(page 16) {ms2 / ms:.2f}x")
                except Exception as e:
                    print(f"  sdpa-{name} {tag}: unavailable ({type(e).__name__}: {str(e)[:80]})")
            del kt, vt
        sets = qs = None  # free before the next configuration allocates
        torch.cuda.empty_cache()
    if sweep:
        kc, vc, tables, lens = _paged([4096] * 32, 8, 128, 16, torch.bfloat16, dev)
        q = torch.randn(32, 1, 32, 128, device=dev, dtype=torch.bfloat16)
        kv_bytes = 32 * 4096 * 8 * 128 * 4
        for bn, st, w in itertools.product((32, 64, 128), (3, 5), (4, 8)):
            cfg = dict(BLOCK_M=16, BLOCK_N=bn, num_warps=w, num_stages=st)
            ms = bench(lambda: kernels.decode(q, kc, vc, tables, lens, 128 ** -0.5, (-1, -1), 0.0, None, 4096,
                                              None, None, False, config=cfg))
            _row("decode-sweep", f"  cfg n{bn} s{st} w{w} B=32 ctx=4096", ms, kv_bytes / ms / 1e6, "GB/s")
    # skewed batch: one 32k sequence + 31 of 512 (page 16)
    lens = [32768] + [512] * 31
    kc, vc, tables, seq_lens = _paged(lens, 8, 128, 16, torch.bfloat16, dev)
    q = torch.randn(32, 1, 32, 128, device=dev, dtype=torch.bfloat16)
    kv_bytes = sum(lens) * 8 * 128 * 4
    ms = bench(lambda: attention_decode(q, kc, vc, tables, seq_lens))
    _row("decode", "ours skewed 1x32k + 31x512 page 16", ms, kv_bytes / ms / 1e6, "GB/s",
         f"{kv_bytes / ms / 1e6 / copy_gbs:.0%} of copy")


def sweep_decode(dev, copy_gbs):
    """Decode schedules and tiles on the batches where the heuristic's choice was below its goal: B=1 at 8k,
    the skewed batch, the FP8 cache; B=32 at 4k as the control. Inputs rotate past L2 (lmkernels.bench.timing)."""
    from lmkernels.bench import timing

    from . import kernels

    scale = 128 ** -0.5
    batches = (("B=1 ctx=8192", [8192], False), ("B=32 ctx=4096", [4096] * 32, False),
               ("skewed 1x32k+31x512", [32768] + [512] * 31, False), ("B=32 ctx=4096 fp8", [4096] * 32, True))
    bf16_cfgs = ((128, 3, 4), (64, 5, 4), (128, 4, 4))
    fp8_cfgs = ((128, 3, 4), (128, 5, 4), (64, 7, 4), (64, 9, 4), (256, 3, 8))
    print("\ndecode sweep (GB/s of KV read; persistent: programs, tile, stages, warps; split: splits)")
    for tag, lens, fp8 in batches:
        elem = 1 if fp8 else 2
        kv_bytes = sum(lens) * 8 * 128 * 2 * elem
        n_sets = timing.rotation_count(kv_bytes, timing.l2_bytes())
        sets = []
        for _ in range(n_sets):
            kc, vc, tables, seq_lens = _paged(lens, 8, 128, 16, torch.bfloat16, dev)
            ks = vs = None
            if fp8:
                ks, vs = torch.rand(8, device=dev) * 0.01 + 0.005, torch.rand(8, device=dev) * 0.01 + 0.005
                kc = (kc.float() / ks[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
                vc = (vc.float() / vs[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            q = torch.randn(len(lens), 1, 32, 128, device=dev, dtype=torch.bfloat16)
            sets.append((q, kc, vc, tables, seq_lens, ks, vs))
        ctx = max(lens)
        variants = []
        for n_prog in (132, 264, 396):
            for bn, st, w in (fp8_cfgs if fp8 else bf16_cfgs):
                variants.append((f"persistent p{n_prog} n{bn} s{st} w{w}",
                                 None, dict(BLOCK_M=16, BLOCK_N=bn, num_warps=w, num_stages=st, PROGRAMS=n_prog)))
        for ns in ((8, 16, 32, 64) if len(lens) == 1 else (1, 2, 4)):
            variants.append((f"split {ns} n64 s5", ns, dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=5)))
        for name, ns, cfg in variants:
            def call(q, kc, vc, tables, seq_lens, ks, vs, ns=ns, cfg=cfg):
                return kernels.decode(q, kc, vc, tables, seq_lens, scale, (-1, -1), 0.0, ns, ctx, ks, vs, False,
                                      config=dict(cfg))
            try:
                ms = timing.time_ms(call, sets)
                _row("decode-sweep", f"{tag} {name}", ms, kv_bytes / ms / 1e6, "GB/s",
                     f"{kv_bytes / ms / 1e6 / copy_gbs:.0%} of copy")
            except Exception as e:
                print(f"  {tag} {name}: failed ({type(e).__name__}: {str(e)[:120]})")
        del sets
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--bench-only", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time alternative launch configs")
    p.add_argument("--sweep-decode", action="store_true", help="only the decode schedule/tile sweep")
    p.add_argument("--json", help="write all rows to this JSON file")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run the checks at tiny sizes in fp16 through the Triton interpreter (no GPU needed)")
    args = p.parse_args(argv)
    if args.cpu_dry_run:
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":  # the package has imported the kernels (and triton's jit)
            # already: run again in a process that has the interpreter from its start
            os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *(sys.argv[1:] if argv is None else argv)],
                      {**os.environ, "TRITON_INTERPRET": "1"})
        return 1 if run_checks(torch.device("cpu"), small=True) else 0
    if not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-dry-run, or the CPU tests (pytest tests/ops/test_attention*.py)")
        return 1
    import triton

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MB; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    if args.sweep_decode:
        sweep_decode(dev, copy_bandwidth(dev))
        return 0
    t0 = time.time()
    failures = 0 if args.bench_only else run_checks(dev)
    print(f"(checks {time.time() - t0:.0f}s)")
    if not args.check_only:
        torch.manual_seed(0)
        copy_gbs = copy_bandwidth(dev)
        _row("ceiling", "device copy 1 GiB (read + write)", 0.0, copy_gbs, "GB/s")
        bench_prefill(dev, args.sweep)
        bench_decode(dev, copy_gbs, args.sweep)
    print(f"(total {time.time() - t0:.0f}s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__,
                           date=time.strftime("%Y-%m-%d"), rows=ROWS), f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
