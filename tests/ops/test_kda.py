"""KDA prefill and decode kernels (Triton interpreter, fp16/fp32) against the float64 recurrence."""

import pytest
import torch
import triton

from lmkernels.ops.kda import intra_gluon, kda_decode, kda_prefill, kernels, state_gluon
from lmkernels.ops.kda import reference as R
from tests.helpers import compile_in_fresh_process, nan_empty


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(B, T, H, K, V, dt, gate_scale=1.0):
    q = torch.randn(B, T, H, K, dtype=dt)
    k = torch.randn(B, T, H, K, dtype=dt)
    v = torch.randn(B, T, H, V, dtype=dt)
    f = (torch.randn(B, T, H, K) * gate_scale).to(dt)
    b = torch.randn(B, T, H, dtype=dt)
    return q, k, v, f, b


def gate_kwargs(kind, H, K):
    if kind == "none":  # g is the log decay itself
        return {}
    kw = dict(A_log=torch.rand(H) * 0.5, dt_bias=torch.randn(H * K) * 0.5)
    if kind == "safe":
        kw["lower_bound"] = -5.0
    return kw


def ref_run(q, k, v, f, b, kw, **extra):
    d = lambda x: x.double()  # noqa: E731
    return R.kda(d(q), d(k), d(v), d(f), d(b), **kw, **extra)


TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def test_chunked_reference_matches_recurrence():
    q, k, v, f, b = inputs(1, 83, 2, 16, 8, torch.float64)
    kw = dict(A_log=torch.rand(2), dt_bias=torch.randn(32), l2norm_qk=True, beta_sigmoid=True)
    h0 = torch.randn(2, 2, 16, 8, dtype=torch.float64)
    cu = torch.tensor([0, 40, 83])
    o1, s1 = R.kda(q, k, v, f, b, initial_state=h0, cu_seqlens=cu, **kw)
    o2, s2 = R.kda(q, k, v, f, b, initial_state=h0, cu_seqlens=cu, chunk=16, **kw)
    assert rel(o2, o1) < 1e-12 and rel(s2, s1) < 1e-12


@pytest.mark.parametrize("gate,dt", [("safe", torch.float32), ("softplus", torch.float32), ("none", torch.float32),
                                     ("safe", torch.float16), ("softplus", torch.float16)])
def test_prefill_varlen(gate, dt):
    H, K, V = 2, 64, 64
    lens = [70, 1, 130]
    cu = torch.tensor([0, 70, 71, 201])
    q, k, v, f, b = inputs(1, sum(lens), H, K, V, dt)
    kw = dict(gate_kwargs(gate, H, K), l2norm_qk=True, beta_sigmoid=gate != "none")
    if gate == "none":  # a precomputed log decay and β in (0, 1); q/k normalised outside
        f = torch.nn.functional.logsigmoid(f.float() + 3).to(dt)
        b = torch.sigmoid(b.float()).to(dt)
    h0 = torch.randn(3, H, K, V) * 0.1
    o, S = kda_prefill(q, k, v, f, b, cu_seqlens=cu, initial_state=h0, output_final_state=True, **kw)
    ro, rS = ref_run(q, k, v, f, b, kw, cu_seqlens=cu, initial_state=h0.double())
    assert o.dtype == dt and o.shape == v.shape and S.shape == (3, H, K, V)
    assert rel(o, ro) < TOL[dt] and rel(S, rS) < TOL[dt]


def test_prefill_dense_k128_no_initial_state():
    H, K, V = 1, 128, 128
    q, k, v, f, b = inputs(2, 67, H, K, V, torch.float16)
    kw = dict(gate_kwargs("safe", H, K), l2norm_qk=True, beta_sigmoid=True)
    o, S = kda_prefill(q, k, v, f, b, **kw)
    assert S is None
    ro, _ = ref_run(q, k, v, f, b, kw)
    assert rel(o, ro) < TOL[torch.float16]


