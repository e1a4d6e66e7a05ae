"""bench.ab_steps: per-step cost of engine configs, single steps in turn in one process (tiny model, no Ray)."""

from __future__ import annotations

import time

import pytest

from bench import ab_steps


def test_a_config_whose_steps_cost_more_reads_above_the_reference(tiny_target):
    """Each config is built twice, in mirrored order (A B B A); each engine holds the level and takes one step
    per round, in that order; a config whose every step costs 100 ms more reads about that much
    above the reference in its plain decode steps, an identical one below it."""
    from graphs import EngineConfig
    from graphs.build import build_local

    # The same engine three times, told apart by their pools' sizes (which the steps never fill).
    configs = {name: EngineConfig(model=str(tiny_target), kv_slots=2048 + i) for i, name in enumerate(("none", "same", "slow"))}
    built, order = [], []

    def build(config):
        name = next(n for n, c in configs.items() if c is config)
        engine = build_local(config)
        built.append(name)
        step = engine.scheduler.step

        def timed_step():
            order.append(name)
            if name == "slow":
                time.sleep(0.1)
            return step()

        engine.scheduler.step = timed_step
        return engine

    conversations = [[{"role": "user", "content": "word " * (2 + i % 3)}] for i in range(8)]
    results = ab_steps.measure(configs, conversations, level=2, steps=6, max_tokens=40, build=build)
    assert built == ["none", "same", "slow", "slow", "same", "none"]
    # The timed rounds: every engine once a round, in the mirrored order.
    timed = order[-36:]
    assert all(timed[6 * r: 6 * r + 6] == built for r in range(6))
    plain = {name: rows["decode/1"] for name, rows in results.items()}
    assert {row["steps"] for row in plain.values()} == {12}  # two engines x six rounds, all plain decode steps
    # Where the steps ran: two requests each, at the same contexts (the same prompts, greedy, the same steps).
    assert {row["requests_per_step"] for row in plain.values()} == {2.0}
    assert len({row["context_per_request"] for row in plain.values()}) == 1 and plain["none"]["context_per_request"] > 2
    assert plain["none"]["ratio"] == 1.0
    assert plain["same"]["ratio"] < plain["slow"]["ratio"]
    assert plain["slow"]["median_ms"] - plain["none"]["median_ms"] > 60.0  # 100 ms, less what noise may add to none's


def test_configs_and_counts_are_checked():
    with pytest.raises(SystemExit):
        ab_steps.parse_args(["--configs", "none"])
    with pytest.raises(SystemExit):
        ab_steps.parse_args(["--level", "0"])
    args = ab_steps.parse_args(["--configs", "none, serve+fixed/16,none", "--level", "4"])
    assert args.configs == ["none", "serve+fixed/16"] and args.level == 4
