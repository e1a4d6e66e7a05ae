"""Scheduler: request queue, continuous batching, KV slot accounting and the step loop.

Each step is either a prefill step (new requests join: the target extends over their
prompts, the draft catches up, their DraftInput rows are merged into the running batch) or
a decode step (draft propose -> target verify -> draft extend over the running batch).
Every phase runs every step; the one with no work gets an idle input from `spec/`, exactly
as the compiled Ray graph will run it. The executor that runs a step is pluggable: local
calls in one process, or a Ray compiled graph.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch

from actors.cost_model import TreeSizePolicy
from actors.request import IncrementalDetokenizer, Request
from actors.slots import SlotAllocator
from spec.algorithm import SpecAlgorithm
from spec.batch import BatchMeta, DraftExtendInput, DraftInput
from spec.sampling import SamplingParams
from spec.shapes import HiddenStateSpec

log = logging.getLogger(__name__)

@dataclass
class StepPlan:
    """One step's inputs for one rank, and what the scheduler must remember to commit it."""

    kind: str  # "prefill" | "decode" | "resync" | "idle"
    requests: list[Request]
    meta: BatchMeta
    draft_input: DraftInput
    rows: list[int] | None = None  # decode of these running rows only (isolating a failure); None: all


class StepExecutor(Protocol):
    def execute(self, meta: BatchMeta, draft_input: DraftInput) -> tuple[DraftExtendInput, DraftInput]: ...


