"""OpenAI-compatible HTTP server on Ray Serve, over one speculative-decoding graph per replica.

    python serve_app.py [--host 127.0.0.1] [--port 8000] [--model NAME] [--draft-model NAME]
        [--speculative-algorithm NONE|EAGLE|EAGLE3|STANDALONE|NGRAM] [--num-steps N]
        [--eagle-topk K] [--num-draft-tokens N] [--dp-size N] [--api-key KEY] [--max-model-len N]
    serve run serve_app:app                     # the same defaults, through the Serve CLI
    serve run deploy/serve_config.yaml          # build_app(args) with the config's args

Two deployments:
  * `OpenAIIngress` (FastAPI): auth, body limits, request validation and OpenAI response
    shapes, SSE streaming; `/metrics` renders every replica's counters.
  * `SpecEngine`: each replica owns one actor graph (RayEngine: scheduler, target and draft
    actors), reserved with the replica through `placement_group_bundles` (bundle 0 is the
    replica's own, the graph's bundles follow). It autoscales on ongoing requests.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
GET /metrics. Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}.
"""

import argparse
import asyncio
import functools
import hmac
import ipaddress
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any, AsyncIterator, Dict, List, Literal, Optional, Union

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphs.config import EngineConfig
from graphs.metrics import ServeMetrics, merge, render
from graphs.runtime import graph_bundles
from models.registry import DEFAULT_MODEL, REGISTRY
from spec.algorithm import SpecAlgorithm
from spec.sampling import MAX_LOGPROBS, SamplingParams, child_seed

log = logging.getLogger("serve_app")

DEFAULT_EAGLE3_DRAFT = "smollm2-135m-instruct-eagle3"
# What the server speculates with unless told otherwise (README, bench/results/spec_bench.json):
# the default model with its shipped EAGLE-3 head drafting a tree that also carries a prompt-lookup
# branch (the fastest config on Spec-Bench, bf16, batch 1), any other model with prompt lookup
# (NGRAM), which needs no draft. On a 2-core CPU full trees stop paying above 2-4 running requests;
# a budget of 16 verify rows per step cuts them to fewer nodes as the batch grows and to roots
# alone above 8 (bench/results/concurrency.json); a GPU host can raise it. Tree nodes the draft
# finds less than 10% likely are left out: on held-out prompts, on a 2-core CPU, that went from
# 1.14x to 1.20x over none at 4 requests a batch and from 1.62x to 1.63x at one (README); where
# verify rows cost little (GPUs, bf16 on AVX512-BF16/AMX CPUs) 0 may be faster. Keys the user gave
# win over these.
DEFAULT_SPECULATION = {"speculative_algorithm": "EAGLE3", "draft_model": DEFAULT_EAGLE3_DRAFT, "num_steps": 3,
                       "eagle_topk": 4, "num_draft_tokens": 8, "ngram_branch": 5, "verify_budget": 16,
                       "min_path_prob": 0.1}
FALLBACK_SPECULATION = {"speculative_algorithm": "NGRAM"}
ENGINE_DEPLOYMENT = "SpecEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
METRICS_PUSH_S = 1.0
API_KEY_ENV = "SPECGRAPH_API_KEY"  # the CLI's default key, and the deploy configs' api_key_env


# ---- settings ---------------------------------------------------------------------------------


