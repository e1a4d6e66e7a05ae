"""Adaptive speculation: how many tree nodes a decode step verifies, chosen from measurements.

A step that verifies N nodes per request costs more than a plain step (N = 1, the root alone),
and gains the draft tokens it accepts. Both sides are measured online, never assumed:

* `StepCostModel`: step seconds, a decayed least-squares fit linear in the verify rows, the context
  they attend to, the draft's passes and the batch (what a verify row and a draft level cost at this
  load, measured from the steps the engine runs), each step charged for the trees the target really
  verified; a size is predicted to cost what the trees it recently verified cost (the draft's
  `min_path_prob` cuts unsure trees short). The draft's catch-up, timed on its own by the drafter,
  has a fit of its own in the tokens caught up.
* `AcceptanceModel`: per draft depth, the decayed rate at which the full tree's token there is
  accepted given the one before it was; per smaller size, what it keeps of that; per request, its
  level against both, learnt from its drafting steps of any size.
* `TreeSizePolicy`: each step, among a few size buckets (the verify width is one per step: the
  batch stays rectangular), the one with the most expected tokens per second,
  sum_b E_b[accepted + 1] / cost(step), a tree's cost including the catch-up its draft needs first
  (the tokens the batch's requests committed in plain steps since they were last drafted for, and
  the prompt chunks that joined a load decoding plain (`decodes_plain`): the tree that resumes
  drafting pays it once, spread over the steps the load has left, so a tree that only just beats
  plain decoding does not resume after a long stretch of plain steps, nor late in the load). The
  user's `verify_budget` and `disable_by_batch_size` cap
  it. The cost fit starts warm (`actors.cost_probe` times a few dummy steps at engine start), so
  measuring costs little: a rival size is measured only when what one more step of it is expected to
  teach (the knowledge gradient of its rate's uncertainty at this load, over the time the batch's
  requests have left) outweighs what that step loses against the best (its catch-up included), at
  most once every `explore_every` steps, and less often the longer the best at this load holds.

Plain classes; no timing is taken here (the scheduler reports each step's wall time).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# Context tokens are fitted in thousands, so the features have comparable scales.
_CONTEXT_UNIT = 1024.0
# What a tree smaller than the full one is assumed to keep of the full tree's acceptance before it is
# measured (its fewer nodes per depth catch fewer target tokens), and how many predicted draft tokens
# that assumption weighs against measured ones (a step of one request predicts ~2, so one unlucky step
# cannot rule a tree size out for good; a step of 64 outweighs it).
UNTRIED_SCALE = 0.75
PRIOR_TOKENS = 4.0
# How many predicted draft tokens a request's level keeps agreeing with the batch's: a few steps'. A
# step's accepted count is noisy (0-3 drafts where ~1 is expected); at one token, two unlucky small trees
# halved a request's level, which then ruled out the full tree for its batch, and the plain steps that
# followed taught it nothing more (simulated 1-2 requests: 0.83-0.92x the full tree's speed; a prior that
# fades with the request's decay did no better). Its own steps still move it within a few steps.
REQUEST_PRIOR_TOKENS = 4.0
# Relative uncertainty of a size's predicted step cost in a load regime where it was never measured;
# it shrinks as 1 / sqrt(1 + decayed steps measured there).
UNCERTAINTY = 0.25
# Relative uncertainty of what a tree size's drafts are accepted before any real request drafted with it
# (the start-up probe's dummies teach costs only); it shrinks as 1 / sqrt(1 + request-steps of that size).
ACCEPTANCE_UNCERTAINTY = 1.0
# Steps a load is assumed to last when the requests' remaining tokens are not given (`choose`): the
# longest wait between measuring steps (`MAX_BACKOFF` x the default `explore_every`).
DEFAULT_HORIZON = 256
# Each measuring step that leaves a load's best size as it was doubles the wait before the next one
# at that load, up to this many times `explore_every`; a new best there starts the wait over. A
# settled choice (plain decoding at 64 requests, say) then spends almost nothing on rivals.
MAX_BACKOFF = 16
# How much more a tree must promise than plain decoding to be chosen over it. Plain decoding is the
# safe side (no draft work, no catch-up when drafting resumes): a fit off by a few percent in a
# tree's favour would otherwise run trees that are slower than plain steps where the two are close.
PLAIN_MARGIN = 0.03
# How much more a smaller tree must promise than the largest allowed one (the full tree, or the user's cap)
# to be chosen over it. The largest tree's steps measure every smaller tree's share exactly (their nodes are
# its best ones), a smaller tree's steps only its own; where two sizes are predicted within a few percent the
# estimates' noise picks, and at 1-2 requests smaller trees predicted a little ahead ran 5-8% behind the full
# tree (docs/benchmarks.md, sessions 38-40). In the policy's simulation (tests/test_cost_model.py's
# `_serve_waves`, 10 seeds) adaptive over the fixed full tree went 0.94x -> 0.97x at 2 requests, 0.93x ->
# 0.96x at 4, the load-following cases unchanged; in `bench.concurrency`'s 1-2-request cells the change was
# within the runs' noise (session 40: short 2 and long 1 still 0.92-0.95x of the fixed tree).
FULL_MARGIN = 0.05
# Most tokens a request's draft leaves waiting behind plain steps and deferred prompt chunks
# (`actors.draft_runner`): at this many the drafter catches it up at once, which bounds the waiting
# inputs' memory (a target hidden row each: 1728 floats for SmolLM2's EAGLE-3 head, ~14 MB a request
# in fp32 at this bound). Long enough for a 1-2k-token prompt's draft prefill to wait whole: at 128 it
# ran at once, ~3% of a prefill-heavy load's time where no step drafted (docs/benchmarks.md).
MAX_DRAFT_LAG = 2048
# Per size and load regime, what its steps took over what the fit predicts for them now, decayed by this
# each time one is timed there, from `CALIBRATION_PRIOR_STEPS` steps of agreement: a size's predicted
# cost at that load is scaled by it (`TreeSizePolicy.step_cost`). The fit is linear in its features
# and one fit for all loads; where the truth is not (a catch-up of 1084 waiting tokens predicted at
# 618 ms took 885 ms on the AVX2 machine, docs/benchmarks.md session 26), the size's own recent steps
# correct it there. Against the fit's predictions when they ran, the steps of a size run rarely kept a
# ratio to a fit that had moved since (the other sizes' steps move it): at two short requests the full
# tree, measured at 74 ms, was predicted at 85-92 ms and ran in 13 steps of 650 (session 39).
CALIBRATION_DECAY = 0.8
CALIBRATION_PRIOR_STEPS = 2.0
# Most one step moves it, relative to the size's calibration there now: a pause (a collection, another
# process) makes one step take ~2x its prediction, and a size whose calibration such a step raised ~12%
# (bounded at 2x of the fit) stopped running there and kept the raised cost until a measuring step ran it
# again: on the AVX2 machine a slow plain step handed 32-64 requests to 2-node trees that ran 0.95-0.96x
# plain decoding (docs/benchmarks.md session 37). A real mismatch still moves it 1.25x a step. The fit's
# samples are bounded alike, around its prediction for a size it has seen (`StepCostModel.observe`): at one
# long request the full tree is measured rarely, and one 193 ms step where 94 were predicted raised its
# prediction to 145-180 ms for the next 130 steps, which ran plain or 2-node trees where the full tree took
# ~100 ms (session 39).
CALIBRATION_BOUND = 1.25
# Decay of a size's verified-tree shape (`TreeSizePolicy.verified_shape`): the draft's confidence, which
# cuts trees, changes with the requests, so a few steps' worth.
SHAPE_DECAY = 0.9


def knowledge_gradient(mean: float, spread: float) -> float:
    """E[max(X, 1)] - max(mean, 1) for X ~ N(mean, spread^2): what one more measurement of a rival is
    expected to add to the rate of the choice, relative to the bar the rival must clear, when its rate
    relative to that bar is believed `mean` and the measurement would move that belief by `spread`
    (standard deviation of the change). 0 where nothing can move."""
    if spread <= 0.0:
        return 0.0
    z = -abs(mean - 1.0) / spread
    return spread * (z * 0.5 * (1.0 + math.erf(z / math.sqrt(2.0))) + math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi))


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
    """y ~ w . x, w >= 0, by least squares over exponentially decayed samples (each new sample
    multiplies the older ones' weight by `decay`). Non-negative weights because every feature is a
    cost that only adds (more rows, context or levels never make a step cheaper): noisy samples then
    cannot tilt the line into predicting free steps where nothing was measured. A small ridge on
    every weight but the first (the intercept) keeps the answer defined while the samples span few
    directions: a slope the data cannot tell yet stays near 0, so a step predicts about what was
    measured rather than a wild extrapolation."""

    def __init__(self, num_features: int, decay: float, ridge: float = 1e-3):
        self.decay, self.ridge = decay, ridge
        # Plain floats and Python, not numpy: each step adds a sample and solves right after the forward,
        # whose data has just left the caches, and there a numpy call cost 10-100x what it costs warm
        # (np.outer ~100 us against ~2). The update's six numpy calls cost ~2 ms a step, ~0.1 in Python;
        # the solve ~0.33 ms, ~0.11 in Python (docs/benchmarks.md, sessions 23 and 24).
        self.xx = [[0.0] * num_features for _ in range(num_features)]  # (F, F) decayed sum of x x^T
        self.xy = [0.0] * num_features  # (F,) decayed sum of x y
        self._w: list[float] | None = None  # plain floats: `predict` is a short dot product in Python
        self._free: list[int] = []  # the features the last solve left free (the rest held at 0)

    def observe(self, x: list[float], y: float) -> None:
        d = self.decay
        self.xx = [[d * s + xi * xj for s, xj in zip(row, x)] for row, xi in zip(self.xx, x)]
        self.xy = [d * s + xi * y for s, xi in zip(self.xy, x)]
        self._w = None

    def weights(self) -> list[float]:
        """The non-negative least-squares weights (Lawson and Hanson's active-set method). It starts from
        the features the last solve left free: a step moves the fit little, so they are usually still the
        right ones, and one solve and a gradient check find the optimum (from none free, each feature
        costs a solve). A feature held at 0 whose weight would lower the error is freed; a free one whose
        weight would turn negative is moved back to 0 along the way to the new solve."""
        if self._w is None:
            n, xy = len(self.xy), self.xy
            # (F, F) xx + a ridge on every weight but the intercept's
            a = [[v + (self.ridge * (v + 1e-9) if k else 1e-12) if j == k else v for j, v in enumerate(row)]
                 for k, row in enumerate(self.xx)]
            tol = 1e-12 * max(max(map(abs, xy)), 1e-300)
            free, w = self._free, self._solve(a, xy, self._free)
            if min(w) < 0:
                free, w = [], [0.0] * n
            for _ in range(3 * n):  # converges in a few; the bound only guards round-off cycles
                gradient = [b - sum(map(operator.mul, row, w)) for b, row in zip(xy, a)]  # > 0: more weight helps
                held = [k for k, g in enumerate(gradient) if g > tol and k not in free]
                if not held:
                    break
                free = sorted(free + [max(held, key=gradient.__getitem__)])
                while True:
                    z = self._solve(a, xy, free)
                    if free == [] or min(z[k] for k in free) > 0:
                        w = z
                        break
                    # Move from w towards z until the first free weight reaches 0; hold it there.
                    step = min(w[k] / max(w[k] - z[k], 1e-300) for k in free if z[k] <= 0)
                    w = [wk + step * (zk - wk) for wk, zk in zip(w, z)]
                    free = [k for k in free if w[k] > tol]
            self._free = free
            self._w = [max(c, 0.0) for c in w]
        return self._w

    @staticmethod
    def _solve(a: list[list[float]], xy: list[float], free: list[int]) -> list[float]:
        """(F,) least squares over the `free` features, the rest held at 0: LU with partial pivoting
        (as LAPACK's gesv) of the free block, at most 10 x 10."""
        w = [0.0] * len(xy)
        m = len(free)
        rows = [[a[i][j] for j in free] + [xy[i]] for i in free]  # (m, m + 1): the block and its right side
        for c in range(m):
            p = max(range(c, m), key=lambda r: abs(rows[r][c]))
            rows[c], rows[p] = rows[p], rows[c]
            pivot = rows[c]
            for r in range(c + 1, m):
                f = rows[r][c] / pivot[c]
                if f:
                    rows[r][c:] = [x - f * y for x, y in zip(rows[r][c:], pivot[c:])]
        for c in range(m - 1, -1, -1):
            row = rows[c]
            w[free[c]] = (row[m] - sum(row[j] * w[free[j]] for j in range(c + 1, m))) / row[c]
        return w

    def predict(self, x: list[float]) -> float:
        return sum(map(operator.mul, x, self.weights()))


class StepCostModel:
    """Seconds of a decode step of B requests attending to C context tokens (summed over requests) that
    verifies n nodes per request in trees L draft levels deep (the trees the target really verified:
    the draft's `min_path_prob` cuts unsure ones short; a prompt-lookup branch deeper than the draft's
    levels adds none, `TreeSizePolicy.drafted_levels`), one decayed linear fit over every step taken:

        cost = a + b B + c B n + d n C + D (e + f B) + g V B + h L C + j C  (+ catch-up(U))

    (fixed per step; per request; per verify row; attention of the rows over the context; D = 1 when
    the step drafts at all: the draft's extend over the accepted tokens and its top-k head, per step
    and per drafted request; V = max(L - 1, 0) beam levels past the first, whose candidates come from
    the extend's head, each over every request's beams; attention of the draft's passes over the
    context, which makes long-context trees dearer on the draft's side too; reading every request's
    cached K/V once, whatever its rows: without this term a long-context load
    decoding plain charged its KV reads to the rows, and 8-node trees over 1-2k-token prompts were
    predicted at 52-65 ms where they took 38-45, docs/benchmarks.md "Session 18").
    A one-level tree runs no beam level: a single levels term charged it a share of the full tree's
    levels and mispredicted it. One fit for all tree sizes, so a plain step measured at this load also
    tells what a tree's fixed and per-request parts cost, and the other way round.

    U = catch-up tokens, those plain steps and deferred prompt chunks left waiting (`actors.draft_runner`)
    that a step's draft must first extend over, in one prefill-shaped forward the drafter times
    (`DraftExtendInput.catch_up_s`): catch-up(U) = k + m U, its own decayed fit over every catch-up,
    and a step's seconds less its catch-up's teach the fit above. Inferred from whole steps, as one
    more feature of that fit, its weight rested on the first tree after each run of plain steps (the
    only steps where U is not 0): one or two of them set it, at 0.26-9 ms a token in bf16 where the
    forward takes ~0.04 (a 512-token prompt chunk's draft extend, ~19 ms on the AMX CPU), and kept
    trees from resuming (docs/benchmarks.md, sessions 28-29). Before any catch-up is timed it is
    predicted free: the tree that resumes first times one."""

    NUM_FEATURES = 9

    def __init__(self, decay: float = 0.97, catch_up_decay: float = 0.9):
        self.fit = DecayedLinearFit(self.NUM_FEATURES, decay)
        self.catch_up = DecayedLinearFit(2, catch_up_decay)  # seconds ~ k + m U over timed catch-ups
        self.counts: dict[int, float] = {}  # decayed steps seen per tree size

    @staticmethod
    def features(nodes: float, depth: float, batch: int, context_tokens: int, drafts: bool | None) -> list[float]:
        context = context_tokens / _CONTEXT_UNIT
        d = float(depth > 0 if drafts is None else drafts)
        return [1.0, float(batch), batch * nodes, nodes * context, d, d * batch,
                max(depth - 1.0, 0.0) * batch, depth * context, context]

    def observe(self, nodes: float, depth: float, batch: int, context_tokens: int, seconds: float,
                catch_up_s: float = 0.0, *, drafts: bool | None = None, size: int | None = None,
                bounded: bool = True) -> None:
        """A step verified `nodes` per request in a tree `depth` deep in `seconds`, `catch_up_s` of them
        the draft's catch-up (`observe_catch_up` learns that part); `drafts`: whether the draft ran
        (default: depth > 0; a tree the draft's confidence cut to its root still paid the draft's
        extend); `size`: the tree size chosen for it, whose steps `samples` counts (default `nodes`).
        `bounded`: once that size has been seen, the sample is held within `CALIBRATION_BOUND` of the fit's
        prediction (a pause, a collection or another process, is not what the step costs); the start-up
        probe's are not, whose shapes are chosen to teach what the fit cannot predict yet."""
        x = self.features(nodes, depth, batch, context_tokens, drafts)
        took = max(seconds - catch_up_s, 0.0)
        key = int(nodes) if size is None else size
        if bounded and self.counts.get(key, 0.0) > 0.0:
            predicted = self.predict_features(x)
            took = min(max(took, predicted / CALIBRATION_BOUND), predicted * CALIBRATION_BOUND)
        self.fit.observe(x, took)
        for n in self.counts:
            self.counts[n] *= self.fit.decay
        self.counts[key] = self.counts.get(key, 0.0) + 1.0

    def samples(self, size: int) -> float:
        return self.counts.get(size, 0.0)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The drafter caught up `tokens` waiting tokens in `seconds` (in any step: a prompt chunk that hit a
        cached prefix whose draft KV waited, or a request at `MAX_DRAFT_LAG`, teaches it too)."""
        self.catch_up.observe([1.0, float(tokens)], seconds)

    def predict(self, nodes: float, depth: float, batch: int, context_tokens: int, drafts: bool | None = None) -> float:
        """Expected step seconds, catch-up aside (never below a microsecond: an extrapolated line can dip
        under 0)."""
        return self.predict_features(self.features(nodes, depth, batch, context_tokens, drafts))

    def predict_features(self, x: list[float]) -> float:
        """`predict` from a step's `features`."""
        return max(1e-6, self.fit.predict(x))

    def predict_catch_up(self, tokens: int) -> float:
        """Expected seconds of catching up `tokens` waiting tokens (0 for none)."""
        return self.catch_up.predict([1.0, float(tokens)]) if tokens > 0 else 0.0


class AcceptanceModel:
    """What drafts are accepted, as three factors each step of any size teaches:

    * q_d, the decayed rate at which the full tree's depth-d draft token is accepted once depth d - 1
      was, over all requests (learnt from full-tree steps);
    * per smaller tree size n, g_n: what it accepts relative to the full tree for the same request
      (fewer candidates per depth catch fewer target tokens), decayed over all requests, starting
      from `untried_scale`, learnt from every full-tree step: the full tree's nodes are ranked best
      first and the n-node tree is its first n, so the accepted nodes below n are exactly what that
      tree would have accepted (`DraftExtendInput.accepted_nodes`). Its own steps (against m_r's
      prediction of the full tree) teach it only until full trees have measured it: they tell
      m_r g_n, not either alone, and g_n and m_r taught each other. From its own steps alone, at two
      requests g_5 drifted to 1 while the 5-node tree accepted 10% less than the full one, and 5-node
      trees ran ~40% of the steps, 3-5% slower than the full tree (docs/benchmarks.md, session 20);
      taught by both, at one request a good stretch of 4-5-node trees lifted their g_n to 1 within a
      few steps, and they ran in about half the steps where the full tree paid (session 39);
    * per request, m_r: its accepted draft tokens over what the other two factors predicted, decayed,
      from its drafting steps of any size, starting from agreement; a step that drafts nothing for it
      decays that evidence too (`fade`), so a level lowered by a few unlucky steps drifts back to
      agreement while plain steps, which teach nothing of it, run.

    Expected accepted tokens of request r at size n reaching depth D: m_r g_n sum_{d<=D} prod_{j<=d} q_j.
    A request's level is learnt from whatever size it runs: with the per-request rates taught by
    full-tree steps alone, a batch of one after a low-acceptance request ran 2-5-node trees for every
    later prompt, whose full trees would have paid (their acceptance never reached the full tree's
    prediction)."""

    def __init__(self, full_size: int, max_depth: int, decay: float = 0.95, request_decay: float = 0.8,
                 size_decay: float = 0.9, prior: float = 0.5, untried_scale: float = UNTRIED_SCALE,
                 prior_tokens: float = PRIOR_TOKENS, request_prior_tokens: float = REQUEST_PRIOR_TOKENS,
                 sizes: list[int] | None = None, draft_levels: int | None = None):
        self.full_size = full_size
        # Depths past the draft's own levels (`draft_levels`) only a prompt-lookup branch reaches, and only
        # where the text repeats: their rates start from 0, not `prior`, and rise as full trees accept there.
        # From `prior`, a load that rarely runs the full tree (16 long requests) kept them at 0.5 and chose
        # full trees that were slower than plain decoding.
        levels = max_depth if draft_levels is None else min(draft_levels, max_depth)
        self.priors = [prior] * levels + [0.0] * (max_depth - levels)
        # the smaller trees whose g_n the full tree's steps measure (default: every size that drafts)
        self.smaller = [n for n in (sizes or range(2, full_size)) if 1 < n < full_size]
        self.decay, self.request_decay, self.size_decay = decay, request_decay, size_decay
        self.untried_scale, self.prior_tokens = untried_scale, prior_tokens
        self.request_prior_tokens = request_prior_tokens
        # q_d of the full tree: decayed (accepted, reached) counts at each depth over its steps' requests,
        # and the rates they give (kept: every prediction of every step reads them)
        self.depth_sums = [(0.0, 0.0)] * max_depth
        # the same counts over smaller trees' steps: a floor under the prior (see `_rates`)
        self.small_sums = [(0.0, 0.0)] * max_depth
        self._set_rates()
        # n -> decayed (accepted, reached): full-tree steps' accepted nodes below n against all they accepted
        # within its depth (what the n-node tree would have accepted: exact), and n -> decayed (accepted,
        # predicted for the full tree): its own steps' accepted drafts against m_r q's prediction (see
        # `size_factor` for which of the two g_n reads)
        self.size_sums: dict[int, tuple[float, float]] = {}
        self.own_sums: dict[int, tuple[float, float]] = {}
        self.request_sums: dict[int, tuple[float, float]] = {}  # rid -> decayed (accepted, predicted by g_n q)

    def _rates(self) -> list[float]:
        """q_d: at each depth, accepted over reached, from `PRIOR_TOKENS` reaches at a prior. A running
        rate that moved 5% a step kept ~60% of its prior after ten full trees, so a draft better than the
        prior looked worse at the full tree than at the small trees that ran meanwhile. The prior is at
        least what smaller trees accepted at that depth (their nodes are the full tree's best, so the
        full tree accepts at least as often): at one request, the full tree that ran once in ~30 steps
        kept the fixed prior's 0.5 at every depth against ~0.75 real, and 3-node trees ran for the first
        ~150 steps while the full tree was ~10% faster."""
        rates = []
        for base, (seen, reached), (small_seen, small_reached) in zip(self.priors, self.depth_sums, self.small_sums):
            prior = max(base, (small_seen + base * self.prior_tokens) / (small_reached + self.prior_tokens))
            rates.append((seen + prior * self.prior_tokens) / (reached + self.prior_tokens))
        return rates

    def _set_rates(self) -> None:
        """q_d, and their running products summed (`full_tree` of every depth): every prediction of every
        step reads them, and they change only when a step is observed."""
        self.rates = self._rates()
        self._full = [0.0]
        reach = 1.0
        for q in self.rates:
            reach *= q
            self._full.append(self._full[-1] + reach)

    @staticmethod
    def _counted(sums: list[tuple[float, float]], decay: float, drafted_depth: int,
                 accepted: list[int]) -> list[tuple[float, float]]:
        """`sums` after a step of trees `drafted_depth` deep: at each depth it reached, whether the
        token there was accepted given the one before it was (depths past a first rejection say nothing)."""
        return [(decay * seen + sum(a > d for a in accepted), decay * reached + sum(a >= d for a in accepted))
                if d < drafted_depth else (seen, reached) for d, (seen, reached) in enumerate(sums)]

    def full_tree(self, depth: int) -> float:
        """sum_{d<=depth} prod_{j<=d} q_j: the full tree's expected accepted tokens for a typical request."""
        return self._full[min(depth, len(self.rates))]

    def size_factor(self, nodes: int) -> float:
        """g_n (1 for the full tree), at most 1: a smaller tree's nodes are the full tree's best ones
        (`actors.draft_runner.select_tree`), so it never accepts more than the full tree would. From
        `prior_tokens` of the full tree's accepted tokens at `untried_scale`."""
        if nodes == self.full_size:
            return 1.0
        seen, predicted = self.size_sums.get(nodes, (0.0, 0.0))
        if predicted < self.prior_tokens:  # few full trees yet: its own steps' evidence too
            own_seen, own_predicted = self.own_sums.get(nodes, (0.0, 0.0))
            seen, predicted = seen + own_seen, predicted + own_predicted
        return min(1.0, (seen + self.untried_scale * self.prior_tokens) / (predicted + self.prior_tokens))

    def multiplier(self, rid: int | None) -> float:
        """m_r; 1 (agreement) for a request not seen yet (None)."""
        seen, predicted = self.request_sums.get(rid, (0.0, 0.0))
        return (seen + self.request_prior_tokens) / (predicted + self.request_prior_tokens)

    def expected(self, rid: int | None, nodes: int, depth: int) -> float:
        """Expected accepted draft tokens of request `rid` verifying a tree of `nodes` reaching `depth`."""
        return self.expected_sum([self.multiplier(rid)], nodes, depth)

    def expected_sum(self, multipliers: list[float], nodes: int, depth: int) -> float:
        """Expected accepted draft tokens, summed over requests whose levels are `multipliers` (m_r, see
        `multiplier`), each verifying a tree of `nodes` reaching `depth` (each at most `depth`)."""
        scale, cap = self.size_factor(nodes) * self.full_tree(depth), float(depth)
        return sum(min(cap, m * scale) for m in multipliers)

    def observe(self, rids: list[int], nodes: int, drafted_depth: int, accepted: list[int],
                accepted_nodes: list[list[int]] | None = None) -> list[int]:
        """One verify step of a tree of `nodes` reaching `drafted_depth` for each of `rids`, which accepted
        `accepted[b]` draft tokens, at ranked tree nodes `accepted_nodes[b]` (-1 pads; None: not known).
        The full tree's depths past a first rejection say nothing. Returns the tree sizes whose
        acceptance the step measured: its own, and every smaller one where a full tree's nodes are known."""
        if drafted_depth <= 0:
            return []
        taught = [nodes]
        base, factor = self.full_tree(drafted_depth), self.size_factor(nodes)
        if nodes != self.full_size:
            seen, predicted = self.own_sums.get(nodes, (0.0, 0.0))
            levels = sum(self.multiplier(rid) for rid in rids) * base
            self.own_sums[nodes] = (self.size_decay * seen + sum(accepted), self.size_decay * predicted + levels)
        elif accepted_nodes is not None:
            taught += self.smaller
            paths = [[node for node in path if node > 0] for path in accepted_nodes]
            for n in self.smaller:
                # Against what the full tree accepted within the n-node tree's depth: g_n scales the full
                # tree's rate summed to that depth (`expected`); against all it accepted, a 2-node tree
                # (one level) was rated at a third of what it keeps where the full tree accepts 3.
                reach = min(n - 1, len(self.depth_sums))
                seen, whole = self.size_sums.get(n, (0.0, 0.0))
                self.size_sums[n] = (self.size_decay * seen + sum(node < n for path in paths for node in path),
                                     self.size_decay * whole + sum(min(len(path), reach) for path in paths))
        for rid, a in zip(rids, accepted):
            seen, predicted = self.request_sums.get(rid, (0.0, 0.0))
            self.request_sums[rid] = (self.request_decay * seen + a, self.request_decay * predicted + factor * base)
        if nodes == self.full_size:
            self.depth_sums = self._counted(self.depth_sums, self.decay, drafted_depth, accepted)
        else:
            self.small_sums = self._counted(self.small_sums, self.decay, drafted_depth, accepted)
        self._set_rates()
        return taught

    def fade(self, rids: list[int]) -> None:
        """A step that drafted nothing for `rids` decays what their levels were learnt from, as a drafting
        step would: their text moves on either way. Without it, a request at batch 1 whose drafts went
        unaccepted for a few steps decoded plain for dozens of steps, through stretches its full
        tree would have paid for (tests/test_cost_model.py, docs/benchmarks.md session 38)."""
        for rid in rids:
            if rid in self.request_sums:
                seen, predicted = self.request_sums[rid]
                self.request_sums[rid] = (self.request_decay * seen, self.request_decay * predicted)

    def forget(self, rid: int) -> None:
        self.request_sums.pop(rid, None)


@dataclass
class AdaptiveStats:
    """What /metrics shows of the policy: the steps at each chosen tree size, and the acceptance rate
    at each draft depth over all requests (decayed)."""

    steps_by_size: dict[int, int] = field(default_factory=dict)
    last_size: int = 0
    acceptance_by_depth: list[float] = field(default_factory=list)


class TreeSizePolicy:
    """Chooses each decode step's verify width (nodes per request, root included; 1 = plain decoding).

    adaptive=False keeps the fixed behaviour: the full tree within the user's caps. `forced` (the
    start-up probe's) makes every step verify that many nodes, whatever the caps."""

    def __init__(self, tree_size: int, draft_depth: int, adaptive: bool = True,
                 verify_budget: int | None = None, disable_by_batch_size: int | None = None,
                 explore_every: int = 16, draft_levels: int | None = None):
        self.tree_size, self.draft_depth, self.adaptive = tree_size, draft_depth, adaptive
        self.draft_levels = draft_levels  # the draft's own levels, where shallower than draft_depth (a branch)
        self.verify_budget, self.disable_by_batch_size = verify_budget, disable_by_batch_size
        self.buckets = size_buckets(tree_size)
        self.costs = StepCostModel()
        self.explore_every = explore_every
        self.forced: int | None = None
        self.measured: dict[tuple[int, int, int], float] = {}  # (nodes, *regime) -> decayed steps timed
        # Per request: tokens committed by plain steps since its draft last extended (its catch-up).
        self.lag: dict[int, int] = {}
        self._reset_learning()

    def _reset_learning(self) -> None:
        """Forget acceptance and choices (what the probe's dummy requests taught); costs stay."""
        self.acceptance = AcceptanceModel(self.tree_size, max(self.draft_depth, 1), sizes=self.buckets,
                                          draft_levels=self.draft_levels)
        self.step = 0
        self.evidence: dict[int, int] = {}  # request-steps drafted per tree size (its acceptance's evidence)
        self.explored = 0  # step a rival was last measured at
        # Per chosen size and batch regime: decayed sums of the verified trees' (nodes, draft levels) and their
        # weight. The draft's `min_path_prob` cuts an unsure tree short, so a size costs what the trees it
        # really runs cost (`verified_shape`).
        self.shapes: dict[tuple[int, int], tuple[float, float, float]] = {}
        # Per load regime, the best size when last chosen; per batch regime, the steps to wait before
        # measuring a rival. A request's context crosses regimes as it decodes, so a wait per context regime
        # measured the rivals again in each one: at one request in bf16 on an AVX2 CPU, where no tree pays,
        # 16 measuring steps in ~500 (10 with the wait per batch regime).
        self.best_at: dict[tuple[int, int], int] = {}
        self.wait: dict[int, int] = {}
        # (nodes, *regime) -> decayed (seconds taken, the fit's features, steps) summed over its timed decode
        # steps (`CALIBRATION_DECAY`): the fit is linear, so it predicts their sum from the features' sum
        self.calibration: dict[tuple[int, int, int], tuple[float, list[float], float]] = {}
        self.stats = AdaptiveStats()

    def end_probe(self) -> None:
        self.forced = None
        self.lag.clear()
        self._reset_learning()

    def catch_up_tokens(self, rids: list[int], nodes: int) -> int:
        """Tokens the draft must extend over before a step of `nodes` can draft for `rids` (0 for a
        plain step: nothing is drafted, the tokens keep waiting)."""
        return sum(self.lag.get(rid, 0) for rid in rids) if self.depth(nodes) else 0

    def caught_up(self, rid: int) -> None:
        """Request `rid`'s draft extended over all its tokens (a prompt chunk, or a re-prefill)."""
        self.lag.pop(rid, None)

    def deferred(self, rid: int, tokens: int) -> None:
        """Request `rid`'s draft left a prompt chunk of `tokens` waiting (`decodes_plain`); at
        `MAX_DRAFT_LAG` waiting tokens the drafter caught it up instead."""
        lag = self.lag.get(rid, 0) + tokens
        if lag < MAX_DRAFT_LAG:
            self.lag[rid] = lag
        else:
            self.lag.pop(rid, None)

    def decodes_plain(self, batch: int, context_tokens: int) -> bool:
        """Whether a load of `batch` requests attending to `context_tokens` decodes plain: the user's caps,
        or the predicted rates of requests not seen yet. A prompt joining such a load leaves its draft's
        extend waiting (the draft's prefill would cost ~5% of the target's and no tree may use it; the
        tree that resumes drafting pays its catch-up instead), and a short one rides in the load's decode
        step rather than a step of its own (`Scheduler`)."""
        if self.forced is not None:
            return False
        candidates = self._candidates(batch)
        if candidates == [1]:
            return True
        if not self.adaptive or not self._measured(candidates):
            return False
        return self._best_step([None] * batch, context_tokens, candidates)[0] == 1

    def prefill_ahead_pays(self, rids: list[int], context_tokens: int, prompts: int) -> bool:
        """Whether `prompts` short prompts should prefill in a step of their own before the decode of
        the running requests `rids` (attending to `context_tokens`), rather than ride in it: what it
        spares them (each one's first token comes a decode step sooner) outweighs what it costs the
        running requests (each one's next token a step's fixed cost later: the weights read once more;
        the prompts' own rows cost the same either way). At one or two running requests a step of their
        own pays; at 64 it cost adaptive speculation 9% of its tokens a second, where a prompt arrived
        almost every step (docs/benchmarks.md, session 19). With fixed trees (not adaptive) it always
        goes ahead, as it did before."""
        if not rids or not self.adaptive or self.forced is not None:
            return True
        candidates = self._candidates(len(rids))
        if not self._measured(candidates):
            return True
        decode = self._best_step(rids, context_tokens, candidates)[1]
        fixed = self.costs.predict(0.0, 0.0, 0, 0, drafts=False)
        return len(rids) * fixed <= prompts * decode

    def _candidates(self, batch: int) -> list[int]:
        """The size buckets the user's caps allow a step of `batch` requests ([1]: plain only)."""
        cap = capped_size(self.tree_size, batch, self.verify_budget, self.disable_by_batch_size)
        return [n for n in self.buckets if n <= cap]

    def _measured(self, candidates: list[int]) -> bool:
        """Whether the plain step and the largest allowed tree have been timed (the probe or real steps)."""
        return all(self.costs.samples(n) > 0 for n in (candidates[0], candidates[-1]))

    def _best_step(self, rids: list[int | None], context_tokens: int, candidates: list[int]) -> tuple[int, float]:
        """Among `candidates`, the size with the most expected tokens per second for `rids` (None: a
        request not seen yet) attending to `context_tokens`, and its predicted step seconds."""
        cost = {n: self.step_cost(n, len(rids), context_tokens) for n in candidates}
        tokens = self.expected_tokens(rids, candidates)
        best = self._best({n: tokens[n] / cost[n] for n in candidates})
        return best, cost[best]

    @staticmethod
    def _favour(n: int, other: int, largest: int) -> float:
        """How much `n`'s rate is favoured when it is weighed against `other`'s: plain decoding by
        `PLAIN_MARGIN` against any tree, the `largest` tree allowed by `FULL_MARGIN` against a smaller one."""
        if n == 1:
            return 1.0 + PLAIN_MARGIN
        return 1.0 + FULL_MARGIN if n == largest and other not in (1, largest) else 1.0

    @classmethod
    def _best(cls, rate: dict[int, float]) -> int:
        """The size with the most tokens per second: the best tree (the largest favoured against smaller
        ones), unless plain decoding, favoured against it, does as well."""
        trees = [n for n in rate if n > 1]
        if not trees:
            return 1
        largest = max(trees)
        best = max(trees, key=lambda n: rate[n] * cls._favour(n, 0, largest))  # 0: weighed against a smaller tree
        return 1 if 1 in rate and rate[1] * cls._favour(1, best, largest) >= rate[best] else best

    def depth(self, nodes: int) -> int:
        """Draft levels a tree of `nodes` can reach (a chain of n nodes has n - 1)."""
        return min(self.draft_depth, nodes - 1)

    def drafted_levels(self, depth: int) -> int:
        """Draft levels behind a verified tree `depth` deep: past the draft's own levels (`draft_levels`) a
        tree reaches only along a prompt-lookup branch, which costs the draft no forward. Charged its
        branch's depth (up to 5 where the draft runs 3 levels), the full tree of `make serve` was predicted
        at 71 ms at two long requests in bf16 where it took ~55, and 4-node trees ran in 70% of the steps
        at 0.95x the full tree's speed (docs/benchmarks.md, session 36)."""
        return depth if not self.draft_levels else min(depth, self.draft_levels)

    def verified_shape(self, nodes: int, batch: int) -> tuple[float, float]:
        """(nodes, draft levels) a step of `batch` requests choosing `nodes` is expected to verify and draft:
        the decayed mean of its steps' trees at batch sizes within a factor of two (else at the next smaller
        ones: about as wide), or the uncut tree before any ran there. Per batch size because a step verifies
        its widest request's tree (the batch is rectangular): one request's 8-node tree was cut to ~4 nodes,
        a batch of 32 nearly always holds a request whose tree is whole, and 8-node steps at 32 requests,
        predicted from the shape learnt at one request, took ~1000 ms where 823 were predicted
        (docs/benchmarks.md, session 43)."""
        regime = self._regime(batch, 0)[0]
        for key in ((nodes, regime), (nodes, regime - 1)):
            if key in self.shapes:
                width, levels, weight = self.shapes[key]
                return width / weight, levels / weight
        return float(nodes), float(self.drafted_levels(self.depth(nodes)))

    def step_cost(self, nodes: int, batch: int, context_tokens: int, catch_up: int = 0) -> float:
        """Predicted seconds of a step choosing `nodes` per request (`verified_shape`) whose draft first
        catches up `catch_up` tokens: the fit's, scaled by what this size's steps at this load took over
        it (`CALIBRATION_DECAY`), and the catch-up's own."""
        scale = self._calibration((nodes, *self._regime(batch, context_tokens)))
        return scale * self._fit_cost(nodes, batch, context_tokens) + self.costs.predict_catch_up(catch_up)

    def _calibration(self, key: tuple[int, int, int]) -> float:
        """What a size's steps at a load took over what the fit predicts for them now (`CALIBRATION_DECAY`)."""
        if key not in self.calibration:
            return 1.0
        took, features, steps = self.calibration[key]
        fitted = self.costs.predict_features(features)  # the decayed sum of their predictions
        prior = CALIBRATION_PRIOR_STEPS * fitted / steps
        return (took + prior) / (fitted + prior)

    def _fit_features(self, nodes: int, batch: int, context_tokens: int) -> list[float]:
        width, depth = self.verified_shape(nodes, batch)
        return self.costs.features(width, depth, batch, context_tokens, drafts=self.depth(nodes) > 0)

    def _fit_cost(self, nodes: int, batch: int, context_tokens: int) -> float:
        return self.costs.predict_features(self._fit_features(nodes, batch, context_tokens))

    @staticmethod
    def _regime(batch: int, context_tokens: int) -> tuple[int, int]:
        """Batch sizes and mean contexts within a factor of two behave alike."""
        return int(math.log2(max(batch, 1))), int(math.log2(max(context_tokens // max(batch, 1), 1) / 64 + 1))

    def uncertainty(self, nodes: int, batch: int, context_tokens: int, tokens: float, more: int = 0) -> float:
        """Relative uncertainty of `nodes`' predicted rate at this load (expecting `tokens` a step), after
        `more` further steps of it: its cost here (shrinking with the steps measured at this load) and
        its acceptance (shrinking with the request-steps drafted at this size; none for a plain step)."""
        measured = self.measured.get((nodes, *self._regime(batch, context_tokens)), 0.0) + more
        cost = UNCERTAINTY / math.sqrt(1.0 + measured)
        gained = max(tokens - batch, 0.0) / max(tokens, 1e-9)  # the drafts' share of its tokens
        acceptance = ACCEPTANCE_UNCERTAINTY * gained / math.sqrt(1.0 + self.evidence.get(nodes, 0) + more * batch)
        return math.hypot(cost, acceptance)

    def expected_tokens(self, rids: list[int | None], sizes: list[int]) -> dict[int, float]:
        """Per size n of `sizes`: sum over requests of E[accepted + 1] with n nodes per request (None: a
        request not seen yet). Each request's level is read once for all sizes: at 64 requests, reading
        it per size and request was ~1 ms of Python a step."""
        levels = [self.acceptance.multiplier(rid) for rid in rids]
        return {n: len(rids) + (self.acceptance.expected_sum(levels, n, self.depth(n)) if self.depth(n) else 0.0)
                for n in sizes}

    def choose(self, rids: list[int], context_tokens: int, tokens_left: float | None = None) -> int:
        """This step's nodes per request for a batch of requests `rids` attending to `context_tokens`;
        `tokens_left`: the mean tokens its requests may still decode (how long this load may last, what
        a measuring step can pay off over; None: `DEFAULT_HORIZON` steps)."""
        if self.forced is not None:
            return self._chosen(min(self.forced, self.tree_size))
        batch = len(rids)
        cap = capped_size(self.tree_size, batch, self.verify_budget, self.disable_by_batch_size)
        if not self.adaptive or cap == 1:
            return self._chosen(cap)
        if not rids:  # a plan of no requests (all preempted, an idle rank): nothing to choose or learn
            return 1
        self.step += 1
        candidates = [n for n in self.buckets if n <= cap]
        for n in (candidates[-1], candidates[0]):
            if self.costs.samples(n) == 0:  # no probe ran: measure the largest tree and the plain step first
                return self._chosen(n)
        tokens = self.expected_tokens(rids, candidates)
        cost = {n: self.step_cost(n, batch, context_tokens, self.catch_up_tokens(rids, n)) for n in candidates}
        # A tree's catch-up is paid once and buys drafting for the steps the load has left: its rate is
        # charged the catch-up spread over those steps (at most `DEFAULT_HORIZON`). Charged to this one
        # step's rate, it grew with every plain step (a token a request), so a fit that had put a few
        # ms on a catch-up token, from one or two such steps, kept the load plain until its requests
        # ended, and the plain steps, which catch nothing up, never corrected it (2 long requests in bf16:
        # 173 of 227 steps plain at 1.14x plain decoding, where the full trees ran 1.64x; session 28).
        rate = {}
        for n in candidates:
            steady = self.step_cost(n, batch, context_tokens)
            steps = self._steps_left(tokens_left, batch, tokens[n])
            rate[n] = tokens[n] / (steady + (cost[n] - steady) / min(max(steps, 1.0), DEFAULT_HORIZON))
        best = self._best(rate)
        # Rivals: the best's neighbours, the full tree and the plain step (the payoff over sizes can be
        # flat in between), at most one measured every `explore_every` steps, then every 2, 4, ... times
        # that while the best at this load stays the same (`MAX_BACKOFF`).
        i = candidates.index(best)
        rivals = {candidates[j] for j in (0, i - 1, i + 1, len(candidates) - 1) if 0 <= j < len(candidates)} - {best}
        regime = self._regime(batch, context_tokens)
        load = regime[0]
        if self.best_at.get(regime) != best:
            self.best_at[regime], self.wait[load] = best, self.explore_every
        wait = self.wait.get(load, self.explore_every)
        if rivals and self.step - self.explored >= wait:
            steps_left = self._steps_left(tokens_left, batch, tokens[best])
            value = {r: self._measuring_value(r, best, rids, context_tokens, tokens, cost, rate, steps_left)
                     for r in rivals}
            rival = max(value, key=value.get)
            if value[rival] > 0.0:
                self.explored = self.step
                self.wait[load] = min(2 * wait, MAX_BACKOFF * self.explore_every)
                return self._chosen(rival)
        return self._chosen(best)

    @staticmethod
    def _steps_left(tokens_left: float | None, batch: int, tokens: float) -> float:
        """Steps a load of `batch` requests with `tokens_left` each to decode lasts at `tokens` a step
        (None: `DEFAULT_HORIZON`)."""
        return DEFAULT_HORIZON if tokens_left is None else tokens_left * batch / tokens

    def _measuring_value(self, rival: int, best: int, rids: list[int], context_tokens: int, tokens: dict,
                         cost: dict, rate: dict, steps_left: float) -> float:
        """Seconds one measuring step of `rival` is expected to save: what it may teach (the knowledge
        gradient of its rate, over the time the best would take for the `steps_left` steps left at this
        load) less what it loses now (its seconds, the catch-up its draft needs first included, beyond
        what the best takes for as many tokens). A tree that resumes drafting after a long run of plain
        steps thus pays for its catch-up, and one measured late in the load has little left to win."""
        batch = len(rids)
        # Its rate once running (no catch-up), against the bar it must clear to be chosen.
        steady = tokens[rival] / self.step_cost(rival, batch, context_tokens)
        largest = max(rate)
        bar = rate[best] * self._favour(best, rival, largest) / self._favour(rival, best, largest)
        mean = steady / bar
        now = self.uncertainty(rival, batch, context_tokens, tokens[rival])
        after = self.uncertainty(rival, batch, context_tokens, tokens[rival], more=1)
        gain = knowledge_gradient(mean, mean * math.sqrt(max(now * now - after * after, 0.0)))
        saved = steps_left * cost[best] * gain / (1.0 + gain)
        lost = cost[rival] - tokens[rival] / rate[best]
        return saved - lost

    def _chosen(self, nodes: int) -> int:
        self.stats.steps_by_size[nodes] = self.stats.steps_by_size.get(nodes, 0) + 1
        self.stats.last_size = nodes
        return nodes

    def observe(self, rids: list[int], context_tokens: int, nodes: int, seconds: float | None,
                accepted: list[int], verified: tuple[int, int] | None = None,
                accepted_nodes: list[list[int]] | None = None, catch_up_s: float = 0.0) -> None:
        """A decode step chose `nodes` per request and ran in `seconds` (None: not timed alone), `catch_up_s`
        of them its draft's catch-up (`observe_catch_up` learns that part); each request accepted
        `accepted[b]` draft tokens, at ranked tree nodes `accepted_nodes[b]` (-1 pads; None: not known);
        `verified`: the (nodes, depth) of the widest tree the target verified (default: the uncut tree of
        `nodes`)."""
        depth = self.depth(nodes)
        width, verified_depth = verified if verified is not None else (nodes, depth)
        levels = self.drafted_levels(verified_depth)
        if depth:
            for n in self.acceptance.observe(rids, nodes, depth, accepted, accepted_nodes):
                self.evidence[n] = self.evidence.get(n, 0) + len(rids)
        else:
            self.acceptance.fade(rids)
        catch_up = self.catch_up_tokens(rids, nodes)
        for rid in rids:  # a plain step's token waits; a drafting step extended over every waiting one
            lag = self.lag.get(rid, 0) + 1 if depth == 0 else 0
            if 0 < lag < MAX_DRAFT_LAG:
                self.lag[rid] = lag
            else:
                self.lag.pop(rid, None)
        if self.adaptive and seconds is not None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("step of %d x %d nodes (catch-up %d): predicted %.1f ms, took %.1f ms", len(rids), nodes,
                          catch_up, 1e3 * self.step_cost(nodes, len(rids), context_tokens, catch_up), 1e3 * seconds)
            key = (nodes, *self._regime(len(rids), context_tokens))
            if self.costs.samples(nodes) > 0:  # a fit that never saw this size predicts nothing to calibrate
                x = self._fit_features(nodes, len(rids), context_tokens)
                predicted = self._calibration(key) * self.costs.predict_features(x)
                took = min(max(seconds - catch_up_s, predicted / CALIBRATION_BOUND), predicted * CALIBRATION_BOUND)
                sums, features, steps = self.calibration.get(key, (0.0, [0.0] * len(x), 0.0))
                self.calibration[key] = (CALIBRATION_DECAY * sums + took,
                                         [CALIBRATION_DECAY * f + xi for f, xi in zip(features, x)],
                                         CALIBRATION_DECAY * steps + 1.0)
            self.costs.observe(width, levels, len(rids), context_tokens, seconds, catch_up_s,
                               drafts=depth > 0, size=nodes, bounded=self.forced is None)
            for k in self.measured:
                self.measured[k] *= self.costs.fit.decay
            self.measured[key] = self.measured.get(key, 0.0) + 1.0
        if depth:  # after the debug line above, which logs the prediction this step was chosen on
            shape = (nodes, self._regime(len(rids), 0)[0])
            w, d, weight = self.shapes.get(shape, (0.0, 0.0, 0.0))
            self.shapes[shape] = (SHAPE_DECAY * w + width, SHAPE_DECAY * d + levels, SHAPE_DECAY * weight + 1.0)
        self.stats.acceptance_by_depth = [round(q, 4) for q in self.acceptance.rates[: self.draft_depth]]

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The drafter caught up `tokens` waiting tokens in `seconds`, in a step of any kind."""
        if tokens > 0:
            self.costs.observe_catch_up(tokens, seconds)

    def forget(self, rid: int) -> None:
        self.acceptance.forget(rid)
        self.lag.pop(rid, None)
