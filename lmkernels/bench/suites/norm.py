"""RMSNorm (± residual), LayerNorm and LayerNorm+GeLU, bf16, against torch eager, torch.compile and Liger."""

import torch

from .. import peers
from ..counts import norm_bytes
from .. import harness
from ..harness import Case, Impl, run_cases

DTYPE = torch.bfloat16
TOKENS = (4096, 16384, 32768)
HIDDEN = (2048, 4096, 8192)
ODD = ((16384, 5120), (16384, 7168))  # hidden sizes that are not powers of two
QUICK = ((4096, 4096), (16384, 4096), (32768, 8192), (16384, 5120))
GELU_SHAPES = ((16384, 4096), (16384, 8192))
RMS_EPS, LN_EPS = 1e-6, 1e-5


def shapes(quick: bool):
    if quick:
        return list(QUICK)
    return [(t, h) for t in TOKENS for h in HIDDEN] + list(ODD)


def _x(t, h):
    return torch.randn(t, h, device=harness.device(), dtype=DTYPE)


def _w(h):
    return (torch.rand(h, device=harness.device()) + 0.5).to(DTYPE)


def rms_case(t, h, residual: bool) -> Case:
    from ...ops.norm import rms_norm

    if residual:
        def make():
            return _x(t, h), _x(t, h), _w(h)

        def ref(x, res, w):
            r = x + res  # the definition rounds r to the input dtype
            return rms_ref(r, w), r.float()

        ours = Impl("ours", "ours", lambda x, res, w: rms_norm(x, w, RMS_EPS, res))
    else:
        def make():
            return _x(t, h), _w(h)

        def ref(x, w):
            return (rms_ref(x, w),)

        ours = Impl("ours", "ours", lambda x, w: rms_norm(x, w, RMS_EPS))
    return Case(
        op="rms_norm+residual" if residual else "rms_norm", label=f"{t}x{h}", shape=[t, h], dtype="bfloat16",
        nbytes=norm_bytes(t, h, 2, residual=residual), make_inputs=make, reference=ref, ours=ours,
        peers=peers.norm_peers("rms", residual, RMS_EPS),
    )


def rms_ref(x, w):
    return peers.rms_ref(x, w, RMS_EPS)


def layer_case(t, h, gelu: str | None = None) -> Case:
    from ...ops.norm import layer_norm, layer_norm_gelu

    def make():
        return _x(t, h), _w(h), (0.1 * torch.randn(h, device=harness.device())).to(DTYPE)

    def ref(x, w, b):
        return (peers.layer_ref(x, w, b, LN_EPS, gelu),)

    if gelu:
        ours = Impl("ours", "ours", lambda x, w, b: layer_norm_gelu(x, w, b, LN_EPS, approximate=gelu))
    else:
        ours = Impl("ours", "ours", lambda x, w, b: layer_norm(x, w, b, LN_EPS))
    return Case(
        op=f"layer_norm_gelu({gelu})" if gelu else "layer_norm", label=f"{t}x{h}", shape=[t, h],
        dtype="bfloat16", nbytes=norm_bytes(t, h, 2, bias=True), make_inputs=make, reference=ref, ours=ours,
        peers=peers.norm_peers("layer", False, LN_EPS, gelu),
    )


def cases(quick: bool = False):
    """Built lazily, one at a time (each holds its compiled peer)."""
    for t, h in shapes(quick):
        yield rms_case(t, h, residual=False)
    for t, h in shapes(quick):
        yield rms_case(t, h, residual=True)
    for t, h in (QUICK[1:2] if quick else shapes(quick)):
        yield layer_case(t, h)
    for t, h in (GELU_SHAPES[:1] if quick else GELU_SHAPES):
        yield layer_case(t, h, gelu="tanh")


def run(result: dict, quick: bool = False, save=lambda: None) -> None:
    run_cases(cases(quick), result, save=save, reset=peers.reset_compiled)
