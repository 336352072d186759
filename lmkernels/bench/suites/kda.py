"""KDA, bf16: chunked prefill (TFLOP/s) against fla-core's `chunk_kda`, recurrent decode (GB/s of state) against
fla's `fused_recurrent_kda`, with the goals of issue 5.

Every implementation runs with the same fused options (raw gate with A_log/dt_bias and the safe gate
lower_bound = −5, L2 norm of q/k and β sigmoid in the kernel, final states written) and is checked against the
float64 reference before it is timed; both relative errors are in the row (`ours.err`, `peers[i].err`), since
the issue asks our error to be no worse than fla's on the same inputs (`row["accuracy_ok"]`).
- prefill rows: `flops` is the chunked form's nominal count 6C²K + 4C²V + 6CKV per 64-token chunk and head
  (the UT inverse not counted), so TFLOP/s ratios are time ratios; `gbps` counts q, k, v, g, β read, o and the
  final states written once. Goal ≥ 2.3x fla chunk_kda.
- decode rows (one token per sequence, states in a shuffled pool): `gbps` counts the fp32 state read and
  written once plus q, k, v, g, β, o; pct_copy against the device-to-device copy measured in the same run.
  Goal ≥ 1.3x fla fused_recurrent_kda and ≥ 80% of copy.
Timing: `timing.time_ms` (CUDA-graph replays; decode state pools rotated through sets larger than L2).
"""

import torch

from .. import harness, timing
from ..harness import check_then_time, rel_err, short_error

DTYPE = torch.bfloat16
HEAD = 128
LOWER_BOUND = -5.0
CHUNK = 64
FLASHKDA_VARLEN = (1300, 547, 2048, 963, 271, 3063)
# (label, heads, sequence lengths, dense batch): dense rows pass [B, T, H, K] without cu_seqlens
PREFILL = tuple(
    row for h in (32, 64, 96) for row in (
        (f"T=8192 H={h}", h, (8192,), True),
        (f"varlen 6 seqs (8192 tokens) H={h}", h, FLASHKDA_VARLEN, False),
        (f"varlen 8x1024 H={h}", h, (1024,) * 8, False))
) + (("T=32768 H=32", 32, (32768,), True), ("B=8x4096 H=32", 32, (4096,) * 8, True))
QUICK_PREFILL = PREFILL[:3]  # quick: FlashKDA's three H=32 shapes
DECODE_HEADS = 32
DECODE = (1, 16, 64, 256)
QUICK_DECODE = DECODE  # and every decode row (fits one 10-minute GPU call; fla autotunes each new shape)
PREFILL_GOAL = 2.3
DECODE_GOAL = 1.3
DECODE_COPY_GOAL = 0.80
REF_CHUNK = 64  # float64 reference: the chunked form (validated against the recurrence in tests) for speed


def _dev():
    return harness.device()


def _dtype():
    """bf16 on the GPU; fp16 in a CPU dry run (the Triton interpreter computes bf16 dots wrong)."""
    return DTYPE if _dev() == "cuda" else torch.float16


def _fla():
    from fla.ops.kda import chunk_kda  # noqa: F401
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return chunk_kda, fused_recurrent_kda_fwd


def _gate_params(h):
    dev = _dev()
    a_log = torch.log(torch.empty(h, device=dev).uniform_(1, 4))
    dt_bias = torch.randn(h * HEAD, device=dev) * 0.5
    return a_log, dt_bias


def _inputs(b, t, h, dt, dev):
    q = torch.randn(b, t, h, HEAD, device=dev, dtype=dt)
    k = torch.randn(b, t, h, HEAD, device=dev, dtype=dt)
    v = torch.randn(b, t, h, HEAD, device=dev, dtype=dt)
    f = (torch.randn(b, t, h, HEAD, device=dev) * 2 - 3).to(dt)  # raw gate: decays from ~0 to the bound
    beta = torch.randn(b, t, h, device=dev, dtype=dt)
    return q, k, v, f, beta


def _row(op, label, shape, nbytes, flops, unit, ours, peers, copy_gbps, goals, note=""):
    row = harness.unit_row(op, label, shape, nbytes, unit, ours, peers, copy_gbps, goals, note,
                           goal_kinds=("copy", "peer"), flops=flops)
    checked = [p for p in peers if "err" in p and "wrong" not in p]
    row["accuracy_ok"] = no_worse(ours["err"], [p["err"] for p in checked]) if "err" in ours and checked else None
    return row


def no_worse(err, peer_errs, rel=1e-6):
    """Ours no worse than the most accurate peer; errors equal to six digits are equal (identical bf16 outputs
    can give norms that differ in the last bits)."""
    return bool(err <= min(peer_errs) * (1 + rel))


