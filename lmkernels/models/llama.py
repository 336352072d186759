"""The Llama family (Llama 2/3, Mistral, Qwen2 with q/k/v bias, Qwen3 with per-head q/k RMSNorm, SmolLM2),
built only from lmkernels ops and torch matmuls, over a paged KV cache.

Per layer, with the residual stream r and the fused residual-add + RMSNorm of lmkernels.ops.norm:

    x, r   = rms_norm(h, w_in, eps, r)              (the first layer: x = rms_norm(h), r = h)
    q|k|v  = x W_qkvᵀ (+ b)                         one fused projection, split into heads
    q, k   = rms_norm(q, w_q), rms_norm(k, w_k)    Qwen3 only, per head over head_dim
    q, k   = rope(q, k, positions)                 in place (NeoX pairs)
    cache  ← k, v at slot_mapping                  write_kv_cache
    o      = attention(q, cache)                   prefill (varlen) / append prefill / paged decode
    h      = o W_oᵀ
    x, r   = rms_norm(h, w_post, eps, r)
    h      = silu_and_mul(x W_gate|upᵀ) W_downᵀ
final: x = rms_norm(h, w_norm, eps, r) on the rows that need logits, logits = x W_lm_headᵀ.

A step of at most FEW_ROWS tokens (decode) on the Triton kernels runs the same math as four fused gemv passes per layer
(lmkernels.ops.gemv), carrying the residual stream h alone:

    h = h + attention(rms_norm(h, w_in) W_qkvᵀ) W_oᵀ       (norm, rotary and the KV-cache write in the qkv gemv,
                                                             residual add in the o gemv)
    h = h + silu_and_mul(rms_norm(h, w_post) W_gate|upᵀ) W_downᵀ

Weights are stored fused (q|k|v and gate|up) and filled by `load_hf_weights` from Hugging Face names, which both
the safetensors and the GGUF loaders produce.
"""

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .._utils import use_triton
from ..ops.activation import silu_and_mul
from ..ops.attention import (
    ATTN_DTYPES, attention_decode, attention_prefill, attention_prefill_paged, reference as attn_reference,
    write_kv_cache,
)
from ..ops.gemv import gemv, gemv_qkv
from ..ops.norm import rms_norm
from ..ops.rope import apply_rotary, build_cos_sin_cache
from .config import ModelConfig
from .metadata import AttentionMetadata, KVCache


# Decode steps of up to this many tokens take the gemv layers: on the H100 they beat cuBLAS with the unfused
# neighbours at 1 and 2 rows and break even at 4; at 8 rows cuBLAS streams 20–40% faster (benchmarks/NOTES.md).
FEW_ROWS = 4


def _param(*shape, dtype, device):
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class _Weight(nn.Module):
    """A container for `weight` (and `bias`) parameters, so state_dict names read like HF's."""

    def __init__(self, *shape, bias=False, dtype, device):
        super().__init__()
        self.weight = _param(*shape, dtype=dtype, device=device)
        self.bias = _param(shape[0], dtype=dtype, device=device) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


# ------------------------------------------------------------------------------------------------------------
# attention through the lmkernels ops


def _check_fp32(q):
    if q.device.type != "cpu":
        raise ValueError(f"lmkernels attention takes float16/bfloat16 on {q.device.type}; float32 models run on "
                         f"the CPU only (through the attention reference)")


def _attend_prefill(q, k, v, meta: AttentionMetadata, k_cache, v_cache, window, scale):
    paged = meta.block_tables is not None
    if q.dtype in ATTN_DTYPES:
        if paged:
            return attention_prefill_paged(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens, meta.seq_lens,
                                           max_seqlen_q=meta.max_seqlen, causal=True, scale=scale, window=window)
        return attention_prefill(q, k, v, cu_seqlens_q=meta.cu_seqlens, cu_seqlens_k=meta.cu_seqlens,
                                 max_seqlen_q=meta.max_seqlen, causal=True, scale=scale, window=window)
    # float32 on the CPU: the public ops take fp16/bf16 only; their CPU path is exactly this reference
    _check_fp32(q)
    if paged:
        return attn_reference.attention_prefill_paged(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens,
                                                      meta.seq_lens, causal=True, scale=scale, window=window)[0]
    return attn_reference.attention_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, causal=True, scale=scale,
                                           window=window)[0]