@pytest.mark.parametrize("gate,lb,fs", [("softplus", None, 8.0), ("safe", -10.0, 8.0), ("safe", -8.0, 8.0),
                                       ("safe", -5.0, 8.0)])
def test_prefill_strong_decay_no_overflow(gate, lb, fs):
    """Decays of −10…−60 per token (softplus) or at the lower bound: Γ spans hundreds or thousands in a chunk;
    exp(Γ_i − Γ_j) must stay one exponent. −8 is the block-reference path at its limit, −10 the exact path."""
    H, K, V = 1, 64, 64
    q, k, v, f, b = inputs(1, 64 + 29, H, K, V, torch.float32, gate_scale=fs)
    f = f.abs() + 2
    kw = dict(A_log=torch.full((H,), 2.0), dt_bias=None, lower_bound=lb, l2norm_qk=True, beta_sigmoid=True)
    o, S = kda_prefill(q, k, v, f, b, output_final_state=True, **kw)
    ro, rS = ref_run(q, k, v, f, b, kw)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel(o, ro) < 1e-5


def test_prefill_then_decode_equals_prefill(monkeypatch):
    H, K, V = 2, 64, 64
    N, T0, T = 3, 37, 45
    q, k, v, f, b = inputs(N, T, H, K, V, torch.float32)
    kw = dict(gate_kwargs("safe", H, K), l2norm_qk=True, beta_sigmoid=True)
    ro, rS = ref_run(q, k, v, f, b, kw)
    pool = torch.full((6, H, K, V), float("nan"))
    idx = torch.tensor([4, 0, 2])
    pool[idx] = 0.0
    lens = [T0, 1, T0 - 5]  # ragged prefix lengths: packed varlen prefill into the pool
    cu = torch.tensor([0, *lens]).cumsum(0)
    pack = lambda x: torch.cat([x[n, :lens[n]] for n in range(N)])[None]  # noqa: E731
    packed = [pack(x) for x in (q, k, v, f, b)]
    o0, none = kda_prefill(*packed, cu_seqlens=cu, state_pool=pool, state_indices=idx, **kw)
    assert none is None
    for n in range(N):
        s = int(cu[n])
        assert rel(o0[0, s:s + lens[n]], ro[n, :lens[n]]) < 1e-5
    # decode the rest: one token at a time while the longest lags, padding slot −1 in the batch
    outs = {n: [] for n in range(N)}
    pos = list(lens)
    while min(pos) < T:
        live = [n for n in range(N) if pos[n] < T]
        batch_idx = torch.tensor([int(idx[n]) for n in live] + [-1])
        take = lambda x: torch.stack([x[n, pos[n]] for n in live] + [x[0, 0]])  # noqa: E731
        with monkeypatch.context() as m:  # outputs start as NaN: the padding row's 0 must be written
            m.setattr(torch, "empty", nan_empty)
            o = kda_decode(*(take(x) for x in (q, k, v, f, b)), pool, batch_idx, **kw)
        assert (o[-1] == 0).all()
        for j, n in enumerate(live):
            outs[n].append(o[j])
            pos[n] += 1
    for n in range(N):
        got = torch.stack(outs[n])
        assert rel(got, ro[n, lens[n]:]) < 1e-5
    assert rel(pool[idx], rS) < 1e-5
    untouched = torch.tensor([1, 3, 5])
    assert torch.isnan(pool[untouched]).all()


