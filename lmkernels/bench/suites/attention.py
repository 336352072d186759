"""Attention, bf16: prefill (TFLOP/s) and paged decode (GB/s of KV read) against torch SDPA's flash, cuDNN
and efficient backends (and compiled FlexAttention for one prefill shape), with the goals of issue 3.

The shared harness times bandwidth-bound rows against torch.compile/Liger; attention needs other peers,
FLOP rates and per-row goals, so this suite has its own small loop. Its rows carry the keys the report
reads (op, label, shape, dtype, bytes, status, ours/peers with ms and gbps, pct_copy, best_peer, ratio,
goal) plus `unit`, `flops` and `tflops`:
- prefill rows: `gbps` counts q, k, v read and o written once (so ratios between implementations are time
  ratios); the TFLOP/s figures (2·S²·H·(Dqk + Dv), halved when causal) are in the row's `tflops` keys and
  note, and pct_copy is empty (compute-bound). Two rows are MLA prefill's attention (q/k dim 192, v dim 128;
  issue 6), checked against SDPA mem-efficient (flash takes one head dim).
- mla_prefill rows (issue 6, no goal): a whole MLA prefill layer (gather, up-projection, attention, LSE merge of
  prefix chunks) against the same math in PyTorch (einsums + SDPA).
- decode rows: `gbps` counts the K and V cache bytes read (the issue's "KV bytes read per second"),
  pct_copy is against the device-to-device copy measured in the same run.
Goals (issue 3): prefill ≥ 1.0x SDPA cuDNN; decode B=1 ≥ 2x the best SDPA backend, B=32/B=64 ≥ 1.0x SDPA and
≥ 90% of copy, the skewed batch ≥ 80% of copy. Every implementation is checked before it is timed (ours
against the fp32 reference where it fits in memory, else against SDPA flash); a wrong peer is not timed.
Timing: `timing.time_ms` (CUDA-graph replays; decode inputs rotated through sets larger than L2).
"""

import torch
import torch.nn.functional as F

from .. import harness, timing
from ..counts import gbps
from ..harness import check_then_time, rel_err, short_error

DTYPE = torch.bfloat16
HQ, HK = 32, 8
# (sequence, q/k head dim, causal, q heads, kv heads[, v head dim]); the 192/128 rows are MLA prefill's attention
# (DeepSeek-V3: 128 heads, or 16 a GPU at tensor parallel 8; the keys and values up-projected per head)
PREFILL = ((2048, 128, True, 32, 8), (8192, 128, True, 32, 8), (32768, 128, True, 32, 8), (8192, 128, False, 32, 8),
           (8192, 64, True, 32, 8), (8192, 256, True, 16, 4), (8192, 192, True, 128, 128, 128),
           (8192, 192, True, 16, 16, 128))
QUICK_PREFILL = ((2048, 128, True, 32, 8), (8192, 128, True, 32, 8))
# MLA prefill, a whole layer (issue 6): (heads, new tokens, cached prefix)
MLA_PREFILL = ((16, 8192, 0), (128, 4096, 0), (128, 1024, 8192))
QUICK_MLA_PREFILL = MLA_PREFILL[:1]
FLEX_SHAPES = ((8192, 128, True),)  # FlexAttention compiles per shape (tens of seconds): one representative
VARLEN = (8192, 4096, 2048, 1024, 512, 300, 100, 7000)
# (label, lengths, page size, fp8 cache)
DECODE = (("B=1 ctx=8192", (8192,), 16, False), ("B=1 ctx=8192 page 64", (8192,), 64, False),
          ("B=32 ctx=4096", (4096,) * 32, 16, False), ("B=64 ctx=16384", (16384,) * 64, 16, False),
          ("skewed 1x32768 + 31x512", (32768,) + (512,) * 31, 16, False),
          ("B=32 ctx=4096 fp8 cache", (4096,) * 32, 16, True))
QUICK_DECODE = (DECODE[0], DECODE[2], DECODE[4])
HEAD_DIM = 128
SDPA_BACKENDS = ("cudnn", "flash", "efficient")
TOL = harness.TOL_BF16  # the check of every implementation (check_then_time's default)
PREFILL_PEER_GOAL = 1.0  # × SDPA cuDNN
DECODE_GOALS = {"B=1": ("peer", 2.0), "skewed": ("copy", 0.80)}  # otherwise copy ≥ 90% and peer ≥ 1.0x


