"""Triton kernel for rotary embeddings: rotates q and k in place, both in one launch.

A program owns BLOCK_T tokens × BLOCK_H heads of either q or k (the head blocks of q come first, then
those of k). It loads the cos/sin rows of its tokens once and uses them for all its heads, then reads
and writes each rotary element exactly once; the non-rotary tail of a head is never touched. With
~1024 pairs per program and tens of thousands of programs for a prefill, every SM keeps enough
bytes in flight to stream at HBM bandwidth. Token and head strides are free, so q
and k may be views into one fused qkv tensor.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, stride_t, stride_h, n_heads, head0, toks, tok_mask, cos, sin, half,
    IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotate heads head0 … head0 + BLOCK_H − 1 of the tokens `toks` in place; cos, sin: [BLOCK_T, 1, BLOCK_HALF]"""
    heads = head0 + tl.arange(0, BLOCK_H)
    base = x_ptr + toks[:, None, None] * stride_t + heads[None, :, None] * stride_h
    rows = tok_mask[:, None, None] & (heads < n_heads)[None, :, None]
    if IS_NEOX:  # pairs (j, j + R/2): two contiguous halves
        j = tl.arange(0, BLOCK_HALF)[None, None, :]
        mask = rows & (j < half)
        x1 = tl.load(base + j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + j + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + j, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + j + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    else:  # pairs (2j, 2j + 1): load the R dims whole and split them in registers, as stride-2 accesses
        # would not coalesce (10x slower on an H100)
        c = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        mask = rows & (c < 2 * half)
        x = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, BLOCK_HALF, 2)))
        y = tl.interleave(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        tl.store(base + c, y.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cache_ptr, pos_ptr,
    n_tokens, n_q_heads, n_k_heads, q_stride_t, q_stride_h, k_stride_t, k_stride_h, cache_stride, half,
    IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # A 1-D grid with the head block varying fastest: programs that run together share their tokens,
    # so the cos/sin rows come from L2 after the first read.
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    n_head_blocks = q_blocks + tl.cdiv(n_k_heads, BLOCK_H)
    pid = tl.program_id(0)
    hb = pid % n_head_blocks
    toks = (pid // n_head_blocks).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = toks < n_tokens

    pos = tl.load(pos_ptr + toks, mask=tok_mask, other=0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + pos[:, None] * cache_stride + j[None, :]
    cs_mask = tok_mask[:, None] & (j < half)[None, :]
    cos = tl.load(row, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(row + half, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]

    if hb < q_blocks:
        _rotate_heads(q_ptr, q_stride_t, q_stride_h, n_q_heads, hb * BLOCK_H, toks, tok_mask, cos, sin, half,
                      IS_NEOX, BLOCK_T, BLOCK_H, BLOCK_HALF)
    else:
        _rotate_heads(k_ptr, k_stride_t, k_stride_h, n_k_heads, (hb - q_blocks) * BLOCK_H, toks, tok_mask,
                      cos, sin, half, IS_NEOX, BLOCK_T, BLOCK_H, BLOCK_HALF)


def launch_config(n_tokens: int, n_q_heads: int, n_k_heads: int, half: int):
    """(BLOCK_T, BLOCK_H, BLOCK_HALF, num_warps) for about 1024 rotated pairs per program, 4 warps.

    Swept on an H100 at 8192 tokens × (32 + 8) heads × 128 (benchmarks/NOTES.md): one token × 16 heads
    per program streams 8% faster than 8 tokens × 8 heads, so heads fill a program before tokens do.
    Small (decode) batches take fewer tokens per program, so the grid still spreads over the SMs.
    """
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(n_q_heads, n_k_heads)), max(1, 1024 // block_half))
    block_t = min(triton.next_power_of_2(n_tokens), max(1, 1024 // (block_h * block_half)))
    head_blocks = triton.cdiv(n_q_heads, block_h) + triton.cdiv(n_k_heads, block_h)
    while block_t > 1 and triton.cdiv(n_tokens, block_t) * head_blocks < 264:
        block_t //= 2
    return block_t, block_h, block_half, 4


def apply_rotary(q, k, cos_sin_cache, positions, is_neox):
    """Rotate q [T, Hq, D] and k [T, Hk, D] (or None) in place; last dims have unit stride."""
    n_tokens, n_q_heads = q.shape[0], q.shape[1]
    n_k_heads = 0 if k is None else k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    if n_tokens == 0 or n_q_heads + n_k_heads == 0 or half == 0:
        return
    block_t, block_h, block_half, num_warps = launch_config(n_tokens, n_q_heads, n_k_heads, half)
    head_blocks = triton.cdiv(n_q_heads, block_h) + triton.cdiv(n_k_heads, block_h)
    grid = (triton.cdiv(n_tokens, block_t) * head_blocks,)
    k_arg = q if k is None else k  # with no k the grid has no k head blocks: q only stands in for the pointer
    _rotary_kernel[grid](
        q, k_arg, cos_sin_cache, positions,
        n_tokens, n_q_heads, n_k_heads, q.stride(0), q.stride(1), k_arg.stride(0), k_arg.stride(1),
        cos_sin_cache.stride(0), half,
        IS_NEOX=is_neox, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=num_warps,
    )