@pytest.mark.parametrize("gate,bv", [("softplus", 16), ("safe", 32), ("safe", 64)])
def test_decode_multi_token(monkeypatch, gate, bv):
    """Every V block width decode_config picks (16 / 32 / 64 columns, 1 / 2 / 4 warps); a padding slot in the
    middle of the batch gets 0 for each of its tokens (outputs start as NaN) and leaves the pool alone."""
    monkeypatch.setitem(kernels.TUNE, "decode", dict(BV=bv, num_warps=bv // 16))
    H, K, V, N, Q = 2, 128, 128, 3, 3
    q, k, v, f, b = inputs(N, Q, H, K, V, torch.float16)
    kw = dict(gate_kwargs(gate, H, K), l2norm_qk=True, beta_sigmoid=True)
    pool = torch.randn(3, H, K, V) * 0.1
    idx = torch.tensor([2, -1, 0])
    live, slots = [0, 2], torch.tensor([2, 0])
    before = pool.clone()
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", nan_empty)
        o = kda_decode(q, k, v, f, b, pool, idx, **kw)
    ro, rS = ref_run(*(x[live] for x in (q, k, v, f, b)), kw, initial_state=before[slots].double())
    assert o.shape == v.shape and rel(o[live], ro) < TOL[torch.float16]
    assert (o[1] == 0).all()
    assert rel(pool[slots], rS) < 1e-5 and torch.equal(pool[1], before[1])


def test_decode_paired_reduction(monkeypatch):
    """The GPU's decode sums S·(D k) and S·(D q) in one tuple reduction (PAIRED), the interpreter in two by
    default (its tuple reduction runs element by element): the paired line, at one small shape."""
    H, K, V, N, Q = 1, 64, 64, 1, 2
    q, k, v, f, b = inputs(N, Q, H, K, V, torch.float32)
    kw = dict(gate_kwargs("safe", H, K), l2norm_qk=True, beta_sigmoid=True)
    before = torch.randn(2, H, K, V) * 0.1
    outs = {}
    for paired in (True, False):
        monkeypatch.setitem(kernels.TUNE, "decode", dict(BV=V, num_warps=4, PAIRED=paired))
        pool = before.clone()
        outs[paired] = kda_decode(q, k, v, f, b, pool, torch.tensor([1]), **kw), pool
    ro, rS = ref_run(q, k, v, f, b, kw, initial_state=before[1:].double())
    for o, pool in outs.values():
        assert rel(o, ro) < 1e-5 and rel(pool[1:], rS) < 1e-5 and torch.equal(pool[0], before[0])


def test_bad_inputs():
    H, K, V = 2, 64, 64
    q, k, v, f, b = inputs(1, 10, H, K, V, torch.float16)
    with pytest.raises(ValueError, match="head dim K"):
        kda_prefill(q[..., :48], k[..., :48], v, f[..., :48], b)
    with pytest.raises(ValueError, match="v must be"):
        kda_prefill(q, k, v[:, :, :1], f, b)
    with pytest.raises(ValueError, match="k must have"):
        kda_prefill(q, k[:, :, :1], v, f, b)
    with pytest.raises(TypeError, match="k must have dtype"):
        kda_prefill(q, k.float(), v, f, b)
    with pytest.raises(ValueError, match="A_log"):
        kda_prefill(q, k, v, f, b, A_log=torch.zeros(3))
    with pytest.raises(ValueError, match="lower_bound"):
        kda_prefill(q, k, v, f, b, lower_bound=-5.0)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_prefill(q, k, v, f, b, A_log=torch.zeros(H), lower_bound=2.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_prefill(q, k, v, f, b, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="initial_state"):
        kda_prefill(q, k, v, f, b, initial_state=torch.zeros(2, H, K, V))
    pool = torch.zeros(2, H, K, V)
    with pytest.raises(ValueError, match="state_indices"):
        kda_prefill(q, k, v, f, b, state_pool=pool, state_indices=torch.tensor([2]))
    with pytest.raises(ValueError, match="state_indices"):
        kda_decode(q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], pool, torch.tensor([5]))
    with pytest.raises(ValueError, match="state_pool"):
        kda_decode(q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], pool[:, :1], torch.tensor([0]))
    with pytest.raises(TypeError, match="state_pool"):
        kda_decode(q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], pool.half(), torch.tensor([0]))
    with pytest.raises(ValueError, match="scale"):
        kda_decode(q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], pool, torch.tensor([0]), scale=-1.0)


