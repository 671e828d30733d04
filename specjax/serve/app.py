"""The OpenAI-compatible ASGI app of `specjax serve` (FastAPI), over the serving engine (`runners.serving`).

Routes: POST /v1/completions and /v1/chat/completions (with `stream: true` as server-sent events, and
`stream_options.include_usage`), GET /v1/models, /health, /metrics (Prometheus). With an API key every route but
/health needs `Authorization: Bearer KEY`.

Each response carries, next to OpenAI's `usage`, `timing` (queue_time, time_to_first_token, e2e_latency, seconds)
and, with speculation on, `spec_decode`: drafted, accepted, acceptance_rate, mean_accepted_length (tau),
tokens_per_forward, verify_steps, per_position_acceptance / _accepted / _drafted (`requests.spec_metrics`). A
streamed response carries them in its usage chunk (include_usage).

The event loop never runs JAX: it tokenizes, submits to the engine and waits on an asyncio queue that the
engine thread feeds (`loop.call_soon_threadsafe`). A client that disconnects (a stream closed, or a waiting
non-streamed request whose connection drops) cancels its request, which frees its slot at the next step chunk.

Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for a malformed body (the field
named; unknown fields too) or a request the server cannot serve, 401 without the key, 404 for another model's
name, 429 when the queue is full, 503 while shutting down, 500 when a generation fails (the rest keep running).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjax.errors import SpecjaxError
from specjax.requests import encode_prompt
from specjax.runners.serving import (Delta, EngineStoppedError, Failed, Finished, QueueFullError, Result,
                                     ServingEngine)
from specjax.serve.metrics import CONTENT_TYPE, ServerMetrics
from specjax.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body

POLL_DISCONNECT_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def create_app(engine: ServingEngine, model_name: str, *, api_key: str | None = None,
               metrics: ServerMetrics | None = None) -> FastAPI:
    """The app over a started engine. model_name: the name /v1/models lists and requests may give as `model`;
    api_key: None (no auth) or the bearer token every route but /health needs; metrics: the engine's observer
    (a new one, reading only the gauges, when None)."""
    if metrics is None:
        metrics = ServerMetrics(engine)
    created = int(time.time())
    app = FastAPI(title="specjax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics = engine, metrics

    def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, status, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        metrics.failed("bad_request")
        message, param = _describe_validation(exc.errors())
        return error(400, message, "invalid_request_error", param)

    @app.exception_handler(_HTTPError)
    async def http_error(request: Request, exc: _HTTPError):
        return error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), "invalid_request_error")

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise _HTTPError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                             "authentication_error")

    @app.get("/health")
    async def health():
        if engine.alive:
            return {"status": "ok"}
        why = engine.failure or "shutting down"
        return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)

    api = APIRouter(dependencies=[Depends(authorize)])

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

    def bad_request(e: Exception) -> _HTTPError:
        metrics.failed("bad_request")
        return _HTTPError(400, str(e), "invalid_request_error")

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        try:
            prompt = body.single_prompt()
            sp = body.sampling_params(body.max_tokens, 16)
            ids = encode_prompt(engine.tokenizer, engine.llm.config.vocab_size, prompt, False)
            sp = engine.check(ids, sp)
        except (SpecjaxError, ValueError) as e:
            raise bad_request(e) from None
        return await _respond(request, body, ids, sp, "text_completion", f"cmpl-{uuid.uuid4().hex}")

    @api.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        try:
            sp = body.sampling_params(body.requested_max_tokens(), engine.options.max_tokens)
            ids = encode_prompt(engine.tokenizer, engine.llm.config.vocab_size, [m.as_dict() for m in body.messages],
                                True, add_generation_prompt=body.add_generation_prompt,
                                chat_template_kwargs=body.chat_template_kwargs)
            sp = engine.check(ids, sp)
        except (SpecjaxError, ValueError) as e:
            raise bad_request(e) from None
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
                yield _sse(error_body(err.message, err.kind, err.status))
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
    """One line for pydantic's first error: the field by name (dotted path), and what is wrong with it."""
    if not errors:
        return "the request body is not valid", None
    e = errors[0]
    # Union members show up in the path as type tags ('str', 'list[int]'): dropped, the field names stay.
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _is_type_tag(x)]
    field = ".".join(loc) or None
    kind = e.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})", None
    if kind == "extra_forbidden":
        return f"unknown field {field!r}: remove it (or check its spelling)", field
    if kind == "missing":
        return f"missing field {field!r}", field
    if field is None:
        return f"the request body is not valid: {e.get('msg')}; send a JSON object", None
    return f"{field}: {e.get('msg')}", field


def _is_type_tag(x) -> bool:
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "list", "dict", "TextPart"))
