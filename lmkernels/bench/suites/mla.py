"""MLA absorbed decode, bf16 latent cache [pages, 64, 576]: B ∈ {1, 32, 128} × context ∈ {1k, 8k, 32k} × heads
∈ {16, 128}, one query token, plus two-token (MTP) rows and 128 heads at B=4 × 1k / 4k, against SDPA on the
materialised equivalent (MQA: q [B, H, Q, 576] against one KV head k [B, 1, S, 576], v = its first 512 columns,
enable_gqa) and FlashInfer's paged MLA decode where it is installed; then skewed batches (a few long sequences among
short ones, informational: ours against its members run apart and against FlashInfer).

FlashInfer (BatchMLAPagedAttentionWrapper, the strongest MLA peer that runs on these machines; FlashMLA does not
travel) reads the same paged cache and page tables as ours, with q packed as [B·Q, H, 576]; each of its Hopper
backends (fa3, fa2) is a peer of its own, planned once outside the timing as our schedule is made once per step.

Rows use the attention suite's schema. Memory-bound rows (heads × query tokens < 128): unit GB/s, bytes =
latent cache rows read + q read + o written, goal ≥ 85% of the copy bandwidth measured in the same run.
Compute-bound rows (heads × query tokens ≥ 128): unit TFLOP/s, FLOPs = B·Q·H·S·(2·576 + 2·512), goal ≥ 50%
of the bf16 GEMM TFLOP/s measured in the same run (goal["gemm"], with pct_gemm in the row). The issue states no
peer goal; "ours / best" is against the fastest peer that ran. Each implementation is checked before it is
timed: ours and FlashInfer against an fp32 reference of the same math (gathered dense) on the first input set,
SDPA against ours' reference.

FlexAttention (torch.nn.attention.flex_attention under torch.compile(fullgraph=True, dynamic=False)) runs as a
peer on the same dense equivalent as SDPA (q [B, H, Q, 576], k [B, 1, S, 576], v its first 512 columns,
enable_gqa; a block mask "key ≤ context − Q + query" on the MTP rows), checked like SDPA. It compiles once per
shape (dynamo reset before each, so the compile is real and no recompile limit turns it into eager), so it runs
only on the FLEX_ROWS (the quick rows: one row of each kind), each compile attempt under FLEX_TIMEOUT_S and all
of them under FLEX_BUDGET_S, so that the suite stays inside one 10-minute device call. Where the default kernel
options do not compile or run, the FLEX_VARIANTS after it are tried in order (smaller key tiles, one stage; then
the non-decoding flex kernel), each the same math; where none runs the row records "does not run: <error>" for
the peer (the root cause of the compile error, not the wrapper's first line) and the suite goes on.
Seen on the H100 (torch 2.11, triton 3.6, 2026-11-23): flex's decoding kernel pads the qk dim 576 to 1024 and
compiles in 8–14 s at 16 heads; at 128 heads (one 128-row block of a 1024-wide q) it needs 336 KB (320 KB with
32-key tiles) of shared memory and does not compile, and the non-decoding kernel (one block per query head) runs.
Like SDPA it gets one input set (at B=1 1k its 1.2 MB stay in L2), v as a view of k's first 512 columns.
"""

import contextlib
import signal
import threading
import time
import traceback

import torch
import torch.nn.functional as F

from .. import ceilings, harness, timing
from ..counts import gbps, tflops
from ..harness import goal_text, log_line, rel_err, short_error

PAGE = 64
SCALE = 192 ** -0.5
TOL = 1e-2
COPY_GOAL = 0.85
GEMM_GOAL = 0.50
# (batch, context, heads, query tokens)
DECODE = (tuple((b, s, 16, 1) for b in (1, 32, 128) for s in (1024, 8192, 32768))
          + ((32, 8192, 16, 2), (128, 8192, 16, 2), (32, 8192, 128, 2))
          + tuple((b, s, 128, 1) for b in (1, 32, 128) for s in (1024, 8192, 32768))
          + ((4, 1024, 128, 1), (4, 4096, 128, 1)))  # small 128-head batches, where the merge's rounds weigh most
QUICK = ((1, 1024, 16, 1), (32, 8192, 16, 1), (32, 8192, 128, 1), (32, 8192, 16, 2))
SDPA_BACKENDS = ("efficient", "cudnn", "flash", "math")
READ_MAX_BYTES = 1 << 30  # rows past this get no read ceiling (_read_ceiling)
MEM_FRACTION = 0.80  # skip a row whose tensors would exceed this share of free GPU memory
_CEIL = {}
FLEX_ROWS = QUICK  # FlexAttention compiles once per shape: only these rows run it
FLEX_TIMEOUT_S = 150  # one compile attempt (SIGALRM; the attempt is reported as timed out)
FLEX_BUDGET_S = 300  # all FlexAttention compile attempts of one suite run together
# kernel options tried in order until one compiles and runs (None: flex's defaults); each is the same math
FLEX_VARIANTS = (
    (None, "default options"),
    ({"BLOCK_N": 32, "num_stages": 1, "num_warps": 4}, "BLOCK_N 32, 1 stage, 4 warps"),
    ({"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": 32, "num_stages": 1, "num_warps": 4},
     "non-decoding kernel, 16x32 tiles, 1 stage"),
)
_FLEX_SPENT = [0.0]
FLASHINFER_BACKENDS = ("fa3", "fa2")  # its MLA backends for Hopper, in the order its "auto" policy tries them
FLASHINFER_WORKSPACE = 128 << 20  # bytes of float workspace (its partials), the size its docs start from
_FI = {}


