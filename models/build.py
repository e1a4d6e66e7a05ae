"""Build target and draft modules from resolved folders (weights assigned straight from
safetensors onto modules created on the meta device, so nothing is initialised twice)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.config import DecoderShape
from models.drafts import Eagle3Draft, EagleDraft, StandaloneDraft
from models.llama import LlamaForCausalLM
from models.loader import CheckpointError, TensorSource, checkpoint_names, load_config, load_weights, resolve_model
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

    def tensor_names(self) -> set[str]:
        """The checkpoint's tensor names, from its index or file header (no tensor is read)."""
        return TensorSource(self.folder).keys()


def draft_kind(config: Any, tensor_names: set[str] = frozenset()) -> SpecAlgorithm:
    """What a draft checkpoint is, from its `architectures`, else from its tensor names: the
    EAGLE authors' EAGLE-1/2 heads declare `LlamaForCausalLM` but hold `fc` and `layers.0.*`
    (an EAGLE-3 head also a `hidden_norm`) instead of a whole model."""
    archs = " ".join(cfg_get(config, "architectures", []) or [])
    if "Eagle3" in archs:
        return SpecAlgorithm.EAGLE3
    if "Eagle" in archs:
        return SpecAlgorithm.EAGLE
    bare = {name.removeprefix("model.") for name in tensor_names}
    if bare & {"midlayer.hidden_norm.weight", "layers.0.hidden_norm.weight"}:
        return SpecAlgorithm.EAGLE3
    if "fc.weight" in bare:
        return SpecAlgorithm.EAGLE
    return SpecAlgorithm.STANDALONE


def check_draft_kind(algorithm: SpecAlgorithm, draft: ModelSource) -> None:
    kind = draft_kind(draft.config, draft.tensor_names())
    if kind is not algorithm:
        archs = cfg_get(draft.config, "architectures", [])
        raise CheckpointError(
            f"{draft.folder / 'config.json'}: field 'architectures' is {archs}, and with its tensors that is a "
            f"{kind.name} draft, but speculative_algorithm is {algorithm.name}"
        )


def _head_aliases(name: str) -> list[str]:
    """The spellings under which published EAGLE heads store a tensor: bare (the EAGLE authors,
    SpecForge) or under `model.` (SGLang loads either), and the EAGLE-3 layer as `midlayer.*`
    (EAGLE authors, SpecForge, SGLang) or `layers.0.*` (vLLM maps `midlayer.` to it)."""
    names = [name]
    if name.startswith("midlayer."):
        names.append("layers.0." + name.removeprefix("midlayer."))
    return names + ["model." + n for n in names]


def _tie(module: torch.nn.Module, embed: torch.nn.Embedding) -> None:
    module.lm_head.weight = embed.weight


def _target_module(source: ModelSource) -> tuple[LlamaForCausalLM, set[str]]:
    """(module on the meta device, optional tensors): the config as our model code reads it
    (supported model_type, no sliding window shorter than the context, ...)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(source.config, str(source.folder / "config.json"))
    return model, {"lm_head.weight"} if model.shape.tie_word_embeddings else set()


def check_target(source: ModelSource) -> DecoderShape:
    """The target's config, and every tensor name and shape it implies against its files'
    headers, reading no tensor (at startup and in `graphs.check_pair`)."""
    model, optional = _target_module(source)
    load_weights(model, TensorSource(source.folder), torch.float32, optional, dry_run=True)
    return model.shape


def build_target(source: ModelSource, dtype: torch.dtype, device) -> LlamaForCausalLM:
    model, optional = _target_module(source)
    tied = model.shape.tie_word_embeddings
    load_weights(model, TensorSource(source.folder), dtype, optional)
    if tied:
        _tie(model, model.model.embed_tokens)
    return model.to(device).eval()


# Draft tensors a head may leave out, and the target tensors that stand in for them, in order.
SHARED_WITH_TARGET = {"embed_tokens.weight": [TARGET_EMBED], "lm_head.weight": ["lm_head.weight", TARGET_EMBED]}


def _shared_tensor_name(target: ModelSource, draft_name: str, like: torch.Size, folder: Path) -> str:
    """The target tensor standing in for a draft tensor its checkpoint left out, checked to fit
    from the target's headers."""
    source = TensorSource(target.folder)
    names = SHARED_WITH_TARGET[draft_name]
    found = next((name for name in names if name in source.keys()), None)
    if found is None:
        raise CheckpointError(f"{target.folder}: none of {names} found (the draft shares them with the target)")
    if source.shape(found) != tuple(like):
        raise CheckpointError(
            f"{folder}: no {draft_name!r} and the target's {source.shape(found)} does not fit the draft's "
            f"{tuple(like)} (hidden_size differs): ship the draft's own"
        )
    return found


def _vocab_maps(model: torch.nn.Module, absent: set[str], folder: Path, target_vocab: int) -> None:
    """Checks a draft's vocabulary maps (`spec.vocab`) and fills those its checkpoint left out:
    fine for a draft over the whole vocabulary, where each id maps to itself; an error for a
    smaller draft vocabulary, which cannot be guessed."""
    _missing_vocab_maps(model, absent, folder, target_vocab)
    if "d2t" in absent:
        model.d2t = torch.zeros(model.draft_vocab_size, dtype=torch.long)
    if "t2d" in absent:
        model.t2d = torch.ones(target_vocab, dtype=torch.bool)
    ids = vocab_ids(model.d2t)
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < target_vocab):
        raise CheckpointError(f"{folder}: tensor 'd2t' maps draft ids outside the target's {target_vocab} ids")