@dataclass
class ServeSettings:
    """Serving options that are not engine options (those live in EngineConfig)."""

    served_model_name: Optional[str] = None  # default: the config's model name
    # When a key is set, /v1/* (and /metrics, unless metrics_public) needs "Authorization: Bearer
    # <key>". api_key_env names an environment variable of the replicas holding it (deploy configs:
    # never a key in the file); api_key is the key itself (the CLI, tests).
    api_key: Optional[str] = None
    api_key_env: Optional[str] = None
    metrics_public: bool = False  # True: /metrics answers without the key
    max_queue: int = 256  # per replica: 503 once this many requests wait for a batch slot (0: refuse all)
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: Optional[float] = None  # default: 0.75 * batch size
    max_ongoing_requests: Optional[int] = None  # default: batch size + max_queue + 16
    ingress_replicas: int = 1
    replica_num_cpus: float = 0.1  # the engine replica's own bundle (the graph's bundles follow)
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1
    # max_tokens of chat requests that set none (OpenAI: up to the context). The scheduler
    # reserves KV for a request's whole budget, so a cap lets more such requests run at once.
    default_max_tokens: Optional[int] = None
    health_stall_s: float = 900.0  # an engine silent this long is unhealthy (Serve replaces the replica)

    def __post_init__(self) -> None:
        for name in ("min_replicas", "max_queue"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_replicas", "ingress_replicas", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.api_key_env is not None and (not isinstance(self.api_key_env, str) or not self.api_key_env):
            raise ValueError(f"api_key_env must name an environment variable, got {self.api_key_env!r}")

    def resolved_api_key(self) -> Optional[str]:
        """The key this process enforces: api_key, else the variable api_key_env names (unset: none)."""
        if self.api_key:
            return self.api_key
        return os.environ.get(self.api_key_env) or None if self.api_key_env else None

    def check_exposure(self, host: str) -> None:
        """Refuse to serve on a non-loopback address without an API key."""
        if is_loopback(host) or self.resolved_api_key():
            return
        where = (f"environment variable {self.api_key_env} (api_key_env) is not set" if self.api_key_env
                 else "set api_key_env to the name of an environment variable holding the key")
        raise ValueError(f"api_key: serving on {host!r} (not a loopback address) needs an API key; {where}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_ENGINE_FIELDS = {f.name: f for f in fields(EngineConfig)}
_SETTINGS_FIELDS = {f.name: f for f in fields(ServeSettings)}


def _coerce(name: str, annotation: str, value: Any) -> Any:
    """Args from `serve run ... key=value` or YAML may arrive as strings: convert by field type."""
    if value is None or not isinstance(value, str):
        return value
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) or str(annotation)
    kind = kind.replace("typing.", "")
    if name == "speculative_algorithm":  # "NONE" is an algorithm here, not a missing value
        return value
    if value.lower() in ("none", "null", "") and ("None" in kind or "Optional" in kind):
        return None
    if kind.startswith("bool"):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    try:
        if "int" in kind and "float" not in kind:
            return int(value)
        if "float" in kind:
            return float(value)
        if kind.startswith("dict"):
            return json.loads(value)
    except (ValueError, json.JSONDecodeError):
        raise ValueError(f"{name}: cannot read {value!r} as {kind}") from None
    return value


@functools.lru_cache(maxsize=None)
def default_draft_available() -> bool:
    """The trained EAGLE-3 draft of the default model is registered and its files are there."""
    if DEFAULT_EAGLE3_DRAFT not in REGISTRY:
        return False
    from models.loader import resolve_model

    try:
        resolve_model(DEFAULT_EAGLE3_DRAFT)
        return True
    except Exception as exc:  # noqa: BLE001 - registered but not trained/shipped yet
        log.warning("%s is registered but not usable (%s): using NGRAM", DEFAULT_EAGLE3_DRAFT, exc)
        return False


def apply_spec_defaults(engine: dict) -> dict:
    """Default speculation when none is asked for: DEFAULT_SPECULATION on the default model
    (FALLBACK_SPECULATION on others, or when the shipped head is missing). Asking for EAGLE3
    without a draft on the default model picks the shipped SmolLM2 EAGLE-3 head."""
    engine = dict(engine)
    model = engine.get("model") or DEFAULT_MODEL
    engine["model"] = model
    algorithm, draft = engine.get("speculative_algorithm"), engine.get("draft_model")
    if algorithm is None and draft is None:
        default = DEFAULT_SPECULATION if model == DEFAULT_MODEL and default_draft_available() else FALLBACK_SPECULATION
        given = {k for k, v in engine.items() if v is not None}
        engine.update({k: v for k, v in default.items() if engine.get(k) is None})
        if "ngram_branch" not in given and (engine.get("eagle_topk") == 1
                                            or engine.get("ngram_branch", 0) >= engine.get("num_draft_tokens", 0)):
            engine.pop("ngram_branch", None)  # the default branch fits the default tree, not one the user shaped
        if "min_path_prob" not in given and engine.get("eagle_topk") == 1:
            engine.pop("min_path_prob", None)  # chosen for trees; chains lost speed with it (README)
    elif (draft is None and model == DEFAULT_MODEL and SpecAlgorithm.from_name(algorithm) is SpecAlgorithm.EAGLE3
          and default_draft_available()):
        engine["draft_model"] = DEFAULT_EAGLE3_DRAFT
    return engine


def split_args(args: dict | None) -> tuple[dict, ServeSettings]:
    """`build_app` args -> (EngineConfig kwargs with defaults applied, ServeSettings)."""
    engine, settings = {}, {}
    for key, value in (args or {}).items():
        key = key.replace("-", "_")
        if key in _SETTINGS_FIELDS:
            settings[key] = _coerce(key, _SETTINGS_FIELDS[key].type, value)
        elif key in _ENGINE_FIELDS and key != "backend":
            engine[key] = _coerce(key, _ENGINE_FIELDS[key].type, value)
        elif key == "backend":
            if value != "ray":
                raise ValueError("backend: the server always runs the ray backend")
        else:
            known = sorted([*_ENGINE_FIELDS, *_SETTINGS_FIELDS])
            raise ValueError(f"unknown argument {key!r}; known: {', '.join(known)}")
    engine = apply_spec_defaults(engine)
    EngineConfig(**engine, backend="ray")  # validate now, not in a replica
    return engine, ServeSettings(**settings)


# ---- errors -----------------------------------------------------------------------------------


class APIError(Exception):
    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def event(self) -> dict:
        """As an engine event (plain data through Ray)."""
        return {"failed": {"status": self.status, "message": self.message, "param": self.param, "code": self.code,
                           "headers": self.headers}}

    @classmethod
    def from_event(cls, event: dict) -> "APIError":
        e = event["failed"]
        return cls(e["status"], e["message"], e.get("param"), e.get("code"), e.get("headers"))


ENGINE_ERROR = "the engine failed this request (details are in the server log)"
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "min_p",
                   "logprobs")
