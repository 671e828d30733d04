"""The OpenAI-compatible ASGI app of `specjax serve` (FastAPI), over the serving engine (`runners.serving`).

Routes: POST /v1/completions and /v1/chat/completions (with `stream: true` as server-sent events, and
`stream_options.include_usage`), GET /v1/models, /health, /metrics (Prometheus), /openapi.json. With an API key
every route but /health needs `Authorization: Bearer KEY`, checked before the body is read (`serve.limits`).

Each response carries, next to OpenAI's `usage`, `timing` (queue_time, time_to_first_token, e2e_latency, seconds)
and, with speculation on, `spec_decode`: drafted, accepted, acceptance_rate, mean_accepted_length (tau),
tokens_per_forward, verify_steps, per_position_acceptance / _accepted / _drafted (`requests.spec_metrics`). A
streamed response carries them in its usage chunk (include_usage).

The event loop never runs JAX and never tokenizes: a body past `ServerLimits.max_body_bytes` is refused (413)
before it is read, and the prompt is checked (size, roles, special-token text) and tokenized on a bounded thread
pool (`serve.prepare`); the loop submits the ids to the engine and waits on an asyncio queue that the engine
thread feeds (`loop.call_soon_threadsafe`). A client that disconnects (a stream closed, or a waiting
non-streamed request whose connection drops) cancels its request, which frees its slot at the next step chunk.

Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for a malformed body (the field
named in the message and in `param`; unknown fields too) or a request the server cannot serve, 401 without the
key, 404 for another model's name or an unknown route, 413 for a body past the limit, 429 when the queue (or the
tokenizing pool) is full, 503 while shutting down, 500 when a generation fails (the rest keep running). Messages
carry no file-system path and no internal type name (`public_message`). Every request the server refuses is
counted in /metrics' specjax:request_failure{reason} (`serve.metrics`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjax.errors import SpecjaxError
from specjax.runners.serving import (Delta, EngineStoppedError, Failed, Finished, QueueFullError, Result,
                                     ServingEngine)
from specjax.serve.limits import Guard, ServerLimits, too_large_message
from specjax.serve.metrics import CONTENT_TYPE, ServerMetrics
from specjax.serve.prepare import BusyError, Preparer
from specjax.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body

POLL_DISCONNECT_S = 0.25  # how often a waiting non-streamed request checks that its client is still there
_log = logging.getLogger("specjax.serve")
# The failure reason /metrics counts for each status the server answers itself (`metrics.REASONS`).
_STATUS_REASONS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                   413: "too_large", 422: "bad_request", 429: "queue_full", 503: "unavailable"}


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def create_app(engine: ServingEngine, model_name: str, *, api_key: str | None = None,
               metrics: ServerMetrics | None = None, limits: ServerLimits | None = None) -> FastAPI:
    """The app over a started engine. model_name: the name /v1/models lists and requests may give as `model`;
    api_key: None (no auth) or the bearer token every route but /health needs; metrics: the engine's observer
    (a new one, reading only the gauges, when None); limits: the HTTP-side limits (`ServerLimits()` when None).
    The OpenAPI description of the routes is served at /openapi.json."""
    if metrics is None:
        metrics = ServerMetrics(engine)
    limits = ServerLimits() if limits is None else limits
    preparer = Preparer(engine, limits)
    created = int(time.time())
    app = FastAPI(title="specjax", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.engine, app.state.metrics, app.state.preparer = engine, metrics, preparer
    # Outermost of the app's own middleware: a request without the key is answered before its body is read.
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes, refused=metrics.failed)

    _install_error_handlers(app, metrics, limits)

    @app.get("/health")
    async def health():
        if engine.alive:
            return {"status": "ok"}
        why = engine.failure or "shutting down"
        return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)

    api = APIRouter()

    @api.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @api.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "specjax",
                "max_model_len": engine.max_model_len,
                "speculative_config": _spec_dict(engine)}
        return {"object": "list", "data": [card]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            metrics.failed("not_found")
            raise _HTTPError(404, f"the model {name!r} is not served here; this server serves {model_name!r} "
                                  "(GET /v1/models)", "NotFoundError", "model")

    def submit(ids: list[int], sp, on_event: Callable) -> Any:
        try:
            return engine.submit(ids, sp, on_event, request_id=None)
        except QueueFullError as e:
            metrics.failed("queue_full")
            raise _HTTPError(429, str(e), "rate_limit_error") from None
        except EngineStoppedError as e:
            metrics.failed("unavailable")
            raise _HTTPError(503, str(e), "service_unavailable") from None

    async def prepared(make_params: Callable, work: Callable, *args):
        """(ids, sampling params): the body's own checks on the loop, tokenizing on the pool; a refusal is a
        counted 400 (429 when the pool is full) naming the field."""
        try:
            sp = make_params()
            return await preparer.run(work, *args, sp)
        except BusyError as e:
            metrics.failed("queue_full")
            raise _HTTPError(429, str(e), "rate_limit_error") from None
        except (SpecjaxError, ValueError) as e:
            metrics.failed("bad_request")
            raise _HTTPError(400, str(e), "invalid_request_error", getattr(e, "param", None)) from None

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        ids, sp = await prepared(lambda: body.sampling_params(body.max_tokens, 16), preparer.completion,
                                 _single_prompt(body, metrics))
        return await _respond(request, body, ids, sp, "text_completion", f"cmpl-{uuid.uuid4().hex}")

    @api.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        ids, sp = await prepared(
            lambda: body.sampling_params(body.requested_max_tokens(), engine.options.max_tokens), preparer.chat,
            [m.as_dict() for m in body.messages], body.add_generation_prompt, body.chat_template_kwargs)
        return await _respond(request, body, ids, sp, "chat.completion", f"chatcmpl-{uuid.uuid4().hex}")

    async def _respond(request: Request, body, ids: list[int], sp, kind: str, rid: str):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(ev) -> None:  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        handle = submit(ids, sp, on_event)
        shape = _Shape(kind, rid, int(time.time()), model_name)
        if body.stream:
            return StreamingResponse(_stream(engine, handle, queue, shape, body.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), POLL_DISCONNECT_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.cancel(handle)
                        return Response(status_code=499)
                    continue
                if isinstance(ev, Finished):
                    return shape.full(ev.result)
                if isinstance(ev, Failed):
                    raise _failure(ev)
        except asyncio.CancelledError:
            engine.cancel(handle)
            raise

    app.include_router(api)
    return app


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics, limits: ServerLimits) -> None:
    """Every error answer of the app: the JSON error body (no internals), counted in /metrics when the server
    turned the request away itself (the routes raise `_HTTPError` and count their own refusals)."""

    def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(public_message(message), kind, status, param), status_code=status)

    def refused(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        """A request the server turns away itself: counted in /metrics under the status's reason."""
        metrics.failed(_STATUS_REASONS.get(status, "bad_request"))
        return error(status, message, kind, param)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        message, param = _describe_validation(exc.errors())
        return refused(400, message, "invalid_request_error", param)

    @app.exception_handler(_HTTPError)
    async def http_error(request: Request, exc: _HTTPError):
        return error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 413:
            return refused(413, too_large_message(limits.max_body_bytes), "invalid_request_error")
        if exc.status_code == 400:  # FastAPI could not read the body (invalid UTF-8, nesting too deep for JSON)
            return refused(400, "the request body could not be read as JSON (invalid UTF-8, or nested too deeply); "
                                "send a JSON object", "invalid_request_error")
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return refused(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # A defect, never the client's input: logged in full here, and the client gets no internals.
        _log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        metrics.failed("error")
        return error(500, "internal server error", "server_error")


def _single_prompt(body: CompletionRequest, metrics: ServerMetrics):
    try:
        return body.single_prompt()
    except (SpecjaxError, ValueError) as e:
        metrics.failed("bad_request")
        raise _HTTPError(400, str(e), "invalid_request_error", "prompt") from None


# An absolute file-system path (POSIX or Windows) inside a message: shown by its last component only.
_PATH = re.compile(r"(?:[A-Za-z]:\\|/)(?:[^\s/\\'\"(),:;]+[/\\])+([^\s/\\'\"(),:;]+)")
# A Python exception's type name in front of its text ("TypeError: ...", "(PanicException: ...)").
_TYPE_NAME = re.compile(r"\b(?:[A-Z]\w*)?(?:Error|Exception|Panic)\b:\s*")


def public_message(message: str) -> str:
    """`message` as a client may see it: no file-system path (only the file's name) and no internal exception
    type name; the rest, which names the field and the fix, is kept."""
    return _TYPE_NAME.sub("", _PATH.sub(lambda m: m.group(1), message))


class _Shape:
    """The JSON of one response: full (non-streamed) or chunks."""

    def __init__(self, kind: str, rid: str, created: int, model: str):
        self.chat = kind == "chat.completion"
        self.kind, self.rid, self.created, self.model = kind, rid, created, model

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def full(self, r: Result) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                      "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
        else:
            choice = {"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason,
                      "stop_reason": r.stop_reason}
        return {**self._head(self.kind), "choices": [choice], **_usage(r)}

    def chunk(self, text: str | None = None, finish: Result | None = None, role: bool = False,
              usage: bool = False) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        reason = None if finish is None else finish.finish_reason
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        if finish is not None:
            choice["stop_reason"] = finish.stop_reason
        out = {**self._head(obj), "choices": [choice]}
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, r: Result) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], **_usage(r)}


