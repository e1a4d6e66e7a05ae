"""Llama-family causal LM written for serving: flat ragged token rows, explicit positions,
a token-slot KV pool, logits only for the rows asked for, and capture of the hidden states
EAGLE drafts consume."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from models.attention import AttentionMetadata, KVPool
from models.config import DecoderShape, rope_parameters
from models.layers import DecoderLayer, RMSNorm, RotaryEmbedding


class LlamaModel(nn.Module):
    def __init__(self, shape: DecoderShape, hf_config: Any):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary = RotaryEmbedding(*rope_parameters(hf_config, shape.head_dim))


class LlamaForCausalLM(nn.Module):
    """Module names follow Hugging Face (`model.layers.N.self_attn.q_proj`, `lm_head`)."""

    def __init__(self, hf_config: Any, where: str = "config.json"):
        super().__init__()
        self.shape = DecoderShape.from_hf(hf_config, where)
        self.model = LlamaModel(self.shape, hf_config)
        self.lm_head = nn.Linear(self.shape.hidden_size, self.shape.vocab_size, bias=False)
        if self.shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_kv_pool(self, num_slots: int, dtype: torch.dtype, device) -> KVPool:
        s = self.shape
        return KVPool(s.num_layers, num_slots, s.num_kv_heads, s.head_dim, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVPool,
        aux_layer_ids: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids (T,) -> (final normed hidden (T, H), aux (T, len(aux_layer_ids) * H) or None).

        aux concatenates the INPUTS of the listed layers (the residual stream entering them),
        in the listed order: what EAGLE-3 consumes.
        """
        h = self.model.embed_tokens(input_ids)  # (T, H)
        cos, sin = self.model.rotary(meta.positions, h.dtype)
        captured: dict[int, torch.Tensor] = {}
        wanted = set(aux_layer_ids or ())
        for i, layer in enumerate(self.model.layers):
            if i in wanted:
                captured[i] = h
            h = layer(h, cos, sin, kv.k[i], kv.v[i], meta)
        aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return self.model.norm(h), aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) -> (R, V) float32."""
        return self.lm_head(hidden).float()
