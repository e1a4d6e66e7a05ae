"""Scheduler: request queue, continuous batching, KV slot accounting and the step loop.

Each step carries the running batch's decode (draft propose -> target verify -> draft extend)
and, within a token budget, chunks of prompts (the target extends over them from wherever their
KV ends, the draft catches up; a request whose prompt is complete joins the running batch with
its DraftInput row), both in one forward (a mixed step, as vLLM V1 and Sarathi-Serve run them);
a step with nothing running is a prefill step, one with no prompt waiting a decode step.
Every phase runs every step; the one with no work gets an idle input from `spec/`, exactly
as the compiled Ray graph will run it. The executor that runs a step is pluggable: local
calls in one process, or a Ray compiled graph.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from actors.cost_model import TreeSizePolicy
from actors.prefix_cache import PrefixCache
from actors.request import IncrementalDetokenizer, Request
from actors.slots import SlotAllocator
from spec.algorithm import SpecAlgorithm
from spec.batch import BatchMeta, DraftExtendInput, DraftInput
from spec.sampling import SamplingParams
from spec.shapes import HiddenStateSpec

log = logging.getLogger(__name__)

# In "shortest" prefill order, a prompt overtaken in this many steps (prompts that arrived after it
# prefilled while it got no chunk) goes first: a long prompt waits at most this many steps of shorter
# prompts' chunks beyond what arrival order would make it wait.
MAX_PASSED_OVER = 4


@dataclass
class StepPlan:
    """One step's inputs for one rank, and what the scheduler must remember to commit it."""

    kind: str  # "prefill" | "decode" | "mixed" | "resync" | "idle"
    requests: list[Request]
    meta: BatchMeta
    draft_input: DraftInput
    rows: list[int] | None = None  # decode of these running rows only (isolating a failure); None: all
    admitted: list[Request] = field(default_factory=list)  # prefill: requests it took off the queue
    # mixed: its decode plan and prefill plan; their metas merged, decode rows first, are `meta`
    parts: tuple["StepPlan", "StepPlan"] | None = None


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
    max_num_batched_tokens: int  # tokens one prefill step carries (chunked prefill)
    max_model_len: int
    prefix_cache: bool = True
    short_prefill_tokens: int = 0  # prompts this short (after the cache) prefill ahead of the decode (EngineConfig)
    prefill_order: str = "fcfs"  # or "shortest": which prompts take a step's token budget first (EngineConfig)
    needs_history: bool = False  # decode steps carry each request's tokens (prompt lookup)
    vocab_size: int | None = None  # the target's (token ids in sampling parameters stay below it)
    draft_depth: int = 0  # draft tokens on a full tree's deepest path (EngineConfig.tree_depth; 0: none)
    draft_levels: int | None = None  # of them, the draft's own levels (num_steps; a prompt-lookup branch
    # reaches deeper); None: all of them
    # Each decode step's tree size: chosen from measured costs and acceptance (actors.cost_model),
    # or (False) the full tree; verify_budget and disable_by_batch_size cap it either way.
    adaptive: bool = True
    verify_budget: int | None = None
    disable_by_batch_size: int | None = None


@dataclass
class SchedulerStats:
    """Counters for /metrics (plain numbers, summed over ranks)."""

    preemptions: int = 0  # requests freed and requeued to make room
    step_tokens: int = 0  # tokens the last step carried (prefill chunk tokens, or decode verify rows)
    queue_wait_s: float = 0.0  # arrival to first admission, summed over admitted requests
    admitted: int = 0