def _dev():
    return harness.device()


def _dtype():
    return torch.bfloat16 if _dev() == "cuda" else torch.float16


def sdpa_fn(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]

    def run(q, k, v, mask):
        with sdpa_kernel(b):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)

    return run


def flex_fn(n_new, ctx, dev, options=None):
    """torch.compile(flex_attention) on the dense equivalent, [B, H, Q, D]: one KV head (enable_gqa), a block mask
    that lets new token i see keys ≤ ctx − n_new + i when there are several (MTP), kernel options as given."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = None
    if n_new > 1:
        first = ctx - n_new
        mask = create_block_mask(lambda b, h, q, k: k <= first + q, None, None, n_new, ctx, device=dev)
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    kw = {"kernel_options": dict(options)} if options else {}
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, scale=SCALE, enable_gqa=True, **kw)


def root_error(e: BaseException, limit: int = 200) -> str:
    """The innermost cause of a (compile) error in one line, with the wrapper types before it: inductor wraps
    e.g. a triton OutOfResources in BackendCompilerFailed, whose own first line says only 'backend raised'."""
    chain, seen = [e], {id(e)}
    while True:
        nxt = chain[-1].__cause__ or getattr(chain[-1], "inner_exception", None) or chain[-1].__context__
        if nxt is None or id(nxt) in seen:
            break
        chain.append(nxt)
        seen.add(id(nxt))
    root = short_error(chain[-1], limit)
    wrappers = " < ".join(type(x).__name__ for x in chain[:-1])
    text = f"{wrappers} < {root}" if wrappers else root
    return text if len(text) <= limit else text[: limit - 1] + "…"


@contextlib.contextmanager
def _deadline(seconds):
    """Raise TimeoutError in this (main) thread after `seconds` (SIGALRM; a no-op where there is none)."""
    if seconds is None or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise TimeoutError(f"compile or first call longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def flex_peer(n_new, ctx, dev, inputs, check, nbytes, flops):
    """The FlexAttention peer of one row: FLEX_VARIANTS in order until one compiles and runs, then checked and
    timed; compile time in compile_s; the failures before it in note; "does not run: …" when none runs."""
    errors = []
    for options, desc in FLEX_VARIANTS:
        left = FLEX_BUDGET_S - _FLEX_SPENT[0]
        if left <= 0:
            errors.append(f"{desc}: not tried, the run's FlexAttention compile budget ({FLEX_BUDGET_S} s) is spent")
            break
        torch._dynamo.reset()
        t0 = time.time()
        try:
            with _deadline(min(FLEX_TIMEOUT_S, left) if dev == "cuda" else None):
                fn = flex_fn(n_new, ctx, dev, options)
                out = fn(*inputs)
                if dev == "cuda":
                    torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{desc}: {root_error(e)}")
            continue
        finally:
            _FLEX_SPENT[0] += time.time() - t0
        name = "flex(compiled)" if options is None else f"flex(compiled, {desc})"
        res = _impl(name, "flex", fn, [inputs], check, nbytes, flops, first=out)
        res["compile_s"] = round(time.time() - t0, 1)
        if errors:
            res["note"] = "default options do not run: " + "; ".join(errors)
        return res
    return {"name": "flex(compiled)", "kind": "flex", "missing": "does not run: " + "; ".join(errors)}


def flashinfer_csr(tables, lens, n_new, page):
    """FlashInfer's CSR plan metadata for a paged batch, int32 on the tables' device: (qo_indptr, kv_indptr,
    kv_indices, kv_len): each sequence's pages in order (its table row up to its last page), n_new queries each."""
    pages = (lens.long() + page - 1) // page
    kv_indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=tables.device)
    kv_indptr[1:] = pages.cumsum(0)
    used = torch.arange(tables.shape[1], device=tables.device)[None, :] < pages[:, None]
    qo_indptr = torch.arange(lens.numel() + 1, dtype=torch.int32, device=tables.device) * n_new
    return qo_indptr, kv_indptr, tables[used].to(torch.int32), lens.to(torch.int32)


def _flashinfer_workspace(dev):
    if "flashinfer_ws" not in _FI:
        _FI["flashinfer_ws"] = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=dev)
    return _FI["flashinfer_ws"]


