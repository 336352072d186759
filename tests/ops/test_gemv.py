"""The decode-time linear layer (gemv with fused RMSNorm / bias / SwiGLU / residual): Triton kernel through the
interpreter and the reference, against float64 math."""

import pytest
import torch
import torch.nn.functional as F

from lmkernels.ops.gemv import gemv, gemv_qkv, reference
from lmkernels.ops.gemv import kernels
from tests.helpers import TOL, rel_err


def float64_gemv(x, w, bias=None, g=None, eps=1e-6, residual=None, gated=False):
    a = x.double()
    if g is not None:
        a = a / torch.sqrt(a.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    y = a @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    if gated:
        gate, up = y.chunk(2, -1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.double()
    return y


def make(m, n, k, dtype, *, gated=False, bias=False, norm=False, residual=False):
    x = torch.randn(m, k, dtype=dtype) * 2 + 0.3
    w = (torch.randn(n * (2 if gated else 1), k) / k ** 0.5).to(dtype)
    return dict(
        x=x, weight=w,
        bias=(0.5 * torch.randn(w.shape[0])).to(dtype) if bias else None,
        norm_weight=(torch.rand(k) + 0.5).to(dtype) if norm else None,
        residual=torch.randn(m, n).to(dtype) if residual else None,
        gated=gated,
    )


def call(c, eps=1e-6):
    return gemv(c["x"], c["weight"], c["bias"], norm_weight=c["norm_weight"], eps=eps, residual=c["residual"],
                gated=c["gated"])


def expected(c, eps=1e-6):
    return float64_gemv(c["x"], c["weight"], c["bias"], c["norm_weight"], eps, c["residual"], c["gated"])


FUSIONS = {
    "plain": {},
    "norm": dict(norm=True),
    "norm+gated": dict(norm=True, gated=True),
    "residual": dict(residual=True),
    "all": dict(norm=True, gated=True, bias=True, residual=True),
    "bias": dict(bias=True),
}
# (M, N, K): N and K not multiples of the tiles, K shorter than one tile, one row and several
SHAPES = [(1, 40, 300), (1, 64, 1024), (3, 24, 1000), (8, 9, 130), (2, 1, 64), (5, 33, 17)]


@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_float64(fusion, shape, monkeypatch):
    m, n, k = shape
    c = make(m, n, k, torch.float16, **FUSIONS[fusion])
    empty = torch.empty  # poison: an output element the kernel does not write stays NaN and fails
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    y = call(c)
    monkeypatch.undo()
    assert y.shape == (m, n) and y.dtype == torch.float16
    assert rel_err(y, expected(c)) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes(dtype):
    """No tensor-core dot in this kernel, so bf16 runs correctly through the interpreter too."""
    c = make(2, 48, 700, dtype, norm=True, gated=True, residual=True)
    assert rel_err(call(c), expected(c)) < TOL[dtype]


@pytest.mark.parametrize("config", [dict(BLOCK_N=16, BLOCK_K=64), dict(BLOCK_N=4, BLOCK_K=128)])
def test_launch_configs(config):
    """Several K tiles with and without a ragged last tile, and other row blocks, give the same function."""
    for k in (256, 300):
        c = make(1, 37, k, torch.float32, norm=True, gated=True, bias=True)
        full = dict(BLOCK_M=1, num_warps=2, STAGES=2, **config)
        y = kernels.gemv(c["x"], c["weight"], c["bias"], c["norm_weight"], 1e-6, None, True, config=full)
        assert rel_err(y, expected(c)) < TOL[torch.float32]


def test_strided_rows_and_eps():
    x = torch.randn(3, 900)[:, 100:612]  # row stride 900
    w = torch.randn(20, 512) / 20
    g = torch.rand(512) + 0.5
    y = gemv(x, w, norm_weight=g, eps=0.5)
    assert rel_err(y, float64_gemv(x, w, g=g, eps=0.5)) < TOL[torch.float32]
    assert rel_err(y, float64_gemv(x, w, g=g, eps=1e-6)) > 1e-3  # eps reaches the kernel


def test_reference_matches_float64():
    c = make(4, 30, 200, torch.float32, norm=True, gated=True, bias=True, residual=True)
    ref = reference.gemv(c["x"], c["weight"], c["bias"], c["norm_weight"], 1e-6, c["residual"], True)
    assert rel_err(ref, expected(c)) < TOL[torch.float32]


def test_gate_is_the_first_half(monkeypatch):
    """A swapped gate/up would pass a test that only checks finite output: it fails this one."""
    c = make(1, 32, 256, torch.float32, gated=True)
    swapped = dict(c, weight=torch.cat(c["weight"].chunk(2, 0)[::-1]))
    assert rel_err(call(c), expected(swapped)) > 0.1


def test_cpu_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    c = make(2, 16, 128, torch.float32, norm=True, residual=True)
    assert rel_err(call(c), expected(c)) < TOL[torch.float32]


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(9, 64)), "1 to 8 rows"),
    (dict(x=torch.randn(64)), "x must have 2 dimensions"),
    (dict(weight=torch.randn(16, 63)), "weight must have shape"),
    (dict(weight=torch.randn(16, 64).half()), "weight must have dtype"),
    (dict(weight=torch.randn(15, 64), gated=True), "even number of rows"),
    (dict(weight=torch.randn(64, 16).t()), "weight must be contiguous"),
    (dict(norm_weight=torch.rand(65)), "norm_weight must have shape"),
    (dict(residual=torch.randn(2, 17)), "residual must have shape"),
    (dict(bias=torch.randn(8)), "bias must have shape"),
    (dict(eps=0.0), "eps must be a positive"),
])
def test_bad_input(bad, match):
    args = dict(x=torch.randn(2, 64), weight=torch.randn(16, 64), bias=None, norm_weight=None, residual=None,
                gated=False, eps=1e-6)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        gemv(args.pop("x"), args.pop("weight"), args.pop("bias"), **args)


