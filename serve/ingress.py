"""The HTTP ingress (FastAPI on Serve): auth, body limits, validation, OpenAI response shapes,
SSE streaming, `/health`, `/v1/models` and `/metrics`."""

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphs.metrics import ServeMetrics, merge, render
from serve.metrics import MetricsReporter, replica_key
from serve.protocol import (
    APIError, chat_logprobs, ChatBody, completion_logprobs, completion_response, CompletionBody,
    ENGINE_ERROR, GenRequest, parse_request, stream_chunk, usage_all)
from serve.settings import ServeSettings

log = logging.getLogger(__name__)


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
        key, app_name = replica_key()
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
                return chat_logprobs(event.get("logprobs"))
            shaped = completion_logprobs(event.get("logprobs"), offsets[index])
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
                yield stream_chunk(req, rid, created, usage=usage_all(finals), final_usage=True)
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


