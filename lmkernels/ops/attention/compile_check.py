"""Compile the attention kernels for Hopper (sm_90) on a machine without a GPU, and report what ptxas made of
them: `python -m lmkernels.ops.attention.compile_check [prefill|ws|paged|decode|persistent|other|all]`.

A development aid for the launch heuristics, not a test: it catches GPU-only compile errors (things the
interpreter accepts, such as non-constexpr globals) and prints per configuration the registers, stack bytes
(spills), shared memory, and the instructions that matter — wgmma (Hopper tensor cores), mma.sync
(Ampere-style), cp.async (pipelined pointer loads) and cp.async.bulk.tensor (TMA). Pointers and the strides
named stride_* or s_* (except those listed in NOT_ALIGNED) are declared 16-divisible, as triton's launcher does
for typical shapes; without that, loads do not vectorise and the pipeliner does nothing. Uses triton internals
(ASTSource, GPUTarget, the bundled cuobjdump) as of triton 3.6.
"""

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import kernels as K

TARGET = GPUTarget("cuda", 90, 32)
NOT_ALIGNED = {"stride_lh", "stride_lt", "stride_lb", "stride_ls", "stride_plb", "stride_plt", "stride_plh",
               "stride_pls", "stride_lan", "stride_lah", "stride_lbn", "stride_lbh", "stride_bt", "stride_kscale",
               "stride_vscale", "s_bh"}


def compile_kernel(fn, types, constexprs, num_warps, num_stages, source=ASTSource, **options):
    """Compile `fn` for sm_90; `types` maps argument names to triton types (default i32); `source`: the AST source
    class (a Gluon kernel's: GluonASTSource); `options`: more compile options (maxnreg)."""
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    stride = lambda n: n.startswith(("stride_", "s_")) and n not in NOT_ALIGNED  # noqa: E731
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in constexprs and (sig[n].startswith("*") or stride(n))}
    k = triton.compile(source(fn, sig, constexprs, attrs), target=TARGET,
                       options=dict(num_warps=num_warps, num_stages=num_stages, **options))
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return dict(regs=int(m.group(1)) if m else -1, stack=int(m.group(2)) if m else -1,
                smem_kb=k.metadata.shared // 1024,
                wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"), cp_async=ptx.count("cp.async.cg"),
                tma=ptx.count("cp.async.bulk.tensor"), div=ptx.count("div.full.f32") + ptx.count("div.rn.f32"),
                vote=ptx.count("vote.sync.any"))


def prefill(dqk=128, dv=128, dtype="bf16", cache=None, cfg=None, tma=False, causal=True, max_seqlen_q=4096):
    """cache: None (packed k/v) or the paged cache's type ("bf16", "fp8e4nv")."""
    cfg = dict(cfg or K.prefill_config(dqk, dv, max_seqlen_q))
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    cfg.pop("TMA", None)
    kv = "*" + (cache or dtype)
    types = dict(q_ptr="*" + dtype, k_ptr=kv, v_ptr=kv, o_ptr="*" + dtype, lse_ptr="*fp32", cu_q_ptr="*i32",
                 cu_k_ptr="*i32", bt_ptr="*i32", ks_ptr="*fp32", vs_ptr="*fp32", qk_scale="fp32", cap_in="fp32",
                 cap_out="fp32")
    ce = dict(VARLEN=True, PAGED=cache is not None, FP8=cache == "fp8e4nv", TMA=tma and cache is None,
              HAS_LEFT=False, HAS_RIGHT=causal, SOFTCAP=False, STORE_LSE=True, HEAD_DQK=dqk, HEAD_DV=dv,
              BLOCK_DV=triton.next_power_of_2(dv), INTERPRET=False, **cfg)
    ce["BLOCK_DQK"], ce["DQK_HI"] = K.head_dim_blocks(dqk)
    return compile_kernel(K._prefill_kernel, types, ce, nw, ns)