def _stand_ins(model: torch.nn.Module, absent: set[str], draft: ModelSource, target: ModelSource) -> dict[str, str]:
    """{draft tensor its checkpoint left out: the target tensor standing in for it}, each checked
    to fit from the target's headers (startup check and load alike)."""
    _missing_lm_head(model, absent, draft.folder, int(cfg_get(target.config, "vocab_size")))
    return {name: _shared_tensor_name(target, name, model.get_parameter(name).shape, draft.folder)
            for name in SHARED_WITH_TARGET.keys() & absent}


def _draft_module(algorithm: SpecAlgorithm, draft: ModelSource, target: ModelSource):
    """(module on the meta device, checkpoint names, optional tensors) for a draft checkpoint."""
    check_draft_kind(algorithm, draft)
    where = str(draft.folder / "config.json")
    target_vocab = int(cfg_get(target.config, "vocab_size"))
    with torch.device("meta"):
        if algorithm is SpecAlgorithm.STANDALONE:
            model = StandaloneDraft(draft.config, where)
            optional = {"d2t"} | ({"lm_head.weight"} if model.shape.tie_word_embeddings else set())
            return model, {}, optional
        if algorithm is SpecAlgorithm.EAGLE3:
            width = get_draft_input_from_target_hidden_dim(algorithm, target.config, draft.config)
            model = Eagle3Draft(draft.config, target_vocab, width, where)
            optional = {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"}
        else:
            model = EagleDraft(draft.config, where)
            optional = {"embed_tokens.weight", "lm_head.weight"}
    rename = checkpoint_names(model.state_dict().keys(), draft.tensor_names(), _head_aliases)
    return model, rename, optional


def check_draft_checkpoint(algorithm: SpecAlgorithm, draft: ModelSource, target: ModelSource) -> None:
    """Every tensor name and shape the draft's config implies, against its files' headers, and
    the vocabulary maps a reduced draft vocabulary needs, reading no tensor: at startup and in
    `graphs.check_pair`, before any weight loads."""
    model, rename, optional = _draft_module(algorithm, draft, target)
    absent = load_weights(model, TensorSource(draft.folder), torch.float32, optional, rename, dry_run=True)
    target_vocab = int(cfg_get(target.config, "vocab_size"))
    if algorithm is not SpecAlgorithm.EAGLE:
        _missing_vocab_maps(model, absent, draft.folder, target_vocab)
    if algorithm is SpecAlgorithm.STANDALONE:
        return  # a tied standalone LM's head is its own embeddings
    _stand_ins(model, absent, draft, target)


def _missing_vocab_maps(model: torch.nn.Module, absent: set[str], folder: Path, target_vocab: int) -> None:
    """A draft over the whole vocabulary may leave its maps out (each id maps to itself); a
    smaller draft vocabulary cannot be guessed."""
    missing = [name for name in ("d2t", "t2d") if name in absent]
    if missing and model.draft_vocab_size != target_vocab:
        raise CheckpointError(
            f"{folder}: tensor(s) {missing} missing, needed because draft_vocab_size "
            f"{model.draft_vocab_size} differs from the target vocab_size {target_vocab}"
        )


def _missing_lm_head(model: torch.nn.Module, absent: set[str], folder: Path, target_vocab: int) -> None:
    """Only an LM head over the target's whole vocabulary can be taken from the target."""
    vocab = getattr(model, "draft_vocab_size", target_vocab)
    if "lm_head.weight" in absent and vocab != target_vocab:
        raise CheckpointError(f"{folder}: tensor 'lm_head.weight' missing, needed because draft_vocab_size "
                              f"{vocab} differs from the target vocab_size {target_vocab}")


def build_draft(
    algorithm: SpecAlgorithm, draft: ModelSource, target: ModelSource, dtype: torch.dtype, device
) -> torch.nn.Module:
    """EAGLE / EAGLE-3 heads take missing embeddings (and LM heads over the whole vocabulary)
    from the target."""
    model, rename, optional = _draft_module(algorithm, draft, target)
    target_vocab = int(cfg_get(target.config, "vocab_size"))
    absent = load_weights(model, TensorSource(draft.folder), dtype, optional, rename)
    if algorithm is SpecAlgorithm.STANDALONE:
        _vocab_maps(model, absent, draft.folder, target_vocab)
        if model.shape.tie_word_embeddings:
            _tie(model, model.model.embed_tokens)
        model.keep_draft_vocab_rows()
        return model.to(device).eval()

    if algorithm is SpecAlgorithm.EAGLE3:
        _vocab_maps(model, absent, draft.folder, target_vocab)
    for name, found in _stand_ins(model, absent, draft, target).items():
        module = model.get_submodule(name.removesuffix(".weight"))
        module.weight = torch.nn.Parameter(TensorSource(target.folder).get(found).to(dtype), requires_grad=False)
    return model.to(device).eval()


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