def _errs(ours, peers):
    parts = [f"ours {ours['err']:.2e}" if "err" in ours else "ours n/a"]
    parts += [f"{p['name']} {p['err']:.2e}" for p in peers if "err" in p]
    return "rel err vs float64: " + ", ".join(parts)


def _rates(ours, peers, unit):
    key = "tflops" if unit == "TFLOP/s" else "gbps"
    parts = [f"ours {ours[key]:.1f}" if key in ours else "ours n/a"]
    parts += [f"{p['name']} {p[key]:.1f}" for p in peers if key in p]
    return f"{unit}: " + ", ".join(parts)


def prefill_flops(n_tokens, heads, k=HEAD, v=HEAD, c=CHUNK):
    per_chunk = 6 * c * c * k + 4 * c * c * v + 6 * c * k * v
    return per_chunk * heads * n_tokens // c


def prefill_case(label, h, lens, dense):
    from ...ops.kda import kda_prefill, reference

    dt, dev = _dtype(), _dev()
    lens = list(lens)
    total = sum(lens)
    b, t = (len(lens), lens[0]) if dense else (1, total)
    q, k, v, f, beta = _inputs(b, t, h, dt, dev)
    a_log, dt_bias = _gate_params(h)
    cu_cpu = None if dense else torch.tensor([0, *lens]).cumsum(0)
    cu = None if dense else cu_cpu.to(dev)
    n_seqs = len(lens)
    opts = dict(A_log=a_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND)
    d = lambda x: x.double()  # noqa: E731
    want_o, want_s = reference.kda(d(q), d(k), d(v), d(f), d(beta), cu_seqlens=cu_cpu, l2norm_qk=True,
                                   beta_sigmoid=True, chunk=REF_CHUNK, **opts)
    check = lambda out: rel_err(out[0].float(), want_o)  # noqa: E731
    elem = q.element_size()
    nbytes = (4 * total * h * HEAD + total * h) * elem + total * h * HEAD * elem + n_seqs * h * HEAD * HEAD * 4
    flops = prefill_flops(total, h)

    def ours_fn(q, k, v, f, beta):
        return kda_prefill(q, k, v, f, beta, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, output_final_state=True,
                           l2norm_qk=True, beta_sigmoid=True, **opts)

    ours = check_then_time("ours", "ours", ours_fn, [(q, k, v, f, beta)], check, nbytes, flops)
    if "err" in ours:
        try:
            ours["state_err"] = rel_err(ours_fn(q, k, v, f, beta)[1], want_s)
        except Exception as e:  # noqa: BLE001
            ours["state_err_missing"] = short_error(e)
    peers = []
    try:
        chunk_kda, _ = _fla()

        def fla_fn(q, k, v, f, beta):
            kw = {} if dense else dict(cu_seqlens=cu.long(), cu_seqlens_cpu=cu_cpu.long())
            return chunk_kda(q, k, v, f, beta, A_log=a_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                             use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                             lower_bound=LOWER_BOUND, output_final_state=True, **kw)

        peers.append(check_then_time("fla chunk_kda", "fla", fla_fn, [(q, k, v, f, beta)], check, nbytes, flops))
    except Exception as e:
        peers.append({"name": "fla chunk_kda", "kind": "fla", "missing": short_error(e)})
    note = (f"{label} K=V={HEAD} bf16, fused gate (lower_bound {LOWER_BOUND:g}), L2, β sigmoid, final states: "
            + _rates(ours, peers, "TFLOP/s") + "; " + _errs(ours, peers) + f"; goal ≥ {PREFILL_GOAL}x fla")
    del want_o, want_s
    return _row("kda_prefill", label, [b, t, h, HEAD, HEAD], nbytes, flops, "TFLOP/s", ours, peers, None,
                {"peer": PREFILL_GOAL}, note)


