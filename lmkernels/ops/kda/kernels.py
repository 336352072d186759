"""KDA Triton kernels: chunked prefill (two kernels) and the recurrent decode.

Prefill, chunks of BT = 16 or 32 tokens (64 as an option; prefill_config chooses) that never cross a sequence
boundary:
1. `_kda_intra` (one program per chunk and head, all chunks in parallel): fused gate and β sigmoid;
   Γ = within-chunk cumulative decay; A (β-scaled k·k with decays, strictly lower) and Aqk (q·k with decays,
   lower with the diagonal); T = (I + A)⁻¹ by Neumann doubling (A is nilpotent: (I − A)(I + A²)…(I + A^(BT/2)));
   Tb = T diag(β), W = Tb (K ⊙ e^Γ) (dots in the input dtype), Qg = scale·Q ⊙ e^Γ, Kg = K ⊙ e^(Γ_C − Γ),
   e^Γ_C (ONEPASS, 16-token chunks: the row norms first, Qg, Kg and K ⊙ e^Γ stored from the A steps, W formed in
   place; otherwise a second pass over q, k, g recomputes the gate and Γ). exp(Γ_i − Γ_j) is never split around
   a point outside a safe range: with the fused safe gate (lower_bound ≥ −8) each 16-row block uses the Γ of
   its middle row as reference (factors ≤ e^{8|lb|}) and one dot per block of BK key channels covers all BT/16
   blocks (block-diagonal right operand; at BT = 16 one block, plain 2D factors); the L2 norms of q and k are
   applied to A and Aqk afterwards as row and column scales, so q, k and g are read once for A. Other gates use
   one exponent per (i, j, d) (slower). Exponentials are ex2.approx.ftz (`_exp`).
2. `_kda_state` (one program per piece of a sequence, head and block of V columns, sequential over the
   piece's chunks; the V blocks of one piece and head are launched next to each other, so W, Qg, Kg are read
   from DRAM once; a piece: a sequence's chunks inside one segment, each segment taking the same fraction of
   every sequence; states carried from piece to piece):
   U = Tb V (off the chain; storing U from the intra kernel instead cost 2 × T·H·V values of traffic, −3 to
   −6%), Ũ = U − W S, O = Qg S + Aqk Ũ, S ← Diag(e^Γ_C) S + Kgᵀ Ũ; the state S stays in fp32 registers, read
   from and written to a state pool.
   On Hopper, 16-token chunks with BV ≥ 64 run the same step from state_gluon.py (Gluon: no shared-memory
   round trips in the chain; bit-equal outputs), and 16-token chunks of bf16 inputs with the safe gate run the
   intra kernel from intra_gluon.py (Gluon: one warp per chunk and head, Γ scanned in-thread).
Decode: `_kda_decode`, one program per sequence, head and V block; the state is updated in place.
"""

import bisect
import contextlib

import torch
import triton
import triton.language as tl

from ..._utils import interpreting, sm_count

# 16-token chunks where tokens × heads ≥ CHAIN_RATIO × the longest sequence, the state kernels beside the intra
# kernel up to OVERLAP_RATIO × (prefill_config)
CHAIN_RATIO, OVERLAP_RATIO = 20, 100
BS = 16  # sub-chunk
# The block-reference A dots: exp(Γ_i − M_b) leaves fp32's normal range below e^-87.3 (denormals keep few bits
# and may be flushed on the way through the tf32 dot) while its partner factor reaches e^{8|lb|}, so a pair
# lost or blurred that way is below e^{-87.3 + 8|lb|} (e^-47 at −5, 1e-10 at −8, 7e-4 at −10). Below this
# bound the exact per-element path runs.
SAFE_MIN_LOWER_BOUND = -8.0


@triton.jit
def _exp(x, FAST: tl.constexpr):
    """e^x. FAST (compiled kernels; the interpreter has no inline PTX): ex2.approx.ftz, which skips the denormal
    fix-up ptxas wraps around a plain ex2.approx.f32 (two compares, selects and multiplies per exponential, 13%
    of the intra kernel's instructions). Results below 2^-126 flush to 0, which the block-reference bound
    (SAFE_MIN_LOWER_BOUND) already counts as lost."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.exp(x)


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def _gate(x, a, lower_bound, GATE: tl.constexpr, FAST: tl.constexpr = False):
    if GATE == 1:
        x = -a * _softplus(x)
    elif GATE == 2:
        x = lower_bound / (1.0 + _exp(-a * x, FAST))
    return x


@triton.jit
def _load_raw(q, k, g, tok, hh, c0, ok, s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, BK: tl.constexpr):
    """Columns c0 … c0 + BK of the chunk's q, k and g as stored (rows where ok is false read 0)."""
    dk = c0 + tl.arange(0, BK)
    bq = tl.load(q + tok[:, None] * s_qt + hh * s_qh + dk[None, :], mask=ok[:, None], other=0.0)
    bk = tl.load(k + tok[:, None] * s_kt + hh * s_kh + dk[None, :], mask=ok[:, None], other=0.0)
    bg = tl.load(g + tok[:, None] * s_gt + hh * s_gh + dk[None, :], mask=ok[:, None], other=0.0)
    return bq, bk, bg


@triton.jit
def _gated(bq, bk, bg, hh, c0, rm, a, dt_bias, lower_bound, K: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
           HAS_BIAS: tl.constexpr, FAST: tl.constexpr):
    """q and k (not normalised) in fp32 and the log decay g gated (0 on padded rows)."""
    bg = bg.to(tl.float32)
    if GATE > 0:
        if HAS_BIAS:
            bg = bg + tl.load(dt_bias + hh * K + c0 + tl.arange(0, BK)).to(tl.float32)[None, :]
        bg = _gate(bg, a, lower_bound, GATE, FAST)
    bg = tl.where(rm[:, None], bg, 0.0)
    return bq.to(tl.float32), bk.to(tl.float32), bg


