"""Rotary embedding (NeoX), in place on q and k, bf16, fp32 cos/sin cache, random positions."""

import torch

from .. import peers
from ..counts import rope_bytes
from .. import harness
from ..harness import Case, Impl, run_cases

DTYPE = torch.bfloat16
TOKENS, Q_HEADS, KV_HEADS, HEAD_DIM = 8192, 32, 8, 128
MAX_POSITION = 32768
BASE = 500000.0  # Llama 3


def rope_case(t=None, hq=None, hk=None, d=None) -> Case:
    from ...ops.rope import apply_rotary, build_cos_sin_cache

    t, hq, hk, d = t or TOKENS, hq or Q_HEADS, hk or KV_HEADS, d or HEAD_DIM
    cache = build_cos_sin_cache(d, MAX_POSITION, BASE, dtype=torch.float32, device=harness.device())

    def make():
        q = torch.randn(t, hq, d, device=harness.device(), dtype=DTYPE)
        k = torch.randn(t, hk, d, device=harness.device(), dtype=DTYPE)
        pos = torch.randint(0, MAX_POSITION, (t,), device=harness.device())
        return q, k, cache, pos

    def ours(q, k, c, pos):
        return apply_rotary(q, k, c, pos, is_neox=True)

    return Case(
        op="apply_rotary(neox)", label=f"T={t}, {hq}+{hk} heads, d={d}", shape=[t, hq, hk, d], dtype="bfloat16",
        nbytes=rope_bytes(t, hq, hk, d, 2, rotary_dim=d, cache_elem=4, pos_elem=8),
        make_inputs=make, reference=peers.rope_ref, ours=Impl("ours", "ours", ours), peers=peers.rope_peers(),
        note=f"in place; cos/sin cache fp32 [{MAX_POSITION}, {d}], random int64 positions",
    )


def cases(quick: bool = False):
    yield rope_case()


def run(result: dict, quick: bool = False, save=lambda: None) -> None:
    run_cases(cases(quick), result, save=save, reset=peers.reset_compiled)
