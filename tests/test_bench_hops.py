"""bench.hops: a Ray step's phases lined up from the two processes' stamps (no Ray needed)."""

import pytest

from bench.hops import PHASES, phases, summary


def _step(t0: float, rung_while_computing: bool = False) -> tuple[list, list]:
    """The scheduler's and the actor's stamps of one step starting at t0 (ms offsets below), each phase
    of a known length: encode 0.1, send 0.3, deliver 0.4, decode 0.05, hand-over 0.1, compute 40,
    hand-back 0.05, write 0.5 (0.1 of Ray's loop, then the write), wake 0.2, receive 0.4, finish 0.02."""
    ms = 1e-3
    edges = [0.0]
    for length in (0.1, 0.3, 0.4, 0.05, 0.1, 40.0, 0.05, 0.5, 0.2, 0.4, 0.02):
        edges.append(edges[-1] + length)
    at = [t0 + e * ms for e in edges]
    scheduler = [("encode", at[0]), ("encoded", at[1]), ("ring", at[2])]
    if rung_while_computing:  # a doorbell of an earlier write, heard while the actor computes
        scheduler.append(("rung", at[5] + 10 * ms))
    scheduler += [("rung", at[9]), ("received", at[10]), ("done", at[11])]
    runner = [("decode", at[3]), ("decoded", at[4]), ("compute", at[5]), ("computed", at[6]), ("returns", at[7]),
              ("ring", at[8])]
    return scheduler, runner


def test_each_phase_is_read_from_both_processes_stamps():
    s1, r1 = _step(100.0)
    s2, r2 = _step(100.1, rung_while_computing=True)
    rows = phases(s1 + s2, r1 + r2)
    assert len(rows) == 2
    expected = dict(zip(PHASES, (0.1, 0.3, 0.4, 0.05, 0.1, 40.0, 0.05, 0.5, 0.2, 0.4, 0.02)))
    for row in rows:
        for phase, ms in expected.items():
            assert row[phase] * 1e3 == pytest.approx(ms, abs=1e-6), phase
    out = summary(rows)
    assert out["steps"] == 2
    assert out["coordination_ms"] == pytest.approx(sum(expected.values()) - 40.0, abs=1e-6)


def test_edges_that_cross_between_the_processes_count_zero_and_keep_the_step():
    scheduler, runner = _step(100.0)
    # the actor started decoding 5 us before the scheduler stamped the end of its write
    scheduler = [(n, t + 0.405e-3 if n == "ring" else t) for n, t in scheduler]
    rows = phases(scheduler, runner)
    assert len(rows) == 1 and rows[0]["deliver"] == 0.0
    assert rows[0]["coordination"] * 1e3 == pytest.approx(0.1 + 0.3 + 0.4 + 0.05 + 0.1 + 0.05 + 0.5 + 0.2 + 0.4 + 0.02)


def test_a_step_the_actor_did_not_stamp_is_left_out():
    s1, _ = _step(100.0)  # e.g. a step that failed before the actor ran it
    s2, r2 = _step(100.1)
    rows = phases(s1 + s2, r2)
    assert len(rows) == 1
    assert summary([]) == {"steps": 0}
