"""Peers: the plain PyTorch formulation a user would write (eager), torch.compile of that same function,
and Liger Kernel where it is importable. A peer that cannot be built is returned with `missing` set
(the reason), never raised. Also the fp32 references every implementation is checked against.

Liger 0.8.5 entry points used (forward only, under torch.no_grad, as inference calls them):
  LigerRMSNormFunction.apply(X, W, eps)                      casting_mode "llama" (its default)
  LigerFusedAddRMSNormFunction.apply(X, R, W, eps) -> (Y, S)  S = X + R
  LigerLayerNormFunction.apply(X, W, B, eps)
  LigerFusedGateUpSiLUMulFunction.apply(Y)                    Y = [gate | up], the layout ours takes
  LigerSiLUMulFunction.apply(a, b), LigerGELUMulFunction.apply(a, b)   (tanh GeLU); both wrap forward in
      ensure_contiguous, so slices of one [gate | up] tensor would be copied first: they get separate
      contiguous a and b, prepared outside the timing (what a model with separate gate/up projections has)
  LigerRopeFunction.apply(q, k, cos, sin)   q [B, H, T, D] as a transposed view of [B, T, H, D] storage
      (Hugging Face layout), rotated in place; cos/sin [1, T, rotary_dim] gathered per token
"""

import importlib

import torch
import torch.nn.functional as F

from .harness import Impl

# ----------------------------------------------------------------------------------------------------
# builders


def eager(name: str, fn, note: str = "", **kw) -> Impl:
    return Impl(name=name, kind="eager", fn=fn, note=note, **kw)


_dynamo_ready = False


def configure_dynamo() -> None:
    """Every case compiles its own static-shape graph: raise the recompile limits once."""
    global _dynamo_ready
    if _dynamo_ready:
        return
    import torch._dynamo

    cfg = torch._dynamo.config
    for name, value in (("cache_size_limit", 1024), ("recompile_limit", 1024),
                        ("accumulated_cache_size_limit", 8192), ("accumulated_recompile_limit", 8192)):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), value))
    import torch._inductor.config

    # No pool of compile workers: they keep the host busy after a compile, which slowed the launches
    # of whatever was timed next in a first run (up to 80% on the smallest norm shapes).
    torch._inductor.config.compile_threads = 1
    _dynamo_ready = True


def reset_compiled() -> None:
    """Drop compiled graphs between cases, so a new shape is compiled static, not made dynamic."""
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:
        pass


def compiled(fn, name: str = "torch.compile", note: str = "", **kw) -> Impl:
    """torch.compile(fn) with the default mode and static shapes; it compiles on its first call, which
    the harness makes outside the timing (the correctness check)."""
    try:
        configure_dynamo()
        cfn = torch.compile(fn, dynamic=False)
    except Exception as e:
        return Impl(name=name, kind="compile", missing=f"{type(e).__name__}: {e}")
    return Impl(name=name, kind="compile", fn=cfn, note=note or "torch.compile of the eager function, "
                "default mode, static shapes", **kw)


def liger_attr(module: str, attr: str):
    """(object, None) or (None, reason) for liger_kernel.<module>.<attr>."""
    try:
        mod = importlib.import_module(f"liger_kernel.{module}")
    except Exception as e:
        return None, f"liger_kernel not importable ({type(e).__name__}: {e})"
    obj = getattr(mod, attr, None)
    if obj is None:
        return None, f"liger_kernel.{module} has no {attr} in this version"
    return obj, None


def liger(name: str, module: str, attr: str, call, note: str = "", **kw) -> Impl:
    """A Liger peer: `call(obj)` builds the timed function from liger_kernel.<module>.<attr>."""
    obj, why = liger_attr(module, attr)
    if obj is None:
        return Impl(name=name, kind="liger", missing=why)
    return Impl(name=name, kind="liger", fn=call(obj), note=note or f"{attr}", **kw)


