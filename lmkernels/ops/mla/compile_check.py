"""Compile the MLA kernels for Hopper (sm_90) without a GPU and print registers, spills, shared memory and the
instructions that matter: `python -m lmkernels.ops.mla.compile_check`. A development aid (the test suite only
uses `ws`: the Gluon kernel has no interpreter path); it uses the attention family's helper (triton internals as
of 3.6)."""

import sys

from ..attention.compile_check import _show, compile_kernel
from . import kernels as K


def decode(rows, cache="bf16", split=True, cfg=None):
    cfg = dict(cfg or K.decode_config(rows, cache != "bf16"))
    cfg.setdefault("KEYS_MAJOR", False)
    cfg.setdefault("TMA", False)
    cfg.setdefault("HALVES", False)
    cfg.pop("WS", None)  # the Triton kernel at the Gluon kernel's rows: decode_config's tiles
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    cfg.pop("PROGRAMS_PER_SM", None)  # launcher-side keys, not kernel constexprs
    cfg.pop("FAST_DRAM_PROGRAMS_PER_SM", None)
    cfg.pop("FAST_DRAM_SMALL_MIN_KEYS", None)
    types = dict(qn_ptr="*bf16", qp_ptr="*bf16", c_ptr="*" + cache, s_ptr="*fp32", bt_ptr="*i32", len_ptr="*i32",
                 o_ptr="*bf16", lse_ptr="*fp32", po_ptr="*bf16" if K.FUSED_MERGE else "*fp32", pl_ptr="*fp32",
                 sched_ptr="*i32", prog_ptr="*i32", cnt_ptr="*i32", qk_scale="fp32")
    cfg.setdefault("FUSED_MERGE", split and K.FUSED_MERGE)
    cfg.setdefault("RANGES", split)
    ce = dict(PAGE_TILE=True, SPLIT=split, FP8=cache == "fp8e4nv", KV_LORA=512, ROPE=64, INTERPRET=False, **cfg)
    return compile_kernel(K._mla_decode_kernel, types, ce, nw, ns)


