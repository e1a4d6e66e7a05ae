"""Build target and draft modules from resolved folders (weights assigned straight from
safetensors onto modules created on the meta device, so nothing is initialised twice)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.drafts import Eagle3Draft, EagleDraft, StandaloneDraft
from models.llama import LlamaForCausalLM
from models.loader import CheckpointError, TensorSource, load_config, load_weights, resolve_model
from spec.algorithm import SpecAlgorithm
from spec.shapes import cfg_get, get_draft_input_from_target_hidden_dim
from spec.vocab import vocab_ids

TARGET_EMBED = "model.embed_tokens.weight"


@dataclass
class ModelSource:
    """A resolved model: its folder and config, before any weights load."""

    folder: Path
    config: Any

    @classmethod
    def resolve(cls, name_or_path) -> "ModelSource":
        folder = resolve_model(name_or_path)
        return cls(folder, load_config(folder))


def draft_kind(config: Any) -> SpecAlgorithm:
    """What a draft checkpoint is, from its `architectures`."""
    archs = " ".join(cfg_get(config, "architectures", []) or [])
    if "Eagle3" in archs:
        return SpecAlgorithm.EAGLE3
    if "Eagle" in archs:
        return SpecAlgorithm.EAGLE
    return SpecAlgorithm.STANDALONE


def check_draft_kind(algorithm: SpecAlgorithm, draft: ModelSource) -> None:
    kind = draft_kind(draft.config)
    if kind is not algorithm:
        archs = cfg_get(draft.config, "architectures", [])
        raise CheckpointError(
            f"{draft.folder / 'config.json'}: field 'architectures' is {archs}, which is a {kind.name} draft, "
            f"but speculative_algorithm is {algorithm.name}"
        )


def _tie(module: torch.nn.Module, embed: torch.nn.Embedding) -> None:
    module.lm_head.weight = embed.weight


def build_target(source: ModelSource, dtype: torch.dtype, device) -> LlamaForCausalLM:
    where = str(source.folder / "config.json")
    with torch.device("meta"):
        model = LlamaForCausalLM(source.config, where)
    tied = model.shape.tie_word_embeddings
    load_weights(model, TensorSource(source.folder), dtype, optional={"lm_head.weight"} if tied else set())
    if tied:
        _tie(model, model.model.embed_tokens)
    return model.to(device).eval()


def _target_tensor(target: ModelSource, names: list[str], dtype: torch.dtype) -> torch.Tensor:
    source = TensorSource(target.folder)
    for name in names:
        if name in source.keys():
            return source.get(name).to(dtype)
    raise CheckpointError(f"{target.folder}: none of {names} found (the draft shares them with the target)")


def _vocab_maps(model: torch.nn.Module, absent: set[str], folder: Path, target_vocab: int) -> None:
    """Checks a draft's vocabulary maps (`spec.vocab`) and fills those its checkpoint left out:
    fine for a draft over the whole vocabulary, where each id maps to itself; an error for a
    smaller draft vocabulary, which cannot be guessed."""
    missing = [name for name in ("d2t", "t2d") if name in absent]
    if missing and model.draft_vocab_size != target_vocab:
        raise CheckpointError(
            f"{folder}: tensor(s) {missing} missing, needed because draft_vocab_size "
            f"{model.draft_vocab_size} differs from the target vocab_size {target_vocab}"
        )
    if "d2t" in absent:
        model.d2t = torch.zeros(model.draft_vocab_size, dtype=torch.long)
    if "t2d" in absent:
        model.t2d = torch.ones(target_vocab, dtype=torch.bool)
    ids = vocab_ids(model.d2t)
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < target_vocab):
        raise CheckpointError(f"{folder}: tensor 'd2t' maps draft ids outside the target's {target_vocab} ids")


def build_draft(
    algorithm: SpecAlgorithm, draft: ModelSource, target: ModelSource, dtype: torch.dtype, device
) -> torch.nn.Module:
    """EAGLE / EAGLE-3 heads take missing embeddings (and EAGLE its LM head) from the target."""
    check_draft_kind(algorithm, draft)
    where = str(draft.folder / "config.json")
    source = TensorSource(draft.folder)
    target_vocab = int(cfg_get(target.config, "vocab_size"))
    if algorithm is SpecAlgorithm.STANDALONE:
        with torch.device("meta"):
            model = StandaloneDraft(draft.config, where)
        tied = model.shape.tie_word_embeddings
        absent = load_weights(model, source, dtype, optional={"d2t"} | ({"lm_head.weight"} if tied else set()))
        _vocab_maps(model, absent, draft.folder, target_vocab)
        if tied:
            _tie(model, model.model.embed_tokens)
        model.keep_draft_vocab_rows()
        return model.to(device).eval()

    if algorithm is SpecAlgorithm.EAGLE3:
        width = get_draft_input_from_target_hidden_dim(algorithm, target.config, draft.config)
        with torch.device("meta"):
            model = Eagle3Draft(draft.config, target_vocab, width, where)
        absent = load_weights(model, source, dtype, optional={"embed_tokens.weight", "d2t", "t2d"})
        _vocab_maps(model, absent, draft.folder, target_vocab)
    else:
        with torch.device("meta"):
            model = EagleDraft(draft.config, where)
        absent = load_weights(model, source, dtype, optional={"embed_tokens.weight", "lm_head.weight"})
        if "lm_head.weight" in absent:
            lm_head = _target_tensor(target, ["lm_head.weight", TARGET_EMBED], dtype)
            model.lm_head.weight = torch.nn.Parameter(lm_head, requires_grad=False)
    if "embed_tokens.weight" in absent:
        embed = _target_tensor(target, [TARGET_EMBED], dtype)
        if embed.shape != model.embed_tokens.weight.shape:
            raise CheckpointError(
                f"{draft.folder}: no 'embed_tokens.weight' and the target's embeddings {tuple(embed.shape)} do not "
                f"fit the draft's {tuple(model.embed_tokens.weight.shape)} (hidden_size differs): ship the draft's own"
            )
        model.embed_tokens.weight = torch.nn.Parameter(embed, requires_grad=False)
    return model.to(device).eval()


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