@dataclass(frozen=True)
class SchedulerConfig:
    algorithm: SpecAlgorithm
    tree_size: int  # most verify nodes per request and step (root included)
    scratch_size: int  # draft scratch slots per request and step
    topk_width: int  # columns of DraftInput.topk_* (0 where the draft has not seen the root)
    hidden_spec: HiddenStateSpec | None  # the draft's recurrent hidden state
    kv_slots: int
    max_running_requests: int
    max_prefill_tokens: int
    max_model_len: int
    needs_history: bool = False  # decode steps carry each request's tokens (prompt lookup)
    vocab_size: int | None = None  # the target's (token ids in sampling parameters stay below it)
    draft_depth: int = 0  # draft levels of a full tree (num_steps; 0 without speculation)
    # Each decode step's tree size: chosen from measured costs and acceptance (actors.cost_model),
    # or (False) the full tree; verify_budget and disable_by_batch_size cap it either way.
    adaptive: bool = True
    verify_budget: int | None = None
    disable_by_batch_size: int | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, executor: StepExecutor, tokenizer, eos_ids: set[int]):
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.slots = SlotAllocator(config.kv_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.draft_input = self._idle_draft_input()
        self.reserved = 0
        self._inflight: StepPlan | None = None  # planned, not yet committed
        self._failed: list[Request] = []  # failed outside a step's own requests, not yet reported
        self._next_rid = 0
        self._rng = random.SystemRandom()
        self.vocab_size = config.vocab_size or len(tokenizer)
        self.policy = TreeSizePolicy(config.tree_size, config.draft_depth, config.adaptive,
                                     config.verify_budget, config.disable_by_batch_size)

    def _idle_draft_input(self) -> DraftInput:
        return DraftInput.create_idle(self.config.hidden_spec, self.config.topk_width)

    @property
    def per_step_slots(self) -> int:
        return self.config.tree_size + self.config.scratch_size

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: int | None = None) -> int:
        """Queue a request; raises ValueError for prompts that can never run."""
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens leave no room within max_model_len {limit}")
        if rid is None:
            rid = self._next_rid
            self._next_rid += 1
        seed = params.seed if params.seed is not None else self._rng.randrange(2**62)
        params.check_vocab(self.vocab_size)
        request = Request(rid, list(prompt_ids), params, seed, IncrementalDetokenizer(self.tokenizer),
                          self.eos_ids, limit)
        request.reserved = len(prompt_ids) + request.max_new_tokens + 2 * self.per_step_slots
        if request.reserved > self.config.kv_slots:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens plus max_tokens {params.max_tokens} need "
                f"{request.reserved} KV slots, more than the pool's {self.config.kv_slots}"
            )
        self.waiting.append(request)
        return rid

    def abort(self, rid: int) -> bool:
        """End a queued or running request; False when it was neither (already finished)."""
        for request in list(self.waiting):
            if request.rid == rid:
                self.waiting.remove(request)
                request.finish_reason = "abort"
                return True
        for i, request in enumerate(self.running):
            if request.rid == rid:
                request.finish_reason = "abort"
                self._retire([i])
                return True
        return False

    def find(self, rid: int) -> Request:
        for request in (*self.waiting, *self.running):
            if request.rid == rid:
                return request
        raise KeyError(f"request {rid} is not queued or running")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    # ---- the step loop --------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one step; returns the requests that made progress (finished and failed ones
        included). A step that raises is rerun request by request: the request that fails
        alone ends with an error, the others go on."""
        plan = self.plan()
        if plan.kind == "idle":
            return self.take_failed()
        try:
            start = time.perf_counter()
            ext, draft_input = self.executor.execute(plan.meta, plan.draft_input)
            seconds = time.perf_counter() - start
        except Exception:  # noqa: BLE001 - find the request that broke it
            log.warning("step failed; rerunning its requests one by one", exc_info=True)
            self.release_uncommitted()
            return self.isolate(plan.requests, lambda solo: self.executor.execute(solo.meta, solo.draft_input))
        return self.commit(plan, ext, draft_input, seconds) + self.take_failed()

    def take_failed(self) -> list[Request]:
        """Requests failed alone since the last call (to report their end)."""
        failed, self._failed = self._failed, []
        return failed

    def idle_plan(self) -> "StepPlan":
        return StepPlan("idle", [], BatchMeta.create_idle(self.config.scratch_size, self.config.tree_size),
                        self._idle_draft_input())

    def plan(self) -> "StepPlan":
        """Choose this step's work and allocate its KV slots: a prefill of newly admitted
        requests, a decode of the running batch, or an idle step (inputs from spec/). A
        request that cannot be planned (alone) fails alone; the step goes on without it."""
        admitted = self._admit()
        try:
            if admitted:
                self._inflight = self._plan_prefill(admitted)
            elif self.running:
                self._inflight = self._plan_decode()
            else:
                self._inflight = self.idle_plan()
        except Exception:  # noqa: BLE001 - _plan_* undid their allocations
            bad = self._unplannable(admitted or list(self.running))
            if not bad:
                raise
            for request, exc in bad:
                self.fail_request(request, exc)
            return self.plan()
        return self._inflight

    def _unplannable(self, requests: list[Request]) -> list[tuple[Request, Exception]]:
        """Plan each request alone (and undo it): the ones that raise, with what they raised."""
        order, bad = list(self.waiting), []
        for request in requests:
            try:
                self.plan_alone(request)
                self.release_uncommitted()
            except Exception as exc:  # noqa: BLE001
                bad.append((request, exc))
        self.waiting = deque(r for r in order if r.finish_reason is None)  # queue order as before
        return bad

    def plan_alone(self, request: Request) -> "StepPlan":
        """A step of `request` alone: its prefill when it waits, else a decode of its row."""
        if any(r is request for r in self.running):
            self._inflight = self._plan_decode([next(i for i, r in enumerate(self.running) if r is request)])
        else:
            self.waiting.remove(request)
            self.reserved += request.reserved
            self._inflight = self._plan_prefill([request])
        return self._inflight

    def isolate(self, requests: list[Request], run, is_request_error=lambda exc: True) -> list[Request]:
        """Rerun a failed step's requests one at a time (`run(plan) -> (ext, draft_input)`):
        a request whose step fails alone ends with finish_reason "error" and frees its slots,
        the others make their step. An error `is_request_error` rejects (a dead actor) is
        raised after the solo step's allocations are undone."""
        progressed: list[Request] = []
        for request in requests:
            if request.finish_reason is not None:
                continue
            try:
                solo = self.plan_alone(request)
            except Exception as exc:  # noqa: BLE001
                self.fail_request(request, exc)
                continue
            try:
                ext, draft_input = run(solo)
            except Exception as exc:  # noqa: BLE001
                self.release_uncommitted()
                if not is_request_error(exc):
                    raise
                log.warning("request %s failed alone: %s", request.rid, exc)
                self.fail_request(request, exc)
                continue
            progressed += self.commit(solo, ext, draft_input)
        return progressed + self.take_failed()

    def fail_request(self, request: Request, exc: BaseException) -> None:
        """End one request with an error wherever it is (queued or running) and free its slots."""
        request.fail(f"{type(exc).__name__}: {exc}")
        if any(r is request for r in self.waiting):
            self.waiting.remove(request)
        rows = [i for i, r in enumerate(self.running) if r is request]
        self._retire(rows)
        self._failed.append(request)

    def commit(self, plan: "StepPlan", ext: DraftExtendInput, draft_input: DraftInput,
               seconds: float | None = None) -> list[Request]:
        """Apply a step's results: append tokens, keep accepted KV slots, free the rest. A
        request whose tokens raise ends with an error alone (retired with the finished).
        `seconds`: the step's wall time (the tree-size policy learns from decode steps)."""
        self._inflight = None
        if plan.kind == "prefill":
            for request, tokens, logprobs in zip(plan.requests, ext.new_token_ids(), ext.new_logprobs()):
                request.num_verify_steps += 1
                self._append(request, tokens, logprobs)
            self.running.extend(plan.requests)
            self.draft_input = self.draft_input.merge(draft_input)
        elif plan.kind == "decode":
            if plan.rows is None:
                self.draft_input = draft_input
            else:  # a subset stepped: its rows go first, the others keep theirs
                others = [i for i in range(len(self.running)) if i not in plan.rows]
                self.draft_input = draft_input.merge(self.draft_input.filter(others))
                self.running = [self.running[i] for i in plan.rows] + [self.running[i] for i in others]
            self.slots.free(plan.meta.scratch_slots.reshape(-1))
            committed = torch.split(ext.slots, ext.extend_lens.tolist())
            for b, (request, kept, tokens, logprobs) in enumerate(
                    zip(plan.requests, committed, ext.new_token_ids(), ext.new_logprobs())):
                keep = set(kept.tolist())
                self.slots.free([x for x in plan.meta.verify_slots[b].tolist() if x not in keep])
                request.slots.extend(kept.tolist())
                request.num_verify_steps += 1
                request.accept_lens.append(len(tokens) - 1)
                self._append(request, tokens, logprobs)
            self._observe_decode(plan, ext, seconds)
        self._retire_finished()
        return list(plan.requests)

    @staticmethod
    def _append(request: Request, tokens: list[int], logprobs: list | None) -> None:
        try:
            request.append_tokens(tokens, logprobs)
        except Exception as exc:  # noqa: BLE001 - e.g. its detokenizer or stop rules raising
            log.warning("request %s failed committing its tokens: %s", request.rid, exc)
            request.fail(f"{type(exc).__name__}: {exc}")

    def _admit(self) -> list[Request]:
        admitted, tokens = [], 0
        while self.waiting and len(self.running) + len(admitted) < self.config.max_running_requests:
            request = self.waiting[0]
            if self.reserved + request.reserved > self.config.kv_slots:
                break  # wait until running requests finish and release their reservation
            if admitted and tokens + len(request.prompt_ids) > self.config.max_prefill_tokens:
                break
            self.waiting.popleft()
            self.reserved += request.reserved
            tokens += len(request.prompt_ids)
            admitted.append(request)
        return admitted

    def _sampling_fields(self, requests: list[Request]) -> dict[str, torch.Tensor]:
        """Every per-request sampling input of BatchMeta but the history (see spec.batch)."""
        floats = lambda name: torch.tensor([float(getattr(r.params, name)) for r in requests])  # noqa: E731
        longs = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
        return dict(
            temperature=floats("temperature"), top_p=floats("top_p"), min_p=floats("min_p"),
            top_k=longs([int(r.params.top_k) for r in requests]), seeds=longs([r.seed for r in requests]),
            prompt_lens=longs([len(r.prompt_ids) for r in requests]),
            num_output=longs([len(r.output_ids) for r in requests]),
            min_tokens=longs([r.params.min_tokens for r in requests]),
            repetition_penalty=floats("repetition_penalty"), presence_penalty=floats("presence_penalty"),
            frequency_penalty=floats("frequency_penalty"),
            # Stop ids only matter while min_tokens holds them back (then the processors stay off).
            stop_ids=self._padded([r.stop_ids if len(r.output_ids) < r.params.min_tokens else [] for r in requests],
                                  -1),
            bias_ids=self._padded([list(r.params.logit_bias) for r in requests], -1),
            bias_values=self._padded([list(r.params.logit_bias.values()) for r in requests], 0,
                                     torch.float32),
            num_logprobs=longs([-1 if r.params.logprobs is None else r.params.logprobs for r in requests]),
        )

    @staticmethod
    def _padded(rows: list[list], pad, dtype: torch.dtype = torch.long) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        out = torch.full((len(rows), width), pad, dtype=dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
        return out

    def _prefill_meta(self, requests: list[Request], tokens: list[list[int]], slots: list[list[int]],
                      next_token: list[int]) -> BatchMeta:
        batch = len(requests)
        empty = torch.zeros((batch, 0), dtype=torch.long)
        return BatchMeta(
            seq_lens=torch.zeros(batch, dtype=torch.long), kv_slots=empty,
            prefill_lens=torch.tensor([len(t) for t in tokens], dtype=torch.long),
            prefill_tokens=self._padded(tokens, 0), prefill_slots=self._padded(slots, 0),
            next_token=torch.tensor(next_token, dtype=torch.long),
            scratch_slots=empty, verify_slots=empty, history=empty, **self._sampling_fields(requests),
        )

    def _plan_prefill(self, requests: list[Request]) -> "StepPlan":
        """Prefill of admitted requests; on any error its slots are freed and the requests
        are back at the front of the queue (nothing leaks)."""
        try:
            for request in requests:
                request.slots = self.slots.alloc(len(request.prompt_ids)).tolist()
            meta = self._prefill_meta(requests, [r.prompt_ids for r in requests], [r.slots for r in requests],
                                      [-1] * len(requests))
        except Exception:
            self._unadmit(requests)
            raise
        return StepPlan("prefill", requests, meta, self._idle_draft_input())

    def _plan_decode(self, rows: list[int] | None = None) -> "StepPlan":
        """Decode of the running batch (or of `rows` of it); slots are allocated last, so a
        request whose inputs cannot be built leaks nothing. The verify slots' width is the step's
        tree size (the policy's choice), the scratch slots only there when it drafts."""
        requests = list(self.running) if rows is None else [self.running[i] for i in rows]
        batch = len(requests)
        n = self.policy.choose([r.rid for r in requests], sum(r.seq_len for r in requests))
        s = self.config.scratch_size if n > 1 else 0
        # Prompt lookup reads the tokens; so do the penalties (verification counts them per node).
        needs_history = self.config.needs_history or any(r.params.uses_history for r in requests)
        history = (
            self._padded([r.prompt_ids + r.output_ids for r in requests], -1)
            if needs_history else torch.zeros((batch, 0), dtype=torch.long)
        )
        fields = dict(
            seq_lens=torch.tensor([r.seq_len for r in requests], dtype=torch.long),
            kv_slots=self._padded([r.slots for r in requests], 0),
            prefill_lens=torch.zeros(batch, dtype=torch.long),
            prefill_tokens=torch.zeros((batch, 0), dtype=torch.long),
            prefill_slots=torch.zeros((batch, 0), dtype=torch.long),
            next_token=torch.full((batch,), -1, dtype=torch.long),
            history=history, **self._sampling_fields(requests),
        )
        scratch = self.slots.alloc(batch * s).view(batch, s)
        try:
            verify = self.slots.alloc(batch * n).view(batch, n)
        except Exception:
            self.slots.free(scratch.reshape(-1))
            raise
        meta = BatchMeta(scratch_slots=scratch, verify_slots=verify, **fields)
        draft_input = self.draft_input if rows is None else self.draft_input.filter(rows)
        return StepPlan("decode", requests, meta, draft_input, rows)

    def _observe_decode(self, plan: "StepPlan", ext: DraftExtendInput, seconds: float | None) -> None:
        """Tell the tree-size policy what a decode step cost and what each request accepted."""
        nodes = int(plan.meta.verify_slots.shape[1])
        depth = self.policy.depth(nodes)
        for request in plan.requests:
            request.draft_depths.append(depth)
        self.policy.observe([r.rid for r in plan.requests], int(plan.meta.seq_lens.sum()), nodes, seconds,
                            ext.accept_lens.tolist())

    def plan_resync(self) -> "StepPlan":
        """Re-prefill every running request into fresh runners (after an actor restart):
        prompt plus output but the last token, which becomes the known next token, so
        nothing is sampled twice. The same KV slots are rewritten with the same values."""
        requests = list(self.running)
        tokens = [(r.prompt_ids + r.output_ids)[:-1] for r in requests]
        meta = self._prefill_meta(requests, tokens, [r.slots for r in requests], [r.output_ids[-1] for r in requests])
        return StepPlan("resync", requests, meta, self._idle_draft_input())

    def commit_resync(self, plan: "StepPlan", draft_input: DraftInput) -> None:
        self.draft_input = draft_input

    def release_uncommitted(self) -> "StepPlan | None":
        """Undo the allocations of a planned step that failed (its runners died or raised):
        slots go back to the pool and admitted requests back to the front of the queue.
        Returns the undone plan."""
        plan, self._inflight = self._inflight, None
        if plan is None:
            return None
        if plan.kind == "decode":
            self.slots.free(plan.meta.scratch_slots.reshape(-1))
            self.slots.free(plan.meta.verify_slots.reshape(-1))
        elif plan.kind == "prefill":
            self._unadmit(plan.requests)
        return plan

    def _unadmit(self, requests: list[Request]) -> None:
        """Admitted requests back to the front of the queue, their slots and reservation freed."""
        for request in reversed(requests):
            if request.slots:
                self.slots.free(request.slots)
            request.slots = []
            self.reserved -= request.reserved
            self.waiting.appendleft(request)

    def fail_all(self, message: str) -> list[Request]:
        """End every request with an error (the engine cannot serve them); frees everything."""
        self.release_uncommitted()
        failed = list(self.waiting) + list(self.running)
        for request in failed:
            request.fail(message)
        self.waiting.clear()
        self._retire(list(range(len(self.running))))
        return failed

    def _retire_finished(self) -> None:
        self._retire([i for i, r in enumerate(self.running) if r.finish_reason is not None])

    def _retire(self, rows: list[int]) -> None:
        """Free finished requests' slots and drop their rows from the batch state."""
        if not rows:
            return
        for i in rows:
            request = self.running[i]
            self.policy.forget(request.rid)
            self.slots.free(request.slots)
            request.slots = []
            self.reserved -= request.reserved
        keep = [i for i in range(len(self.running)) if i not in set(rows)]
        self.running = [self.running[i] for i in keep]
        self.draft_input = self.draft_input.filter(keep)


class DataParallelScheduler:
    """One Scheduler per data-parallel rank, stepped in lockstep: every rank runs every
    step, a rank without work on idle inputs (what DP attention needs). Requests go to the
    least-loaded rank."""

    def __init__(self, ranks: list[Scheduler], executor):
        self.ranks = ranks
        self.executor = executor  # execute_all([(meta, draft_input) per rank]) -> [(ext, draft_input)]
        self._next_rid = 0
        self.execute_s = 0.0  # wall time spent inside executor.execute_all (benchmarks)
        self.executed_steps = 0

    def tree_size_stats(self) -> dict:
        """Decode steps per chosen tree size (summed over ranks) and each rank's decayed acceptance
        rate per draft depth (the adaptive policy's view, for /metrics)."""
        steps: dict[int, int] = {}
        for rank in self.ranks:
            for size, n in rank.policy.stats.steps_by_size.items():
                steps[size] = steps.get(size, 0) + n
        return {"steps_by_tree_size": steps,
                "acceptance_by_depth": [rank.policy.stats.acceptance_by_depth for rank in self.ranks]}

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        rank = min(self.ranks, key=lambda r: (len(r.running) + len(r.waiting), r.reserved))
        rid = self._next_rid
        rank.add_request(prompt_ids, params, rid=rid)
        self._next_rid += 1
        return rid

    def find(self, rid: int) -> Request:
        for rank in self.ranks:
            try:
                return rank.find(rid)
            except KeyError:
                pass
        raise KeyError(f"request {rid} is not queued or running")

    def abort(self, rid: int) -> bool:
        return any([rank.abort(rid) for rank in self.ranks])

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.ranks)

    @property
    def num_free_slots(self) -> int:
        return sum(r.num_free_slots for r in self.ranks)

    def step(self, lock: AbstractContextManager = nullcontext(), is_request_error=lambda exc: True) -> list[Request]:
        """Plan and commit under `lock`; the runners' work happens outside it, so requests
        can be submitted (and stats read) while a step runs. A step that raises an error
        `is_request_error` accepts is rerun request by request (Scheduler.isolate); others
        (a dead actor) are raised with the step's allocations undone."""
        with lock:
            try:
                plans = [rank.plan() for rank in self.ranks]
            except Exception:
                for rank in self.ranks:
                    rank.release_uncommitted()
                raise
            if all(p.kind == "idle" for p in plans):
                return self._take_failed()
        start = time.perf_counter()
        try:
            results = self.executor.execute_all([(p.meta, p.draft_input) for p in plans])
        except Exception as exc:  # noqa: BLE001
            if not is_request_error(exc):
                raise
            log.warning("step failed (%s); rerunning its requests one by one", exc)
            with lock:
                return self.isolate(is_request_error)
        with lock:
            self.executed_steps += 1
            progressed: list[Request] = []
            seconds = time.perf_counter() - start
            self.execute_s += seconds
            for rank, plan, (ext, draft_input) in zip(self.ranks, plans, results):
                progressed += rank.commit(plan, ext, draft_input, seconds)
            return progressed + self._take_failed()

    def _take_failed(self) -> list[Request]:
        return [r for rank in self.ranks for r in rank.take_failed()]

    def isolate(self, is_request_error=lambda exc: True) -> list[Request]:
        """Undo the failed step and rerun each of its requests alone (other ranks idle)."""
        failed = [rank.release_uncommitted() for rank in self.ranks]
        progressed: list[Request] = []
        for k, (rank, plan) in enumerate(zip(self.ranks, failed)):
            if plan is None or not plan.requests:
                continue

            def run(solo: StepPlan, k: int = k):
                plans = [solo if i == k else r.idle_plan() for i, r in enumerate(self.ranks)]
                return self.executor.execute_all([(p.meta, p.draft_input) for p in plans])[k]

            progressed += rank.isolate(plan.requests, run, is_request_error)
        return progressed + self._take_failed()

    def fail_all(self, message: str) -> list[Request]:
        return [r for rank in self.ranks for r in rank.fail_all(message)]

    def resync(self) -> None:
        """Refill restarted runners: re-prefill every running request on every rank."""
        plans = [rank.plan_resync() for rank in self.ranks]
        results = self.executor.execute_all([(p.meta, p.draft_input) for p in plans])
        for rank, plan, (_, draft_input) in zip(self.ranks, plans, results):
            rank.commit_resync(plan, draft_input)
