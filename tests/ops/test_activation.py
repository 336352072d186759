"""SwiGLU / GeGLU on [gate | up]: Triton kernel (interpreter) and reference vs float64 math."""

import math

import pytest
import torch

from lmkernels.ops.activation import gelu_and_mul, reference, silu_and_mul
from tests.helpers import TOL, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 2 * 576), (7, 2 * 2304), (3, 5, 2 * 1000), (4, 2 * 4100), (2, 2)]


def float64_gated(x, act):
    g, u = x.double().chunk(2, dim=-1)
    if act == "silu":
        a = g / (1 + torch.exp(-g))
    elif act == "tanh":
        a = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    else:
        a = 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))
    return a * u


OPS = {
    "silu": silu_and_mul,
    "tanh": lambda x: gelu_and_mul(x, "tanh"),
    "erf": lambda x: gelu_and_mul(x, "none"),
}


@pytest.mark.parametrize("act", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel(act, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    y = OPS[act](x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    assert rel_err(y, float64_gated(x, act)) < TOL[dtype]


def test_forms_differ_and_gate_is_first_half():
    """Catch a swapped gate/up or a tanh/erf mix-up: those give errors far above the tolerance."""
    x = torch.randn(4, 512) * 3
    assert rel_err(gelu_and_mul(x, "tanh"), float64_gated(x, "erf")) > 5 * TOL[torch.float32]
    swapped = torch.cat(x.chunk(2, -1)[::-1], -1)
    assert rel_err(silu_and_mul(x), float64_gated(swapped, "silu")) > 0.1


def test_strided_rows_and_poisoned_output(monkeypatch):
    x = torch.randn(5, 3000)[:, 200:2200]
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    y = silu_and_mul(x)
    monkeypatch.undo()
    assert rel_err(y, float64_gated(x, "silu")) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", list(OPS))
def test_reference_matches_float64(dtype, act):
    x = torch.randn(6, 2 * 300, dtype=dtype) * 3
    y = reference.silu_and_mul(x) if act == "silu" else reference.gelu_and_mul(x, "tanh" if act == "tanh" else "none")
    assert rel_err(y, float64_gated(x, act)) < TOL[dtype]


def test_empty_rows():
    assert silu_and_mul(torch.randn(0, 8)).shape == (0, 4)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: silu_and_mul(torch.randn(4, 7)), ValueError, "even"),
        (lambda: silu_and_mul(torch.randn(4, 0)), ValueError, "even"),
        (lambda: silu_and_mul(torch.randint(0, 3, (4, 8))), TypeError, "x must have dtype"),
        (lambda: silu_and_mul(torch.randn(8, 4).t()), ValueError, "x must be contiguous"),
        (lambda: gelu_and_mul(torch.randn(4, 8), "erf"), ValueError, "approximate"),
        (lambda: silu_and_mul(None), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_torch_compile_fullgraph():
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(32, 2 * 48)
            self.down = torch.nn.Linear(48, 32)

        def forward(self, x):
            return self.down(silu_and_mul(self.up(x))) + self.down(gelu_and_mul(self.up(x)))

    mlp = MLP().eval()
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(mlp, fullgraph=True, backend="aot_eager")(x), mlp(x))