def _attend_decode(q, meta: AttentionMetadata, k_cache, v_cache, window, scale):
    if q.dtype in ATTN_DTYPES:
        return attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale=scale, window=window,
                                max_seqlen_k=meta.max_seqlen_k)
    _check_fp32(q)
    return attn_reference.attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale=scale,
                                           window=window)[0]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, device):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = _Weight(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, bias=cfg.qkv_bias, dtype=dtype,
                                device=device)
        self.o_proj = _Weight(cfg.hidden_size, cfg.q_size, bias=cfg.o_bias, dtype=dtype, device=device)
        if cfg.qk_norm:
            self.q_norm = _Weight(cfg.head_dim, dtype=dtype, device=device)
            self.k_norm = _Weight(cfg.head_dim, dtype=dtype, device=device)
        w = cfg.sliding_windows[layer] if cfg.sliding_windows else None
        self.window = (w - 1, -1) if w else (-1, -1)  # HF: keys in (pos − w, pos]
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, x, positions, cos_sin, meta: AttentionMetadata, k_cache, v_cache):
        return self.o_proj(self.attend(self.qkv_proj(x), positions, cos_sin, meta, k_cache, v_cache))

    def fused_qkv_ok(self, meta: AttentionMetadata, k_cache, cos_sin) -> bool:
        """Whether gemv_qkv can stand in for qkv → rotary → cache write: a decode step, no per-head q/k norm
        (it sits between the projection and the rotary), rotary over the whole head, a cache in the model's dtype."""
        c = self.cfg
        return (not meta.is_prefill and not c.qk_norm and cos_sin.shape[1] == c.head_dim and c.head_dim % 16 == 0
                and k_cache.dtype == self.qkv_proj.weight.dtype)

    def attend(self, qkv, positions, cos_sin, meta: AttentionMetadata, k_cache, v_cache):
        """q|k|v [T, ·] → attention output [T, q_size] (before o_proj); writes k, v to the cache."""
        c = self.cfg
        t = qkv.shape[0]
        q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size: c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            # per head; the heads of the fused qkv rows are not one uniform stride of rows, hence the reshape
            q = rms_norm(q.reshape(-1, c.head_dim), self.q_norm.weight, c.rms_norm_eps).view(q.shape)
            k = rms_norm(k.reshape(-1, c.head_dim), self.k_norm.weight, c.rms_norm_eps).view(k.shape)
        apply_rotary(q, k, cos_sin, positions, is_neox=True)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            o = _attend_prefill(q, k, v, meta, k_cache, v_cache, self.window, self.scale)
        else:
            o = self.decode(q, meta, k_cache, v_cache)
        return o.reshape(t, c.q_size)

    def decode(self, q, meta: AttentionMetadata, k_cache, v_cache):
        """Paged decode attention of the step's queries (any view with Q · heads · head_dim per sequence)."""
        c = self.cfg
        b, nq = meta.seq_lens.shape[0], meta.decode_query_len
        return _attend_decode(q.view(b, nq, c.num_heads, c.head_dim), meta, k_cache, v_cache, self.window, self.scale)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        self.gate_up_proj = _Weight(2 * cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype,
                                    device=device)
        self.down_proj = _Weight(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype,
                                 device=device)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, device):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _Weight(cfg.hidden_size, dtype=dtype, device=device)
        self.self_attn = Attention(cfg, layer, dtype, device)
        self.post_attention_layernorm = _Weight(cfg.hidden_size, dtype=dtype, device=device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, h, residual, positions, cos_sin, meta, k_cache, v_cache):
        if residual is None:
            x, residual = rms_norm(h, self.input_layernorm.weight, self.eps), h
        else:
            x, residual = rms_norm(h, self.input_layernorm.weight, self.eps, residual)
        h = self.self_attn(x, positions, cos_sin, meta, k_cache, v_cache)
        x, residual = rms_norm(h, self.post_attention_layernorm.weight, self.eps, residual)
        return self.mlp(x), residual

    def forward_few_rows(self, h, positions, cos_sin, meta, k_cache, v_cache):
        """The same layer for a step of a few tokens (decode), on the residual stream h alone: four gemv passes
        over the weights, each carrying its neighbours (norm before, SwiGLU or the residual add after)."""
        attn, mlp, c = self.self_attn, self.mlp, self.self_attn.cfg
        if attn.fused_qkv_ok(meta, k_cache, cos_sin):  # decode: rotary and the cache write ride on the qkv pass
            q = gemv_qkv(h, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=self.input_layernorm.weight,
                         eps=self.eps, num_heads=c.num_heads, cos_sin_cache=cos_sin, positions=positions,
                         k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping)
            o = attn.decode(q, meta, k_cache, v_cache).reshape(q.shape)
        else:
            qkv = gemv(h, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=self.input_layernorm.weight,
                       eps=self.eps)
            o = attn.attend(qkv, positions, cos_sin, meta, k_cache, v_cache)
        h = gemv(o, attn.o_proj.weight, attn.o_proj.bias, residual=h)
        a = gemv(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm_weight=self.post_attention_layernorm.weight,
                 eps=self.eps, gated=True)
        return gemv(a, mlp.down_proj.weight, mlp.down_proj.bias, residual=h)


