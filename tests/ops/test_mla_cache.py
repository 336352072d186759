"""MLA latent-cache write (fused RMSNorm + interleaved RoPE + paged store) against the float64 reference."""

import pytest
import torch

from lmkernels.ops.mla import new_latent_cache, reference, write_latent_cache
from lmkernels.ops.rope import build_cos_sin_cache

YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _inputs(n, dtype, max_pos=300):
    kv = torch.randn(n, 576 + 8, dtype=dtype)[:, :576]  # a strided view, as a slice of a fused projection
    weight = (1 + 0.1 * torch.randn(512)).to(dtype)
    cs = build_cos_sin_cache(64, max_pos, 10000.0, YARN)
    positions = torch.randint(0, max_pos, (n,))
    return kv, weight, cs, positions


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_write_matches_reference(page, dtype):
    n = 37
    kv, weight, cs, positions = _inputs(n, dtype)
    num_pages = -(-(n + 5) // page) + 1
    cache, _ = new_latent_cache(num_pages, page, dtype=dtype)
    cache.fill_(float("nan"))
    slots = torch.randperm(num_pages * page)[:n]
    slots[3] = -1  # a padding token: its slot stays untouched
    write_latent_cache(kv, weight, cs, positions, slots, cache, eps=1e-6)
    want = reference.latent_rows(kv, weight, cs, positions, 1e-6)
    flat = cache.view(-1, 576)
    keep = slots >= 0
    got = flat[slots[keep]].double()
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    err = (got - want[keep]).norm() / want[keep].norm()
    assert err < tol, err
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[slots[keep]] = True
    assert torch.isnan(flat[~written].float()).all()  # nothing else written


def test_rope_is_interleaved_deepseek_style():
    """The rope part equals lmkernels' GPT-J (interleaved) rotary applied to k_pe: q_pe rotated that way
    gives the same scores."""
    from lmkernels.ops.rope import reference as rope_ref

    kv, weight, cs, positions = _inputs(9, torch.float32)
    rows = reference.latent_rows(kv, weight, cs, positions, 1e-6)
    pe = rope_ref.rotate(kv[:, None, 512:].contiguous(), cs, positions, is_neox=False)[:, 0]
    torch.testing.assert_close(rows[:, 512:].float(), pe, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("page", [1, 16])
def test_write_fp8(page):
    n = 21
    kv, weight, cs, positions = _inputs(n, torch.float16)
    kv[4, :128] = 0  # an all-zero group: scale 1
    num_pages = -(-n // page) + 2
    cache, scales = new_latent_cache(num_pages, page, dtype=torch.float8_e4m3fn)
    scales.fill_(float("nan"))
    slots = torch.randperm(num_pages * page)[:n]
    write_latent_cache(kv, weight, cs, positions, slots, cache, cache_scales=scales)
    rows = reference.latent_rows(kv, weight, cs, positions, 1e-6)
    # the kernel's fp16-free fp32 math may round differently from float64 only at exact e4m3 midpoints
    want_v, want_s = reference.quantize_rows(rows.float())
    got_v = cache.view(-1, 576)[slots].float()
    got_s = scales.view(-1, 5)[slots]
    torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=0)
    assert got_s[4, 0] == 1.0
    mismatch = (got_v != want_v.float()).float().mean()
    assert mismatch < 1e-3, mismatch
    deq = reference.dequantize_rows(cache.view(-1, 576)[slots], got_s).double()
    err = (deq - rows).norm() / rows.norm()
    assert err < 4e-2, err  # e4m3: 3 mantissa bits


def test_write_bad_inputs():
    kv, weight, cs, positions = _inputs(4, torch.float16)
    cache, _ = new_latent_cache(2, 4, dtype=torch.float16)
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="kv"):
        write_latent_cache(kv[:, :512], weight, cs, positions, slots, cache)
    with pytest.raises(ValueError, match="latent_cache"):
        write_latent_cache(kv, weight, cs, positions, slots, torch.zeros(2, 4, 512, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight"):
        write_latent_cache(kv, weight[:64], cs, positions, slots, cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        write_latent_cache(kv, weight, cs[:, :32], positions, slots, cache)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_latent_cache(kv, weight, cs, positions, torch.tensor([0, 1, 2, 8]), cache)
    with pytest.raises(ValueError, match="positions"):
        write_latent_cache(kv, weight, cs, torch.tensor([0, 1, 2, 300]), slots, cache)
    fp8, _ = new_latent_cache(2, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cache_scales"):
        write_latent_cache(kv, weight, cs, positions, slots, fp8)
    with pytest.raises(TypeError, match="slot_mapping"):
        write_latent_cache(kv, weight, cs, positions, slots.float(), cache)
