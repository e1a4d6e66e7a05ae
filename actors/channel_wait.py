"""Compiled-graph channel reads that sleep while they wait.

Ray 2.60's shared-memory channel read (PlasmaObjectHeader::ReadAcquire) spins with
sched_yield until the writer's value arrives (ray#55128): every actor of a compiled graph
waiting for its input, and the process waiting for the graph's output, burns a core. On a
small machine that core is the one the target computes on. `install()` replaces the read in
this process with non-blocking tries and sleeps that grow from PAUSE_S to `max_sleep_s`,
so a wait costs at most `max_sleep_s` of latency and next to no CPU.

A try costs 30-45 us of CPU here (Python, Ray's channel, the exception of an empty read), and
every wake-up preempts one of the target's threads. Sleeping first through most of the recent wait
(the step repeats) was tried and measured worse than this plain backoff
(bench/results/graph_levers.json, docs/benchmarks.md), so reads keep no history.
"""

from __future__ import annotations

import time

from ray.exceptions import RayChannelTimeoutError
from ray.experimental.channel import shared_memory_channel

PAUSE_S = 20e-6  # first sleep: a value that is almost there costs next to nothing

_EMPTY = object()  # no value read yet (a read may return None)


def install(max_sleep_s: float) -> None:
    """Make this process's channel reads sleep (up to `max_sleep_s` at a time) while they
    wait; 0 keeps Ray's spinning read. Call it before the graph compiles (once per process)."""
    channel = shared_memory_channel.Channel
    spinning_read = getattr(channel.read, "spinning_read", channel.read)
    if max_sleep_s <= 0:
        channel.read = spinning_read
        return

    def read(self, timeout: float | None = None):
        start = time.monotonic()
        deadline = None if timeout is None or timeout < 0 else start + timeout
        value, pause = _EMPTY, PAUSE_S
        while value is _EMPTY:
            try:
                value = spinning_read(self, 0)  # 0: one try, no wait
            except RayChannelTimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, max_sleep_s)
        return value

    read.spinning_read = spinning_read
    channel.read = read
