"""The offline engine: tokenization, chat templates, and driving the scheduler."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from actors.request import RequestOutput
from actors.scheduler import Scheduler
from graphs.config import EngineConfig
from spec.sampling import SamplingParams

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


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

    def generate_each(self, requests: Sequence[tuple[Prompt | Messages, SamplingParams]]) -> list[RequestOutput]:
        """Many requests, each with its own sampling parameters, batched together."""
        return self._generate_ids([(self.encode(p), params) for p, params in requests])

    def stream(self, prompt: Prompt | Messages, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as steps complete (other requests progress meanwhile)."""
        return self._stream_ids(self.encode(prompt), params or SamplingParams())

    def _generate_ids(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
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

    def _generate_ids(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        requests = [self.scheduler.find(self.scheduler.add_request(ids, params)) for ids, params in requests]
        while any(r.finish_reason is None for r in requests):
            self.scheduler.step()
        return [r.output() for r in requests]

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


