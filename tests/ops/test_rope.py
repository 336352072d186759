"""Rotary embeddings: Triton kernel (interpreter) and reference vs float64 complex math; caches vs transformers."""

import math

import pytest
import torch

from lmkernels.ops.rope import apply_rotary, build_cos_sin_cache, kernels, reference, rope_frequencies
from tests.helpers import TOL, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (T, Hq, Hk, D, rotary_dim): odd token counts, GQA/MQA, partial rotary, a non-power-of-two half (40),
# head counts that do not fill a head block
SHAPES = [(1, 4, 1, 128, 128), (7, 8, 2, 128, 64), (33, 4, 4, 64, 32), (5, 3, 2, 80, 80)]


def float64_rotary(x, cache, positions, is_neox):
    """The definition written independently of reference.py: pairs as complex numbers times e^{iθ}, in float64."""
    r = cache.shape[-1]
    x = x.double()
    cos, sin = cache.double()[positions.long()].chunk(2, dim=-1)
    turn = torch.complex(cos, sin)[:, None, :]  # [T, 1, R/2], the same for every head
    xr = x[..., :r]
    if is_neox:
        z = torch.complex(xr[..., : r // 2], xr[..., r // 2 :]) * turn
        y = torch.cat((z.real, z.imag), dim=-1)
    else:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], r // 2, 2).contiguous()) * turn
        y = torch.view_as_real(z).flatten(-2)
    return torch.cat((y, x[..., r:]), dim=-1)


def random_angle_cache(max_position, rotary_dim, scale=1.0):
    """Angles uniform in [0, 2π) so that every pair turns by a sizeable angle (a real cache barely turns
    the low frequencies, which would hide an unwritten element); scale ≠ 1 as YaRN's attention factor."""
    angles = torch.rand(max_position, rotary_dim // 2, dtype=torch.float64) * 2 * math.pi
    return (torch.cat((angles.cos(), angles.sin()), dim=-1) * scale).float()


def make(shape, dtype, max_position=4096):
    n_tokens, hq, hk, d, r = shape
    q = torch.randn(n_tokens, hq, d, dtype=dtype)
    k = torch.randn(n_tokens, hk, d, dtype=dtype)
    positions = torch.randint(0, max_position, (n_tokens,))  # shuffled, as in a batched decode
    return q, k, build_cos_sin_cache(r, max_position), positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_kernel(shape, dtype, is_neox):
    q, k, cache, positions = make(shape, dtype)
    q_ref, k_ref = reference.apply_rotary(q, k, cache, positions, is_neox)
    q64, k64 = float64_rotary(q, cache, positions, is_neox), float64_rotary(k, cache, positions, is_neox)
    q_out, k_out = apply_rotary(q, k, cache, positions, is_neox=is_neox)
    assert q_out is q and k_out is k  # in place, the same tensors back
    for out, ref, f64 in ((q, q_ref, q64), (k, k_ref, k64)):
        assert out.dtype == dtype
        assert rel_err(out, f64) < TOL[dtype]
        assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("block_t,block_h", [(4, 2), (8, 1), (2, 8)])
@pytest.mark.parametrize("is_neox", [True, False])
def test_kernel_block_shapes(monkeypatch, block_t, block_h, is_neox):
    """Several tokens per program (a prefill's blocks; small CPU tests get one token per program), with
    token and head counts that leave the last token block and the last head blocks partly empty."""
    heuristic = kernels.launch_config

    def forced(n_tokens, n_q_heads, n_k_heads, half):
        return block_t, block_h, heuristic(n_tokens, n_q_heads, n_k_heads, half)[2], 4

    monkeypatch.setattr(kernels, "launch_config", forced)
    q, k, cache, positions = make((13, 5, 3, 96, 64), torch.bfloat16)
    q64, k64 = float64_rotary(q, cache, positions, is_neox), float64_rotary(k, cache, positions, is_neox)
    apply_rotary(q, k, cache, positions, is_neox=is_neox)
    assert rel_err(q, q64) < TOL[torch.bfloat16] and rel_err(k, k64) < TOL[torch.bfloat16]


def test_every_element_rotated():
    """Per element, in fp32, with large random angles: an unwritten or wrongly paired element fails."""
    n_tokens, hq, hk, d, r = 37, 5, 3, 96, 64
    cache = random_angle_cache(300, r, scale=1.3)
    positions = torch.randperm(300)[:n_tokens].int()
    for is_neox in (True, False):
        q, k = torch.randn(n_tokens, hq, d), torch.randn(n_tokens, hk, d)
        q0, k0 = q.clone(), k.clone()
        apply_rotary(q, k, cache, positions, is_neox=is_neox)
        for out, before in ((q, q0), (k, k0)):
            torch.testing.assert_close(out, float64_rotary(before, cache, positions, is_neox).float(),
                                       rtol=1e-5, atol=1e-5)
            assert (out[..., :r] != before[..., :r]).all()
            assert torch.equal(out[..., r:], before[..., r:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("d,r", [(128, 64), (64, 64)])
def test_fused_qkv_views(dtype, pos_dtype, d, r):
    """q and k are strided views into one qkv tensor; v and the non-rotary tails, poisoned with NaN,
    stay bit-identical and never leak into the rotated dims."""
    n_tokens, hq, hk = 9, 4, 2
    qkv = torch.randn(n_tokens, (hq + 2 * hk) * d, dtype=dtype)
    heads = qkv.view(n_tokens, hq + 2 * hk, d)
    heads[..., r:] = float("nan")
    heads[:, hq + hk :] = float("nan")  # v
    q, k = qkv[:, : hq * d].view(n_tokens, hq, d), qkv[:, hq * d : (hq + hk) * d].view(n_tokens, hk, d)
    before = qkv.clone()
    cache = random_angle_cache(64, r)
    positions = torch.randint(0, 64, (n_tokens,), dtype=pos_dtype)
    apply_rotary(q, k, cache, positions)
    after = qkv.view(n_tokens, hq + 2 * hk, d)
    want = float64_rotary(before.view(n_tokens, hq + 2 * hk, d)[:, : hq + hk], cache, positions, True)
    assert rel_err(after[:, : hq + hk, :r], want[..., :r]) < TOL[dtype]
    untouched = before.view(n_tokens, hq + 2 * hk, d)
    torch.testing.assert_close(after[..., r:], untouched[..., r:], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(after[:, hq + hk :], untouched[:, hq + hk :], rtol=0, atol=0, equal_nan=True)


def test_strided_heads_k_none_and_cache_in_q_dtype():
    """Every other head of a wider tensor (head stride 2·D), no k, and a bf16 cache."""
    wide = torch.randn(6, 8, 64, dtype=torch.bfloat16)
    q = wide[:, ::2]
    skipped = wide[:, 1::2].clone()
    cache = build_cos_sin_cache(64, 128, dtype=torch.bfloat16)
    positions = torch.tensor([127, 0, 5, 64, 3, 99])
    want = float64_rotary(q, cache, positions, False)
    q_out, k_out = apply_rotary(q, None, cache, positions, is_neox=False)
    assert k_out is None and q_out is q
    assert rel_err(wide[:, ::2], want) < TOL[torch.bfloat16]
    assert torch.equal(wide[:, 1::2], skipped)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_reference_matches_float64(dtype, is_neox):
    q, k, cache, positions = make((11, 4, 2, 128, 96), dtype)
    q_ref, k_ref = reference.apply_rotary(q, k, cache, positions, is_neox)
    assert rel_err(q_ref, float64_rotary(q, cache, positions, is_neox)) < TOL[dtype]
    assert rel_err(k_ref, float64_rotary(k, cache, positions, is_neox)) < TOL[dtype]
    assert reference.apply_rotary(q, None, cache, positions, is_neox)[1] is None


def test_cpu_reference_path(monkeypatch):
    """Without the interpreter a CPU tensor runs the reference, in place too."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, cache, positions = make((5, 2, 1, 64, 64), torch.float32)
    want = float64_rotary(q, cache, positions, True)
    apply_rotary(q, k, cache, positions)
    assert rel_err(q, want) < TOL[torch.float32]


def test_empty():
    q, k = torch.randn(0, 4, 64), torch.randn(0, 1, 64)
    apply_rotary(q, k, build_cos_sin_cache(64, 16), torch.zeros(0, dtype=torch.int64))


def test_launch_config():
    """Programs hold about 1024 pairs, heads first; a small batch still gets many programs."""
    assert kernels.launch_config(8192, 32, 8, 64) == (1, 16, 64, 4)
    assert kernels.launch_config(8192, 4, 1, 64) == (4, 4, 64, 4)
    block_t, block_h, _, _ = kernels.launch_config(256, 4, 1, 64)
    assert block_t * block_h * 64 <= 1024 and 256 // block_t * 2 >= 264


# --- caches vs transformers -------------------------------------------------------------------------------------

CACHE_CASES = [
    (64, 10000.0, None),
    (64, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    (64, 10000.0, {"type": "linear", "factor": 2.0}),  # legacy key
    (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}),
    (128, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen
    (64, 10000.0, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,  # DeepSeek-V3
                   "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}),
    (64, 10000.0, {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096}),
    (64, 150000.0, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,  # gpt-oss
                    "original_max_position_embeddings": 4096, "truncate": False}),
    (64, 10000.0, {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.9,
                   "original_max_position_embeddings": 2048}),
]


@pytest.mark.parametrize("rotary_dim,base,rope_scaling", CACHE_CASES)
def test_cache_matches_transformers(rotary_dim, base, rope_scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {k: v for k, v in (rope_scaling or {}).items() if k != "type"}
    params["rope_type"] = (rope_scaling or {}).get("type", params.get("rope_type", "default"))
    params["rope_theta"] = base
    factor = params.get("factor", 1.0)
    original = params.get("original_max_position_embeddings", 2048)
    config = transformers.LlamaConfig(  # the model's own context, so HF's consistency checks stay quiet
        hidden_size=4 * rotary_dim, num_attention_heads=4, head_dim=rotary_dim,
        max_position_embeddings=int(original * factor), rope_parameters=params,
    )
    hf = LlamaRotaryEmbedding(config)
    theta, attention_factor = rope_frequencies(rotary_dim, 2048, base, rope_scaling)
    torch.testing.assert_close(theta, hf.inv_freq.double(), rtol=1e-6, atol=0)  # HF's are fp32
    assert attention_factor == pytest.approx(hf.attention_scaling, rel=1e-12)

    n = 2048
    cache = build_cos_sin_cache(rotary_dim, n, base, rope_scaling)
    cos, sin = hf(torch.zeros(1), torch.arange(n)[None])
    half = rotary_dim // 2
    # HF's fp32 angles p·θ are off by up to p·θ·6e-8 rad: 2e-4 at p = 2048 (ours are exact)
    torch.testing.assert_close(cache, torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1), rtol=0, atol=5e-4)


def test_cache_layout_dtype_and_yarn_scale():
    cache = build_cos_sin_cache(8, 10, 100.0, {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16}, dtype=torch.bfloat16)
    assert cache.shape == (10, 8) and cache.dtype == torch.bfloat16
    scale = 0.1 * math.log(4.0) + 1
    # cos² + sin² = attention_factor², and position 0 is [1 … | 0 …] · attention_factor
    norm2 = cache.double()[:, :4] ** 2 + cache.double()[:, 4:] ** 2
    torch.testing.assert_close(norm2, torch.full_like(norm2, scale**2), rtol=1e-2, atol=0)
    assert torch.equal(cache[0].float(), torch.tensor([scale] * 4 + [0.0] * 4, dtype=torch.bfloat16).float())


# --- bad inputs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda q, k, c, p: apply_rotary(q.long(), k, c, p), TypeError, "q must have dtype"),
        (lambda q, k, c, p: apply_rotary(q[0], k, c, p), ValueError, "q must have 3 dimensions"),
        (lambda q, k, c, p: apply_rotary(q, k.half(), c, p), TypeError, "k must have dtype"),
        (lambda q, k, c, p: apply_rotary(q, k[:-1], c, p), ValueError, "k must have shape"),
        (lambda q, k, c, p: apply_rotary(q, k[..., :32], c[:, :32], p), ValueError, "k must have shape"),
        (lambda q, k, c, p: apply_rotary(q, k, c, p[:-1]), ValueError, "positions must have shape"),
        (lambda q, k, c, p: apply_rotary(q, k, c, p.float()), TypeError, "positions must have dtype"),
        (lambda q, k, c, p: apply_rotary(q, k, c[0], p), ValueError, "cos_sin_cache must have 2 dimensions"),
        (lambda q, k, c, p: apply_rotary(q, k, c[:, :31], p), ValueError, "rotary_dim"),
        (lambda q, k, c, p: apply_rotary(q, k, torch.cat((c, c), 1), p), ValueError, "rotary_dim"),
        (lambda q, k, c, p: apply_rotary(q, k, c.half(), p), TypeError, "cos_sin_cache must have dtype"),
        (lambda q, k, c, p: apply_rotary(q, k, c[:, ::2], p), ValueError, "cos_sin_cache must be contiguous"),
        (lambda q, k, c, p: apply_rotary(q, k, c, p.to("meta")), ValueError, "positions is on meta"),
        (lambda q, k, c, p: apply_rotary(q, k.to("meta"), c, p), ValueError, "k is on meta"),
        (lambda q, k, c, p: apply_rotary(torch.randn(5, 4, 128)[..., ::2], k, c, p), ValueError,
         "q must be contiguous"),
        (lambda q, k, c, p: apply_rotary(q, torch.randn(5, 2, 128)[..., ::2], c, p), ValueError,
         "k must be contiguous"),
        (lambda q, k, c, p: apply_rotary(q, k, c, p + 6), ValueError, "positions must lie in"),
        (lambda q, k, c, p: apply_rotary(q, k, c, p - 16), ValueError, "positions must lie in"),
        (lambda q, k, c, p: apply_rotary("q", k, c, p), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_inputs(call, exc, match):
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    cache, positions = build_cos_sin_cache(64, 20), torch.arange(5) + 10
    q0 = q.clone()
    with pytest.raises(exc, match=match):
        call(q, k, cache, positions)
    assert torch.equal(q, q0)  # nothing ran


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rotary_dim": 63}, "rotary_dim"),
        ({"max_position": 0}, "max_position"),
        ({"base": 0.5}, "base"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, "high_freq_factor"),
        ({"rope_scaling": {"rope_type": "default", "rope_theta": 500000.0}}, "rope_theta"),
    ],
)
def test_bad_cache_arguments(kwargs, match):
    args = {"rotary_dim": 64, "max_position": 16, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_cos_sin_cache(**args)


def test_torch_compile_fullgraph():
    """Rotating views of a fused qkv inside a compiled function traces as one graph and gives the eager result."""
    hq, hk, d = 4, 2, 64

    def attention_inputs(qkv, cache, positions):
        q = qkv[:, : hq * d].view(-1, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].view(-1, hk, d)
        apply_rotary(q, k, cache, positions)
        return qkv * 2

    cache = build_cos_sin_cache(32, 64)
    qkv, positions = torch.randn(7, (hq + 2 * hk) * d), torch.randint(0, 64, (7,))
    eager_qkv, compiled_qkv = qkv.clone(), qkv.clone()
    eager = attention_inputs(eager_qkv, cache, positions)
    compiled = torch.compile(attention_inputs, fullgraph=True, backend="aot_eager")(compiled_qkv, cache, positions)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_qkv, eager_qkv)  # the mutation reached the caller's tensor