class Scheduler:
    """Requests move waiting -> prefilling -> running. A step decodes the running batch and
    prefills prompt chunks in what its verify rows leave of `max_num_batched_tokens`, in one
    forward, so a long prompt prefills over several steps while the running requests keep
    decoding at every step. KV is allocated as requests grow; when the pool runs short the newest
    request is preempted (its KV goes to the prefix cache or the pool, it waits at the front of the
    queue and is recomputed), so nothing is reserved up front and no big request blocks admission."""

    def __init__(self, config: SchedulerConfig, executor: StepExecutor, tokenizer, eos_ids: set[int]):
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.slots = SlotAllocator(config.kv_slots)
        self.cache = PrefixCache(self.slots.free) if config.prefix_cache else None
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, their prompt KV partly written (chunks)
        self.running: list[Request] = []
        self.draft_input = self._idle_draft_input()
        self.stats = SchedulerStats()
        self._inflight: StepPlan | None = None  # planned, not yet committed
        self._failed: list[Request] = []  # failed outside a step's own requests, not yet reported
        self._after_short_prefill = False  # the last step was a short prefill ahead of the running batch
        # The same tensor objects step after step wherever the values are the same: the Ray hop then
        # sends a reference to what the actor already holds (actors.step_stream). Never written in place.
        self._request_fields: tuple[tuple[Request, ...], dict[str, torch.Tensor]] = ((), {})
        self._constants: dict[tuple, torch.Tensor] = {}
        self._next_rid = 0
        self._admissions = itertools.count()
        self._rng = random.SystemRandom()
        self.vocab_size = config.vocab_size or len(tokenizer)
        self.policy = TreeSizePolicy(config.tree_size, config.draft_depth, config.adaptive,
                                     config.verify_budget, config.disable_by_batch_size,
                                     draft_levels=config.draft_levels)

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
        # Nothing is reserved; a request whose full length would not fit even alone can never finish.
        need = len(prompt_ids) + request.max_new_tokens + 2 * self.per_step_slots
        if need > self.config.kv_slots:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens plus max_tokens {params.max_tokens} need "
                f"{need} KV slots, more than the pool's {self.config.kv_slots}"
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
        for request in self.prefilling:
            if request.rid == rid:
                request.finish_reason = "abort"
                self.prefilling.remove(request)
                self._drop_kv(request)
                return True
        for i, request in enumerate(self.running):
            if request.rid == rid:
                request.finish_reason = "abort"
                self._retire([i])
                return True
        return False

    def find(self, rid: int) -> Request:
        for request in (*self.waiting, *self.prefilling, *self.running):
            if request.rid == rid:
                return request
        raise KeyError(f"request {rid} is not queued or running")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_free_slots(self) -> int:
        """Slots free for new KV: the pool's plus the cached ones no request uses (evictable)."""
        return self.slots.num_free + self._evictable

    @property
    def _evictable(self) -> int:
        return 0 if self.cache is None else self.cache.num_evictable

    @property
    def num_cached_slots(self) -> int:
        return 0 if self.cache is None else self.cache.num_cached

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
        """Choose this step's work and allocate its KV slots: prefill chunks, a decode of the
        running batch, or an idle step (inputs from spec/). A request that cannot be planned
        (alone) fails alone; the step goes on without it."""
        prefill = self._prefill_work()
        try:
            if self.running:
                plan = self._plan_prefill() if prefill and self._short_prefill_first() else None
                if plan is None:
                    plan = self._plan_decode()
                    plan = self._with_chunks(plan) if prefill else plan
            else:
                plan = self._plan_prefill() if prefill else None
            if plan is None and self.prefilling and not self.running:
                self._preempt_newest()  # partial prompts hold the pool and none can grow: requeue one
                return self.plan()
            self._inflight = plan or self.idle_plan()
        except Exception:  # noqa: BLE001 - _plan_* undid their allocations
            bad = self._unplannable(list(self.running) + (self.prefilling + list(self.waiting) if prefill else []))
            if not bad:
                raise
            for request, exc in bad:
                self.fail_request(request, exc)
            return self.plan()
        self.stats.step_tokens = self._step_tokens(self._inflight)
        self._after_short_prefill = self._inflight.kind == "prefill" and bool(self.running)
        return self._inflight

    def _short_prefill_first(self) -> bool:
        """Whether the prompts to prefill next (partly prefilled ones, then the ones admission would
        take) need at most `short_prefill_tokens` forward tokens in all, prefix-cache hits left out:
        they then run in a step of their own before the running batch's decode. Never twice in a
        row, so a stream of short prompts cannot stall the running requests; never where the running
        batch decodes plain: there the decode step is short, and a step of their own would cost
        every running request a whole step (the weights read once more) to spare the new ones a
        few rows (docs/benchmarks.md "Session 18"); elsewhere only where the policy finds that the
        wait it spares the new prompts outweighs the delay it costs the running requests
        (`TreeSizePolicy.prefill_ahead_pays`: one or two running requests, not dozens)."""
        limit = min(self.config.short_prefill_tokens, self.config.max_num_batched_tokens)  # one step: done
        if limit <= 0 or self._after_short_prefill:
            return False
        need = sum(r.kv_len - len(r.slots) for r in self.prefilling)
        prompts = len(self.prefilling)
        room = self.config.max_running_requests - len(self.running) - len(self.prefilling)
        for request in list(self.waiting)[: max(room, 0)]:
            if need > limit:
                break
            need += self._uncached(request)
            prompts += 1
        if not 0 < need <= limit:
            return False
        # The policy's rates last: dearest.
        return not self._joins_plain_load() and self.policy.prefill_ahead_pays(
            [r.rid for r in self.running], sum(r.seq_len for r in self.running), prompts)

    def _cached_prefix(self, request: Request):
        """The prefix cache's longest match for the request's KV tokens: (node, slots); at least its last
        token is left to compute (its logits, and the draft's input there, come from that forward)."""
        tokens, known_next = request.kv_tokens()
        return self.cache.match(tokens + ([known_next] if known_next >= 0 else []), len(tokens) - 1)

    def _uncached(self, request: Request) -> int:
        """Tokens a waiting request's prefill would compute now, beyond the prefix cache."""
        return request.kv_len - (0 if self.cache is None else len(self._cached_prefix(request)[1]))

    def _prefill_order(self) -> list[Request]:
        """The prompts a step may prefill, in the order they take its token budget. "fcfs": the partly
        prefilled ones oldest first, then the queue. "shortest": the fewest tokens left to compute first
        (a waiting prompt counted beyond the prefix cache when first ordered), so a short prompt's first
        token does not wait for a long prompt's whole prefill; preempted requests (resumed before newer
        ones) and prompts overtaken in `MAX_PASSED_OVER` steps go first, oldest first, so none starves."""
        if self.config.prefill_order == "fcfs":
            return list(self.prefilling) + list(self.waiting)
        for request in self.waiting:
            if request.prefill_estimate is None:
                request.prefill_estimate = self._uncached(request)
        left = {id(r): r.kv_len - len(r.slots) for r in self.prefilling}

        def key(r: Request) -> tuple:
            if self._overdue(r):
                return (0, r.arrival)
            return (1, left.get(id(r), r.prefill_estimate), r.arrival)

        return sorted([*self.prefilling, *self.waiting], key=key)

    def _prefill_work(self) -> bool:
        """Prompts to extend: partly prefilled ones, or waiting ones with room to run."""
        room = len(self.running) + len(self.prefilling) < self.config.max_running_requests
        return bool(self.prefilling) or (bool(self.waiting) and room)

    def _with_chunks(self, decode: "StepPlan") -> "StepPlan":
        """The decode step plus prompt chunks in what its verify rows leave of the token budget:
        one mixed step. At least a quarter of the budget goes to the chunks, so that a large
        running batch cannot hold the queue back."""
        budget = self.config.max_num_batched_tokens
        budget = max(budget - int(decode.meta.verify_slots.numel()), -(-budget // 4))
        try:
            prefill = self._plan_prefill(budget=budget)
        except Exception:
            self._release(decode)
            raise
        if prefill is None:
            return decode
        return StepPlan("mixed", decode.requests + prefill.requests, decode.meta.merge(prefill.meta),
                        decode.draft_input, admitted=prefill.admitted, parts=(decode, prefill))

    @staticmethod
    def _step_tokens(plan: "StepPlan") -> int:
        if plan.parts is not None:
            return sum(Scheduler._step_tokens(part) for part in plan.parts)
        if plan.kind == "prefill":
            return int(plan.meta.prefill_lens.sum())
        return int(plan.meta.verify_slots.numel())

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
        """A step of `request` alone: its next prefill chunk when it waits or prefills, else a
        decode of its row."""
        if any(r is request for r in self.running):
            self._inflight = self._plan_decode([next(i for i, r in enumerate(self.running) if r is request)])
        else:
            plan = self._plan_prefill(only=request)
            if plan is None:
                raise RuntimeError(f"KV pool exhausted: no room for request {request.rid}'s prefill")
            self._inflight = plan
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
        """End one request with an error wherever it is (queued, prefilling or running) and free its slots."""
        request.fail(f"{type(exc).__name__}: {exc}")
        if any(r is request for r in self.waiting):
            self.waiting.remove(request)
        if any(r is request for r in self.prefilling):
            self.prefilling.remove(request)
            self._drop_kv(request)
        self._retire([i for i, r in enumerate(self.running) if r is request])
        self._failed.append(request)

    def commit(self, plan: "StepPlan", ext: DraftExtendInput, draft_input: DraftInput,
               seconds: float | None = None) -> list[Request]:
        """Apply a step's results: append tokens, keep accepted KV slots, free the rest. A
        request whose tokens raise ends with an error alone (retired with the finished).
        `seconds`: the step's wall time (the tree-size policy learns from decode steps)."""
        self._inflight = None
        self.policy.observe_catch_up(ext.catch_up_tokens, ext.catch_up_s)
        if plan.kind == "prefill":
            progressed = self._commit_prefill(plan, ext, draft_input)
        elif plan.kind == "mixed":
            decode, prefill = plan.parts
            first, rest = torch.arange(decode.meta.num_requests), torch.arange(decode.meta.num_requests,
                                                                               plan.meta.num_requests)
            self._commit_decode(decode, ext.filter(first), draft_input.filter(first))
            # Its time is the chunks' too: the tree-size policy learns step costs from decode steps alone.
            self._observe_decode(decode, ext.filter(first), None)
            progressed = list(decode.requests) + self._commit_prefill(prefill, ext.filter(rest),
                                                                      draft_input.filter(rest))
        elif plan.kind == "decode":
            progressed = list(plan.requests)
            self._commit_decode(plan, ext, draft_input)
            self._observe_decode(plan, ext, seconds)
        else:
            progressed = []
        self._retire_finished()
        return progressed

    def _commit_prefill(self, plan: "StepPlan", ext: DraftExtendInput, draft_input: DraftInput) -> list[Request]:
        """Chunks join their requests' KV; requests whose prompt is complete start running with
        their first token (a recomputed request already has it) and their DraftInput row."""
        done = []
        for b, (request, n, deferred) in enumerate(zip(plan.requests, plan.meta.prefill_lens.tolist(),
                                                       plan.meta.defer_draft.tolist())):
            tokens, _ = request.kv_tokens()
            request.slots.extend(plan.meta.prefill_slots[b, :n].tolist())
            if deferred:  # its draft extend waits for the next tree that drafts for it
                self.policy.deferred(request.rid, n)
            else:  # the draft extended over the chunk and anything that waited before it
                self.policy.caught_up(request.rid)
            if len(request.slots) == len(tokens):
                done.append(b)
        new_tokens, new_logprobs = ext.new_token_ids(), ext.new_logprobs()
        for b in done:
            request = plan.requests[b]
            self.prefilling.remove(request)
            if not request.output_ids:
                request.num_verify_steps += 1
                self._append(request, new_tokens[b], new_logprobs[b])
            self.running.append(request)
        self.draft_input = self.draft_input.merge(draft_input.filter(done))
        return [plan.requests[b] for b in done]

    def _commit_decode(self, plan: "StepPlan", ext: DraftExtendInput, draft_input: DraftInput) -> None:
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

    @staticmethod
    def _append(request: Request, tokens: list[int], logprobs: list | None) -> None:
        try:
            request.append_tokens(tokens, logprobs)
        except Exception as exc:  # noqa: BLE001 - e.g. its detokenizer or stop rules raising
            log.warning("request %s failed committing its tokens: %s", request.rid, exc)
            request.fail(f"{type(exc).__name__}: {exc}")

    # ---- KV on demand ---------------------------------------------------------------

    def _alloc(self, n: int) -> torch.Tensor:
        """n slots from the pool, evicting unused cached prefixes first when it is short: a
        sixteenth of the pool at least, as an eviction walks the whole tree."""
        if n > self.slots.num_free and self.cache is not None:
            self.cache.evict(max(n - self.slots.num_free, self.config.kv_slots // 16))
        return self.slots.alloc(n)

    def _admit(self, request: Request) -> None:
        """Take the longest cached prefix of the request's tokens (`_cached_prefix`)."""
        request.admit_seq = next(self._admissions)
        if self.cache is None:
            return
        node, slots = self._cached_prefix(request)
        self.cache.lock(node)
        request.cache_node, request.slots, request.num_cached = node, slots, len(slots)
        self.cache.query_tokens += request.kv_len
        self.cache.hit_tokens += len(slots)

    def _drop_kv(self, request: Request, keep: bool = False) -> None:
        """Give back a request's KV. With `keep` (its committed tokens are final, e.g. finished
        or preempted) the positions go to the prefix cache; the slots it does not take (cached
        already, or past the last token known to follow) go to the pool."""
        own = request.slots[request.num_cached :]
        if self.cache is not None:
            if keep:
                known = request.prompt_ids + request.output_ids
                n = min(len(request.slots), len(known) - 1)
                own = self.cache.insert(known, request.slots[:n]) + request.slots[n:]
            if request.cache_node is not None:
                self.cache.unlock(request.cache_node)
        self.slots.free(own)
        request.slots, request.num_cached, request.cache_node = [], 0, None

    def _preempt_newest(self) -> None:
        """Requeue the most recently admitted running or prefilling request at the front of the
        queue (before every newer request), its KV given back: it is recomputed when resumed."""
        victim = max(self.running + self.prefilling, key=lambda r: r.admit_seq)
        if any(r is victim for r in self.prefilling):
            self.prefilling.remove(victim)
        else:
            row = next(i for i, r in enumerate(self.running) if r is victim)
            self.running.pop(row)
            self.draft_input = self.draft_input.filter([i for i in range(len(self.running) + 1) if i != row])
        self._drop_kv(victim, keep=True)
        victim.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)
        log.info("preempted request %s (KV pool short)", victim.rid)

    def _room(self) -> int:
        """Slots a prefill may take: free and evictable ones, less the running batch's next decode step."""
        return self.num_free_slots - self.per_step_slots * len(self.running)

    # ---- planning -------------------------------------------------------------------

    def _sampling_fields(self, requests: list[Request], decode: bool = False) -> dict[str, torch.Tensor]:
        """Every per-request sampling input of BatchMeta but the history (see spec.batch): the two that
        move with a request's output every step, and those fixed for its life, which a decode step
        (`decode`) builds once for its requests and reuses while they stay the running batch."""
        if not decode:
            fixed = self._fixed_fields(requests)
        else:
            key, fixed = self._request_fields
            if len(key) != len(requests) or any(a is not b for a, b in zip(key, requests)):
                fixed = self._fixed_fields(requests)
                self._request_fields = (tuple(requests), fixed)
        # Stop ids only matter while min_tokens holds them back (then the processors stay off).
        stops = [r.stop_ids if len(r.output_ids) < r.params.min_tokens else [] for r in requests]
        return dict(fixed, num_output=torch.tensor([len(r.output_ids) for r in requests], dtype=torch.long),
                    stop_ids=self._padded(stops, -1) if any(stops) else self._constant("no_ids", len(requests)))

    def _fixed_fields(self, requests: list[Request]) -> dict[str, torch.Tensor]:
        """The sampling inputs fixed for a request's life, (B,) or (B, K) each."""
        floats = lambda name: torch.tensor([float(getattr(r.params, name)) for r in requests])  # noqa: E731
        longs = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
        return dict(
            temperature=floats("temperature"), top_p=floats("top_p"), min_p=floats("min_p"),
            top_k=longs([int(r.params.top_k) for r in requests]), seeds=longs([r.seed for r in requests]),
            prompt_lens=longs([len(r.prompt_ids) for r in requests]),
            min_tokens=longs([r.params.min_tokens for r in requests]),
            repetition_penalty=floats("repetition_penalty"), presence_penalty=floats("presence_penalty"),
            frequency_penalty=floats("frequency_penalty"),
            bias_ids=self._padded([list(r.params.logit_bias) for r in requests], -1),
            bias_values=self._padded([list(r.params.logit_bias.values()) for r in requests], 0,
                                     torch.float32),
            num_logprobs=longs([-1 if r.params.logprobs is None else r.params.logprobs for r in requests]),
        )

    _CONSTANT_COLUMNS = {
        "zeros": lambda b: torch.zeros(b, dtype=torch.long),  # (B,)
        "no_next": lambda b: torch.full((b,), -1, dtype=torch.long),  # (B,): no known next token
        "no_ids": lambda b: torch.zeros((b, 0), dtype=torch.long),  # (B, 0)
        "no_defer": lambda b: torch.zeros(b, dtype=torch.bool),  # (B,)
    }

    def _constant(self, name: str, batch: int) -> torch.Tensor:
        """A decode step's column that is the same for every batch of `batch` requests, built once."""
        value = self._constants.get((name, batch))
        if value is None:
            value = self._constants[(name, batch)] = self._CONSTANT_COLUMNS[name](batch)
        return value

    @staticmethod
    def _padded(rows: list[list], pad, dtype: torch.dtype = torch.long) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        out = torch.full((len(rows), width), pad, dtype=dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
        return out

    def _history(self, requests: list[Request], drafts: bool = True) -> torch.Tensor:
        """(B, Lh) prompt + output per request, padded with -1, where a drafter (`drafts`: a step that
        drafts; a plain step's drafter reads nothing) or a penalty reads it; else (B, 0)."""
        if (drafts and self.config.needs_history) or any(r.params.uses_history for r in requests):
            return self._padded([r.prompt_ids + r.output_ids for r in requests], -1)
        return self._constant("no_ids", len(requests))

    def _prefill_meta(self, requests: list[Request], starts: list[int], lens: list[int], slots: list[list[int]]
                      ) -> BatchMeta:
        """Extend each request's KV over tokens starts[b]:starts[b] + lens[b] of its kv_tokens()
        into `slots[b]`, after the request.slots[:starts[b]] already there. The token after a
        chunk is known (the next prompt token, or a recomputed request's last output token) but
        at the end of a new prompt, where the target samples it."""
        chunks, next_token = [], []
        for request, start, n in zip(requests, starts, lens):
            tokens, known_next = request.kv_tokens()
            chunks.append(tokens[start : start + n])
            next_token.append(tokens[start + n] if start + n < len(tokens) else known_next)
        empty = torch.zeros((len(requests), 0), dtype=torch.long)
        return BatchMeta(
            seq_lens=torch.tensor(starts, dtype=torch.long),
            kv_slots=self._padded([r.slots[:s] for r, s in zip(requests, starts)], 0),
            prefill_lens=torch.tensor(lens, dtype=torch.long),
            prefill_tokens=self._padded(chunks, 0), prefill_slots=self._padded(slots, 0),
            next_token=torch.tensor(next_token, dtype=torch.long),
            scratch_slots=empty, verify_slots=empty, history=self._history(requests),
            **self._sampling_fields(requests),
        )

    def _plan_prefill(self, only: Request | None = None, budget: int | None = None) -> "StepPlan | None":
        """Chunks of at most `budget` (max_num_batched_tokens) tokens in all, prompts taken in
        `_prefill_order` (a new request is admitted as it comes up; its whole chunk must fit the pool: it
        does not start by holding a sliver of it). In "shortest" order only a step's first prompt may
        prefill partly: a step that completes prompts carries no chunk of a longer one, which would hold
        back their first tokens for a chunk that yields none; and an overdue prompt, first, takes at
        most half the budget where others wait, so the prompts that arrived since still ride in the
        step rather than wait for its whole prefill (and the ones already prefilling go on partly). A
        chunk that completes its prompt leaves the slots of the request's first decode step
        (`per_step_slots`) free, also of the prompts after it in the step: else that step's planning
        preempts it before it decodes. `only`: that request's next chunk alone
        (isolating a failure). None when nothing fits. On any error the step's slots are freed and its
        admissions undone (nothing leaks)."""
        budget = self.config.max_num_batched_tokens if budget is None else budget
        requests, lens, slots, admitted = [], [], [], []
        reserve = 0 if only is not None else self.per_step_slots * len(self.running)
        shortest = only is None and self.config.prefill_order == "shortest"
        order = [only] if only is not None else self._prefill_order()
        share = max(budget // 2, 1) if shortest and len(order) > 1 else budget
        # A new request whose chunk the pool cannot hold ends admissions for this step: none after it in
        # the order passes it (a preempted request, first in the order, would otherwise be passed by the
        # requests that then fill the pool again, and preempted in turn); partly prefilled ones go on.
        admitting = True
        # Beside an overdue first prompt (at most `share` of the budget) the prompts already prefilling go on
        # partly too: else a preempted one, first again, kept an older prompt from prefilling while it filled
        # the pool itself, was preempted (the newest) when neither could finish, and so on forever.
        overdue_first = False
        try:
            for request in order:
                if budget == 0:
                    break
                fresh = not any(r is request for r in self.prefilling)
                full = len(self.running) + len(self.prefilling) >= self.config.max_running_requests
                if fresh and (not admitting or full):
                    continue
                if fresh:
                    self.waiting.remove(request)
                    self._admit(request)
                    self.prefilling.append(request)
                    admitted.append(request)
                remaining = request.kv_len - len(request.slots)
                room = self.num_free_slots - reserve
                n = min(remaining, budget, room)
                if only is None and n == remaining and room - n < self.per_step_slots:
                    # Completed now, it would have no room for its first decode step, whose planning would
                    # preempt it (the newest) before it decoded; re-admitted onto its cached prefix in that same
                    # step's chunks (overdue), it did so again and again (CI hung so on the real model).
                    n = remaining - 1
                pool_short = n < 1 or (fresh and n < min(remaining, budget))
                if pool_short or (shortest and requests and n < remaining and (fresh or not overdue_first)):
                    if fresh:
                        self._unadmit([admitted.pop()])
                        admitting = admitting and not pool_short
                    continue
                if shortest and not requests and self._overdue(request):
                    n, overdue_first = min(n, share), True
                slots.append(self._alloc(n).tolist())
                requests.append(request)
                lens.append(n)
                budget -= n
                if n == remaining:  # it decodes next step: keep that step's slots from the prompts after it
                    reserve += self.per_step_slots
                if request.queue_wait_s is None:  # its first chunk: admitted and skipped ones are still waiting
                    request.queue_wait_s = time.monotonic() - request.arrival
                    self.stats.queue_wait_s += request.queue_wait_s
                    self.stats.admitted += 1
            if not requests:
                return None
            if shortest:
                self._count_overtaken(order, requests)
            meta = self._prefill_meta(requests, [len(r.slots) for r in requests], lens, slots)
            if self.config.algorithm.needs_draft_model and self._joins_plain_load():
                meta.defer_draft.fill_(True)
        except Exception:
            self.slots.free([s for row in slots for s in row])
            self._unadmit(admitted)
            raise
        return StepPlan("prefill", requests, meta, self._idle_draft_input(), admitted=admitted)

    @staticmethod
    def _overdue(request: Request) -> bool:
        """In "shortest" order: a preempted request, or a prompt overtaken `MAX_PASSED_OVER` times."""
        return bool(request.num_preemptions) or request.passed_over >= MAX_PASSED_OVER

    @staticmethod
    def _count_overtaken(order: list[Request], served: list[Request]) -> None:
        """Each prompt of `order` that gets no chunk while one that arrived after it does was overtaken."""
        chosen = {id(r) for r in served}
        youngest = max(r.arrival for r in served)
        for request in order:
            if id(request) not in chosen and request.arrival < youngest:
                request.passed_over += 1

    def _joins_plain_load(self) -> bool:
        """Whether prompts prefilled now join a load the policy decodes plain (the running and
        prefilling requests, and the waiting ones that fit beside them: a burst of prompts decodes
        together once all are in): their chunks then leave the draft's extend waiting."""
        room = max(0, self.config.max_running_requests - len(self.running) - len(self.prefilling))
        joining = list(self.prefilling) + list(itertools.islice(self.waiting, room))
        batch = len(self.running) + len(joining)
        context = sum(r.seq_len for r in self.running) + sum(r.kv_len for r in joining)
        return self.policy.decodes_plain(batch, context)

    def _plan_decode(self, rows: list[int] | None = None) -> "StepPlan":
        """Decode of the running batch (or of `rows` of it). When the pool cannot hold the
        step's tree and scratch slots, the newest requests are preempted first. Slots are
        allocated last, so a request whose inputs cannot be built leaks nothing. The verify
        slots' width is the step's tree size (the policy's choice), the scratch slots only there
        when it drafts."""
        if rows is None:
            while self.num_free_slots < self.per_step_slots * len(self.running) and len(
                    self.running) + len(self.prefilling) > 1:
                self._preempt_newest()
        requests = list(self.running) if rows is None else [self.running[i] for i in rows]
        batch = len(requests)
        n = self.policy.choose([r.rid for r in requests], sum(r.seq_len for r in requests),
                               sum(r.max_new_tokens - len(r.output_ids) for r in requests) / max(batch, 1))
        s = self.config.scratch_size if n > 1 else 0
        fields = dict(
            seq_lens=torch.tensor([r.seq_len for r in requests], dtype=torch.long),
            kv_slots=self._padded([r.slots for r in requests], 0),
            prefill_lens=self._constant("zeros", batch), prefill_tokens=self._constant("no_ids", batch),
            prefill_slots=self._constant("no_ids", batch), next_token=self._constant("no_next", batch),
            defer_draft=self._constant("no_defer", batch),
            history=self._history(requests, drafts=n > 1), **self._sampling_fields(requests, decode=True),
        )
        scratch = self._alloc(batch * s).view(batch, s)
        try:
            verify = self._alloc(batch * n).view(batch, n)
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
        verified = (int(ext.tree_nodes.max()), int(ext.tree_depths.max())) if ext.num_requests else None
        self.policy.observe([r.rid for r in plan.requests], int(plan.meta.seq_lens.sum()), nodes, seconds,
                            ext.accept_lens.tolist(), verified, ext.accepted_nodes.tolist(), ext.catch_up_s)

    def plan_resync(self) -> "StepPlan":
        """Re-prefill every running request into fresh runners (after an actor restart), the
        same recomputation a preempted request gets (Request.kv_tokens): nothing is sampled
        twice, and the same KV slots are rewritten with the same values. Partly prefilled
        requests go back to the queue and the prefix cache forgets what no request holds:
        the runners' KV of both is gone."""
        self._unadmit(list(self.prefilling))
        if self.cache is not None:
            self.cache.clear()
        requests = list(self.running)
        meta = self._prefill_meta(requests, [0] * len(requests), [len(r.slots) for r in requests],
                                  [r.slots for r in requests])
        return StepPlan("resync", requests, meta, self._idle_draft_input())

    def commit_resync(self, plan: "StepPlan", draft_input: DraftInput) -> None:
        self.draft_input = draft_input
        for request in plan.requests:  # the re-prefill extended their drafts over every token
            self.policy.caught_up(request.rid)

    def release_uncommitted(self) -> "StepPlan | None":
        """Undo the allocations of a planned step that failed (its runners died or raised):
        slots go back to the pool and requests it admitted back to the front of the queue.
        Returns the undone plan."""
        plan, self._inflight = self._inflight, None
        if plan is not None:
            self._release(plan)
        return plan

    def _release(self, plan: "StepPlan") -> None:
        for part in plan.parts or ():
            self._release(part)
        if plan.kind == "decode":
            self.slots.free(plan.meta.scratch_slots.reshape(-1))
            self.slots.free(plan.meta.verify_slots.reshape(-1))
        elif plan.kind == "prefill":
            for b, n in enumerate(plan.meta.prefill_lens.tolist()):
                self.slots.free(plan.meta.prefill_slots[b, :n])
            self._unadmit(plan.admitted)

    def _unadmit(self, requests: list[Request]) -> None:
        """Prefilling requests back to the front of the queue (in order), their KV given back."""
        for request in reversed(requests):
            self.prefilling.remove(request)
            self._drop_kv(request)
            self.waiting.appendleft(request)

    def fail_all(self, message: str) -> list[Request]:
        """End every request with an error (the engine cannot serve them); frees everything."""
        self.release_uncommitted()
        self._unadmit(list(self.prefilling))
        failed = list(self.waiting) + list(self.running)
        for request in failed:
            request.fail(message)
        self.waiting.clear()
        self._retire(list(range(len(self.running))))
        return failed

    def _retire_finished(self) -> None:
        self._retire([i for i, r in enumerate(self.running) if r.finish_reason is not None])

    def _retire(self, rows: list[int]) -> None:
        """Free finished requests' slots (what they computed stays in the prefix cache) and drop
        their rows from the batch state."""
        if not rows:
            return
        for i in rows:
            request = self.running[i]
            self.policy.forget(request.rid)
            self._drop_kv(request, keep=request.finish_reason in ("stop", "length"))
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
        rank = min(self.ranks, key=lambda r: (len(r.running) + len(r.prefilling) + len(r.waiting), -r.num_free_slots))
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

    def load_stats(self) -> dict[str, int]:
        """Serving-under-load counters and gauges summed over ranks (for /metrics)."""
        caches = [r.cache for r in self.ranks if r.cache is not None]
        return {
            "preemptions": sum(r.stats.preemptions for r in self.ranks),
            "step_tokens": sum(r.stats.step_tokens for r in self.ranks),
            "step_token_budget": sum(r.config.max_num_batched_tokens for r in self.ranks),
            "queue_wait_ms": int(1000 * sum(r.stats.queue_wait_s for r in self.ranks)),
            "admitted": sum(r.stats.admitted for r in self.ranks),
            "prefix_hit_tokens": sum(c.hit_tokens for c in caches),
            "prefix_query_tokens": sum(c.query_tokens for c in caches),
            "cached_slots": sum(r.num_cached_slots for r in self.ranks),
        }

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
