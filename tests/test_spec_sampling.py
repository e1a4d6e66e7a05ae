"""Sampling rules (spec/sampling.py) and draft-tree helpers (spec/tree.py).

Statistical checks use fixed seeds and positions: the sampler is a pure function of
(seed, position), so each check either always passes or always fails, it cannot flake.
Chi-square thresholds are the 0.1% upper quantiles.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from spec.sampling import SamplingParams, accept_tree, choose_tokens, uniforms
from spec.tree import ancestor_mask, chain_parents, depths

# Upper 0.001 quantiles of the chi-square distribution, by degrees of freedom.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 19: 43.820}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic of observed `counts` against `probs` (all probs > 0)."""
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", True), ("max_tokens", 2.5),
        ("temperature", -0.1), ("temperature", 101.0), ("temperature", float("nan")), ("temperature", "1"),
        ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.5),
        ("top_k", -2), ("top_k", 1.5),
        ("seed", -1), ("seed", 2**63), ("seed", 1.0),
        ("stop", [""]), ("stop", ["ok", ""]), ("stop", [3]),
    ],
)
def test_sampling_params_rejects_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_and_normalisation():
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed, params.stop) == (
        16, 1.0, 1.0, 0, None, [])
    assert not params.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    # Edges that are allowed.
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, seed=0)
    SamplingParams(temperature=100.0, top_p=1e-9, top_k=1, seed=2**63 - 1)


# --------------------------------------------------------------------------- choose_tokens


def rows_of(n: int, temperature=1.0, top_p=1.0, top_k=0, seed=0, positions=None):
    """The per-row arguments of choose_tokens for n rows: (temperature, top_p, top_k, seeds, positions)."""
    return (
        torch.full((n,), float(temperature)),
        torch.full((n,), float(top_p)),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), seed, dtype=torch.long) if isinstance(seed, int) else seed,
        torch.arange(n) if positions is None else positions,
    )


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3  # (R, V)


def test_temperature_zero_is_argmax_whatever_the_rest():
    logits = random_logits(64, 50)
    for top_p, top_k, seed in [(1.0, 0, 0), (0.3, 5, 7), (0.9, 1, 123)]:
        tokens = choose_tokens(logits, *rows_of(64, 0.0, top_p, top_k, seed))
        assert tokens.dtype == torch.long and tokens.shape == (64,)
        assert torch.equal(tokens, logits.argmax(dim=1))


def test_temperature_zero_takes_the_first_of_tied_maxima():
    """Greedy ties go to the lowest token id, as transformers' argmax does (bf16 logits tie often)."""
    logits = torch.zeros(3, 4096)
    logits[0, [7, 300, 4000]] = 2.0
    logits[1, [0, 4095]] = 1.0
    logits[2, 1000:] = -1.0  # every id tied below 1000
    tokens = choose_tokens(logits, *rows_of(3, 0.0, 1.0, 0, 0))
    assert tokens.tolist() == [7, 0, 0]


def test_same_seed_and_position_give_the_same_token():
    logits = random_logits(256, 40)
    args = rows_of(256, 1.0, 0.95, 20, seed=99)
    first = choose_tokens(logits, *args)
    assert torch.equal(first, choose_tokens(logits.clone(), *args))
    # Not a constant: other seeds give other tokens on many rows.
    other = choose_tokens(logits, *rows_of(256, 1.0, 0.95, 20, seed=100))
    assert (first != other).sum() > 50


def test_a_row_does_not_depend_on_its_batch():
    logits = random_logits(32, 30, seed=3)
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0] * 8)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0] * 8)
    top_k = torch.tensor([0, 0, 5, -1] * 8)
    seeds, positions = torch.arange(32) * 7, torch.arange(32) + 100
    together = choose_tokens(logits, temperature, top_p, top_k, seeds, positions)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    shuffled = choose_tokens(logits[order], temperature[order], top_p[order], top_k[order], seeds[order],
                             positions[order])
    assert torch.equal(shuffled, together[order])
    for i in range(32):
        alone = choose_tokens(logits[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], top_k[i:i + 1],
                              seeds[i:i + 1], positions[i:i + 1])
        assert int(alone) == int(together[i])


def test_top_k_one_and_tiny_top_p_are_argmax_at_temperature_one():
    logits = random_logits(500, 64, seed=5)
    argmax = logits.argmax(dim=1)
    assert torch.equal(choose_tokens(logits, *rows_of(500, 1.0, 1.0, 1, seed=11)), argmax)
    assert torch.equal(choose_tokens(logits, *rows_of(500, 1.0, 1e-6, 0, seed=11)), argmax)
    # Sanity: without the restriction the sampler does leave the argmax.
    assert (choose_tokens(logits, *rows_of(500, 1.0, 1.0, 0, seed=11)) != argmax).any()


