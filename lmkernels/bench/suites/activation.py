"""SwiGLU (silu_and_mul) and GeGLU (gelu_and_mul, tanh) on x = [gate | up], bf16."""

import torch

from .. import peers
from ..counts import gated_bytes
from .. import harness
from ..harness import Case, Impl, run_cases

DTYPE = torch.bfloat16
SHAPES = ((8192, 14336), (4096, 11008))  # (tokens, d): Llama-3-8B and Llama-2-7B MLP widths
QUICK = SHAPES[:1]


def gated_case(t, d, act: str) -> Case:
    from ...ops.activation import gelu_and_mul, silu_and_mul

    def make():
        return (2.0 * torch.randn(t, 2 * d, device=harness.device(), dtype=DTYPE),)

    def ref(x):
        return (peers.gated_ref(x, act),)

    if act == "silu":
        op, ours = "silu_and_mul", Impl("ours", "ours", silu_and_mul)
    else:
        op, ours = "gelu_and_mul(tanh)", Impl("ours", "ours", lambda x: gelu_and_mul(x, "tanh"))
    return Case(
        op=op, label=f"{t}x{2 * d} -> {t}x{d}", shape=[t, 2 * d], dtype="bfloat16", nbytes=gated_bytes(t, d, 2),
        make_inputs=make, reference=ref, ours=ours, peers=peers.gated_peers(act),
    )


def cases(quick: bool = False):
    for act in ("silu", "gelu_tanh"):
        for t, d in (QUICK if quick else SHAPES):
            yield gated_case(t, d, act)


def run(result: dict, quick: bool = False, save=lambda: None) -> None:
    run_cases(cases(quick), result, save=save, reset=peers.reset_compiled)
