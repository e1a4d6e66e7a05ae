"""One request's state: tokens, KV slots, incremental detokenization and stop rules."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from spec.sampling import SamplingParams


class IncrementalDetokenizer:
    """Emits text as tokens arrive, never half a UTF-8 character: text is released only
    once the decoded tail no longer ends in U+FFFD (an incomplete byte sequence).

    The rule (vLLM's) decodes a window twice per token. For a fast tokenizer the same rule runs
    in Rust (`tokenizers.decoders.DecodeStream`, one call a token: 1.1 against 7.7 us a token
    here, and per step that is every running request's tokens); the offsets below follow its
    releases, so `flush` (a request's end, where a partial character is released too) and a
    stream that fails its prefix check fall back to the Python rule exactly where it left off."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # A tokenizer that cleans up spaces in `decode` would release other text from Rust.
        plain = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True) if plain else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int, final: bool = False) -> str:
        self.tokens.append(token)
        if final:
            return self.flush()
        if self._stream is None:
            return self._advance(allow_partial=False)
        try:
            text = self._stream.step(self._backend, token)
        except Exception:  # noqa: BLE001 - its prefix check failed on this text: the Python rule from here
            self._stream = None
            return self._advance(allow_partial=False)
        if text is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text

    def flush(self) -> str:
        return self._advance(allow_partial=True)

    def _advance(self, allow_partial: bool) -> str:
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not allow_partial):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return new_text[len(prefix_text) :]


@dataclass
class RequestOutput:
    """The result (or the progress so far) of one request."""

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    num_prompt_tokens: int
    num_output_tokens: int
    num_verify_steps: int
    accept_lens: list[int] = field(default_factory=list)  # accepted draft tokens per verify step
    draft_depths: list[int] = field(default_factory=list)  # draft levels verified per decode step (0: plain)
    error: str | None = None
    # Per output token where asked (SamplingParams.logprobs): (raw logprob, [(top id, logprob), ...]).
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def acceptance_length(self) -> float:
        return self.num_output_tokens / max(1, self.num_verify_steps)


