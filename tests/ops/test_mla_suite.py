"""The MLA benchmark suite on CPU: a dry run through the Triton interpreter (fp16, tiny shapes, a fake timer)."""

import sys
import types

import pytest
import torch

import lmkernels.bench as bench
from lmkernels.bench import harness, report, timing
from lmkernels.bench.suites import mla as suite
from lmkernels.ops.mla import kernels


@pytest.fixture
def dry_run(monkeypatch):
    monkeypatch.setattr(harness, "DEVICE", "cpu")

    def fake_time(fn, sets, **kw):
        timing.cycling(fn, sets)()
        if kw.get("info") is not None:
            kw["info"]["method"] = "fake"
        return 0.5

    monkeypatch.setattr(timing, "time_ms", fake_time)
    monkeypatch.setattr(timing, "rotation_count", lambda *a, **k: 2)
    monkeypatch.setattr(suite, "PAGE", 16)
    monkeypatch.setattr(suite, "QUICK", ((1, 40, 4, 1), (2, 33, 8, 2), (2, 20, 128, 1)))
    monkeypatch.setattr(suite, "QUICK_SKEWED", (("2 x 70 + 2 x 20", 70, 2, 20, 2),))
    monkeypatch.setattr(suite, "QUICK_FP8", ((2, 40, 4, 1),))


def test_mla_suite_registered():
    assert bench.load_suite("mla") is suite


def test_mla_suite_dry_run(dry_run, monkeypatch):
    result = {"suite": "mla", "ceilings": {"copy_gbps": 3000.0, "gemm_bf16_tflops": 700.0}, "rows": []}
    saves = []
    read = {"read_gbps": 100.0, "read_ms": 0.25, "read_by": "fake"}  # the GPU's read ceiling, as if measured
    monkeypatch.setattr(suite, "_read_ceiling", lambda nbytes: read)
    suite.run(result, quick=True, save=lambda: saves.append(len(result["rows"])))
    rows, skewed, (fp8,) = result["rows"][:3], result["rows"][3:5], result["rows"][5:]
    assert saves == [1, 2, 3, 4, 5, 6]
    # informational: ours on an FP8 cache against ours on a bf16 one, GB/s of the FP8 bytes
    assert fp8["status"] == "ok" and fp8["goal"] == {} and fp8["ours"]["err"] < 1e-2, fp8
    assert fp8["bytes"] == 2 * 40 * (576 + 4 * 5) + 2 * 4 * 1088 * 2 and fp8["label"].endswith("fp8 cache")
    assert [p["name"] for p in fp8["peers"]] == ["ours, bf16 cache"] and fp8["peers"][0]["err"] < 1e-2
    assert fp8["ratio"] > 0 and fp8["pct_copy"] > 0 and "bf16 cache" in fp8["note"]
    for row in skewed:  # informational: no goal, ours against ours on the members run apart (and FlashInfer)
        assert row["status"] == "ok", row
        assert row["ours"]["err"] < 1e-2 and row["goal"] == {}
        assert len(row["peers"]) == 1 and row["peers"][0]["missing"].startswith("not importable: ")
        assert len(row["members_apart_ms"]) == 2 and "members run apart" in row["note"]
    assert [r["unit"] for r in skewed] == ["GB/s", "TFLOP/s"] and skewed[1]["pct_gemm"] > 0
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ours"]["err"] < 1e-2 and row["ours"]["gbps"] > 0 and row["note"]
        assert [p["name"] for p in row["peers"]] == ["flashinfer", "sdpa-math"] and row["peers"][1]["err"] < 1e-2
        assert row["peers"][0]["missing"].startswith("not importable: ")
        assert list(row["goal"]) == (["gemm"] if row["unit"] == "TFLOP/s" else ["copy"])
        assert None not in row["goal"].values()
    mem, mtp, compute = rows
    assert mem["unit"] == "GB/s" and mem["pct_copy"] > 0 and mem["bytes"] == 40 * 576 * 2 + 4 * 1088 * 2
    assert compute["unit"] == "TFLOP/s" and compute["pct_gemm"] > 0
    assert compute["flops"] == 2 * 128 * 20 * 2176
    # the read ceiling in each row's goal measure: % of copy, or the row's FLOPs in the read's time as % of GEMM
    assert mem["read_ceiling"] == {**read, "pct_copy": 100 * 100.0 / 3000.0} and "100 GB/s" in mem["note"]
    assert compute["read_ceiling"]["pct_gemm"] == pytest.approx(100 * compute["flops"] / 0.25e-3 / 1e12 / 700.0)
    md = report.render_markdown([{**result, "gpu": "dry", "versions": {}}])
    assert "mla_decode" in md and "| read-only bound |" in md and "3.3% of copy" in md


