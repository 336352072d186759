"""`lmkernels check`: every op against its reference.py on the current device, fresh random inputs.

On CUDA the Triton kernels run at real sizes; on CPU they run through the Triton interpreter (the CLI
turns it on before any kernel module is imported) at small sizes, because the interpreter is slow.
"""

import time

import torch

from .ops import activation, attention, gemv, kda, mla, norm, rope

# Relative-error limits against the reference at the op's input dtype. Both sides compute in fp32 and
# round once, so they differ by about one rounding of the output (bf16: 2^-9 relative).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _norm_cases(rows, dev, dt):
    for n in (576, 2304, 5120, 7168):
        x = torch.randn(rows, n, device=dev, dtype=dt) * 2 + 0.5
        res = torch.randn_like(x)
        w = torch.rand(n, device=dev) + 0.5
        b = torch.randn(n, device=dev)
        yield "rms_norm", x.shape, (lambda: norm.rms_norm(x, w, 1e-6)), (lambda: norm.reference.rms_norm(x, w, 1e-6))
        yield ("rms_norm+residual", x.shape, (lambda: torch.cat(norm.rms_norm(x, w, 1e-6, res), -1)),
               lambda: torch.cat(norm.reference.norm(x, res, w, None, 1e-6, "rms"), -1))
        yield ("rms_norm(1+w)", x.shape, (lambda: norm.rms_norm(x, w, 1e-6, weight_offset=1.0)),
               lambda: norm.reference.rms_norm(x, w, 1e-6, 1.0))
        yield ("layer_norm+residual", x.shape, (lambda: torch.cat(norm.layer_norm(x, w, b, 1e-5, res), -1)),
               lambda: torch.cat(norm.reference.norm(x, res, w, b, 1e-5, "layer"), -1))
        for approx, form in (("tanh", "tanh"), ("none", "erf")):
            yield (f"layer_norm_gelu({approx})", x.shape,
                   (lambda: norm.layer_norm_gelu(x, w, b, approximate=approx)),
                   lambda: norm.reference.layer_norm(x, w, b, 1e-5, form))


def _activation_cases(rows, dev, dt):
    for d in (2304, 14336):
        x = torch.randn(rows, 2 * d, device=dev, dtype=dt) * 3
        yield "silu_and_mul", x.shape, (lambda: activation.silu_and_mul(x)), (lambda: activation.reference.silu_and_mul(x))
        for approx in ("tanh", "none"):
            yield (f"gelu_and_mul({approx})", x.shape, (lambda: activation.gelu_and_mul(x, approx)),
                   lambda: activation.reference.gelu_and_mul(x, approx))


