"""Adaptive speculation: how many tree nodes a decode step verifies, chosen from measurements.

A step that verifies N nodes per request costs more than a plain step (N = 1, the root alone),
and gains the draft tokens it accepts. Both sides are measured online, never assumed:

* `StepCostModel`: step seconds per tree-size bucket, a decayed least-squares fit that is linear
  in the batch size and in the context tokens the batch attends to (what a verify row and a draft
  level cost at this load; the drafting a bucket needs is part of its step).
* `AcceptanceModel`: per request and draft depth, the decayed rate at which that depth's token is
  accepted given the one before it was; new requests start from the batch-wide rates.
* `TreeSizePolicy`: each step, among a few size buckets (the verify width is one per step: the
  batch stays rectangular), the one with the most expected tokens per second,
  sum_b E_b[accepted + 1] / cost(step). The user's `verify_budget` and `disable_by_batch_size` cap
  it. Buckets near the best are re-measured now and then, and as soon as the batch size or the
  context moves to a regime where they were never tried, so the choice follows the load.

Plain classes; no timing is taken here (the scheduler reports each step's wall time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Context tokens are fitted in thousands, so the three features have comparable scales.
_CONTEXT_UNIT = 1024.0


def size_buckets(tree_size: int) -> list[int]:
    """The verify widths a step may choose: every size up to 5, then powers of two and the full tree."""
    sizes = {n for n in range(1, min(tree_size, 5) + 1)}
    n = 8
    while n < tree_size:
        sizes.add(n)
        n *= 2
    sizes.add(tree_size)
    return sorted(sizes)


def capped_size(tree_size: int, batch: int, verify_budget: int | None, disable_by_batch_size: int | None) -> int:
    """The most nodes per request a user's caps allow in a step of `batch` requests: the root alone
    above `disable_by_batch_size`, else at most verify_budget // batch (never below the root)."""
    if disable_by_batch_size is not None and batch > disable_by_batch_size:
        return 1
    if verify_budget is not None:
        return max(1, min(tree_size, verify_budget // max(batch, 1)))
    return tree_size


class DecayedLinearFit:
    """y ~ w . x by least squares over exponentially decayed samples (each new sample multiplies the
    older ones' weight by `decay`), with a small ridge so that few samples still give an answer."""

    def __init__(self, num_features: int, decay: float, ridge: float = 1e-4):
        self.decay, self.ridge = decay, ridge
        self.xx = torch.zeros((num_features, num_features), dtype=torch.float64)
        self.xy = torch.zeros(num_features, dtype=torch.float64)
        self.weight = 0.0  # decayed sample count
        self._w: torch.Tensor | None = None

    def observe(self, x: list[float], y: float) -> None:
        v = torch.tensor(x, dtype=torch.float64)
        self.xx = self.decay * self.xx + torch.outer(v, v)
        self.xy = self.decay * self.xy + v * y
        self.weight = self.decay * self.weight + 1.0
        self._w = None

    def predict(self, x: list[float]) -> float:
        if self._w is None:
            scale = float(self.xx.diagonal().mean()) + 1e-12
            a = self.xx + self.ridge * scale * torch.eye(self.xx.shape[0], dtype=torch.float64)
            self._w = torch.linalg.solve(a, self.xy)
        return float(torch.tensor(x, dtype=torch.float64) @ self._w)


class StepCostModel:
    """Seconds of a decode step per tree-size bucket, as a function of the batch size B and the
    context tokens C the batch attends to: cost_n(B, C) = a_n + b_n B + c_n C (decayed fits)."""

    def __init__(self, buckets: list[int], decay: float = 0.95):
        self.fits = {n: DecayedLinearFit(3, decay) for n in buckets}

    @staticmethod
    def _features(batch: int, context_tokens: int) -> list[float]:
        return [1.0, float(batch), context_tokens / _CONTEXT_UNIT]

    def observe(self, nodes: int, batch: int, context_tokens: int, seconds: float) -> None:
        self.fits[nodes].observe(self._features(batch, context_tokens), seconds)

    def samples(self, nodes: int) -> float:
        return self.fits[nodes].weight

    def predict(self, nodes: int, batch: int, context_tokens: int) -> float:
        """Expected step seconds (never below a microsecond: an extrapolated line can dip under 0)."""
        return max(1e-6, self.fits[nodes].predict(self._features(batch, context_tokens)))


class AcceptanceModel:
    """Per request, the decayed rate q_d at which the depth-d draft token is accepted once depth d - 1
    was (d = 1..max_depth); a new request starts from the rates of all requests. Expected accepted
    tokens of a tree reaching depth D: sum_{d<=D} prod_{j<=d} q_j."""

    def __init__(self, max_depth: int, decay: float = 0.8, prior: float = 0.5):
        self.max_depth, self.decay = max_depth, decay
        self.overall = [prior] * max_depth
        self.per_request: dict[int, list[float]] = {}

    def rates(self, rid: int) -> list[float]:
        return self.per_request.get(rid, self.overall)

    def observe(self, rid: int, drafted_depth: int, accepted: int) -> None:
        """One verify step of request `rid`: its tree reached `drafted_depth`, `accepted` tokens were
        accepted. Depths past the first rejection say nothing (they were not reached)."""
        if drafted_depth <= 0:
            return
        own = self.per_request.setdefault(rid, list(self.overall))
        for rates, decay in ((own, self.decay), (self.overall, 1.0 - (1.0 - self.decay) / 4)):
            for d in range(min(accepted + 1, drafted_depth)):
                rates[d] = decay * rates[d] + (1.0 - decay) * (1.0 if d < accepted else 0.0)

    def expected(self, rid: int, depth: int) -> float:
        """Expected accepted draft tokens of a tree of `depth` levels."""
        total, reach = 0.0, 1.0
        for q in self.rates(rid)[:depth]:
            reach *= q
            total += reach
        return total

    def forget(self, rid: int) -> None:
        self.per_request.pop(rid, None)


@dataclass
class AdaptiveStats:
    """What /metrics shows of the policy: the steps at each chosen tree size, and the acceptance rate
    at each draft depth over all requests (decayed)."""

    steps_by_size: dict[int, int] = field(default_factory=dict)
    last_size: int = 0
    acceptance_by_depth: list[float] = field(default_factory=list)


class TreeSizePolicy:
    """Chooses each decode step's verify width (nodes per request, root included; 1 = plain decoding).

    adaptive=False keeps the fixed behaviour: the full tree within the user's caps."""

    def __init__(self, tree_size: int, draft_depth: int, adaptive: bool = True,
                 verify_budget: int | None = None, disable_by_batch_size: int | None = None,
                 explore_every: int = 64, min_samples: float = 2.0):
        self.tree_size, self.draft_depth, self.adaptive = tree_size, draft_depth, adaptive
        self.verify_budget, self.disable_by_batch_size = verify_budget, disable_by_batch_size
        self.buckets = size_buckets(tree_size)
        self.costs = StepCostModel(self.buckets)
        self.acceptance = AcceptanceModel(max(draft_depth, 1))
        self.explore_every, self.min_samples = explore_every, min_samples
        # Correction per bucket: accepted tokens seen over those predicted (small trees of a wide
        # draft accept less per depth than the rates, measured on full trees, suggest).
        self.seen = {n: 1.0 for n in self.buckets}
        self.predicted = {n: 1.0 for n in self.buckets}
        self.tried: dict[tuple[int, int, int], int] = {}  # (nodes, batch regime, context regime) -> step
        self.step = 0
        self.stats = AdaptiveStats()

    def depth(self, nodes: int) -> int:
        """Draft levels a tree of `nodes` can reach (a chain of n nodes has n - 1)."""
        return min(self.draft_depth, nodes - 1)

    @staticmethod
    def _regime(batch: int, context_tokens: int) -> tuple[int, int]:
        """Batch sizes and mean contexts within a factor of two behave alike."""
        return int(math.log2(max(batch, 1))), int(math.log2(max(context_tokens // max(batch, 1), 1) / 64 + 1))

    def expected_tokens(self, rids: list[int], nodes: int) -> float:
        """sum over requests of E[accepted + 1] with `nodes` per request."""
        depth = self.depth(nodes)
        if depth == 0:
            return float(len(rids))
        scale = min(1.0, self.seen[nodes] / self.predicted[nodes])
        return sum(1.0 + scale * self.acceptance.expected(rid, depth) for rid in rids)

    def choose(self, rids: list[int], context_tokens: int) -> int:
        """This step's nodes per request for a batch of requests `rids` attending to `context_tokens`."""
        batch = len(rids)
        cap = capped_size(self.tree_size, batch, self.verify_budget, self.disable_by_batch_size)
        if not self.adaptive or cap == 1:
            return self._chosen(cap)
        self.step += 1
        candidates = [n for n in self.buckets if n <= cap]
        fitted = [n for n in candidates if self.costs.samples(n) >= self.min_samples]
        unfitted = [n for n in candidates if n not in fitted]
        if not fitted or (unfitted and len(fitted) < 2):
            # Start up: measure the largest tree and the plain step before comparing anything.
            order = [candidates[-1], candidates[0], *candidates[1:-1]]
            return self._chosen(next(n for n in order if n in unfitted))
        rate = {n: self.expected_tokens(rids, n) / self.costs.predict(n, batch, context_tokens) for n in fitted}
        best = max(rate, key=rate.get)
        # Re-measure a neighbour of the best when this regime has not seen it lately.
        regime = self._regime(batch, context_tokens)
        i = candidates.index(best)
        for n in candidates[max(i - 1, 0): i + 2]:
            last = self.tried.get((n, *regime))
            if n != best and (last is None or self.step - last >= self.explore_every):
                return self._chosen(n, regime)
        return self._chosen(best, regime)

    def _chosen(self, nodes: int, regime: tuple[int, int] | None = None) -> int:
        if regime is not None:
            self.tried[(nodes, *regime)] = self.step
        self.stats.steps_by_size[nodes] = self.stats.steps_by_size.get(nodes, 0) + 1
        self.stats.last_size = nodes
        return nodes

    def observe(self, rids: list[int], context_tokens: int, nodes: int, seconds: float | None,
                accepted: list[int]) -> None:
        """A decode step ran with `nodes` per request in `seconds` (None: not timed alone) and each
        request accepted `accepted[b]` draft tokens."""
        depth = self.depth(nodes)
        if depth:
            predicted = sum(self.acceptance.expected(rid, depth) for rid in rids)
            self.seen[nodes] = 0.9 * self.seen[nodes] + 0.1 * sum(accepted)
            self.predicted[nodes] = 0.9 * self.predicted[nodes] + 0.1 * max(predicted, 1e-3)
            for rid, a in zip(rids, accepted):
                self.acceptance.observe(rid, depth, a)
        if self.adaptive and seconds is not None and nodes in self.costs.fits:
            self.costs.observe(nodes, len(rids), context_tokens, seconds)
        self.stats.acceptance_by_depth = [round(q, 4) for q in self.acceptance.overall[: self.draft_depth]]

    def forget(self, rid: int) -> None:
        self.acceptance.forget(rid)
