"""The server's ASGI middlewares, plain ASGI (SSE chunks pass straight through): the
access log, the API key check and the request body's size limit."""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from .responses import error_response

ACCESS_KEY = "minivllm.access"  # the ASGI scope key of a request's `Access`
logger = logging.getLogger("minivllm.server")


@dataclass
class Access:
    """What a request's access-log line says besides its status (its route fills it)."""

    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None


class AccessLog:
    """Echoes a request's `X-Request-Id` header on its response, and logs one line per
    request (not /health, /metrics: probes and scrapes) at info level once its response
    has ended: id, status, prompt and completion tokens, time to first token, duration.
    Plain ASGI, like `ApiKeyCheck`: SSE chunks pass straight through."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        logged = scope["path"] not in ("/health", "/metrics")
        if given is None and not logged:
            await self.app(scope, receive, send)
            return
        record = scope[ACCESS_KEY] = Access()
        status = 499  # the client left before the response began
        start = time.monotonic()

        async def send_echoing(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if given is not None:
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      (b"x-request-id", given)]}
            await send(message)

        try:
            await self.app(scope, receive, send_echoing)
        finally:
            if logged:
                ttft = "-" if record.ttft is None else f"{record.ttft:.3f}s"
                logger.info('minivllm serve: "%s %s" %d id=%s prompt_tokens=%d '
                            "completion_tokens=%d ttft=%s duration=%.3fs", scope["method"],
                            scope["path"], status, record.request_id, record.prompt_tokens,
                            record.completion_tokens, ttft, time.monotonic() - start)


class ApiKeyCheck:
    """401 for /v1 requests without `Authorization: Bearer KEY`.

    NOTE: plain ASGI, not `@app.middleware("http")`: that one (Starlette's
    BaseHTTPMiddleware) relays every SSE chunk of a streamed body through a memory
    stream and an extra task, per token per request."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(
                    401, "invalid or missing API key: send the header "
                    "'Authorization: Bearer KEY'", "authentication_error",
                    code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a request body over `limit` bytes: decided from Content-Length before any
    of it is read (a body without one is counted as it arrives). The refused body is read
    and dropped, never parsed: a client still sending it would otherwise see the
    connection reset instead of the answer."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                await self._refuse(receive, send, scope, f"{int(length):,} bytes")
            else:
                await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(receive, send, scope, f"over {self.limit:,} bytes",
                                   more=message.get("more_body", False))
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return body
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Any, send: Any, scope: Any, size: str,
                      more: bool = True) -> None:
        while more:
            message = await receive()
            more = message["type"] == "http.request" and message.get("more_body", False)
        response = error_response(
            413, f"the request body is {size}: over this server's limit of {self.limit:,} "
            "bytes (--max-request-bytes)", code="request_too_large")
        await response(scope, receive, send)