def _desc(dtype, cols):
    """The type of kernels_few.cache_descriptor's TMA descriptor (tiles of 64 keys × cols)."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * cols), element_bitwidth=16, rank=2)
    return f"tensordesc<{dtype}[64, {cols}],{layout!r}>"


def _bf16_cache_types(dtype):
    """The argument types of the Gluon kernels over a 16-bit cache (kernels_ws.py, kernels_few.py,
    kernels_seesaw_t.py: the last two take the cache as kernels_few.cache_descriptor's descriptors)."""
    return dict(qn_ptr="*" + dtype, qp_ptr="*" + dtype, c_ptr="*" + dtype, c_desc=_desc(dtype, 64),
                pe_desc=_desc(dtype, 32), bt_ptr="*i32", len_ptr="*i32",
                o_ptr="*" + dtype, lse_ptr="*fp32", po_ptr="*" + dtype, pl_ptr="*fp32", sched_ptr="*i32",
                qk_scale="fp32")


def ws(split=True, dtype="bf16", q_tma=True):
    """The warp-specialised Gluon kernel (kernels_ws.py); split: partials in q's dtype, PDL, the merge kernel's launch
    triggered late and the first pair's t1 loaded after t0 (one wave), as mla_decode gives them on Hopper; q_tma: q
    brought by the loader's TMA (q rows of one stride), else loaded by the consumers."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import kernels_ws as W

    types = _bf16_cache_types(dtype)
    ce = dict(SPLIT=split, SCHEDULE_ROW=W.ROW, KV_LORA=512, ROPE=64, BLOCK_M=W.BLOCK_M, BLOCK_N=W.BLOCK_N,
              CONSUMER_REGS=W.CONSUMER_REGS, USE_PDL=True, LATE_TRIGGER=split, T1_AFTER_T0=split, Q_TMA=q_tma)
    if q_tma:
        types.update(q_desc=_desc(dtype, 64), qp_desc=_desc(dtype, 64))
    else:
        ce.update(q_desc=None, qp_desc=None)
    return compile_kernel(W._mla_decode_ws_kernel, types, ce, 4, 1, source=GluonASTSource, maxnreg=W.MAXNREG)


def few(split=True, dtype="bf16", ranges=False, fused=False):
    """The few-rows Gluon kernel (kernels_few.py), as mla_decode launches it on Hopper; ranges: a launch of
    programs; fused: with the in-kernel merge (then no merge kernel after it: its launch is not triggered late)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import kernels_few as F

    types = dict(_bf16_cache_types(dtype), prog_ptr="*i32", cnt_ptr="*i32")
    ce = dict(SPLIT=split or ranges, SCHEDULE_ROW=F.ROW, KV_LORA=512, ROPE=64, ROWS=F.MAX_ROWS, BLOCK_N=F.BLOCK_N,
              NSTAGE=F.NSTAGE, RANGES=ranges, PROGRAM_ROW=F.PROGRAM_ROW, USE_PDL=True,
              LATE_TRIGGER=(split or ranges) and not fused, FUSED=fused)
    return compile_kernel(F._mla_decode_few_kernel, types, ce, 4, 1, source=GluonASTSource, maxnreg=F.MAXNREG)


def seesaw_t(split=True, dtype="bf16", ranges=False, rows=32):
    """The transposed-seesaw Gluon kernel (kernels_seesaw_t.py) at `rows`, as mla_decode launches it on Hopper;
    ranges: a launch of programs."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import kernels_few as F, kernels_seesaw_t as T

    types = dict(_bf16_cache_types(dtype), prog_ptr="*i32")
    ce = dict(SPLIT=split or ranges, SCHEDULE_ROW=F.ROW, KV_LORA=512, ROPE=64, ROWS=rows, BLOCK_N=F.BLOCK_N,
              RANGES=ranges, PROGRAM_ROW=F.PROGRAM_ROW, USE_PDL=True, LATE_TRIGGER=split or ranges)
    return compile_kernel(T._mla_decode_seesaw_t_kernel, types, ce, 4, 1, source=GluonASTSource, maxnreg=F.MAXNREG)


def fp8(rows=16, split=True, dtype="bf16"):
    """The FP8 Gluon kernel (kernels_fp8.py) at `rows` (16, 32 or 64), as mla_decode launches it on Hopper."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import kernels_fp8 as F

    types = dict(qn_ptr="*" + dtype, qp_ptr="*" + dtype, c_ptr="*fp8e4nv", s_ptr="*fp32", bt_ptr="*i32",
                 len_ptr="*i32", o_ptr="*" + dtype, lse_ptr="*fp32", po_ptr="*" + dtype, pl_ptr="*fp32",
                 sched_ptr="*i32", qk_scale="fp32")
    ce = dict(SPLIT=split, SCHEDULE_ROW=F.ROW, KV_LORA=512, ROPE=64, ROWS=rows, BLOCK_N=F.BLOCK_N,
              NSTAGE=F.stages(rows), USE_PDL=True, LATE_TRIGGER=split)
    return compile_kernel(F._mla_decode_fp8_kernel, types, ce, 4, 1, source=GluonASTSource, maxnreg=F.MAXNREG)


def merge(block_d, chunk_s, partials="bf16"):
    """The generic merge kernel as merge_partials launches it (merge_warps a program); partials: their dtype (the
    Gluon kernels' are q's, the Triton kernel's fp32)."""
    types = dict(po_ptr="*" + partials, pl_ptr="*fp32", sched_ptr="*i32", o_ptr="*bf16", lse_ptr="*fp32")
    ce = dict(CHUNK_S=chunk_s, KV_LORA=512, BLOCK_D=block_d, INTERPRET=False, LONG_ENTRIES=0)
    return compile_kernel(K._mla_merge_kernel, types, ce, K.merge_warps(block_d, chunk_s), 1)


def main(argv=None):
    args = argv or sys.argv[1:]
    configs = [None]
    if args and args[0] == "sweep":
        configs = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                   for bm in (16, 64) for bn in (16, 32, 64) for w in (4, 8) for s in (1, 2, 3)]
    for rows in (16, 32, 64, 128):
        for cache in ("bf16", "fp8e4nv"):
            for cfg in configs:
                if cfg is not None and cfg["BLOCK_M"] != min(64, max(16, rows)):
                    continue
                c = cfg or K.decode_config(rows, cache != "bf16")
                try:
                    r = decode(rows, cache, True, cfg)
                except Exception as e:  # noqa: BLE001
                    print(f"rows {rows} {cache} {c}: {type(e).__name__} {str(e)[:100]}")
                    continue
                _show(f"mla decode rows {rows} {c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']} "
                      f"{cache}", r)
    for block_d, chunk_s in ((K.MERGE_BLOCK_D, 32), (K.MERGE_BLOCK_D, K.MERGE_CHUNK_S),
                             (K.MERGE_BLOCK_D, K.MERGE_CHUNK_S_FEW), (512, 16), (512, 32)):
        _show(f"mla merge, {block_d} columns × {chunk_s} splits a load", merge(block_d, chunk_s))
    from . import schedule as S

    sce = dict(BLOCK_N=64, MAX_CHUNKS=S.MAX_CHUNKS, SEQ_BLOCK=S.SEQ_BLOCK, K=S.CANDIDATES)
    _show("mla schedule", compile_kernel(S._schedule_kernel, dict(len_ptr="*i32", sched_ptr="*i32"), sce,
                                         S.SCHEDULE_WARPS, 1))
    rce = dict(BLOCK_N=32, MAX_CHUNKS=S.MAX_CHUNKS, BLOCK=S.RANGE_BLOCK, K=S.CANDIDATES,
               CUT=S.RANGE_CUT_TILES, DRAM=S.DRAM_PROGRAMS)
    _show("mla schedule of programs", compile_kernel(S._program_schedule_kernel, dict(len_ptr="*i32",
                                                                                       sched_ptr="*i32"), rce, 8, 1))
    for split in (False, True):
        _show(f"mla decode rows 64, warp-specialised (Gluon), split {split}", ws(split))
    _show("mla decode rows 16, few rows (Gluon)", few())
    for fused in (False, True):
        _show(f"mla decode rows 16, few rows (Gluon), a launch of programs, in-kernel merge {fused}",
              few(ranges=True, fused=fused))
    for rows in (16, 32):
        _show(f"mla decode rows {rows}, transposed seesaw (Gluon), a launch of programs", seesaw_t(ranges=True,
                                                                                                  rows=rows))
    for rows in (16, 32, 64):
        _show(f"mla decode rows {rows}, FP8 cache (Gluon)", fp8(rows))
    r = decode(16, cfg=dict(K.decode_config(16), USE_PDL=True))
    _show("mla decode rows 16 with PDL (griddepcontrol)", r)
    types = dict(kv_ptr="*bf16", w_ptr="*bf16", cs_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64", c_ptr="*bf16",
                 sc_ptr="*fp32", eps="fp32")
    for cache in ("bf16", "fp8e4nv"):
        types["c_ptr"] = "*" + cache
        _show(f"write_latent_cache {cache}", compile_kernel(K._write_latent_kernel, types,
                                                            dict(FP8=cache != "bf16", KV_LORA=512, ROPE=64), 4, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
