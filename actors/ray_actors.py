"""Thin Ray actor wrappers over the plain runner classes.

Each wrapper times its own compute, so benchmarks can separate Ray overhead (step wall
time minus compute) from model time, and sends its step batches packed (actors.wire). Actors in a compiled graph still answer ordinary
`.remote()` calls such as `stats()`. Runners are built and called on the actor's one compute
thread (actors.compute_thread), whichever thread Ray calls from. The actor that takes the
scheduler's step inputs reads them as deltas over what it holds (actors.step_stream).
"""

from __future__ import annotations

import time

import ray

from actors import channel_wait, wire
from actors.compute_thread import ComputeThread
from actors.step import run_step
from actors.step_stream import StreamReceiver
from spec.batch import BatchMeta, DraftExtendInput, DraftInput, VerifyInput


class _Timed:
    def _start(self) -> None:
        """Per process, before the first step: batches this actor returns travel packed."""
        wire.register()
        self._reset_stats()
        self._compute = ComputeThread()

    def _reset_stats(self) -> None:
        self._compute_s = 0.0
        self._calls = 0

    def _timed(self, fn, *args):
        return self._compute.run(self._time, fn, *args)

    def _time(self, fn, *args):
        """On the compute thread: the hand-over to it counts as Ray overhead, not compute."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._compute_s += time.perf_counter() - start
            self._calls += 1

    def stats(self, reset: bool = False) -> dict:
        out = {"compute_s": self._compute_s, "calls": self._calls}
        if reset:
            self._reset_stats()
        return out

    def ready(self) -> bool:
        return True

    def sleep_while_waiting(self, max_sleep_s: float) -> None:
        """Compiled-graph reads in this actor sleep, not spin, while they wait (actors.channel_wait)."""
        channel_wait.install(max_sleep_s)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote
class TargetActor(_Timed):
    def __init__(self, **runner_kwargs):
        from actors.target_runner import TargetRunner

        self._start()
        self.runner = self._compute.run(lambda: TargetRunner(**runner_kwargs))

    def forward_step(self, meta_and_verify: tuple[BatchMeta, VerifyInput]) -> DraftExtendInput:
        return self._timed(self.runner.forward_step, *meta_and_verify)


@ray.remote
class DraftActor(_Timed):
    """Wraps whichever drafter the algorithm needs (a model runner, n-gram lookup, or none):
    `build(*args, **kwargs)` makes it inside the actor (the graph layer passes its factory, so this
    layer imports nothing above it)."""

    def __init__(self, build, *args, **kwargs):
        self._start()
        self.drafter = self._compute.run(lambda: build(*args, **kwargs))
        self.inputs = StreamReceiver()

    def propose(self, step) -> tuple[BatchMeta, VerifyInput]:
        """`step`: (BatchMeta, DraftInput), or a message of the scheduler's StreamSender."""
        meta, draft_input = self.inputs.decode(step)
        return meta, self._timed(self.drafter.propose, meta, draft_input)

    def extend(self, meta_and_verify: tuple[BatchMeta, VerifyInput], ext: DraftExtendInput):
        meta, _ = meta_and_verify
        draft_input = self._timed(self.drafter.extend, meta, ext)
        self.inputs.returned(draft_input)
        return ext.for_scheduler(), draft_input  # after the extend, which sets the step's catch-up on ext


@ray.remote
class TargetDraftActor(_Timed):
    """The target with its drafter in the same process (draft placement "colocated"): one hop
    per step, and the hidden states the draft reads never leave the process. `build(*args,
    **kwargs)` makes the drafter, as for DraftActor."""

    def __init__(self, target_kwargs: dict, build, *args, **kwargs):
        from actors.target_runner import TargetRunner

        self._start()
        self.runner = self._compute.run(lambda: TargetRunner(**target_kwargs))
        self.drafter = self._compute.run(lambda: build(*args, **kwargs))
        self.inputs = StreamReceiver()

    def step(self, step) -> tuple[DraftExtendInput, DraftInput]:
        """`step`: (BatchMeta, DraftInput), or a message of the scheduler's StreamSender."""
        ext, draft_input = self._timed(run_step, self.runner, self.drafter, *self.inputs.decode(step))
        self.inputs.returned(draft_input)
        return ext.for_scheduler(), draft_input
