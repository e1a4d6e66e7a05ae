"""The OpenAI protocol: request bodies (pydantic), their validation and translation into engine
requests, response and SSE chunk shapes, and OpenAI-style errors (no Ray: unit-tested directly)."""

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from spec.sampling import MAX_LOGPROBS, SamplingParams, child_seed


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


def param_of(message: str) -> str | None:
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
        raise APIError(400, str(exc), param_of(str(exc)), "invalid_value") from None
    out.sampling = sampling
    return out


# ---- response shapes --------------------------------------------------------------------------


def usage_of(result: dict) -> dict:
    p, c = result["prompt_tokens"], result["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    if entries is None:
        return None
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in e["top"]]}
                        for e in entries]}


def completion_logprobs(entries: list[dict] | None, offset: int = 0) -> dict | None:
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


def usage_all(results: list[dict]) -> dict:
    """Usage of n choices: the prompt once, every choice's completion tokens."""
    return usage_of({"prompt_tokens": results[0]["prompt_tokens"],
                     "completion_tokens": sum(r["completion_tokens"] for r in results)})


def completion_response(req: GenRequest, results: list[dict], rid: str, created: int) -> dict:
    choices = []
    for index, result in enumerate(results):
        if req.chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": result["text"]},
                            "logprobs": chat_logprobs(result.get("logprobs")),
                            "finish_reason": result["finish_reason"]})
        else:
            choices.append({"index": index, "text": result["text"],
                            "logprobs": completion_logprobs(result.get("logprobs")),
                            "finish_reason": result["finish_reason"]})
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": created,
            "model": req.model, "choices": choices, "usage": usage_all(results)}


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


