"""The KDA intra kernel (kernels._kda_intra's math and outputs for 16-token chunks with the safe gate) written in
Gluon, for Hopper.

Why: the Triton intra kernel is bound by shared-memory wavefronts (ncu, session h: L1/TEX 83%), nearly all of them
layout changes: the row scan of Γ, the row reductions and every dot operand go through shared memory in layouts
Triton picks. Here one warp owns one (chunk, head). q, k and g arrive in shared memory by cp.async, all at once, and
are read back in tiles where one thread holds all 16 rows of a column, so the cumulative sum Γ and the reference rows
(Γ_7, Γ_15) are in-thread arithmetic; each dot operand is staged once through swizzled shared memory (ldmatrix).
Outputs: those of the Triton kernel with ONEPASS (Qg, Kg, W = Tb (K ⊙ e^Γ), Tb = T diag(β), Aqk, e^Γ_C), with the
same factorisation of the decays around the chunk's middle row (kernels.SAFE_MIN_LOWER_BOUND); on the GPU they
agree with the Triton kernel's to 1e-4 (bf16 rounding; benchmarks/NOTES.md, issue 5, session j).
Speed (H100, ncu, 8×1024 H=32): 218 µs against the Triton kernel's 259; 198 registers and 19 KB of shared memory a
program allow 8 warps per SM, where it is latency-bound (more warps through fewer registers or unswizzled staging
tiles measured slower, NOTES j-3 / j-8).
Compiled kernels only: the interpreter cannot run Gluon (CPU tests run the Triton kernel; `lmkernels check` runs
this one on the GPU)."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

TRITON_VERSIONS = ("3.6",)  # Gluon's API moves between releases: only the triton this was checked with
BT = gl.constexpr(16)


@gluon.jit
def _add(a, b):
    """Our own combiner: gl.sum's becomes an interpreter object when TRITON_INTERPRET=1 (the CPU tests build this)."""
    return a + b


@gluon.jit
def _exp2(x):
    """2^x as ex2.approx.ftz (kernels._exp: results below 2^-126 flush to 0)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _col(x, r, i: gl.constexpr):
    """Row i of x [BT, C] (all rows of a column sit in one thread: no exchange)."""
    return gl.reduce(gl.where(r[:, None] == i, x, 0.0), 0, _add)


@gluon.jit
def _stage(dst, row0, ROW_STRIDE: gl.constexpr, n):
    """cp.async the chunk's rows (row0 + r · ROW_STRIDE, r < n; the rest read as 0) into dst [BT, K]."""
    K: gl.constexpr = dst.shape[1]
    cp: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // K, K // 8], [1, 1], [1, 0])
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, cp))
    d = gl.arange(0, K, layout=gl.SliceLayout(0, cp))
    async_copy.async_copy_global_to_shared(dst, row0 + r[:, None] * ROW_STRIDE + d[None, :], mask=(r < n)[:, None])


