"""One thread for all of a runner process's torch work.

libgomp gives every thread that starts a parallel region its own team of worker threads, and
once a process manages more OpenMP threads than it has CPUs it stops spinning between regions:
its workers sleep on a futex and each of the hundreds of parallel regions in a step pays a
wake-up. A Ray actor builds its runner on the main thread and a compiled graph calls it from
another thread, so it held two teams on a 2-CPU box and a step kept ~1.3 of its 2 cores busy
(docs/benchmarks.md, "One OpenMP team per actor"). Everything an actor does with torch goes
through one `ComputeThread`, so the process has exactly one team whoever calls.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class ComputeThread:
    def __init__(self, name: str = "torch-compute"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args) -> Any:
        """fn(*args) on the compute thread; returns its result or raises its exception here."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        done = threading.Event()
        box: list = []
        self._jobs.put((fn, args, done, box))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            fn, args, done, box = self._jobs.get()
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box.append((False, exc))
            done.set()
