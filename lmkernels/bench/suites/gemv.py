"""The decode-time linear layers of Llama-3-8B (lmkernels.ops.gemv), bf16, one and four rows of x, each with the
fusion the engine's decode step uses, against the same math from cuBLAS plus the neighbouring ops.

Peers, both computing the row's whole function:
- "cuBLAS + ops" (eager): F.linear (cuBLAS) with lmkernels' rms_norm / silu_and_mul and torch's add around it,
  i.e. what the engine ran before this op;
- "torch.compile" (the goal peer): torch.compile of the same chain written in torch ops (fp32 norm, bf16
  F.linear, SwiGLU, add), as a model's code computes it; inductor fuses the elementwise parts.
GB/s counts the weight, x, the residual and the output once each; the weights dominate (8–235 MB per call).
"""

import torch
import torch.nn.functional as F

from .. import harness, peers
from ..harness import Case, Impl, run_cases

DTYPE = torch.bfloat16
EPS = 1e-5
SHAPES = {  # Llama-3-8B: (output width N, K, fusion)
    "qkv (rms_norm)": (6144, 4096, dict(norm=True)),
    "o (+ residual)": (4096, 4096, dict(residual=True)),
    "gate|up (rms_norm, SwiGLU)": (14336, 4096, dict(norm=True, gated=True)),
    "down (+ residual)": (4096, 14336, dict(residual=True)),
    "lm_head (rms_norm)": (128256, 4096, dict(norm=True)),
}
ROWS = (1, 4)


def gemv_case(name, n, k, fusion, m) -> Case:
    from ...ops.activation import silu_and_mul
    from ...ops.gemv import gemv, reference
    from ...ops.norm import rms_norm

    norm, gated, residual = fusion.get("norm", False), fusion.get("gated", False), fusion.get("residual", False)
    dev = harness.device()

    def make():
        w = (torch.randn(n * (2 if gated else 1), k, device=dev) / k ** 0.5).to(DTYPE)
        x = torch.randn(m, k, device=dev).to(DTYPE)
        g = (torch.rand(k, device=dev) + 0.5).to(DTYPE) if norm else None
        r = torch.randn(m, n, device=dev).to(DTYPE) if residual else None
        return x, w, g, r

    def ref(x, w, g, r):  # the definition on fp32 copies: fp32 out
        f = lambda t: None if t is None else t.float()  # noqa: E731
        return (reference.gemv(f(x), f(w), None, f(g), EPS, f(r), gated),)

    def ours(x, w, g, r):
        return gemv(x, w, norm_weight=g, eps=EPS, residual=r, gated=gated)

    def unfused(x, w, g, r):
        a = rms_norm(x, g, EPS) if g is not None else x
        y = F.linear(a, w)
        if gated:
            y = silu_and_mul(y)
        return y + r if r is not None else y

    def compile_fn(x, w, g, r):  # as a model written in torch computes it: norm in fp32, bf16 matmul
        a = x
        if g is not None:
            xf = x.float()
            a = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * g.float()).to(DTYPE)
        y = F.linear(a, w)
        if gated:
            gate, up = y.float().chunk(2, -1)
            y = (F.silu(gate) * up).to(DTYPE)
        return y + r if r is not None else y

    nbytes = 2 * (n * (2 if gated else 1) * k + m * k + m * n * (2 if residual else 1) + (k if norm else 0))
    peer_list = [peers.eager("cuBLAS + ops", unfused, "F.linear with lmkernels rms_norm / silu_and_mul, torch add"),
                 peers.compiled(compile_fn)]
    return Case(op="gemv", label=f"{name} M={m}", shape=[m, n, k], dtype="bfloat16", nbytes=nbytes,
                make_inputs=make, reference=ref, ours=Impl("ours", "ours", ours), peers=peer_list)


def cases(quick: bool = False):
    for m in ROWS[:1] if quick else ROWS:
        for name, (n, k, fusion) in SHAPES.items():
            yield gemv_case(name, n, k, fusion, m)


def run(result: dict, quick: bool = False, save=lambda: None) -> None:
    result["goal_text"] = ("≥ 90% of copy bandwidth (weights read once) and ≥ 1.0x torch.compile of the same "
                           "fused function")
    run_cases(cases(quick), result, save=save, reset=peers.reset_compiled)
