"""The Ray backend: the lossless matrix through the compiled graph with DP ranks (fewer
requests than ranks, so idle inputs flow every step), streaming, and fault injection."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray
import torch

from actors import shm_channel
from graphs import EngineConfig, SamplingParams, build_graph
from graphs.config import OMP_ENV

pytestmark = pytest.mark.integration

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_target):
    engine = build_graph(EngineConfig(model=str(tiny_target)))
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _ray_engine(target, algorithm=None, draft=None, **kw):
    return build_graph(EngineConfig(model=str(target), speculative_algorithm=algorithm,
                                    draft_model=draft and str(draft), backend="ray", kv_slots=2048, **kw))


OMP_POLICY = {"NGRAM": "passive", "STANDALONE": "brief"}  # the others run libgomp's default waits

# Draft placement None is the default: colocated (no draft GPUs or resources asked for); "separate" is named.
# The graph's values cross processes over our own channel (graph_channel "shm", the default) or Ray's.
@pytest.mark.parametrize("algorithm,draft,dp,topk,n,cutoff,placement,channel", [
    ("EAGLE3", "tiny_eagle3_own", 2, 2, 5, None, None, "shm"),
    ("EAGLE3", "tiny_eagle3_own", 2, 2, 5, None, "separate", "shm"),
    ("STANDALONE", "tiny_standalone", 1, 1, 4, None, None, "shm"),
    ("STANDALONE", "tiny_standalone", 1, 1, 4, None, "separate", "ray"),
    ("NGRAM", None, 2, 1, 4, None, None, "ray"),
    ("EAGLE3", "tiny_eagle3_shared", 2, 4, 8, 1, None, "shm"),  # ranks with 2+ requests decode plainly
])
def test_lossless_through_the_compiled_graph(request, tiny_target, reference, algorithm, draft, dp, topk, n, cutoff,
                                             placement, channel):
    # No start-up probe: the cold policy measures the full tree and the plain step first, so both run.
    # A 6-token step budget prefills the longest prompt in chunks, in mixed steps with the decode
    # rows of the prompts prefilled first.
    engine = _ray_engine(tiny_target, algorithm, draft and request.getfixturevalue(draft), dp_size=dp,
                         eagle_topk=topk, num_draft_tokens=n, disable_by_batch_size=cutoff, draft_placement=placement,
                         cost_probe=False, max_num_batched_tokens=6, graph_channel=channel,
                         omp_wait_policy=OMP_POLICY.get(algorithm, "default"))
    try:
        # The scheduler writes each rank's step input into a segment of its own channel (shm only).
        pid = ray.get(engine.scheduler.__ray_call__.remote(lambda self: os.getpid()))
        ours = [name for name in os.listdir(shm_channel.segment_dir())
                if name.startswith(f"{shm_channel._PREFIX}{pid}-")]
        assert len(ours) == (dp if channel == "shm" else 0)
        actors = engine.actors()
        assert len(actors) == dp * (1 if engine.config.colocated_draft else 2)
        # The runners' OpenMP waits are set in their environment, before torch loads.
        assert ray.get([a.__ray_call__.remote(lambda self: {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
                                                            if k in os.environ})
                        for a in actors]) == [OMP_ENV[OMP_POLICY.get(algorithm, "default")]] * len(actors)
        # The scheduler actor keeps one torch thread: an OpenMP team of its own would spin on the
        # cores the runners compute on after each of its small tensor ops.
        assert ray.get(engine.scheduler.__ray_call__.remote(lambda self: torch.get_num_threads())) == 1
        # A rank computes on target_num_cpus + draft_num_cpus (1 + 1) whatever it drafts with: a colocated
        # drafter's CPU joins the target's thread pool, model-free (NGRAM) or not; a separate model draft
        # keeps its own.
        threads = ray.get([a.__ray_call__.remote(lambda self: self._compute.run(torch.get_num_threads))
                           for a in actors])
        assert threads == ([2] if engine.config.colocated_draft else [1, 1]) * dp
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
        # One request on dp ranks: the other ranks run idle inputs every step.
        assert engine.generate(PROMPTS[:1], GREEDY)[0].token_ids == reference[0]
        stats = engine.stats()
        assert stats["free_slots"] == stats["kv_slots"] == 2048 * dp
        if cutoff is None:  # adaptive speculation measured plain steps and trees on the actors too
            assert 1 in stats["steps_by_tree_size"] and max(stats["steps_by_tree_size"]) > 1
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def eagle3_engine(tiny_target, tiny_eagle3_shared):
    engine = _ray_engine(tiny_target, "EAGLE3", tiny_eagle3_shared, dp_size=2, eagle_topk=2, num_draft_tokens=5)
    yield engine
    engine.shutdown()


def test_many_concurrent_async_streams(eagle3_engine, reference):
    async def one(prompt):
        return "".join([d async for d in eagle3_engine.astream(prompt, GREEDY)])

    async def main():
        return await asyncio.gather(*[one(PROMPTS[i % 3]) for i in range(24)])

    texts = asyncio.run(main())
    expected = [eagle3_engine.tokenizer.decode(reference[i % 3], skip_special_tokens=True) for i in range(24)]
    assert texts == expected
    assert eagle3_engine.stats()["free_slots"] == 4096


def test_abandoned_stream_frees_its_kv(eagle3_engine):
    before = eagle3_engine.stats()
    stream = eagle3_engine.stream([1, 2, 3], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    next(stream)
    stream.close()
    deadline = time.time() + 30
    while eagle3_engine.stats()["running"] and time.time() < deadline:
        time.sleep(0.1)
    stats = eagle3_engine.stats()
    assert stats["running"] == 0 and stats["free_slots"] == 4096
    # Ended by the abort, not by running its 400 tokens (the scheduler counts only early ends).
    assert stats["aborted"] == before["aborted"] + 1


def test_a_poison_request_fails_alone_through_the_graph(eagle3_engine, reference):
    """A token id outside the vocabulary (the HTTP edge refuses it; the engine API does not)
    makes the target actor raise: that request ends with an error, the others are unharmed."""
    prompts = [*PROMPTS[:2], [1, 2, 10**6], PROMPTS[2]]
    outs = ray.get([eagle3_engine.scheduler.generate.remote(p, GREEDY) for p in prompts])
    bad = outs.pop(2)
    assert bad.finish_reason == "error" and "IndexError" in bad.error
    assert [o.token_ids for o in outs] == reference
    stats = eagle3_engine.stats()
    assert stats["free_slots"] == stats["kv_slots"] and stats["restarts"] == 0
    assert ray.get(eagle3_engine.scheduler.health.remote()) is None


def test_a_batch_is_queued_together(eagle3_engine):
    """generate() of many prompts queues them all before the next step, as the local engine does:
    one prefill step answers every one-token request (submitted one call each, the first step
    began with those that had arrived)."""
    prompts = [PROMPTS[i % 3] + [20 + i] for i in range(8)]
    for _ in range(3):
        before = eagle3_engine.stats()["steps"]
        outs = eagle3_engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
        assert [o.num_output_tokens for o in outs] == [1] * 8
        assert eagle3_engine.stats()["steps"] == before + 1


def test_a_refused_prompt_refuses_its_batch_or_comes_back_alone(eagle3_engine, reference):
    """As in the local engine: a prompt the scheduler refuses raises for the whole batch and leaves
    none of it queued; with errors_as_outputs it alone comes back with an error."""
    too_long = list(range(600))
    with pytest.raises(ValueError, match="prompt"):
        eagle3_engine.generate([PROMPTS[0], too_long, PROMPTS[1]], GREEDY)
    stats = eagle3_engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["free_slots"] == stats["kv_slots"]
    outs = eagle3_engine.generate_each([(PROMPTS[0], GREEDY), (too_long, GREEDY), (PROMPTS[2], GREEDY)],
                                       errors_as_outputs=True)
    assert outs[1].finish_reason == "error" and "prompt" in outs[1].error and outs[1].num_prompt_tokens == 600
    assert [outs[0].token_ids, outs[2].token_ids] == [reference[0], reference[2]]


def test_infeasible_resources_fail_at_once_naming_them(tiny_target):
    from ray.util import placement_group_table

    before = set(placement_group_table())  # other engines of this Ray session keep theirs
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"no_such_node: needs 2, the cluster has 0") as info:
        _ray_engine(tiny_target, dp_size=2, target_resources={"no_such_node": 1})
    assert "dp_size=2" in str(info.value) and time.monotonic() - start < 60
    created = {pg_id: pg for pg_id, pg in placement_group_table().items() if pg_id not in before}
    assert created and all(pg["state"] == "REMOVED" for pg in created.values())  # none left asking


def test_bad_request_is_a_clear_error(eagle3_engine):
    with pytest.raises(ValueError, match="prompt"):
        eagle3_engine.generate([list(range(600))], GREEDY)
    assert eagle3_engine.generate(PROMPTS[:1], GREEDY)[0].finish_reason == "length"  # still serving


def _kill_midway(engine, which: str, reference):
    """Start long generations, kill one kind of actor once tokens flow, compare outputs."""
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    expected = engine.generate(PROMPTS, params)
    steps = engine.stats()["steps"]  # the reference above ran steps too
    refs = [engine.scheduler.generate.remote(p, params) for p in PROMPTS]

    def decoding(stats: dict) -> bool:
        return stats["running"] == len(PROMPTS) and stats["steps"] >= steps + 3

    deadline = time.time() + 60
    while not decoding(engine.stats()) and time.time() < deadline:
        time.sleep(0.02)
    actors = engine.actors()
    victims = actors[0::2] if which == "target" else actors[1::2]
    ray.kill(victims[0])
    assert engine.stats()["running"] == len(PROMPTS), "the kill must land while every request runs"
    outs = ray.get(refs, timeout=240)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert all(o.finish_reason == "length" and o.num_output_tokens == 100 for o in outs)
    stats = engine.stats()
    assert stats["restarts"] >= 1 and stats["free_slots"] == stats["kv_slots"]


@pytest.mark.parametrize("which,placement", [("draft", "separate"), ("target", "separate"), ("target", "colocated")])
def test_actor_death_costs_no_request(tiny_target, tiny_standalone, reference, which, placement):
    """Colocated, the one actor of the rank holds target and draft: killing it takes both."""
    engine = _ray_engine(tiny_target, "STANDALONE", tiny_standalone, dp_size=1, draft_placement=placement)
    try:
        _kill_midway(engine, which, reference)
        deadline = time.time() + 60
        while not engine.stats()["speculating"] and time.time() < deadline:
            engine.generate(PROMPTS[:1], GREEDY)
        assert engine.stats()["speculating"]  # the draft is back and speculation resumed
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    finally:
        engine.shutdown()


def test_spent_restart_budget_breaks_the_engine_visibly(tiny_target):
    """Beyond its restart budget the engine fails its requests with an error and reports
    itself broken (a Serve replica's health check then fails, and Serve replaces it)."""
    engine = _ray_engine(tiny_target, "NGRAM", max_actor_restarts=0)
    try:
        assert ray.get(engine.scheduler.health.remote()) is None
        ref = engine.scheduler.generate.remote(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0,
                                                                          ignore_eos=True))
        deadline = time.time() + 60
        while engine.stats()["steps"] < 2 and time.time() < deadline:
            time.sleep(0.02)
        ray.kill(engine.actors()[0])
        out = ray.get(ref, timeout=120)
        assert out.finish_reason == "error" and "could not recover" in out.error
        assert "restarts" in ray.get(engine.scheduler.health.remote())
        with pytest.raises(Exception, match="engine broken"):
            engine.generate(PROMPTS[:1], GREEDY)
        assert engine.stats()["free_slots"] == engine.stats()["kv_slots"]
    finally:
        engine.shutdown()


