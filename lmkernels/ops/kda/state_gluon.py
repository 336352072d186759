"""The KDA state kernel (kernels._kda_state's math and arguments, 16-token chunks) written in Gluon, for Hopper.

Why: the state kernel is a chain of dependent chunk updates. In the Triton kernel the state S [K, BV] lives in
the accumulator layout of the update dot with its rows split across the warps, so every step moves S and Ũ
through shared memory, behind barriers, to become the right operand of the next dots. Here each warp owns
BV / num_warps value columns of S for all K rows (mma.sync layout with the warps along N): W·S, Qg·S, Aqk·Ũ and
Kgᵀ·Ũ for those columns need only that warp's own S and Ũ, so the operand changes are register shuffles and
the chain has no barrier. The loaded operands (W, Qg, Kg, Tb, Aqk, V, e^Γ_C) come through a cp.async ring in
swizzled shared memory, STAGES − 1 chunks ahead, one barrier a step. Same dots in the same order as the Triton
kernel: the outputs are bit-equal on the GPU. A step alone: 540 ns against 695 (BV 32); in the prefill +4–10% at
BV 64, nothing at BV 32 beside the intra kernel (benchmarks/NOTES.md, issue 5, session i; kernels.GLUON_STATE).
Compiled kernels only: the interpreter cannot run Gluon (CPU tests run the Triton kernel; `lmkernels check`
runs this one on the GPU)."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

STAGES = 3
TRITON_VERSIONS = ("3.6",)  # Gluon's API moves between releases: only the triton this was checked with


@gluon.jit
def _copy_rows(dst, src, row0, eos, row_stride, col0, ROWS: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
    """cp.async rows row0 … row0 + ROWS (row_stride apart) and columns col0 … col0 + COLS of src into dst; rows at
    or past eos read as 0."""
    r = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    d = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(dst, src + r[:, None] * row_stride + d[None, :], mask=(r < eos)[:, None])


@gluon.jit
def _issue(c, nc, bos, eos, w, qg, kg, tb, aqk, v, gdec, s_vt, s_vh, hh, c0, iv, ring,
           H: gl.constexpr, K: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr):
    """cp.async chunk c's operands into ring stage c % STAGES (rows past the piece's end read as 0)."""
    sw, sq, sk, st, sa, sv, sg = ring
    s = c % sw.shape[0]
    tok0 = bos + c * BT
    nw: gl.constexpr = gl.num_warps()
    wide: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [nw, 1], [1, 0])  # [BT, K]
    narrow: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [nw, 1], [1, 0])  # [BT, BT]
    vlay: gl.constexpr = gl.BlockedLayout([1, 8], [BT // 2, 32 // (BT // 2)], [nw, 1], [1, 0])  # [BT, BV]
    _copy_rows(sw.index(s), w, tok0, eos, H * K, hh * K, BT, K, wide)
    _copy_rows(sq.index(s), qg, tok0, eos, H * K, hh * K, BT, K, wide)
    _copy_rows(sk.index(s), kg, tok0, eos, H * K, hh * K, BT, K, wide)
    _copy_rows(st.index(s), tb, tok0, eos, H * BT, hh * BT, BT, BT, narrow)
    _copy_rows(sa.index(s), aqk, tok0, eos, H * BT, hh * BT, BT, BT, narrow)
    _copy_rows(sv.index(s), v + hh * s_vh, tok0, eos, s_vt, iv * BV, BT, BV, vlay)
    ldg: gl.constexpr = gl.BlockedLayout([4], [32], [nw], [0])
    dg = gl.arange(0, K, layout=ldg)
    async_copy.async_copy_global_to_shared(sg.index(s), gdec + ((c0 + c) * H + hh) * K + dg,
                                           mask=(dg < K) & (c < nc))
    async_copy.commit_group()


@gluon.jit
def _kda_state_gluon(
    w, tb, v, qg, kg, aqk, gdec, o, pieces, h0, h0_idx, ht, ht_idx, carry,
    s_vt, s_vh, s_ot, s_oh, s_h0, s_ht,
    H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, BT: gl.constexpr,
    HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, STAGES: gl.constexpr,
):
    """One piece of a sequence, one head, one block of BV value columns (kernels._kda_state)."""
    nw: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, nw], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    pid = gl.program_id(0)
    iv = pid % (V // BV)
    hh = (pid // (V // BV)) % H
    row = pieces + (pid // (V // BV * H)) * 6
    bos = gl.load(row)
    eos = gl.load(row + 1)
    c0 = gl.load(row + 2)
    nn = gl.load(row + 3)
    c_in = gl.load(row + 4).to(gl.int64)
    c_out = gl.load(row + 5).to(gl.int64)
    dt: gl.constexpr = w.dtype.element_ty
    wide: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    narrow: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    vlay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128 if BV >= 64 else 64, element_bitwidth=16,
                                              rank=2)
    ring = (gl.allocate_shared_memory(dt, [STAGES, BT, K], wide), gl.allocate_shared_memory(dt, [STAGES, BT, K], wide),
            gl.allocate_shared_memory(dt, [STAGES, BT, K], wide),
            gl.allocate_shared_memory(dt, [STAGES, BT, BT], narrow),
            gl.allocate_shared_memory(dt, [STAGES, BT, BT], narrow),
            gl.allocate_shared_memory(dt, [STAGES, BT, BV], vlay),
            gl.allocate_shared_memory(gl.float32, [STAGES, K], gl.SwizzledSharedLayout(1, 1, 1, [0])))
    sw, sq, sk, st, sa, sv, sg = ring
    dk = gl.arange(0, K, layout=gl.SliceLayout(1, mma))
    dv = iv * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, mma))
    idx = hh * K * V + dk[:, None] * V + dv[None, :]
    S = gl.zeros([K, BV], gl.float32, layout=mma)
    if c_in >= 0:
        S = gl.load(carry + c_in * (H * K * V) + idx)
    else:
        if HAS_H0:
            i0 = gl.load(h0_idx + nn).to(gl.int64)
            S = gl.load(h0 + i0 * s_h0 + idx).to(gl.float32)
    nc = (eos - bos + BT - 1) // BT
    for c in gl.static_range(STAGES - 1):
        _issue(c, nc, bos, eos, w, qg, kg, tb, aqk, v, gdec, s_vt, s_vh, hh, c0, iv, ring, H, K, BT, BV)
    zero = gl.zeros([BT, BV], gl.float32, layout=mma)
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, mma))
    for c in range(nc):
        s = c % STAGES
        async_copy.wait_group(STAGES - 2)  # chunk c has landed
        gl.thread_barrier()  # ... for every warp, and every warp is done with chunk c − 1's stage, refilled next
        _issue(c + STAGES - 1, nc, bos, eos, w, qg, kg, tb, aqk, v, gdec, s_vt, s_vh, hh, c0, iv, ring, H, K, BT, BV)
        Sb = gl.convert_layout(S.to(dt), lb)
        un = mma_v2(st.index(s).load(la), sv.index(s).load(lb), zero) - mma_v2(sw.index(s).load(la), Sb, zero)
        unb = gl.convert_layout(un.to(dt), lb)
        ob = mma_v2(sa.index(s).load(la), unb, mma_v2(sq.index(s).load(la), Sb, zero))
        tok = bos + c * BT + r
        gl.store(o + tok[:, None] * s_ot + hh * s_oh + dv[None, :], ob.to(o.dtype.element_ty),
                 mask=(tok < eos)[:, None])
        S = mma_v2(sk.index(s).permute((1, 0)).load(la), unb, S * sg.index(s).load(gl.SliceLayout(1, mma))[:, None])
    async_copy.wait_group(0)
    if c_out >= 0:
        gl.store(carry + c_out * (H * K * V) + idx, S)
    else:
        if STORE_HT:
            i1 = gl.load(ht_idx + nn).to(gl.int64)
            gl.store(ht + i1 * s_ht + idx, S)


def supported(q, bt=16, i64=False):
    """16-token chunks of 16-bit inputs with int32 offsets on Hopper, under the triton this was checked with."""
    return (q.is_cuda and bt == 16 and not i64 and q.dtype in (torch.bfloat16, torch.float16)
            and triton.__version__.startswith(TRITON_VERSIONS) and torch.cuda.get_device_capability(q.device) == (9, 0))
