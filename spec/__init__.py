"""The single source of truth for speculative-decoding contracts: algorithms, hidden-state
shapes and dtypes, and the batch-level state that travels between actors (no Ray, no model code).

May import: nothing of this project (every other layer imports it)."""

from spec.algorithm import SpecAlgorithm
from spec.batch import BatchMeta, DraftExtendInput, DraftInput, VerifyInput
from spec.shapes import (
    HiddenStateSpec,
    ShapeContractError,
    get_draft_input_from_target_hidden_dim,
    get_draft_recurrent_hidden_state_spec,
    get_target_aux_layer_ids,
    validate_spec_pair,
)

__all__ = [
    "SpecAlgorithm",
    "ShapeContractError",
    "HiddenStateSpec",
    "get_draft_input_from_target_hidden_dim",
    "get_draft_recurrent_hidden_state_spec",
    "get_target_aux_layer_ids",
    "validate_spec_pair",
    "DraftInput",
    "VerifyInput",
    "DraftExtendInput",
    "BatchMeta",
]