def prefill_ws(dqk=192, dv=128, dtype="bf16", causal=True, varlen=True, tiles=None):
    """The warp-specialised Gluon prefill (prefill_ws.py) at its config's tiles (or tiles: (warpgroups, BLOCK_N,
    STAGES))."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import prefill_ws as W

    wgs, block_n, stages = tiles or W.config(dqk, dv)
    maxnreg, consumer_regs = W.REGS[wgs]
    lo, hi = K.head_dim_blocks(dqk)
    types = dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype, qh_ptr="*" + dtype, kh_ptr="*" + dtype,
                 o_ptr="*" + dtype, lse_ptr="*fp32", cu_q_ptr="*i32", cu_k_ptr="*i32", qk_scale="fp32")
    ce = dict(VARLEN=varlen, CAUSAL=causal, STORE_LSE=True, HEAD_DQK=dqk, HEAD_DV=dv, DQK_LO=lo, DQK_HI=hi, WGS=wgs,
              BLOCK_N=block_n, STAGES=stages, M_BAND=16, CONSUMER_REGS=consumer_regs)
    return compile_kernel(W._prefill_ws_kernel, types, ce, 4, 1, source=GluonASTSource, maxnreg=maxnreg)


def decode(d=128, rows=4, cache="bf16", split=True, cfg=None):
    cfg = dict(cfg or K.decode_config(d, d, rows))
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    cfg.pop("PROGRAMS_PER_SM", None)  # launcher-side keys, not kernel constexprs
    cfg.pop("PROGRAMS", None)
    types = dict(q_ptr="*bf16", kc_ptr="*" + cache, vc_ptr="*" + cache, bt_ptr="*i32", len_ptr="*i32",
                 o_ptr="*fp32" if split else "*bf16", lse_ptr="*fp32", ks_ptr="*fp32", vs_ptr="*fp32",
                 qk_scale="fp32", cap_in="fp32", cap_out="fp32")
    ce = dict(NUM_SPLITS=8 if split else 1, HAS_LEFT=False, SOFTCAP=False, FP8=cache == "fp8e4nv", STORE_LSE=True,
              HEAD_DQK=d, HEAD_DV=d, BLOCK_DQK=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(d),
              INTERPRET=False, **cfg)
    return compile_kernel(K._decode_kernel, types, ce, nw, ns)


def decode_persistent(d=128, rows=4, cache="bf16", cfg=None, batch=64):
    cfg = dict(cfg or K.decode_config(d, d, rows))
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    cfg.pop("PROGRAMS_PER_SM", None)
    cfg.pop("PROGRAMS", None)
    types = dict(q_ptr="*bf16", kc_ptr="*" + cache, vc_ptr="*" + cache, bt_ptr="*i32", len_ptr="*i32",
                 o_ptr="*bf16", lse_ptr="*fp32", part_o_ptr="*fp32", part_l_ptr="*fp32", cnt_ptr="*i32",
                 ks_ptr="*fp32", vs_ptr="*fp32", qk_scale="fp32", cap_in="fp32", cap_out="fp32")
    ce = dict(HAS_LEFT=False, SOFTCAP=False, FP8=cache == "fp8e4nv", STORE_LSE=False, HEAD_DQK=d, HEAD_DV=d,
              BLOCK_DQK=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(d),
              BLOCK_B=triton.next_power_of_2(batch), BLOCK_R=min(cfg["BLOCK_M"], triton.next_power_of_2(rows)),
              BLOCK_S=max(1, 32 // min(cfg["BLOCK_M"], triton.next_power_of_2(rows))), INTERPRET=False, **cfg)
    return compile_kernel(K._decode_persistent_kernel, types, ce, nw, ns)


def decode_merge(splits=32, dv=128):
    """The split-KV decode's merge kernel as decode launches it (decode_merge_warps a program)."""
    types = dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", len_ptr="*i32", o_ptr="*bf16", lse_ptr="*fp32")
    block_s, block_dv = triton.next_power_of_2(splits), triton.next_power_of_2(dv)
    ce = dict(NUM_SPLITS=splits, HAS_LEFT=False, STORE_LSE=True, HEAD_DV=dv, BLOCK_S=block_s, BLOCK_DV=block_dv,
              BLOCK_N=64, USE_PDL=True)
    return compile_kernel(K._decode_merge_kernel, types, ce, K.decode_merge_warps(block_s, dv), 1)