def _flex_dry(monkeypatch, fail_first):
    """flex_fn stand-in: the first variants fail as inductor does (a wrapper whose cause is the real error), the next
    one runs the same math eagerly (SDPA math on the dense equivalent)."""
    calls = []

    def fake_flex_fn(n_new, ctx, dev, options=None):
        calls.append(options)
        if len(calls) <= fail_first:
            def broken(q, k, v):
                try:
                    raise ValueError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
                except ValueError as inner:
                    raise RuntimeError("backend='inductor' raised:\nsee the cause") from inner
            return broken
        mask = suite._mask(n_new, ctx, "cpu")
        return lambda q, k, v: suite.sdpa_fn("math")(q, k, v, mask)

    monkeypatch.setattr(suite, "flex_fn", fake_flex_fn)
    monkeypatch.setattr(suite, "_flex_wanted", lambda *a: True)
    monkeypatch.setattr(suite, "QUICK", ((2, 33, 8, 2),))
    monkeypatch.setattr(suite, "QUICK_SKEWED", ())
    monkeypatch.setattr(suite, "QUICK_FP8", ())
    return calls


@pytest.mark.parametrize("fail_first", [0, 1, 3])
def test_mla_suite_flex_peer(dry_run, monkeypatch, fail_first):
    """The FlexAttention peer: runs and is checked like SDPA; where the default options fail, the next variant is
    tried and the failure kept in its note (root cause, not the wrapper's first line); where every variant fails,
    the row records "does not run: …" for it and the row itself stays ok."""
    calls = _flex_dry(monkeypatch, fail_first)
    result = {"suite": "mla", "ceilings": {"copy_gbps": 3000.0, "gemm_bf16_tflops": 700.0}, "rows": []}
    suite.run(result, quick=True)
    (row,) = result["rows"]
    assert row["status"] == "ok", row
    flex = [p for p in row["peers"] if p["kind"] == "flex"]
    assert len(flex) == 1 and len(calls) == min(fail_first + 1, len(suite.FLEX_VARIANTS))
    (flex,) = flex
    if fail_first >= len(suite.FLEX_VARIANTS):
        assert flex["missing"].startswith("does not run: default options: RuntimeError < ValueError: out of resource")
        assert "gbps" not in flex
    else:
        assert flex["err"] < 1e-2 and flex["gbps"] > 0 and "compile_s" in flex
        assert (fail_first == 0) == (flex["name"] == "flex(compiled)")
        assert (fail_first == 0) == ("note" not in flex)
        if fail_first:
            assert "out of resource: shared memory" in flex["note"]


def test_mla_suite_flex_budget(dry_run, monkeypatch):
    """A spent compile budget is reported, not ignored."""
    _flex_dry(monkeypatch, 0)
    monkeypatch.setattr(suite, "FLEX_BUDGET_S", 0)
    result = {"suite": "mla", "ceilings": {}, "rows": []}
    suite.run(result, quick=True)
    (flex,) = [p for p in result["rows"][0]["peers"] if p["kind"] == "flex"]
    assert "budget" in flex["missing"]


def test_root_error():
    try:
        try:
            raise KeyError("deep")
        except KeyError as inner:
            raise RuntimeError("wrapper\nmore") from inner
    except RuntimeError as e:
        assert suite.root_error(e) == "RuntimeError < KeyError: 'deep'"
    assert suite.root_error(ValueError("x" * 500)).endswith("…")


