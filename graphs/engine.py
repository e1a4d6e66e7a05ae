"""The offline engine: tokenization, chat templates, and driving the scheduler."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from actors.request import RequestOutput
from actors.scheduler import Scheduler
from graphs.chat_ids import ReplyIds, encode_chat, reply_ids_of
from graphs.config import EngineConfig
from spec.sampling import SamplingParams

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


def refused_output(prompt_ids: list[int], exc: Exception) -> RequestOutput:
    """The output of a request the engine refused to queue."""
    return RequestOutput(request_id=-1, token_ids=[], text="", finish_reason="error",
                         num_prompt_tokens=len(prompt_ids), num_output_tokens=0, num_verify_steps=0, error=str(exc))


def _is_chat(prompt: Prompt | Messages) -> bool:
    return not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], dict)


class Engine:
    """The offline API shared by both backends: prompts, chat templates, generate/chat/stream."""

    def __init__(self, config: EngineConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.replies = ReplyIds(config.reply_ids_tokens) if config.reply_ids_tokens else None

    # ---- prompts --------------------------------------------------------------------

    def encode(self, prompt: Prompt | Messages) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if _is_chat(prompt):
            return self.encode_chat(prompt)  # type: ignore[arg-type]
        return [int(t) for t in prompt]

    def encode_chat(self, messages: Messages) -> list[int]:
        if not messages:
            raise ValueError("messages: must contain at least one message")
        return encode_chat(self.tokenizer, messages, self.replies)

    def remember_reply(self, prompt_ids: list[int], output: RequestOutput) -> None:
        """Keep a finished chat reply's generated ids for the turn that sends its text back."""
        if self.replies is None or output.finish_reason not in ("stop", "length"):
            return
        reply = reply_ids_of(self.tokenizer, output.token_ids, output.text)
        if reply is not None:
            self.replies.remember(prompt_ids, reply, output.text)

    # ---- generation -----------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        return self.generate_each([(p, params) for p in prompts])

    def chat(self, conversations: Sequence[Messages], params: SamplingParams | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        prompts = [self.encode_chat(c) for c in conversations]
        outputs = self._generate_ids([(ids, params) for ids in prompts])
        for ids, output in zip(prompts, outputs):
            self.remember_reply(ids, output)
        return outputs

    def generate_each(self, requests: Sequence[tuple[Prompt | Messages, SamplingParams]],
                      errors_as_outputs: bool = False) -> list[RequestOutput]:
        """Many requests, each with its own sampling parameters, batched together. A request
        the engine refuses (ValueError, e.g. longer than the context) raises, or with
        `errors_as_outputs` comes back alone as an output with finish_reason "error"."""
        prompts = [self.encode(p) for p, _ in requests]
        outputs = self._generate_ids([(ids, params) for ids, (_, params) in zip(prompts, requests)], errors_as_outputs)
        for (prompt, _), ids, output in zip(requests, prompts, outputs):
            if _is_chat(prompt):
                self.remember_reply(ids, output)
        return outputs

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