def _usage(r: Result) -> dict:
    out: dict = {"usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                           "total_tokens": r.prompt_tokens + r.completion_tokens},
                 "timing": {"queue_time": r.queue_time, "time_to_first_token": r.time_to_first_token,
                            "e2e_latency": r.e2e_latency}}
    if r.spec is not None:
        out["spec_decode"] = dict(r.spec)
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(engine: ServingEngine, handle, queue: asyncio.Queue, shape: _Shape,
                  include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of one request. Leaving early (the client disconnected: the response task is
    cancelled, or the generator closed) cancels the request in the engine."""
    done = False
    try:
        if shape.chat:
            yield _sse(shape.chunk(role=True, usage=include_usage))
        while True:
            ev = await queue.get()
            if isinstance(ev, Delta):
                yield _sse(shape.chunk(ev.text, usage=include_usage))
            elif isinstance(ev, Finished):
                done = True
                yield _sse(shape.chunk(None, finish=ev.result, usage=include_usage))
                if include_usage:
                    yield _sse(shape.usage_chunk(ev.result))
                yield "data: [DONE]\n\n"
                return
            elif isinstance(ev, Failed):
                done = True
                err = _failure(ev)
                yield _sse(error_body(public_message(err.message), err.kind, err.status))
                yield "data: [DONE]\n\n"
                return
    finally:
        if not done:
            engine.cancel(handle)


def _failure(ev: Failed) -> _HTTPError:
    if ev.reason == "shutdown":
        return _HTTPError(503, ev.message, "service_unavailable")
    return _HTTPError(500, ev.message, "server_error")


def _spec_dict(engine: ServingEngine) -> dict | None:
    spec = engine.spec
    if not spec.enabled:
        return None
    from dataclasses import asdict

    return {k: v for k, v in asdict(spec).items() if v is not None}


def _describe_validation(errors) -> tuple[str, str | None]:
    """One line for pydantic's first error: the field by name (dotted path), and what is wrong with it, without
    the server's own class names."""
    if not errors:
        return "the request body is not valid; send a JSON object", None
    e = errors[0]
    # Union members show up in the path as type tags ('str', 'list[int]'): dropped, the field names stay.
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _is_type_tag(x)]
    field = ".".join(loc) or None
    kind = e.get("type", "")
    msg = re.sub(r" or instance of \w+", "", str(e.get("msg", "")))
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', msg)})", None
    if field is None:
        if kind == "missing":
            return "the request body is empty; send a JSON object", None
        return "the request body must be a JSON object", None
    if kind == "extra_forbidden":
        return f"unknown field {field!r}: remove it (or check its spelling)", field
    if kind == "missing":
        return f"missing field {field!r}", field
    if field == "seed" and kind == "less_than_equal":
        return (f"seed: {msg}: seeds are 32-bit (0 to 2**32 - 1); a larger one is refused, not reduced", field)
    return f"{field}: {msg}", field


def _is_type_tag(x) -> bool:
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "list", "dict", "TextPart"))