def test_flashinfer_csr():
    """Each sequence's pages in table order up to its last page; queries n_new apart."""
    tables = torch.tensor([[7, 3, 0, 0], [1, 2, 4, 5], [6, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([17, 64, 1], dtype=torch.int32)
    qo, kv_indptr, kv_indices, kv_len = suite.flashinfer_csr(tables, lens, 2, 16)
    assert qo.tolist() == [0, 2, 4, 6] and kv_indptr.tolist() == [0, 2, 6, 7]
    assert kv_indices.tolist() == [7, 3, 1, 2, 4, 5, 6] and kv_len.tolist() == [17, 64, 1]
    assert {t.dtype for t in (qo, kv_indptr, kv_indices, kv_len)} == {torch.int32}


def _fake_flashinfer(monkeypatch):
    """A stand-in for flashinfer.mla with the documented meaning of its CSR plan and packed tensors, in plain
    PyTorch: each request's pages kv_indices[kv_indptr[b]:kv_indptr[b + 1]], its first kv_len[b] rows, queries
    qo_indptr[b]:qo_indptr[b + 1] aligned to the end (causal). Its fa2 backend refuses to plan, as on a GPU
    without it."""
    class Metadata:
        @classmethod
        def csr(cls, *tensors):
            meta = cls()
            meta.tensors = tensors
            return meta

    class Wrapper:
        def __init__(self, workspace, backend):
            self.backend = backend

        def plan(self, *, metadata, num_heads, causal, sm_scale, page_size, **kw):
            if self.backend == "fa2":
                raise RuntimeError("fa2 MLA requires SM80 or newer")
            self.meta, self.causal, self.scale = metadata.tensors, causal, sm_scale

        def run(self, *, query, kv_cache):
            qo, kv_indptr, kv_indices, kv_len = (t.tolist() for t in self.meta)
            out = torch.empty(*query.shape[:2], 512, dtype=query.dtype)
            for b in range(len(kv_len)):
                rows = kv_cache[kv_indices[kv_indptr[b]:kv_indptr[b + 1]]].flatten(0, 1)[:kv_len[b]].double()
                q = query[qo[b]:qo[b + 1]].double()
                s = torch.einsum("nhd,sd->nhs", q, rows) * self.scale
                n = q.shape[0]
                if self.causal:
                    late = torch.arange(kv_len[b])[None, :] > (kv_len[b] - n + torch.arange(n))[:, None]
                    s = s.masked_fill(late[:, None, :], float("-inf"))
                out[qo[b]:qo[b + 1]] = torch.einsum("nhs,sd->nhd", torch.softmax(s, -1), rows[:, :512]).to(out.dtype)
            return out

    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper, mla.MLAPlanMetadata = Wrapper, Metadata
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)


def test_mla_suite_flashinfer_peer(dry_run, monkeypatch):
    """The FlashInfer peer gets our cache, its CSR plan and packed q, and is checked against the fp32 reference:
    uniform, MTP and skewed rows; a backend that does not plan is recorded as missing with its reason."""
    _fake_flashinfer(monkeypatch)
    monkeypatch.setattr(suite, "QUICK", ((2, 33, 8, 2), (3, 40, 4, 1)))
    monkeypatch.setattr(suite, "QUICK_FP8", ())  # FlashInfer is no peer of the FP8 rows
    result = {"suite": "mla", "ceilings": {"copy_gbps": 3000.0, "gemm_bf16_tflops": 700.0}, "rows": []}
    suite.run(result, quick=True)
    assert len(result["rows"]) == 4
    for row in result["rows"]:
        assert row["status"] == "ok", row
        fa3, fa2 = row["peers"][:2]
        assert fa3["name"] == "flashinfer-fa3" and fa3["err"] < 1e-2 and fa3["gbps"] > 0, fa3
        assert fa2["name"] == "flashinfer-fa2" and fa2["missing"] == "RuntimeError: fa2 MLA requires SM80 or newer"
        assert row["best_peer"] is not None and row["ratio"] > 0
    assert "flashinfer-fa3" in result["rows"][2]["note"]