def other():
    out = {"decode merge, 32 splits, d128": decode_merge()}
    for cache in ("bf16", "fp8e4nv"):
        types = dict(k_ptr="*bf16", v_ptr="*bf16", kc_ptr="*" + cache, vc_ptr="*" + cache, slot_ptr="*i64",
                     ks_ptr="*fp32", vs_ptr="*fp32")
        out[f"write_kv_cache {cache}, 8 heads d128"] = compile_kernel(
            K._write_kv_kernel, types, dict(HEAD_DK=128, HEAD_DV=128, BLOCK_H=8, BLOCK_DK=128, BLOCK_DV=128,
                                            FP8=cache != "bf16"), **_warps(K.write_kv_config(8, 128, 128)))
    rows, block_d, nw = K.merge_config(128)
    types = dict(oa_ptr="*bf16", la_ptr="*fp32", ob_ptr="*bf16", lb_ptr="*fp32", o_ptr="*bf16", l_ptr="*fp32")
    out["merge_attention_states d128"] = compile_kernel(K._merge_kernel, types,
                                                        dict(HEAD_D=128, ROWS=rows, BLOCK_D=block_d), nw, 1)
    return out


def _warps(cfg):
    return dict(num_warps=cfg["num_warps"], num_stages=1)


def _show(name, r):
    print(f"{name:<52} regs {r['regs']:>3} stack {r['stack']:>3}B smem {r['smem_kb']:>3}KB  wgmma {r['wgmma']:>3} "
          f"mma {r['mma']:>3} cp.async {r['cp_async']:>3} tma {r['tma']:>3}", flush=True)


def _ws_config(dqk, dv):
    from .prefill_ws import config

    return config(dqk, dv)


def main(argv=None):
    which = (argv or sys.argv[1:] or ["all"])[0]
    if which in ("prefill", "all"):
        for dqk, dv in ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)):
            for m in (4096, 32):
                for tma in (False, True):
                    cfg = K.prefill_config(dqk, dv, m)
                    _show(f"prefill d{dqk}/{dv} {cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} "
                          f"s{cfg['num_stages']} {'tma' if tma else 'ptr'}", prefill(dqk, dv, tma=tma, max_seqlen_q=m))
    if which in ("prefill", "ws", "all"):
        for dqk, dv in ((64, 64), (128, 128), (192, 128), (256, 128)):
            for causal in (True, False):
                wgs, block_n, stages = _ws_config(dqk, dv)
                _show(f"prefill_ws d{dqk}/{dv} {64 * wgs}x{block_n} s{stages} {'causal' if causal else 'full'}",
                      prefill_ws(dqk, dv, causal=causal))
    if which in ("paged", "all"):
        for cache in ("bf16", "fp8e4nv"):
            for d in (64, 128, 256):
                _show(f"paged prefill d{d} cache {cache}", prefill(d, d, cache=cache))
    if which in ("decode", "all"):
        for cache in ("bf16", "fp8e4nv"):
            for d, rows in ((64, 8), (128, 4), (128, 32), (256, 4)):
                for split in (True, False):
                    cfg = K.decode_config(d, d, rows)
                    _show(f"decode d{d} rows {rows} {cfg['BLOCK_M']}x{cfg['BLOCK_N']} s{cfg['num_stages']} {cache} "
                          f"{'split' if split else 'whole'}", decode(d, rows, cache, split))
    if which in ("persistent", "decode", "all"):
        for cache in ("bf16", "fp8e4nv"):
            for d, rows in ((64, 8), (128, 4), (128, 32), (256, 4)):
                cfg = K.decode_config(d, d, rows)
                _show(f"decode persistent d{d} rows {rows} {cfg['BLOCK_M']}x{cfg['BLOCK_N']} s{cfg['num_stages']} "
                      f"{cache}", decode_persistent(d, rows, cache))
    if which in ("other", "all"):
        for name, r in other().items():
            _show(name, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
