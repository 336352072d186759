"""Triton kernel for the decode-time linear layer: y = x Wᵀ for a few rows of x, with its neighbours fused.

A decode step at batch 1 streams every weight once and does 2 flops per weight: it runs at memory speed,
so the work of a kernel is to keep the HBM busy and to spend no extra launch or pass on the small things
around each matmul. One program owns BLOCK_N rows of W (and with `gated` the matching BLOCK_N rows of the
up half) over the whole K, so it needs no split-K reduction and can finish the row itself:
- prologue: RMSNorm of x. The norm's scale is one number per row of x, so it is applied after the dot
  (y = (W · (x ⊙ g)) · rstd) and its sum of squares accumulates in the same pass over K as the dot;
- epilogue: bias, SwiGLU (silu(gate) · up from the two accumulators), the residual add.
Multiply-adds run on CUDA cores in fp32 (no tensor cores: there is nothing to gain at 2 flops per 2 bytes);
the K loop is software-pipelined (`tl.range(..., num_stages)`) so several tiles of W are in flight.

With USE_PDL the kernel is launched as a programmatic dependent launch (Hopper): it may start while the
kernel before it finishes, loads its first W tile (weights are never written by an earlier kernel), then
waits for that kernel (`gdc_wait`) before it reads x or writes anything. It also lets the next kernel
launch early (`gdc_launch_dependents`). This hides the drain-and-launch gap between back-to-back matmuls.
"""

import triton
import triton.language as tl

from ..._utils import gdc_launch_dependents, gdc_wait, interpreting, pdl_enabled


@triton.jit
def _load_w(w_ptrs, k0, offs_k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs + k0 + offs_k[None, :])
    return tl.load(w_ptrs + k0 + offs_k[None, :], mask=(k0 + offs_k < K)[None, :], other=0.0)


