"""Draft models behind one interface: EAGLE, EAGLE-3 heads and standalone LMs.

    draft_forward(input_ids (T,), hidden (T, W) | None, meta, kv, from_target) ->
        (recurrent (T, Hd) | None, head_hidden (T, Hd))
    topk(head_hidden (R, Hd), k) -> (probs (R, k) float32, target-vocab ids (R, k) long)

EAGLE-3 heads and standalone LMs may propose from a draft vocabulary smaller than the target's
(`draft_vocab_size`, mapped to target ids by `d2t`; `spec.vocab`). `from_target` tells EAGLE-3
whether `hidden` holds target aux rows (mapped by `fc`) or its own recurrent state; widths are
checked by the runner against `spec/` before this is called.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from models.attention import AttentionMetadata, KVPool
from models.config import DecoderShape, rope_parameters
from models.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from models.llama import LlamaForCausalLM
from spec.shapes import cfg_get
from spec.vocab import to_target, vocab_ids


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = logits.float().softmax(dim=-1)
    return probs.topk(k, dim=-1)


class _SingleLayerDraft(nn.Module):
    """Shared plumbing of EAGLE heads: one attention layer, RoPE, a one-layer KV pool."""

    shape: DecoderShape

    def make_kv_pool(self, num_slots: int, dtype: torch.dtype, device) -> KVPool:
        s = self.shape
        return KVPool(1, num_slots, s.num_kv_heads, s.head_dim, dtype, device)


class Eagle3Draft(_SingleLayerDraft):
    """EAGLE-3 head in the public layout: fc, midlayer.*, norm, lm_head, d2t, t2d[, embed_tokens]."""

    def __init__(self, hf_config: Any, target_vocab_size: int, input_width: int, where: str = "config.json"):
        super().__init__()
        self.shape = DecoderShape.from_hf(hf_config, where, eagle_head=True)
        hidden = self.shape.hidden_size
        self.draft_vocab_size = int(cfg_get(hf_config, "draft_vocab_size", self.shape.vocab_size))
        self.embed_tokens = nn.Embedding(target_vocab_size, hidden)
        self.fc = nn.Linear(input_width, hidden, bias=False)
        self.midlayer = Eagle3Layer(self.shape)
        self.norm = RMSNorm(hidden, self.shape.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(target_vocab_size, dtype=torch.bool))
        self.rotary = RotaryEmbedding(*rope_parameters(hf_config, self.shape.head_dim))

    def draft_forward(self, input_ids, hidden, meta: AttentionMetadata, kv: KVPool, from_target: bool):
        if from_target:
            hidden = self.fc(hidden)  # (T, num_aux * Ht) -> (T, Hd)
        embeds = self.embed_tokens(input_ids)
        cos, sin = self.rotary(meta.positions, embeds.dtype)
        out = self.midlayer(embeds, hidden, cos, sin, kv.k[0], kv.v[0], meta)
        return out, self.norm(out)

    def topk(self, head_hidden: torch.Tensor, k: int):
        probs, draft_ids = _topk(self.lm_head(head_hidden), k)
        return probs, to_target(draft_ids, self.d2t)


class Eagle3Layer(nn.Module):
    """Attention over cat(norm(embed), hidden_norm(h)) (2H wide); the residual is h."""

    def __init__(self, shape: DecoderShape):
        super().__init__()
        hidden = shape.hidden_size
        self.input_layernorm = RMSNorm(hidden, shape.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, shape.rms_norm_eps)
        self.self_attn = Attention(shape, input_width=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, embeds, hidden, cos, sin, k_cache, v_cache, meta):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (T, 2H)
        h = hidden + self.self_attn(x, cos, sin, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleDraft(_SingleLayerDraft):
    """EAGLE(-2) head: fc over cat(embed, hidden), one decoder layer without input norm,
    and the target's embeddings and LM head. Layout: fc.{weight,bias}, layers.0.*."""

    def __init__(self, hf_config: Any, where: str = "config.json"):
        super().__init__()
        self.shape = DecoderShape.from_hf(hf_config, where)
        hidden = self.shape.hidden_size
        self.embed_tokens = nn.Embedding(self.shape.vocab_size, hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(cfg_get(hf_config, "bias", True)))
        self.layers = nn.ModuleList([EagleLayer(self.shape)])
        self.lm_head = nn.Linear(hidden, self.shape.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(*rope_parameters(hf_config, self.shape.head_dim))

    def draft_forward(self, input_ids, hidden, meta: AttentionMetadata, kv: KVPool, from_target: bool):
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden], dim=-1))  # (T, H)
        cos, sin = self.rotary(meta.positions, x.dtype)
        out = self.layers[0](x, cos, sin, kv.k[0], kv.v[0], meta)
        return out, out

    def topk(self, head_hidden: torch.Tensor, k: int):
        return _topk(self.lm_head(head_hidden), k)


class EagleLayer(nn.Module):
    def __init__(self, shape: DecoderShape):
        super().__init__()
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        h = x + self.self_attn(x, cos, sin, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class StandaloneDraft(LlamaForCausalLM):
    """Any Llama-family LM used as a draft; carries no hidden state between steps.

    With a `draft_vocab_size` below vocab_size (and `d2t` in its checkpoint) it proposes only
    those ids, a frequency-ranked hot vocabulary (as FR-Spec and SGLang's speculative token map):
    its LM head keeps just their rows, the bulk of a small draft's weights and of what each draft
    step reads (49152 x 256 of SmolLM2's 4-layer draft). Its inputs still embed every id."""

    def __init__(self, hf_config: Any, where: str = "config.json"):
        super().__init__(hf_config, where)
        self.draft_vocab_size = int(cfg_get(hf_config, "draft_vocab_size", self.shape.vocab_size))
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))

    def keep_draft_vocab_rows(self) -> None:
        """After loading: an LM head of the draft vocabulary's rows only (copied, so a tied
        embedding keeps every row)."""
        if self.draft_vocab_size == self.shape.vocab_size:
            return
        rows = self.lm_head.weight.detach()[vocab_ids(self.d2t)]  # (Vd, H)
        self.lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype, device=rows.device)
        self.lm_head.weight = nn.Parameter(rows, requires_grad=False)

    def draft_forward(self, input_ids, hidden, meta: AttentionMetadata, kv: KVPool, from_target: bool):
        head_hidden, _ = self(input_ids, meta, kv)
        return None, head_hidden

    def topk(self, head_hidden: torch.Tensor, k: int):
        probs, draft_ids = _topk(self.logits(head_hidden), k)
        return probs, to_target(draft_ids, self.d2t)
