"""`lmkernels check` on the CPU: every op family runs and passes, and a broken op is reported as a failure."""

import pytest

from lmkernels import check
from lmkernels.ops import attention, kda


def test_check_passes_and_covers_every_family(capsys):
    assert check.run("cpu") == 0
    out = capsys.readouterr().out
    for name in ("rms_norm", "layer_norm_gelu", "silu_and_mul", "apply_rotary", "attention_prefill",
                 "attention_decode(fp8 cache)", "write_kv_cache", "merge_attention_states", "gemv(rms_norm, SwiGLU)",
                 "gemv_qkv(rms_norm, rotary, cache)", "write_latent_cache", "mla_decode(16 heads, q 2)",
                 "mla_decode(16 heads, shared schedule)", "write_latent_cache(fp8)", "mla_decode(16 heads, fp8 cache)",
                 "mla_prefill(4 heads)", "mla_prefill(4 heads, shared plan)",
                 "kda_prefill(N=3, H=2) state", "kda_decode(state pool) o", "kda_decode(state pool) states"):
        assert name in out
    assert "all passed" in out


def _off_by_one_percent(fn):
    def wrong(*args, **kwargs):
        out = fn(*args, **kwargs)
        return tuple(x * 1.01 for x in out) if isinstance(out, tuple) else out * 1.01
    return wrong


@pytest.mark.parametrize("family,op", [(attention, "attention_decode"), (kda, "kda_prefill")])
def test_check_reports_a_wrong_op(monkeypatch, capsys, family, op):
    monkeypatch.setattr(family, op, _off_by_one_percent(getattr(family, op)))
    # the broken op's cases beside one healthy family's (the whole check runs above; once is enough on 2 cores)
    every_case = check.cases
    monkeypatch.setattr(check, "cases",
                        lambda device: (c for c in every_case(device) if c[0].startswith((op, "rms_norm"))))
    assert check.run("cpu") == 1
    out = capsys.readouterr().out
    failing = [line for line in out.splitlines() if line.endswith("FAIL")]
    passing = [line for line in out.splitlines() if line.endswith("pass")]
    assert failing and all(line.startswith(op) for line in failing)
    assert passing and all(line.startswith("rms_norm") for line in passing)
