"""Serving under load stays lossless: chunked prefill, preemption under a short KV pool and
prefix-cache hits give every request exactly the tokens an unconstrained run gives it (greedy
and seeded sampling), for EAGLE, EAGLE-3, STANDALONE and NGRAM; KV comes back after each run."""

from __future__ import annotations

import random

import pytest
import torch

from actors.prefix_cache import PrefixCache
from graphs import EngineConfig, SamplingParams, build_graph

# (algorithm, draft fixture name, eagle_topk, num_draft_tokens, num_steps)
ALGORITHMS = [
    ("EAGLE3", "tiny_eagle3_own", 2, 6, 3),
    ("EAGLE", "tiny_eagle", 1, 4, 3),
    ("STANDALONE", "tiny_standalone", 2, 6, 3),
    ("NGRAM", None, 1, 4, 3),
]
UNCONSTRAINED = dict(kv_slots=4096, max_num_batched_tokens=4096, prefix_cache=False)


def _engine(request, algorithm, draft, topk, n, steps, **kw):
    draft_path = request.getfixturevalue(draft) if draft else None
    # Fixed trees: the tests compare accept lengths, which follow the tree sizes an adaptive
    # (timing-driven) policy would vary between engines.
    kw.setdefault("adaptive_speculation", False)
    return build_graph(EngineConfig(
        model=str(request.getfixturevalue("tiny_target")), speculative_algorithm=algorithm,
        draft_model=draft_path and str(draft_path), eagle_topk=topk, num_draft_tokens=n, num_steps=steps, **kw))


