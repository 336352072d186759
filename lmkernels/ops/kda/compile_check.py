"""Compile the KDA kernels for Hopper (sm_90) without a GPU and print registers, stack (spills), shared memory and
tensor-core instruction counts per configuration: `python -m lmkernels.ops.kda.compile_check`. A development aid
(uses the attention family's compile helper, triton 3.6 internals); the test suite uses `state_gluon`."""

import sys

from ..attention.compile_check import _show, compile_kernel
from . import kernels as K


def intra(cfg=None, gate=2, dtype="bf16", k=128, v=128):
    cfg = {**K.prefill_config(k, v, 1, 32, 8192, 8192), **(cfg or {})}
    types = {n: "*" + dtype for n in ("q", "k", "g", "beta", "w", "tb", "qg", "kg", "aqk")}
    types.update(A_log="*fp32", dt_bias="*fp32", gl="*fp32", chunks="*i32", scale="fp32", lower_bound="fp32")
    ce = dict(H=32, K=k, BT=cfg["BT"], BS=K.BS, BK=cfg["BK"], GATE=gate, HAS_BIAS=True, L2=True, BETA_SIG=True,
              SAFE=gate == 2 and bool(cfg["SAFE"]), PREC=cfg["PREC"], NSQ=cfg["BT"].bit_length() - 2,
              BKW=min(cfg["BKW"], k), FAST=True, A16=bool(cfg.get("A16")) and dtype == "bf16", I64=False,
              ONEPASS=bool(cfg.get("onepass")))
    return compile_kernel(K._kda_intra, types, ce, cfg["intra_warps"], cfg["intra_stages"],
                          **K.intra_compile_options(cfg))


def state(cfg=None, dtype="bf16", k=128, v=128):
    cfg = {**K.prefill_config(k, v, 1, 32, 8192, 8192), **(cfg or {})}
    types = {n: "*" + dtype for n in ("w", "tb", "v", "qg", "kg", "aqk", "o")}
    types.update(gl="*fp32", pieces="*i32", h0="*fp32", h0_idx="*i32", ht="*fp32", ht_idx="*i32", carry="*fp32")
    ce = dict(H=32, K=k, V=v, BV=cfg["BV"], BT=cfg["BT"], HAS_H0=True, STORE_HT=True, INTERPRET=False,
              STAGES=cfg["state_stages"], I64=False)
    return compile_kernel(K._kda_state, types, ce, cfg["state_warps"], cfg["state_stages"])


def state_gluon(bv=64, dtype="bf16", k=128, v=128):
    """The state kernel in Gluon (state_gluon.py); the test suite builds it here (it has no interpreter path)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import state_gluon as SG

    types = {n: "*" + dtype for n in ("w", "tb", "v", "qg", "kg", "aqk", "o")}
    types.update(gdec="*fp32", pieces="*i32", h0="*fp32", h0_idx="*i32", ht="*fp32", ht_idx="*i32", carry="*fp32")
    ce = dict(H=32, K=k, V=v, BV=bv, BT=16, HAS_H0=True, STORE_HT=True, STAGES=SG.STAGES)
    return compile_kernel(SG._kda_state_gluon, types, ce, 4, 1, source=GluonASTSource)


def intra_gluon(bc=32, k=128):
    """The intra kernel in Gluon (intra_gluon.py; no interpreter path), one warp a program."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import intra_gluon as IG

    types = {n: "*bf16" for n in ("q", "k", "g", "beta", "w", "tb", "qg", "kg", "aqk")}
    types.update(A_log="*fp32", dt_bias="*fp32", gdec="*fp32", chunks="*i32", scale="fp32", lower_bound="fp32")
    ce = dict(S_QT=32 * k, S_KT=32 * k, S_GT=32 * k, H=32, K=k, BC=bc, HAS_BIAS=True, BETA_SIG=True, L2=True)
    return compile_kernel(IG._kda_intra_gluon, types, ce, 1, 1, source=GluonASTSource)


def decode(cfg=None, dtype="bf16", k=128, v=128, n=64):
    cfg = {**K.decode_config(k, v, n, 32), **(cfg or {})}
    types = {n_: "*" + dtype for n_ in ("q", "k", "v", "g", "beta", "o")}
    types.update(A_log="*fp32", dt_bias="*fp32", pool="*fp32", idx="*i32", scale="fp32", lower_bound="fp32")
    ce = dict(Q=1, H=32, K=k, V=v, BV=cfg["BV"], GATE=2, HAS_BIAS=True, L2=True, BETA_SIG=True)
    return compile_kernel(K._kda_decode, types, ce, cfg["num_warps"], 1)


def main(argv=None):
    which = (argv or sys.argv[1:] or ["all"])[0]
    if which in ("intra", "all"):
        for w in (4, 8):
            for bk in (16, 32, 64):
                _show(f"intra safe w{w} BK{bk}", intra(dict(intra_warps=w, BK=bk)))
        _show("intra softplus (per-element) w4", intra(dict(intra_warps=4), gate=1))
    if which in ("intra_gluon", "all"):
        for bc in (32, 64):
            _show(f"intra (Gluon) BC{bc} w1", intra_gluon(bc))
    if which in ("state", "all"):
        for bv in (16, 32, 64):
            for w in (4, 8):
                _show(f"state BV{bv} w{w}", state(dict(BV=bv, state_warps=w)))
    if which in ("state_gluon", "all"):
        for bv in (32, 64):
            _show(f"state (Gluon) BV{bv} w4", state_gluon(bv))
    if which in ("decode", "all"):
        for bv, w in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 4)):
            _show(f"decode BV{bv} w{w}", decode(dict(BV=bv, num_warps=w)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