def _dev():
    return harness.device()


def _dtype():
    """bf16 on the GPU; fp16 in a CPU dry run (the Triton interpreter computes bf16 dots wrong)."""
    return DTYPE if _dev() == "cuda" else torch.float16


# ----------------------------------------------------------------------------------------------------
# peers


def sdpa_fn(backend: str, causal: bool, gqa: bool = False, mask=None):
    """SDPA restricted to one backend; q/k/v in [B, H, S, D]; mask: a boolean attn_mask (True: attend) instead of
    the causal flag."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]

    def run(q, k, v):
        with sdpa_kernel(b):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  enable_gqa=gqa)

    return run


def flex_fn(s: int, hq: int, causal: bool):
    """torch.compile(flex_attention) with a causal (or no) block mask, GQA in the kernel; [B, H, S, D]."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, s, s, device=_dev())
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True)


# ----------------------------------------------------------------------------------------------------
# rows


def _row(op, label, shape, nbytes, flops, unit, ours, peers, copy_gbps, goals, note=""):
    if "ms_first" in ours and "ms" in ours:
        ours["spread_pct"] = 100 * abs(ours["ms_first"] - ours["ms"]) / ours["ms"]
    return harness.unit_row(op, label, shape, nbytes, unit, ours, peers, copy_gbps, goals, note, flops=flops)


def _rate_note(ours, peers, unit, goal_text):
    key = "tflops" if unit == "TFLOP/s" else "gbps"
    parts = [f"ours {ours[key]:.0f}" if key in ours else "ours n/a"]
    parts += [f"{p['name']} {p[key]:.0f}" for p in peers if key in p]
    return f"{unit}: " + ", ".join(parts) + f"; goal {goal_text}"


