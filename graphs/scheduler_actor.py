"""SchedulerActor: the Ray actor that owns the scheduler and steps the graph.

A background thread runs the step loop (plan -> compiled graph -> commit) whenever there is
work; the actor's asyncio methods take requests and stream progress back, so one actor
serves many concurrent streams. A stream whose consumer goes away aborts its request,
which frees its KV slots.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import aclosing

import ray

from actors.request import RequestOutput
from spec.sampling import SamplingParams

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class SchedulerActor:
    def __init__(self, config, placement_group, bundle_offset: int = 0):
        from actors import channel_wait, wire
        from actors.cost_probe import probe_step_costs
        from actors.scheduler import DataParallelScheduler, Scheduler
        from graphs.assembly import eos_token_ids, resolve_sources, scheduler_config
        from graphs.runtime import GraphRuntime
        from models.build import load_tokenizer

        channel_wait.install(config.graph_wait_sleep_us * 1e-6)  # this process reads the graph's outputs
        wire.register()  # and writes its inputs: step batches travel packed
        target, draft = resolve_sources(config)
        tokenizer = load_tokenizer(target.folder)
        sched_config = scheduler_config(config, target, draft)
        ranks = [Scheduler(sched_config, None, tokenizer, eos_token_ids(target, tokenizer)) for _ in range(config.dp_size)]
        self.dp = DataParallelScheduler(ranks, None)
        self.runtime = GraphRuntime(config, placement_group, bundle_offset, self.dp,
                                    sched_config.hidden_spec, sched_config.topk_width)
        self.max_model_len = sched_config.max_model_len
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        # rid -> (its caller's loop, its event queue, whether the caller reads the final output alone)
        self._subscribers: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = {}
        self._unstarted: dict[int, int] = {}  # rid -> steps taken when it was submitted (until its first event)
        self._aborts: list[int] = []
        self._stop = False
        self._steps = 0
        self._aborted = 0
        if config.cost_probe:  # before the step loop starts: nothing else steps the graph yet
            probe_step_costs(self.dp, ranks, lambda: self.runtime.step(self._lock))
        self._thread = threading.Thread(target=self._loop, name="step-loop", daemon=True)
        self._thread.start()

    # ---- the step loop (background thread) ------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                self._apply_aborts()
                busy = self.dp.has_unfinished()
            if not busy:
                self._wakeup.wait(0.05)
                self._wakeup.clear()
                continue
            started = time.monotonic()
            try:
                progressed = self.runtime.step(self._lock)
            except Exception as exc:  # noqa: BLE001 - never leave a client hanging
                log.exception("step failed beyond recovery")
                with self._lock:
                    progressed = self.dp.fail_all(f"engine error: {exc}")
            ended = time.monotonic()
            with self._lock:
                self._steps += 1
                self._publish(progressed, started, ended)

    def _apply_aborts(self) -> None:
        """Aborts wait for the step in flight to commit: its slots are still in use."""
        for rid in self._aborts:
            self._aborted += self._drop(rid)  # counts requests ended early, not ones already done
        self._aborts.clear()

    def _drop(self, rid: int) -> int:
        """End request `rid` in the scheduler (under the lock) and forget its subscriber; returns the
        scheduler's count of requests it ended early."""
        self._subscribers.pop(rid, None)
        self._unstarted.pop(rid, None)
        return self.dp.abort(rid)

    def _publish(self, requests, started: float, ended: float) -> None:
        for request in requests:
            sub = self._subscribers.get(request.rid)
            if sub is None:
                continue
            loop, queue, final_only = sub
            finished = request.finish_reason is not None
            if final_only and not finished:
                # No event, so no wake-up of this actor's event loop each step: on a small machine it
                # takes a core from the step that runs meanwhile (one generate() of 32 tokens: 3.5 ms
                # between its steps in all with an event a step, 0.7 ms without).
                continue
            event = {"delta": request.take_delta(), "finished": finished, "logprobs": request.take_logprobs(),
                     "output": request.output() if finished else None}
            submitted_at_step = self._unstarted.pop(request.rid, None)
            if submitted_at_step is not None:
                event["timing"] = self._first_event_timing(request, submitted_at_step, started, ended)
            loop.call_soon_threadsafe(queue.put_nowait, event)
            if finished:
                self._subscribers.pop(request.rid, None)

    def _first_event_timing(self, request, submitted_at_step: int, started: float, ended: float) -> dict:
        """Where a request's time to first token went inside this actor (time.monotonic(), one
        clock for every process of the machine, so callers can place their own hops around it):
        arrival (queued) -> admitted (planned into a step) -> step_started of the step that made the
        first token -> step_ended -> published; steps: steps ended since it was submitted, that one
        included (2 when a step was in flight on arrival; more for a chunked prompt)."""
        admitted = request.arrival + (request.queue_wait_s or 0.0)
        return {"arrival": request.arrival, "admitted": admitted, "step_started": started, "step_ended": ended,
                "published": time.monotonic(), "steps": self._steps - submitted_at_step,
                "prompt_tokens": len(request.prompt_ids), "cached_tokens": request.num_cached}

    # ---- requests (asyncio, many at once) -------------------------------------------

    async def _submit(self, prompt_ids: list[int], params: SamplingParams,
                      final_only: bool = False) -> tuple[int, asyncio.Queue]:
        return (await self._submit_many([(prompt_ids, params)], final_only=final_only))[0]

    async def _submit_many(self, requests: list[tuple[list[int], SamplingParams]],
                           refused_as_errors: bool = False,
                           final_only: bool = False) -> list[tuple[int, asyncio.Queue] | ValueError]:
        """Queue `requests` in one hold of the lock, so the step loop plans them together (a batch
        submitted one call at a time started its first step with the few that had arrived, and the
        rest prefilled a step later). A request the scheduler refuses (ValueError) un-queues the
        others and raises, as the local engine's batch does; with `refused_as_errors` its entry is
        the ValueError instead and the others run. `final_only`: the queue gets the last event
        alone (the caller wants the output, not the progress)."""
        broken = self.health()
        if broken:
            raise RuntimeError(f"engine broken: {broken}")
        loop, entries = asyncio.get_running_loop(), []
        with self._lock:
            for prompt_ids, params in requests:
                try:
                    rid = self.dp.add_request(prompt_ids, params)
                except ValueError as exc:
                    if not refused_as_errors:
                        for entry in entries:
                            if isinstance(entry, tuple):
                                self._drop(entry[0])  # never ran: not counted as aborted
                        raise
                    entries.append(exc)
                    continue
                queue: asyncio.Queue = asyncio.Queue()
                self._subscribers[rid] = (loop, queue, final_only)
                self._unstarted[rid] = self._steps
                entries.append((rid, queue))
        self._wakeup.set()
        return entries

    async def _events(self, rid: int, queue: asyncio.Queue):
        """The request's events up to its last; aborted if the caller goes away before."""
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event["finished"]
                yield event
        finally:
            if not finished:
                self.abort(rid)

    async def _output(self, rid: int, queue: asyncio.Queue) -> RequestOutput:
        async with aclosing(self._events(rid, queue)) as events:
            async for event in events:
                output = event["output"]
        return output

    async def stream(self, prompt_ids: list[int], params: SamplingParams):
        """Yield {"delta", "finished", "logprobs", "output"} events as steps complete (logprobs:
        [(token id, logprob, [(top id, logprob), ...])] of the new tokens, or None if not asked)."""
        # aclosing: a consumer that goes away aborts the request now, not when the generator is collected
        async with aclosing(self._events(*await self._submit(prompt_ids, params))) as events:
            async for event in events:
                yield event

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        rid, queue = await self._submit(prompt_ids, params, final_only=True)
        return await self._output(rid, queue)

    async def generate_many(self, requests: list[tuple[list[int], SamplingParams]],
                            refused_as_errors: bool = False) -> list[RequestOutput | ValueError]:
        """Outputs of `requests`, queued together (`_submit_many`); a refused one's entry is its
        ValueError where `refused_as_errors`."""
        entries = await self._submit_many(requests, refused_as_errors, final_only=True)
        outputs = await asyncio.gather(*[self._output(*e) for e in entries if isinstance(e, tuple)])
        done = iter(outputs)
        return [e if isinstance(e, ValueError) else next(done) for e in entries]

    def abort(self, rid: int) -> None:
        with self._lock:
            self._aborts.append(rid)
        self._wakeup.set()

    def stats(self) -> dict:
        with self._lock:
            return {
                "steps": self._steps,
                "running": sum(len(r.running) for r in self.dp.ranks),
                "waiting": sum(len(r.waiting) for r in self.dp.ranks),
                "free_slots": self.dp.num_free_slots,
                "kv_slots": sum(r.config.kv_slots for r in self.dp.ranks),
                "restarts": self.runtime.restarts,
                "aborted": self._aborted,
                "speculating": not self.runtime.pending_drafts,
                "execute_s": self.dp.execute_s,
                "executed_steps": self.dp.executed_steps,
                **self.dp.tree_size_stats(),
                **self.dp.load_stats(),
            }

    def health(self) -> str | None:
        """Why this engine cannot serve (None: it can). Reads no scheduler state, so it never
        waits for the step lock."""
        if self.runtime.broken:
            return self.runtime.broken
        if not self._thread.is_alive() and not self._stop:
            return "the step loop has stopped"
        return None

    def actors(self) -> list:
        """The rank actors (target, draft per rank), e.g. for fault-injection tests and stats."""
        return self.runtime.actors()

    def actors_by_role(self) -> dict[str, list]:
        return self.runtime.actors_by_role()

    def config_info(self) -> dict:
        return {"max_model_len": self.max_model_len}

    def shutdown(self) -> None:
        self._stop = True
        self._thread.join(timeout=30)
        with self._lock:
            self.runtime.shutdown()
