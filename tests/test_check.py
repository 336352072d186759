"""`lmkernels check` on the CPU: every op family runs and passes, and a broken op is reported as a failure."""

from lmkernels import check
from lmkernels.ops import attention


def test_check_passes_and_covers_every_family(capsys):
    assert check.run("cpu") == 0
    out = capsys.readouterr().out
    for name in ("rms_norm", "layer_norm_gelu", "silu_and_mul", "apply_rotary", "attention_prefill",
                 "attention_decode(fp8 cache)", "write_kv_cache", "merge_attention_states", "gemv(rms_norm, SwiGLU)",
                 "gemv_qkv(rms_norm, rotary, cache)"):
        assert name in out
    assert "all passed" in out


def test_check_reports_a_wrong_op(monkeypatch, capsys):
    real = attention.attention_decode
    monkeypatch.setattr(attention, "attention_decode", lambda *a, **kw: real(*a, **kw) * 1.01)
    assert check.run("cpu") == 1
    out = capsys.readouterr().out
    failing = [line for line in out.splitlines() if line.endswith("FAIL")]
    assert failing and all(line.startswith("attention_decode") for line in failing)