def rope_cache(cfg: ModelConfig, max_position: int) -> torch.Tensor:
    """The float32 [max_position, head_dim] cos|sin cache of the config's rope (HF rope_parameters, or a GGUF's
    rope_freqs factors, which divide the default frequencies)."""
    if cfg.rope_freq_factors is None:
        return build_cos_sin_cache(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
    factors = torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)
    if factors.numel() != cfg.head_dim // 2:
        raise ValueError(f"rope_freqs has {factors.numel()} factors, expected head_dim / 2 = {cfg.head_dim // 2}")
    j = torch.arange(cfg.head_dim // 2, dtype=torch.float64)
    theta = cfg.rope_theta ** (-2 * j / cfg.head_dim) / factors
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * theta[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], attn_metadata, kv_cache) → logits [N, vocab] for the rows in
    attn_metadata.logits_indices (default: each sequence's last new token)."""

    def __init__(self, config, *, dtype=torch.bfloat16, device=None, max_model_len: Optional[int] = None):
        super().__init__()
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
        self.config = cfg.validate()
        self.dtype = dtype
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        self.embed_tokens = _Weight(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = _Weight(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = None if cfg.tie_word_embeddings else _Weight(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                                                     device=device)
        self.register_buffer("cos_sin_cache", rope_cache(cfg, self.max_model_len).to(device), persistent=False)
        self.fused_decode = True  # False: decode steps take the matmul path too (to compare)

    def few_rows_path(self, h: torch.Tensor) -> bool:
        """Steps of at most FEW_ROWS tokens (decode) run the fused gemv layers on the Triton kernels."""
        return self.fused_decode and 0 < h.shape[0] <= FEW_ROWS and h.dtype in ATTN_DTYPES and use_triton(h)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def allocate_kv_cache(self, num_pages: int, page_size: int, dtype=None) -> KVCache:
        return KVCache.allocate(self.config, num_pages, page_size, dtype or self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        meta = attn_metadata
        h = F.embedding(input_ids, self.embed_tokens.weight)
        if self.few_rows_path(h):
            for i, layer in enumerate(self.layers):
                h = layer.forward_few_rows(h, positions, self.cos_sin_cache, meta, kv_cache.k[i], kv_cache.v[i])
            idx = meta.default_logits_indices(input_ids.shape[0])
            if idx is not None:
                h = h[idx]
            return gemv(h, self.lm_head_weight, norm_weight=self.norm.weight, eps=self.config.rms_norm_eps)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, positions, self.cos_sin_cache, meta, kv_cache.k[i], kv_cache.v[i])
        idx = meta.default_logits_indices(input_ids.shape[0])
        if idx is not None:
            h, residual = h[idx], residual[idx]
        x, _ = rms_norm(h, self.norm.weight, self.config.rms_norm_eps, residual)
        return F.linear(x, self.lm_head_weight)

    # --------------------------------------------------------------------------------------------------------
    # weights

    def hf_target(self, name: str):
        """(parameter, row slice or None) that the Hugging Face tensor `name` fills; None for names to skip."""
        c = self.config
        if name.startswith("model."):
            name = name[len("model."):]
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight":
            return (self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight), None
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) >= 4 and parts[1].isdigit() and int(parts[1]) < c.num_layers:
            layer = self.layers[int(parts[1])]
            sub, leaf = ".".join(parts[2:-1]), parts[-1]
            fused = {
                "self_attn.q_proj": ("self_attn.qkv_proj", 0, c.q_size),
                "self_attn.k_proj": ("self_attn.qkv_proj", c.q_size, c.kv_size),
                "self_attn.v_proj": ("self_attn.qkv_proj", c.q_size + c.kv_size, c.kv_size),
                "mlp.gate_proj": ("mlp.gate_up_proj", 0, c.intermediate_size),
                "mlp.up_proj": ("mlp.gate_up_proj", c.intermediate_size, c.intermediate_size),
            }
            if sub in fused:
                target, start, size = fused[sub]
                p = getattr(layer.get_submodule(target), leaf, None)
                return (p, slice(start, start + size)) if p is not None else (None, None)
            try:
                p = getattr(layer.get_submodule(sub), leaf, None)
            except AttributeError:
                p = None
            return p, None
        if name in ("embed_tokens.weight", "norm.weight"):
            return getattr(self, parts[0]).weight, None
        return None, None

    def load_hf_weights(self, tensors: Iterable, *, strict: bool = True) -> None:
        """Fill the parameters from (Hugging Face name, tensor) pairs, fusing q|k|v and gate|up. Raises
        ValueError on an unknown name, a shape mismatch, or (strict) a parameter left unfilled."""
        filled = {}
        with torch.no_grad():
            for name, tensor in tensors:
                target = self.hf_target(name)
                if target is None:
                    continue
                p, rows = target
                if p is None:
                    raise ValueError(f"unexpected weight {name!r} for a {self.config.model_type} model with this "
                                     f"config")
                if p is self.embed_tokens.weight and name.endswith("lm_head.weight"):
                    continue  # tied embeddings: the checkpoint may still carry a copy
                dst = p if rows is None else p[rows]
                if tuple(tensor.shape) != tuple(dst.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(tensor)
                filled.setdefault(id(p), 0)
                filled[id(p)] += dst.numel()
        if strict:
            missing = [n for n, p in self.named_parameters() if filled.get(id(p), 0) != p.numel()]
            if missing:
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                raise ValueError(f"the checkpoint leaves weights unset: {', '.join(missing[:5])}{more}")