def _workload(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """8 requests, prompts of 3 to 45 tokens, greedy and seeded sampling."""
    rng = random.Random(seed)
    out = []
    for i in range(8):
        prompt = [rng.randrange(1, 64) for _ in range(3 + (i * 6) % 43)]
        out.append((prompt, SamplingParams(max_tokens=12 + i % 3 * 5, temperature=0.0 if i % 2 else 0.9,
                                           seed=7 + i, ignore_eos=True)))
    return out


def _outputs(engine, requests, watch=None):
    """Submit every request at once and step to the end; `watch(scheduler)` after each step."""
    sched = engine.scheduler
    reqs = [sched.find(sched.add_request(p, params)) for p, params in requests]
    while sched.has_unfinished():
        sched.step()
        if watch:
            watch(sched)
    return [r.output() for r in reqs]


def _run(engine, requests, watch=None):
    return [o.token_ids for o in _outputs(engine, requests, watch)]


def _draft_keys_at_start(engine, requests):
    """Outputs, and per request the draft's layer-0 keys over its KV positions as it starts
    decoding (local backend, model drafts)."""
    drafter = engine.scheduler.executor.drafter
    seen = {}

    def watch(sched):
        for r in sched.running:
            seen.setdefault(r.rid, drafter.kv.k[0][:, torch.tensor(r.slots)].clone())

    outs = _outputs(engine, requests, watch)
    return outs, [seen[o.request_id] for o in outs]


def _assert_kv_back(sched):
    assert sched.num_free_slots == sched.config.kv_slots
    assert not sched.prefilling and not sched.running and not sched.waiting
    assert sched.cache is None or sched.cache.num_locked == 0


@pytest.mark.parametrize("algorithm,draft,topk,n,steps", ALGORITHMS)
def test_chunked_prefill_and_preemption_are_lossless(request, algorithm, draft, topk, n, steps):
    """A token budget of 16 prefills the long prompts over several steps, each chunk in one
    forward with the running requests' verify rows (mixed steps), and a pool of 100 slots (the
    requests want ~400) preempts and recomputes: same tokens."""
    spec = (algorithm, draft, topk, n, steps)
    reference = _run(_engine(request, *spec, **UNCONSTRAINED), _workload())
    engine = _engine(request, *spec, kv_slots=100, max_num_batched_tokens=16, prefix_cache=False)
    seen = {"mixed": False, "front": True}
    commit = engine.scheduler.commit

    def watch_commit(plan, *args):
        seen["mixed"] |= plan.kind == "mixed"  # committed as one step, not rerun request by request
        return commit(plan, *args)

    engine.scheduler.commit = watch_commit

    def watch(sched):
        # A preempted request waits before every request that never ran (no starvation).
        started = [r.admit_seq >= 0 for r in sched.waiting]
        seen["front"] &= started == sorted(started, reverse=True)

    assert _run(engine, _workload(), watch) == reference
    assert engine.scheduler.stats.preemptions > 0
    assert seen["mixed"] and seen["front"]
    _assert_kv_back(engine.scheduler)


def _random_arrivals(seed: int) -> dict[int, list[tuple[list[int], SamplingParams]]]:
    """3 to 5 greedy requests arriving over the first 8 steps: prompts of 2 to 60 tokens, 2 to 30 new ones."""
    rng = random.Random(seed)
    arrivals: dict[int, list] = {}
    for _ in range(rng.randint(3, 5)):
        step, prompt = rng.randint(0, 8), [rng.randrange(1, 64) for _ in range(rng.randint(2, 60))]
        params = SamplingParams(max_tokens=rng.randint(2, 30), temperature=0.0, ignore_eos=True)
        arrivals.setdefault(step, []).append((prompt, params))
    return arrivals


# Workloads (`_random_arrivals` seeds) on which requests cycled between preemption and re-admission (the
# first two), or were preempted right after their prompts completed (the third).
@pytest.mark.parametrize("algorithm,n,kv_slots,prefix_cache,seed", [
    ("NONE", 1, 91, False, 52),
    ("NGRAM", 8, 102, True, 105),
    ("NGRAM", 4, 70, True, 29),
])
def test_preempted_requests_resume_without_cycling(request, algorithm, n, kv_slots, prefix_cache, seed):
    """Requests arriving over a few steps into a pool that holds two or three of them all end, with the
    tokens an unconstrained run gives them, and a prompt that completes is never preempted before it
    decodes. A preempted request is overdue and prefills first; while only a step's first prompt could
    prefill partly it kept an older, partly prefilled prompt from prefilling, neither could finish, and
    it was preempted (the newest) and first again, forever; and one re-admitted onto its cached prefix
    completed with no room left for its first decode step, whose planning preempted it (CI hung so on the
    real model)."""
    spec = (algorithm, None, 1, n, 3)
    arrivals = _random_arrivals(seed)
    engine = _engine(request, *spec, kv_slots=kv_slots, max_num_batched_tokens=16, prefix_cache=prefix_cache)
    completed: dict[int, tuple] = {}  # prompts completed and not yet decoded: their request, preemptions then

    def watch(sched, plan):
        decoding = plan.parts[0].requests if plan.kind == "mixed" else plan.requests if plan.kind == "decode" else []
        for request in decoding:
            completed.pop(request.rid, None)
        for request, preemptions in completed.values():
            assert request.num_preemptions == preemptions, f"request {request.rid} preempted before decoding"
        prefill = plan.parts[1] if plan.kind == "mixed" else plan if plan.kind == "prefill" else None
        if prefill is not None:  # (its chunks join the requests' slots when it commits, after this)
            chunks = zip(prefill.requests, prefill.meta.prefill_lens.tolist())
            completed.update({r.rid: (r, r.num_preemptions) for r, n in chunks if len(r.slots) + n == r.kv_len})

    outs = _staggered(engine, arrivals, watch, max_steps=400)
    reference = _staggered(_engine(request, *spec, **UNCONSTRAINED), arrivals)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert engine.scheduler.stats.preemptions > 0
    _assert_kv_back(engine.scheduler)


@pytest.mark.parametrize("algorithm,draft,topk,n,steps", ALGORITHMS)
def test_prefix_cache_hits_are_lossless(request, algorithm, draft, topk, n, steps):
    """Second turns (first prompt + its answer + more) and prompts sharing a long prefix reuse
    cached KV, also under chunking and preemption, and get the tokens a cache-less run gets."""
    spec = (algorithm, draft, topk, n, steps)
    first = _workload(1)
    shared = [7, 3, 9, 12, 40, 41, 5] * 4
    cached = _engine(request, *spec, kv_slots=4096, max_num_batched_tokens=16)
    plain = _engine(request, *spec, **UNCONSTRAINED)
    # The first turns decode plainly, so their draft KV waits to be caught up (a plain step defers
    # the draft's extend): the second turns' cache hits end in those positions and must find them
    # written.
    cached.scheduler.policy.verify_budget = 1
    answers = _run(cached, first)
    cached.scheduler.policy.verify_budget = None
    assert answers == _run(plain, first)
    rng = random.Random(2)
    second = [(p + a + [rng.randrange(1, 64) for _ in range(4)], params) for (p, params), a in zip(first, answers)]
    second += [(shared + [i + 1, i + 2], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
               for i in range(4)]
    cache = cached.scheduler.cache
    hits_before = cache.hit_tokens
    # Prompts that leave the cached shared prefix where the cached ones went on differently.
    second += [(shared + [i + 9, i + 3], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
               for i in range(4)]
    _run(cached, second[-8:-4])
    if draft:
        # The draft finds at every cached position the KV a full prefill writes (an EAGLE entry
        # pairs a token with the next one, which differs where cached prompts diverge).
        with_cache, keys = _draft_keys_at_start(cached, second)
        without, plain_keys = _draft_keys_at_start(plain, second)
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(keys, plain_keys))
    else:
        with_cache, without = _outputs(cached, second), _outputs(plain, second)
    assert [o.token_ids for o in with_cache] == [o.token_ids for o in without]
    assert [o.accept_lens for o in with_cache] == [o.accept_lens for o in without]
    # Every second turn finds its whole first turn but the last token (not in the KV).
    assert cache.hit_tokens - hits_before >= sum(len(p) + len(a) - 1 for (p, _), a in zip(first, answers))
    _assert_kv_back(cached.scheduler)
    small = _engine(request, *spec, kv_slots=120, max_num_batched_tokens=16)
    _run(small, first)
    assert _run(small, second) == _run(plain, second)
    assert small.scheduler.stats.preemptions > 0
    _assert_kv_back(small.scheduler)


def test_prefix_cache_keys_positions_by_token_pairs_and_evicts_lru():
    freed: list[int] = []
    cache = PrefixCache(freed.extend)
    assert cache.insert([1, 2, 3, 4], [10, 11, 12]) == []
    node, slots = cache.match([1, 2, 3, 4, 5], most=10)
    assert slots == [10, 11, 12]  # position p matches when tokens p and p + 1 do
    assert cache.match([1, 2, 3, 9], most=10)[1] == [10, 11]  # position 2's entry pairs 3 with 4
    assert cache.match([1, 2, 3, 4], most=1)[1] == [10]
    assert cache.insert([1, 2, 3, 7, 8], [20, 21, 22, 23]) == [20, 21]  # positions 0-1 were cached
    cache.lock(node)
    assert cache.evict(10) == 2 and sorted(freed) == [22, 23]  # the locked path stays
    cache.unlock(node)
    cache.clear()
    assert sorted(freed) == [10, 11, 12, 22, 23] and cache.num_cached == 0
    with pytest.raises(ValueError, match="tokens"):
        cache.insert([1, 2], [5, 6])


def test_step_budget_is_validated_by_name():
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            EngineConfig(max_num_batched_tokens=bad)
    with pytest.raises(ValueError, match="prefill_order"):
        EngineConfig(prefill_order="lifo")


@pytest.mark.parametrize("spec, caps", [((None, None, 1, 4, 3), {}),
                                         (("EAGLE3", "tiny_eagle3_own", 2, 6, 3), {"disable_by_batch_size": 1})],
                         ids=["none", "eagle3-capped"])
def test_short_prompt_rides_in_a_plain_decode_step(request, spec, caps):
    """Where the running batch decodes plain (no speculation, or above the user's
    disable_by_batch_size), a short arrival rides in its decode step (mixed) rather than taking a
    step of its own: that step would cost every running request a whole step, while riding along
    costs a few rows. The tokens are those of the engine that never prefills ahead."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    rng = random.Random(4)
    prompt = lambda n: [rng.randrange(1, 64) for _ in range(n)]  # noqa: E731
    arrivals = {0: [(prompt(20), greedy), (prompt(9), greedy)], 3: [(prompt(6), greedy)], 6: [(prompt(5), greedy)]}
    plans = []
    engine = _engine(request, *spec, short_prefill_tokens=16, **caps)
    outs = _staggered(engine, arrivals, lambda sched, plan: plans.append((plan.kind, len(sched.running))))
    off = _engine(request, *spec, short_prefill_tokens=0, **caps)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _staggered(off, arrivals)]
    assert plans[0] == ("prefill", 0)
    assert plans[3][0] == plans[6][0] == "mixed"
    assert [kind for kind, running in plans if kind == "prefill" and running] == []
    _assert_kv_back(engine.scheduler)


def _staggered(engine, arrivals, watch=None, first=None, max_steps: int = 2000):
    """Requests submitted at given steps ({step: [(prompt, params)]}), stepped to the end (failing
    after `max_steps`, rather than hanging); `watch(scheduler, plan)` sees every committed plan;
    `first`, where given, gets each request's step of its first token, in submission order. Returns
    the outputs in submission order."""
    sched, reqs, firsts, step = engine.scheduler, [], {}, 0
    commit = sched.commit

    def watch_commit(plan, *args):
        if watch:
            watch(sched, plan)
        return commit(plan, *args)

    sched.commit = watch_commit
    while step <= max(arrivals) or sched.has_unfinished():
        reqs += [sched.find(sched.add_request(p, params)) for p, params in arrivals.get(step, [])]
        sched.step()
        firsts.update({r.rid: step for r in reqs if r.output_ids and r.rid not in firsts})
        step += 1
        assert step < max_steps, f"still unfinished after {step} steps: {sched.stats}"
    if first is not None:
        first.extend(firsts[r.rid] for r in reqs)
    return [r.output() for r in reqs]


def test_short_prompt_prefills_ahead_of_the_running_decode(request):
    """A prompt needing few tokens beyond the cache (here a short one) that arrives while others
    decode gets its first token from a prefill step of its own, not from the running batch's
    speculative decode step; a long prompt rides in the decode step (mixed); never two such steps
    in a row; the tokens are those of the engine without it, and the KV comes back."""
    spec = ("EAGLE3", "tiny_eagle3_own", 2, 6, 3)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    prompt = lambda n: [rng.randrange(1, 64) for _ in range(n)]  # noqa: E731
    arrivals = {0: [(prompt(20), greedy), (prompt(9), greedy)], 3: [(prompt(6), greedy), (prompt(7), greedy)],
                5: [(prompt(80), greedy)], 6: [(prompt(5), greedy)], 7: [(prompt(4), greedy)]}
    plans = []
    engine = _engine(request, *spec, short_prefill_tokens=16)
    outs = _staggered(engine, arrivals, lambda sched, plan: plans.append(
        (plan.kind, sorted(r.rid for r in plan.requests), len(sched.running))))
    off = _engine(request, *spec, short_prefill_tokens=0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _staggered(off, arrivals)]
    # Steps 0-2: the first two prefill together, then decode. Step 3: the two short arrivals (13
    # tokens) prefill alone while two requests run; step 4 decodes all four.
    assert plans[0] == ("prefill", [0, 1], 0)
    assert plans[3] == ("prefill", [2, 3], 2) and plans[4][0] == "decode"
    # Step 5: the 80-token prompt needs more than 16: it rides in the decode step (mixed); step 6
    # the short one, after a decode step, prefills alone.
    assert plans[5][0] == "mixed" and 4 in plans[5][1]
    assert plans[6] == ("prefill", [5], 5)
    # Step 7: another short arrival, but the decode comes first (it rides along).
    assert plans[7][0] == "mixed" and 6 in plans[7][1]
    assert all(not (a[0] == b[0] == "prefill" and b[2]) for a, b in zip(plans, plans[1:]))
    _assert_kv_back(engine.scheduler)


def _first_token_steps(engine, arrivals):
    """`_staggered`'s outputs and each request's first-token step (submission order)."""
    first = []
    return _staggered(engine, arrivals, first=first), first


@pytest.mark.parametrize("spec", [("EAGLE3", "tiny_eagle3_own", 2, 6, 3), ("NONE", None, 1, 1, 1)])
def test_short_prompts_prefill_ahead_of_a_long_one(request, spec):
    """A long prompt prefilling in chunks does not hold back short prompts that arrive behind it: in
    "shortest" order their first tokens come before its, in "fcfs" after. The tokens are the same
    either way, and the KV comes back."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rng = random.Random(5)
    prompt = lambda n: [rng.randrange(1, 64) for _ in range(n)]  # noqa: E731
    arrivals = {0: [(prompt(70), greedy)], 1: [(prompt(6), greedy), (prompt(5), greedy), (prompt(7), greedy)]}
    runs = {}
    for order in ("shortest", "fcfs"):
        engine = _engine(request, *spec, max_num_batched_tokens=24, short_prefill_tokens=0, prefill_order=order)
        runs[order] = _first_token_steps(engine, arrivals)
        _assert_kv_back(engine.scheduler)
    (shortest, first), (fcfs, fcfs_first) = runs["shortest"], runs["fcfs"]
    assert [o.token_ids for o in shortest] == [o.token_ids for o in fcfs]
    assert max(first[1:]) < first[0]
    assert min(fcfs_first[1:]) >= fcfs_first[0]


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(request, monkeypatch):
    """A short prompt arriving every step goes ahead of a long one in "shortest" order, but once the
    long one has been overtaken `MAX_PASSED_OVER` times it prefills first, in at least half of each
    step's budget: its first token comes a few steps later than in arrival order, not after the stream
    ends (as it would without that rule), and every short prompt still gets its first token in the
    step it arrives in (in arrival order they queue behind the long one)."""
    import actors.scheduler as scheduler

    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rng = random.Random(6)
    prompt = lambda n: [rng.randrange(1, 64) for _ in range(n)]  # noqa: E731
    stream = range(1, 40)
    arrivals = {0: [(prompt(48), greedy)], **{step: [(prompt(8), greedy)] for step in stream}}

    def first_tokens(order):
        engine = _engine(request, "NONE", None, 1, 1, 1, max_num_batched_tokens=16, short_prefill_tokens=0,
                         prefill_order=order)
        outs, first = _first_token_steps(engine, arrivals)
        _assert_kv_back(engine.scheduler)
        return [o.token_ids for o in outs], first

    fcfs_tokens, fcfs = first_tokens("fcfs")
    tokens, shortest = first_tokens("shortest")
    assert tokens == fcfs_tokens
    assert shortest[0] <= scheduler.MAX_PASSED_OVER + 2 * (fcfs[0] + 1)
    assert shortest[1:] == list(stream) != fcfs[1:]
    monkeypatch.setattr(scheduler, "MAX_PASSED_OVER", 10**9)
    assert first_tokens("shortest")[1][0] >= stream[-1]  # the rule is what bounds it: without it the stream wins
