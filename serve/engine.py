"""The engine deployment: each `SpecEngine` replica owns one actor graph (RayEngine: scheduler,
target and draft actors), reserved with the replica through its placement group bundles."""

import logging
import time
from typing import AsyncIterator

import ray

from graphs.config import EngineConfig
from graphs.metrics import ServeMetrics
from spec.algorithm import SpecAlgorithm
from spec.sampling import SamplingParams
from serve.metrics import MetricsReporter, replica_key
from serve.protocol import APIError, param_of
from serve.settings import ServeSettings

log = logging.getLogger(__name__)


def _cause(exc: BaseException) -> BaseException:
    return getattr(exc, "cause", None) or exc


class SpecEngine:
    """One replica = one actor graph (RayEngine in this replica's placement group)."""

    def __init__(self, engine_kwargs: dict, settings: dict):
        from graphs.ray_graph import RayEngine
        from graphs.assembly import resolve_sources
        from spec.shapes import cfg_get

        self.config = EngineConfig(**engine_kwargs, backend="ray")
        self.settings = ServeSettings(**settings)
        self.engine = RayEngine(self.config)
        info = ray.get(self.engine.scheduler.config_info.remote())
        self.max_model_len = int(info["max_model_len"])
        target, _ = resolve_sources(self.config)
        self.vocab_size = int(cfg_get(target.config, "vocab_size", len(self.engine.tokenizer)))
        self.capacity = self.config.max_running_requests * self.config.dp_size
        self.max_queue = self.settings.max_queue
        self.inflight = 0
        self.waiting = 0  # the scheduler's queue, as last seen
        self._probe, self._probe_at = None, 0.0
        self._token_texts: dict[int, str] = {}  # logprobs' token strings, decoded once
        self.metrics = ServeMetrics()
        if self.config.algorithm is not SpecAlgorithm.NONE:
            self.metrics.set_draft_depth(self.config.tree_depth)
        key, app_name = replica_key()
        self.reporter = MetricsReporter(self.metrics, key, app_name, refresh=self._refresh_stats)

    # ---- admin -----------------------------------------------------------------------

    def reconfigure(self, user_config: dict) -> None:
        if user_config and "max_queue" in user_config:
            self.set_max_queue(int(user_config["max_queue"]))

    def set_max_queue(self, max_queue: int) -> int:
        """Change the queue limit at run time (0 refuses every new request: drain)."""
        old, self.max_queue = self.max_queue, max_queue
        return old

    async def _refresh_stats(self) -> None:
        stats = await self.engine.scheduler.stats.remote()
        self.waiting = stats["waiting"]
        self.metrics.set_engine_stats(stats)

    async def stats(self) -> dict:
        self.reporter.start()
        stats = await self.engine.scheduler.stats.remote()
        return {**stats, "inflight": self.inflight, "max_queue": self.max_queue, "max_model_len": self.max_model_len}

    async def info(self) -> dict:
        return {"max_model_len": self.max_model_len, "algorithm": self.config.algorithm.name,
                "model": self.config.model, "draft_model": self.config.draft_model}

    async def actors(self) -> dict:
        """This replica's actor handles (fault-injection tests, inspection): the replica itself,
        the scheduler, the target actor of every rank (hosting the drafter where it is colocated)
        and the separate draft actors."""
        by_role = await self.engine.scheduler.actors_by_role.remote()
        return {"replica": ray.get_runtime_context().current_actor, "scheduler": self.engine.scheduler, **by_role}

    async def metrics_snapshot(self) -> tuple[str, dict]:
        """(replica key, fresh snapshot): lets /metrics show current gauges of a replica."""
        await self._refresh_stats()
        return self.reporter.key, self.metrics.snapshot()

    async def check_health(self) -> None:
        """Fails when the scheduler actor is dead, its engine broken (restart budget spent,
        step loop stopped) or it has not answered for `health_stall_s`; Serve then replaces
        the replica. The probe never waits for the step lock."""
        self.reporter.start()
        now = time.monotonic()
        if self._probe is None:
            self._probe, self._probe_at = self.engine.scheduler.health.remote(), now
        ready, _ = ray.wait([self._probe], timeout=0)
        if ready:
            probe, self._probe = self._probe, None
            broken = await probe  # raises if the scheduler actor died
            if broken:
                raise RuntimeError(f"engine broken: {broken}")
        elif now - self._probe_at > self.settings.health_stall_s:
            raise RuntimeError(f"engine unresponsive for {now - self._probe_at:.0f} s")

    async def ping(self) -> bool:
        await self.check_health()
        return True

    def __del__(self):
        try:
            self.reporter.retire()
        except Exception:  # noqa: BLE001
            pass
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - the replica is going away regardless
                log.debug("engine shutdown raised", exc_info=True)

    # ---- requests --------------------------------------------------------------------

    def _prepare(self, req: dict) -> tuple[list[int], SamplingParams]:
        try:
            ids = self.engine.encode_chat(req["messages"]) if req["chat"] else self.engine.encode(req["prompt"])
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer refusing the input
            raise APIError(400, f"{'messages' if req['chat'] else 'prompt'}: {exc}",
                           "messages" if req["chat"] else "prompt", "invalid_value") from None
        if self.engine.replies is not None:
            self.metrics.set_replies_reused(self.engine.replies.reused)
        if not req["chat"] and isinstance(req["prompt"], list):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               "prompt", "invalid_value")
        if not ids:
            raise APIError(400, "prompt: must contain at least one token", "prompt", "invalid_value")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"prompt: {len(ids)} tokens leave no room within the model's context length "
                           f"({self.max_model_len} tokens)", "messages" if req["chat"] else "prompt",
                           "context_length_exceeded")
        max_tokens = req["max_tokens"]
        if max_tokens is None:
            max_tokens = min(room, self.settings.default_max_tokens or room)
        elif max_tokens > room:
            raise APIError(400, f"max_tokens: {max_tokens} new tokens plus the prompt's {len(ids)} exceed the "
                           f"model's context length of {self.max_model_len} tokens", "max_tokens",
                           "context_length_exceeded")
        try:
            params = SamplingParams(max_tokens=max_tokens, **req["sampling"])
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc), param_of(str(exc)), "invalid_value") from None
        return ids, params

    def _admit(self) -> None:
        queued = max(self.waiting, self.inflight - self.capacity)
        if queued >= self.max_queue:
            raise APIError(503, f"server busy: {queued} requests waiting (max_queue {self.max_queue}); retry later",
                           None, "queue_full", headers={"Retry-After": str(self.settings.retry_after_s)})

    async def _events(self, req: dict) -> AsyncIterator[dict]:
        """{"failed": {...}} once (refused), or {"delta"} events then one {"finished": True, ...} event."""
        self.reporter.start()
        start = time.perf_counter()
        try:
            ids, params = self._prepare(req)
            self._admit()
        except APIError as exc:
            yield exc.event()
            return
        self.inflight += 1
        events = self.engine.astream_events(ids, params)
        first_at, finished = None, False
        try:
            async for event in events:
                now = time.perf_counter()
                if first_at is None:
                    first_at = now
                    self.metrics.record_first_token(now - start)
                logprobs = self._logprob_entries(event.get("logprobs"))
                if not event["finished"]:
                    yield {"delta": event["delta"], "logprobs": logprobs}
                    continue
                out = event["output"]
                finished = True
                if req["chat"]:
                    self.engine.remember_reply(ids, out)
                self.metrics.record_finished(out, first_at, now)
                yield {"delta": event["delta"], "logprobs": logprobs, "finished": True, "text": out.text,
                       "finish_reason": out.finish_reason, "error": out.error,
                       "prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
                       "verify_steps": out.num_verify_steps}
                return
        except ValueError as exc:  # the scheduler refused the request (e.g. its KV would not fit)
            if first_at is not None:
                raise
            message = str(_cause(exc))
            finished = True
            yield APIError(400, message, param_of(message) or "prompt", "invalid_value").event()
        except Exception:  # noqa: BLE001 - e.g. a broken engine refusing work: this replica is going away
            if first_at is not None:
                raise
            log.exception("the engine refused a request")
            finished = True
            yield APIError(503, "engine unavailable; retry later", None, "engine_unavailable",
                           headers={"Retry-After": str(self.settings.retry_after_s)}).event()
        finally:
            self.inflight -= 1
            if not finished:
                self.metrics.record_aborted()
            await events.aclose()

    async def stream(self, req: dict) -> AsyncIterator[dict]:
        async for event in self._events(req):
            yield event

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.engine.tokenizer.decode([token])
        return text

    def _logprob_entries(self, raw: list | None) -> list[dict] | None:
        """The scheduler's (id, logprob, [(top id, logprob)]) -> {"token", "logprob", "bytes", "top":
        [(token, logprob, bytes)]} (token texts decoded one token at a time, bytes their UTF-8)."""
        if raw is None:
            return None
        text = self._token_text
        return [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
                 "top": [(text(i), v, list(text(i).encode())) for i, v in top]} for t, lp, top in raw]

    async def complete(self, req: dict) -> dict:
        final, logprobs = None, []
        async for event in self._events(req):
            if "failed" in event:
                return event
            final = event
            logprobs += event.get("logprobs") or []
        if final is not None:
            final["logprobs"] = logprobs if req["sampling"].get("logprobs") is not None else None
        return final or APIError(500, "the engine ended the request without a result", None, "engine_error").event()