MAX_N = 16  # choices per request (each runs as its own request in the batch)
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs` (OpenAI's limit; chat allows MAX_LOGPROBS)
# OpenAI (and vLLM) fields this server does not implement, with the values that mean "not used":
# any other value is refused with 400 naming the field, never silently ignored.
UNSUPPORTED_FIELDS = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}), "echo": (None, False),
    "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,), "prompt_logprobs": (None,),
    "use_beam_search": (None, False), "include_stop_str_in_output": (None, False),
}


def _param_of(message: str) -> str | None:
    head = message.split(":")[0].split(" ")[0]
    return head if head in (*SAMPLING_FIELDS, "prompt", "messages") else None


# ---- request validation and translation (no Ray: unit-tested directly) --------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lenient):
    include_usage: Optional[bool] = None


class ContentPart(_Lenient):
    type: str
    text: Optional[str] = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None


class _CommonBody(_Lenient):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    user: Optional[str] = None
    ignore_eos: Optional[bool] = None
    best_of: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[List[int]] = None
    min_p: Optional[float] = None


class CompletionBody(_CommonBody):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    logprobs: Optional[int] = None


class ChatBody(_CommonBody):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


@dataclass
class GenRequest:
    """A validated request, as sent to the engine replica (plain data)."""

    chat: bool
    model: str
    prompt: Union[str, List[int], None] = None
    messages: Optional[List[dict]] = None
    max_tokens: Optional[int] = None  # None: up to the context length
    sampling: dict = field(default_factory=dict)  # SamplingParams kwargs other than max_tokens
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # independent choices, each its own engine request

    def to_engine(self, index: int = 0) -> dict:
        """Choice `index`'s engine request: a given seed becomes that choice's derived seed."""
        out = asdict(self)
        if out["sampling"].get("seed") is not None:
            out["sampling"]["seed"] = child_seed(out["sampling"]["seed"], index)
        return out


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(x for x in loc if not any(t in x for t in ("[", "str", "list", "int")) or x.isdigit())
    if err.get("type") == "missing":
        return APIError(400, f"{param}: field required", param, "missing_field")
    return APIError(400, f"{where or param}: {err.get('msg')}", param, "invalid_value")


def _message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages: content part of type {part.type!r} is not supported (text only)",
                           "messages", "invalid_value")
        texts.append(part.text)
    return "".join(texts)


def parse_request(body: Any, chat: bool, served_names: list[str]) -> GenRequest:
    """Validate an OpenAI request body and translate it into a GenRequest.

    Raises APIError (400 for bad values, 404 for an unknown model)."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", None, "invalid_json")
    try:
        req = (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if req.model is not None and req.model not in served_names:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves {served_names[0]!r}",
                       "model", "model_not_found")
    for name, unused in UNSUPPORTED_FIELDS.items():
        if body.get(name) not in unused:
            raise APIError(400, f"{name}: not supported by this server", name, "unsupported_parameter")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n: must be in [1, {MAX_N}], got {n}", "n", "invalid_value")
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, f"best_of: only best_of == n is supported, got {req.best_of} with n {n}", "best_of",
                       "invalid_value")
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", "top_logprobs", "invalid_value")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                           "top_logprobs", "invalid_value")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
        if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"logprobs: must be in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs}", "logprobs",
                           "invalid_value")
    logit_bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias: key {key!r} is not a token id", "logit_bias", "invalid_value")
        logit_bias[int(key)] = value

    out = GenRequest(chat=chat, model=served_names[0], stream=bool(req.stream), n=n,
                     include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage))
    if chat:
        if not req.messages:
            raise APIError(400, "messages: must contain at least one message", "messages", "invalid_value")
        out.messages = [{"role": m.role, "content": _message_text(m.content)} for m in req.messages]
        out.max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: batches of prompts are not supported (got {len(prompt)}); "
                               "send one prompt per request", "prompt", "invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt", "invalid_value")
        out.prompt = prompt
        out.max_tokens = 16 if req.max_tokens is None else req.max_tokens
    stop = req.stop
    sampling = dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        seed=req.seed,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        ignore_eos=bool(req.ignore_eos),
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias, min_tokens=req.min_tokens or 0, stop_token_ids=list(req.stop_token_ids or []),
        min_p=req.min_p or 0.0, logprobs=logprobs,
    )
    try:  # the engine's own rules, checked here so the client hears about them first
        SamplingParams(max_tokens=max(1, sampling["min_tokens"]) if out.max_tokens is None else out.max_tokens,
                       **sampling)
    except ValueError as exc:
        raise APIError(400, str(exc), _param_of(str(exc)), "invalid_value") from None
    out.sampling = sampling
    return out


# ---- response shapes --------------------------------------------------------------------------


def usage_of(result: dict) -> dict:
    p, c = result["prompt_tokens"], result["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chat_logprobs(entries: list[dict] | None) -> dict | None:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    if entries is None:
        return None
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in e["top"]]}
                        for e in entries]}


def _completion_logprobs(entries: list[dict] | None, offset: int = 0) -> dict | None:
    """OpenAI completions shape: tokens, token_logprobs, top_logprobs (token -> logprob, the emitted
    token included, as vLLM does) and text_offset (from `offset`, the text already sent)."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{e["token"]: e["logprob"], **{t: lp for t, lp, _ in e["top"]}} for e in entries],
            "text_offset": offsets}


def _usage_all(results: list[dict]) -> dict:
    """Usage of n choices: the prompt once, every choice's completion tokens."""
    return usage_of({"prompt_tokens": results[0]["prompt_tokens"],
                     "completion_tokens": sum(r["completion_tokens"] for r in results)})


def completion_response(req: GenRequest, results: list[dict], rid: str, created: int) -> dict:
    choices = []
    for index, result in enumerate(results):
        if req.chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": result["text"]},
                            "logprobs": _chat_logprobs(result.get("logprobs")),
                            "finish_reason": result["finish_reason"]})
        else:
            choices.append({"index": index, "text": result["text"],
                            "logprobs": _completion_logprobs(result.get("logprobs")),
                            "finish_reason": result["finish_reason"]})
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": created,
            "model": req.model, "choices": choices, "usage": _usage_all(results)}


def stream_chunk(req: GenRequest, rid: str, created: int, *, text: str | None = None, role: bool = False,
                 finish_reason: str | None = None, usage: dict | None = None, final_usage: bool = False,
                 index: int = 0, logprobs: dict | None = None) -> str:
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    chunk: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": req.model}
    if final_usage:
        chunk["choices"] = []
    elif req.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        chunk["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        chunk["choices"] = [{"index": index, "text": text or "", "logprobs": logprobs,
                             "finish_reason": finish_reason}]
    if req.include_usage:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


# ---- metrics hub: one small actor per application, fed by every replica -----------------------


@ray.remote(num_cpus=0)
class MetricsHub:
    def __init__(self):
        self.snapshots: dict[str, dict] = {}

    def report(self, key: str, snapshot: dict) -> None:
        self.snapshots[key] = snapshot

    def retire(self, key: str) -> None:
        """A replica stopped: keep its counters, drop its gauges."""
        if key in self.snapshots:
            self.snapshots[key]["gauges"] = None

    def collect(self) -> dict[str, dict]:
        return self.snapshots


class MetricsReporter:
    """Pushes a replica's ServeMetrics snapshot to the application's hub when it changed."""

    def __init__(self, metrics: ServeMetrics, key: str, app_name: str, refresh=None):
        self.metrics, self.key, self.hub_name = metrics, key, f"specgraph-metrics:{app_name}"
        self.refresh = refresh  # async callable run before each push (e.g. engine gauges)
        self.hub = None
        self._pushed = -1
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def get_hub(self):
        if self.hub is None:
            self.hub = MetricsHub.options(name=self.hub_name, get_if_exists=True,
                                          scheduling_strategy="DEFAULT").remote()
        return self.hub

    async def collect(self, fresh: dict | None = None) -> list[dict]:
        """All replicas' snapshots: this one's taken now, and `fresh` ({key: snapshot}) over the hub's."""
        try:
            hub = await asyncio.to_thread(self.get_hub)
            snaps = dict(await hub.collect.remote())
        except Exception:  # noqa: BLE001 - the hub went away with its owner: rebuilt on next use
            log.warning("metrics hub unavailable", exc_info=True)
            self.hub, snaps = None, {}
        snaps.update(fresh or {})
        snaps[self.key] = self.metrics.snapshot()
        return list(snaps.values())

    async def push(self) -> None:
        if self.refresh is not None:
            await self.refresh()
        if self.metrics.version == self._pushed:
            return
        version = self.metrics.version
        try:
            hub = await asyncio.to_thread(self.get_hub)
            await hub.report.remote(self.key, self.metrics.snapshot())
            self._pushed = version
        except Exception:  # noqa: BLE001
            log.debug("metrics push failed", exc_info=True)
            self.hub = None

    async def _run(self) -> None:
        while True:
            try:
                await self.push()
            except Exception:  # noqa: BLE001 - metrics never take the replica down
                log.debug("metrics refresh failed", exc_info=True)
            await asyncio.sleep(METRICS_PUSH_S)

    def retire(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.hub is not None:
            try:
                self.hub.report.remote(self.key, self.metrics.snapshot())
                self.hub.retire.remote(self.key)
            except Exception:  # noqa: BLE001
                pass


def _replica_key() -> tuple[str, str]:
    try:
        ctx = serve.get_replica_context()
        return f"{ctx.deployment}#{ctx.replica_id.unique_id}", ctx.app_name
    except Exception:  # noqa: BLE001 - outside Serve (tests)
        return f"local#{uuid.uuid4().hex[:8]}", "default"


# ---- the engine deployment ----------------------------------------------------------------------


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
            self.metrics.set_draft_depth(self.config.num_steps)
        key, app_name = _replica_key()
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
        the scheduler, and the target and draft actor of every rank."""
        ranks = await self.engine.scheduler.actors.remote()
        return {"replica": ray.get_runtime_context().current_actor, "scheduler": self.engine.scheduler,
                "targets": ranks[0::2], "drafts": ranks[1::2]}

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
            raise APIError(400, str(exc), _param_of(str(exc)), "invalid_value") from None
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
            yield APIError(400, message, _param_of(message) or "prompt", "invalid_value").event()
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


# ---- the HTTP ingress ---------------------------------------------------------------------------

fastapi_app = FastAPI(title="specgraph", docs_url=None, redoc_url=None)


def _openapi() -> dict:
    """FastAPI's schema of the routes plus the request bodies, which the handlers read raw (to
    answer bad JSON with OpenAI errors), so clients and fuzzers see the fields that are validated."""
    if fastapi_app.openapi_schema is None:
        schema = get_openapi(title=fastapi_app.title, version=fastapi_app.version, routes=fastapi_app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in (("/v1/completions", CompletionBody), ("/v1/chat/completions", ChatBody)):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        fastapi_app.openapi_schema = schema
    return fastapi_app.openapi_schema


fastapi_app.openapi = _openapi


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_handler(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
    return APIError(400, f"{'.'.join(loc) or 'body'}: {errors[0].get('msg') if errors else 'invalid request'}",
                    loc[0] if loc else None, "invalid_value").response()


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_handler(request: Request, exc: StarletteHTTPException):
    return APIError(exc.status_code, str(exc.detail), None, None).response()


@fastapi_app.exception_handler(Exception)
async def _internal_handler(request: Request, exc: Exception):
    log.exception("unhandled error on %s", request.url.path)
    return APIError(500, "internal error", None, "internal_error").response()


def _serve_http_host() -> str:
    """The address Serve's HTTP proxies bind (from the Serve controller)."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    return ray.get(controller.get_http_config.remote()).host


@serve.ingress(fastapi_app)
class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, engine_kwargs: dict, settings: dict):
        self.engine = engine
        self.engine_stream = engine.options(stream=True)
        self.settings = ServeSettings(**settings)
        self.api_key = self.settings.resolved_api_key()
        self.settings.check_exposure(_serve_http_host())
        model = engine_kwargs["model"]
        self.served_names = [self.settings.served_model_name or model, model]
        self.created = int(time.time())
        self.metrics = ServeMetrics()
        key, app_name = _replica_key()
        self.reporter = MetricsReporter(self.metrics, key, app_name)

    # ---- plumbing --------------------------------------------------------------------

    def _check_auth(self, request: Request) -> None:
        key = self.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided (send 'Authorization: Bearer <key>')", None,
                           "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _read_json(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        too_big = APIError(413, f"request body larger than {limit} bytes", None, "request_too_large")
        if declared is not None:
            try:
                if int(declared) > limit:
                    raise too_big
            except ValueError:
                raise APIError(400, "invalid Content-Length header", None, "invalid_request") from None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, or e.g. an over-long integer
            raise APIError(400, f"request body is not valid JSON: {exc}", None, "invalid_json") from None
        except RecursionError:
            raise APIError(400, "request body is nested too deeply", None, "invalid_json") from None

    async def _generate(self, endpoint: str, request: Request, chat: bool) -> Response:
        self.reporter.start()
        try:
            self._check_auth(request)
            req = parse_request(await self._read_json(request), chat, self.served_names)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            created = int(time.time())
            if req.stream:
                gens = [self.engine_stream.stream.remote(req.to_engine(i)) for i in range(req.n)]
                try:
                    firsts = [await gen.__anext__() for gen in gens]
                except BaseException:
                    for gen in gens:
                        gen.cancel()
                    raise
                failed = next((f for f in firsts if "failed" in f), None)
                if failed is not None:
                    for gen in gens:
                        gen.cancel()
                    raise APIError.from_event(failed)
                response: Response = StreamingResponse(
                    self._sse(req, rid, created, firsts, gens), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            else:
                results = await asyncio.gather(*[self.engine.complete.remote(req.to_engine(i)) for i in range(req.n)])
                for result in results:
                    if "failed" in result:
                        raise APIError.from_event(result)
                    if result.get("finish_reason") == "error":
                        log.warning("request %s failed in the engine: %s", rid, result.get("error"))
                        raise APIError(500, ENGINE_ERROR, None, "engine_error")
                response = JSONResponse(completion_response(req, list(results), rid, created))
        except APIError as exc:
            response = exc.response()
        except Exception as exc:  # noqa: BLE001
            from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

            if isinstance(exc, (BackPressureError, DeploymentUnavailableError)):
                response = APIError(503, f"server busy: {exc}", None, "queue_full",
                                    headers={"Retry-After": str(self.settings.retry_after_s)}).response()
            else:
                log.exception("request failed")
                response = APIError(500, "internal error", None, "internal_error").response()
        self.metrics.record_request(endpoint, response.status_code)
        return response

    @staticmethod
    async def _merged(firsts: list[dict], gens: list) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, event) from n engine streams as they arrive; an exception in place of
        the event where a stream broke (that choice then ends)."""
        for index, first in enumerate(firsts):
            yield index, first
        pending = {asyncio.ensure_future(gen.__anext__()): i for i, gen in enumerate(gens)
                   if not firsts[i].get("finished")}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = pending.pop(task)
                    try:
                        event = task.result()
                    except StopAsyncIteration:
                        continue
                    except Exception as exc:  # noqa: BLE001 - the engine replica failed mid-stream
                        yield index, exc
                        continue
                    yield index, event
                    if not event.get("finished"):
                        pending[asyncio.ensure_future(gens[index].__anext__())] = index
        finally:
            for task in pending:
                task.cancel()

    async def _sse(self, req: GenRequest, rid: str, created: int, firsts: list[dict], gens: list) -> AsyncIterator[str]:
        done: set[int] = set()
        finals: list[dict] = []
        offsets = [0] * len(gens)  # completions' text_offset: text sent so far per choice

        def logprobs_of(index: int, event: dict) -> dict | None:
            if req.chat:
                return _chat_logprobs(event.get("logprobs"))
            shaped = _completion_logprobs(event.get("logprobs"), offsets[index])
            offsets[index] += len(event.get("delta") or "")
            return shaped

        try:
            if req.chat:
                for index in range(len(gens)):
                    yield stream_chunk(req, rid, created, role=True, index=index)
            async for index, event in self._merged(firsts, gens):
                if isinstance(event, Exception):
                    log.warning("stream broke: %s", event)
                    done.add(index)
                    err = APIError(500, ENGINE_ERROR, None, "engine_error").body()
                    yield f"data: {json.dumps(err)}\n\n"
                    continue
                if event.get("delta") or event.get("logprobs"):
                    yield stream_chunk(req, rid, created, text=event.get("delta") or "", index=index,
                                       logprobs=logprobs_of(index, event))
                if event.get("finished"):
                    done.add(index)
                    if event.get("finish_reason") == "error":
                        log.warning("request %s failed in the engine: %s", rid, event.get("error"))
                        err = APIError(500, ENGINE_ERROR, None, "engine_error").body()
                        yield f"data: {json.dumps(err)}\n\n"
                        continue
                    finals.append(event)
                    yield stream_chunk(req, rid, created, text=None if req.chat else "",
                                       finish_reason=event["finish_reason"], index=index)
            if req.include_usage and finals:
                yield stream_chunk(req, rid, created, usage=_usage_all(finals), final_usage=True)
            yield "data: [DONE]\n\n"
        finally:
            for index, gen in enumerate(gens):
                if index not in done:
                    gen.cancel()  # the client went away (or the stream broke): abort, free the KV

    # ---- routes ----------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        self.reporter.start()
        try:
            await asyncio.wait_for(self.engine.ping.remote(), timeout=10)
        except Exception as exc:  # noqa: BLE001
            return APIError(503, f"engine not ready: {type(exc).__name__}", None, "unavailable").response()
        return JSONResponse({"status": "ok"})

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except APIError as exc:
            self.metrics.record_request("/v1/models", exc.status)
            return exc.response()
        self.metrics.record_request("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [
            {"id": self.served_names[0], "object": "model", "created": self.created, "owned_by": "specgraph"}]})

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate("/v1/completions", request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate("/v1/chat/completions", request, chat=True)

    @fastapi_app.get("/metrics")
    async def metrics_endpoint(self, request: Request) -> Response:
        self.reporter.start()
        if not self.settings.metrics_public:
            try:
                self._check_auth(request)
            except APIError as exc:
                return exc.response()
        fresh = {}
        try:  # one engine replica's current gauges (all of them when there is one replica)
            key, snap = await asyncio.wait_for(self.engine.metrics_snapshot.remote(), timeout=5)
            fresh[key] = snap
        except Exception:  # noqa: BLE001 - fall back to what replicas pushed last
            log.debug("engine metrics refresh failed", exc_info=True)
        snapshots = await self.reporter.collect(fresh)
        return PlainTextResponse(render(merge(snapshots)), media_type="text/plain; version=0.0.4")

    def __del__(self):
        try:
            self.reporter.retire()
        except Exception:  # noqa: BLE001
            pass


# ---- the application ----------------------------------------------------------------------------


def build_app(args: dict | None = None) -> serve.Application:
    """The Serve application for `args` (EngineConfig fields and ServeSettings fields)."""
    engine_kwargs, settings = split_args(args)
    config = EngineConfig(**engine_kwargs, backend="ray")
    batch = config.max_running_requests * config.dp_size
    max_ongoing = settings.max_ongoing_requests or batch + settings.max_queue + 16
    target = settings.target_ongoing_requests or max(1.0, 0.75 * batch)
    engine = serve.deployment(SpecEngine, name=ENGINE_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": settings.replica_num_cpus},
        placement_group_bundles=[{"CPU": settings.replica_num_cpus}] + graph_bundles(config),
        placement_group_strategy=config.placement_strategy,
        autoscaling_config={"min_replicas": settings.min_replicas, "initial_replicas": max(1, settings.min_replicas),
                            "max_replicas": settings.max_replicas, "target_ongoing_requests": target},
        max_ongoing_requests=max_ongoing,
        max_queued_requests=max(1, settings.max_queue),
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=30,
    )
    ingress = serve.deployment(OpenAIIngress, name=INGRESS_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": 0.1},
        num_replicas=settings.ingress_replicas,
        max_ongoing_requests=max_ongoing * settings.max_replicas + 64,
    )
    settings_dict = asdict(settings)
    return ingress.bind(engine.bind(engine_kwargs, settings_dict), engine_kwargs, settings_dict)


# ---- `python serve_app.py` ----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="serve_app.py", description="OpenAI-compatible speculative-decoding server on Ray Serve.",
        epilog=f"Default: {DEFAULT_MODEL} with {DEFAULT_SPECULATION['speculative_algorithm']} speculation "
               f"(draft {DEFAULT_EAGLE3_DRAFT}); other models: {FALLBACK_SPECULATION['speculative_algorithm']}.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, folder or .gguf")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--speculative-algorithm", default=None, help="NONE, EAGLE, EAGLE3, STANDALONE or NGRAM")
    p.add_argument("--num-steps", type=int, default=None)
    p.add_argument("--eagle-topk", type=int, default=None)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--ngram-branch", type=int, default=None, help="prompt-lookup tokens forced into each draft tree")
    p.add_argument("--min-path-prob", type=float, default=None,
                   help="verify only draft tokens whose path probability reaches this "
                        "(0: full chains and trees; default model: 0.1)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="decode steps with more running requests than this skip drafting")
    p.add_argument("--verify-budget", type=int, default=None,
                   help="most verify rows per decode step: larger batches keep fewer tree nodes each "
                        "(default model: 16)")
    p.add_argument("--dp-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--kv-slots", type=int, default=None)
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 or auto (bf16 on GPUs and on CPUs with AMX/AVX512-BF16)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $SPECGRAPH_API_KEY; "
                        "needed to bind a non-loopback --host)")
    p.add_argument("--metrics-public", action="store_true", default=None, help="serve /metrics without the key")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of chat requests that give none (default: up to the context length)")
    p.add_argument("--max-queue", type=int, default=None, help="waiting requests per replica before 503 (256)")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound (1)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray started here")
    p.add_argument("--dashboard", action="store_true", help="start the Ray dashboard with the local Ray")
    return p.parse_args(argv)


def app_args_from_cli(ns: argparse.Namespace) -> dict:
    skip = {"host", "port", "num_cpus", "dashboard"}
    args = {k: v for k, v in vars(ns).items() if k not in skip and v is not None}
    if "api_key" not in args and os.environ.get(API_KEY_ENV):
        args["api_key_env"] = API_KEY_ENV  # the replicas read it: the key stays out of the app's args
    return args


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = app_args_from_cli(ns)
    try:  # bad flags fail here, before Ray starts
        application = build_app(args)
        engine_kwargs, settings = split_args(args)
        settings.check_exposure(ns.host)
    except ValueError as exc:
        print(f"serve_app.py: error: {exc}", file=sys.stderr)
        return 2
    config = EngineConfig(**engine_kwargs, backend="ray")

    stop = threading.Event()
    serving = threading.Event()

    def _on_signal(signum, frame):  # noqa: ARG001
        stop.set()
        if not serving.is_set():  # still starting: interrupt whatever is blocking
            raise KeyboardInterrupt

    started_ray = False
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address=os.environ["RAY_ADDRESS"])
            else:
                needed = settings.replica_num_cpus + sum(b.get("CPU", 0) for b in graph_bundles(config)) + 0.2
                num_cpus = ns.num_cpus or max(os.cpu_count() or 1, math.ceil(needed))
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=ns.dashboard)
                started_ray = True
        serve.start(http_options={"host": ns.host, "port": ns.port})
        log.info("deploying %s (%s%s)...", config.model, config.algorithm.name,
                 f" with {config.draft_model}" if config.draft_model else "")
        serve.run(application, name="default", route_prefix="/")
        host = f"[{ns.host}]" if ":" in ns.host else ns.host
        log.info("serving %s at http://%s:%d/v1 (health: /health, metrics: /metrics); Ctrl-C to stop",
                 settings.served_model_name or config.model, host, ns.port)
        serving.set()
        while not stop.wait(1.0):
            pass
        log.info("stopping")
        return 0
    except KeyboardInterrupt:
        log.info("interrupted while starting; stopping")
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()


app = build_app({})

if __name__ == "__main__":
    raise SystemExit(main())