def flashinfer_peers(sets, heads, n_new, check, nbytes, flops):
    """FlashInfer's BatchMLAPagedAttentionWrapper, one peer per backend it offers on Hopper: planned once (a plan,
    like our schedule, is made once per decode step), then run on q packed as [B·Q, H, 576] and on our cache
    [pages, page, 576] as it is. Every set keeps its own cache and q but shares the first set's page table and
    lengths (the plan holds them). One "not importable" peer where FlashInfer is not installed."""
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata
    except Exception as e:  # noqa: BLE001
        return [{"name": "flashinfer", "kind": "flashinfer", "missing": f"not importable: {short_error(e)}"}]
    _, _, cache, tables, lens = sets[0]
    metadata = MLAPlanMetadata.csr(*flashinfer_csr(tables, lens, n_new, cache.shape[1]))
    batch = lens.numel()
    fi_sets = [(torch.cat((q_nope, q_pe), -1).flatten(0, 1), cache) for q_nope, q_pe, cache, _, _ in sets]
    peers = []
    for backend in FLASHINFER_BACKENDS:
        name = f"flashinfer-{backend}"
        try:
            wrapper = BatchMLAPagedAttentionWrapper(_flashinfer_workspace(cache.device), backend=backend)
            wrapper.plan(metadata=metadata, num_heads=heads, head_dim_ckv=512, head_dim_kpe=64,
                         page_size=cache.shape[1], causal=n_new > 1, sm_scale=SCALE, q_data_type=cache.dtype,
                         kv_data_type=cache.dtype)
        except Exception as e:  # noqa: BLE001
            peers.append({"name": name, "kind": "flashinfer", "missing": root_error(e)})
            continue

        def fn(q, cache, wrapper=wrapper):
            return wrapper.run(query=q, kv_cache=cache).view(batch, n_new, heads, 512)

        peers.append(_impl(name, "flashinfer", fn, fi_sets, check, nbytes, flops))
    return peers


def _flex_wanted(batch, ctx, heads, n_new, dev):
    return dev == "cuda" and (batch, ctx, heads, n_new) in FLEX_ROWS