def dist_version(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        import importlib.metadata

        return importlib.metadata.version(dist)
    except Exception:
        return None


def liger_version() -> str | None:
    version = dist_version("liger-kernel")
    if version:
        return version
    try:
        import liger_kernel

        return getattr(liger_kernel, "__version__", "unknown")
    except Exception:
        return None


# ----------------------------------------------------------------------------------------------------
# norms: eager formulations (fp32 math, one rounding) and references (fp32, unrounded)


def rms_eager(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rms_ref(x, w, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def layer_ref(x, w, b, eps, gelu=None):
    y = F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps)
    return F.gelu(y, approximate=gelu) if gelu else y


def norm_peers(kind: str, residual: bool, eps: float, gelu: str | None = None) -> list:
    """Peers for rms_norm / layer_norm / layer_norm_gelu, taking the case's inputs:
    rms: (x, w) or (x, residual, w); layer: (x, w, b)."""
    if kind == "rms" and not residual:
        def eager_fn(x, w):
            return rms_eager(x, w, eps)

        return [
            eager("torch eager", eager_fn, "x.float() · rsqrt(mean(x²) + eps) · w, rounded once"),
            eager("F.rms_norm", lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps),
                  "torch.nn.functional.rms_norm"),
            compiled(eager_fn),
            liger("liger", "ops.rms_norm", "LigerRMSNormFunction", lambda f: (lambda x, w: f.apply(x, w, eps)),
                  "LigerRMSNormFunction (casting mode llama)"),
        ]
    if kind == "rms":
        def eager_fn(x, res, w):
            r = x + res
            return rms_eager(r, w, eps), r

        peers = [eager("torch eager", eager_fn, "r = x + residual; rms_norm(r) in fp32 math"), compiled(eager_fn)]
        fused = liger("liger", "ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction",
                      lambda f: (lambda x, res, w: f.apply(x, res, w, eps)),
                      "LigerFusedAddRMSNormFunction (one kernel, returns (y, x + residual))")
        if fused.missing is not None:  # older Liger: no fused residual op; a user adds in eager first
            def unfused(f):
                def fn(x, res, w):
                    r = x + res
                    return f.apply(r, w, eps), r
                return fn

            fused = liger("liger", "ops.rms_norm", "LigerRMSNormFunction", unfused,
                          "eager x + residual, then LigerRMSNormFunction (no fused residual op in this Liger)")
        return peers + [fused]
    if residual:
        raise ValueError("layer_norm with a residual has no suite case")
    if gelu is None:
        def eager_fn(x, w, b):
            return F.layer_norm(x, (x.shape[-1],), w, b, eps)

        return [
            eager("torch eager", eager_fn, "F.layer_norm"),
            compiled(eager_fn),
            liger("liger", "ops.layer_norm", "LigerLayerNormFunction",
                  lambda f: (lambda x, w, b: f.apply(x, w, b, eps)), "LigerLayerNormFunction"),
        ]

    def eager_fn(x, w, b):
        return F.gelu(F.layer_norm(x, (x.shape[-1],), w, b, eps), approximate=gelu)

    def liger_then_gelu(f):
        return lambda x, w, b: F.gelu(f.apply(x, w, b, eps), approximate=gelu)

    return [
        eager("torch eager", eager_fn, f"F.gelu(F.layer_norm(x), approximate={gelu!r})"),
        compiled(eager_fn),
        liger("liger", "ops.layer_norm", "LigerLayerNormFunction", liger_then_gelu,
              "LigerLayerNormFunction, then eager F.gelu (Liger has no fused LayerNorm+GeLU)"),
    ]


# ----------------------------------------------------------------------------------------------------
# gated activations on x = [gate | up]


def gated_ref(x, act):
    d = x.shape[-1] // 2
    g, u = x[..., :d].float(), x[..., d:].float()
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return a * u


def _split_contiguous(x):
    d = x.shape[-1] // 2
    return x[..., :d].contiguous(), x[..., d:].contiguous()


def gated_peers(act: str) -> list:
    """Peers for silu_and_mul / gelu_and_mul(tanh); the case's input is (x,) with x = [gate | up]."""
    if act == "silu":
        def eager_fn(x):
            d = x.shape[-1] // 2
            return F.silu(x[..., :d]) * x[..., d:]

        note = "F.silu(x[..., :d]) * x[..., d:]"
    else:
        def eager_fn(x):
            d = x.shape[-1] // 2
            return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]

        note = "F.gelu(x[..., :d], approximate='tanh') * x[..., d:]"
    peers = [eager("torch eager", eager_fn, note), compiled(eager_fn)]
    if act == "silu":
        peers.append(liger("liger", "ops.swiglu", "LigerFusedGateUpSiLUMulFunction",
                           lambda f: (lambda x: f.apply(x)),
                           "LigerFusedGateUpSiLUMulFunction on the [gate | up] tensor (ours' layout)"))
        peers.append(liger("liger (a, b)", "ops.swiglu", "LigerSiLUMulFunction", lambda f: (lambda a, b: f.apply(a, b)),
                           "LigerSiLUMulFunction(a, b) on separate contiguous gate and up tensors, split "
                           "outside the timing", prepare=_split_contiguous))
    else:
        peers.append(liger("liger (a, b)", "ops.geglu", "LigerGELUMulFunction", lambda f: (lambda a, b: f.apply(a, b)),
                           "LigerGELUMulFunction(a, b) (tanh GeLU) on separate contiguous gate and up tensors, "
                           "split outside the timing; Liger has no [gate | up] GeGLU", prepare=_split_contiguous))
    return peers


# ----------------------------------------------------------------------------------------------------
# rotary (NeoX), inputs (q [T, Hq, D], k [T, Hk, D], cos_sin_cache [max_pos, rot], positions [T])


def _rotate_neox(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_ref(q, k, cache, positions):
    cos, sin = cache.index_select(0, positions).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return _rotate_neox(q, cos, sin), _rotate_neox(k, cos, sin)


def rope_eager(q, k, cache, positions):
    """vLLM's forward_native formulation (full rotary width): gather, rotate in fp32, new tensors."""
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return _rotate_neox(q, cos, sin).to(q.dtype), _rotate_neox(k, cos, sin).to(k.dtype)


def _liger_rope_inputs(q, k, cache, positions):
    """Hugging Face layout for Liger: [1, H, T, D] views of the [T, H, D] storage (so Liger rotates in
    place, no copy), and cos/sin [1, T, rot] = cat(half, half) gathered by position."""
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(0).contiguous()
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(0).contiguous()
    return q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), cos, sin


def _liger_rope_canon(out):
    q, k = out
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


def rope_peers() -> list:
    return [
        eager("torch eager", rope_eager, "gather cos/sin by position, rotate in fp32, out of place"),
        compiled(rope_eager),
        liger("liger", "ops.rope", "LigerRopeFunction", lambda f: (lambda q, k, cos, sin: f.apply(q, k, cos, sin)),
              "LigerRopeFunction on [1, H, T, D] views of the same storage (in place); cos/sin fp32 "
              "[1, T, 128] gathered by position outside the timing",
              prepare=_liger_rope_inputs, canon=_liger_rope_canon),
    ]
