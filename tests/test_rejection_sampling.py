"""Speculative sampling preserves the target's distribution: chi-square tests of the
marginals of the 2nd and 3rd output tokens (both produced by verification) against the
exact target probabilities, with drafts that disagree with the target."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from graphs import EngineConfig, SamplingParams, build_graph
from bench.random_models import make_eagle3, make_llama

VOCAB = 16
PROMPT = [3, 1, 4]
NUM_SAMPLES = 2400
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rs")
    # std 0.6: peaked but not degenerate distributions over 16 tokens.
    target = make_llama(root / "target", vocab_size=VOCAB, hidden=32, layers=4, heads=4, kv_heads=2,
                        intermediate=64, seed=11, std=0.6)
    standalone = make_llama(root / "draft", vocab_size=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1,
                            intermediate=32, seed=12, std=0.6)
    eagle3 = make_eagle3(root / "eagle3", target, hidden=32, seed=13)
    return target, standalone, eagle3


# Penalties strong enough to move the distributions a lot (vLLM semantics, written out by hand
# in `penalised` below as an independent reference).
PENALTIES = dict(repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.4, logit_bias={5: 1.5})


def penalised(logits: torch.Tensor, outputs: list[int]) -> torch.Tensor:
    """One row of logits (V,) after logit_bias, then the repetition penalty over prompt + output
    and the frequency and presence penalties over the output."""
    logits = logits.clone()
    for token, bias in PENALTIES["logit_bias"].items():
        logits[token] += bias
    for token in set(PROMPT) | set(outputs):
        rep = PENALTIES["repetition_penalty"]
        logits[token] = logits[token] / rep if logits[token] > 0 else logits[token] * rep
    for token in set(outputs):
        logits[token] -= PENALTIES["frequency_penalty"] * outputs.count(token) + PENALTIES["presence_penalty"]
    return logits


def exact_marginals(target, processors: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
    """P(x2), P(x3) and P(x3 == x2) under the target alone, by enumerating every (x1, x2) prefix."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prefixes1 = [[a] for a in range(VOCAB)]
    prefixes2 = [[a, b] for a in range(VOCAB) for b in range(VOCAB)]

    def dist(logits: torch.Tensor, prefixes: list[list[int]]) -> torch.Tensor:
        if processors:
            logits = torch.stack([penalised(row, out) for row, out in zip(logits, prefixes)])
        return logits.div(TEMPERATURE).softmax(-1)

    with torch.no_grad():
        p1 = dist(model(torch.tensor([PROMPT])).logits[:, -1], [[]])[0]  # (V,)
        p2 = dist(model(torch.tensor([PROMPT + p for p in prefixes1])).logits[:, -1], prefixes1)  # (V, V): [x1, x2]
        p3 = dist(model(torch.tensor([PROMPT + p for p in prefixes2])).logits[:, -1], prefixes2).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2  # (x1, x2)
    repeat = float((joint12 * p3.diagonal(dim1=1, dim2=2)).sum())  # p3[x1, x2, x2]
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1)), repeat


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test; cells with small expectation are pooled; p-value by Wilson-Hilferty."""
    expected = probs.double() * counts.sum()
    order = expected.argsort()
    obs_cells, exp_cells, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():
        acc_o += float(counts[i])
        acc_e += float(expected[i])
        if acc_e >= 5.0:
            obs_cells.append(acc_o)
            exp_cells.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e:
        obs_cells[-1] += acc_o
        exp_cells[-1] += acc_e
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_cells, exp_cells))
    dof = len(exp_cells) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


CASES = [
    ("NONE", None, 1, 4),
    ("STANDALONE", "standalone", 1, 4),  # chain
    ("STANDALONE", "standalone", 3, 6),  # tree
    ("EAGLE3", "eagle3", 1, 4),
    ("EAGLE3", "eagle3", 2, 5),
    ("NGRAM", None, 1, 4),
]


@pytest.mark.parametrize("algorithm,draft,topk,n,processors",
                         [(*case, False) for case in CASES]
                         # The target drafting for itself: most third tokens come from accepted nodes,
                         # whose distribution must count the node's own draft token as output.
                         + [("STANDALONE", "target", 3, 6, True)])
def test_output_distribution_matches_target(models, algorithm, draft, topk, n, processors):
    """With penalties and logit_bias too: each tree node's distribution counts the drafts on its
    path as output, so accepted tokens still follow the penalised target exactly."""
    target, standalone, eagle3 = models
    draft_path = {"standalone": standalone, "eagle3": eagle3, "target": target}.get(draft)
    engine = build_graph(EngineConfig(
        model=str(target), speculative_algorithm=None if algorithm == "NONE" else algorithm,
        draft_model=draft_path and str(draft_path), eagle_topk=topk, num_draft_tokens=n,
        # Fixed trees: the adaptive policy may decode 400 requests plainly (its choice follows measured
        # step costs), and this test is about the distribution of accepted tokens.
        max_running_requests=400, kv_slots=32768, adaptive_speculation=False,
    ))
    sched = engine.scheduler
    extra = PENALTIES if processors else {}
    reqs = [sched.find(sched.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=TEMPERATURE, seed=s,
                                                                 ignore_eos=True, **extra)))
            for s in range(NUM_SAMPLES)]
    while sched.has_unfinished():
        sched.step()
    tokens = torch.tensor([r.output_ids for r in reqs])  # (S, 3)
    p2, p3, repeat = exact_marginals(target, processors)
    accepted = sum(sum(r.accept_lens) for r in reqs)
    if algorithm != "NONE":
        assert accepted > 0, "the test must exercise acceptance"
        assert accepted < 2 * NUM_SAMPLES, "the draft must disagree with the target sometimes"
    for position, probs in ((1, p2), (2, p3)):
        counts = torch.bincount(tokens[:, position], minlength=VOCAB)
        assert chi_square_p_value(counts, probs) > 1e-3, (position, counts.tolist(), (probs * NUM_SAMPLES).tolist())
    # How often the third token repeats the second: penalties act on exactly this, and at an
    # accepted draft node only if the node's own token counts as output (4 standard deviations).
    repeats, expected = int((tokens[:, 2] == tokens[:, 1]).sum()), repeat * NUM_SAMPLES
    assert abs(repeats - expected) < 4 * math.sqrt(expected) + 1, (repeats, expected)
    if processors:  # the penalties matter: the samples are not the unpenalised target's
        plain3 = exact_marginals(target)[1]
        assert chi_square_p_value(torch.bincount(tokens[:, 2], minlength=VOCAB), plain3) < 1e-3
    assert sched.num_free_slots == 32768


def test_chi_square_detects_a_wrong_distribution(models):
    """The statistic has power: samples from a perturbed distribution are rejected."""
    target = models[0]
    p2, _, _ = exact_marginals(target)
    wrong = (p2 + 0.05).clamp_min(0)
    wrong /= wrong.sum()
    counts = torch.round(wrong * NUM_SAMPLES).long()
    assert chi_square_p_value(counts, p2) < 1e-3