def test_top_k_disabled_by_zero_and_minus_one():
    logits = random_logits(300, 20, seed=8)
    full = choose_tokens(logits, *rows_of(300, 1.0, 1.0, 20, seed=4))
    assert torch.equal(choose_tokens(logits, *rows_of(300, 1.0, 1.0, 0, seed=4)), full)
    assert torch.equal(choose_tokens(logits, *rows_of(300, 1.0, 1.0, -1, seed=4)), full)
    assert torch.equal(choose_tokens(logits, *rows_of(300, 1.0, 1.0, 1000, seed=4)), full)


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent (V,) target distribution: softmax(logits / T), then top-k, then top-p, renormalised."""
    weights = [math.exp(x / temperature) for x in logits]
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        order = order[:top_k]
    total = sum(weights[i] for i in order)
    kept, mass = [], 0.0
    for i in order:  # smallest prefix whose mass reaches top_p
        if mass >= top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    probs = torch.zeros(len(logits), dtype=torch.float64)
    for i in kept:
        probs[i] = weights[i]
    return probs / probs.sum()


LOGITS6 = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0), (0.8, 0, 1.0), (2.5, 0, 1.0), (1.3, 3, 1.0), (0.7, 0, 0.8), (1.0, 4, 0.7),
        # top-p applies to the top-k renormalised mass: these keep fewer tokens than top-p on the raw mass
        (1.0, 2, 0.7), (1.5, 3, 0.7),
    ],
)
@pytest.mark.parametrize("vary", ["positions", "seeds"])
def test_sampling_frequencies_match_the_target_distribution(temperature, top_k, top_p, vary):
    n = 40_000
    logits = torch.tensor(LOGITS6).expand(n, -1)  # (n, 6): one row per draw
    index = torch.arange(n)
    if vary == "positions":  # one request, many positions
        args = rows_of(n, temperature, top_p, top_k, seed=1234, positions=index)
    else:  # many requests, one position
        args = rows_of(n, temperature, top_p, top_k, seed=index * 3 + 1, positions=torch.full((n,), 17))
    counts = torch.bincount(choose_tokens(logits, *args), minlength=6)  # (6,)

    probs = reference_probs(LOGITS6, temperature, top_k, top_p)
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside top-k / top-p"
    df = int(support.sum()) - 1
    if df:
        assert chi_square(counts[support], probs[support]) < CHI2_999[df], (counts, probs * n)


def test_frequency_check_detects_a_wrong_temperature():
    """The statistic used above does separate close distributions (so it is not vacuous)."""
    n = 40_000
    counts = torch.bincount(
        choose_tokens(torch.tensor(LOGITS6).expand(n, -1), *rows_of(n, 1.0, 1.0, 0, seed=1234)), minlength=6)
    assert chi_square(counts, reference_probs(LOGITS6, 1.0, 0, 1.0)) < CHI2_999[5]
    assert chi_square(counts, reference_probs(LOGITS6, 0.9, 0, 1.0)) > CHI2_999[5]


# --------------------------------------------------------------------------- uniforms


@pytest.mark.parametrize("vary", ["positions", "seeds"])
def test_uniforms_in_unit_interval_and_uniform(vary):
    n = 100_000
    index = torch.arange(n)
    if vary == "positions":
        u = uniforms(torch.full((n,), 42), index)
    else:
        u = uniforms(index, torch.full((n,), 5))
    assert u.dtype == torch.float64 and u.shape == (n,)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert len(torch.unique(u)) > n - 5
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    assert chi_square(counts, torch.full((20,), 1 / 20)) < CHI2_999[19]
    # Neighbours are not correlated.
    corr = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(corr)) < 0.02


def test_uniforms_extreme_inputs():
    seeds = torch.tensor([0, 1, 2**63 - 1, 2**62, 12345])
    positions = torch.tensor([0, 2**40, 7, 2**31, 0])
    u = uniforms(seeds, positions)
    assert ((u >= 0) & (u < 1)).all()
    assert torch.equal(u, uniforms(seeds.clone(), positions.clone()))
    assert len(set(u.tolist())) == 5


# --------------------------------------------------------------------------- accept_tree

CHAIN_TOKENS = [10, 11, 12, 13]  # node 0 is the root (the verified token)
CHAIN_PARENTS = [-1, 0, 1, 2]


def test_accept_chain_fully():
    # The target's token at node i is the draft token of node i + 1, then a bonus at the end.
    path, bonus = accept_tree(CHAIN_TOKENS, CHAIN_PARENTS, target_tokens=[11, 12, 13, 99])
    assert path == [0, 1, 2, 3] and bonus == 99


def test_accept_chain_rejected_at_first():
    path, bonus = accept_tree(CHAIN_TOKENS, CHAIN_PARENTS, target_tokens=[50, 12, 13, 99])
    assert path == [0] and bonus == 50


def test_accept_chain_partially():
    path, bonus = accept_tree(CHAIN_TOKENS, CHAIN_PARENTS, target_tokens=[11, 77, 13, 99])
    assert path == [0, 1] and bonus == 77


#        0 (root)
#       / \
#  1:t5    2:t7
#   |      /  \
#  3:t9  4:t11 5:t12
TREE_TOKENS = [1, 5, 7, 9, 11, 12]
TREE_PARENTS = [-1, 0, 0, 1, 2, 2]


@pytest.mark.parametrize(
    "target_tokens,path,bonus",
    [
        ([7, 0, 12, 0, 0, 42], [0, 2, 5], 42),  # second branch, then its second child
        ([7, 0, 11, 0, 8, 0], [0, 2, 4], 8),
        ([5, 9, 0, 3, 0, 0], [0, 1, 3], 3),  # first branch to its leaf
        ([5, 4, 0, 0, 0, 0], [0, 1], 4),  # node 1 accepted, its child rejected
        ([6, 9, 12, 0, 0, 0], [0], 6),  # no child of the root matches
    ],
)
def test_accept_tree_follows_the_matching_branch(target_tokens, path, bonus):
    assert accept_tree(TREE_TOKENS, TREE_PARENTS, target_tokens) == (path, bonus)


def test_accept_tree_duplicate_sibling_tokens_take_the_first():
    assert accept_tree([0, 5, 5], [-1, 0, 0], [5, 1, 2]) == ([0, 1], 1)


def test_accept_tree_random_trees_satisfy_the_rule():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 10)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tokens = [rng.randrange(4) for _ in range(n)]
        target = [rng.randrange(4) for _ in range(n)]
        path, bonus = accept_tree(tokens, parents, target)
        assert path[0] == 0
        for parent, child in zip(path, path[1:]):
            assert parents[child] == parent and tokens[child] == target[parent]
        last = path[-1]
        assert bonus == target[last]
        assert not any(parents[c] == last and tokens[c] == bonus for c in range(n)), "stopped too early"


# --------------------------------------------------------------------------- tree helpers


def test_tree_mask_and_depths_hand_built():
    parents = torch.tensor([TREE_PARENTS])  # (1, 6)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    mask = ancestor_mask(parents)
    assert mask.shape == (1, 6, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[0], expected)
    assert depths(mask).tolist() == [[0, 1, 1, 2, 2, 2]]


def test_chain_mask_is_lower_triangular_and_depths_count_up():
    parents = chain_parents(2, 5)  # (2, 5)
    assert parents.tolist() == [[-1, 0, 1, 2, 3]] * 2
    mask = ancestor_mask(parents)
    assert torch.equal(mask, torch.tril(torch.ones(5, 5, dtype=torch.bool)).expand(2, 5, 5))
    assert depths(mask).tolist() == [[0, 1, 2, 3, 4]] * 2


def test_tree_helpers_are_per_row():
    parents = torch.stack([torch.tensor(TREE_PARENTS), chain_parents(1, 6)[0]])  # (2, 6)
    mask = ancestor_mask(parents)
    depth = depths(mask)
    assert torch.equal(mask[0], ancestor_mask(parents[:1])[0])
    assert torch.equal(mask[1], torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    assert depth.tolist() == [[0, 1, 1, 2, 2, 2], [0, 1, 2, 3, 4, 5]]
    # Depth = ancestors excluding self.
    assert torch.equal(depth, mask.sum(dim=2) - 1)


@pytest.mark.parametrize("n", [1, 2, 8, 16, 17, 33])
def test_ancestor_mask_matches_walking_up_the_parents(n):
    """Random trees and the deepest one (a chain of n - 1 edges): the squaring must reach the root."""
    g = torch.Generator().manual_seed(n)
    random = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    parents = torch.stack([torch.tensor(random), chain_parents(1, n)[0]])  # (2, n)
    expected = torch.zeros(2, n, n, dtype=torch.bool)
    for b, row in enumerate(parents.tolist()):
        for i in range(n):
            j = i
            while j >= 0:
                expected[b, i, j] = True
                j = row[j]
    assert torch.equal(ancestor_mask(parents), expected)