@gluon.jit
def _kda_intra_gluon(
    q, k, g, beta, A_log, dt_bias, w, tb, qg, kg, aqk, gdec, chunks,
    s_qh, s_kh, s_gh, s_bt, s_bh,
    scale, lower_bound,
    S_QT: gl.constexpr, S_KT: gl.constexpr, S_GT: gl.constexpr, H: gl.constexpr, K: gl.constexpr,
    BC: gl.constexpr, HAS_BIAS: gl.constexpr, BETA_SIG: gl.constexpr, L2: gl.constexpr,
):
    """One (chunk, head) per one-warp program, heads fastest (neighbouring programs read neighbouring bytes of the
    same token rows); BC key channels a step. The token strides are constexpr (one build per input layout): each
    row's address is then a base register plus an immediate."""
    pid = gl.program_id(0)
    hh = pid % H
    ic = pid // H
    start = gl.load(chunks + 2 * ic)
    n = gl.load(chunks + 2 * ic + 1)
    dt: gl.constexpr = w.dtype.element_ty
    NCH: gl.constexpr = K // BC
    # [BT, BC] tiles: a thread holds all 16 rows of BC / 32 columns
    cols: gl.constexpr = gl.BlockedLayout([BT, BC // 32], [1, 32], [1, 1], [1, 0])
    rows_c: gl.constexpr = gl.SliceLayout(1, cols)
    chan_c: gl.constexpr = gl.SliceLayout(0, cols)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    la32: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    lb32: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=1)
    rows_m: gl.constexpr = gl.SliceLayout(1, mma)
    cols_m: gl.constexpr = gl.SliceLayout(0, mma)
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BC * 2, 128), element_bitwidth=16, rank=2)
    s_ke = gl.allocate_shared_memory(dt, [BT, BC], sw)  # A operands of this step: K ⊙ e^(Γ−M), Q ⊙ e^(Γ−M)
    s_qe = gl.allocate_shared_memory(dt, [BT, BC], sw)
    s_kc = gl.allocate_shared_memory(dt, [BT, BC], sw)  # B operand (transposed): K ⊙ e^(M−Γ)
    s_kw = gl.allocate_shared_memory(dt, [NCH, BT, BC], sw)  # K ⊙ e^Γ (normalised), for W at the end

    # q, k, g of the chunk land in shared memory by cp.async (16-byte pieces, rows past the chunk read as 0); the
    # tiles are then read in the column layout, so no load latency sits inside the arithmetic
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    s_in = gl.allocate_shared_memory(dt, [3, BT, K], plain)
    _stage(s_in.index(0), q + start * S_QT + hh * s_qh, S_QT, n)
    _stage(s_in.index(1), k + start * S_KT + hh * s_kh, S_KT, n)
    _stage(s_in.index(2), g + start * S_GT + hh * s_gh, S_GT, n)
    async_copy.commit_group()

    r = gl.arange(0, BT, layout=rows_c)
    rm = r < n
    # the [T, H, K] outputs: scalar row-0 pointers plus constant row offsets (each row's address is then one base
    # register plus an immediate; offsets summed in int32 first took a 64-bit address per row and spilled)
    o0 = start * (H * K) + hh * K
    ro = (r * (H * K))[:, None]
    a = gl.exp(gl.load(A_log + hh).to(gl.float32))
    async_copy.wait_group(0)
    gl.thread_barrier()
    # the L2 norms first: Qg, Kg and K ⊙ e^Γ are stored normalised from the A steps
    rq = gl.full([BT], 1.0, gl.float32, layout=rows_c)
    rk = gl.full([BT], 1.0, gl.float32, layout=rows_c)
    if L2:
        xx = gl.zeros([BT, BC], gl.float32, layout=cols)
        yy = gl.zeros([BT, BC], gl.float32, layout=cols)
        for c in gl.static_range(NCH):
            x = s_in.index(0).slice(c * BC, BC, dim=1).load(cols).to(gl.float32)
            y = s_in.index(1).slice(c * BC, BC, dim=1).load(cols).to(gl.float32)
            xx += x * x
            yy += y * y
        rq = 1.0 / gl.sqrt(gl.reduce(xx, 1, _add) + 1e-6)  # one cross-lane reduction per row
        rk = 1.0 / gl.sqrt(gl.reduce(yy, 1, _add) + 1e-6)
    rqs = rq * scale
    LOG2E: gl.constexpr = 1.4426950408889634
    a2 = -a * LOG2E
    lb2 = lower_bound * LOG2E
    A = gl.zeros([BT, BT], gl.float32, layout=mma)
    Aq = gl.zeros([BT, BT], gl.float32, layout=mma)
    for c in gl.static_range(NCH):
        d = c * BC + gl.arange(0, BC, layout=chan_c)
        bq = s_in.index(0).slice(c * BC, BC, dim=1).load(cols).to(gl.float32)
        bk = s_in.index(1).slice(c * BC, BC, dim=1).load(cols).to(gl.float32)
        bg = s_in.index(2).slice(c * BC, BC, dim=1).load(cols).to(gl.float32)
        if HAS_BIAS:
            bg = bg + gl.load(dt_bias + hh * K + d).to(gl.float32)[None, :]
        # the safe gate in base 2 (Γ·log2 e, so each decay is one ex2); 0 on padded rows
        bg = gl.where(rm[:, None], lb2 / (1.0 + _exp2(bg * a2)), 0.0)
        G = gl.associative_scan(bg, 0, _add)
        M = _col(G, r, BT // 2 - 1)  # the reference row: exp(Γ_i − Γ_j) = e^(Γ_i − M) · e^(M − Γ_j)
        Gl = _col(G, r, BT - 1)  # Γ_C (padded rows add 0)
        e_row = _exp2(G - M[None, :])
        k_col = bk * _exp2(M[None, :] - G)
        # e^Γ = e^(Γ−M)·e^M and e^(Γ_C−Γ) = e^(M−Γ)·e^(Γ_C−M): each factor within fp32
        eG = e_row * _exp2(M)[None, :]
        ot = ro + d[None, :]
        gl.store(qg + o0 + ot, (bq * eG * rqs[:, None]).to(dt), mask=rm[:, None])
        gl.store(kg + o0 + ot, (k_col * _exp2(Gl - M)[None, :] * rk[:, None]).to(dt), mask=rm[:, None])
        gl.store(gdec + (ic * H + hh) * K + d, _exp2(Gl))
        s_kw.index(c).store((bk * eG * rk[:, None]).to(dt))
        s_ke.store((bk * e_row).to(dt))
        s_qe.store((bq * e_row).to(dt))
        s_kc.store(k_col.to(dt))
        gl.thread_barrier()
        kcT = s_kc.permute((1, 0)).load(lb)
        A = mma_v2(s_ke.load(la), kcT, A)
        Aq = mma_v2(s_qe.load(la), kcT, Aq)
        gl.thread_barrier()  # the staging tiles are rewritten by the next step

    i = gl.arange(0, BT, layout=rows_m)
    j = gl.arange(0, BT, layout=cols_m)
    ok_m = i < n
    tok_m = start + i
    bb = gl.load(beta + tok_m * s_bt + hh * s_bh, mask=ok_m, other=0.0).to(gl.float32)
    if BETA_SIG:
        bb = 1.0 / (1.0 + _exp2(bb * -LOG2E))
    bb = gl.where(ok_m, bb, 0.0)
    bb_j = gl.convert_layout(bb, cols_m)
    rk_i = gl.convert_layout(rk, rows_m)
    rk_j = gl.convert_layout(rk, cols_m)
    rq_i = gl.convert_layout(rq, rows_m)
    A = gl.where(i[:, None] > j[None, :], A, 0.0) * (rk_i * bb)[:, None] * rk_j[None, :]
    Aq = gl.where(i[:, None] >= j[None, :], Aq, 0.0) * (rq_i * scale)[:, None] * rk_j[None, :]
    oa = tok_m[:, None] * (H * BT) + hh * BT + j[None, :]
    gl.store(aqk + oa, Aq.to(dt), mask=ok_m[:, None])

    # T = (I + A)^-1 = (I − A)(I + A²)(I + A⁴)(I + A⁸): A is strictly lower triangular (A^16 = 0); tf32 dots
    eye = gl.where(i[:, None] == j[None, :], 1.0, 0.0)
    zero = gl.zeros([BT, BT], gl.float32, layout=mma)
    Tm = eye - A
    Pw = A
    for _ in gl.static_range(3):
        Pw = mma_v2(gl.convert_layout(Pw, la32), gl.convert_layout(Pw, lb32), zero, input_precision="tf32")
        Tm = mma_v2(gl.convert_layout(Tm, la32), gl.convert_layout(eye + Pw, lb32), zero, input_precision="tf32")
    Tb = (Tm * bb_j[None, :]).to(dt)
    gl.store(tb + oa, Tb, mask=ok_m[:, None])

    # W = Tb (K ⊙ e^Γ), per BC channels, stored from the tile layout
    Tb_a = gl.convert_layout(Tb, la)
    wz = gl.zeros([BT, BC], gl.float32, layout=mma)
    for c in gl.static_range(NCH):
        d = c * BC + gl.arange(0, BC, layout=chan_c)
        wc = gl.convert_layout(mma_v2(Tb_a, s_kw.index(c).load(lb), wz).to(dt), cols)
        gl.store(w + o0 + ro + d[None, :], wc, mask=rm[:, None])


def eligible(q, k, g, gate, safe, bt=16, i64=False):
    """What the kernel computes: 16-token chunks of bf16 inputs with the safe gate and int32 offsets (the A dots take
    bf16 operands, as the Triton kernel's A16), q, k, g in 16-byte pieces for cp.async (16-byte aligned, token strides
    of 8 elements (constexpr), head strides of 16 (the launcher's divisibility hint)), under the triton this was
    checked with."""
    return (bt == BT.value and gate == 2 and bool(safe) and not i64 and q.dtype == torch.bfloat16
            and all(x.stride(0) % 8 == 0 and x.stride(1) % 16 == 0 and x.data_ptr() % 16 == 0 for x in (q, k, g))
            and triton.__version__.startswith(TRITON_VERSIONS))


def supported(q, k, g, gate, safe, bt=16, i64=False):
    """eligible, on a Hopper GPU."""
    return q.is_cuda and eligible(q, k, g, gate, safe, bt, i64) and torch.cuda.get_device_capability(q.device) == (9, 0)
