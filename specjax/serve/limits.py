"""What `specjax serve` checks before it reads a request's body: the API key, then the body's size.

`Guard` (plain ASGI middleware) answers 401 from the headers alone, so an unauthenticated request never has its
body read or parsed; then 413 from the Content-Length header before any byte of the body is read, or, for a
body sent in chunks, as soon as the bytes read pass the limit. uvicorn discards the rest of a refused body as it
arrives, without keeping it, so the client still reads the 413. (FastAPI's own max_body_size answers a
declared-too-large body in plain text whatever the app's handlers say, so it is not used.)

`ServerLimits` holds the HTTP-side limits (the engine's own are `runners.serving.EngineOptions`); the server's
CLI sets them (`specjax serve --max-body-bytes ...`).
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Callable, Optional

from starlette.exceptions import HTTPException

from specjax.requests import RequestError
from specjax.serve.protocol import error_body

DEFAULT_MAX_BODY_BYTES = 4 << 20
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key


@dataclass(frozen=True)
class ServerLimits:
    """Limits on what a request may make the server do before it reaches the engine.

    max_body_bytes: the largest request body read; a larger one gets 413 before it is read.
    max_prompt_chars: the most characters a prompt may have (a completion's text, or every string a chat request
        gives its template: contents, names, roles, chat_template_kwargs) before it is tokenized; None derives it
        from the engine's max_prompt_tokens times the longest token of the vocabulary, so no prompt that could fit
        in max_prompt_tokens is refused by it.
    prepare_workers: threads that tokenize and render chat templates (off the event loop).
    max_preparing: requests being tokenized or waiting for a thread at most; more get 429.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: Optional[int] = None
    prepare_workers: int = 2
    max_preparing: int = 64

    def __post_init__(self):
        for name, low in (("max_body_bytes", 64), ("max_prompt_chars", 1), ("prepare_workers", 1),
                          ("max_preparing", 1)):
            value = getattr(self, name)
            if value is None and name == "max_prompt_chars":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RequestError(f"invalid {name}={value!r}: must be an integer >= {low}")


def too_large_message(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes); send a "
            "shorter prompt")


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a body sent in chunks passes the limit; FastAPI's body reader lets an
    HTTPException through, and the app's handler answers it (a JSON 413)."""

    def __init__(self):
        super().__init__(413, "request body too large")


class Guard:
    """ASGI middleware: the API key on every path but /health, then the body-size limit, both before the body is
    read. `refused(reason)` is called for each request it answers itself ('unauthorized', 'too_large',
    'bad_request'); a chunked body past the limit raises `BodyTooLarge` from `receive` instead."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, refused: Callable[[str], None]):
        self.app, self.api_key, self.limit, self.refused = app, api_key, max_body_bytes, refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS and not self._authorized(headers):
            self.refused("unauthorized")
            return await _json(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                               "authentication_error")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            self.refused("too_large")
            return await _json(send, 413, too_large_message(self.limit), "invalid_request_error")
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge()
            return message

        return await self.app(scope, counted, send)

    def _authorized(self, headers: dict) -> bool:
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


async def _json(send, status: int, message: str, kind: str) -> None:
    body = json.dumps(error_body(message, kind, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
