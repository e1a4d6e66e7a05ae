"""Scheduler: request queue, continuous batching, KV slot accounting and the step loop.

Each step is either a prefill step (new requests join: the target extends over their
prompts, the draft catches up, their DraftInput rows are merged into the running batch) or
a decode step (draft propose -> target verify -> draft extend over the running batch).
Every phase runs every step; the one with no work gets an idle input from `spec/`, exactly
as the compiled Ray graph will run it. The executor that runs a step is pluggable: local
calls in one process, or a Ray compiled graph.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from actors.request import IncrementalDetokenizer, Request, RequestOutput
from actors.slots import SlotAllocator
from spec.algorithm import SpecAlgorithm
from spec.batch import BatchMeta, DraftExtendInput, DraftInput
from spec.sampling import SamplingParams
from spec.shapes import HiddenStateSpec


class StepExecutor(Protocol):
    def execute(self, meta: BatchMeta, draft_input: DraftInput) -> tuple[DraftExtendInput, DraftInput]: ...


@dataclass(frozen=True)
class SchedulerConfig:
    algorithm: SpecAlgorithm
    tree_size: int  # verify nodes per request and step (root included)
    scratch_size: int  # draft scratch slots per request and step
    topk_width: int  # columns of DraftInput.topk_* (0 where the draft has not seen the root)
    hidden_spec: HiddenStateSpec | None  # the draft's recurrent hidden state
    kv_slots: int
    max_running_requests: int
    max_prefill_tokens: int
    max_model_len: int


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
        self._next_rid = 0
        self._rng = random.SystemRandom()

    def _idle_draft_input(self) -> DraftInput:
        return DraftInput.create_idle(self.config.hidden_spec, self.config.topk_width)

    @property
    def per_step_slots(self) -> int:
        return self.config.tree_size + self.config.scratch_size

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; raises ValueError for prompts that can never run."""
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens leave no room within max_model_len {limit}")
        rid = self._next_rid
        self._next_rid += 1
        seed = params.seed if params.seed is not None else self._rng.randrange(2**62)
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

    def abort(self, rid: int) -> None:
        for request in list(self.waiting):
            if request.rid == rid:
                self.waiting.remove(request)
                request.finish_reason = "abort"
        for i, request in enumerate(self.running):
            if request.rid == rid:
                request.finish_reason = "abort"
                self._retire([i])
                return

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
        """Run one step; returns the requests that made progress (finished ones included)."""
        admitted = self._admit()
        if admitted:
            return self._prefill(admitted)
        if self.running:
            return self._decode()
        return []

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
        return dict(
            temperature=torch.tensor([float(r.params.temperature) for r in requests]),
            top_p=torch.tensor([float(r.params.top_p) for r in requests]),
            top_k=torch.tensor([int(r.params.top_k) for r in requests], dtype=torch.long),
            seeds=torch.tensor([r.seed for r in requests], dtype=torch.long),
        )

    @staticmethod
    def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        out = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out

    def _prefill(self, requests: list[Request]) -> list[Request]:
        batch = len(requests)
        prompt_slots = [self.slots.alloc(len(r.prompt_ids)) for r in requests]
        meta = BatchMeta(
            seq_lens=torch.zeros(batch, dtype=torch.long),
            kv_slots=torch.zeros((batch, 0), dtype=torch.long),
            prefill_lens=torch.tensor([len(r.prompt_ids) for r in requests], dtype=torch.long),
            prefill_tokens=self._padded([r.prompt_ids for r in requests], 0),
            prefill_slots=self._padded([s.tolist() for s in prompt_slots], 0),
            next_token=torch.full((batch,), -1, dtype=torch.long),
            scratch_slots=torch.zeros((batch, 0), dtype=torch.long),
            verify_slots=torch.zeros((batch, 0), dtype=torch.long),
            history=torch.zeros((batch, 0), dtype=torch.long),
            **self._sampling_fields(requests),
        )
        ext, new_draft_input = self.executor.execute(meta, self._idle_draft_input())
        for request, slots, tokens in zip(requests, prompt_slots, ext.new_token_ids()):
            request.slots = slots.tolist()
            request.num_verify_steps += 1
            request.append_tokens(tokens)
        self.running.extend(requests)
        self.draft_input = self.draft_input.merge(new_draft_input)
        self._retire_finished()
        return requests

    def _decode(self) -> list[Request]:
        requests = self.running
        batch, n, s = len(requests), self.config.tree_size, self.config.scratch_size
        verify_slots = self.slots.alloc(batch * n).view(batch, n)
        scratch_slots = self.slots.alloc(batch * s).view(batch, s)
        history = (
            self._padded([r.prompt_ids + r.output_ids for r in requests], -1)
            if self.config.algorithm is SpecAlgorithm.NGRAM else torch.zeros((batch, 0), dtype=torch.long)
        )
        meta = BatchMeta(
            seq_lens=torch.tensor([r.seq_len for r in requests], dtype=torch.long),
            kv_slots=self._padded([r.slots for r in requests], 0),
            prefill_lens=torch.zeros(batch, dtype=torch.long),
            prefill_tokens=torch.zeros((batch, 0), dtype=torch.long),
            prefill_slots=torch.zeros((batch, 0), dtype=torch.long),
            next_token=torch.full((batch,), -1, dtype=torch.long),
            scratch_slots=scratch_slots, verify_slots=verify_slots, history=history,
            **self._sampling_fields(requests),
        )
        ext, self.draft_input = self.executor.execute(meta, self.draft_input)
        self.slots.free(scratch_slots.reshape(-1))
        committed = torch.split(ext.slots, ext.extend_lens.tolist())
        for b, (request, kept, tokens) in enumerate(zip(requests, committed, ext.new_token_ids())):
            keep = set(kept.tolist())
            self.slots.free([x for x in verify_slots[b].tolist() if x not in keep])
            request.slots.extend(kept.tolist())
            request.num_verify_steps += 1
            request.accept_lens.append(len(tokens) - 1)
            request.append_tokens(tokens)
        self._retire_finished()
        return list(requests)

    def _retire_finished(self) -> None:
        self._retire([i for i, r in enumerate(self.running) if r.finish_reason is not None])

    def _retire(self, rows: list[int]) -> None:
        """Free finished requests' slots and drop their rows from the batch state."""
        if not rows:
            return
        for i in rows:
            request = self.running[i]
            self.slots.free(request.slots)
            request.slots = []
            self.reserved -= request.reserved
        keep = [i for i in range(len(self.running)) if i not in set(rows)]
        self.running = [self.running[i] for i in keep]
        self.draft_input = self.draft_input.filter(keep)

    def outputs_of(self, requests: list[Request]) -> list[RequestOutput]:
        return [r.output() for r in requests]
