"""bench.concurrency end to end on the tiny model: levels, the NAME@N cutoff configs, JSON and plot."""

from __future__ import annotations

import dataclasses
import json
import os
from functools import partial

import pytest

from bench import concurrency, configs, engine_process


def test_concurrency_levels_cutoff_and_plot(tiny_target, tmp_path):
    out = tmp_path / "concurrency.json"
    result = concurrency.main(["--model", str(tiny_target), "--configs", "ngram,ngram+fixed,ngram+fixed@1",
                               "--levels", "1,2", "--prompts", "short", "--dtypes", "float32", "--max-tokens", "6", "--repeats", "1",
                               "--prompts-per-level", "2", "--rounds", "1", "--threads", "1", "--out", str(out), "--plot",
                               "--no-engine-processes"])  # in processes: test_each_local_engine_runs_in_a_process_of_its_own
    assert list(result["results"]) == ["short-float32"]
    group = result["results"]["short-float32"]
    assert list(group) == ["none", "ngram", "ngram+fixed", "ngram+fixed@1"]
    for per_level in group.values():
        assert set(per_level) == {"1", "2"}
        # Two prompts at each level: one at a time at batch 1, both in flight at 2.
        assert per_level["1"]["requests"] == per_level["2"]["requests"] == 2
        assert all(entry["mismatches"] == 0 and entry["tokens_per_s"] > 0 for entry in per_level.values())
    assert all(entry["speedup"] == 1.0 and entry["cpu_ratio"] == 1.0 for entry in group["none"].values())
    # CPU per token (what a loaded machine distorts least) for every config, as a ratio to none's.
    assert all(entry["cpu_ms_per_token"] > 0 and entry["cpu_ratio"] > 0 for e in group.values() for entry in e.values())
    # One request is within the cutoff of 1: it drafts exactly as ngram+fixed does; two are above it.
    cut, full = group["ngram+fixed@1"], group["ngram+fixed"]
    assert cut["1"]["acceptance_length"] == full["1"]["acceptance_length"]
    assert group["none"]["1"]["tree_sizes"] == {"1": 2 * 5}  # both prompts' decode steps at batch 1
    assert cut["2"]["acceptance_length"] == 1.0 and cut["2"]["tree_sizes"] == {"1": 5}
    assert set(full["1"]["tree_sizes"]) == {"5"}  # ngram's 4 steps + the root, every decode step
    for per_level in group.values():
        for entry in per_level.values():
            _check_step_profile(entry)
    assert group["none"]["1"]["step_profile"]["decode/1"]["tokens_per_request_step"] == 1.0
    assert full["1"]["step_profile"]["prefill/0"]["prompt_tokens_per_step"] > 0
    assert json.loads(out.read_text()) == result
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["meta"]["levels"] == [1, 2] and result["meta"]["repeats"] == 1
    assert result["meta"]["prompts_per_level"] == 2 and result["meta"]["arrival"] == "closed"
    assert not result["meta"]["engine_per_process"]


def test_a_level_above_the_engines_default_batch_runs_whole(tiny_target):
    """A level of 40 requests keeps 40 decoding at once: the engine's default `max_running_requests` (32)
    ran such a level 32 at a time and queued the rest."""
    result = concurrency.main(["--model", str(tiny_target), "--configs", "none", "--levels", "40", "--prompts", "short",
                               "--dtypes", "float32", "--max-tokens", "4", "--repeats", "1", "--rounds", "1",
                               "--prompts-per-level", "40", "--threads", "1", "--interleave", "turns",
                               "--no-engine-processes", "--out", os.devnull])
    profile = result["results"]["short-float32"]["none"]["40"]["step_profile"]
    assert max(row["requests_per_step"] for key, row in profile.items() if key.startswith(("decode", "mixed"))) == 40.0


def _check_step_profile(entry: dict) -> None:
    """The step profile covers the steps the tree sizes count: per size, its decode and mixed steps (a
    mixed step decodes the running batch at the size the policy chose), and its time shares sum to 1."""
    profile = entry["step_profile"]
    by_size: dict[str, int] = {}
    for key, row in profile.items():
        kind, nodes = key.split("/")
        if kind in ("decode", "mixed"):
            by_size[nodes] = by_size.get(nodes, 0) + row["steps"]
        assert row["steps"] > 0 and row["median_ms"] > 0
    assert by_size == entry["tree_sizes"]
    assert abs(sum(row["time_share"] for row in profile.values()) - 1.0) < 1e-3


def _pid(engine) -> int:
    return os.getpid()


def _fail(engine, message: str):
    raise ValueError(message)


