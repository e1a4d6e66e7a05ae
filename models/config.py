"""The decoder dimensions our model code needs, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spec.shapes import cfg_get

SUPPORTED_ACTIVATIONS = ("silu", "swish")


@dataclass(frozen=True)
class DecoderShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v bias (Qwen2 has it)
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, config: Any, where: str = "config.json") -> "DecoderShape":
        """Validate and extract; a missing or bad field is a ValueError naming it and `where`."""
        def need(key: str) -> int:
            value = cfg_get(config, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        act = cfg_get(config, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{where}: field 'hidden_act' is {act!r}; only {SUPPORTED_ACTIVATIONS} are supported")
        model_type = cfg_get(config, "model_type", "llama")
        head_dim = cfg_get(config, "head_dim") or hidden // heads
        kv_heads = cfg_get(config, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"{where}: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})")
        qkv_bias = bool(cfg_get(config, "attention_bias", False)) or model_type == "qwen2"
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate_size=need("intermediate_size"),
            rms_norm_eps=float(cfg_get(config, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg_get(config, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg_get(config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_bias=bool(cfg_get(config, "attention_bias", False)) and model_type != "qwen2",
            mlp_bias=bool(cfg_get(config, "mlp_bias", False)),
        )


def rope_parameters(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq (D/2,), attention scaling) using transformers' rules for every RoPE type."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not isinstance(config, PretrainedConfig):
        from transformers import LlamaConfig

        config = LlamaConfig(**config)
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)), 1.0
    # Models are built under `torch.device("meta")`; compute the frequencies on the CPU for real
    # (transformers' RoPE functions create tensors on the ambient default device).
    with torch.device("cpu"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq, float(scaling)
