"""RMSNorm / LayerNorm (+residual, +GeLU): Triton kernels (interpreter) and reference vs float64 math."""

import math

import pytest
import torch

from lmkernels.ops.norm import layer_norm, layer_norm_gelu, reference, rms_norm
from tests.helpers import TOL, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 576), (7, 2304), (33, 5120), (3, 4, 96), (2, 1)]


def float64_norm(x, weight, bias, eps, kind, weight_offset=0.0, gelu="none"):
    """The definition written independently of reference.py, in float64."""
    x = x.double()
    if kind == "rms":
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    else:
        c = x - x.mean(-1, keepdim=True)
        y = c / torch.sqrt((c * c).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.double() + weight_offset)
    if bias is not None:
        y = y + bias.double()
    if gelu == "tanh":
        y = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
    elif gelu == "erf":
        y = 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
    return y


def make(shape, dtype, residual=True):
    x = torch.randn(shape, dtype=dtype) * 2 + 0.5  # non-zero mean so LayerNorm's centring matters
    res = torch.randn(shape, dtype=dtype) if residual else None
    w = torch.rand(shape[-1]) + 0.5
    b = torch.randn(shape[-1])
    return x, res, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel(shape, dtype, with_residual):
    x, res, w, _ = make(shape, dtype, with_residual)
    out = rms_norm(x, w, 1e-6, res)
    if with_residual:
        y, r = out
        r64 = x.double() + res.double()
        assert rel_err(r, r64) < TOL[dtype]
        ref = float64_norm(r.double(), w, None, 1e-6, "rms")  # the norm of the sum the caller keeps
    else:
        y, ref = out, float64_norm(x, w, None, 1e-6, "rms")
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gemma_offset_and_no_weight(dtype):
    x, _, w, _ = make((5, 640), dtype, False)
    assert rel_err(rms_norm(x, w, 1e-6, weight_offset=1.0), float64_norm(x, w, None, 1e-6, "rms", 1.0)) < TOL[dtype]
    assert rel_err(rms_norm(x, None, 1e-6), float64_norm(x, None, None, 1e-6, "rms")) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_kernel(shape, dtype):
    x, res, w, b = make(shape, dtype)
    y, r = layer_norm(x, w, b, 1e-5, res)
    assert rel_err(r, x.double() + res.double()) < TOL[dtype]
    assert rel_err(y, float64_norm(r, w, b, 1e-5, "layer")) < TOL[dtype]
    y = layer_norm(x, None, None, 1e-5)
    assert rel_err(y, float64_norm(x, None, None, 1e-5, "layer")) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate,form", [("tanh", "tanh"), ("none", "erf")])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_gelu_kernel(dtype, approximate, form, with_residual):
    x, res, w, b = make((9, 1000), dtype, with_residual)
    out = layer_norm_gelu(x, w, b, 1e-5, res, approximate=approximate)
    y, base = (out[0], out[1]) if with_residual else (out, x)
    assert rel_err(y, float64_norm(base, w, b, 1e-5, "layer", gelu=form)) < TOL[dtype]


def test_gelu_forms_differ():
    """The tanh and erf forms must not be confused: on these inputs they differ by more than the tolerance."""
    x, _, w, b = make((4, 256), torch.float32, False)
    y_tanh = layer_norm_gelu(x, w, b, approximate="tanh")
    assert rel_err(y_tanh, float64_norm(x, w, b, 1e-5, "layer", gelu="erf")) > 10 * TOL[torch.float32]


def test_strided_rows_and_poisoned_outputs(monkeypatch):
    """Rows with a stride (a slice of a wider tensor) work, and every output element is written."""
    wide = torch.randn(6, 3000)
    x = wide[:, 100:2100]
    res = torch.randn(6, 4000)[:, :2000]
    w = torch.randn(2000)
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))
    y, r = rms_norm(x, w, 1e-6, res)
    monkeypatch.undo()
    assert rel_err(y, float64_norm(x.double() + res.double(), w, None, 1e-6, "rms")) < TOL[torch.float32]
    assert torch.equal(r, x + res)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_float64(dtype):
    x, res, w, b = make((4, 333), dtype)
    y, r = reference.norm(x, res, w, None, 1e-6, "rms", 1.0)
    assert rel_err(y, float64_norm(r, w, None, 1e-6, "rms", 1.0)) < TOL[dtype]
    y = reference.norm(x, None, w, b, 1e-5, "layer", gelu="erf")
    assert rel_err(y, float64_norm(x, w, b, 1e-5, "layer", gelu="erf")) < TOL[dtype]


def test_empty_rows():
    x = torch.randn(0, 64)
    y, r = rms_norm(x, torch.ones(64), residual=torch.randn(0, 64))
    assert y.shape == (0, 64) and r.shape == (0, 64)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda x, w: rms_norm(x.long(), w), TypeError, "x must have dtype"),
        (lambda x, w: rms_norm(x, w[:-1]), ValueError, "weight must have shape"),
        (lambda x, w: rms_norm(x, w.int()), TypeError, "weight must have dtype"),
        (lambda x, w: rms_norm(x, w, residual=x[:, :-1]), ValueError, "residual must have shape"),
        (lambda x, w: rms_norm(x, w, residual=x.half()), TypeError, "residual must have dtype"),
        (lambda x, w: rms_norm(x.t(), torch.ones(8)), ValueError, "x must be contiguous"),
        (lambda x, w: rms_norm(x, w, eps=-1.0), ValueError, "eps"),
        (lambda x, w: rms_norm(x, w.to("meta")), ValueError, "weight is on meta"),
        (lambda x, w: layer_norm(x, w, torch.ones(3)), ValueError, "bias must have shape"),
        (lambda x, w: layer_norm_gelu(x, w, None, approximate="erf"), ValueError, "approximate"),
        (lambda x, w: rms_norm(torch.randn(4, 0), None), ValueError, "last dimension"),
        (lambda x, w: rms_norm("x", w), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_inputs(call, exc, match):
    x, w = torch.randn(8, 16), torch.ones(16)
    with pytest.raises(exc, match=match):
        call(x, w)


def test_torch_compile_fullgraph():
    """A pre-norm block built from the ops traces as one graph and gives the eager result."""

    class Block(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(n) + 0.5)
            self.b = torch.nn.Parameter(torch.randn(n))

        def forward(self, x, res):
            y, r = rms_norm(x, self.w, 1e-6, res)
            return layer_norm_gelu(y, self.w, self.b) + r

    block = Block(48).eval()
    x, res = torch.randn(5, 48), torch.randn(5, 48)
    with torch.no_grad():
        eager = block(x, res)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, res)
    torch.testing.assert_close(compiled, eager)
