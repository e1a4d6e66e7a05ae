"""Building blocks of Llama-family decoders (Llama, Qwen2, Qwen3, Mistral, SmolLM2), named like the
Hugging Face modules so checkpoints load by name."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import AttentionMetadata, paged_attention
from models.config import DecoderShape


def _stack(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the listed linears' outputs side by side (same input)."""
    first = linears[0]
    has_bias = first.bias is not None
    out = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=has_bias,
                    dtype=first.weight.dtype, device=first.weight.device)
    with torch.no_grad():
        out.weight.copy_(torch.cat([m.weight for m in linears]))
        if has_bias:
            out.bias.copy_(torch.cat([m.bias for m in linears]))
    return out


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for explicit positions; inv_freq comes from transformers' RoPE rules (any scaling)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, 1, D) for `apply_rotary`, computed once per forward pass.
        sin's first half is negated here, so that every layer's rotation needs no negation."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # (T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        half = freqs.shape[1]
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D), cos/sin (T, 1, D) from RotaryEmbedding: x * cos + rotate_half(x) * sin,
    where rotate_half(x) = cat(-x2, x1) = roll(x, D/2) with the sign carried by sin (exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    """GQA self-attention over the KV pool. `input_width` is 2H for the EAGLE-3 midlayer."""

    def __init__(self, shape: DecoderShape, input_width: int | None = None):
        super().__init__()
        width = input_width or shape.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=shape.attention_bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=shape.attention_bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=shape.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, shape.hidden_size, bias=shape.o_bias)
        self.scale = self.head_dim**-0.5
        if shape.qk_norm:  # Qwen3: one RMSNorm over head_dim, shared by every q (k) head
            self.q_norm = RMSNorm(self.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, shape.rms_norm_eps)
        self.qk_norm = shape.qk_norm
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections (serving only)
        self.kernel = False  # attend through our C++ CPU kernel (models.cpu_kernels, serving only)

    def fuse_projections(self) -> None:
        """Replace q/k/v_proj by one linear over their stacked weights: one weight pass per token
        instead of three (what a decode step is bound by on CPU). Checkpoints load before this."""
        self.qkv_proj = _stack([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, W) -> q and k heads side by side (T, Hq + Hkv, D), v (T, Hkv, D): RoPE then
        rotates q and k in one pass."""
        t, qk_width = x.shape[0], (self.num_heads + self.num_kv_heads) * self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)  # (T, (Hq + 2 Hkv) * D)
            qk, v = qkv[:, :qk_width], qkv[:, qk_width:]
        else:
            qk, v = torch.cat([self.q_proj(x), self.k_proj(x)], dim=-1), self.v_proj(x)
        return qk.view(t, -1, self.head_dim), v.view(t, -1, self.head_dim)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qk, v = self.project(x)  # (T, Hq + Hkv, D), (T, Hkv, D)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.kernel)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=shape.mlp_bias)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=shape.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse_projections (serving only)

    def fuse_projections(self) -> None:
        """Replace gate/up_proj by one linear over their stacked weights (see Attention's)."""
        self.gate_up_proj = _stack([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I) each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, h, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))
