"""Start-up probe: time a few decode steps on dummy requests so adaptive speculation starts from
measured costs instead of measuring them on the first users' requests.

For each probe shape (a batch of dummy prompts of some length), the dummy requests are prefilled,
then every probed tree size runs `steps_per_size` timed decode steps (the full tree first, then
smaller ones down to the plain step, then one draft level again: its first step catches the draft up
over the plain steps' tokens, the catch-up term's first sample); the policies' cost fits learn from
them as from any step. The dummy requests are then aborted (their KV freed, nothing cached) and the policies
forget the acceptance and choices the dummies taught: only the costs stay. Shapes that do not fit
the engine (its running-request limit, KV pool or model length) shrink or are skipped.

Works on any scheduler with `add_request`, `find`, `abort` (a `Scheduler` or a
`DataParallelScheduler`); `step` runs one step of it (the engine's own step loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actors.cost_model import TreeSizePolicy
from actors.scheduler import Scheduler, SchedulerStats
from spec.sampling import SamplingParams


@dataclass(frozen=True)
class ProbeShape:
    batch: int  # dummy requests decoded together
    prompt_tokens: int  # context each attends to

    def __post_init__(self):
        if self.batch < 1 or self.prompt_tokens < 1:
            raise ValueError(f"ProbeShape: batch and prompt_tokens must be positive, got {self}")


# One request at a short context, a batch of them, and a few long-context requests: enough to tell
# apart the step's fixed, per-request, per-row and per-context costs (`StepCostModel`'s features).
# The long contexts are 1k tokens at a batch of 2, where verify rows and draft levels start paying
# for their attention (Spec-Bench summarization and RAG prompts run to 1-2k tokens): a context term
# learnt from one request at 512 tokens was too small to tell, and extrapolated to 16 x 1.5k. (The
# probe's prefills, about 3k tokens in all, are most of its cost.)
DEFAULT_SHAPES = (ProbeShape(1, 64), ProbeShape(16, 64), ProbeShape(2, 1024))


# Runs of the plain step before the last full tree: their tokens wait for the draft (a few per request,
# so that the catch-up term's first sample stands out of a step's timing noise).
PLAIN_RUNS = 4


def probe_sizes(policy: TreeSizePolicy) -> list[int]:
    """The probed sizes in order, each run for `steps_per_size` steps: the full tree, a tree of two
    beam levels (4 nodes), one draft level (no beam level) and the plain step, which tell apart the
    fit's per-row, per-drafted-request and per-level terms; the plain step `PLAIN_RUNS` times over, then
    one draft level again, whose first step catches the draft up over the plain steps' tokens (the
    cheapest tree, and one whose cost no `min_path_prob` cut of the levels varies)."""
    sizes = sorted({policy.tree_size, min(4, policy.tree_size), min(2, policy.tree_size)}, reverse=True)
    return sizes + [1] * PLAIN_RUNS + [min(2, policy.tree_size)]


# Tokens in the cycle a dummy prompt repeats.
DUMMY_CYCLE = 8


def dummy_prompt(index: int, length: int, vocab_size: int) -> list[int]:
    """A deterministic token sequence, distinct per request (no prefix sharing between dummies), that
    repeats a short cycle: the draft then continues it confidently, so the probed trees run every
    level and keep every node as users' trees do (`min_path_prob` cut the trees of unrepeating noise
    short, and the fit learnt that trees were cheaper than they are)."""
    cycle = [(7919 * (index + 1) + 104729 * t) % vocab_size for t in range(DUMMY_CYCLE)]
    return [cycle[t % DUMMY_CYCLE] for t in range(length)]


def probe_step_costs(scheduler, ranks: list[Scheduler], step: Callable[[], object], *,
                     shapes: tuple[ProbeShape, ...] = DEFAULT_SHAPES, steps_per_size: int = 2) -> int:
    """Run the probe on `scheduler` whose per-rank `Scheduler`s are `ranks`; returns the timed decode
    steps it ran (0 when speculation is not adaptive)."""
    policies: list[TreeSizePolicy] = [rank.policy for rank in ranks]
    if not policies or not all(p.adaptive and p.tree_size > 1 for p in policies):
        return 0
    config = ranks[0].config
    sizes = probe_sizes(policies[0])
    # Every probed step may accept a full chain (the dummies' cycles are accepted), and a dummy whose
    # prompt is in decodes a token at each step that prefills the others; none may finish early.
    decoded = 1 + steps_per_size * sum(policies[0].depth(n) + 1 for n in sizes)
    timed = 0
    for shape in shapes:
        new_tokens = decoded + 2 + shape.batch * shape.prompt_tokens // max(config.max_num_batched_tokens, 1)
        length = min(shape.prompt_tokens, config.max_model_len - new_tokens - 1)
        need = length + new_tokens + 2 * ranks[0].per_step_slots  # what a request is admitted against
        # At most half of each rank's pool, so the probe never preempts.
        batch = min(shape.batch, config.max_running_requests * len(ranks),
                    len(ranks) * (config.kv_slots // max(need, 1) // 2))
        if length < 1 or batch < 1:
            continue
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        rids = [scheduler.add_request(dummy_prompt(b, length, ranks[0].vocab_size), params) for b in range(batch)]
        try:
            for policy in policies:
                policy.forced = 1
            while any(_prefilling(scheduler, rid) for rid in rids):  # plain decodes may come between chunks
                step()
            for nodes in sizes:
                for policy in policies:
                    policy.forced = nodes
                for _ in range(steps_per_size):
                    step()
                    timed += 1
        finally:
            for rid in rids:
                scheduler.abort(rid)
            for rank in ranks:  # /metrics count users' requests only
                rank.policy.end_probe()
                rank.stats = SchedulerStats()
                if rank.cache is not None:
                    rank.cache.hit_tokens = rank.cache.query_tokens = 0
    return timed


def _prefilling(scheduler, rid: int) -> bool:
    try:
        return not scheduler.find(rid).output_ids
    except KeyError:  # ended (a dummy that failed): nothing to wait for
        return False