# ---------------------------------------------------------------------------------------------------------------
# gemv_qkv: projection + NeoX rotary + paged cache write


def float64_qkv(x, w, bias, g, eps, cos_sin, positions, hq, hk, d):
    y = float64_gemv(x, w, bias, g, eps)
    q, k, v = y.split([hq * d, hk * d, hk * d], -1)
    cos, sin = cos_sin.double()[positions].chunk(2, -1)

    def rotate(t):
        t1, t2 = t.reshape(len(x), -1, d).chunk(2, -1)
        return torch.cat((t1 * cos[:, None] - t2 * sin[:, None], t2 * cos[:, None] + t1 * sin[:, None]), -1)

    return rotate(q).reshape(len(x), -1), rotate(k), v.reshape(len(x), hk, d)


@pytest.mark.parametrize("m, hq, hk, d, bias, config", [
    (1, 4, 2, 32, False, None),
    (3, 4, 1, 16, True, None),
    (2, 2, 2, 64, False, dict(BLOCK_M=2, BLOCK_N=16, BLOCK_K=64, num_warps=2, STAGES=2)),
])
def test_qkv_rotary_cache_write(m, hq, hk, d, bias, config, monkeypatch):
    k_dim, page_size, pages = 200, 4, 6
    dt = torch.float16
    x = torch.randn(m, k_dim, dtype=dt)
    w = (torch.randn((hq + 2 * hk) * d, k_dim) / k_dim ** 0.5).to(dt)
    b = (0.3 * torch.randn(w.shape[0])).to(dt) if bias else None
    g = torch.rand(k_dim) + 0.5
    angles = torch.arange(50.0)[:, None] * torch.rand(d // 2)[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
    positions = torch.randint(0, 50, (m,))
    slots = torch.randperm(pages * page_size)[:m]
    if m > 1:
        slots[1] = -1  # a padding row: nothing stored
    k_cache = torch.full((pages, page_size, hk, d), 7.0, dtype=dt)
    v_cache = torch.full_like(k_cache, 7.0)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    args = (x, w, b, g, 1e-6, cos_sin, positions, k_cache, v_cache, slots, hq)
    if config is None:
        q = gemv_qkv(x, w, b, norm_weight=g, eps=1e-6, num_heads=hq, cos_sin_cache=cos_sin, positions=positions,
                     k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    else:
        q = kernels.gemv_qkv(*args, config=config)
    monkeypatch.undo()
    want_q, want_k, want_v = float64_qkv(x, w, b, g, 1e-6, cos_sin, positions, hq, hk, d)
    assert q.shape == (m, hq * d) and rel_err(q, want_q) < TOL[dt]
    written = torch.zeros(pages * page_size, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            written[s] = True
            page, row = divmod(s, page_size)
            assert rel_err(k_cache[page, row], want_k[i]) < TOL[dt]
            assert rel_err(v_cache[page, row], want_v[i]) < TOL[dt]
    untouched = ~written.view(pages, page_size)
    assert (k_cache[untouched] == 7.0).all() and (v_cache[untouched] == 7.0).all()


def test_qkv_reference_matches_float64():
    m, hq, hk, d = 2, 4, 2, 16
    x = torch.randn(m, 64)
    w = torch.randn((hq + 2 * hk) * d, 64) / 8
    angles = torch.arange(10.0)[:, None] * torch.rand(d // 2)[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
    positions, slots = torch.tensor([3, 9]), torch.tensor([5, 0])
    k_cache, v_cache = torch.zeros(2, 4, hk, d), torch.zeros(2, 4, hk, d)
    q = reference.gemv_qkv(x, w, None, None, 1e-6, cos_sin, positions, k_cache, v_cache, slots, hq)
    want_q, want_k, want_v = float64_qkv(x, w, None, None, 1e-6, cos_sin, positions, hq, hk, d)
    assert rel_err(q, want_q) < TOL[torch.float32]
    assert rel_err(k_cache[1, 1], want_k[0]) < TOL[torch.float32] and rel_err(v_cache[0, 0], want_v[1]) < 1e-5


@pytest.mark.parametrize("bad, match", [
    (dict(num_heads=3), "multiple of the cache's 2 kv heads"),
    (dict(weight=torch.randn(100, 64)), "rows"),
    (dict(cos_sin_cache=torch.randn(20, 8)), "full head dim"),
    (dict(positions=torch.tensor([0, 25])), "positions must lie"),
    (dict(slot_mapping=torch.tensor([0, 64])), "slot_mapping must lie"),
    (dict(k_cache=torch.zeros(4, 4, 2, 16).half()), "k_cache must have dtype"),
])
def test_qkv_bad_input(bad, match):
    args = dict(x=torch.randn(2, 64), weight=torch.randn(8 * 16, 64), norm_weight=None, num_heads=4,
                cos_sin_cache=torch.randn(20, 16), positions=torch.tensor([0, 3]), k_cache=torch.zeros(4, 4, 2, 16),
                v_cache=torch.zeros(4, 4, 2, 16), slot_mapping=torch.tensor([1, -1]))
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        gemv_qkv(args.pop("x"), args.pop("weight"), **args)


def test_torch_compile_fullgraph():
    """Both ops trace as custom ops (fake implementations give the shapes; gemv_qkv declares its cache writes)."""
    c = make(2, 24, 64, torch.float32, norm=True, gated=True, residual=True)
    hq, hk, d = 2, 1, 16
    wqkv = torch.randn((hq + 2 * hk) * d, 24) / 5
    angles = torch.arange(8.0)[:, None] * torch.rand(d // 2)[None, :]
    cs = torch.cat((angles.cos(), angles.sin()), -1)
    pos, slots = torch.tensor([1, 6]), torch.tensor([3, 0])

    def step(x, w, g, r, kc, vc):
        h = gemv(x, w, norm_weight=g, residual=r, gated=True)
        return gemv_qkv(h, wqkv, num_heads=hq, cos_sin_cache=cs, positions=pos, k_cache=kc, v_cache=vc,
                        slot_mapping=slots)

    caches = [torch.zeros(2, 4, hk, d) for _ in range(4)]
    args = (c["x"], c["weight"], c["norm_weight"], c["residual"])
    want = step(*args, caches[0], caches[1])
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args, caches[2], caches[3])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(caches[2], caches[0])
    torch.testing.assert_close(caches[3], caches[1])