def _rope_cases(tokens, dev, dt):
    cache = rope.build_cos_sin_cache(128, 65536, 500000.0, device=dev)
    for heads, dim, rot, neox in ((32, 128, 128, True), (16, 64, 64, False), (8, 128, 64, True)):
        q = torch.randn(tokens, heads, dim, device=dev, dtype=dt)
        k = torch.randn(tokens, max(1, heads // 4), dim, device=dev, dtype=dt)
        pos = torch.randint(0, 65536, (tokens,), device=dev)
        c = cache[:, :rot] if rot == 128 else rope.build_cos_sin_cache(rot, 65536, 10000.0, device=dev)
        name = f"apply_rotary({'neox' if neox else 'gptj'}, rot {rot})"

        def ours(q=q, k=k, c=c, pos=pos, neox=neox):
            q2, k2 = rope.apply_rotary(q.clone(), k.clone(), c, pos, is_neox=neox)
            return torch.cat([q2.flatten(1), k2.flatten(1)], 1)

        def ref(q=q, k=k, c=c, pos=pos, neox=neox):
            q2, k2 = rope.reference.apply_rotary(q, k, c, pos, neox)
            return torch.cat([q2.flatten(1), k2.flatten(1)], 1)

        yield name, (tokens, heads, dim), ours, ref


def _gemv_cases(rows, dev, dt):
    """The decode-time linear layers: plain, RMSNorm + SwiGLU, residual; qkv with rotary and the cache write."""
    big = dev.type == "cuda"
    k, n = (4096, 14336) if big else (300, 40)
    x = torch.randn(rows, k, device=dev, dtype=dt)
    g = torch.rand(k, device=dev, dtype=dt) + 0.5
    w = (torch.randn(2 * n, k, device=dev) / k ** 0.5).to(dt)
    r = torch.randn(rows, n, device=dev, dtype=dt)
    yield "gemv", (rows, n, k), lambda: gemv.gemv(x, w[:n]), lambda: gemv.reference.gemv(x, w[:n])
    yield ("gemv(rms_norm, SwiGLU)", (rows, n, k), lambda: gemv.gemv(x, w, norm_weight=g, gated=True),
           lambda: gemv.reference.gemv(x, w, None, g, 1e-6, None, True))
    yield ("gemv(+ residual)", (rows, n, k), lambda: gemv.gemv(x, w[:n], residual=r),
           lambda: gemv.reference.gemv(x, w[:n], None, None, 1e-6, r))
    hq, hk, d, page = (32, 8, 128, 16) if big else (4, 2, 32, 4)
    wqkv = (torch.randn((hq + 2 * hk) * d, k, device=dev) / k ** 0.5).to(dt)
    angles = torch.arange(64.0, device=dev)[:, None] * torch.rand(d // 2, device=dev)[None, :]
    cs = torch.cat((angles.cos(), angles.sin()), -1)
    pos = torch.randint(0, 64, (rows,), device=dev)
    slots = torch.randperm(8 * page, device=dev)[:rows]

    def qkv(ours: bool):
        """q and both caches after one call (ours or the reference) on fresh zeroed caches."""
        kc = torch.zeros(8, page, hk, d, device=dev, dtype=dt)
        vc = torch.zeros_like(kc)
        if ours:
            q = gemv.gemv_qkv(x, wqkv, norm_weight=g, num_heads=hq, cos_sin_cache=cs, positions=pos, k_cache=kc,
                              v_cache=vc, slot_mapping=slots)
        else:
            q = gemv.reference.gemv_qkv(x, wqkv, None, g, 1e-6, cs, pos, kc, vc, slots, hq)
        return torch.cat([q.flatten(), kc.flatten(), vc.flatten()])

    yield ("gemv_qkv(rms_norm, rotary, cache)", (rows, (hq + 2 * hk) * d, k), lambda: qkv(True),
           lambda: qkv(False))


def _attention_cases(big, dev, dt):
    """Prefill (packed ragged batch, GQA, causal / window + softcap), paged decode over shuffled pages (1 and 2
    new tokens, bf16/fp16 and FP8 caches), KV writes and the LSE merge."""
    ref = attention.reference
    hq, hk, d = (32, 8, 128) if big else (4, 2, 64)
    lens = [1, 700, 2049] if big else [1, 17, 40]
    cu = torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens), hq, d, device=dev, dtype=dt)
    k = torch.randn(sum(lens), hk, d, device=dev, dtype=dt)
    v = torch.randn(sum(lens), hk, d, device=dev, dtype=dt)
    for kw in (dict(causal=True), dict(causal=False), dict(causal=True, window=(63, 0), softcap=30.0)):
        mask = "window, softcap" if "window" in kw else "causal" if kw["causal"] else "full"
        name = f"attention_prefill({mask})"
        yield (name, q.shape, lambda kw=kw: attention.attention_prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw),
               lambda kw=kw: ref.attention_varlen(q, k, v, cu, cu, **kw)[0])
    page = 16
    ctx = [1, 5000, 333, 4096] if big else [1, 37, 20, 3]
    width = max(-(-n // page) for n in ctx)
    tables = torch.randperm(len(ctx) * width, device=dev).to(torch.int32).view(len(ctx), width)  # shuffled pages
    kc = torch.randn(len(ctx) * width, page, hk, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    seq_lens = torch.tensor(ctx, device=dev, dtype=torch.int32)
    ks, vs = kc.float().abs().amax((0, 1, 3)) / 448, vc.float().abs().amax((0, 1, 3)) / 448
    k8, v8 = ref.quantize_fp8(kc, ks), ref.quantize_fp8(vc, vs)
    for n_new in (1, 2):
        qd = torch.randn(len(ctx), n_new, hq, d, device=dev, dtype=dt)
        yield (f"attention_decode(q {n_new})", qd.shape,
               lambda qd=qd: attention.attention_decode(qd, kc, vc, tables, seq_lens),
               lambda qd=qd: ref.attention_decode(qd, kc, vc, tables, seq_lens)[0])
    yield ("attention_decode(fp8 cache)", qd.shape,
           lambda: attention.attention_decode(qd, k8, v8, tables, seq_lens, k_scale=ks, v_scale=vs),
           lambda: ref.attention_decode(qd, k8, v8, tables, seq_lens, k_scale=ks, v_scale=vs)[0])
    slots = torch.randperm(kc.shape[0] * page, device=dev)[: k.shape[0]]

    def write(fn):
        kc2, vc2 = kc.clone(), vc.clone()
        fn(k, v, kc2, vc2, slots)
        return torch.cat([kc2.flatten(), vc2.flatten()])

    yield "write_kv_cache", k.shape, lambda: write(attention.write_kv_cache), lambda: write(ref.write_kv_cache)
    o_a, o_b = torch.randn(2, sum(lens), hq, d, device=dev, dtype=dt)
    l_a, l_b = torch.randn(2, sum(lens), hq, device=dev) * 3
    yield ("merge_attention_states", o_a.shape, lambda: attention.merge_attention_states(o_a, l_a, o_b, l_b)[0],
           lambda: ref.merge_states(o_a, l_a, o_b, l_b)[0])


def _once(fn):
    """fn, called on first use only: two checked parts of one call (an output and the states it updates) share it."""
    memo = {}

    def get():
        if "value" not in memo:
            memo["value"] = fn()
        return memo["value"]
    return get


def _kda_cases(big, dev, dt):
    """Prefill with the gate, L2 norm and β sigmoid fused, initial and final states: a ragged batch with a
    length-1 sequence (16-token chunks on the GPU) and, on the GPU, a batch of shorter sequences (16-token chunks
    with Qg, Kg stored from the A steps), one long sequence over 32 and over 8 heads (16- and 32-token chunks,
    state recurrence beside the chunk work on a second stream); recurrent decode of one token per sequence
    against a shuffled state pool (the output and the updated states compared)."""
    ref = kda.reference
    K = 128 if big else 64
    shapes = (([1, 700, 2049], 32), ([1000, 1024, 1, 1024, 1023], 32), ([8192], 32), ([8192], 8)) if big else (
        ([1, 17, 40], 2),)
    for lens, h in shapes:
        cu = torch.tensor([0, *lens]).cumsum(0)
        q, k, v = (torch.randn(1, sum(lens), h, K, device=dev, dtype=dt) for _ in range(3))
        f = (torch.randn(1, sum(lens), h, K, device=dev) * 2 - 3).to(dt)
        beta = torch.randn(1, sum(lens), h, device=dev, dtype=dt)
        h0 = torch.randn(len(lens), h, K, K, device=dev) * 0.05
        opts = dict(A_log=torch.log(torch.empty(h, device=dev).uniform_(1, 4)),
                    dt_bias=torch.randn(h * K, device=dev) * 0.5, lower_bound=-5.0, l2norm_qk=True, beta_sigmoid=True)

        ours = _once(lambda q=q, k=k, v=v, f=f, beta=beta, h0=h0, cu=cu, opts=opts: kda.kda_prefill(
            q, k, v, f, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu.to(dev), cu_seqlens_cpu=cu,
            **opts))
        want = _once(lambda q=q, k=k, v=v, f=f, beta=beta, h0=h0, cu=cu, opts=opts: ref.kda(
            *(x.double() for x in (q, k, v, f, beta)), initial_state=h0.double(), cu_seqlens=cu, chunk=64, **opts))
        for i, part in enumerate(("o", "state")):
            yield (f"kda_prefill(N={len(lens)}, H={h}) {part}", q.shape, lambda i=i, ours=ours: ours()[i],
                   lambda i=i, want=want: want()[i])
    n = 64 if big else 3
    h = 32 if big else 2
    q, k, v = (torch.randn(n, h, K, device=dev, dtype=dt) for _ in range(3))
    f = (torch.randn(n, h, K, device=dev) * 2 - 3).to(dt)
    beta = torch.randn(n, h, device=dev, dtype=dt)
    pool = torch.randn(n + 3, h, K, K, device=dev) * 0.05
    idx = torch.randperm(n + 3, device=dev)[:n].to(torch.int32)
    opts = dict(A_log=torch.log(torch.empty(h, device=dev).uniform_(1, 4)),
                dt_bias=torch.randn(h * K, device=dev) * 0.5, lower_bound=-5.0, l2norm_qk=True, beta_sigmoid=True)

    def decode(reference):
        p = pool.double() if reference else pool.clone()
        if reference:  # [N, Q = 1, H, ·] in float64
            o = ref.kda_decode(*(x.double()[:, None] for x in (q, k, v, f, beta)), p, idx.cpu(), **opts)[:, 0]
        else:
            o = kda.kda_decode(q, k, v, f, beta, p, idx, **opts)
        return o, p[idx.long()]

    ours, want = _once(lambda: decode(False)), _once(lambda: decode(True))
    for i, part in enumerate(("o", "states")):
        yield f"kda_decode(state pool) {part}", q.shape, lambda i=i: ours()[i], lambda i=i: want()[i]


def _ragged_latent(lens, page, dev, dt):
    """A latent cache of random rows for sequences of these lengths on shuffled pages, NaN past each end: (cache,
    block tables, seq_lens)."""
    width = max(-(-n // page) for n in lens)
    tables = torch.randperm(len(lens) * width, device=dev).to(torch.int32).view(len(lens), width)
    cache = torch.full((len(lens) * width, page, 576), float("nan"), device=dev, dtype=dt)
    for b, n in enumerate(lens):
        rows = cache[tables[b].long()].view(-1, 576)
        rows[:n] = torch.randn(n, 576, device=dev, dtype=dt)
        cache[tables[b].long()] = rows.view(width, page, 576)
    return cache, tables, torch.tensor(lens, device=dev, dtype=torch.int32)


def _mla_cases(big, dev, dt):
    """The fused latent-cache write (RMSNorm, interleaved RoPE, store at shuffled slots), the absorbed decode
    over shuffled pages of ragged lengths (1 and 2 new tokens; 16 and, on the GPU, 128 heads: the warp-specialised
    kernel on Hopper), both again over an FP8 cache, and the prefill (q/k 192, v 128) over the same pages: new
    tokens after cached prefixes of several chunks, with its own plan and with a plan shared by two calls."""
    ref = mla.reference
    page = 64 if big else 16
    ctx = [1, 1000, 4097, 333] if big else [1, 37, 20]
    width = max(-(-c // page) for c in ctx)
    tables = torch.randperm(len(ctx) * width, device=dev).to(torch.int32).view(len(ctx), width)
    seq_lens = torch.tensor(ctx, device=dev, dtype=torch.int32)
    n_tok = sum(ctx)
    kv = torch.randn(n_tok, 576, device=dev, dtype=dt)
    w = torch.rand(512, device=dev, dtype=dt) + 0.5
    cs = rope.build_cos_sin_cache(64, 8192, 10000.0, None).to(dev)
    pos = torch.cat([torch.arange(c, device=dev) for c in ctx])
    slots = torch.cat([tables[b, torch.arange(c, device=dev) // page].long() * page + torch.arange(c, device=dev) % page
                       for b, c in enumerate(ctx)])
    cache = torch.zeros(len(ctx) * width, page, 576, device=dev, dtype=dt)
    mla.write_latent_cache(kv, w, cs, pos, slots, cache)

    def write(fn):
        c = torch.full_like(cache, float("nan"))
        fn(kv, w, cs, pos, slots, c)
        return c.view(-1, 576)[slots]

    yield "write_latent_cache", kv.shape, lambda: write(mla.write_latent_cache), lambda: write(ref.write_latent_cache)
    for heads, n_new in ((16, 1), (16, 2)) + (((128, 1), (128, 2)) if big else ()):  # 128 heads: Gluon on Hopper
        qn = torch.randn(len(ctx), n_new, heads, 512, device=dev, dtype=dt)
        qp = torch.randn(len(ctx), n_new, heads, 64, device=dev, dtype=dt)
        yield (f"mla_decode({heads} heads, q {n_new})", qn.shape,
               lambda qn=qn, qp=qp: mla.mla_decode(qn, qp, cache, tables, seq_lens, scale=0.07)[0],
               lambda qn=qn, qp=qp: ref.mla_decode(qn, qp, cache, tables, seq_lens, 0.07)[0])
        if n_new == 1 and heads == 128:  # 48 rows of contiguous q: the 64-row Gluon kernel's q box reaches past them
            qf, qpf = (torch.randn(len(ctx), 1, 48, d, device=dev, dtype=dt) for d in (512, 64))
            yield ("mla_decode(48 heads)", qf.shape,
                   lambda qf=qf, qpf=qpf: mla.mla_decode(qf, qpf, cache, tables, seq_lens, scale=0.07)[0],
                   lambda qf=qf, qpf=qpf: ref.mla_decode(qf, qpf, cache, tables, seq_lens, 0.07)[0])
        if n_new == 1 and heads == 16:  # chunks of ≥ 4 tiles: the few-rows Gluon kernel on a fast-DRAM Hopper
            for h, splits in ((16, 4), (8, 1)):
                qf, qpf = qn[:, :, :h], qp[:, :, :h]
                yield (f"mla_decode({h} heads, {splits} splits)", qf.shape,
                       lambda qf=qf, qpf=qpf, s=splits: mla.mla_decode(qf, qpf, cache, tables, seq_lens, scale=0.07,
                                                                       num_splits=s)[0],
                       lambda qf=qf, qpf=qpf: ref.mla_decode(qf, qpf, cache, tables, seq_lens, 0.07)[0])
        if n_new == 2 and heads == 16:  # 24 and 32 rows: the transposed seesaw on a fast-DRAM Hopper, its own plan
            # or a caller's chunks
            for h, splits in ((12, None), (16, 4)):
                qf, qpf = qn[:, :, :h], qp[:, :, :h]
                yield (f"mla_decode({h} heads, q 2, {splits or 'planned'} splits)", qf.shape,
                       lambda qf=qf, qpf=qpf, s=splits: mla.mla_decode(qf, qpf, cache, tables, seq_lens, scale=0.07,
                                                                       num_splits=s)[0],
                       lambda qf=qf, qpf=qpf: ref.mla_decode(qf, qpf, cache, tables, seq_lens, 0.07)[0])
        if n_new == 1 and heads == 16 and big:  # a skewed batch: ranges across sequence ends (few rows, the seesaw)
            lens = [8192] + [300 + 7 * i for i in range(60)]
            sk_cache, sk_tables, sk_lens = _ragged_latent(lens, page, dev, dt)
            for h, q in ((16, 1), (8, 2), (16, 2), (32, 1)):  # 16 rows (one head each, or two new tokens), 32 rows
                qs, qps = (torch.randn(len(lens), q, h, d, device=dev, dtype=dt) for d in (512, 64))
                yield (f"mla_decode({h} heads{', q 2' if q == 2 else ''}, 1 x 8k + 60 short)", qs.shape,
                       lambda qs=qs, qps=qps: mla.mla_decode(qs, qps, sk_cache, sk_tables, sk_lens, scale=0.07)[0],
                       lambda qs=qs, qps=qps: ref.mla_decode(qs, qps, sk_cache, sk_tables, sk_lens, 0.07)[0])
        if n_new == 1 and heads == 16 and big:  # contexts ≤ 1k in a batch that fills the GPU: the few-rows kernel
            # merges the pieces its ranges cut in the kernel (two calls: its counters must be zero again after one)
            lens = [1024] + [40 + 9 * i for i in range(110)]
            sk_cache, sk_tables, sk_lens = _ragged_latent(lens, page, dev, dt)
            qs, qps = (torch.randn(len(lens), 1, 16, d, device=dev, dtype=dt) for d in (512, 64))
            for call in (1, 2):
                yield (f"mla_decode(16 heads, 1k + 110 short, call {call})", qs.shape,
                       lambda qs=qs, qps=qps: mla.mla_decode(qs, qps, sk_cache, sk_tables, sk_lens, scale=0.07,
                                                             max_seqlen_k=1024)[0],
                       lambda qs=qs, qps=qps: ref.mla_decode(qs, qps, sk_cache, sk_tables, sk_lens, 0.07)[0])
        if n_new == 1:  # the step's schedule made once, as a model's layers share it
            step = mla.mla_decode_schedule(cache, tables, seq_lens, num_heads=heads)
            yield (f"mla_decode({heads} heads, shared schedule)", qn.shape,
                   lambda qn=qn, qp=qp, step=step: mla.mla_decode(qn, qp, cache, tables, seq_lens, scale=0.07,
                                                                 schedule=step)[0],
                   lambda qn=qn, qp=qp: ref.mla_decode(qn, qp, cache, tables, seq_lens, 0.07)[0])
    # FP8 e4m3 cache (a scale per 128 values): the fused write (compared dequantised) and the decode over it
    c8, s8 = mla.new_latent_cache(cache.shape[0], page, dtype=torch.float8_e4m3fn, device=dev)

    def write8(fn):
        c, s = torch.zeros_like(c8), torch.full_like(s8, float("nan"))
        fn(kv, w, cs, pos, slots, c, cache_scales=s)
        return ref.dequantize_rows(c.view(-1, 576)[slots], s.view(-1, s.shape[-1])[slots])

    yield ("write_latent_cache(fp8)", kv.shape, lambda: write8(mla.write_latent_cache),
           lambda: write8(ref.write_latent_cache))
    mla.write_latent_cache(kv, w, cs, pos, slots, c8, cache_scales=s8)
    for heads, n_new in ((16, 1), (16, 2), (128, 1)) if big else ((16, 1),):  # Gluon on Hopper (kernels_fp8)
        qn = torch.randn(len(ctx), n_new, heads, 512, device=dev, dtype=dt)
        qp = torch.randn(len(ctx), n_new, heads, 64, device=dev, dtype=dt)
        yield (f"mla_decode({heads} heads{', q 2' if n_new == 2 else ''}, fp8 cache)", qn.shape,
               lambda qn=qn, qp=qp: mla.mla_decode(qn, qp, c8, tables, seq_lens, scale=0.07, cache_scales=s8)[0],
               lambda qn=qn, qp=qp: ref.mla_decode(qn, qp, c8, tables, seq_lens, 0.07, s8)[0])
    heads, chunk = (16, 1024) if big else (4, 8)
    q_lens = [1, 200, 1500, 333] if big else [1, 10, 20]
    cu = torch.tensor([0, *q_lens], device=dev).cumsum(0).to(torch.int32)
    qn = torch.randn(sum(q_lens), heads, 128, device=dev, dtype=dt) / 128 ** 0.25
    qp = torch.randn(sum(q_lens), heads, 64, device=dev, dtype=dt) / 8
    w_kv_b = torch.randn(heads * 256, 512, device=dev, dtype=dt) / 512 ** 0.5
    args = (qn, qp, cache, tables, cu, seq_lens, w_kv_b)

    def prefill_ref():
        rows = ref.gather_latents(cache, tables, seq_lens)
        return torch.cat([ref.mla_attention(qn[a:e], qp[a:e], rows[b], w_kv_b, ctx[b] - (e - a), 0.07, 128, 128)[0]
                          for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))])

    plan = mla.mla_prefill_plan(cache, tables, cu, seq_lens, chunk_size=chunk)
    yield (f"mla_prefill({heads} heads)", qn.shape, lambda: mla.mla_prefill(*args, scale=0.07, chunk_size=chunk),
           prefill_ref)
    yield (f"mla_prefill({heads} heads, shared plan)", qn.shape,
           lambda: torch.cat([mla.mla_prefill(*args, scale=0.07, chunk_size=chunk, plan=plan) for _ in range(2)]),
           lambda: prefill_ref().repeat(2, 1, 1))


def cases(device):
    """(op, shape, dtype, run ours, run reference) for every registered op."""
    big = device.type == "cuda"
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for gen, rows in ((_norm_cases, (4093, 1) if big else (5, 1)),
                          (_activation_cases, (8191, 1) if big else (3, 1)),
                          (_rope_cases, (8191, 1) if big else (7, 1)),
                          (_gemv_cases, (1, 3))):
            for r in rows:
                for name, shape, ours, ref in gen(r, device, dt):
                    yield name, tuple(shape), dt, ours, ref
    # attention: half precision only; on the CPU fp16 alone (the interpreter computes bf16 dots wrong)
    for dt in ((torch.bfloat16, torch.float16) if big else (torch.float16,)):
        for gen in (_attention_cases, _mla_cases):
            for name, shape, ours, ref in gen(big, device, dt):
                yield name, tuple(shape), dt, ours, ref
    # KDA: bf16 on the GPU (its fp32 path takes tf32 dots), fp32 through the interpreter
    for name, shape, ours, ref in _kda_cases(big, device, torch.bfloat16 if big else torch.float32):
        yield name, tuple(shape), torch.bfloat16 if big else torch.float32, ours, ref


def run(device=None) -> int:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    print(f"lmkernels check on {where}")
    torch.manual_seed(int(time.time()))  # fresh inputs on every run
    header = f"{'op':<34} {'shape':<18} {'dtype':<9} {'rel err':>9} {'limit':>7}  result"
    print(header + "\n" + "-" * len(header))
    failures = 0
    for name, shape, dt, ours, ref in cases(device):
        try:
            err = rel_err(ours(), ref())
            ok = err < TOL[dt]
            err_txt = f"{err:9.2e}"
        except Exception as e:  # report and keep going: one broken op must not hide the others
            ok, err_txt = False, f"{type(e).__name__}: {e}"[:60]
        failures += not ok
        dtype = str(dt).removeprefix("torch.")
        print(f"{name:<34} {str(shape):<18} {dtype:<9} {err_txt:>9} {TOL[dt]:7.0e}  {'pass' if ok else 'FAIL'}")
    print(f"{failures} failure(s)" if failures else "all passed")
    return 1 if failures else 0
