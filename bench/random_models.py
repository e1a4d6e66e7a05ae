"""Random-weight models saved through the real formats (save_pretrained, safetensors in the
public EAGLE / EAGLE-3 layouts) with a word-level tokenizer: fast, offline, and loaded by the
same code as real checkpoints. The test suite's tiny models, and bench.gpu_step's models of
real shapes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
import transformers
from transformers import PreTrainedTokenizerFast

from train.hot_vocab import with_hot_vocab

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Words w0 .. w{V-3}, then <eos> (id V-2) and <unk> (id V-1)."""
    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab["<eos>"], vocab["<unk>"] = vocab_size - 2, vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _scale_(module: torch.nn.Module, std: float, generator: torch.Generator) -> None:
    """Re-draw matrices with a larger std so logits have clear gaps (greedy is then stable
    under the tiny float differences between batched and unbatched kernels)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * std)


# transformers classes of each decoder family the target runner serves (models.config).
ARCHITECTURES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def make_llama(folder: Path, vocab_size: int = 64, hidden: int = 64, layers: int = 4, heads: int = 4,
               kv_heads: int = 2, intermediate: int = 128, seed: int = 0, tie: bool = True,
               std: float = 0.25, max_pos: int = 512, arch: str = "llama", dtype: torch.dtype = torch.float32,
               max_shard_size: str | None = None, **extra) -> Path:
    """A random decoder of family `arch` (ARCHITECTURES) saved with save_pretrained in `dtype`,
    sharded (model.safetensors.index.json) when `max_shard_size` is given."""
    folder = Path(folder)
    name = ARCHITECTURES[arch]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_pos,
        tie_word_embeddings=tie, **{"eos_token_id": vocab_size - 2, "bos_token_id": None, "pad_token_id": None, **extra},
    )
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    _scale_(model, std, generator)
    model.to(dtype).save_pretrained(folder, safe_serialization=True,
                                    **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    word_tokenizer(vocab_size).save_pretrained(folder)
    return folder


def make_hot_vocab(folder: Path, draft: Path, ids: list[int]) -> Path:
    """A copy of the Llama folder `draft` proposing only `ids` (sorted): config `draft_vocab_size`
    and a `d2t` tensor, as train.hot_vocab writes them (its `with_hot_vocab`)."""
    folder = Path(folder)
    shutil.copytree(draft, folder)
    config, state = with_hot_vocab(json.loads((folder / "config.json").read_text()),
                                   load_file(str(folder / "model.safetensors")), torch.tensor(ids))
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _rand(generator, *shape, std=0.25):
    return torch.randn(shape, generator=generator) * std


def make_eagle3(folder: Path, target: Path, hidden: int, draft_vocab: int | None = None,
                own_embeddings: bool = False, seed: int = 1, heads: int = 4, kv_heads: int = 2,
                aux_layer_ids: list[int] | None = None, layer: str = "midlayer", prefix: str = "",
                aux_ids_at: str = "eagle_config", declare_target_hidden: bool = True, lm_head: bool = True,
                maps: bool | None = None, **config_extra) -> Path:
    """An EAGLE-3 head in a published layout: fc, {layer}.*, norm, lm_head, d2t, t2d[, embed_tokens].

    layer "midlayer" (EAGLE authors, SpecForge) or "layers.0" (vLLM); prefix "" or "model."
    (SGLang's own names) before every name but lm_head, d2t and t2d; aux_layer_ids in
    `eagle_config` or at the config's top level ("top"); declare_target_hidden False and
    lm_head False as the EAGLE authors' heads for a target of their width and vocabulary;
    maps: write d2t/t2d (default: only for a reduced draft vocabulary)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target) / "config.json").read_text())
    vocab, t_hidden = tcfg["vocab_size"], tcfg["hidden_size"]
    draft_vocab = draft_vocab or vocab
    head_dim = hidden // heads
    inter = 2 * hidden
    g = torch.Generator().manual_seed(seed)
    num_aux = len(aux_layer_ids) if aux_layer_ids else 3
    fc = _rand(g, hidden, num_aux * t_hidden, std=0.05)
    layer_state = {
        "input_layernorm.weight": torch.ones(hidden),
        "hidden_norm.weight": torch.ones(hidden),
        "post_attention_layernorm.weight": torch.ones(hidden),
        "self_attn.q_proj.weight": _rand(g, heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": _rand(g, kv_heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": _rand(g, kv_heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": _rand(g, hidden, heads * head_dim),
        "mlp.gate_proj.weight": _rand(g, inter, hidden),
        "mlp.up_proj.weight": _rand(g, inter, hidden),
        "mlp.down_proj.weight": _rand(g, hidden, inter),
    }
    state = {f"{prefix}fc.weight": fc, f"{prefix}norm.weight": torch.ones(hidden)}
    state.update({f"{prefix}{layer}.{k}": v for k, v in layer_state.items()})
    if lm_head:
        state["lm_head.weight"] = _rand(g, draft_vocab, hidden)
    if maps if maps is not None else draft_vocab != vocab:
        # Draft vocabulary = every other target token: draft id i -> target id 2i.
        target_ids = torch.arange(draft_vocab) * (2 if draft_vocab != vocab else 1)
        state["d2t"] = target_ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        state["t2d"] = t2d
    if own_embeddings:
        state[f"{prefix}embed_tokens.weight"] = _rand(g, vocab, hidden)
    save_file(state, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": inter, "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-6, "max_position_embeddings": tcfg["max_position_embeddings"],
        "rope_theta": tcfg.get("rope_theta", tcfg.get("rope_parameters", {}).get("rope_theta", 10000.0)),
        "tie_word_embeddings": False, "hidden_act": "silu",
    }
    if declare_target_hidden:
        config["target_hidden_size"] = t_hidden
    if aux_ids_at == "top":
        config.update({"eagle_aux_hidden_state_layer_ids": aux_layer_ids} if aux_layer_ids else {})
    else:
        config["eagle_config"] = {"use_aux_hidden_state": True}
        if aux_layer_ids:
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    config.update(config_extra)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def make_eagle(folder: Path, target: Path, seed: int = 2, architectures: tuple[str, ...] = ("LlamaForCausalLMEagle",),
               prefix: str = "", own_embeddings: bool = False) -> Path:
    """An EAGLE(-1/2) head in the public layout (fc.{weight,bias}, layers.0.*), sharing the target's
    LM head (and embeddings unless own_embeddings). The EAGLE authors' heads declare
    `LlamaForCausalLM` and the target's other fields; SGLang's `LlamaForCausalLMEagle`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target) / "config.json").read_text())
    hidden, heads, kv_heads = tcfg["hidden_size"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    head_dim, inter = tcfg.get("head_dim") or hidden // heads, tcfg["intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    state = {
        "fc.weight": _rand(g, hidden, 2 * hidden, std=0.1), "fc.bias": torch.zeros(hidden),
        "layers.0.self_attn.q_proj.weight": _rand(g, heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": _rand(g, kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": _rand(g, kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": _rand(g, hidden, heads * head_dim),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        "layers.0.mlp.gate_proj.weight": _rand(g, inter, hidden),
        "layers.0.mlp.up_proj.weight": _rand(g, inter, hidden),
        "layers.0.mlp.down_proj.weight": _rand(g, hidden, inter),
    }
    if own_embeddings:
        state["embed_tokens.weight"] = _rand(g, tcfg["vocab_size"], hidden)
    save_file({prefix + k: v for k, v in state.items()}, str(folder / "model.safetensors"))
    config = dict(tcfg, architectures=list(architectures), num_hidden_layers=1)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: every UTF-8 byte is one token, so one emoji is 4 tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab["<eos>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
