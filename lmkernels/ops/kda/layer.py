"""The KDA layer of Kimi Linear (transformers' `KimiLinearDeltaAttention`), built on kda_prefill / kda_decode and
lmkernels' rms_norm:

    [q|k|v] = SiLU(causal depthwise conv_W([x W_q | x W_k | x W_v]))          (one conv over the 3·H·D channels)
    f = (x W_fa) W_fb   (raw gate; the kernel computes −exp(A_log)·softplus(f + dt_bias), or the safe gate)
    b = x W_b           (β = sigmoid(b) in the kernel); q, k L2-normalised in the kernel
    o = KDA(q, k, v, f, b)
    y = (RMSNorm_D(o) · sigmoid((x W_ga) W_gb)) W_o

State for incremental decoding (`KDACache`): the last W − 1 conv inputs per sequence and the fp32 KDA state
[B, H, D, D]. `forward(x, cache)` with T > 1 is a prefill (continuing from the cache when it holds state), with
T = 1 a recurrent decode step.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..norm import rms_norm
from .api import kda_decode, kda_prefill


@dataclass
class KDACache:
    conv: torch.Tensor  # [B, 3·H·D, W − 1], the last conv inputs
    state: torch.Tensor  # fp32 [B, H, D, D]

    @classmethod
    def empty(cls, batch, layer, device=None, dtype=torch.float32):
        c = 3 * layer.num_heads * layer.head_dim
        return cls(torch.zeros(batch, c, layer.conv_size - 1, device=device, dtype=dtype),
                   torch.zeros(batch, layer.num_heads, layer.head_dim, layer.head_dim, device=device,
                               dtype=torch.float32))


class KDALayer(nn.Module):
    def __init__(self, hidden_size, num_heads, head_dim, conv_size=4, eps=1e-6, lower_bound=None):
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim, self.conv_size = hidden_size, num_heads, head_dim, conv_size
        self.eps, self.lower_bound = eps, lower_bound
        d = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, d, bias=False)
        self.k_proj = nn.Linear(hidden_size, d, bias=False)
        self.v_proj = nn.Linear(hidden_size, d, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * d, conv_size))
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, d, bias=False)
        self.o_norm_weight = nn.Parameter(torch.ones(head_dim))
        self.o_proj = nn.Linear(d, hidden_size, bias=False)
        nn.init.normal_(self.conv_weight, std=conv_size ** -0.5)

    @classmethod
    def from_hf(cls, m, lower_bound=None):
        """Copy the weights of a transformers KimiLinearDeltaAttention module."""
        layer = cls(m.hidden_size, m.num_heads, m.head_dim, m.conv_kernel_size, m.layer_norm_epsilon, lower_bound)
        layer = layer.to(device=m.q_proj.weight.device, dtype=m.q_proj.weight.dtype)
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
                getattr(layer, name).weight.copy_(getattr(m, name).weight)
            layer.f_a_proj.weight.copy_(m.forget_gate.f_a_proj.weight)
            layer.f_b_proj.weight.copy_(m.forget_gate.f_b_proj.weight)
            layer.dt_bias.copy_(m.forget_gate.dt_bias)
            layer.A_log.copy_(m.forget_gate.A_log.reshape(-1))
            layer.conv_weight.copy_(m.conv1d.weight.squeeze(1))
            layer.o_norm_weight.copy_(m.o_norm.weight)
        return layer

    def _conv(self, mixed, cache):
        """mixed [B, C, T] → SiLU(causal depthwise conv) [B, C, T]; updates cache.conv."""
        w = self.conv_size
        prev = cache.conv.to(mixed.dtype) if cache is not None else mixed.new_zeros(*mixed.shape[:2], w - 1)
        full = torch.cat([prev, mixed], -1)
        if cache is not None:
            cache.conv.copy_(full[..., full.shape[-1] - (w - 1):])
        return F.silu(F.conv1d(full, self.conv_weight.unsqueeze(1).to(mixed.dtype), groups=full.shape[1]))

    def forward(self, x: torch.Tensor, cache: Optional[KDACache] = None) -> torch.Tensor:
        """x [B, T, hidden] → [B, T, hidden]. With a cache: T > 1 continues a prefill from cache.state (zero it for a
        new sequence), T = 1 is one decode step; both update the cache in place."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1).transpose(1, 2)
        q, k, v = self._conv(mixed, cache).transpose(1, 2).reshape(B, T, 3, H, D).unbind(2)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, D)
        b = self.b_proj(x)
        kw = dict(A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound, l2norm_qk=True,
                  beta_sigmoid=True)
        if cache is None:
            o, _ = kda_prefill(q, k, v, f, b, **kw)
        else:
            idx = torch.arange(B, device=x.device, dtype=torch.int32)
            if T == 1:
                o = kda_decode(q, k, v, f, b, cache.state, idx, **kw)
            else:
                o, _ = kda_prefill(q, k, v, f, b, state_pool=cache.state, state_indices=idx, **kw)
        gate = self.g_b_proj(self.g_a_proj(x)).view(B, T, H, D)
        y = rms_norm(o.float(), self.o_norm_weight.float(), self.eps) * torch.sigmoid(gate.float())
        return self.o_proj(y.to(x.dtype).reshape(B, T, H * D))
