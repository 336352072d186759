"""A DeepSeek-V3 attention layer (MLA) from lmkernels ops, matching Hugging Face transformers'
`DeepseekV3Attention` (interleaved RoPE, YaRN mscale) on the same weights.

    q      = q_b(RMSNorm(q_a(x)))  (or q_proj(x) without a q LoRA)          [T, H, nope + 64]
    kv     = kv_a(x) = [c_kv (512) | k_pe (64)]   → write_latent_cache (RMSNorm + RoPE + paged store, one launch)
    q_pe   = RoPE(q_pe)  (interleaved pairs, lmkernels apply_rotary with is_neox=False)
    prefill: mla_prefill (up-projected k/v, attention_prefill with q/k dim nope + 64 and v dim v_head_dim,
             the cached context merged by LSE)
    decode:  q_lat = q_nope · W_UK (absorbed), o_lat = mla_decode(q_lat, q_pe, cache), o = o_lat · W_UVᵀ
    out    = o_proj(o)
softmax scale = (nope + 64)^−½ · mscale², mscale = 0.1 · mscale_all_dim · ln(factor) + 1 for YaRN (HF's
yarn_apply_mscale); the cos/sin cache carries YaRN's attention factor (HF's attention_scaling). The dense
projections are torch matmuls (lmkernels has no bf16 GEMM op of its own); everything else is lmkernels ops.
kv_lora_rank must be 512 and the rope dim 64 (the latent cache layout).
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..norm import rms_norm
from ..rope import apply_rotary, build_cos_sin_cache
from .api import mla_decode, write_latent_cache
from .prefill import mla_prefill
from .reference import KV_LORA_RANK, ROPE_DIM


def softmax_scale(qk_head_dim: int, rope_parameters: Optional[dict]) -> float:
    scale = qk_head_dim ** -0.5
    rp = rope_parameters or {}
    if rp.get("rope_type", rp.get("type", "default")) != "default" and rp.get("mscale_all_dim"):
        factor = rp["factor"]
        m = 0.1 * rp["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return scale


class DeepseekV3MLA:
    """Weights as Hugging Face names them (nn.Linear weights [out, in]); see from_hf."""

    def __init__(self, weights: dict, *, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                 qk_rope_head_dim: int = ROPE_DIM, kv_lora_rank: int = KV_LORA_RANK, rope_theta: float = 10000.0,
                 rope_parameters: Optional[dict] = None, max_position: int = 4096, rms_norm_eps: float = 1e-6):
        if kv_lora_rank != KV_LORA_RANK or qk_rope_head_dim != ROPE_DIM:
            raise ValueError(f"the latent cache needs kv_lora_rank {KV_LORA_RANK} and qk_rope_head_dim {ROPE_DIM}, got "
                             f"{kv_lora_rank} and {qk_rope_head_dim}")
        self.w = weights
        self.h, self.nope, self.v_dim = num_heads, qk_nope_head_dim, v_head_dim
        self.eps = rms_norm_eps
        self.scale = softmax_scale(qk_nope_head_dim + ROPE_DIM, rope_parameters)
        ref = weights["kv_b_proj.weight"]
        self.cos_sin = build_cos_sin_cache(ROPE_DIM, max_position, rope_theta, rope_parameters,
                                           dtype=torch.float32, device=ref.device)
        w = ref.view(num_heads, qk_nope_head_dim + v_head_dim, KV_LORA_RANK)
        self.w_uk = w[:, :qk_nope_head_dim]  # [H, nope, 512]
        self.w_uv = w[:, qk_nope_head_dim:]  # [H, v, 512]

    @classmethod
    def from_hf(cls, attn, config, *, dtype=None, max_position: Optional[int] = None):
        """From a transformers DeepseekV3Attention module and its config (weights copied, optionally cast)."""
        weights = {k: (v.detach().to(dtype) if dtype else v.detach()).contiguous() for k, v in attn.state_dict().items()}
        rp = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(weights, num_heads=config.num_attention_heads, qk_nope_head_dim=config.qk_nope_head_dim,
                   v_head_dim=config.v_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                   kv_lora_rank=config.kv_lora_rank, rope_theta=theta, rope_parameters=rp or None,
                   max_position=max_position or config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps)

    def _linear(self, x, name):
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _project(self, x, positions, slot_mapping, cache, cache_scales):
        """x [T, hidden] → q_nope [T, H, nope], q_pe [T, H, 64] (rotated); writes the tokens' latents."""
        if "q_proj.weight" in self.w:
            q = self._linear(x, "q_proj")
        else:
            q = self._linear(rms_norm(self._linear(x, "q_a_proj"), self.w["q_a_layernorm.weight"], self.eps),
                             "q_b_proj")
        q = q.view(x.shape[0], self.h, self.nope + ROPE_DIM)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope:].contiguous()
        apply_rotary(q_pe, None, self.cos_sin, positions, is_neox=False)
        kv = self._linear(x, "kv_a_proj_with_mqa")
        write_latent_cache(kv, self.w["kv_a_layernorm.weight"], self.cos_sin, positions, slot_mapping, cache,
                           cache_scales=cache_scales, eps=self.eps)
        return q_nope, q_pe

    def prefill(self, x, positions, cu_seqlens, seq_lens, block_tables, slot_mapping, cache, cache_scales=None,
                chunk_size: int = 8192, plan=None):
        """x [T, hidden] packed new tokens (cu_seqlens [B + 1]), their positions [T] and cache slots [T];
        seq_lens [B] the full lengths after them (plan: the step's mla_prefill_plan, shared by the model's layers).
        Returns [T, hidden]."""
        q_nope, q_pe = self._project(x, positions, slot_mapping, cache, cache_scales)
        o = mla_prefill(q_nope.contiguous(), q_pe, cache, block_tables, cu_seqlens, seq_lens,
                        self.w["kv_b_proj.weight"], scale=self.scale, cache_scales=cache_scales, chunk_size=chunk_size,
                        plan=plan)
        return self._linear(o.reshape(x.shape[0], -1), "o_proj")

    def decode(self, x, positions, seq_lens, block_tables, slot_mapping, cache, cache_scales=None,
               max_seqlen_k: Optional[int] = None, schedule=None):
        """x [B, Q, hidden]: the newest Q tokens of each sequence; positions [B, Q], slot_mapping [B·Q];
        seq_lens [B] the lengths including them. Absorbed MQA over the latent cache (schedule: the step's
        mla_decode_schedule, shared by the model's layers). Returns [B, Q, hidden]."""
        b, n_new = x.shape[:2]
        q_nope, q_pe = self._project(x.reshape(b * n_new, -1), positions.reshape(-1), slot_mapping, cache,
                                     cache_scales)
        q_lat = torch.einsum("thn,hnd->thd", q_nope, self.w_uk).view(b, n_new, self.h, KV_LORA_RANK)
        o_lat, _ = mla_decode(q_lat, q_pe.view(b, n_new, self.h, ROPE_DIM), cache, block_tables, seq_lens,
                              scale=self.scale, cache_scales=cache_scales, max_seqlen_k=max_seqlen_k,
                              schedule=schedule)
        o = torch.einsum("bqhd,hvd->bqhv", o_lat, self.w_uv)
        return self._linear(o.reshape(b, n_new, -1), "o_proj")