def _inputs(batch, ctx, heads, n_new, dt, dev):
    from ...ops.mla import new_latent_cache

    width = -(-ctx // PAGE)
    cache, _ = new_latent_cache(batch * width, PAGE, dtype=dt, device=dev)
    cache.normal_()
    tables = torch.randperm(batch * width, device=dev).to(torch.int32).view(batch, width)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q_nope = torch.randn(batch, n_new, heads, 512, device=dev, dtype=dt) / 512 ** 0.25
    q_pe = torch.randn(batch, n_new, heads, 64, device=dev, dtype=dt) / 64 ** 0.25
    return q_nope, q_pe, cache, tables, lens


def _dense(cache, tables, ctx):
    """The latent rows of each sequence as [B, 1, S, 576] (SDPA's layout; what a non-paged engine stores)."""
    return cache[tables.long()].flatten(1, 2)[:, None, :ctx].contiguous()


def _reference(q_nope, q_pe, dense, n_new):
    """fp32 absorbed MQA on the dense rows: [B, Q, H, 512]."""
    q = torch.cat((q_nope, q_pe), -1).float()  # [B, Q, H, 576]
    k = dense[:, 0].float()  # [B, S, 576]
    s = torch.einsum("bqhd,bsd->bqhs", q, k) * SCALE
    ctx = k.shape[1]
    pos = ctx - n_new + torch.arange(n_new, device=q.device)
    s = s.masked_fill((torch.arange(ctx, device=q.device)[None, :] > pos[:, None])[:, None, :], float("-inf"))
    return torch.einsum("bqhs,bsd->bqhd", torch.softmax(s, -1), k[..., :512])


def _mask(n_new, ctx, dev):
    if n_new == 1:
        return None
    pos = ctx - n_new + torch.arange(n_new, device=dev)
    return torch.arange(ctx, device=dev)[None, :] <= pos[:, None]  # [Q, S] bool


SLOW_MS = 50.0  # a call slower than this is timed by CUDA events (median of a few calls), not do_bench
VERY_SLOW_MS = 1000.0  # ... and slower than this by the one call after the check (the run's time budget)


def _event_ms(fn, args, n=1):
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _measure(fn, sets):
    """(ms, method): do_bench of CUDA-graph replays (timing.time_ms), or CUDA events for calls long enough
    (≥ SLOW_MS) that launch costs do not matter and do_bench's repetitions would eat the run's budget."""
    if _dev() == "cuda":
        single = _event_ms(fn, sets[0])
        if single >= VERY_SLOW_MS:
            return single, "cuda events, 1 call (slow)"
        if single >= SLOW_MS:
            return _event_ms(fn, sets[0], 3), "cuda events, median of 3 calls (slow)"
    info = {}
    ms = timing.time_ms(fn, sets, info=info)
    return ms, info.get("method")


def _impl(name, kind, fn, sets, check, nbytes, flops, first=None):
    """Check (on `first`, the output of fn(*sets[0]) if already computed) then time one implementation."""
    res = {"name": name, "kind": kind}
    try:
        err = check(fn(*sets[0]) if first is None else first)
        res["err"] = err
        if not err <= TOL:
            res["wrong"] = f"rel err {err:.2e} > {TOL:.0e}"
            return res
        res["ms"], res["timing"] = _measure(fn, sets)
        res["gbps"] = gbps(nbytes, res["ms"])
        res["tflops"] = tflops(flops, res["ms"])
    except Exception as e:  # noqa: BLE001
        res["missing"] = short_error(e)
        if kind == "ours":
            log_line(traceback.format_exc())
    return res


def _schedule_costs(ours, call_fn, make_schedule, sets):
    """ours is timed with the step's schedule made once and shared (as a model's layers share it): also time the
    call that makes its own (ms_call) and the schedule kernel alone (ms_schedule)."""
    if "ms" in ours and _dev() == "cuda":
        ours["ms_call"] = timing.time_ms(call_fn, sets)
        ours["ms_schedule"] = timing.time_ms(make_schedule, [()])


def _schedule_note(ours):
    if "ms_call" not in ours:
        return ""
    return (f"; per layer (the step's schedule shared; made inside the call {ours['ms_call'] * 1e3:.1f} µs, the "
            f"schedule kernel alone {ours['ms_schedule'] * 1e3:.1f} µs)")


def decode_case(batch, ctx, heads, n_new):
    from ...ops.mla import kernels, kernels_few, mla_decode, mla_decode_schedule

    dt, dev = _dtype(), _dev()
    label = f"B={batch} ctx={ctx} H={heads} Q={n_new}"
    shape = [batch, ctx, heads, n_new, PAGE]
    elem = torch.tensor([], dtype=dt).element_size()
    cache_bytes = batch * ctx * 576 * elem
    nbytes = cache_bytes + batch * n_new * heads * (576 + 512) * elem
    flops = batch * n_new * heads * ctx * (2 * 576 + 2 * 512)
    compute = heads * n_new >= 128
    unit = "TFLOP/s" if compute else "GB/s"
    base = {"op": "mla_decode", "label": label, "shape": shape, "dtype": "bfloat16", "bytes": nbytes, "flops": flops,
            "unit": unit, "peers": [], "pct_copy": None, "best_peer": None, "best_peer_gbps": None, "ratio": None,
            "goal": {"gemm": None} if compute else {"copy": None}}
    n_sets = timing.rotation_count(nbytes, timing.l2_bytes() if dev == "cuda" else timing.DEFAULT_L2)
    if dev == "cuda":
        free = torch.cuda.mem_get_info()[0]
        need = n_sets * cache_bytes + 2 * cache_bytes  # the sets, the dense copy for SDPA, its reference
        if need > MEM_FRACTION * free:
            n_sets = max(1, int((MEM_FRACTION * free - 2 * cache_bytes) // cache_bytes))
            if n_sets * cache_bytes + 2 * cache_bytes > MEM_FRACTION * free:
                return {**base, "status": "skipped", "failure": None, "ours": {},
                        "note": f"{label}: skipped, needs {need / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free"}
    sets = [_inputs(batch, ctx, heads, n_new, dt, dev) for _ in range(n_sets)]
    q_nope, q_pe, cache, tables, lens = sets[0]
    dense = _dense(cache, tables, ctx)
    small = batch * n_new * heads * ctx <= (1 << 27)
    want = _reference(q_nope, q_pe, dense, n_new) if small else None

    def make_schedule():  # every set has the same lengths: one schedule serves them all
        return mla_decode_schedule(cache, tables, lens, num_heads=heads, q_per_seq=n_new, max_seqlen_k=ctx)

    schedule = make_schedule()

    def ours_fn(q_nope, q_pe, cache, tables, lens):
        return mla_decode(q_nope, q_pe, cache, tables, lens, scale=SCALE, max_seqlen_k=ctx, schedule=schedule)[0]

    def call_fn(q_nope, q_pe, cache, tables, lens):
        return mla_decode(q_nope, q_pe, cache, tables, lens, scale=SCALE, max_seqlen_k=ctx)[0]

    ours_out = ours_fn(*sets[0])
    if want is None:  # too big for the fp32 reference: check batch entry 0 alone
        want0 = _reference(q_nope[:1], q_pe[:1], dense[:1], n_new)
        check = lambda o: rel_err(o[:1].float(), want0)  # noqa: E731
    else:
        check = lambda o: rel_err(o.float(), want)  # noqa: E731
    ours = _impl("ours", "ours", ours_fn, sets, check, nbytes, flops, first=ours_out)
    if "ms" in ours and ours["ms"] < SLOW_MS:  # a second round: its spread shows the noise
        ours["ms_first"] = ours["ms"]
        ours["ms"] = min(ours["ms"], timing.time_ms(ours_fn, sets))
        ours["gbps"], ours["tflops"] = gbps(nbytes, ours["ms"]), tflops(flops, ours["ms"])
        ours["spread_pct"] = 100 * abs(ours["ms_first"] - ours["ms"]) / ours["ms"]
    _schedule_costs(ours, call_fn, make_schedule, sets)
    fi_peers = flashinfer_peers(sets, heads, n_new, check, nbytes, flops)
    ref_o = ours_out.float() if want is None else want
    del sets
    if dev == "cuda":
        torch.cuda.empty_cache()
    # SDPA on the dense rows: q [B, H, Q, 576] against k [B, 1, S, 576], v = k[..., :512]
    qd = torch.cat((q_nope, q_pe), -1).transpose(1, 2)
    vd = dense[..., :512]
    mask = _mask(n_new, ctx, dev)
    sdpa_check = lambda o: rel_err(o.transpose(1, 2).float(), ref_o)  # noqa: E731
    peers = fi_peers
    for b in (SDPA_BACKENDS if dev == "cuda" else ("math",)):
        if b == "math" and batch * heads * n_new * ctx * 576 * 2 > (4 << 30):  # math repeats k per head
            peers.append({"name": f"sdpa-{b}", "kind": "sdpa", "missing": "skipped: would materialise k per head"})
            continue
        peers.append(_impl(f"sdpa-{b}", "sdpa", lambda q, k, v, b=b: sdpa_fn(b)(q, k, v, mask),
                           [(qd, dense, vd)], sdpa_check, nbytes, flops))
    if _flex_wanted(batch, ctx, heads, n_new, dev):
        peers.append(flex_peer(n_new, ctx, dev, (qd, dense, vd), sdpa_check, nbytes, flops))
    del dense, vd
    plan = kernels.decode_plan(tuple(q_nope.shape[:3]), cache, ctx)
    cfg, ws, slots, base_slots = plan.cfg, plan.ws, plan.slots, plan.base
    if plan.programs:
        programs = f"{plan.programs} programs taking ranges of the batch's keys"
    else:
        programs = f"{base_slots} slots" + (f" (+ {slots - base_slots} for skewed batches)" if slots > base_slots
                                            else "")
    rows = q_nope.shape[1] * q_nope.shape[2]
    if ws and rows <= kernels_few.MAX_ROWS and cache.dtype != torch.float8_e4m3fn:
        tiles = f"{kernels_few.MAX_ROWS}x{cfg['BLOCK_N']} few-rows Gluon, transposed tiles"
    elif ws:
        tiles = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} warp-specialised Gluon, seesaw"
    else:
        tiles = (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']} "
                 + ("keys-major" if cfg.get("KEYS_MAJOR") else "rows-major") + (" halves" if cfg.get("HALVES") else "")
                 + (" TMA" if cfg.get("TMA") else ""))
    failure = ours.get("wrong") or ours.get("missing")
    row = {**base, "status": "FAILED" if failure else "ok", "failure": failure, "ours": ours, "peers": peers}
    key = "tflops" if compute else "gbps"
    timed = [p for p in peers if key in p]
    best = max(timed, key=lambda p: p[key]) if timed else None
    if best:
        row["best_peer"], row["best_peer_gbps"] = best["name"], best["gbps"]
    if not failure:
        copy, gemm = _CEIL.get("copy_gbps"), _CEIL.get("gemm_bf16_tflops")
        if copy:
            row["pct_copy"] = 100 * ours["gbps"] / copy
        if gemm:
            row["pct_gemm"] = 100 * ours["tflops"] / gemm
        if best:
            row["ratio"] = ours[key] / best[key]
        if compute and gemm:
            row["goal"]["gemm"] = bool(ours["tflops"] >= GEMM_GOAL * gemm)
        elif not compute and copy:
            row["goal"]["copy"] = bool(ours["gbps"] >= COPY_GOAL * copy)
        read = _read_ceiling(nbytes)
        if read:
            row["read_ceiling"] = _read_bound(read, flops, compute)
    goal_txt = (f"≥ {GEMM_GOAL:.0%} of bf16 GEMM" if compute
                else f"≥ {COPY_GOAL:.0%} of copy")
    figs = ", ".join(f"{p['name']} {p[key]:.1f}" for p in peers if key in p) or "no SDPA backend ran"
    ours_fig = f"{ours[key]:.1f}" if key in ours else "n/a"
    extra = f"{row['pct_gemm']:.1f}% of GEMM, " if row.get("pct_gemm") is not None and compute else ""
    row["note"] = (f"{label}: {unit} ours {ours_fig} ({extra}{ours.get('gbps', 0):.0f} GB/s, "
                   f"{ours.get('tflops', 0):.1f} TFLOP/s), {figs}; goal {goal_txt}; page {PAGE}, "
                   f"{tiles}, {plan.splits} splits on {programs} per m-block, "
                   f"timing {ours.get('timing')}{_schedule_note(ours)}{_read_note(row.get('read_ceiling'))}"
                   + ("" if want is not None else "; checked on batch entry 0 (fp32 reference too large)"))
    return row


def _read_ceiling(nbytes):
    """What one kernel that only reads the row's bytes reaches (ceilings.read_bandwidth; on the GPU only, and up
    to READ_MAX_BYTES: past it a read runs at the copy rate, 3088 GB/s at 1.2 GB on the H100, NOTES session s)."""
    if _dev() != "cuda" or nbytes > READ_MAX_BYTES:
        return None
    return ceilings.read_bandwidth(nbytes - nbytes % 2)


def _read_bound(read, flops, compute):
    """The read ceiling in the row's goal measure: % of copy (memory-bound rows), or for compute-bound rows the
    TFLOP/s of an op taking only the read's time, as % of the GEMM. No op over these bytes can pass it, so a row
    whose bound is below its goal cannot meet it (per-launch costs against too few bytes)."""
    out = dict(read)
    copy, gemm = _CEIL.get("copy_gbps"), _CEIL.get("gemm_bf16_tflops")
    if compute and gemm:
        out["pct_gemm"] = 100 * tflops(flops, read["read_ms"]) / gemm
    elif not compute and copy:
        out["pct_copy"] = 100 * read["read_gbps"] / copy
    return out


def _read_note(read):
    if not read:
        return ""
    bound = (f", {read['pct_copy']:.1f}% of copy" if "pct_copy" in read
             else f", {read['pct_gemm']:.1f}% of GEMM at its FLOPs" if "pct_gemm" in read else "")
    return f"; one kernel only reading these bytes: {read['read_gbps']:.0f} GB/s{bound} ({read['read_by']})"


def _ragged_inputs(lens, heads, dt, dev):
    """A paged batch of the given lengths (each sequence its own shuffled pages, the table padded with page 0)."""
    from ...ops.mla import new_latent_cache

    pages = [-(-n // PAGE) for n in lens]
    cache, _ = new_latent_cache(sum(pages), PAGE, dtype=dt, device=dev)
    cache.normal_()
    perm = torch.randperm(sum(pages), device=dev).to(torch.int32)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=dev)
    start = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[start:start + n]
        start += n
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    q_nope = torch.randn(len(lens), 1, heads, 512, device=dev, dtype=dt) / 512 ** 0.25
    q_pe = torch.randn(len(lens), 1, heads, 64, device=dev, dtype=dt) / 64 ** 0.25
    return q_nope, q_pe, cache, tables, lens_t


def _ours_ms(lens, heads, dt, dev, nbytes, costs=None):
    """ours on a batch of these lengths (max_seqlen_k: its longest; the schedule shared): (ms, timing method);
    costs: a dict for _schedule_costs."""
    from ...ops.mla import mla_decode, mla_decode_schedule

    n_sets = timing.rotation_count(nbytes, timing.l2_bytes() if dev == "cuda" else timing.DEFAULT_L2)
    sets = [_ragged_inputs(lens, heads, dt, dev) for _ in range(n_sets)]
    _, _, cache, tables, lens_t = sets[0]

    def make_schedule():
        return mla_decode_schedule(cache, tables, lens_t, num_heads=heads, max_seqlen_k=max(lens))

    schedule = make_schedule()

    def fn(q_nope, q_pe, cache, tables, lens_t, schedule=schedule):
        return mla_decode(q_nope, q_pe, cache, tables, lens_t, scale=SCALE, max_seqlen_k=max(lens), schedule=schedule)

    fn(*sets[0])  # compiled before the first timed call (_measure times one call first, to choose its method)
    ms, method = _measure(fn, sets)
    if costs is not None:
        costs["ms"] = ms
        _schedule_costs(costs, lambda *a: fn(*a, schedule=None), make_schedule, sets)
    return ms, method


def skewed_case(name, long_len, n_long, short_len, n_short, heads):
    """A few long sequences among short ones, one query token: informational (the issue states no goal for it), ours
    against ours on its members run apart (the long sequences as one batch, then the short ones): with
    splits set by the batch size alone the long sequence got only the short ones' share of programs and such a
    batch took 3–7x its members' time (NOTES, issue 6, m-9). Checked on the long sequence and one short one."""
    from ...ops.mla import mla_decode

    dt, dev = _dtype(), _dev()
    lens = [long_len] * n_long + [short_len] * n_short
    elem = torch.tensor([], dtype=dt).element_size()

    def counts(ls):
        keys = sum(ls)
        return keys * 576 * elem + len(ls) * heads * (576 + 512) * elem, heads * keys * (2 * 576 + 2 * 512)

    nbytes, flops = counts(lens)
    compute = heads >= 128
    label = f"{name} H={heads} Q=1"
    base = {"op": "mla_decode", "label": label, "shape": [len(lens), long_len, heads, 1, PAGE], "dtype": "bfloat16",
            "bytes": nbytes, "flops": flops, "unit": "TFLOP/s" if compute else "GB/s", "peers": [], "pct_copy": None,
            "best_peer": None, "best_peer_gbps": None, "ratio": None, "goal": {}}
    first = _ragged_inputs(lens, heads, dt, dev)
    q_nope, q_pe, cache, tables, lens_t = first
    checked = (0, n_long)
    wants = [_reference(q_nope[i:i + 1], q_pe[i:i + 1], cache[tables[i].long()].flatten(0, 1)[None, None, :lens[i]], 1)
             for i in checked]

    def check(o):
        return max(rel_err(o[i:i + 1].float(), want) for i, want in zip(checked, wants))

    ours = {"name": "ours", "kind": "ours",
            "err": check(mla_decode(q_nope, q_pe, cache, tables, lens_t, scale=SCALE, max_seqlen_k=long_len)[0])}
    if not ours["err"] <= TOL:
        ours["wrong"] = f"rel err {ours['err']:.2e} > {TOL:.0e}"
        return {**base, "status": "FAILED", "failure": ours["wrong"], "ours": ours, "note": f"{label}: wrong"}
    ours["ms"], ours["timing"] = _ours_ms(lens, heads, dt, dev, nbytes, ours)
    ours["gbps"], ours["tflops"] = gbps(nbytes, ours["ms"]), tflops(flops, ours["ms"])
    apart = [_ours_ms(ls, heads, dt, dev, counts(ls)[0])[0] for ls in ([long_len] * n_long, [short_len] * n_short)]
    n_sets = timing.rotation_count(nbytes, timing.l2_bytes() if dev == "cuda" else timing.DEFAULT_L2)
    sets = [first] + [_ragged_inputs(lens, heads, dt, dev) for _ in range(n_sets - 1)]
    peers = flashinfer_peers(sets, heads, 1, check, nbytes, flops)
    del sets, first, q_nope, q_pe, cache, tables
    row = {**base, "status": "ok", "failure": None, "ours": ours, "peers": peers, "members_apart_ms": apart}
    copy, gemm = _CEIL.get("copy_gbps"), _CEIL.get("gemm_bf16_tflops")
    if copy:
        row["pct_copy"] = 100 * ours["gbps"] / copy
    if gemm:
        row["pct_gemm"] = 100 * ours["tflops"] / gemm
    key = "tflops" if compute else "gbps"
    timed = [p for p in peers if key in p]
    peer_text = ""
    if timed:
        best = max(timed, key=lambda p: p[key])
        row["best_peer"], row["best_peer_gbps"], row["ratio"] = best["name"], best["gbps"], ours[key] / best[key]
        peer_text = "; " + ", ".join(f"{p['name']} {p['ms'] * 1e3:.1f} µs" for p in timed)
    row["note"] = (f"{label} (a skewed batch): ours {ours['ms'] * 1e3:.1f} µs, {ours[key]:.1f} {base['unit']}; its "
                   f"members run apart {apart[0] * 1e3:.1f} µs ({n_long} × {long_len}) + {apart[1] * 1e3:.1f} µs "
                   f"({n_short} × {short_len}): together {sum(apart) / ours['ms']:.2f}x as fast{peer_text}; no goal "
                   f"stated; timing {ours['timing']}{_schedule_note(ours)}")
    return row


def fp8_case(batch, ctx, heads, n_new):
    """A uniform batch over an FP8 (e4m3) cache with a scale per 128 values: informational (the issue's goals are
    for the bf16 cache), ours against ours on a bf16 cache of the same shape (the peer column "ours, bf16 cache";
    GB/s of the FP8 row's bytes, so the ratio is the speed-up over bf16). FlashInfer's FP8 MLA takes one scale for
    the whole cache, not the same function. Checked on batch entry 0 against fp32 math on the dequantised rows."""
    from ...ops.mla import kernels, mla_decode, mla_decode_schedule
    from ...ops.mla.reference import N_SCALES, dequantize_rows, quantize_rows

    dt, dev = _dtype(), _dev()
    label = f"B={batch} ctx={ctx} H={heads} Q={n_new} fp8 cache"
    elem = torch.tensor([], dtype=dt).element_size()
    nbytes = batch * ctx * (576 + 4 * N_SCALES) + batch * n_new * heads * (576 + 512) * elem
    flops = batch * n_new * heads * ctx * (2 * 576 + 2 * 512)
    base = {"op": "mla_decode", "label": label, "shape": [batch, ctx, heads, n_new, PAGE], "dtype": "bfloat16",
            "bytes": nbytes, "flops": flops, "unit": "GB/s", "peers": [], "pct_copy": None, "best_peer": None,
            "best_peer_gbps": None, "ratio": None, "goal": {}}

    def fp8_inputs():
        q_nope, q_pe, cache, tables, lens = _inputs(batch, ctx, heads, n_new, dt, dev)
        values, scales = quantize_rows(cache)
        return q_nope, q_pe, values, scales, tables, lens

    n_sets = timing.rotation_count(nbytes, timing.l2_bytes() if dev == "cuda" else timing.DEFAULT_L2)
    sets = [fp8_inputs() for _ in range(n_sets)]
    q_nope, q_pe, cache, scales, tables, lens = sets[0]
    rows0 = dequantize_rows(cache[tables[0].long()].flatten(0, 1)[:ctx], scales[tables[0].long()].flatten(0, 1)[:ctx])
    want0 = _reference(q_nope[:1], q_pe[:1], rows0[None, None], n_new)
    schedule = mla_decode_schedule(cache, tables, lens, num_heads=heads, q_per_seq=n_new, max_seqlen_k=ctx,
                                   cache_scales=scales)

    def ours_fn(q_nope, q_pe, cache, scales, tables, lens):
        return mla_decode(q_nope, q_pe, cache, tables, lens, scale=SCALE, max_seqlen_k=ctx, cache_scales=scales,
                          schedule=schedule)[0]

    ours = _impl("ours", "ours", ours_fn, sets, lambda o: rel_err(o[:1].float(), want0), nbytes, flops)
    plan = kernels.decode_plan((batch, n_new, heads), cache, ctx)
    del sets, cache, scales, rows0
    bf16_sets = [_inputs(batch, ctx, heads, n_new, dt, dev) for _ in range(timing.rotation_count(
        batch * ctx * 576 * elem, timing.l2_bytes() if dev == "cuda" else timing.DEFAULT_L2))]
    q_nope, q_pe, cache, tables, lens = bf16_sets[0]
    want_b = _reference(q_nope[:1], q_pe[:1], _dense(cache, tables[:1], ctx), n_new)
    schedule_b = mla_decode_schedule(cache, tables, lens, num_heads=heads, q_per_seq=n_new, max_seqlen_k=ctx)

    def bf16_fn(q_nope, q_pe, cache, tables, lens):
        return mla_decode(q_nope, q_pe, cache, tables, lens, scale=SCALE, max_seqlen_k=ctx, schedule=schedule_b)[0]

    peers = [_impl("ours, bf16 cache", "ours-bf16", bf16_fn, bf16_sets, lambda o: rel_err(o[:1].float(), want_b),
                   nbytes, flops)]
    del bf16_sets, cache
    failure = ours.get("wrong") or ours.get("missing")
    row = {**base, "status": "FAILED" if failure else "ok", "failure": failure, "ours": ours, "peers": peers}
    kernel = ("Gluon, e4m3 → f16 in shared memory" if plan.ws else
              f"Triton {plan.cfg['BLOCK_M']}x{plan.cfg['BLOCK_N']} w{plan.cfg['num_warps']}")
    if not failure:
        copy = _CEIL.get("copy_gbps")
        if copy:
            row["pct_copy"] = 100 * ours["gbps"] / copy
        if "gbps" in peers[0]:
            row["best_peer"], row["best_peer_gbps"] = peers[0]["name"], peers[0]["gbps"]
            row["ratio"] = ours["gbps"] / peers[0]["gbps"]
    ms = {p["name"]: p["ms"] * 1e3 for p in [ours] + peers if "ms" in p}
    row["note"] = (f"{label}: " + ", ".join(f"{k} {v:.1f} µs" for k, v in ms.items()) + f"; {kernel}, "
                   f"{plan.splits} splits on {plan.slots} slots; GB/s of the FP8 bytes (576 e4m3 + 5 fp32 scales a "
                   f"key); no goal stated; timing {ours.get('timing')}")
    return row


# FP8 cache rows (informational): (batch, context, heads, query tokens)
FP8_ROWS = ((1, 32768, 16, 1), (32, 8192, 16, 1), (128, 1024, 16, 1), (128, 8192, 16, 1), (32, 8192, 16, 2),
            (1, 32768, 128, 1), (32, 8192, 128, 1), (128, 1024, 128, 1))
QUICK_FP8 = FP8_ROWS[1:2]

# skewed batches (informational rows, 16 and 128 heads each): (name, long length, long sequences, short length, short
# sequences)
SKEWED = (("1 x 32k + 31 x 1k", 32768, 1, 1024, 31), ("1 x 8k + 127 x 512", 8192, 1, 512, 127),
          ("8 x 4k + 120 x 256", 4096, 8, 256, 120))
QUICK_SKEWED = SKEWED[:1]


def cases(quick=False):
    for b, s, h, q in (QUICK if quick else DECODE):
        yield lambda b=b, s=s, h=h, q=q: decode_case(b, s, h, q)
    for heads in (16, 128):
        for case in (QUICK_SKEWED if quick else SKEWED):
            yield lambda a=(*case, heads): skewed_case(*a)
    for b, s, h, q in (QUICK_FP8 if quick else FP8_ROWS):
        yield lambda b=b, s=s, h=h, q=q: fp8_case(b, s, h, q)


def run(result: dict, quick: bool = False, save=lambda: None) -> None:
    result["goal_text"] = (f"memory-bound rows (GB/s) ≥ {COPY_GOAL:.0%} of copy; compute-bound rows (heads × query "
                           f"tokens ≥ 128, TFLOP/s) ≥ {GEMM_GOAL:.0%} of the bf16 GEMM; SDPA reads a dense copy; "
                           "read-only bound: what one kernel that only reads the row's bytes reaches (the best of a "
                           "plain Triton read at 1–8 programs an SM and torch.sum, timed as ours), in the goal's "
                           "measure (for TFLOP/s rows the row's FLOPs in the read's time): no op over those bytes "
                           "can pass it")
    _CEIL.clear()
    _FLEX_SPENT[0] = 0.0
    _CEIL.update(result.get("ceilings") or {})
    harness.run_rows(cases(quick), result, progress_line, "mla_decode", save)


def progress_line(row: dict) -> str:
    head = f"[mla] {row.get('label')}:"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')} ({row.get('failure') or row.get('note')})"
    parts = [f"ours {row['ours']['gbps']:.0f} GB/s {row['ours']['tflops']:.1f} TFLOP/s"]
    if row.get("pct_copy") is not None:
        parts.append(f"{row['pct_copy']:.1f}% of copy")
    if row.get("pct_gemm") is not None:
        parts.append(f"{row['pct_gemm']:.1f}% of GEMM")
    for p in row["peers"]:
        parts.append(f"{p['name']} {p['gbps']:.0f} GB/s" if "gbps" in p else f"{p['name']} n/a")
    parts.append("goal " + goal_text(row))
    return f"{head} " + ", ".join(parts)
