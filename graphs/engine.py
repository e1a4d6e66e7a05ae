"""The offline engine: tokenization, chat templates, and driving the scheduler."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from actors.request import RequestOutput
from actors.scheduler import Scheduler
from graphs.config import EngineConfig
from spec.sampling import SamplingParams

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


def refused_output(prompt_ids: list[int], exc: Exception) -> RequestOutput:
    """The output of a request the engine refused to queue."""
    return RequestOutput(request_id=-1, token_ids=[], text="", finish_reason="error",
                         num_prompt_tokens=len(prompt_ids), num_output_tokens=0, num_verify_steps=0, error=str(exc))


class Engine:
    """The offline API shared by both backends: prompts, chat templates, generate/chat/stream."""

    def __init__(self, config: EngineConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer

    # ---- prompts --------------------------------------------------------------------

    def encode(self, prompt: Prompt | Messages) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if prompt and isinstance(prompt[0], dict):
            return self.encode_chat(prompt)  # type: ignore[arg-type]
        return [int(t) for t in prompt]

    def encode_chat(self, messages: Messages) -> list[int]:
        if not messages:
            raise ValueError("messages: must contain at least one message")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- generation -----------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        return self.generate_each([(p, params) for p in prompts])

    def chat(self, conversations: Sequence[Messages], params: SamplingParams | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        return self._generate_ids([(self.encode_chat(c), params) for c in conversations])

    def generate_each(self, requests: Sequence[tuple[Prompt | Messages, SamplingParams]],
                      errors_as_outputs: bool = False) -> list[RequestOutput]:
        """Many requests, each with its own sampling parameters, batched together. A request
        the engine refuses (ValueError, e.g. longer than the context) raises, or with
        `errors_as_outputs` comes back alone as an output with finish_reason "error"."""
        return self._generate_ids([(self.encode(p), params) for p, params in requests], errors_as_outputs)

    def stream(self, prompt: Prompt | Messages, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as steps complete (other requests progress meanwhile)."""
        return self._stream_ids(self.encode(prompt), params or SamplingParams())

    def _generate_ids(self, requests: list[tuple[list[int], SamplingParams]],
                      errors_as_outputs: bool = False) -> list[RequestOutput]:
        raise NotImplementedError

    def _stream_ids(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release the engine's resources (runners, actors); the engine is unusable afterwards."""


class LocalEngine(Engine):
    """Everything in this process: the caller's thread drives the scheduler."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, tokenizer):
        super().__init__(config, tokenizer)
        self.scheduler = scheduler

    def _generate_ids(self, requests: list[tuple[list[int], SamplingParams]],
                      errors_as_outputs: bool = False) -> list[RequestOutput]:
        queued: list = []
        for ids, params in requests:
            try:
                queued.append(self.scheduler.find(self.scheduler.add_request(ids, params)))
            except ValueError as exc:
                if not errors_as_outputs:
                    for request in queued:  # nothing of a refused batch stays queued
                        self.scheduler.abort(request.rid)
                    raise
                queued.append(refused_output(ids, exc))
        running = [r for r in queued if not isinstance(r, RequestOutput)]
        while any(r.finish_reason is None for r in running):
            self.scheduler.step()
        return [r if isinstance(r, RequestOutput) else r.output() for r in queued]

    def _stream_ids(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        request = self.scheduler.find(self.scheduler.add_request(prompt_ids, params))
        try:
            while request.finish_reason is None:
                self.scheduler.step()
                delta = request.take_delta()
                if delta:
                    yield delta
            tail = request.take_delta()
            if tail:
                yield tail
        finally:
            if request.finish_reason is None:
                self.scheduler.abort(request.rid)


