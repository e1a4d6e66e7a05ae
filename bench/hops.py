"""Where a Ray step's coordination goes, hop by hop, for the colocated placement (`make serve`'s): one
compiled-graph hop from the scheduler actor to the target actor that hosts the drafter, and back.

Both processes stamp the same monotonic clock (`time.perf_counter`, CLOCK_MONOTONIC on Linux, shared
by every process of a machine) at the edges of each phase; `phases` lines the stamps up step by step:

    encode     the scheduler's StreamSender.encode (step inputs as deltas, actors.step_stream)
    send       the message is pickled (actors.wire packs the batches) and written to the channel (ours,
               actors.shm_channel, or Ray's), until the scheduler rings the actor's doorbell (actors.channel_wait)
    deliver    until the actor's step method starts: its read wakes, reads and deserializes
    decode     the actor's StreamReceiver.decode
    hand-over  to the actor's compute thread (actors.compute_thread)
    compute    the runners' step (what `compute_ms` of bench.graph's profile sums)
    hand-back  back to Ray's thread, until the step returns
    write      from the return: Ray's executor loop pickles the result and writes the channel, until
               the actor rings the scheduler's doorbell
    wake       until the scheduler's read wakes on its doorbell
    receive    the scheduler reads and deserializes the result, and CompiledDAGRef.get returns it
    finish     the scheduler takes the returned DraftInput (StreamSender.returned)

Installed into live actors with `__ray_call__` (bench only: the wrappers stay until the actors go).
"""

from __future__ import annotations

import statistics
import time

PHASES = ("encode", "send", "deliver", "decode", "hand-over", "compute", "hand-back", "write", "wake", "receive",
          "finish")


def _stamp_doorbells(events: list) -> None:
    """Stamp this process's doorbell rings (a compiled-graph channel write has just completed,
    actors.channel_wait) and wake-ups. A ring, not the write's return, marks the write's end: the
    reader may wake and finish before the writer's thread runs again."""
    from actors import channel_wait

    ring, wait = channel_wait._Ringer.ring, channel_wait._Bell.wait

    def stamped_ring(self):
        events.append(("ring", time.perf_counter()))
        ring(self)

    def stamped_wait(self, timeout):
        wait(self, timeout)
        events.append(("rung", time.perf_counter()))

    channel_wait._Ringer.ring, channel_wait._Bell.wait = stamped_ring, stamped_wait


def _wrap(obj, method: str, events: list, before: str | None, after: str | None) -> None:
    fn = getattr(obj, method)

    def stamped(*args):
        if before:
            events.append((before, time.perf_counter()))
        try:
            return fn(*args)
        finally:
            if after:
                events.append((after, time.perf_counter()))

    setattr(obj, method, stamped)


def install_scheduler(actor_self) -> None:
    """In the SchedulerActor: stamp rank 0's hop (the compiled executor's first sender)."""
    events = actor_self._hop_events = []
    executor = actor_self.dp.executor
    sender = executor.senders[0]
    _wrap(sender, "encode", events, "encode", "encoded")
    _wrap(sender, "returned", events, "received", None)
    _wrap(executor, "execute_all", events, None, "done")
    _stamp_doorbells(events)


def install_runner(actor_self) -> None:
    """In a TargetDraftActor: stamp its step's decode, compute and return."""
    events = actor_self._hop_events = []
    _wrap(actor_self.inputs, "decode", events, "decode", "decoded")
    _wrap(actor_self, "_time", events, "compute", "computed")
    _wrap(actor_self.inputs, "returned", events, "returns", None)
    _stamp_doorbells(events)


def take(actor_self) -> list:
    """The stamps so far, cleared."""
    out = list(actor_self._hop_events)
    actor_self._hop_events.clear()
    return out


def _first(events: list, name: str, start: float, end: float) -> float | None:
    return next((t for n, t in events if n == name and start <= t <= end), None)


def phases(scheduler: list, runner: list) -> list[dict]:
    """Per step that both sides stamped in full, the seconds of each of `PHASES`, and `coordination`: the
    step's wall time in the scheduler less the actor's compute. `scheduler` and `runner`: (name,
    perf_counter) stamps in time order. Steps are cut at the scheduler's "encode" stamps; a step without
    one of the stamps a phase needs (a step that failed, or the actor's calls outside the graph) is left
    out, as are all steps when the graph's reads spin (`graph_wait_sleep_us=0`: no doorbells). The two
    processes run at once, so a phase's edges can cross by a few microseconds (the actor may wake before
    the scheduler has stamped its ring): such a phase counts 0."""
    steps, start = [], None
    for name, t in scheduler:
        if name == "encode":
            start = t
        elif name == "done" and start is not None:
            steps.append((start, t))
            start = None
    out = []
    for start, end in steps:
        s = {n: _first(scheduler, n, start, end) for n in ("encoded", "ring", "received")}
        r = {n: _first(runner, n, start, end) for n in ("decode", "decoded", "compute", "computed", "returns")}
        if None in s.values() or None in r.values():
            continue
        written = _first(runner, "ring", r["returns"], end)
        if written is None:
            continue
        # The scheduler's first wake-up after the actor's write; none when a try between naps read it first.
        rung = _first(scheduler, "rung", written, s["received"]) or written
        edges = [start, s["encoded"], s["ring"], r["decode"], r["decoded"], r["compute"], r["computed"],
                 r["returns"], written, rung, s["received"], end]
        row = {phase: max(b - a, 0.0) for phase, a, b in zip(PHASES, edges, edges[1:])}
        row["coordination"] = (end - start) - row["compute"]
        out.append(row)
    return out


def summary(rows: list[dict]) -> dict:
    """Median milliseconds of each phase over the steps, and of the step's coordination (its wall time in
    the scheduler less the actor's compute), with the steps counted."""
    if not rows:
        return {"steps": 0}
    out = {f"{p}_ms": 1e3 * statistics.median(r[p] for r in rows) for p in PHASES}
    out["coordination_ms"] = 1e3 * statistics.median(r["coordination"] for r in rows)
    out["steps"] = len(rows)
    return out