@triton.jit
def _load_cols(q, k, g, tok, hh, c0, rm, a, dt_bias, lower_bound, s_qt, s_qh, s_kt, s_kh, s_gt, s_gh,
               K: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr):
    """Columns c0 … c0 + BK of the chunk's q, k (not normalised) and log decay g (gated, 0 on padded rows)."""
    bq, bk, bg = _load_raw(q, k, g, tok, hh, c0, rm, s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, BK)
    return _gated(bq, bk, bg, hh, c0, rm, a, dt_bias, lower_bound, K, BK, GATE, HAS_BIAS, FAST)


@triton.jit
def _sums_of_squares(q, k, tok, hh, rm, s_qt, s_qh, s_kt, s_kh, K: tl.constexpr, BK: tl.constexpr):
    """Per row, Σ q² and Σ k² over the key channels (a pass of its own, BK channels at a time)."""
    sq = tl.zeros(tok.shape, tl.float32)
    sk = tl.zeros(tok.shape, tl.float32)
    for c0 in tl.static_range(0, K, BK):
        dk = c0 + tl.arange(0, BK)
        x = tl.load(q + tok[:, None] * s_qt + hh * s_qh + dk[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        y = tl.load(k + tok[:, None] * s_kt + hh * s_kh + dk[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        sq += tl.sum(x * x, 1)
        sk += tl.sum(y * y, 1)
    return sq, sk


@triton.jit
def _inv_norm(sum_sq, L2: tl.constexpr):
    """Row scales of the L2 norm, 1 / sqrt(|x|² + 1e-6) (ones without L2)."""
    if L2:
        return 1.0 / tl.sqrt(sum_sq + 1e-6)
    return tl.full(sum_sq.shape, 1.0, tl.float32)


@triton.jit
def _kda_intra(
    q, k, g, beta, A_log, dt_bias, w, tb, qg, kg, aqk, gl, chunks,
    s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
    GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BETA_SIG: tl.constexpr, SAFE: tl.constexpr,
    L2: tl.constexpr, PREC: tl.constexpr, NSQ: tl.constexpr, BKW: tl.constexpr, FAST: tl.constexpr,
    A16: tl.constexpr = False, I64: tl.constexpr = True, ONEPASS: tl.constexpr = False,
):
    ic = tl.program_id(0)
    hh = tl.program_id(1)
    start = tl.load(chunks + 2 * ic)
    if I64:
        start = start.to(tl.int64)
    n = tl.load(chunks + 2 * ic + 1)
    r = tl.arange(0, BT)
    rm = r < n
    tok = start + r
    bb = tl.load(beta + tok * s_bt + hh * s_bh, mask=rm, other=0.0).to(tl.float32)
    if BETA_SIG:
        bb = tl.sigmoid(bb)
    bb = tl.where(rm, bb, 0.0)
    a = 1.0
    if GATE > 0:
        a = tl.exp(tl.load(A_log + hh).to(tl.float32))
    sq = tl.zeros([BT], tl.float32)
    sk = tl.zeros([BT], tl.float32)
    causal = r[:, None] > r[None, :]
    causal_d = r[:, None] >= r[None, :]
    if SAFE:
        # Row block b (BS rows) takes the Γ of its middle row, M_b, as reference: the pair (i, j), j in block b,
        # gets exp(Γ_i − M_b)·exp(M_b − Γ_j); rows before block b are 0. Both factors are ≤ 1 outside the
        # diagonal block and ≤ exp(BS/2·|lower_bound|) in it, so a row factor lost to underflow hides at most
        # e^{-87.3 + 8|lb|} (SAFE_MIN_LOWER_BOUND; 32-row blocks, or exp(Γ_i − M_b) split through i's own block's
        # reference, lose pairs of order one: benchmarks/NOTES.md, issue 5). One dot per BK block of key
        # channels covers all NB = BT/BS blocks: [BT, NB·BK] (rows × (block, channel)) × [NB·BK, BT] (block
        # diagonal in the columns).
        # q and k are normalised afterwards (row and column scales), so q, k and g are read once here, one step
        # ahead: their load latency hides behind the step before (−7% on H100, benchmarks/NOTES.md).
        NB: tl.constexpr = BT // BS
        nb = tl.arange(0, NB)
        js = tl.arange(0, BS)
        A = tl.zeros([BT, BT], tl.float32)
        Aq = tl.zeros([BT, BT], tl.float32)
        if ONEPASS:  # the row norms first, so that the A steps can store Qg, Kg and K ⊙ e^Γ
            if L2:
                sq, sk = _sums_of_squares(q, k, tok, hh, rm, s_qt, s_qh, s_kt, s_kh, K, BKW)
            rq = _inv_norm(sq, L2)
            rk = _inv_norm(sk, L2)
        nq, nk, ng = _load_raw(q, k, g, tok, hh, 0, rm, s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, BK)
        for c0 in tl.range(0, K, BK):
            bq, bk, bg = _gated(nq, nk, ng, hh, c0, rm, a, dt_bias, lower_bound, K, BK, GATE, HAS_BIAS, FAST)
            nq, nk, ng = _load_raw(q, k, g, tok, hh, c0 + BK, rm & (c0 + BK < K), s_qt, s_qh, s_kt, s_kh, s_gt, s_gh,
                                   BK)
            if L2 and not ONEPASS:
                sq += tl.sum(bq * bq, 1)
                sk += tl.sum(bk * bk, 1)
            G = tl.cumsum(bg, 0)
            if NB == 1:  # 16-token chunks: one block, so plain 2D factors (no block-diagonal operand)
                M1 = tl.sum(tl.where(r[:, None] == BS // 2 - 1, G, 0.0), 0)
                em = _exp(M1[None, :] - G, FAST)
                k_col = bk * em
                e_row = _exp(G - M1[None, :], FAST)
                if ONEPASS:  # e^Γ = e^(Γ−M)·e^M, e^(Γ_C−Γ) = e^(M−Γ)·e^(Γ_C−M): each factor within fp32
                    Gl = tl.sum(tl.where(r[:, None] == BT - 1, G, 0.0), 0)  # Γ_C (padded rows have g = 0)
                    eG = e_row * _exp(M1, FAST)[None, :]
                    dk = c0 + tl.arange(0, BK)
                    ot = tok[:, None] * (H * K) + hh * K + dk[None, :]
                    dt = w.dtype.element_ty
                    tl.store(qg + ot, (bq * eG * (rq * scale)[:, None]).to(dt), mask=rm[:, None])
                    tl.store(kg + ot, (k_col * _exp(Gl - M1, FAST)[None, :] * rk[:, None]).to(dt), mask=rm[:, None])
                    tl.store(w + ot, (bk * eG * rk[:, None]).to(dt), mask=rm[:, None])  # K ⊙ e^Γ, W in place later
                    tl.store(gl + (ic * H + hh) * K + dk, _exp(Gl, FAST))
                if A16:  # bf16 operands (the factors reach e^{8|lb|}: beyond fp16)
                    kc16 = tl.trans(k_col.to(tl.bfloat16))
                    A = tl.dot((bk * e_row).to(tl.bfloat16), kc16, A)
                    Aq = tl.dot((bq * e_row).to(tl.bfloat16), kc16, Aq)
                else:
                    A = tl.dot(bk * e_row, tl.trans(k_col), A, input_precision=PREC)
                    Aq = tl.dot(bq * e_row, tl.trans(k_col), Aq, input_precision=PREC)
            else:
                M = tl.sum(tl.where(js[None, :, None] == BS // 2 - 1, tl.reshape(G, [NB, BS, BK]), 0.0), 1)  # [NB, BK]
                after = r[:, None, None] >= (nb * BS)[None, :, None]  # [BT, NB, 1]
                er = _exp(tl.where(after, G[:, None, :] - M[None, :, :], float("-inf")), FAST)  # [BT, NB, BK]
                inblk = (r // BS)[None, :, None] == nb[:, None, None]  # [NB, BT, 1]
                Mown = tl.reshape(tl.broadcast_to(M[:, None, :], [NB, BS, BK]), [BT, BK])  # each row's own reference
                ec = tl.where(inblk, (bk * _exp(Mown - G, FAST))[None, :, :], 0.0)
                ct = tl.reshape(tl.permute(ec, (0, 2, 1)), [NB * BK, BT])
                A = tl.dot(tl.reshape(bk[:, None, :] * er, [BT, NB * BK]), ct, A, input_precision=PREC)
                Aq = tl.dot(tl.reshape(bq[:, None, :] * er, [BT, NB * BK]), ct, Aq, input_precision=PREC)
        rq = _inv_norm(sq, L2)
        rk = _inv_norm(sk, L2)
        A = tl.where(causal, A, 0.0) * (rk * bb)[:, None] * rk[None, :]
        Aq = tl.where(causal_d, Aq, 0.0) * (rq * scale)[:, None] * rk[None, :]
    else:
        if L2:  # row norms first (a pass over the key channels)
            sq, sk = _sums_of_squares(q, k, tok, hh, rm, s_qt, s_qh, s_kt, s_kh, K, BK)
        rq = _inv_norm(sq, L2)
        rk = _inv_norm(sk, L2)
        A = tl.zeros([BT, BT], tl.float32)
        Aq = tl.zeros([BT, BT], tl.float32)
        # one exponent per (i, j, d): walk the key channels, recomputing each gate column from memory
        for d in range(K):
            kc = tl.load(k + tok * s_kt + hh * s_kh + d, mask=rm, other=0.0).to(tl.float32) * rk
            qc = tl.load(q + tok * s_qt + hh * s_qh + d, mask=rm, other=0.0).to(tl.float32) * (rq * scale)
            gc = tl.load(g + tok * s_gt + hh * s_gh + d, mask=rm, other=0.0).to(tl.float32)
            if GATE > 0:
                bd = 0.0
                if HAS_BIAS:
                    bd = tl.load(dt_bias + hh * K + d).to(tl.float32)
                gc = _gate(gc + bd, a, lower_bound, GATE)
            gc = tl.where(rm, gc, 0.0)
            Gc = tl.cumsum(gc, 0)
            E = tl.exp(tl.where(causal_d, Gc[:, None] - Gc[None, :], float("-inf")))
            A += tl.where(causal, kc[:, None] * kc[None, :] * E, 0.0)
            Aq += qc[:, None] * kc[None, :] * E
        A = A * bb[:, None]
    tl.store(aqk + tok[:, None] * (H * BT) + hh * BT + r[None, :], Aq.to(aqk.dtype.element_ty), mask=rm[:, None])

    # T = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A is strictly lower triangular (A^BT = 0)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    Tm = eye - A
    Pw = A
    for _ in tl.static_range(NSQ):
        Pw = tl.dot(Pw, Pw, input_precision=PREC)
        Tm = tl.dot(Tm, eye + Pw, input_precision=PREC)

    # Tb = T diag(β) (the state kernel forms U = Tb V), W = Tb (K ⊙ e^Γ): operands in the input dtype (tensor
    # cores for 16-bit inputs)
    dt = w.dtype.element_ty
    Tb = (Tm * bb[None, :]).to(dt)
    if ONEPASS:
        tl.debug_barrier()  # K ⊙ e^Γ, stored by every thread of the program
        for c0 in tl.static_range(0, K, BKW):
            ot = tok[:, None] * (H * K) + hh * K + (c0 + tl.arange(0, BKW))[None, :]
            ke = tl.load(w + ot, mask=rm[:, None], other=0.0)
            tl.store(w + ot, tl.dot(Tb, ke, input_precision=PREC).to(dt), mask=rm[:, None])
    else:
        for c0 in tl.static_range(0, K, BKW):
            bq, bk, bg = _load_cols(q, k, g, tok, hh, c0, rm, a, dt_bias, lower_bound, s_qt, s_qh, s_kt, s_kh, s_gt,
                                    s_gh, K, BKW, GATE, HAS_BIAS, FAST)
            bq = bq * rq[:, None]
            bk = bk * rk[:, None]
            G = tl.cumsum(bg, 0)
            Glast = tl.sum(bg, 0)  # Γ at the chunk's last token (padded rows have g = 0)
            eG = _exp(G, FAST)
            dk = c0 + tl.arange(0, BKW)
            ot = tok[:, None] * (H * K) + hh * K + dk[None, :]
            tl.store(w + ot, tl.dot(Tb, (bk * eG).to(dt), input_precision=PREC).to(dt), mask=rm[:, None])
            tl.store(qg + ot, (bq * eG * scale).to(dt), mask=rm[:, None])
            tl.store(kg + ot, (bk * _exp(Glast[None, :] - G, FAST)).to(dt), mask=rm[:, None])
            tl.store(gl + (ic * H + hh) * K + dk, _exp(Glast, FAST))
    tl.store(tb + tok[:, None] * (H * BT) + hh * BT + r[None, :], Tb, mask=rm[:, None])


@triton.jit
def _state_chunk(S, c, c0, bos, eos, w, tb, v, s_vt, s_vh, qg, kg, aqk, gl, o, s_ot, s_oh, hh, r, dk, dv,
                 H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    dt = w.dtype.element_ty
    tok = bos + c * BT + r
    rm = tok < eos
    ok = tok[:, None] * (H * K) + hh * K + dk[None, :]
    bw = tl.load(w + ok, mask=rm[:, None], other=0.0)
    bqg = tl.load(qg + ok, mask=rm[:, None], other=0.0)
    bkg = tl.load(kg + ok, mask=rm[:, None], other=0.0)
    btb = tl.load(tb + tok[:, None] * (H * BT) + hh * BT + r[None, :], mask=rm[:, None], other=0.0)
    bv = tl.load(v + tok[:, None] * s_vt + hh * s_vh + dv[None, :], mask=rm[:, None], other=0.0)
    ba = tl.load(aqk + tok[:, None] * (H * BT) + hh * BT + r[None, :], mask=rm[:, None], other=0.0)
    bgl = tl.load(gl + ((c0 + c) * H + hh) * K + dk)
    Sb = S.to(dt)
    un = tl.dot(btb, bv.to(dt)) - tl.dot(bw, Sb)
    unb = un.to(dt)
    ob = tl.dot(bqg, Sb) + tl.dot(ba, unb)
    tl.store(o + tok[:, None] * s_ot + hh * s_oh + dv[None, :], ob.to(o.dtype.element_ty), mask=rm[:, None])
    return S * bgl[:, None] + tl.dot(tl.trans(bkg), unb)


@triton.jit
def _kda_state(
    w, tb, v, qg, kg, aqk, gl, o, pieces, h0, h0_idx, ht, ht_idx, carry,
    s_vt, s_vh, s_ot, s_oh, s_h0, s_ht,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, INTERPRET: tl.constexpr, STAGES: tl.constexpr,
    I64: tl.constexpr = True,
):
    """One piece of a sequence (its chunks inside one segment; a row of `pieces`: first token, end token, first
    chunk, sequence, carry slot in, carry slot out), one head, one block of V columns. The state comes from the
    carry slot (the sequence's previous piece), else from h0 or zero; it goes to the carry slot for the next
    piece, else to ht."""
    # piece-major, then head, then V block: the longest pieces' chains (listed first) start in the first wave,
    # and the V blocks of one (piece, head) run side by side, sharing W, Qg, Kg in L2
    pid = tl.program_id(0)
    iv = pid % (V // BV)
    hh = (pid // (V // BV)) % H
    row = pieces + (pid // (V // BV * H)) * 6
    bos = tl.load(row)  # token offsets in int32 where they fit (I64 False): 9% fewer instructions per step
    eos = tl.load(row + 1)
    if I64:
        bos = bos.to(tl.int64)
        eos = eos.to(tl.int64)
    c0 = tl.load(row + 2)
    nn = tl.load(row + 3)
    c_in = tl.load(row + 4).to(tl.int64)
    c_out = tl.load(row + 5).to(tl.int64)
    r = tl.arange(0, BT)
    dk = tl.arange(0, K)
    dv = iv * BV + tl.arange(0, BV)
    st = hh * K * V + dk[:, None] * V + dv[None, :]
    S = tl.zeros([K, BV], tl.float32)
    if c_in >= 0:
        S = tl.load(carry + c_in * (H * K * V) + st)
    else:
        if HAS_H0:
            i0 = tl.load(h0_idx + nn).to(tl.int64)
            S = tl.load(h0 + i0 * s_h0 + st).to(tl.float32)
    nc = (eos - bos + BT - 1) // BT
    if INTERPRET:  # numpy >= 2.4: the interpreter cannot use loaded scalars as range() bounds
        c = 0
        while c < nc:
            S = _state_chunk(S, c, c0, bos, eos, w, tb, v, s_vt, s_vh, qg, kg, aqk, gl, o, s_ot, s_oh, hh, r, dk, dv, H,
                             K, BT)
            c += 1
    else:
        for c in tl.range(0, nc, num_stages=STAGES):  # tl.range: Triton then pipelines the e^Γ_C load too
            S = _state_chunk(S, c, c0, bos, eos, w, tb, v, s_vt, s_vh, qg, kg, aqk, gl, o, s_ot, s_oh, hh, r, dk, dv, H,
                             K, BT)
    if c_out >= 0:
        tl.store(carry + c_out * (H * K * V) + st, S)
    else:
        if STORE_HT:
            i1 = tl.load(ht_idx + nn).to(tl.int64)
            tl.store(ht + i1 * s_ht + st, S)


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _kda_decode(
    q, k, v, g, beta, A_log, dt_bias, o, pool, idx,
    s_qn, s_qt, s_qh, s_kn, s_kt, s_kh, s_vn, s_vt, s_vh, s_gn, s_gt, s_gh, s_bn, s_bt, s_bh, s_on, s_ot, s_oh,
    s_p, scale, lower_bound,
    Q: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_BIAS: tl.constexpr, L2: tl.constexpr, BETA_SIG: tl.constexpr, PAIRED: tl.constexpr,
):
    # V blocks of a head, then heads, then sequences: neighbouring programs read neighbouring state rows
    # (B ≥ 64 +4% against sequences first)
    pid = tl.program_id(0)
    iv = pid % (V // BV)
    hh = (pid // (V // BV)) % H
    nn = pid // (V // BV * H)
    dv = iv * BV + tl.arange(0, BV)
    slot = tl.load(idx + nn).to(tl.int64)
    if slot < 0:  # padding: its output is 0 (o is not pre-zeroed: that would be a launch of its own)
        for t in tl.static_range(Q):
            tl.store(o + nn * s_on + t * s_ot + hh * s_oh + dv, tl.zeros([BV], o.dtype.element_ty))
        return
    dk = tl.arange(0, K)
    p = pool + slot * s_p + hh * K * V + dk[:, None] * V + dv[None, :]
    S = tl.load(p)
    a = 1.0
    bias = tl.zeros([K], tl.float32)
    if GATE > 0:
        a = tl.exp(tl.load(A_log + hh).to(tl.float32))
        if HAS_BIAS:
            bias = tl.load(dt_bias + hh * K + dk).to(tl.float32)
    for t in tl.static_range(Q):
        bq = tl.load(q + nn * s_qn + t * s_qt + hh * s_qh + dk).to(tl.float32)
        bk = tl.load(k + nn * s_kn + t * s_kt + hh * s_kh + dk).to(tl.float32)
        bv = tl.load(v + nn * s_vn + t * s_vt + hh * s_vh + dv).to(tl.float32)
        bg = tl.load(g + nn * s_gn + t * s_gt + hh * s_gh + dk).to(tl.float32)
        bb = tl.load(beta + nn * s_bn + t * s_bt + hh * s_bh).to(tl.float32)
        if L2:
            bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6)
            bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
        if BETA_SIG:
            bb = tl.sigmoid(bb)
        if GATE > 0:
            bg = _gate(bg + bias, a, lower_bound, GATE)
        decay = tl.exp(bg)
        qs = bq * scale
        # one reduction over K for both products, on the state as loaded: with D = diag(e^g),
        # (D S)ᵀ k = Sᵀ (D k) and (D S + k unᵀ)ᵀ q = Sᵀ (D q) + un (k · q)
        if PAIRED:
            sk, sq = tl.reduce((S * (bk * decay)[:, None], S * (qs * decay)[:, None]), 0, _add_pairs)
        else:  # the same sums as two: the interpreter runs a tuple reduction element by element (~1 s a [64, 16])
            sk = tl.sum(S * (bk * decay)[:, None], 0)
            sq = tl.sum(S * (qs * decay)[:, None], 0)
        un = (bv - sk) * bb
        ob = sq + un * tl.sum(bk * qs)
        S = S * decay[:, None] + bk[:, None] * un[None, :]
        tl.store(o + nn * s_on + t * s_ot + hh * s_oh + dv, ob.to(o.dtype.element_ty))
    tl.store(p, S)


# ---------------------------------------------------------------------------------------------------
# launchers


def prefill_config(K, V, n_seqs, heads, tokens, max_len, long_seqs=1, gluon_state=False, gluon_intra=False,
                   full_seqs=1, num_sms=0):
    """Launch parameters (H100 A/Bs in benchmarks/NOTES.md, issue 5, session g): the chunk (BT); the intra
    kernel's warps, pipeline stages, register cap, key channels per A step (BK) and per W/U step (BKW); the state
    kernel's block of V, warps and stages; the segments the chunk list is cut into and whether each segment's
    state kernel runs beside the next segment's intra kernel (overlap).
    16-token chunks where the intra work dominates: a 16-row block needs no cross-block part, and 2-warp
    programs capped at 128 registers (eight per SM) make the intra kernel ~35% faster than at 32 tokens; but
    the state kernel's chain of chunk updates then takes twice the steps (session g: 0.88 µs per 16 tokens
    against 1.12 per 32; session h: 0.70 against 1.05, at ~5.3 cycles per instruction). The intra kernel
    saves ~1 ns per token-head and the chain costs ~20 ns per token of the longest sequence: 16 wins where
    tokens × heads ≥ CHAIN_RATIO × the longest sequence (measured: one sequence at H=24 is 8% faster at 16,
    at H=16 12% slower). Where the chains are a large part of the work (below
    CHAIN_RATIO always; at 16 tokens up to OVERLAP_RATIO) and the longest sequence has ≥ 2048 tokens, the
    state kernels run per segment (~2048 tokens of the longest sequence, 2 to 8; every sequence advances in
    each) on a second stream beside the next segment's intra programs, with ~128 state programs (BV, for the
    long_seqs sequences at least half as long as the longest) so that the SMs they share keep room for intra
    programs. Measured: one sequence H=32 T=8192 −13%, T=32768 −19%; H=16 −6% / −16%; H=64 −5%, H=96 −3%;
    2×8192 H=32 −6%, varlen [1300 … 3063] H=32 −6%; more chains (8×1024, 4×4096) lose. 32-token programs:
    4 warps capped at 128 registers (four per SM). 16-token chunks also take the A dots in bf16 for bf16 inputs
    (A16: −3 to −6%, error 3.6e-3 → 4.0e-3 against fla's 4.5e-3) and store Qg, Kg and K ⊙ e^Γ from the A steps
    (onepass: −1.3 to −3%, except beside a BV-32 chain, where it is 2% slower; session h).
    gluon_state (the Gluon state kernel will run, state_gluon.py): where the overlap would use BV-32 chains (one
    long sequence at H=32) it uses BV 64, with segments of ~1024 tokens beside the Triton intra kernel (session i,
    H100: T=8192 H=32 −5.4%, T=32768 −1.6%; with BV 32 the faster chain gained nothing beside the intra kernel) and
    the usual ~2048 beside the Gluon one (gluon_intra, intra_gluon.py; session j: T=8192 H=32 −9% against 1024).
    Beside the Gluon intra kernel, no overlap where the chains of the full_seqs sequences within 10% of the longest
    fill their waves of num_sms SMs to ≥ 90%: the state kernel then uses the whole GPU after the intra kernel, and
    sharing the SMs costs more than it hides (session j, one sequence: 128 chains at H=64 −7% at 8k, −8% at 16k,
    −3% at 32k without the overlap; 64 chains at H=32 +14%, 96 at H=48 +4%, 192 at H=96 +6% with it)."""
    ratio = tokens * heads / max(max_len, 1)
    segments = max(2, min(8, max_len // 2048)) if max_len >= 2048 else 1
    programs_bv = 1 << max(V * heads * long_seqs // 128, 1).bit_length() - 1  # BV for ~128 state programs
    bv = max(32, min(V, programs_bv))
    overlap = dict(segments=segments, overlap=True, BV=bv, onepass=bv >= 64)
    if ratio >= CHAIN_RATIO:
        cfg = dict(BT=16, intra_warps=2, intra_stages=3, intra_maxnreg=128, BK=32, BKW=64, BV=min(64, V),
                   state_warps=4, state_stages=3, PREC="tf32", A16=1, onepass=True, SAFE=1, segments=1, overlap=False)
        if ratio <= OVERLAP_RATIO and segments >= 2:
            cfg.update(overlap)
            if gluon_state and cfg["BV"] < GLUON_STATE_MIN_BV:  # Gluon chains: BV 64
                cfg.update(BV=GLUON_STATE_MIN_BV)
                if not gluon_intra:  # beside the slower Triton intra kernel, ~1024-token segments
                    cfg.update(segments=max(2, min(8, max_len // 1024)))
            chains = full_seqs * heads * (V // cfg["BV"])
            if gluon_intra and num_sms and chains >= 0.9 * num_sms * -(-chains // num_sms):
                cfg.update(segments=1, overlap=False)
        return cfg
    bv = 32 if n_seqs * heads * (V // 32) >= 96 else 16
    cfg = dict(BT=32, intra_warps=4, intra_stages=3, intra_maxnreg=128, BK=16, BKW=64, BV=min(bv, V), state_warps=4,
               state_stages=3, PREC="tf32", SAFE=1, segments=1, overlap=False)
    if segments >= 2:
        cfg.update(overlap)
    return cfg


def intra_compile_options(cfg):
    """The intra kernel's extra compile options: the register cap, where the configuration sets one."""
    return {"maxnreg": cfg["intra_maxnreg"]} if cfg.get("intra_maxnreg") else {}


def needs_int64_offsets(tokens, bt, buffer_row, *inputs):
    """Whether an element offset formed from a token index (the padded rows of the last chunk included) can reach
    2^31: over our [T, H, ·] buffers (buffer_row elements a token) and the inputs' token strides."""
    return (tokens + bt) * max(buffer_row, *(x.stride(0) for x in inputs)) > 2**31


def decode_config(K, V, n, heads):
    """Enough programs (sequence × head × V block) to fill the GPU: narrow V blocks for small batches."""
    pairs = n * heads  # measured on H100 (H = 32, B = 1 to 256): 1 warp per 16 columns of V
    bv = min(16 if pairs < 512 else 32 if pairs < 1024 else 64, V)
    return dict(BV=bv, num_warps=bv // 16)


def segment_table(cu_list, bt, n_segments):
    """The chunks (start token, rows), never crossing a sequence, cut into segments: segment s holds the s-th
    n_segments-th of every sequence's chunks, so the segments advance all sequences together. The chunk table
    lists the segments one after the other (each a range [a, b) of it), and per segment its pieces (first
    token, end token, first chunk in the table, sequence, carry slot in, carry slot out), a piece being a
    sequence's chunks inside the segment: a piece leaves its state in a carry slot for the sequence's next
    piece. An empty sequence is a piece of no chunks (its final state is its initial state). Within a segment the
    pieces are listed longest first.
    Returns (chunks, pieces, [(a, b, first piece, pieces) per segment], carry slots)."""
    per_seq = [[(c, min(bt, e - c)) for c in range(s, e, bt)] for s, e in zip(cu_list, cu_list[1:])]
    n_seg = max(1, min(n_segments, max(len(c) for c in per_seq)))
    chunks, pieces, segs = [], [], []
    last_slot = [-1] * len(per_seq)  # the carry slot each sequence's next piece reads (−1: h0)
    slots = 0
    for si in range(n_seg):
        a, p0 = len(chunks), len(pieces)
        for n, cs in enumerate(per_seq):
            lo, hi = si * len(cs) // n_seg, (si + 1) * len(cs) // n_seg
            if lo == hi and (cs or si > 0):  # nothing of this sequence here (an empty one goes in segment 0)
                continue
            part = cs[lo:hi]
            bos = part[0][0] if part else cu_list[n]
            eos = part[-1][0] + part[-1][1] if part else cu_list[n]
            out = -1
            if hi < len(cs):  # more of the sequence follows: hand the state on
                out, slots = slots, slots + 1
            pieces.append((bos, eos, len(chunks), n, last_slot[n], out))
            last_slot[n] = out
            chunks.extend(part)
        pieces[p0:] = sorted(pieces[p0:], key=lambda pc: pc[0] - pc[1])  # longest first: its chains start first
        segs.append((a, len(chunks), p0, len(pieces) - p0))
    return chunks, pieces, segs, slots


# the state kernel in Gluon (state_gluon.py) for 16-token chunks on Hopper with BV ≥ 64 (H100, session i, outputs
# bit-equal: varlen 6 H=32 +8.8%, T=8192 H=64 +10.3%, 8×1024 H=32 +5.7%, H=96 +4.4%, 8×4096 −0.7%); with BV-32
# chains beside the intra kernel (one long sequence at H=32) it gained nothing (T=8192 +0.5%, T=32768 −4.7%)
# although alone its step is 22% shorter (540 against 695 ns), so there prefill_config moves to BV 64
GLUON_STATE, GLUON_STATE_MIN_BV = True, 64
# the intra kernel in Gluon (intra_gluon.py) for 16-token chunks of bf16 inputs with the safe gate on Hopper, BC key
# channels a step (H100, session j: every suite row 5–19% faster in the whole prefill; BC 64 within ±2%)
GLUON_INTRA, GLUON_INTRA_BC = True, 32
_META = {}
_SIDE_STREAMS = {}
# overrides for tuning runs: {"prefill": {...}, "decode": {...}, "decode_by_n": {N: {...}}, "skip_state": bool,
# "slow_exp": bool, "i64": bool}; decode's PAIRED: one tuple reduction for both sums (the GPU's; off in the interpreter)
TUNE = {}
LAUNCHED = {}  # the last compiled kernels (registers and spills for tuning reports)


def _metadata(cu_list, dev, bt, n_segments):
    """segment_table on the device (chunks [nc, 2], pieces [P, 6] int32), the segments and the number of carry
    slots on the host; cached per batch layout so that a CUDA-graph capture after a warm-up call copies nothing to
    the device."""
    key = (tuple(cu_list), str(dev), bt, n_segments)
    hit = _META.get(key)
    if hit is None:
        chunks, pieces, segs, slots = segment_table(cu_list, bt, n_segments)
        hit = (torch.tensor(chunks if chunks else [(0, 0)], dtype=torch.int32).to(dev),
               torch.tensor(pieces, dtype=torch.int32).to(dev), segs, len(chunks), slots)
        if len(_META) > 256:
            _META.clear()
        _META[key] = hit
    return hit


def _side_stream(dev):
    """A high-priority stream for the state kernels: their programs take SM slots ahead of the intra kernel's
    queued ones, so the chain of chunk updates is not starved."""
    s = _SIDE_STREAMS.get(dev)
    if s is None:
        s = _SIDE_STREAMS[dev] = torch.cuda.Stream(dev, priority=-1)
    return s


def prefill(q, k, v, g, beta, cu, scale, A_log, dt_bias, lower_bound, l2, beta_sig, h0, h0_idx, ht, ht_idx,
            cu_host=None, config=None):
    """Packed tokens: q/k/g [T, H, K], v [T, H, V], beta [T, H]; cu [N + 1] (any device; cu_host: the same on
    the CPU, to avoid a sync). Initial states from h0[h0_idx[n]] (fp32 [*, H, K, V]) when h0 is given; final
    states to ht[ht_idx[n]].
    Per segment of the chunk list: the intra kernel, then the state kernel from the previous segment's carried
    states. With overlap (CUDA), the state kernels run on a second stream, each after its segment's intra
    kernel and beside the next segment's."""
    T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    cu_list = (cu_host if cu_host is not None else cu).tolist()  # a host sync only for CUDA offsets alone
    n_seqs = len(cu_list) - 1
    o = torch.empty(T, H, V, device=dev, dtype=v.dtype)
    if n_seqs == 0 or (T == 0 and ht is None):
        return o
    lens = [b - a for a, b in zip(cu_list, cu_list[1:])]
    max_len = max(lens)
    long_seqs = sum(2 * n >= max_len for n in lens)
    full_seqs = sum(10 * n >= 9 * max_len for n in lens)
    gate = 0 if A_log is None else (1 if lower_bound is None else 2)
    safe_gate = gate == 2 and lower_bound >= SAFE_MIN_LOWER_BOUND
    gluon_dev = not interpreting() and dev.type == "cuda"
    if gluon_dev:
        from . import intra_gluon, state_gluon

        gluon_dev = state_gluon.supported(q)  # Hopper, 16-bit inputs, the triton the Gluon kernels were checked with
    gluon_intra_dev = GLUON_INTRA and gluon_dev and intra_gluon.supported(q, k, g, gate, safe_gate)
    cfg = {**prefill_config(K, V, n_seqs, H, T, max_len, long_seqs, GLUON_STATE and gluon_dev, gluon_intra_dev,
                            full_seqs, sm_count(dev) if gluon_intra_dev else 0),
           **TUNE.get("prefill", {}), **(config or {})}
    bt = cfg["BT"]
    chunks, pieces, segs, nc, slots = _metadata(cu_list, dev, bt, cfg["segments"])
    it = q.dtype
    w = torch.empty(T, H, K, device=dev, dtype=it)
    qg = torch.empty(T, H, K, device=dev, dtype=it)
    kg = torch.empty(T, H, K, device=dev, dtype=it)
    tb = torch.empty(T, H, bt, device=dev, dtype=it)
    aqk = torch.empty(T, H, bt, device=dev, dtype=it)
    gl = torch.empty(max(nc, 1), H, K, device=dev, dtype=torch.float32)
    carry = torch.empty(max(slots, 1), H, K, V, device=dev, dtype=torch.float32)
    safe = bool(cfg["SAFE"]) if safe_gate else 0
    BV = cfg["BV"]
    i64 = TUNE.get("i64", needs_int64_offsets(T, bt, H * max(K, V, bt), q, k, g, v, beta))
    gluon_state = (cfg.get("gluon_state", GLUON_STATE and BV >= GLUON_STATE_MIN_BV) and gluon_dev
                   and state_gluon.supported(q, bt, i64))
    gluon_intra = (cfg.get("gluon_intra", gluon_intra_dev) and gluon_dev
                   and intra_gluon.supported(q, k, g, gate, safe, bt, i64))
    main = side = None
    if cfg["overlap"] and len(segs) > 1 and dev.type == "cuda":
        main, side = torch.cuda.current_stream(dev), _side_stream(dev)
    for a, b, p0, n_pieces in segs:
        if b > a and gluon_intra:
            LAUNCHED["intra"] = intra_gluon._kda_intra_gluon[((b - a) * H,)](
                q, k, g, beta, A_log, dt_bias if dt_bias is not None else q, w, tb, qg, kg, aqk, gl[a:], chunks[a:],
                q.stride(1), k.stride(1), g.stride(1), beta.stride(0), beta.stride(1), float(scale),
                float(lower_bound), S_QT=q.stride(0), S_KT=k.stride(0), S_GT=g.stride(0), H=H, K=K,
                BC=min(cfg.get("BC", GLUON_INTRA_BC), K), HAS_BIAS=dt_bias is not None, BETA_SIG=bool(beta_sig),
                L2=bool(l2), num_warps=1)
        elif b > a:
            LAUNCHED["intra"] = _kda_intra[(b - a, H)](
                q, k, g, beta, A_log if A_log is not None else q, dt_bias if dt_bias is not None else q,
                w, tb, qg, kg, aqk, gl[a:], chunks[a:],
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1), beta.stride(0),
                beta.stride(1), float(scale), float(lower_bound or 0.0),
                H=H, K=K, BT=bt, BS=BS, BK=cfg["BK"], GATE=gate, HAS_BIAS=dt_bias is not None, L2=bool(l2),
                BETA_SIG=bool(beta_sig), SAFE=safe, PREC=cfg["PREC"], NSQ=bt.bit_length() - 2,
                BKW=min(cfg["BKW"], K), FAST=not interpreting() and not TUNE.get("slow_exp"),
                A16=bool(cfg.get("A16")) and it == torch.bfloat16, I64=i64,
                ONEPASS=bool(cfg.get("onepass")) and safe and bt == BS,
                num_warps=cfg["intra_warps"], num_stages=cfg["intra_stages"],
                **intra_compile_options(cfg))
        if TUNE.get("skip_state") or n_pieces == 0:
            continue
        if side is not None:
            side.wait_stream(main)  # this segment's intra outputs
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            kernel, extra = ((state_gluon._kda_state_gluon, dict(STAGES=state_gluon.STAGES)) if gluon_state else
                             (_kda_state, dict(INTERPRET=interpreting(), STAGES=cfg["state_stages"], I64=i64,
                                               num_stages=cfg["state_stages"])))
            LAUNCHED["state"] = kernel[(n_pieces * H * (V // BV),)](
                w, tb, v, qg, kg, aqk, gl, o, pieces[p0:], h0 if h0 is not None else gl,
                h0_idx if h0 is not None else pieces, ht if ht is not None else gl,
                ht_idx if ht is not None else pieces, carry,
                v.stride(0), v.stride(1), o.stride(0), o.stride(1), h0.stride(0) if h0 is not None else 0,
                ht.stride(0) if ht is not None else 0,
                H=H, K=K, V=V, BV=BV, BT=bt, HAS_H0=h0 is not None, STORE_HT=ht is not None,
                num_warps=cfg["state_warps"], **extra)
    if side is not None:
        main.wait_stream(side)
    return o


def decode(q, k, v, g, beta, pool, idx, scale, A_log, dt_bias, lower_bound, l2, beta_sig, config=None):
    """q/k/g [N, Q, H, K], v [N, Q, H, V], beta [N, Q, H]; pool fp32 [P, H, K, V] updated in place."""
    N, Q, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(N, Q, H, V, device=q.device, dtype=v.dtype)
    if N == 0 or Q == 0:
        return o
    cfg = {**decode_config(K, V, N, H), **TUNE.get("decode_by_n", {}).get(N, {}), **TUNE.get("decode", {}),
           **(config or {})}
    gate = 0 if A_log is None else (1 if lower_bound is None else 2)
    BV = cfg["BV"]
    LAUNCHED["decode"] = _kda_decode[(N * H * (V // BV),)](
        q, k, v, g, beta, A_log if A_log is not None else q, dt_bias if dt_bias is not None else q, o, pool, idx,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:3], *beta.stride()[:3], *o.stride()[:3],
        pool.stride(0), float(scale), float(lower_bound or 0.0),
        Q=Q, H=H, K=K, V=V, BV=BV, GATE=gate, HAS_BIAS=dt_bias is not None, L2=bool(l2), BETA_SIG=bool(beta_sig),
        PAIRED=cfg.get("PAIRED", not interpreting()), num_warps=cfg["num_warps"])
    return o
