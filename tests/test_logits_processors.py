"""Logits processors and logprobs (spec/sampling.py) against hand-computed expectations."""

from __future__ import annotations

import math

import pytest
import torch

from spec.batch import BatchMeta
from spec.sampling import (ProcessorRows, SamplingParams, child_seed, choose_tokens, process_logits,
                           processed_probs, token_logprobs, tree_processor_rows)
from spec.tree import ancestor_mask, depths


def rows(logits_rows: int, prompt=(), output=(), num_output=0, min_tokens=0, stop_ids=(), bias=None,
         repetition=1.0, presence=0.0, frequency=0.0) -> ProcessorRows:
    """The same processor settings on every row."""
    r = logits_rows
    ids = lambda xs: torch.tensor([list(xs)] * r, dtype=torch.long).reshape(r, len(xs))  # noqa: E731
    bias = bias or {}
    return ProcessorRows(
        prompt_tokens=ids(prompt), output_tokens=ids(output), num_output=torch.full((r,), num_output),
        min_tokens=torch.full((r,), min_tokens), stop_ids=ids(stop_ids), bias_ids=ids(bias.keys()),
        bias_values=torch.tensor([list(bias.values())] * r, dtype=torch.float32).reshape(r, len(bias)),
        repetition_penalty=torch.full((r,), repetition), presence_penalty=torch.full((r,), presence),
        frequency_penalty=torch.full((r,), frequency),
    )


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    out = process_logits(LOGITS, rows(1, prompt=[0], output=[1, 2], repetition=2.0))
    # 0 (prompt): 2/2; 1 (output, negative): -1*2; 2 (output): 0.5/2; 3, 4 unseen.
    assert out.tolist() == [[1.0, -2.0, 0.25, 3.0, 0.0]]


def test_frequency_and_presence_count_output_tokens_only():
    out = process_logits(LOGITS, rows(1, prompt=[3, 3], output=[1, 2, 2], frequency=0.5, presence=0.25))
    # 1 once: -0.5 - 0.25; 2 twice: -1.0 - 0.25; 3 only in the prompt: untouched.
    assert out.tolist() == [[2.0, -1.75, -0.75, 3.0, 0.0]]


def test_negative_penalties_encourage_repeats():
    out = process_logits(LOGITS, rows(1, output=[4, 4], frequency=-1.0, presence=-0.5))
    assert out[0, 4].item() == pytest.approx(2.5)


def test_logit_bias_adds_and_comes_before_the_penalties():
    out = process_logits(LOGITS, rows(1, output=[0], bias={0: 2.0, 3: -100.0}, repetition=2.0))
    # 0: (2 + 2) / 2 (biased, then penalised); 3: 3 - 100.
    assert out.tolist() == [[2.0, -1.0, 0.5, -97.0, 0.0]]


@pytest.mark.parametrize("num_output,masked", [(0, True), (2, True), (3, False), (7, False)])
def test_min_tokens_masks_stop_ids_until_reached(num_output, masked):
    out = process_logits(LOGITS, rows(1, num_output=num_output, min_tokens=3, stop_ids=[3, 1]))
    expect = [2.0, -math.inf, 0.5, -math.inf, 0.0] if masked else LOGITS[0].tolist()
    assert out[0].tolist() == expect
    greedy = choose_tokens(LOGITS, torch.zeros(1), torch.ones(1), torch.zeros(1, dtype=torch.long),
                           torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                           processors=rows(1, num_output=num_output, min_tokens=3, stop_ids=[3, 1]))
    assert greedy.item() == (0 if masked else 3)


def test_neutral_processors_change_nothing():
    assert torch.equal(process_logits(LOGITS, rows(1, prompt=[0, 1], output=[2, 3])), LOGITS)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = processed_probs(logits, torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.long),
                            min_p=torch.tensor([0.4]))  # threshold 0.4 * 0.5 = 0.2
    assert probs[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    same = processed_probs(logits, torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.long),
                           min_p=torch.tensor([0.0]))
    assert same[0].tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])


def test_token_logprobs_are_raw_log_softmax_with_top_k():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    chosen = torch.tensor([4, 0, 9])
    lp, top, ids = token_logprobs(logits, chosen, 3)
    ref = logits.log_softmax(-1)
    assert torch.allclose(lp, ref[torch.arange(3), chosen])
    assert torch.allclose(top, ref.topk(3, dim=1).values) and torch.equal(ids, ref.topk(3, dim=1).indices)
    assert token_logprobs(logits, chosen, 0)[1].shape == (3, 0)


def test_tree_rows_count_the_path_drafts_as_output():
    """Node i's history is prompt + output + the draft tokens from the root's child down to i."""
    parents = torch.tensor([[-1, 0, 0, 1]])  # root; 1, 2 children of root; 3 child of 1
    mask = ancestor_mask(parents)
    draft = torch.tensor([[9, 5, 6, 7]])  # root 9 is the last output token
    positions = 10 + depths(mask)
    meta = BatchMeta(
        seq_lens=torch.tensor([10]), kv_slots=torch.zeros((1, 0), dtype=torch.long),
        prefill_lens=torch.zeros(1, dtype=torch.long), prefill_tokens=torch.zeros((1, 0), dtype=torch.long),
        prefill_slots=torch.zeros((1, 0), dtype=torch.long), next_token=torch.tensor([-1]),
        scratch_slots=torch.zeros((1, 0), dtype=torch.long), verify_slots=torch.zeros((1, 4), dtype=torch.long),
        temperature=torch.zeros(1), top_p=torch.ones(1), top_k=torch.zeros(1, dtype=torch.long),
        seeds=torch.zeros(1, dtype=torch.long), history=torch.tensor([[1, 2, 3, 8, 9]]),
        prompt_lens=torch.tensor([3]), num_output=torch.tensor([2]), min_tokens=torch.tensor([4]),
        stop_ids=torch.tensor([[5]]), repetition_penalty=torch.tensor([2.0]))
    r = tree_processor_rows(meta, draft, mask, positions)
    outputs = [sorted(t for t in row if t >= 0) for row in r.output_tokens.tolist()]
    assert outputs == [[8, 9], [5, 8, 9], [6, 8, 9], [5, 7, 8, 9]]
    assert [sorted(t for t in row if t >= 0) for row in r.prompt_tokens.tolist()] == [[1, 2, 3]] * 4
    assert r.num_output.tolist() == [2, 3, 3, 4]  # min_tokens 4: stop id 5 still held at nodes 0-2
    logits = torch.zeros(4, 10)
    logits[:, 5] = 1.0
    out = process_logits(logits, r)
    assert out[:3, 5].tolist() == [-math.inf] * 3 and out[3, 5].item() == 0.5  # node 3: seen, 1 / 2


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
    ("repetition_penalty", "1"), ("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 17),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("logit_bias", {1: 101}), ("logit_bias", {-1: 1}),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", True),
])
def test_sampling_params_rejects_bad_processor_fields(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})


def test_vocab_check_and_stop_ids():
    params = SamplingParams(logit_bias={70: 1.0}, stop_token_ids=[3])
    with pytest.raises(ValueError, match="logit_bias: token id 70"):
        params.check_vocab(64)
    assert params.stop_ids({62}) == [3, 62]
    assert SamplingParams(ignore_eos=True, stop_token_ids=[3]).stop_ids({62}) == [3]


def test_child_seeds_differ_and_stay_in_range():
    assert [child_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert child_seed(2**63 - 1, 1) == 0