def test_first_event_says_where_the_time_to_first_token_went(eagle3_engine):
    """The scheduler actor's stamps (one monotonic clock for the machine's processes) fall between
    the caller's submit and receipt, in the order the request passed them."""
    called = time.monotonic()
    events = eagle3_engine.stream_events([1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    first = next(events)
    received = time.monotonic()
    rest = list(events)
    t = first["timing"]
    assert called <= t["arrival"] <= t["admitted"] <= t["step_ended"] <= t["published"] <= received
    assert t["arrival"] <= t["step_started"] <= t["step_ended"]
    assert t["steps"] >= 1 and t["prompt_tokens"] == 4
    assert all("timing" not in e for e in rest)


@ray.remote
class _SlowEcho:
    """A compiled-graph node that takes a while per step without using CPU, with sleeping,
    ringing channel reads and writes as the runner actors install them."""

    def __init__(self, max_sleep_s: float):
        from actors import channel_wait

        channel_wait.install(max_sleep_s)

    def step(self, x):
        time.sleep(0.05)
        return x


def test_graph_reads_sleep_until_the_writer_rings():
    """A read waiting for a 50 ms step is woken by the writer's doorbell: it tries the channel
    once or twice per value, where naps of at most 500 us try ~100 times (4 CPU ms of tries a
    step, taken from the cores the runners compute on)."""
    from ray.dag import InputNode

    from actors import channel_wait

    max_sleep_s = 500e-6
    channel_wait.install(max_sleep_s)  # this process reads the graph's output, as the scheduler actor does
    echo = _SlowEcho.remote(max_sleep_s)
    ray.get(echo.__ray_ready__.remote())
    with InputNode() as inp:
        dag = echo.step.bind(inp)
    compiled = dag.experimental_compile()
    try:
        assert compiled.execute(b"warm").get() == b"warm"
        before = channel_wait.tries()
        for i in range(10):
            assert compiled.execute(i).get() == i
        assert channel_wait.tries() - before <= 10 * 3
    finally:
        compiled.teardown()
        channel_wait.install(0)
        ray.kill(echo)
