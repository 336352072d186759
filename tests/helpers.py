"""Shared test helpers: the error measure and per-dtype tolerances (the same ones `lmkernels check` uses), a
NaN-poisoning torch.empty, and the sm_90 build of a Gluon kernel."""

import json
import os
import subprocess
import sys

import torch

from lmkernels.check import TOL, rel_err  # noqa: F401

_torch_empty = torch.empty


def nan_empty(*args, **kwargs):
    """torch.empty whose floating-point tensors hold NaN: patched in (monkeypatch) so that outputs an op allocates
    start poisoned and every element it should write is checked."""
    t = _torch_empty(*args, **kwargs)
    return t.fill_(float("nan")) if t.is_floating_point() else t


def compile_in_fresh_process(expr: str):
    """The JSON value of `expr` (a compile_check call) evaluated in a fresh Python without TRITON_INTERPRET: the
    interpreter tests patch triton.language in this process, and Gluon kernels compile through it."""
    code = ("import json, lmkernels.ops.attention.compile_check, lmkernels.ops.kda.compile_check, "
            "lmkernels.ops.mla.compile_check; "
            f"print(json.dumps({expr}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