def decode_case(batch, h=None):
    from ...ops.kda import kda_decode, reference

    h = h or DECODE_HEADS
    dt, dev = _dtype(), _dev()
    state_bytes = batch * h * HEAD * HEAD * 4
    n_sets = timing.rotation_count(2 * state_bytes, timing.l2_bytes() if dev == "cuda" else timing.DEFAULT_L2)
    a_log, dt_bias = _gate_params(h)
    opts = dict(A_log=a_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND)
    sets = []
    for _ in range(n_sets):
        q, k, v, f, beta = _inputs(batch, 1, h, dt, dev)
        pool = torch.randn(batch + 3, h, HEAD, HEAD, device=dev) * 0.05
        idx = torch.randperm(batch + 3, device=dev)[:batch].to(torch.int32)
        sets.append((q, k, v, f, beta, pool, idx))
    q, k, v, f, beta, pool, idx = sets[0]
    pool0 = pool.clone()  # the timed calls update the pools in place; checks start from this copy
    d = lambda x: x.double()  # noqa: E731
    ref_pool = pool0.double()
    want_o = reference.kda_decode(d(q), d(k), d(v), d(f), d(beta), ref_pool, idx.cpu(), l2norm_qk=True,
                                  beta_sigmoid=True, **opts)
    want_s = ref_pool[idx.long()]

    def checker(run):
        def check(_):
            p = pool0.clone()
            o = run(q, k, v, f, beta, p, idx)
            return max(rel_err(o.float(), want_o), rel_err(p[idx.long()], want_s))
        return check

    def ours_fn(q, k, v, f, beta, pool, idx):
        return kda_decode(q, k, v, f, beta, pool, idx, l2norm_qk=True, beta_sigmoid=True, **opts)

    elem = q.element_size()
    nbytes = 2 * state_bytes + (4 * batch * h * HEAD + batch * h) * elem
    sets_run = sets
    ours = check_then_time("ours", "ours", ours_fn, sets_run, checker(ours_fn), nbytes)
    peers = []
    try:
        _, fused_recurrent_kda_fwd = _fla()

        def fla_fn(q, k, v, f, beta, pool, idx):
            return fused_recurrent_kda_fwd(q, k, v, f, beta, A_log=a_log, dt_bias=dt_bias, initial_state=pool,
                                           inplace_final_state=True, ssm_state_indices=idx,
                                           use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                           use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)[0]

        peers.append(check_then_time("fla fused_recurrent_kda", "fla", fla_fn, sets_run, checker(fla_fn), nbytes))
    except Exception as e:
        peers.append({"name": "fla fused_recurrent_kda", "kind": "fla", "missing": short_error(e)})
    label = f"decode B={batch} H={h} one token"
    note = (f"{label}, K=V={HEAD}, fp32 states in a shuffled pool: " + _rates(ours, peers, "GB/s") + "; "
            + _errs(ours, peers) + f"; goal ≥ {DECODE_GOAL}x fla and ≥ {DECODE_COPY_GOAL:.0%} of copy")
    del sets
    return _row("kda_decode", label, [batch, 1, h, HEAD, HEAD], nbytes, None, "GB/s", ours, peers,
                _COPY.get("gbps"), {"peer": DECODE_GOAL, "copy": DECODE_COPY_GOAL}, note)


_COPY = {}


def cases(quick: bool = False):
    for label, h, lens, dense in (QUICK_PREFILL if quick else PREFILL):
        yield lambda label=label, h=h, lens=lens, dense=dense: prefill_case(label, h, lens, dense)
    for b in (QUICK_DECODE if quick else DECODE):
        yield lambda b=b: decode_case(b)


def run(result: dict, quick: bool = False, save=lambda: None) -> None:
    _COPY["gbps"] = (result.get("ceilings") or {}).get("copy_gbps")
    with torch.inference_mode():
        harness.run_rows(cases(quick), result, progress_line, "kda", save)


def progress_line(row: dict) -> str:
    head = f"[kda] {row.get('op')} {row.get('label')}:"
    if row.get("status") != "ok":
        return f"{head} FAILED ({row.get('failure')})"
    unit = row.get("unit", "GB/s")
    key = "tflops" if unit == "TFLOP/s" else "gbps"
    parts = [f"ours {row['ours'][key]:.1f} {unit} ({row['ours']['ms']:.3f} ms, err {row['ours'].get('err', 0):.1e})"]
    if row.get("pct_copy") is not None:
        parts.append(f"{row['pct_copy']:.1f}% of copy")
    for p in row["peers"]:
        parts.append(f"{p['name']} {p[key]:.1f} ({p['ms']:.3f} ms, err {p.get('err', 0):.1e})" if key in p
                     else f"{p['name']} n/a ({p.get('missing') or p.get('wrong')})")
    if row.get("ratio") is not None:
        parts.append(f"{row['ratio']:.2f}x {row['best_peer']}")
    goal = row.get("goal") or {}
    parts.append("goal " + ("met" if all(v is not False for v in goal.values()) else
                            "miss: " + ", ".join(k for k, v in goal.items() if v is False)))
    if row.get("accuracy_ok") is not None:
        parts.append("accuracy " + ("ok" if row["accuracy_ok"] else "worse than peer"))
    return f"{head} " + ", ".join(parts)