class Request:
    def __init__(self, rid: int, prompt_ids: list[int], params: SamplingParams, seed: int,
                 detokenizer: IncrementalDetokenizer, eos_ids: set[int], max_model_len: int):
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed
        self.detok = detokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.output_ids: list[int] = []
        self.slots: list[int] = []  # committed KV slots, one per token in the KV cache
        self._text = ""  # the text of the first `_detokenized` output tokens (see `text`)
        self._detokenized = 0
        self.emitted = 0  # chars of `text` handed out as stream deltas
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_verify_steps = 0
        self.accept_lens: list[int] = []
        self.draft_depths: list[int] = []  # per decode step: draft levels its tree could reach (0: plain)
        # KV on demand: the prefix cache owns the first `num_cached` slots (held through
        # `cache_node`), the request the rest; a preempted request holds none and recomputes.
        self.num_cached = 0
        self.cache_node = None
        self.admit_seq = -1  # admission order (the newest running request is preempted first)
        self.num_preemptions = 0
        self.arrival = time.monotonic()
        self.queue_wait_s: float | None = None  # arrival to first admission
        # Shortest-prefill-first order (`Scheduler._prefill_order`): the tokens its prefill was expected
        # to compute beyond the prefix cache when first ordered, and the steps in which prompts that
        # arrived after it prefilled while it got nothing.
        self.prefill_estimate: int | None = None
        self.passed_over = 0
        self.stop_ids = params.stop_ids(eos_ids)  # ids that end the output (EOS unless ignored, stop_token_ids)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.logprobs_emitted = 0  # entries of `logprobs` handed out with stream deltas

    @property
    def seq_len(self) -> int:
        return len(self.slots)

    def kv_tokens(self) -> tuple[list[int], int]:
        """The tokens a (re-)prefill writes to the KV cache and the known token after them
        (-1: the prefill samples it). With output, that is prompt + output but the last token,
        which is not in the KV (it is the next step's root) and is known, so a recomputed
        request (preempted, or refilled after an actor restart) samples nothing twice."""
        if self.output_ids:
            return self.prompt_ids + self.output_ids[:-1], self.output_ids[-1]
        return self.prompt_ids, -1

    @property
    def kv_len(self) -> int:
        """How many tokens `kv_tokens` holds (without building the list)."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def max_new_tokens(self) -> int:
        return min(self.params.max_tokens, self.max_model_len - len(self.prompt_ids))

    @property
    def text(self) -> str:
        """The full text so far (stop strings already cut). Without stop strings no rule reads it while
        the request runs, so it is detokenized when read (a stream's delta, the output): the tokens since
        the last read in one burst, through the same incremental rule. Per token after each step, every
        running request's decode met caches the forward had just flushed: ~85 us a request a step at 64
        requests here, against ~1-2 us a token in a burst (docs/benchmarks.md, session 23)."""
        for i in range(self._detokenized, len(self.output_ids)):
            # A stop id's text is left out; at the length limit a partial character is released too.
            stop_id, at_limit = self._ends_at(i)
            self._text += self.detok.flush() if stop_id else self.detok.add(self.output_ids[i], final=at_limit)
        self._detokenized = len(self.output_ids)
        return self._text

    def _ends_at(self, i: int) -> tuple[bool, bool]:
        """Whether output token i is a stop id (once min_tokens are out), and whether it reaches the
        length limit: what ends the request there, and how its text ends."""
        return i + 1 > self.params.min_tokens and self.output_ids[i] in self.stop_ids, i + 1 >= self.max_new_tokens

    def append_tokens(self, tokens: list[int], logprobs: list | None = None) -> None:
        """Append verified tokens one by one, stopping at EOS or a stop id (its text left out),
        a stop string, max_tokens or the context length; tokens after the stop are dropped.
        No stop applies before min_tokens output tokens (vLLM). Text is made as each token comes only
        where stop strings need it (`text`)."""
        stops = self.params.stop
        for i, token in enumerate(tokens):
            before = len(self.text) if stops else 0  # the text before this token
            self.output_ids.append(token)
            if self.params.logprobs is not None and logprobs is not None:
                lp, top = logprobs[i]
                self.logprobs.append((lp, top[: self.params.logprobs]))
            is_stop_id, at_limit = self._ends_at(len(self.output_ids) - 1)
            if stops and len(self.output_ids) > self.params.min_tokens:
                window = self.text[max(0, before - max(map(len, stops)) + 1) :]
                hits = [window.find(s) for s in stops if s in window]
                if hits:
                    self._text = self._text[: len(self._text) - len(window) + min(hits)]
                    self.finish_reason = "stop"
                    return
            if is_stop_id:
                self.finish_reason = "stop"
                return
            if at_limit:
                self.finish_reason = "length"
                return

    def take_logprobs(self) -> list[tuple[int, float, list[tuple[int, float]]]] | None:
        """(token id, logprob, top) of the tokens committed since the last call (stream deltas);
        None where the request asked for no logprobs."""
        if self.params.logprobs is None:
            return None
        start, self.logprobs_emitted = self.logprobs_emitted, len(self.logprobs)
        return [(self.output_ids[i], lp, top) for i, (lp, top) in enumerate(self.logprobs[start:], start)]

    def fail(self, error: str) -> None:
        """End with finish_reason "error" (the scheduler frees its slots)."""
        self.finish_reason, self.error = "error", error

    def take_delta(self) -> str:
        """New text since the last call; holds back a possible stop-string prefix until the
        request finishes, so streamed text never shows part of a stop string."""
        hold = 0 if self.finish_reason or not self.params.stop else max(map(len, self.params.stop)) - 1
        end = max(self.emitted, len(self.text) - hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.rid, token_ids=list(self.output_ids), text=self.text,
            finish_reason=self.finish_reason, num_prompt_tokens=len(self.prompt_ids),
            num_output_tokens=len(self.output_ids), num_verify_steps=self.num_verify_steps,
            accept_lens=list(self.accept_lens), draft_depths=list(self.draft_depths), error=self.error,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
        )
