"""Hidden-state widths and dtypes, derived from configs alone.

Every actor asks these functions what a tensor crossing it must look like, instead of
reading a width off a weight (`fc.in_features`) or off the other side's config. Configs may
be `transformers` config objects or plain dicts loaded from `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spec.algorithm import SpecAlgorithm

DEFAULT_NUM_AUX = 3


class ShapeContractError(ValueError):
    """Two parts of the system disagree about a tensor's shape or dtype, or a config pair is invalid."""


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """Read a field from a transformers config object or a plain dict."""
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def _eagle_get(draft_config: Any, key: str, default: Any = None) -> Any:
    """EAGLE-3 fields live in `eagle_config` in published checkpoints, at top level in some."""
    eagle_config = cfg_get(draft_config, "eagle_config")
    value = cfg_get(eagle_config, key) if eagle_config is not None else None
    if value is None:
        value = cfg_get(draft_config, key)
    return default if value is None else value


@dataclass(frozen=True)
class HiddenStateSpec:
    """The width and dtype of a (rows, width) hidden-state tensor passed between actors."""

    width: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width <= 0:
            raise ShapeContractError(f"HiddenStateSpec.width must be a positive int, got {self.width!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ShapeContractError(f"HiddenStateSpec.dtype must be a torch.dtype, got {self.dtype!r}")

    def check(self, tensor: torch.Tensor | None, where: str) -> None:
        """Raise ShapeContractError unless `tensor` is (rows, width) of this dtype."""
        if not isinstance(tensor, torch.Tensor):
            raise ShapeContractError(
                f"{where}: expected hidden states (rows, {self.width}) {self.dtype}, got {type(tensor).__name__}"
            )
        if tensor.dim() != 2 or tensor.shape[1] != self.width or tensor.dtype != self.dtype:
            raise ShapeContractError(
                f"{where}: expected hidden states of width {self.width} and dtype {self.dtype}, "
                f"got shape {tuple(tensor.shape)} and dtype {tensor.dtype}"
            )

    def empty(self, num_rows: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
        """A (num_rows, width) zero tensor: the hidden states of an idle input."""
        return torch.zeros((num_rows, self.width), dtype=self.dtype, device=device)


def _num_aux(draft_config: Any) -> int:
    explicit = _eagle_get(draft_config, "num_aux_hidden_states")
    if explicit is not None:
        return int(explicit)
    ids = _eagle_get(draft_config, "eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else DEFAULT_NUM_AUX


def uses_aux_hidden_states(draft_config: Any) -> bool:
    """EAGLE-3 drafts consume concatenated aux layers unless `use_aux_hidden_state` is false."""
    return bool(_eagle_get(draft_config, "use_aux_hidden_state", True))


def get_draft_input_from_target_hidden_dim(
    algorithm: SpecAlgorithm, target_config: Any, draft_config: Any
) -> int | None:
    """Width of the target hidden states fed to the draft (None where none are fed)."""
    algorithm = SpecAlgorithm.from_name(algorithm)
    target_hidden = cfg_get(target_config, "hidden_size")
    if algorithm is SpecAlgorithm.EAGLE3 and uses_aux_hidden_states(draft_config):
        width = cfg_get(draft_config, "target_hidden_size", target_hidden)
        return int(width) * _num_aux(draft_config)
    if algorithm.is_eagle:
        return int(target_hidden)
    return None


def get_draft_input_hidden_state_spec(
    algorithm: SpecAlgorithm, target_config: Any, draft_config: Any, dtype: torch.dtype
) -> HiddenStateSpec | None:
    """The spec of the target hidden rows in a `DraftExtendInput` (target side width)."""
    width = get_draft_input_from_target_hidden_dim(algorithm, target_config, draft_config)
    return None if width is None else HiddenStateSpec(width, dtype)


def get_draft_recurrent_hidden_state_spec(
    algorithm: SpecAlgorithm, target_config: Any, draft_config: Any, dtype: torch.dtype
) -> HiddenStateSpec | None:
    """The hidden state a draft carries from one step to the next (the draft's own width)."""
    algorithm = SpecAlgorithm.from_name(algorithm)
    if not algorithm.is_eagle:
        return None
    return HiddenStateSpec(int(cfg_get(draft_config, "hidden_size")), dtype)


def get_target_aux_layer_ids(target_config: Any, draft_config: Any) -> list[int]:
    """Target layers whose INPUT hidden state EAGLE-3 captures (index i = input of layer i).

    Ids in a draft config name layer OUTPUTS (the EAGLE-3 reference convention), so id j
    there means the input of layer j + 1 here.
    """
    ids = _eagle_get(draft_config, "eagle_aux_hidden_state_layer_ids")
    if ids:
        return [int(i) + 1 for i in ids]
    num_layers = int(cfg_get(target_config, "num_hidden_layers"))
    return [2, num_layers // 2, num_layers - 3]


def get_draft_vocab_size(draft_config: Any, target_vocab: int) -> int:
    """How many ids the draft proposes (`spec.vocab`): draft_vocab_size, else its vocab_size."""
    return int(cfg_get(draft_config, "draft_vocab_size", cfg_get(draft_config, "vocab_size", target_vocab)))


def _check_draft_vocab_size(algorithm: SpecAlgorithm, draft_config: Any, target_vocab: int) -> None:
    """A draft vocabulary (`spec.vocab`; by default the draft's vocab_size) is a subset of the
    target's: 1..vocab_size ids."""
    reduced_vocab = get_draft_vocab_size(draft_config, target_vocab)
    if not 1 <= reduced_vocab <= target_vocab:
        raise ShapeContractError(
            f"draft_vocab_size: {algorithm.name} draft_vocab_size {reduced_vocab} must be between 1 and the "
            f"target vocab_size {target_vocab}"
        )


SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _check_same_vocab(algorithm: SpecAlgorithm, target_config: Any, draft_config: Any) -> None:
    target_vocab, draft_vocab = cfg_get(target_config, "vocab_size"), cfg_get(draft_config, "vocab_size")
    if draft_vocab is not None and int(draft_vocab) != int(target_vocab):
        raise ShapeContractError(
            f"vocab_size: {algorithm.name} draft has vocab_size {draft_vocab}, target has {target_vocab}; "
            "they must share the tokenizer"
        )


def _check_same_tokenizer(algorithm: SpecAlgorithm, target_config: Any, draft_config: Any) -> None:
    """A standalone LM reads and proposes the target's token ids, so it needs the target's
    tokenizer: the same vocab_size and, where both configs declare them, the same bos and pad
    ids and at least one common eos id (an instruct model lists more eos ids than its base).
    EAGLE heads tokenize nothing (the target's ids go in); their special ids are not checked."""
    _check_same_vocab(algorithm, target_config, draft_config)
    as_set = lambda v: {int(i) for i in v} if isinstance(v, (list, tuple)) else {int(v)}  # noqa: E731
    for field in SPECIAL_TOKEN_FIELDS:
        ours, theirs = cfg_get(target_config, field), cfg_get(draft_config, field)
        if ours is None or theirs is None:
            continue
        agree = as_set(ours) & as_set(theirs) if field == "eos_token_id" else as_set(ours) == as_set(theirs)
        if not agree:
            raise ShapeContractError(
                f"{field}: {algorithm.name} draft has {field} {theirs}, target has {ours}; "
                "they must share the tokenizer"
            )


def _check_single_layer_head(algorithm: SpecAlgorithm, draft_config: Any) -> None:
    layers = int(cfg_get(draft_config, "num_hidden_layers", 1))
    if layers != 1:
        raise ShapeContractError(
            f"num_hidden_layers: {algorithm.name} heads here have one decoder layer, the draft declares {layers}"
        )


def _check_eagle3_width(target_config: Any, draft_config: Any, target_hidden: int) -> None:
    """The width of the rows the draft's `fc` reads, as its config states it: num_aux x
    `target_hidden_size`, or num_aux x its own hidden_size where it declares none (how SGLang
    and vLLM size `fc`), must be what the target produces, num_aux x its hidden_size."""
    declared = cfg_get(draft_config, "target_hidden_size")
    if declared is not None and int(declared) != target_hidden:
        raise ShapeContractError(
            f"target_hidden_size: EAGLE3 draft declares target_hidden_size {declared}, "
            f"but the target's hidden_size is {target_hidden}"
        )
    draft_hidden = int(cfg_get(draft_config, "hidden_size"))
    if declared is None and uses_aux_hidden_states(draft_config) and draft_hidden != target_hidden:
        num_aux = _num_aux(draft_config)
        raise ShapeContractError(
            f"target_hidden_size: EAGLE3 draft declares none, so its fc reads {num_aux} x hidden_size "
            f"({num_aux} x {draft_hidden}), but the target gives {num_aux} x {target_hidden}"
        )


def validate_spec_pair(algorithm: SpecAlgorithm, target_config: Any, draft_config: Any) -> None:
    """Check a target/draft config pair before any weights load; raise naming the bad field."""
    algorithm = SpecAlgorithm.from_name(algorithm)
    if not algorithm.needs_draft_model:
        return
    if draft_config is None:
        raise ShapeContractError(f"draft_model: {algorithm.name} needs a draft model, none was given")
    target_vocab = int(cfg_get(target_config, "vocab_size"))
    target_hidden = int(cfg_get(target_config, "hidden_size"))
    draft_hidden = int(cfg_get(draft_config, "hidden_size"))

    if algorithm is SpecAlgorithm.STANDALONE:
        _check_same_tokenizer(algorithm, target_config, draft_config)
        _check_draft_vocab_size(algorithm, draft_config, target_vocab)
        return

    _check_single_layer_head(algorithm, draft_config)
    if algorithm is SpecAlgorithm.EAGLE:
        if draft_hidden != target_hidden:
            raise ShapeContractError(
                f"hidden_size: EAGLE draft hidden_size {draft_hidden} differs from target hidden_size "
                f"{target_hidden}; EAGLE shares the target's embeddings and LM head"
            )
        _check_same_vocab(algorithm, target_config, draft_config)
        return

    _check_eagle3_width(target_config, draft_config, target_hidden)
    _check_same_vocab(algorithm, target_config, draft_config)
    _check_draft_vocab_size(algorithm, draft_config, target_vocab)
    if uses_aux_hidden_states(draft_config):
        num_layers = int(cfg_get(target_config, "num_hidden_layers"))
        layer_ids = get_target_aux_layer_ids(target_config, draft_config)
        bad = [i - 1 for i in layer_ids if not 0 <= i < num_layers]
        if bad or len(layer_ids) != _num_aux(draft_config):
            raise ShapeContractError(
                f"eagle_aux_hidden_state_layer_ids: {[i - 1 for i in layer_ids]} must be "
                f"{_num_aux(draft_config)} (num_aux_hidden_states) layer-output ids in "
                f"[-1, {num_layers - 2}] for a target with {num_layers} layers"
            )


def agreed_shapes(algorithm: SpecAlgorithm, target_config: Any, draft_config: Any) -> dict[str, Any]:
    """What a valid pair agrees on (run validate_spec_pair first), for people to read."""
    algorithm = SpecAlgorithm.from_name(algorithm)
    out: dict[str, Any] = {
        "algorithm": algorithm.name,
        "target_hidden_size": int(cfg_get(target_config, "hidden_size")),
        "target_num_layers": int(cfg_get(target_config, "num_hidden_layers")),
        "vocab_size": int(cfg_get(target_config, "vocab_size")),
    }
    if draft_config is None:
        return out
    out["draft_hidden_size"] = int(cfg_get(draft_config, "hidden_size"))
    out["draft_vocab_size"] = get_draft_vocab_size(draft_config, out["vocab_size"])
    out["draft_input_width"] = get_draft_input_from_target_hidden_dim(algorithm, target_config, draft_config)
    if algorithm is SpecAlgorithm.EAGLE3 and uses_aux_hidden_states(draft_config):
        inputs = get_target_aux_layer_ids(target_config, draft_config)
        out["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in inputs]
        out["aux_layer_inputs_captured"] = inputs
    return out