def test_each_local_engine_runs_in_a_process_of_its_own(tiny_target):
    """Engines built earlier in a process step slower (docs/benchmarks.md, sessions 19 and 24), so the
    benchmark gives every local engine a process: calls run there, a failing call raises here with
    the child's traceback and leaves the engine usable, a build that fails raises at start."""
    from graphs import EngineConfig

    config = EngineConfig(model=str(tiny_target), kv_slots=256)
    warm = partial(concurrency.warm_up, [{"role": "user", "content": "hi"}])
    first, second = (engine_process.start_engine(config, 1, warm) for _ in range(2))
    try:
        pids = {first.call(_pid), second.call(_pid)}
        assert len(pids) == 2 and os.getpid() not in pids
        with pytest.raises(RuntimeError, match="ValueError: no such prompt"):
            first.call(_fail, "no such prompt")
        run = first.call(concurrency.run_level, [[{"role": "user", "content": "hello"}]], 1, 3)
        assert run["tokens"] == 3 and run["cpu_s"] > 0
    finally:
        first.shutdown(), second.shutdown()
    with pytest.raises(RuntimeError, match="in the engine process"):
        engine_process.start_engine(dataclasses.replace(config, model=str(tiny_target / "missing")), 1, warm)


def test_closed_arrival_keeps_the_level_in_flight_and_outputs_in_prompt_order(tiny_target):
    from graphs import EngineConfig, SamplingParams, build_graph

    # Prompts of 1-4 chunks of the step's token budget: their requests finish steps apart, so a wave
    # would run its stragglers alone while prompts still wait.
    engine = build_graph(EngineConfig(model=str(tiny_target), kv_slots=2048, max_num_batched_tokens=16,
                                      short_prefill_tokens=0))
    conversations = [[{"role": "user", "content": "word " * (3 + 12 * (i % 4))}] for i in range(6)]
    in_flight = []
    step = engine.scheduler.step

    def counting_step():
        scheduler = engine.scheduler
        in_flight.append(len(scheduler.running) + len(scheduler.prefilling) + len(scheduler.waiting))
        return step()

    engine.scheduler.step = counting_step
    run = concurrency.run_level(engine, conversations, 2, 6)
    engine.scheduler.step = step
    alone = [engine.chat([c], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
             for c in conversations]
    assert run["token_ids"] == [list(ids) for ids in alone] and run["tokens"] == 6 * 6
    # Two in flight at every step until the prompts run out, then the last one alone.
    assert in_flight[0] == 2 and in_flight == sorted(in_flight, reverse=True) and in_flight[-1] == 1


def test_levels_run_waves_or_rounds_of_distinct_prompts_in_alternating_order():
    assert [concurrency.waves(level, 8) for level in (1, 2, 3, 8, 64)] == [8, 4, 3, 1, 1]
    assert concurrency.level_runs(3, 8, "wave") == [(3, 3)] * 3
    assert concurrency.level_runs(1, 8, "closed", 3) == [(8, 1)]
    assert concurrency.level_runs(16, 8, "closed", 3) == [(48, 16)]
    assert concurrency.turn_order(["none", "a", "b"], 0) == ["none", "a", "b"]
    assert concurrency.turn_order(["none", "a", "b"], 1) == ["b", "a", "none"]


@pytest.mark.parametrize("name", ["ngram@x", "ngram/0", "ngram@4/8"])
def test_limits_must_be_positive_numbers(tiny_target, name):
    with pytest.raises(SystemExit, match=name):
        concurrency.main(["--model", str(tiny_target), "--configs", name, "--levels", "1", "--prompts", "short"])


def test_config_names_carry_budget_and_cutoff():
    args = concurrency.parse_args(["--model", "m", "--dtype", "float32", "--kv-slots", "512"])
    _, cfg = configs.parse_config("eagle3-tree-ngram/32@8", args)
    assert (cfg.verify_budget, cfg.disable_by_batch_size, cfg.num_draft_tokens) == (32, 8, 8)
    assert configs.parse_config("ngram/12", args)[1].verify_budget == 12
    assert configs.parse_config("ngram/12", args)[1].adaptive_speculation
    _, fixed = configs.parse_config("serve+fixed/16", args)
    assert (fixed.adaptive_speculation, fixed.verify_budget, fixed.min_path_prob) == (False, 16, 0.1)


def test_a_paused_closed_loop_keeps_its_level_in_flight_across_slices(tiny_target):
    """`--interleave slices`: between slices the loop's requests wait in the engine; every step of every
    slice runs the level in full (a steady state, no ramp-up or drain timed), and closing it aborts what
    is in flight, leaving the engine as it was, with the finished requests' tokens equal to a run alone."""
    from graphs import EngineConfig, SamplingParams, build_graph

    # Prompts of 1-4 chunks of the step's token budget: their requests finish steps apart.
    engine = build_graph(EngineConfig(model=str(tiny_target), kv_slots=2048, max_num_batched_tokens=16,
                                      short_prefill_tokens=0))
    free = engine.scheduler.num_free_slots
    conversations = [[{"role": "user", "content": "word " * (3 + 12 * (i % 4))}] for i in range(5)]
    in_flight, step = [], engine.scheduler.step

    def counting_step():
        scheduler = engine.scheduler
        in_flight.append(len(scheduler.running) + len(scheduler.prefilling) + len(scheduler.waiting))
        return step()

    engine.scheduler.step = counting_step
    concurrency.open_loop(engine, conversations, 3, 6)
    in_flight.clear()
    before = len(concurrency._LOOPS[id(engine)].finished)  # finished in the (untimed) ramp-up
    slices = [concurrency.run_slice(engine, 0.01) for _ in range(8)]
    engine.scheduler.step = step
    closed = concurrency.close_loop(engine)
    assert in_flight and set(in_flight) == {3}
    # Its step profile: the slices' steps (none of the ramp-up's), prompt chunks riding in decode steps.
    profile = closed["profile"].summary()
    assert sum(row["steps"] for row in profile.values()) == len(in_flight)
    assert profile["mixed/1"]["prompt_tokens_per_step"] > 0 and profile["decode/1"]["prompt_tokens_per_step"] == 0
    _check_step_profile({"step_profile": profile, "tree_sizes": {str(k): n for k, n in closed["tree_sizes"].items()}})
    assert sum(s["tokens"] for s in slices) > 0 and slices[-1]["finished"] == len(closed["token_ids"]) > 5
    # A running total (wall, CPU, tokens) at each request the slices finished: where engines are cut alike.
    marks = closed["marks"]
    assert len(marks) == len(closed["token_ids"]) - before and marks == sorted(marks) and len(set(marks)) > 1
    assert marks[-1][0] <= sum(s["wall_s"] for s in slices) and marks[-1][2] <= sum(s["tokens"] for s in slices)
    assert not engine.scheduler.has_unfinished() and engine.scheduler.num_free_slots == free
    alone = [engine.chat([c], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
             for c in conversations]
    assert all(ids == list(alone[i % 5]) for i, ids in closed["token_ids"].items())


def test_sliced_levels_interleave_engines_in_processes(tiny_target, tmp_path):
    result = concurrency.main(["--model", str(tiny_target), "--configs", "ngram", "--levels", "2",
                               "--prompts", "short", "--dtypes", "float32", "--max-tokens", "6", "--prompts-per-level",
                               "4", "--rounds", "1", "--threads", "1", "--slice-s", "0.05", "--min-slices", "3",
                               "--out", str(tmp_path / "c.json")])
    assert result["meta"]["interleave"] == "slices" and result["meta"]["engine_per_process"]
    group = result["results"]["short-float32"]
    none, ngram = group["none"]["2"], group["ngram"]["2"]
    assert none["slices"] == ngram["slices"] >= 3 and min(none["requests"], ngram["requests"]) >= 4
    assert none["timed_requests"] == ngram["timed_requests"] >= 3  # both timed over the same prompts
    assert ngram["mismatches"] == 0 and ngram["tokens_per_s"] > 0 and none["speedup"] == 1.0
    for entry in (none, ngram):  # the timed slices' steps, not the ramp-up's: as the tree sizes count them
        _check_step_profile(entry)
    with pytest.raises(SystemExit):  # waves run whole in turns
        concurrency.parse_args(["--arrival", "wave", "--interleave", "slices"])


def test_requests_may_each_have_their_own_length(tiny_target):
    """`--length-spread`: each prompt keeps one output length for every config (seeded), spread evenly
    around --max-tokens, so a closed loop's requests finish steps apart as a server's do; 0 keeps one
    length for all."""
    from graphs import EngineConfig, build_graph

    assert concurrency.request_lengths(8, 0.0, 3) == [8, 8, 8]
    lengths = concurrency.request_lengths(40, 0.5, 64)
    assert lengths == concurrency.request_lengths(40, 0.5, 64) and min(lengths) >= 20 and max(lengths) <= 60
    assert len(set(lengths)) > 10 and abs(sum(lengths) / len(lengths) - 40) < 4
    engine = build_graph(EngineConfig(model=str(tiny_target), kv_slots=2048))
    conversations = [[{"role": "user", "content": f"word {i}"}] for i in range(4)]
    run = concurrency.run_level(engine, conversations, 2, [3, 7, 1, 5])
    assert [len(ids) for ids in run["token_ids"]] == [3, 7, 1, 5]
    concurrency.open_loop(engine, conversations, 2, [3, 7, 1, 5])
    concurrency.run_slice(engine, 0.05)
    closed = concurrency.close_loop(engine)
    assert closed["token_ids"] and all(len(ids) == [3, 7, 1, 5][i % 4] for i, ids in closed["token_ids"].items())
    with pytest.raises(SystemExit):
        concurrency.parse_args(["--length-spread", "1.0"])
