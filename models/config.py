"""The decoder dimensions our model code needs, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spec.shapes import cfg_get

SUPPORTED_ACTIVATIONS = ("silu", "swish")
# Decoder families whose layers models/layers.py builds: Llama 2/3.x (and SmolLM2), Mistral,
# Qwen2 (q/k/v biases) and Qwen3 dense (per-head q/k RMSNorm).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE

    @classmethod
    def from_hf(cls, config: Any, where: str = "config.json", eagle_head: bool = False) -> "DecoderShape":
        """Validate and extract; a missing or bad field is a ValueError naming it and `where`.

        eagle_head: the config of an EAGLE / EAGLE-3 head, whose layer is Llama-style whatever
        its model_type says (SpecForge writes the target's model_type into some)."""
        def need(key: str) -> int:
            value = cfg_get(config, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        act = cfg_get(config, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{where}: field 'hidden_act' is {act!r}; only {SUPPORTED_ACTIVATIONS} are supported")
        declared_type = cfg_get(config, "model_type", "llama")
        model_type = "llama" if eagle_head else declared_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg_get(config, "architectures", [])
            raise ValueError(
                f"{where}: field 'model_type' is {model_type!r} (architectures {archs}); supported model_type "
                f"values: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _check_sliding_window(config, declared_type, where)
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
            qk_norm=model_type == "qwen3",
        )


def _check_sliding_window(config: Any, model_type: str, where: str) -> None:
    """Sliding-window attention is not implemented: refuse a config whose window is shorter than
    its context (Mistral 7B v0.1: 4096 of 32768), where the attention would differ from the
    reference. A window at least as long as the context never limits anything and is accepted,
    as is a window switched off (Qwen2/Qwen3 `use_sliding_window: false`, or `layer_types`
    without a "sliding_attention" layer)."""
    window = cfg_get(config, "sliding_window")
    if window is None:
        return
    if model_type in ("qwen2", "qwen3") and not cfg_get(config, "use_sliding_window", False):
        return
    layer_types = cfg_get(config, "layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return
    context = int(cfg_get(config, "max_position_embeddings", 4096))
    if int(window) < context:
        via = "" if layer_types is None else " (its 'layer_types' name sliding_attention layers)"
        raise ValueError(
            f"{where}: field 'sliding_window' is {window}{via}, below max_position_embeddings {context}: "
            "sliding-window attention is not supported; lower max_position_embeddings to the window to serve within it"
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