def test_cpu_reference_path(monkeypatch):
    """Without the interpreter, CPU tensors run the reference (same API, same results)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    H, K, V = 1, 64, 64
    q, k, v, f, b = inputs(1, 20, H, K, V, torch.float32)
    kw = dict(gate_kwargs("safe", H, K), l2norm_qk=True, beta_sigmoid=True)
    o, S = kda_prefill(q, k, v, f, b, output_final_state=True, **kw)
    ro, rS = ref_run(q, k, v, f, b, kw)
    assert rel(o, ro) < 1e-6 and rel(S, rS) < 1e-6


@pytest.mark.parametrize("cfg", [{"BK": 16, "BKW": 32}, {"BK": 64, "BKW": 128}, {"BT": 64, "BK": 32, "BKW": 64},
                                 {"BT": 16, "BK": 32, "BKW": 64, "BV": 64, "intra_warps": 2},
                                 {"BT": 16, "BK": 32, "BKW": 64, "BV": 64, "intra_warps": 2, "onepass": True}])
@pytest.mark.parametrize("l2", [True, False])
def test_prefill_launch_configs(monkeypatch, cfg, l2):
    """Other blocks of key channels for A (BK) and for W/U (BKW), 16- and 64-token chunks, the 16-token W pass
    from the stored K ⊙ e^Γ (onepass), with and without the fused L2 norm (the safe-gate path applies the norms
    to A and Aqk as row/column scales): the same results."""
    from lmkernels.ops.kda import kernels

    monkeypatch.setitem(kernels.TUNE, "prefill", cfg)
    H, K, V = 2, 128, 64
    cu = torch.tensor([0, 1, 65, 142])
    q, k, v, f, b = inputs(1, 142, H, K, V, torch.float32)
    if not l2:
        q, k = R.l2norm(q), R.l2norm(k)
    kw = dict(gate_kwargs("safe", H, K), l2norm_qk=l2, beta_sigmoid=True)
    o, S = kda_prefill(q, k, v, f, b, cu_seqlens=cu, output_final_state=True, **kw)
    ro, rS = ref_run(q, k, v, f, b, kw, cu_seqlens=cu)
    assert rel(o, ro) < TOL[torch.float32] and rel(S, rS) < TOL[torch.float32]


@pytest.mark.parametrize("gate", ["safe", "softplus", "none"])
def test_prefill_16_token_chunks(monkeypatch, gate):
    """The 16-token configuration (what prefill_config gives many heads over short sequences); every gate form,
    varlen with a length-1 sequence and lengths not multiples of 16, initial and final states."""
    from lmkernels.ops.kda import kernels

    H, K, V = 2, 64, 64
    lens = [37, 1, 50]
    cfg = kernels.prefill_config(K, V, len(lens), 32, sum(lens), max(lens))
    assert cfg["BT"] == 16
    monkeypatch.setitem(kernels.TUNE, "prefill", cfg)
    cu = torch.tensor([0, *lens]).cumsum(0)
    q, k, v, f, b = inputs(1, sum(lens), H, K, V, torch.float32)
    kw = dict(gate_kwargs(gate, H, K), l2norm_qk=True, beta_sigmoid=gate != "none")
    if gate == "none":
        f = torch.nn.functional.logsigmoid(f + 3)
        b = torch.sigmoid(b)
    h0 = torch.randn(3, H, K, V) * 0.1
    o, S = kda_prefill(q, k, v, f, b, cu_seqlens=cu, initial_state=h0, output_final_state=True, **kw)
    ro, rS = ref_run(q, k, v, f, b, kw, cu_seqlens=cu, initial_state=h0.double())
    assert rel(o, ro) < TOL[torch.float32] and rel(S, rS) < TOL[torch.float32]


def test_prefill_chunk_choice():
    """32-token chunks for one long sequence over few heads (the chain of chunk updates dominates), 16 otherwise."""
    from lmkernels.ops.kda.kernels import prefill_config

    assert prefill_config(128, 128, 1, 32, 8192, 8192)["BT"] == 16
    assert prefill_config(128, 128, 8, 32, 8192, 1024)["BT"] == 16
    assert prefill_config(128, 128, 1, 16, 8192, 8192)["BT"] == 32
    assert prefill_config(128, 128, 1, 24, 8192, 8192)["BT"] == 16
    assert prefill_config(128, 128, 2, 8, 65536, 32768, 2)["BT"] == 32
    # the state kernels beside the intra kernel only where one sequence's chain is at least half the work
    one = prefill_config(128, 128, 1, 32, 32768, 32768)
    assert one["overlap"] and one["segments"] == 8 and one["BV"] == 32 and not one["onepass"]
    assert prefill_config(128, 128, 8, 32, 8192, 1024)["onepass"]
    assert not prefill_config(128, 128, 8, 32, 8192, 1024)["overlap"]
    assert prefill_config(128, 128, 1, 96, 8192, 8192)["overlap"]
    assert prefill_config(128, 128, 1, 96, 8192, 8192)["BV"] == 64  # a power of two that divides V
    assert not prefill_config(128, 128, 1, 128, 8192, 8192)["overlap"]
    two = prefill_config(128, 128, 2, 32, 16384, 8192, 2)  # two long chains: ~128 state programs between them
    assert two["overlap"] and two["segments"] == 4 and two["BV"] == 64
    few_heads = prefill_config(128, 128, 1, 16, 8192, 8192)
    assert few_heads["BT"] == 32 and few_heads["overlap"] and few_heads["segments"] == 4
    assert not prefill_config(128, 128, 1, 16, 2000, 2000)["overlap"]  # too short to cut
    # the Gluon state kernel: BV-64 chains, with ~1024-token segments beside the Triton intra kernel only
    gs = prefill_config(128, 128, 1, 32, 8192, 8192, gluon_state=True)
    assert gs["overlap"] and gs["BV"] == 64 and gs["segments"] == 8
    both = prefill_config(128, 128, 1, 32, 8192, 8192, gluon_state=True, gluon_intra=True, num_sms=132)
    assert both["overlap"] and both["BV"] == 64 and both["segments"] == 4
    # beside the Gluon intra kernel, no overlap where the chains fill whole waves: 128 on 132 SMs, not 192 or 96
    h64 = dict(gluon_state=True, gluon_intra=True, num_sms=132)
    assert not prefill_config(128, 128, 1, 64, 8192, 8192, **h64)["overlap"]
    assert prefill_config(128, 128, 1, 96, 8192, 8192, **h64)["overlap"]
    assert prefill_config(128, 128, 1, 48, 8192, 8192, **h64)["overlap"]
    assert prefill_config(128, 128, 1, 64, 8192, 8192, gluon_state=True)["overlap"]  # Triton intra kernel
    ragged = prefill_config(128, 128, 6, 32, 8192, 3063, 2, full_seqs=1, **h64)  # one chain per head is long
    assert ragged["overlap"] and ragged["segments"] == 2


@pytest.mark.parametrize("segments", [2, 5])
def test_prefill_segments(monkeypatch, segments):
    """The chunk list cut into segments (the state kernel run per segment, states carried across the cuts):
    sequences crossing one and two cuts, an empty and a length-1 sequence, states from and to a shuffled pool in
    place. The same values as one segment, bit for bit, and the float64 reference."""
    from lmkernels.ops.kda import kernels

    H, K, V = 2, 64, 64
    lens = [70, 0, 1, 130, 33]
    cu = torch.tensor([0, *lens]).cumsum(0)
    q, k, v, f, b = inputs(1, sum(lens), H, K, V, torch.float32)
    kw = dict(gate_kwargs("safe", H, K), l2norm_qk=True, beta_sigmoid=True)
    idx = torch.tensor([3, 0, 5, 1, 4])
    h0 = torch.randn(6, H, K, V) * 0.1
    runs = []
    for n_seg in (1, segments):
        monkeypatch.setitem(kernels.TUNE, "prefill", {"segments": n_seg})
        pool = h0.clone()
        pool[2] = float("nan")  # no sequence's slot: must stay untouched
        o, _ = kda_prefill(q, k, v, f, b, cu_seqlens=cu, state_pool=pool, state_indices=idx, **kw)
        runs.append((o, pool))
    (o1, p1), (o2, p2) = runs
    assert torch.equal(o2, o1) and torch.equal(p2[idx], p1[idx]) and torch.isnan(p2[2]).all()
    ro, rS = ref_run(q, k, v, f, b, kw, cu_seqlens=cu, initial_state=h0[idx].double())
    assert rel(o2, ro) < TOL[torch.float32] and rel(p2[idx], rS) < TOL[torch.float32]
    assert torch.equal(p2[idx[1]], h0[idx[1]])  # the empty sequence keeps its state


def test_prefill_offset_widths(monkeypatch):
    """int32 token offsets (what the kernels use below 2^31 elements) and int64 ones give the same values."""
    from lmkernels.ops.kda import kernels

    H, K, V = 2, 64, 64
    cu = torch.tensor([0, 19, 20, 71])
    q, k, v, f, b = inputs(1, 71, H, K, V, torch.float32)
    kw = dict(gate_kwargs("safe", H, K), l2norm_qk=True, beta_sigmoid=True)
    runs = []
    for i64 in (False, True):
        monkeypatch.setitem(kernels.TUNE, "i64", i64)
        runs.append(kda_prefill(q, k, v, f, b, cu_seqlens=cu, output_final_state=True, **kw))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    ro, rS = ref_run(q, k, v, f, b, kw, cu_seqlens=cu)
    assert rel(runs[0][0], ro) < TOL[torch.float32] and rel(runs[0][1], rS) < TOL[torch.float32]


def test_int64_offsets_rule():
    """int64 offsets exactly where a token's offset can reach 2^31, including an input with a wide token stride."""
    from lmkernels.ops.kda.kernels import needs_int64_offsets

    x = torch.empty(4, 8)
    assert not needs_int64_offsets(8192, 16, 32 * 128, x)
    assert needs_int64_offsets(2**31 // (32 * 128) - 15, 16, 32 * 128, x)  # the last padded row reaches 2^31
    assert not needs_int64_offsets(2**31 // (32 * 128) - 16, 16, 32 * 128, x)
    wide = torch.empty(2, 3 * 2**20)[:, :8]  # a token stride of 3·2^20 elements
    assert needs_int64_offsets(1024, 16, 32 * 128, wide) and not needs_int64_offsets(1024, 16, 32 * 128, x)


def test_segment_table_pieces():
    """Every chunk in exactly one piece, the segments partition the chunk table, each segment advances every
    sequence that still has chunks and lists its pieces longest first, and a sequence's pieces hand their state
    on through one carry slot each."""
    from lmkernels.ops.kda.kernels import segment_table

    cu = [0, 70, 70, 71, 201, 234]
    chunks, pieces, segs, slots = segment_table(cu, 32, 5)
    assert len(segs) == 5 and [s[0] for s in segs] == [0, *[s[1] for s in segs[:-1]]] and segs[-1][1] == len(chunks)
    assert sorted(c for c, _ in chunks) == sorted(c for s, e in zip(cu, cu[1:]) for c in range(s, e, 32))
    by_seq = {}
    for bos, eos, c0, n, cin, cout in pieces:
        assert [c for c, _ in chunks[c0:c0 + -(-(eos - bos) // 32)]] == list(range(bos, eos, 32))
        by_seq.setdefault(n, []).append((bos, eos, cin, cout))
    assert [len(by_seq[n]) for n in range(5)] == [3, 1, 1, 5, 2]
    assert sorted(p[5] for p in pieces if p[5] >= 0) == list(range(slots))
    sizes = [[eos - bos for bos, eos, *_ in pieces[p0:p0 + n_p]] for _, _, p0, n_p in segs]
    assert all(z == sorted(z, reverse=True) for z in sizes) and sizes[0] != sorted(sizes[0])
    for n, ps in by_seq.items():
        assert ps[0][2] == -1 and ps[-1][3] == -1 and ps[0][0] == cu[n] and ps[-1][1] == cu[n + 1]
        for x, y in zip(ps, ps[1:]):
            assert x[3] == y[2] >= 0 and x[1] == y[0]


@pytest.mark.skipif(not triton.__version__.startswith(state_gluon.TRITON_VERSIONS),
                    reason="the Gluon state kernel runs only on the triton it was checked with")
def test_gluon_state_kernel_compiles_for_hopper():
    """The Gluon state kernel has no interpreter path (the GPU check runs it against the reference; its outputs are
    bit-equal to the Triton state kernel's): here it must build for sm_90 with its design intact: mma.sync dots
    from a cp.async ring, no wgmma, no spills. In a fresh process: the interpreter tests patch triton.language in
    this one, and Gluon compiles through it."""
    C = "lmkernels.ops.kda.compile_check"
    for r in compile_in_fresh_process(f"[{C}.state_gluon(64), {C}.state_gluon(32, 'fp16', 64, 64)]"):
        assert r["mma"] > 0 and r["cp_async"] > 0 and r["wgmma"] == 0 and r["stack"] == 0, r


def test_gluon_state_kernel_chosen_for_hopper_only():
    """16-token chunks of 16-bit inputs with int32 offsets on an sm_90 GPU; never on the CPU."""
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    assert not state_gluon.supported(q, 16, False)
    assert kernels.GLUON_STATE_MIN_BV == 64


@pytest.mark.skipif(not triton.__version__.startswith(intra_gluon.TRITON_VERSIONS),
                    reason="the Gluon intra kernel runs only on the triton it was checked with")
def test_gluon_intra_kernel_compiles_for_hopper():
    """The Gluon intra kernel has no interpreter path (the GPU check runs it against the reference; its outputs agree
    with the Triton intra kernel's to bf16 rounding): here it must build for sm_90 as designed, for K = 128 and 64:
    q, k, g by cp.async, mma.sync dots, no wgmma, no spills. In a fresh process (see the state kernel's test)."""
    C = "lmkernels.ops.kda.compile_check"
    got = compile_in_fresh_process(f"[{C}.intra_gluon(32), {C}.intra_gluon(32, 64)]")
    for r, dots in zip(got, (72, 48)):  # A and Aq per step, six tf32 dots of the inverse, W per step
        assert r["mma"] == dots and r["cp_async"] > 0 and r["wgmma"] == 0 and r["stack"] == 0, r


def test_gluon_intra_kernel_eligibility():
    """What the Gluon intra kernel takes: 16-token chunks of bf16 inputs with the safe gate and int32 offsets, q, k,
    g in 16-byte pieces; never a CPU tensor."""
    T, H, K = 40, 4, 128
    q, k, g = (torch.randn(T, H, K).to(torch.bfloat16) for _ in range(3))
    ok = triton.__version__.startswith(intra_gluon.TRITON_VERSIONS)
    assert intra_gluon.eligible(q, k, g, gate=2, safe=True) == ok
    packed = torch.randn(T, H, 3 * K).to(torch.bfloat16)  # views of one projection: head stride 3K
    assert intra_gluon.eligible(packed[..., :K], packed[..., K:2 * K], g, 2, True) == ok
    odd = torch.randn(T, H, K + 8).to(torch.bfloat16)[..., :K]  # head stride 136: not a multiple of 16
    assert not intra_gluon.eligible(odd, k, g, 2, True)
    assert not intra_gluon.eligible(q.half(), k.half(), g.half(), 2, True)
    assert not intra_gluon.eligible(q, k, g, gate=1, safe=False)  # softplus gate: the exact per-element path
    assert not intra_gluon.eligible(q, k, g, gate=2, safe=False)  # lower_bound below SAFE_MIN_LOWER_BOUND
    assert not intra_gluon.eligible(q, k, g, 2, True, bt=32)
    assert not intra_gluon.eligible(q, k, g, 2, True, i64=True)
    assert not intra_gluon.supported(q, k, g, 2, True)  # a CPU tensor