@triton.jit
def _accumulate(acc, acc_up, ss, w, w_up, x_ptr, g_ptr, k0, offs_k, offs_m, M, K, stride_xm,
                HAS_NORM: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr):
    """One K tile: acc (+)= W_tile ⊙ x_tile (the sum over K waits for the end), ss += x² for the norm."""
    k = k0 + offs_k
    if BLOCK_M == 1:
        if EVEN_K:
            x = tl.load(x_ptr + k).to(tl.float32)
        else:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        if HAS_NORM:
            ss += x * x
            x = x * tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if GATED:
            acc_up += w_up.to(tl.float32) * x[None, :]
    else:
        mask = (offs_m < M)[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            ss += x * x
            x = x * tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
        acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
        if GATED:
            acc_up += w_up.to(tl.float32)[None, :, :] * x[:, None, :]
    return acc, acc_up, ss


@triton.jit
def _stream(x_ptr, g_ptr, w_ptrs, up_ptrs, M, K, stride_xm, eps,
            HAS_NORM: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr,
            INTERPRET: tl.constexpr):
    """The rows at w_ptrs (and up_ptrs when GATED) against all of x over the whole K: (y, up) [BLOCK_M, BLOCK_N]
    in fp32, RMSNorm's scale applied."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    w = _load_w(w_ptrs, 0, offs_k, K, EVEN_K)
    w_up = _load_w(up_ptrs, 0, offs_k, K, EVEN_K) if GATED else 0.0
    if USE_PDL:  # the first tile is in flight; now wait for the kernel that writes x
        gdc_wait()

    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros_like(acc) if GATED else 0.0
    acc, acc_up, ss = _accumulate(acc, acc_up, ss, w, w_up, x_ptr, g_ptr, 0, offs_k, offs_m, M, K, stride_xm,
                                  HAS_NORM, GATED, BLOCK_M, EVEN_K)
    if INTERPRET:  # with numpy ≥ 2.4 the interpreter cannot use a scalar argument as a range() bound
        k0 = BLOCK_K
        while k0 < K:
            w = _load_w(w_ptrs, k0, offs_k, K, EVEN_K)
            w_up = _load_w(up_ptrs, k0, offs_k, K, EVEN_K) if GATED else 0.0
            acc, acc_up, ss = _accumulate(acc, acc_up, ss, w, w_up, x_ptr, g_ptr, k0, offs_k, offs_m, M, K,
                                          stride_xm, HAS_NORM, GATED, BLOCK_M, EVEN_K)
            k0 += BLOCK_K
    else:
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            w = _load_w(w_ptrs, k0, offs_k, K, EVEN_K)
            w_up = _load_w(up_ptrs, k0, offs_k, K, EVEN_K) if GATED else 0.0
            acc, acc_up, ss = _accumulate(acc, acc_up, ss, w, w_up, x_ptr, g_ptr, k0, offs_k, offs_m, M, K,
                                          stride_xm, HAS_NORM, GATED, BLOCK_M, EVEN_K)

    if USE_PDL:  # the streaming is done: the next kernel may launch and start loading its weights
        gdc_launch_dependents()
    if BLOCK_M == 1:
        y = tl.sum(acc, 1)[None, :]
        up = tl.sum(acc_up, 1)[None, :] if GATED else 0.0
        sumsq = tl.sum(ss, 0) + tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        y = tl.sum(acc, 2)
        up = tl.sum(acc_up, 2) if GATED else 0.0
        sumsq = tl.sum(ss, 1)
    if HAS_NORM:
        rstd = tl.rsqrt(sumsq / K + eps)[:, None]
        y = y * rstd
        if GATED:
            up = up * rstd
    return y, up


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_rm, stride_ym, eps,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr, USE_PDL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """y [M, N] from x [M, K] and W [N (×2 if GATED), K]; N is the output width."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # rows past N re-read row N − 1 (no mask on the hot loads); their results are not stored
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn
    up_ptrs = w_ptr + (rows + N)[:, None] * stride_wn  # GATED: the up half starts N rows down
    y, up = _stream(x_ptr, g_ptr, w_ptrs, up_ptrs, M, K, stride_xm, eps, HAS_NORM, GATED, BLOCK_M, BLOCK_N,
                    BLOCK_K, EVEN_K, STAGES, USE_PDL, INTERPRET)
    n_mask = offs_n < N
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        y = y * tl.sigmoid(y) * up
    out_mask = (offs_m < M)[:, None] & n_mask[None, :]
    if HAS_RESIDUAL:
        y += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gemv_qkv_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, q_ptr, cs_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
    M, K, stride_xm, stride_wn, stride_qm, stride_cs, stride_kcp, stride_kcs, stride_kch,
    stride_vcp, stride_vcs, stride_vch, n_q_heads, n_kv_heads, page_size, eps,
    HEAD_D: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr, USE_PDL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """q|k|v = x W_qkvᵀ (+ b), NeoX rotary on q and k, q stored to q_ptr [M, Hq·D], k and v stored into the paged
    caches [pages, page_size, Hk, D] at slot_ptr[m] (−1: no store).

    A program owns BLOCK_N / 2 rotary pairs of one head: rows d and d + D/2 for BLOCK_N / 2 consecutive d,
    interleaved (even columns the first half, odd the second), so both halves of each pair meet in its
    registers and the rotation needs no exchange between programs."""
    HALF: tl.constexpr = HEAD_D // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    per_head = HALF // PAIRS
    head = tl.program_id(0) // per_head
    i = tl.arange(0, BLOCK_N)
    d = (tl.program_id(0) % per_head) * PAIRS + i // 2 + (i % 2) * HALF  # dim within the head
    rows = (head * HEAD_D + d).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn
    y, _ = _stream(x_ptr, g_ptr, w_ptrs, w_ptrs, M, K, stride_xm, eps, HAS_NORM, False, BLOCK_M, BLOCK_N,
                   BLOCK_K, EVEN_K, STAGES, USE_PDL, INTERPRET)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    if head < n_q_heads + n_kv_heads:  # q or k: rotate each pair (x1, x2) by its position's angle
        pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
        j = (tl.program_id(0) % per_head) * PAIRS + tl.arange(0, PAIRS)
        cs = cs_ptr + pos[:, None] * stride_cs + j[None, :]
        cos = tl.load(cs, mask=m_ok[:, None], other=0.0)
        sin = tl.load(cs + HALF, mask=m_ok[:, None], other=0.0)
        x1, x2 = tl.split(tl.reshape(y, (BLOCK_M, PAIRS, 2)))
        y = tl.interleave(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if head < n_q_heads:
        ptrs = q_ptr + offs_m[:, None] * stride_qm + (head * HEAD_D + d)[None, :]
        tl.store(ptrs, y.to(q_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)
        ok = (m_ok & (slot >= 0))[:, None]
        page, row = slot // page_size, slot % page_size
        if head < n_q_heads + n_kv_heads:
            kv = head - n_q_heads
            ptrs = kc_ptr + page[:, None] * stride_kcp + row[:, None] * stride_kcs + kv * stride_kch + d[None, :]
            tl.store(ptrs, y.to(kc_ptr.dtype.element_ty), mask=ok)
        else:
            kv = head - n_q_heads - n_kv_heads
            ptrs = vc_ptr + page[:, None] * stride_vcp + row[:, None] * stride_vcs + kv * stride_vch + d[None, :]
            tl.store(ptrs, y.to(vc_ptr.dtype.element_ty), mask=ok)


def gemv_config(m: int, n: int, k: int, gated: bool):
    """Launch parameters: dict(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES).

    Memory-bound: a program streams BLOCK_N rows of W (twice that when gated); small BLOCK_N gives
    hundreds of programs even for N = 4096 (4 per SM on 132 SMs, all resident in one wave), and the K
    loop keeps STAGES tiles of BLOCK_N × BLOCK_K in flight. More rows of x shrink BLOCK_K so the
    accumulators still fit in registers. The figures: bf16, H100 sweeps (benchmarks/NOTES.md); from 4 rows on
    cuBLAS catches up (qkv, gate|up at 4 rows) and passes (every shape at 8 rows).
    """
    block_m = triton.next_power_of_2(max(1, m))
    if gated:  # gate|up 2×14336×4096: BN 4, BK 1024, 4 stages (2804 GB/s; 2738–2758 for BN 8 or BK 512)
        block_n, block_k, stages = 4, 1024, 4
    elif k >= 8192:  # down 4096×14336: 4 stages (2587 GB/s, 2567 with 1)
        block_n, block_k, stages = 8, 512, 4
    elif n >= 65536:  # lm_head 128256×4096: 3027 GB/s
        block_n, block_k, stages = 8, 512, 3
    else:  # qkv 6144×4096, o 4096×4096: no pipelining (2389 GB/s on qkv, 2154 with 3 stages)
        block_n, block_k, stages = 8, 512, 1
    if block_m > 1:  # 2–8 rows (sweep at 2, 4, 8): 3 stages, shorter K tiles as the accumulators grow
        block_k, stages = (512 if block_m == 2 else 256), 3
        block_n = 4 if (gated or block_m >= 8) else 8
    block_k = min(block_k, max(64, triton.next_power_of_2(k)))
    if interpreting():  # the CPU interpreter runs programs one at a time: 8× fewer, wider ones take 9× less time
        block_n = max(block_n, 64)  # (the same code; tests/ops/test_gemv.py runs the GPU's narrow tiles explicitly)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, STAGES=stages)


def gemv(x, weight, bias, norm_weight, eps, residual, gated, *, use_pdl=None, config=None):
    """x [M, K] (unit K stride), weight [N_w, K] (unit K stride) → y [M, N] in x's dtype (N = N_w, or N_w / 2
    when gated)."""
    import torch

    m, k = x.shape
    n = weight.shape[0] // (2 if gated else 1)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:  # nothing to stream: the definition on empty sums
        from . import reference

        return reference.gemv(x, weight, bias, norm_weight, eps, residual, gated)
    cfg = dict(config or gemv_config(m, n, k, gated))
    pdl = pdl_enabled(x.device) if use_pdl is None else bool(use_pdl)
    launch = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias, norm_weight, residual, y,
        m, n, k, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        float(eps),
        HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        GATED=bool(gated), EVEN_K=k % cfg["BLOCK_K"] == 0, USE_PDL=pdl, INTERPRET=interpreting(), **cfg, **launch,
    )
    return y


def gemv_qkv(x, weight, bias, norm_weight, eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, n_q_heads,
             *, use_pdl=None, config=None):
    """q [M, Hq·D] in x's dtype; k and v of each row go to the caches at slot_mapping (see _gemv_qkv_kernel)."""
    import torch

    m, k = x.shape
    n_kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    q = torch.empty(m, n_q_heads * d, dtype=x.dtype, device=x.device)
    cfg = dict(config or gemv_config(m, weight.shape[0], k, False))
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], d)  # a program's pairs stay inside one head
    pdl = pdl_enabled(x.device) if use_pdl is None else bool(use_pdl)
    launch = {"launch_pdl": True} if pdl else {}
    grid = ((n_q_heads + 2 * n_kv_heads) * d // cfg["BLOCK_N"],)
    _gemv_qkv_kernel[grid](
        x, weight, bias, norm_weight, q, cos_sin_cache, positions, slot_mapping, k_cache, v_cache,
        m, k, x.stride(0), weight.stride(0), q.stride(0), cos_sin_cache.stride(0), *k_cache.stride()[:3],
        *v_cache.stride()[:3], n_q_heads, n_kv_heads, k_cache.shape[1], float(eps),
        HEAD_D=d, HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0,
        USE_PDL=pdl, INTERPRET=interpreting(), **cfg, **launch,
    )
    return q