def prefill_case(s, d, causal, hq, hk, dv=None, flex=False):
    from ...ops.attention import attention_prefill, kernels

    dt, dev = _dtype(), _dev()
    dv = dv or d
    q = torch.randn(s, hq, d, device=dev, dtype=dt)
    k = torch.randn(s, hk, d, device=dev, dtype=dt)
    v = torch.randn(s, hk, dv, device=dev, dtype=dt)
    cu = torch.tensor([0, s], device=dev, dtype=torch.int32)
    flops = 2 * s * s * hq * (d + dv) // (2 if causal else 1)
    nbytes = (s * hq * (d + dv) + s * hk * (d + dv)) * q.element_size()
    qt = q[None].transpose(1, 2)
    kt, vt = (x[None].transpose(1, 2).repeat_interleave(hq // hk, 1) for x in (k, v))  # SDPA: heads repeated
    # the reference: SDPA flash (mem-efficient where v's head dim differs: flash takes one head dim)
    ref = ("flash" if dv == d else "efficient") if dev == "cuda" else "math"
    want = sdpa_fn(ref, causal)(qt, kt, vt).transpose(1, 2)[0]
    check = lambda o: rel_err(o.float() if o.dim() == 3 else o.transpose(1, 2)[0].float(), want.float())  # noqa: E731

    def ours_fn(q, k, v):
        return attention_prefill(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s)

    ours = check_then_time("ours", "ours", ours_fn, [(q, k, v)], check, nbytes, flops)
    peers = []
    for b in (SDPA_BACKENDS if dev == "cuda" else ("math",)):
        peers.append(check_then_time(f"sdpa-{b}", "sdpa", sdpa_fn(b, causal), [(qt, kt, vt)], check, nbytes, flops))
    if flex:
        kf, vf = k[None].transpose(1, 2), v[None].transpose(1, 2)
        try:
            fn = flex_fn(s, hq, causal)
            peers.append(check_then_time("flex(compiled)", "flex", fn, [(qt, kf, vf)], check, nbytes, flops))
        except Exception as e:
            peers.append({"name": "flex(compiled)", "kind": "flex", "missing": short_error(e)})
    cudnn = [p for p in peers if p["name"] == "sdpa-cudnn" and "gbps" in p]
    ratio_goal = {"peer": PREFILL_PEER_GOAL}
    label = f"B=1 S={s} {hq}/{hk} heads d{d}{f'/{dv}' if dv != d else ''} {'causal' if causal else 'full'}"
    note = (f"{label}: " + _rate_note(ours, peers, "TFLOP/s", "≥ 1.0x SDPA cuDNN")
            + f" ({kernels.prefill_path(q, k, v, s, causal)})")
    shape = [1, s, hq, hk, d] + ([dv] if dv != d else [])
    row = _row("attention_prefill", label, shape, nbytes, flops, "TFLOP/s", ours, peers, None, ratio_goal, note)
    if cudnn and row["status"] == "ok":  # the goal is against cuDNN, whichever peer is fastest
        row["goal"]["peer"] = bool(ours["gbps"] / cudnn[0]["gbps"] >= PREFILL_PEER_GOAL)
        row["ratio_cudnn"] = ours["gbps"] / cudnn[0]["gbps"]
    return row


def mla_prefill_case(heads, n_new, prefix):
    """MLA prefill (issue 6, no goal stated): one layer's mla_prefill for one sequence of n_new new tokens after a
    cached prefix, in a step whose layers share one mla_prefill_plan (made outside the timing, as the decode
    schedule is), against the same math in plain PyTorch: the latents up-projected by the same einsums into k
    [S, H, 192] and v [S, H, 128], then SDPA (cuDNN, mem-efficient; a mask where a prefix shifts the causal
    diagonal). The checks are against SDPA mem-efficient on that up-projection. The note adds one call that makes
    its own plan (a host sync: timed eagerly). TFLOP/s count the attention (causal) and the up-projection."""
    from ...ops.mla import mla_prefill, mla_prefill_plan

    dt, dev = _dtype(), _dev()
    page, nope, dv, scale = 64, 128, 128, 192 ** -0.5
    total = prefix + n_new
    pages = -(-total // page)
    cache = torch.randn(pages, page, 576, device=dev, dtype=dt)
    tables = torch.randperm(pages, device=dev).to(torch.int32)[None]
    cu = torch.tensor([0, n_new], device=dev, dtype=torch.int32)
    lens = torch.tensor([total], device=dev, dtype=torch.int32)
    q_nope = torch.randn(n_new, heads, nope, device=dev, dtype=dt) / nope ** 0.25
    q_pe = torch.randn(n_new, heads, 64, device=dev, dtype=dt) / 8
    w_kv_b = torch.randn(heads * (nope + dv), 512, device=dev, dtype=dt) / 512 ** 0.5
    w = w_kv_b.view(heads, nope + dv, 512)
    latents = cache[tables[0].long()].flatten(0, 1)[:total]  # the dense rows a non-paged engine would hold
    flops = 2 * heads * (nope + 64 + dv) * (n_new * prefix + n_new * n_new // 2) + 2 * total * 512 * heads * (nope + dv)
    nbytes = (n_new * heads * (nope + 64 + dv) + total * 576) * q_nope.element_size()
    mask = None
    if prefix:
        mask = torch.arange(total, device=dev)[None, :] <= prefix + torch.arange(n_new, device=dev)[:, None]

    def torch_fn(backend):
        attend = sdpa_fn(backend, True, mask=mask)

        def run(q_nope, q_pe, latents):
            c, pe = latents[:, :512], latents[:, 512:]
            k = torch.cat((torch.einsum("nd,hkd->nhk", c, w[:, :nope]), pe[:, None].expand(-1, heads, -1)), -1)
            v = torch.einsum("nd,hvd->nhv", c, w[:, nope:])
            q = torch.cat((q_nope, q_pe), -1)  # SDPA's default scale is 1/sqrt(192) = scale
            return attend(*(x[None].transpose(1, 2) for x in (q, k, v))).transpose(1, 2)[0]

        return run

    want = torch_fn("efficient" if dev == "cuda" else "math")(q_nope, q_pe, latents).float()
    check = lambda o: rel_err(o.float(), want)  # noqa: E731
    plan = mla_prefill_plan(cache, tables, cu, lens)

    def ours_fn(q_nope, q_pe):
        return mla_prefill(q_nope, q_pe, cache, tables, cu, lens, w_kv_b, scale=scale, plan=plan)

    ours = check_then_time("ours", "ours", ours_fn, [(q_nope, q_pe)], check, nbytes, flops)
    own = check_then_time("ours, a plan per call", "ours", lambda q_nope, q_pe: mla_prefill(
        q_nope, q_pe, cache, tables, cu, lens, w_kv_b, scale=scale), [(q_nope, q_pe)], check, nbytes, flops)
    peers = [check_then_time(f"torch + sdpa-{b}", "sdpa", torch_fn(b), [(q_nope, q_pe, latents)], check, nbytes,
                             flops) for b in (("cudnn", "efficient") if dev == "cuda" else ("math",))]
    row_label = f"B=1 {heads} heads, {n_new} new tokens after {prefix} cached"
    own_text = (f"{own['ms']:.3f} ms ({own.get('timing')})" if "ms" in own else
                own.get("wrong") or own.get("missing"))
    note = (f"{row_label}: " + _rate_note(ours, peers, "TFLOP/s", "none stated")
            + f"; one layer of a step sharing its plan; a call making its own plan: {own_text}")
    row = _row("mla_prefill", row_label, [1, n_new, prefix, heads, nope + 64, dv], nbytes, flops, "TFLOP/s", ours,
               peers, None, {}, note)
    row["own_plan"] = own
    return row


def varlen_case(lens):
    from ...ops.attention import attention_prefill, reference

    dt, dev = _dtype(), _dev()
    total = sum(lens)
    q = torch.randn(total, HQ, HEAD_DIM, device=dev, dtype=dt)
    k = torch.randn(total, HK, HEAD_DIM, device=dev, dtype=dt)
    v = torch.randn(total, HK, HEAD_DIM, device=dev, dtype=dt)
    cu = torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)
    flops = sum(4 * n * n * HQ * HEAD_DIM // 2 for n in lens)
    nbytes = (2 * total * HQ + 2 * total * HK) * HEAD_DIM * q.element_size()
    peers = []
    # SDPA has no packed varlen entry: the peer is SDPA flash called once per sequence (what a user without
    # a varlen kernel does); its check doubles as ours
    flash = sdpa_fn("flash" if dev == "cuda" else "math", True)

    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)

    def per_seq(q, k, v):
        outs = []
        for b in range(len(lens)):
            a, e = offs[b], offs[b + 1]
            qt = q[a:e].transpose(0, 1)[None]
            kt, vt = (x[a:e].transpose(0, 1).repeat_interleave(HQ // HK, 0)[None] for x in (k, v))
            outs.append(flash(qt, kt, vt)[0].transpose(0, 1))
        return torch.cat(outs)

    want = per_seq(q, k, v).float() if dev == "cuda" else reference.attention_varlen(q, k, v, cu, cu)[0].float()
    check = lambda o: rel_err(o.float(), want)  # noqa: E731
    ours = check_then_time("ours", "ours", lambda q, k, v: attention_prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                   max_seqlen_q=max(lens)),
                 [(q, k, v)], check, nbytes, flops)
    peers.append(check_then_time("sdpa-flash per sequence", "sdpa", per_seq, [(q, k, v)], check, nbytes, flops))
    label = f"varlen {len(lens)} seqs ({total} tokens) {HQ}/{HK} d{HEAD_DIM} causal"
    note = f"{label} (lengths {', '.join(map(str, lens))}): " + _rate_note(ours, peers, "TFLOP/s", "none stated")
    return _row("attention_prefill", label, [len(lens), total, HQ, HK, HEAD_DIM], nbytes, flops, "TFLOP/s", ours,
                peers, None, {}, note)


def _paged(lens, page, fp8, dt, dev):
    """Caches with shuffled pages (every slot random); fp8: e4m3 caches with per-head scales."""
    per_seq = [-(-n // page) for n in lens]
    width = max(per_seq)
    num_pages = len(lens) * width
    tables = torch.randperm(num_pages, device=dev).to(torch.int32).view(len(lens), width)
    kc = torch.randn(num_pages, page, HK, HEAD_DIM, device=dev, dtype=dt)
    vc = torch.randn(num_pages, page, HK, HEAD_DIM, device=dev, dtype=dt)
    scales = (None, None)
    if fp8:
        from ...ops.attention import reference

        ks, vs = kc.float().abs().amax((0, 1, 3)) / 448, vc.float().abs().amax((0, 1, 3)) / 448
        kc, vc, scales = reference.quantize_fp8(kc, ks), reference.quantize_fp8(vc, vs), (ks, vs)
    return kc, vc, tables, torch.tensor(lens, device=dev, dtype=torch.int32), scales


def _contiguous(kc, tables, n, scale, dt):
    """The first n tokens of each sequence as a dense [B, Hk, n, D] tensor (the SDPA peers' layout)."""
    pages = tables[:, : -(-n // kc.shape[1])].long()
    x = kc[pages].flatten(1, 2)[:, :n]  # [B, n, Hk, D]
    if scale is not None:
        x = (x.float() * scale[None, None, :, None]).to(dt)
    return x.transpose(1, 2).contiguous()


def decode_case(label, lens, page, fp8):
    from ...ops.attention import attention_decode, kernels, reference

    dt, dev = _dtype(), _dev()
    batch, ctx = len(lens), max(lens)
    elem = 1 if fp8 else torch.tensor([], dtype=dt).element_size()
    nbytes = sum(lens) * HK * HEAD_DIM * 2 * elem
    n_sets = timing.rotation_count(nbytes, timing.l2_bytes() if dev == "cuda" else timing.DEFAULT_L2)
    sets = []
    for _ in range(n_sets):
        kc, vc, tables, seq_lens, (ks, vs) = _paged(lens, page, fp8, dt, dev)
        q = torch.randn(batch, 1, HQ, HEAD_DIM, device=dev, dtype=dt)
        sets.append((q, kc, vc, tables, seq_lens, ks, vs))
    q, kc, vc, tables, seq_lens, ks, vs = sets[0]
    if batch * ctx <= (1 << 21):  # fp32 reference (a Python loop over the batch)
        want = reference.attention_decode(q.float(), kc, vc, tables, seq_lens, k_scale=ks, v_scale=vs)[0]
    else:
        want = None
    check_ref = lambda o: rel_err(o.float(), want.float()) if want is not None else 0.0  # noqa: E731

    def ours_fn(q, kc, vc, tables, seq_lens, ks, vs):
        return attention_decode(q, kc, vc, tables, seq_lens, max_seqlen_k=ctx, k_scale=ks, v_scale=vs)

    ours = check_then_time("ours", "ours", ours_fn, sets, check_ref, nbytes)
    if "ms" in ours:  # a second timing round: its spread says what difference is noise
        ours["ms_first"] = ours["ms"]
        ms2 = timing.time_ms(ours_fn, sets)
        ours["ms"] = min(ours["ms"], ms2)
        ours["gbps"] = gbps(nbytes, ours["ms"])
    peers = []
    uniform = len(set(lens)) == 1
    if uniform and not fp8:  # SDPA on contiguous caches (no paged or ragged decode): [B, H, 1, D] against [B, Hk, S, D]
        dense = [(s[0].transpose(1, 2), _contiguous(s[1], s[3], ctx, s[5], dt), _contiguous(s[2], s[3], ctx, s[6], dt))
                 for s in sets]
        if want is None:  # compare ours with SDPA flash instead of the reference
            ref_o = sdpa_fn("flash", False, True)(*dense[0]).transpose(1, 2).float()
            ours_out = ours_fn(*sets[0]).float()
            ours["err"] = rel_err(ours_out, ref_o)
            if ours["err"] > TOL:
                ours["wrong"] = f"rel err {ours['err']:.2e} > {TOL:.0e} (against SDPA flash)"
            want_dense = ref_o
        else:
            want_dense = want.float()
        check = lambda o: rel_err(o.transpose(1, 2).float(), want_dense)  # noqa: E731
        for b in (SDPA_BACKENDS if dev == "cuda" else ("math",)):
            peers.append(check_then_time(f"sdpa-{b}", "sdpa", sdpa_fn(b, False, True), dense, check, nbytes))
        del dense
    key = "B=1" if batch == 1 else ("skewed" if not uniform else None)
    kind, target = DECODE_GOALS.get(key, (None, None))
    if kind == "peer":
        goals, goal_text = {"peer": target}, f"≥ {target:.0f}x SDPA"
    elif kind == "copy":
        goals, goal_text = {"copy": target}, f"≥ {target:.0%} of copy"
    else:
        goals, goal_text = {"copy": harness.COPY_GOAL, "peer": 1.0}, "≥ 1.0x SDPA and ≥ 90% of copy"
    if fp8:
        goals, goal_text = {"copy": harness.COPY_GOAL}, "≥ 90% of copy (fp8 bytes; SDPA reads bf16)"
    cfg = kernels.decode_config(HEAD_DIM, HEAD_DIM, HQ // HK, fp8=fp8, single=batch == 1)
    schedule = "split-KV" if batch == 1 else f"persistent stream-K, {cfg['PROGRAMS_PER_SM']} programs per SM"
    note = (f"{label}: KV " + _rate_note(ours, peers, "GB/s", goal_text)
            + f" ({schedule}, {cfg['BLOCK_N']}-key tiles, {cfg['num_stages']} stages"
            + (", no SDPA peer: SDPA has no ragged decode" if not uniform else
               ", no peer: SDPA has no fp8 KV" if fp8 else ", SDPA on contiguous caches") + ")")
    del sets
    return _row("attention_decode", f"{label} {HQ}/{HK} heads d{HEAD_DIM} page {page}",
                [batch, ctx, HQ, HK, HEAD_DIM, page], nbytes, None, "GB/s", ours, peers, _COPY.get("gbps"), goals,
                note)


_COPY = {}


def cases(quick: bool = False):
    """Row builders, run lazily one at a time (each frees its inputs)."""
    for s, d, causal, hq, hk, *dv in (QUICK_PREFILL if quick else PREFILL):
        yield lambda s=s, d=d, causal=causal, hq=hq, hk=hk, dv=dv: prefill_case(
            s, d, causal, hq, hk, *dv, flex=not quick and (s, d, causal) in FLEX_SHAPES)
    if not quick:
        yield lambda: varlen_case(VARLEN)
    for heads, n_new, prefix in (QUICK_MLA_PREFILL if quick else MLA_PREFILL):
        yield lambda heads=heads, n_new=n_new, prefix=prefix: mla_prefill_case(heads, n_new, prefix)
    for label, lens, page, fp8 in (QUICK_DECODE if quick else DECODE):
        yield lambda label=label, lens=lens, page=page, fp8=fp8: decode_case(label, list(lens), page, fp8)


GOAL_TEXT = ("prefill ≥ 1.0x SDPA cuDNN (TFLOP/s); decode (GB/s of KV read) B=1 ≥ 2x SDPA, B=32 and B=64 ≥ 1.0x "
             "SDPA and ≥ 90% of copy, skewed batch ≥ 80% of copy")


def run(result: dict, quick: bool = False, save=lambda: None) -> None:
    result["goal_text"] = GOAL_TEXT
    _COPY["gbps"] = (result.get("ceilings") or {}).get("copy_gbps")
    harness.run_rows(cases(quick), result, progress_line, "attention", save)


def progress_line(row: dict) -> str:
    head = f"[attention] {row.get('op')} {row.get('label')}:"
    if row.get("status") != "ok":
        return f"{head} FAILED ({row.get('failure')})"
    unit = row.get("unit", "GB/s")
    key = "tflops" if unit == "TFLOP/s" else "gbps"
    parts = [f"ours {row['ours'][key]:.0f} {unit}"]
    if row.get("pct_copy") is not None:
        parts.append(f"{row['pct_copy']:.1f}% of copy")
    for p in row["peers"]:
        parts.append(f"{p['name']} {p[key]:.0f}" if key in p else f"{p['name']} n/a")
    if row.get("ratio") is not None:
        parts.append(f"{row['ratio']:.3f}x {row['best_peer']}")
    goal = row.get("goal") or {}
    parts.append("no goal" if not goal else "goal " + ("met" if all(v is not False for v in goal.values()) else
                                                        "miss: " + ", ".join(k for k, v in goal.items() if v is False)))
    return f"{head} " + ", ".join(parts)

