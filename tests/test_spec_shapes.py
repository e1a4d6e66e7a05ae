"""Contracts of spec/shapes.py and spec/algorithm.py: widths from configs, spec checks, pair validation.

No Ray, no weights: configs are plain dicts (as loaded from config.json) or transformers
`LlamaConfig` objects, and every width-dependent test runs against both.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from spec import (
    HiddenStateSpec,
    ShapeContractError,
    SpecAlgorithm,
    get_draft_input_from_target_hidden_dim,
    get_draft_recurrent_hidden_state_spec,
    get_target_aux_layer_ids,
    validate_spec_pair,
)
from spec.shapes import get_draft_input_hidden_state_spec

CONFIG_KINDS = ["dict", "llama"]


def make_config(kind: str, fields: dict | None):
    """A config with exactly `fields` set: a plain dict or a transformers LlamaConfig."""
    if fields is None:
        return None
    if kind == "dict":
        return dict(fields)
    # LlamaConfig needs a head count; 4 divides every hidden size used here.
    return LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **fields)


def target_fields(hidden: int = 576, layers: int = 30, vocab: int = 49152) -> dict:
    # Special ids as LlamaConfig's defaults (bos 1, eos 2) and a pad id, which drafts must match.
    return {"hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def draft_fields(hidden: int, vocab: int = 49152, **extra) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": 1, "vocab_size": vocab, **extra}


# --------------------------------------------------------------------------- SpecAlgorithm


@pytest.mark.parametrize("algorithm", list(SpecAlgorithm))
def test_from_name_is_case_insensitive(algorithm):
    name = algorithm.name
    for spelling in (name, name.lower(), name.capitalize(), name.swapcase(), f"  {name.lower()} "):
        assert SpecAlgorithm.from_name(spelling) is algorithm
    assert SpecAlgorithm.from_name(algorithm) is algorithm


def test_from_name_none_means_no_speculation():
    assert SpecAlgorithm.from_name(None) is SpecAlgorithm.NONE


@pytest.mark.parametrize("bad", ["eagle2", "", "medusa", "EAGLE-3"])
def test_from_name_unknown_lists_every_valid_name(bad):
    with pytest.raises(ValueError) as info:
        SpecAlgorithm.from_name(bad)
    message = str(info.value)
    assert repr(bad) in message
    for algorithm in SpecAlgorithm:
        assert algorithm.name in message


def test_from_name_rejects_non_strings():
    with pytest.raises(ValueError, match="string"):
        SpecAlgorithm.from_name(3)


def test_algorithm_properties():
    eagle = {SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3}
    needs_draft = eagle | {SpecAlgorithm.STANDALONE}
    for algorithm in SpecAlgorithm:
        assert algorithm.is_eagle == (algorithm in eagle)
        assert algorithm.needs_draft_model == (algorithm in needs_draft)
        assert algorithm.has_draft_kv == (algorithm in needs_draft)


# --------------------------------------------------------------------------- widths table

# (id, algorithm, target fields, draft fields or None, input-from-target width, recurrent width)
WIDTH_CASES = [
    ("eagle3-smollm", SpecAlgorithm.EAGLE3, target_fields(576),
     draft_fields(256, target_hidden_size=576, draft_vocab_size=8192), 3 * 576, 256),
    ("eagle3-target-hidden-from-target", SpecAlgorithm.EAGLE3, target_fields(576),
     draft_fields(256), 3 * 576, 256),
    ("eagle3-wide-4-aux", SpecAlgorithm.EAGLE3, target_fields(8192, layers=80, vocab=128256),
     draft_fields(4096, vocab=128256, target_hidden_size=8192, num_aux_hidden_states=4), 32768, 4096),
    ("eagle3-num-aux-in-eagle-config", SpecAlgorithm.EAGLE3, target_fields(576),
     draft_fields(256, eagle_config={"num_aux_hidden_states": 2}), 2 * 576, 256),
    ("eagle3-no-aux", SpecAlgorithm.EAGLE3, target_fields(576),
     draft_fields(256, target_hidden_size=576, eagle_config={"use_aux_hidden_state": False}), 576, 256),
    ("eagle3-2-ids-in-eagle-config", SpecAlgorithm.EAGLE3, target_fields(576),
     draft_fields(256, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 20]}), 2 * 576, 256),
    ("eagle3-4-ids-top-level", SpecAlgorithm.EAGLE3, target_fields(576),
     draft_fields(256, eagle_aux_hidden_state_layer_ids=[1, 9, 18, 26]), 4 * 576, 256),
    # Not a valid EAGLE pair (validate_spec_pair rejects it); the widths still come from
    # their own side: input from the target, recurrent from the draft.
    ("eagle-differing", SpecAlgorithm.EAGLE, target_fields(576), draft_fields(256), 576, 256),
    ("eagle-same", SpecAlgorithm.EAGLE, target_fields(576), draft_fields(576), 576, 576),
    ("standalone", SpecAlgorithm.STANDALONE, target_fields(576), draft_fields(128), None, None),
    ("ngram", SpecAlgorithm.NGRAM, target_fields(576), None, None, None),
    ("none", SpecAlgorithm.NONE, target_fields(576), None, None, None),
]


@pytest.mark.parametrize("kind", CONFIG_KINDS)
@pytest.mark.parametrize(
    "algorithm,target,draft,input_width,recurrent_width",
    [case[1:] for case in WIDTH_CASES],
    ids=[case[0] for case in WIDTH_CASES],
)
def test_widths_from_configs(kind, algorithm, target, draft, input_width, recurrent_width):
    target_cfg, draft_cfg = make_config(kind, target), make_config(kind, draft)

    assert get_draft_input_from_target_hidden_dim(algorithm, target_cfg, draft_cfg) == input_width

    recurrent = get_draft_recurrent_hidden_state_spec(algorithm, target_cfg, draft_cfg, torch.bfloat16)
    input_spec = get_draft_input_hidden_state_spec(algorithm, target_cfg, draft_cfg, torch.bfloat16)
    if recurrent_width is None:
        assert recurrent is None
    else:
        assert recurrent == HiddenStateSpec(recurrent_width, torch.bfloat16)
    if input_width is None:
        assert input_spec is None
    else:
        assert input_spec == HiddenStateSpec(input_width, torch.bfloat16)

    # Names work as well as enum members.
    assert get_draft_input_from_target_hidden_dim(algorithm.name.lower(), target_cfg, draft_cfg) == input_width


# --------------------------------------------------------------------------- aux layer ids


@pytest.mark.parametrize("kind", CONFIG_KINDS)
@pytest.mark.parametrize("layers,expected", [(30, [2, 15, 27]), (32, [2, 16, 29]), (80, [2, 40, 77])])
def test_aux_layer_ids_default(kind, layers, expected):
    target = make_config(kind, target_fields(576, layers=layers))
    assert get_target_aux_layer_ids(target, make_config(kind, draft_fields(256))) == expected
    assert get_target_aux_layer_ids(target, None) == expected


@pytest.mark.parametrize("kind", CONFIG_KINDS)
@pytest.mark.parametrize(
    "draft_extra",
    [
        {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}},
        # eagle_config wins over the top level
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
         "eagle_aux_hidden_state_layer_ids": [5, 6, 7]},
    ],
    ids=["top-level", "eagle_config", "eagle_config-wins"],
)
def test_aux_layer_ids_from_draft_config_are_shifted_by_one(kind, draft_extra):
    target = make_config(kind, target_fields(576, layers=30))
    draft = make_config(kind, draft_fields(256, **draft_extra))
    # Draft config ids name layer OUTPUTS: output of layer j is the input of layer j + 1.
    assert get_target_aux_layer_ids(target, draft) == [2, 15, 27]


def test_aux_layer_id_minus_one_is_the_embedding_output():
    target = target_fields(576, layers=30)
    assert get_target_aux_layer_ids(target, {"eagle_aux_hidden_state_layer_ids": [-1, 0, 28]}) == [0, 1, 29]


# --------------------------------------------------------------------------- HiddenStateSpec

WHERE = "draft.extend: hidden_states from target rank 3"


@pytest.mark.parametrize("rows", [0, 1, 7])
def test_check_accepts_right_tensors(rows):
    spec = HiddenStateSpec(256, torch.bfloat16)
    spec.check(torch.zeros(rows, 256, dtype=torch.bfloat16), WHERE)  # (rows, 256) bf16


def _check_error(spec: HiddenStateSpec, value) -> str:
    with pytest.raises(ShapeContractError) as info:
        spec.check(value, WHERE)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert WHERE in message
    assert str(spec.width) in message
    assert str(spec.dtype) in message
    return message


def test_check_wrong_width_names_both_widths():
    message = _check_error(HiddenStateSpec(256, torch.bfloat16), torch.zeros(3, 1728, dtype=torch.bfloat16))
    assert "1728" in message


def test_check_wrong_dtype_names_both_dtypes():
    message = _check_error(HiddenStateSpec(256, torch.bfloat16), torch.zeros(3, 256, dtype=torch.float32))
    assert "torch.float32" in message


@pytest.mark.parametrize("shape", [(256,), (2, 3, 256), (1, 1, 1, 256)])
def test_check_wrong_rank_names_the_shape(shape):
    message = _check_error(HiddenStateSpec(256, torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
    assert str(tuple(shape)) in message


@pytest.mark.parametrize("value", [None, [[0.0] * 256], 3.0])
def test_check_non_tensor_names_the_type(value):
    message = _check_error(HiddenStateSpec(256, torch.bfloat16), value)
    assert type(value).__name__ in message


@pytest.mark.parametrize("rows", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_empty(rows, dtype):
    spec = HiddenStateSpec(1728, dtype)
    out = spec.empty(rows)
    assert out.shape == (rows, 1728) and out.dtype == dtype
    assert not out.any()
    spec.check(out, "empty")
    assert spec.empty().shape == (0, 1728)


@pytest.mark.parametrize("width", [0, -1, True, 2.0, "256"])
def test_spec_rejects_bad_width(width):
    with pytest.raises(ShapeContractError, match="width"):
        HiddenStateSpec(width, torch.float32)


def test_spec_rejects_bad_dtype():
    with pytest.raises(ShapeContractError, match="dtype"):
        HiddenStateSpec(256, "bfloat16")


# --------------------------------------------------------------------------- validate_spec_pair

EAGLE3_DRAFT = draft_fields(256, target_hidden_size=576, draft_vocab_size=8192)

# (id, algorithm, draft fields or None, field the error must name first)
INVALID_PAIRS = [
    ("standalone-vocab", SpecAlgorithm.STANDALONE, draft_fields(128, vocab=32000), "vocab_size"),
    ("standalone-draft-vocab", SpecAlgorithm.STANDALONE, draft_fields(128, draft_vocab_size=50000), "draft_vocab_size"),
    ("standalone-draft-vocab-zero", SpecAlgorithm.STANDALONE, draft_fields(128, draft_vocab_size=0), "draft_vocab_size"),
    ("eagle-hidden", SpecAlgorithm.EAGLE, draft_fields(256), "hidden_size"),
    ("eagle-vocab", SpecAlgorithm.EAGLE, draft_fields(576, vocab=32000), "vocab_size"),
    ("eagle3-target-hidden", SpecAlgorithm.EAGLE3,
     draft_fields(256, target_hidden_size=512), "target_hidden_size"),
    ("eagle3-draft-vocab", SpecAlgorithm.EAGLE3,
     draft_fields(256, target_hidden_size=576, draft_vocab_size=50000), "draft_vocab_size"),
    ("eagle3-id-past-last-layer", SpecAlgorithm.EAGLE3,
     draft_fields(256, target_hidden_size=576, eagle_aux_hidden_state_layer_ids=[1, 14, 29]), "eagle_aux_hidden_state_layer_ids"),
    ("eagle3-id-negative", SpecAlgorithm.EAGLE3,
     draft_fields(256, target_hidden_size=576, eagle_config={"eagle_aux_hidden_state_layer_ids": [-2, 14, 26]}),
     "eagle_aux_hidden_state_layer_ids"),
    ("eagle3-id-huge", SpecAlgorithm.EAGLE3,
     draft_fields(256, target_hidden_size=576, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 300]}),
     "eagle_aux_hidden_state_layer_ids"),
    ("eagle3-num-aux-vs-ids", SpecAlgorithm.EAGLE3,
     draft_fields(256, target_hidden_size=576, num_aux_hidden_states=4, eagle_aux_hidden_state_layer_ids=[1, 14, 26]),
     "eagle_aux_hidden_state_layer_ids"),
    # No target_hidden_size and a narrower draft: fc would read 3 x 256, the target gives 3 x 576.
    ("eagle3-undeclared-width", SpecAlgorithm.EAGLE3, draft_fields(256), "target_hidden_size"),
    ("eagle3-vocab", SpecAlgorithm.EAGLE3, draft_fields(256, vocab=32000, target_hidden_size=576), "vocab_size"),
    ("eagle3-two-layers", SpecAlgorithm.EAGLE3,
     dict(draft_fields(256, target_hidden_size=576), num_hidden_layers=2), "num_hidden_layers"),
    ("standalone-eos", SpecAlgorithm.STANDALONE, draft_fields(128, eos_token_id=[0, 7]), "eos_token_id"),
    ("standalone-eos-list", SpecAlgorithm.STANDALONE, draft_fields(128, eos_token_id=[4, 5]), "eos_token_id"),
    ("standalone-bos", SpecAlgorithm.STANDALONE, draft_fields(128, bos_token_id=0), "bos_token_id"),
    ("standalone-pad", SpecAlgorithm.STANDALONE, draft_fields(128, pad_token_id=5), "pad_token_id"),
    ("eagle-missing", SpecAlgorithm.EAGLE, None, "draft_model"),
    ("eagle3-missing", SpecAlgorithm.EAGLE3, None, "draft_model"),
    ("standalone-missing", SpecAlgorithm.STANDALONE, None, "draft_model"),
]


@pytest.mark.parametrize("kind", CONFIG_KINDS)
@pytest.mark.parametrize(
    "algorithm,draft,field",
    [case[1:] for case in INVALID_PAIRS],
    ids=[case[0] for case in INVALID_PAIRS],
)
def test_validate_rejects_naming_the_field(kind, algorithm, draft, field):
    target = make_config(kind, target_fields(576, layers=30, vocab=49152))
    with pytest.raises(ShapeContractError) as info:
        validate_spec_pair(algorithm, target, make_config(kind, draft))
    message = str(info.value)
    # The field comes first ("hidden_size:" must not be satisfied by "target_hidden_size").
    assert message.startswith(f"{field}:"), message
    assert "\n" not in message


VALID_PAIRS = [
    ("none", SpecAlgorithm.NONE, None),
    ("ngram", SpecAlgorithm.NGRAM, None),
    ("standalone-smaller-hidden", SpecAlgorithm.STANDALONE, draft_fields(128)),
    ("standalone-same-special-ids", SpecAlgorithm.STANDALONE,
     draft_fields(128, bos_token_id=1, eos_token_id=[2], pad_token_id=3)),
    # An instruct draft may list more eos ids than its target (Llama 3.x base vs instruct).
    ("standalone-more-eos-ids", SpecAlgorithm.STANDALONE, draft_fields(128, eos_token_id=[2, 7, 9])),
    # EAGLE heads tokenize nothing: their special ids need not match (SpecForge's Llama 3 8B head
    # declares eos 128001, Llama-3.1-8B-Instruct [128001, 128008, 128009]).
    ("eagle3-other-special-ids", SpecAlgorithm.EAGLE3,
     draft_fields(256, target_hidden_size=576, bos_token_id=0, eos_token_id=9, pad_token_id=0)),
    ("eagle-same-hidden", SpecAlgorithm.EAGLE, draft_fields(576)),
    ("eagle3", SpecAlgorithm.EAGLE3, EAGLE3_DRAFT),
    # No target_hidden_size: fc reads 3 x the draft's own hidden_size, as wide as the target's here.
    ("eagle3-no-target-hidden-size", SpecAlgorithm.EAGLE3, draft_fields(576)),
    ("eagle3-edge-ids", SpecAlgorithm.EAGLE3,
     draft_fields(256, target_hidden_size=576, eagle_config={"eagle_aux_hidden_state_layer_ids": [-1, 14, 28]})),
    ("eagle3-no-aux", SpecAlgorithm.EAGLE3,
     draft_fields(256, target_hidden_size=576, eagle_config={"use_aux_hidden_state": False})),
    ("eagle3-draft-vocab-equal", SpecAlgorithm.EAGLE3, draft_fields(256, target_hidden_size=576, draft_vocab_size=49152)),
]


@pytest.mark.parametrize("kind", CONFIG_KINDS)
@pytest.mark.parametrize(
    "algorithm,draft", [case[1:] for case in VALID_PAIRS], ids=[case[0] for case in VALID_PAIRS]
)
def test_validate_accepts_valid_pairs(kind, algorithm, draft):
    target = make_config(kind, target_fields(576, layers=30, vocab=49152))
    validate_spec_pair(algorithm, target, make_config(kind, draft))
    validate_spec_pair(algorithm.name.lower(), target, make_config(kind, draft))


# --------------------------------------------------------------------------- published pairs
# Target and EAGLE-3 draft configs as published, pasted field for field (only `null` -> None,
# `true`/`false` -> True/False). The drafts are SpecForge's (what `lmsys/*-EAGLE3` heads are
# trained from): no target_hidden_size, no eagle_config, so the width fc reads is 3 x their own
# hidden_size and the aux layers are the default [2, L//2, L-3] inputs.

# citsjtu2020/LLM-Prof sglang/Model_Config.md, "Llama-3.1-8B" (the Instruct model's config has the
# same fields but eos_token_id [128001, 128008, 128009], as the 70B draft below declares).
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
# citsjtu2020/LLM-Prof sglang/Model_Config.md, "Qwen3-4B".
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "initializer_range": 0.02,
    "intermediate_size": 9728, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 0.000001,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.2", "use_cache": False, "use_sliding_window": False,
    "vocab_size": 151936,
}
# citsjtu2020/LLM-Prof sglang/Model_Config.md, "Qwen3-8B".
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
# oumi-ai/oumi configs/recipes/llama3_3/README.md, "70B / Model Info" (vocab 128,256, hidden 8192,
# intermediate 28,672, 80 layers, 64 heads, 8 KV heads, untied, 131,072 max length); special ids as
# the Llama 3.x instruct configs (SpecForge's 70B draft config repeats them).
LLAMA_3_3_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "tie_word_embeddings": False, "max_position_embeddings": 131072, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

# SpecForge configs/llama3-8B-eagle3.json (as in yubofredwang/SpecForge at 79694c7).
LLAMA3_8B_EAGLE3 = {
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 128256,
    "draft_vocab_size": 31960,
}
# sgl-project/SpecForge configs/qwen3-4b-eagle3.json.
QWEN3_4B_EAGLE3 = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 80, "hidden_act": "silu", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936, "draft_vocab_size": 32000,
}
# SpecForge configs/qwen3-8b-eagle3.json (as in yubofredwang/SpecForge at 7064fc6).
QWEN3_8B_EAGLE3 = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936, "draft_vocab_size": 32000,
}
# sgl-project/SpecForge configs/llama3-70B-ealge3.json (the file's own spelling), for Llama-3.3-70B-Instruct.
LLAMA3_70B_EAGLE3 = {
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 8192, "initializer_range": 0.02,
    "intermediate_size": 28672, "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 4096, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 128256, "draft_vocab_size": 32000,
}

# (id, target, draft, width fc reads, aux layer-output ids, draft vocabulary)
PUBLISHED_PAIRS = [
    ("llama-3.1-8b", LLAMA_3_1_8B, LLAMA3_8B_EAGLE3, 3 * 4096, [1, 15, 28], 31960),
    ("qwen3-4b", QWEN3_4B, QWEN3_4B_EAGLE3, 3 * 2560, [1, 17, 32], 32000),
    ("qwen3-8b", QWEN3_8B, QWEN3_8B_EAGLE3, 3 * 4096, [1, 17, 32], 32000),
    ("llama-3.3-70b", LLAMA_3_3_70B, LLAMA3_70B_EAGLE3, 3 * 8192, [1, 39, 76], 32000),
]


@pytest.mark.parametrize("target,draft,width,aux_ids,draft_vocab", [p[1:] for p in PUBLISHED_PAIRS],
                         ids=[p[0] for p in PUBLISHED_PAIRS])
def test_published_eagle3_pairs_agree(target, draft, width, aux_ids, draft_vocab):
    from spec.shapes import agreed_shapes

    validate_spec_pair(SpecAlgorithm.EAGLE3, target, draft)
    shapes = agreed_shapes(SpecAlgorithm.EAGLE3, target, draft)
    assert shapes["draft_input_width"] == width == 3 * target["hidden_size"]
    assert shapes["eagle_aux_hidden_state_layer_ids"] == aux_ids
    assert shapes["aux_layer_inputs_captured"] == [i + 1 for i in aux_ids]
    assert shapes["draft_vocab_size"] == draft_vocab and shapes["vocab_size"] == draft["vocab_size"]
    assert get_draft_recurrent_hidden_state_spec(SpecAlgorithm.EAGLE3, target, draft, torch.bfloat16).width \
        == draft["hidden_size"]


# A draft published for one target, paired with another: (id, target, draft, field named first).
MISMATCHED_PAIRS = [
    # The 8B head is 4096 wide with no target_hidden_size: its fc reads 3 x 4096, Qwen3-4B gives 3 x 2560.
    ("qwen3-4b+qwen3-8b-head", QWEN3_4B, QWEN3_8B_EAGLE3, "target_hidden_size"),
    ("qwen3-8b+qwen3-4b-head", QWEN3_8B, QWEN3_4B_EAGLE3, "target_hidden_size"),
    ("llama-3.3-70b+llama-3.1-8b-head", LLAMA_3_3_70B, LLAMA3_8B_EAGLE3, "target_hidden_size"),
    # Same width, other tokenizer.
    ("llama-3.1-8b+qwen3-8b-head", LLAMA_3_1_8B, QWEN3_8B_EAGLE3, "vocab_size"),
    ("qwen3-8b+llama-3.1-8b-head", QWEN3_8B, LLAMA3_8B_EAGLE3, "vocab_size"),
    # The 8B head declaring the width it was trained on, paired with the 70B target.
    ("llama-3.3-70b+declared-8b-head", LLAMA_3_3_70B, dict(LLAMA3_8B_EAGLE3, target_hidden_size=4096),
     "target_hidden_size"),
]


@pytest.mark.parametrize("target,draft,field", [p[1:] for p in MISMATCHED_PAIRS], ids=[p[0] for p in MISMATCHED_PAIRS])
def test_published_heads_on_the_wrong_target_are_refused(target, draft, field):
    with pytest.raises(ShapeContractError) as info:
        validate_spec_pair(SpecAlgorithm.EAGLE3, target, draft)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_mismatched_pair_error_gives_both_widths():
    with pytest.raises(ShapeContractError) as info:
        validate_spec_pair(SpecAlgorithm.EAGLE3, QWEN3_4B, QWEN3_8B_EAGLE3)
    assert str(info.value) == ("target_hidden_size: EAGLE3 draft declares none, so its fc reads 3 x hidden_size "
                               "(3 x 4096), but the target gives 3 x 2560")
