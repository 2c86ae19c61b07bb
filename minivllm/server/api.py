"""The OpenAI-compatible HTTP face of an `EngineClient` (FastAPI).

Routes: GET /health (503 while the engine loads), GET /metrics, GET /v1/models,
POST /v1/completions, POST /v1/chat/completions (non-streaming, or SSE chunks ending in
`data: [DONE]`), and vLLM's POST /tokenize, POST /detokenize, GET /version. A request's
`X-Request-Id` header is echoed on its response and names it (`chatcmpl-<id>`).
Every error is OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`
with its HTTP status; a request that fails never stops the server.

Admission happens here, before the engine hears of a request: a body over the size limit
is refused (413) before it is parsed; the chat template and the tokenizer run on a worker
thread of this process (never on the engine's thread, where a slow template or a huge
prompt would stall every stream), and the prompt's length is checked against the
context there; the engine gets token ids.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.llm_engine import encode_text
from ..engine.structured_outputs import GrammarError, check_grammar
from ..frontend import GenerateRequest, RequestOutput, render_chat_prompt
from ..outputs import TokenLogprob
from ..reasoning import REASONING_PARSERS, ReasoningParser
from .choices import Choices
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    BadField,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    template_messages,
)
from .tools import DEFAULT_TOOL_PARSER, TOOL_PARSERS, ToolPlan

# The engine's reasons in OpenAI's vocabulary ("abort": the server stopped the request).
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}
# The largest request body read (--max-request-bytes). A prompt that fills a 128k-token
# context is ~0.5 MB of text (~3 MB if every character is JSON-escaped) or ~1 MB as a
# token-id list: 8 MiB leaves room for those and bounds what one client makes us parse.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# pydantic's names for the member of a union a value failed (`stop.str`): not a field.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "true or false", dict: "an object"}
logger = logging.getLogger("minivllm.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


_dumps = orjson.dumps  # compact UTF-8 JSON, as bytes


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(payload) + b"\n\n"


class _Chunks:
    """The SSE events of one streamed response, in OpenAI's chunk format, as bytes.

    An event carries all the text a choice gained since its previous one (one engine
    step's, or several merged when this process is behind). NOTE: it is glued from
    preformatted halves around the new text: encoding the nested chunk per event costs
    the event loop several times more.
    """

    def __init__(self, chat: bool, head: dict[str, Any], include_usage: bool,
                 with_ids: bool, continuous_usage: bool = False) -> None:
        self.chat, self.head = chat, head
        self.include_usage, self.with_ids = include_usage, with_ids
        self.continuous_usage = continuous_usage  # every chunk carries the usage so far
        self._open = b"data: " + _dumps(head)[:-1]  # '{"id":...,"model":"..."' without "}"
        self._pres: dict[int, bytes] = {}  # choice index -> the half before the text
        if chat:
            self._mid = b'},"logprobs":null,"finish_reason":null'
        else:
            self._mid = b',"logprobs":null,"finish_reason":null'
        self._post = b"}]" + (b',"usage":null' if include_usage else b"") + b"}\n\n"

    def _pre(self, index: int) -> bytes:
        pre = self._pres.get(index)
        if pre is None:
            field = b'"delta":{"content":' if self.chat else b'"text":'
            pre = self._pres[index] = (self._open + b',"choices":[{"index":'
                                       + str(index).encode() + b"," + field)
        return pre

    def text(self, index: int, text: str, token_ids: list[int],
             usage: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None,
             reasoning: str | None = None) -> bytes:
        """Choice `index`'s new text (with `reasoning`: its new thinking, apart)."""
        if logprobs is not None or reasoning is not None:
            choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                      "finish_reason": None}
            if self.chat:
                delta = choice["delta"] = {"content": text} if text else {}
                if reasoning is not None:
                    delta["reasoning_content"] = reasoning
            else:
                choice["text"] = text
            if self.with_ids:
                choice["token_ids"] = token_ids
            return self._event(choice, usage)
        ids = b',"token_ids":' + _dumps(token_ids) if self.with_ids else b""
        post = self._post if usage is None else b'}],"usage":' + _dumps(usage) + b"}\n\n"
        return self._pre(index) + _dumps(text) + self._mid + ids + post

    def _event(self, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
        payload = {**self.head, "choices": [choice]}
        if self.include_usage:
            payload["usage"] = usage
        return _sse(payload)

    def opening(self, index: int, usage: dict[str, Any] | None = None) -> bytes:
        if not self.chat:
            return b""
        return self._event({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}, usage)

    def finish(self, index: int, reason: str, usage: dict[str, Any] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        if self.with_ids:
            choice["token_ids"] = []
        return self._event(choice, usage)

    def usage(self, usage: dict[str, int]) -> bytes:
        return _sse({**self.head, "choices": [], "usage": usage})

    def tool_calls(self, index: int, deltas: list[dict[str, Any]],
                   usage: dict[str, Any] | None = None) -> bytes:
        return self._event({"index": index, "delta": {"tool_calls": deltas},
                            "logprobs": None, "finish_reason": None}, usage)


ACCESS_KEY = "minivllm.access"  # the ASGI scope key of a request's `_Access`


@dataclass
class _Access:
    """What a request's access-log line says besides its status (its route fills it)."""

    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None


class _AccessLog:
    """Echoes a request's `X-Request-Id` header on its response, and logs one line per
    request (not /health, /metrics: probes and scrapes) at info level once its response
    has ended: id, status, prompt and completion tokens, time to first token, duration.
    Plain ASGI, like `_ApiKeyCheck`: SSE chunks pass straight through."""

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
        record = scope[ACCESS_KEY] = _Access()
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


class _Logprobs:
    """The engine's logprobs of one request in OpenAI's shapes: chat's `{"content": [...]}`
    or completions' `{tokens, token_logprobs, top_logprobs, text_offset}`. A token's text
    is that token decoded alone (a token holding part of a character shows U+FFFD)."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # completions: where the next token starts in the text
        self._texts: dict[int, str] = {}

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def format(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return {"content": [
                {**self._entry(p.token_id, p.logprob),
                 "top_logprobs": [self._entry(t, v) for t, v in p.top.items()]}
                for p in logprobs]}
        tokens = [self._text(p.token_id) for p in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": [p.logprob for p in logprobs],
                "top_logprobs": [{self._text(t): v for t, v in p.top.items()}
                                 for p in logprobs],
                "text_offset": offsets}

    def prompt(self, token_ids: list[int], logprobs: list[TokenLogprob | None]
               ) -> dict[str, Any]:
        """Completions' echoed prompt: its tokens, each one's logprob (None for the
        first, which nothing predicts) and top tokens, before the generated ones."""
        tokens = [self._text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens,
                "token_logprobs": [None if p is None else p.logprob for p in logprobs],
                "top_logprobs": [None if p is None else
                                 {self._text(t): v for t, v in p.top.items()}
                                 for p in logprobs],
                "text_offset": offsets}


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two formatted logprobs runs of one choice as one (their lists joined)."""
    if a is None or b is None:
        return a if b is None else b
    return {key: a[key] + b[key] for key in a}


class _ChoiceText:
    """One choice's outputs as its response shows them: the prompt first (`echo`, with
    its logprobs once the engine sent them), the thinking apart from the answer (a
    reasoning parser), the tool calls apart from the content (a chat request's tools),
    the logprobs formatted. `delta()` gives one output's part of a chunk; `add()`
    gathers the whole reply for `message()` / `text()`."""

    def __init__(self, echo: str | None, prompt_ids: list[int] | None,
                 parser: ReasoningParser | None, logprobs: _Logprobs | None,
                 tools: ToolPlan | None = None) -> None:
        self.echo, self.prompt_ids = echo, prompt_ids
        self.parser, self.formatter = parser, logprobs
        self.tools = None if tools is None else tools.stream()
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: dict[str, Any] | None = None
        # Shown as the engine sent it (the common case, per token: `delta` is skipped).
        self.plain = echo is None and parser is None and logprobs is None and tools is None

    def finish_reason(self, engine_reason: str | None) -> str:
        """OpenAI's finish reason: a reply that called tools stops with "tool_calls"."""
        reason = FINISH_REASONS.get(engine_reason or "", "stop")
        if reason == "stop" and self.tools is not None and self.tools.calls:
            return "tool_calls"
        return reason

    def delta(self, out: RequestOutput, prompt_logprobs: list[TokenLogprob | None] | None
              ) -> tuple[str, str | None, dict[str, Any] | None, list[dict[str, Any]]]:
        """(answer text, thinking text or None, logprobs or None, tool-call deltas) of
        one output."""
        text, thinking, lps = self._parts(out, prompt_logprobs)
        if self.tools is None:
            return text, thinking, lps, []
        text, calls = self.tools.feed(text, out.finished)
        return text, thinking, lps, calls

    def _parts(self, out: RequestOutput, prompt_logprobs: list[TokenLogprob | None] | None
               ) -> tuple[str, str | None, dict[str, Any] | None]:
        text = out.text
        lps = None
        if self.echo is not None and (out.token_ids or out.finished):
            text = self.echo + text
            self.echo = None
            if self.formatter is not None and prompt_logprobs is not None:
                lps = self.formatter.prompt(self.prompt_ids or [], prompt_logprobs)
        if self.formatter is not None and out.token_ids:
            lps = _joined(lps, self.formatter.format(out.logprobs or []))
        if self.parser is None:
            return text, None, lps
        segments = self.parser.feed(text)
        if out.finished:
            segments += self.parser.finish()
        answer = "".join(t for kind, t in segments if kind == "answer")
        thinking = "".join(t for kind, t in segments if kind == "think")
        return answer, thinking or None, lps

    def add(self, out: RequestOutput, prompt_logprobs: list[TokenLogprob | None] | None
            ) -> None:
        text, thinking, lps, _ = self.delta(out, prompt_logprobs)
        self.content.append(text)
        if thinking:
            self.reasoning.append(thinking)
        self.logprobs = _joined(self.logprobs, lps)

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.parser is not None:
            message["reasoning_content"] = "".join(self.reasoning) or None
        if self.tools is not None and self.tools.calls:
            message["content"] = message["content"] or None
            message["tool_calls"] = [call.as_openai() for call in self.tools.calls]
        return {"message": message}

    def text(self) -> dict[str, Any]:
        return {"text": "".join(self.content)}


class _ApiKeyCheck:
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


class _BodyLimit:
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


def _chars_per_token(tokenizer: Any) -> int | None:
    """The most characters one token stands for (the longest vocabulary entry), or None
    if the tokenizer does not list its vocabulary. A text of C characters is at least
    C / this many tokens: a prompt far over the context is refused without tokenizing."""
    try:
        return max(len(token) for token in tokenizer.get_vocab()) or None
    except Exception:  # noqa: BLE001 - no vocabulary to read: tokenize every prompt
        return None


def build_app(client: Any, *, model_name: str, api_key: str | None = None,
              max_model_len: int | None = None, trust_request_chat_template: bool = False,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              tool_call_parser: str = DEFAULT_TOOL_PARSER,
              reasoning_parser: str | None = None) -> FastAPI:
    """The app around a started client (`EngineFrontend`); `model_name` is what
    requests must name in `model` and what /v1/models lists. `client.tokenizer`, where
    the client has one, tokenizes prompts here (on worker threads). `reasoning_parser`
    (a `REASONING_PARSERS` name) returns chat replies' thinking as `reasoning_content`."""
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={reasoning_parser!r}: not one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    reasoning = REASONING_PARSERS.get(reasoning_parser or "")
    app = FastAPI(title="minivllm", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(client, model_name)

    def context_len() -> int:
        """The context length: the engine's, known once it has loaded."""
        info = client.info
        return max_model_len or (info.max_len if info is not None else 4096)

    def loading() -> bool:
        return bool(getattr(client, "loading", False))
    created = int(time.time())
    app.state.client = client
    app.state.metrics = metrics

    if api_key is not None:
        app.add_middleware(_ApiKeyCheck, api_key=api_key)
    app.add_middleware(_BodyLimit, limit=max_request_bytes)
    app.add_middleware(_AccessLog)  # outermost: refused requests are logged too
    vocab_bound: dict[int, int | None] = {}  # id(tokenizer) -> _chars_per_token

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('msg', '')}")
        def field(error: dict[str, Any]) -> str:
            loc = [str(x) for x in error.get("loc", ()) if x != "body"]
            return ".".join(x for x in loc if x.lower() not in _UNION_TAGS and "[" not in x)

        param = field(first)
        if not param:
            value = first.get("input")
            got = "nothing" if value is None else _JSON_KINDS.get(type(value), "a value")
            return error_response(400, "the request body must be a JSON object with the "
                                  f"request's fields (got {got})")
        if first.get("type") == "missing":
            return error_response(400, f"{param}: this field is required", param=param)
        # A union's members each fail: "a valid string; a valid list".
        whats = [e.get("msg", "invalid value") for e in errors if field(e) == param]
        what = "; ".join(dict.fromkeys(whats))
        return error_response(400, f"{param}: {what} (got {first.get('input')!r})",
                              param=param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_)

    @app.get("/health")
    async def health() -> Response:
        if loading():
            return error_response(503, "the engine is loading", "server_error",
                                  code="engine_loading")
        if client.error is not None:
            return error_response(503, f"the engine stopped: {client.error}", "server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        check_model(model_name)  # 503 while the engine loads: its context is not known yet
        info = client.info
        card = {"id": model_name, "object": "model", "created": created,
                "owned_by": "minivllm", "root": info.model if info else model_name,
                "max_model_len": context_len()}
        return {"object": "list", "data": [card]}

    def check_model(name: str) -> None:
        """The model is ours and ready (requests sent while it loads get 503)."""
        if loading():
            raise ApiError(503, "the engine is loading: retry once /health answers 200",
                           "server_error", code="engine_loading")
        if name != model_name:
            raise ApiError(404, f"The model `{name}` does not exist (this server serves "
                           f"`{model_name}`).", "not_found_error", "model", "model_not_found")

    async def start(request: GenerateRequest, prompt_field: str, n: int = 1) -> Choices:
        """Submit (the first of `n` choices); wait until the engine accepted (or
        refused) it."""
        choices = Choices(client, request, n, metrics.request)
        first = await choices.start()
        if first.finished and not first.accepted:  # refused, or lost with the engine
            if client.error is not None:
                raise ApiError(503, f"the engine stopped: {client.error}", "server_error")
            message = first.error or "the request was refused"
            if not first.rejected:
                raise ApiError(503, f"the request was lost: {message}", "server_error")
            param = prompt_field if message.startswith("prompt") else None
            raise ApiError(400, message, param=param)
        return choices

    def params_of(body: Any) -> Any:
        """The request's sampling parameters, every field checked (before any tokenizing);
        `max_tokens` is settled by `admit` once the prompt's length is known."""
        unknown = body.unknown_fields()
        if unknown:
            logger.warning("minivllm serve: ignored request fields unknown to this server: "
                           "%s", ", ".join(unknown))
        try:
            return body.sampling_params(body.requested_max_tokens()[1] or context_len())
        except BadField as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    async def check_constraint(params: Any, field: str) -> None:
        """A 400 naming `field` for an output constraint that cannot be compiled (parsed
        on a worker thread; the engine compiles it against the vocabulary itself)."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            await asyncio.to_thread(check_grammar, spec)
        except GrammarError as exc:
            raise ApiError(400, f"{field}: cannot be compiled: {exc.reason}",
                           param=field) from None

    def tokenize(tokenizer: Any, prompt: str | None, messages: list[dict[str, str]] | None,
                 template_kwargs: dict[str, Any], field: str) -> list[int]:
        """The prompt's token ids (on a worker thread); a text that cannot fit the context
        whatever it tokenizes to is refused without tokenizing it."""
        texts = [prompt] if messages is None else [m["content"] for m in messages]
        max_len = context_len()
        key = id(tokenizer)
        if key not in vocab_bound:
            vocab_bound[key] = _chars_per_token(tokenizer)
        bound = vocab_bound[key]
        chars = sum(len(t or "") for t in texts)
        if bound is not None and chars // bound >= max_len:
            raise ApiError(400, f"{field}: {chars:,} characters is at least "
                           f"{chars // bound:,} tokens, and this model's maximum context "
                           f"length is {max_len} tokens. Please reduce the length of the "
                           f"{field}.", param=field)
        try:
            if messages is not None:
                prompt = render_chat_prompt(tokenizer, messages, **template_kwargs)
            assert prompt is not None
            return encode_text(tokenizer, prompt)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error, say: the request's fault
            message = str(exc).removeprefix("prompt: ")
            raise ApiError(400, f"{field}: {message}", param=field) from None

    async def admit(body: Any, params: Any, request_id: str, field: str,
                    prompt: str | list[int] | None = None,
                    messages: list[dict[str, str]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> GenerateRequest:
        """The request for the engine: tokenized here, its length checked, `max_tokens`
        settled (unset: what the context leaves, as vLLM does)."""
        kwargs = template_kwargs or {}
        tokenizer = getattr(client, "tokenizer", None)  # None: the engine tokenizes
        ids: list[int] | None = None
        if isinstance(prompt, list):
            ids = prompt
        elif tokenizer is not None:
            ids = await asyncio.to_thread(tokenize, tokenizer, prompt, messages, kwargs, field)
        name, requested = body.requested_max_tokens()
        if ids is None:  # no tokenizer here: the engine tokenizes and caps the length
            return GenerateRequest(request_id, params, prompt=prompt, messages=messages,
                                   chat_template_kwargs=kwargs)
        n = len(ids)
        max_len = context_len()
        if n >= max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                           f"However, your request has {n} input tokens ({field}). Please "
                           f"reduce the length of the {field}.", param=field)
        if requested is not None and n + requested > max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                           f"However, you requested {n + requested} tokens ({n} in the "
                           f"{field}, {requested} in the completion). Please reduce the "
                           f"length of the {field} or completion.", param=name)
        params.max_tokens = requested if requested is not None else max_len - n
        try:
            params.validate()
        except ValueError as exc:  # min_tokens over what the context leaves, say
            raise ApiError(400, str(exc).removeprefix("SamplingParams."),
                           param=str(exc).removeprefix("SamplingParams.").split("=")[0]
                           ) from None
        return GenerateRequest(request_id, params, prompt=ids)

    def access(http: Request) -> _Access:
        return http.scope.get(ACCESS_KEY) or _Access()

    def request_id_of(http: Request, prefix: str) -> str:
        """`prefix-<X-Request-Id>` when the client named its request, else a new id."""
        request_id = f"{prefix}-{http.headers.get('x-request-id') or uuid.uuid4().hex}"
        access(http).request_id = request_id
        return request_id

    def account(record: _Access, choices: Choices) -> None:
        record.prompt_tokens = choices.num_prompt_tokens
        record.completion_tokens = choices.num_generated_tokens
        record.ttft = choices.ttft

    async def collect(choices: Choices, texts: list[_ChoiceText], record: _Access) -> None:
        """Every choice's whole reply, gathered into `texts`."""
        stream = choices.stream()
        try:
            async for choice, out in stream:
                texts[choice.index].add(out, choices.prompt_logprobs)
        finally:
            await stream.aclose()
            account(record, choices)
        failed = next((c for c in choices.choices if c.finish_reason == "error"), None)
        if failed is not None:
            status = 503 if client.error is not None else 500
            raise ApiError(status, f"generation failed: {failed.error}", "server_error")

    async def until_disconnect(http: Request, work: Any) -> Any:
        """Await `work`, cancelling it (which aborts its request) if the client leaves."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                task.cancel()
                raise ApiError(499, "the client closed the connection")

    async def sse(choices: Choices, texts: list[_ChoiceText], chunks: _Chunks,
                  record: _Access) -> AsyncIterator[bytes]:
        """The SSE body. Cancelled when the client goes away: closing the stream then
        aborts every choice's request in the engine (their blocks are freed on the next
        step)."""
        running = choices.usage if chunks.continuous_usage else (lambda: None)
        stream = choices.stream()
        try:
            for index in range(len(texts)):
                opening = chunks.opening(index, running())
                if opening:
                    yield opening
            async for choice, out in stream:
                index = choice.index
                if out.finish_reason == "error":
                    # Then why (OpenAI's client raises on it).
                    yield chunks.finish(index, "error", running())
                    yield _sse({"error": {"message": f"generation failed: {out.error}",
                                          "type": "server_error", "param": None,
                                          "code": None}})
                    break
                shape = texts[index]
                calls: list[dict[str, Any]] = []
                if shape.plain:
                    text, thinking, lps = out.text, None, None
                else:
                    text, thinking, lps, calls = shape.delta(out, choices.prompt_logprobs)
                if text or thinking or (chunks.with_ids and out.token_ids):
                    yield chunks.text(index, text, out.token_ids, running(), lps, thinking)
                if calls:
                    yield chunks.tool_calls(index, calls, running())
                if out.finished:
                    yield chunks.finish(index, shape.finish_reason(out.finish_reason),
                                        running())
            if chunks.include_usage:
                yield chunks.usage(choices.usage())
            yield b"data: [DONE]\n\n"
        finally:
            await stream.aclose()
            account(record, choices)

    def streaming_response(body: Any, chat: bool, request_id: str, created: int,
                           choices: Choices, texts: list[_ChoiceText], record: _Access
                           ) -> StreamingResponse:
        head = {"id": request_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model_name}
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        # As vLLM: running usage on every chunk needs include_usage too.
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        chunks = _Chunks(chat, head, include_usage, body.return_token_ids, continuous)
        return StreamingResponse(sse(choices, texts, chunks, record),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def choice_texts(body: Any, chat: bool, request: GenerateRequest, choices: Choices,
                     tools: ToolPlan | None = None) -> list[_ChoiceText]:
        """How each of the request's choices is shown: with the echoed prompt
        (completions' `echo`), the thinking apart (`--reasoning-parser`, chat), the
        logprobs in the endpoint's shape."""
        echo: str | None = None
        prompt_ids = request.prompt if isinstance(request.prompt, list) else None
        if getattr(body, "echo", False):
            echo = (body.prompt if isinstance(body.prompt, str)
                    else client.tokenizer.decode(body.prompt))
        # Whether the templated prompt ends inside the thinking block (the engine says
        # so when it templated the prompt; here, the prompt's last tokens do).
        opens = choices.opens_thinking
        if chat and reasoning is not None and prompt_ids is not None:
            opens = client.tokenizer.decode(prompt_ids[-16:]).rstrip().endswith("<think>")
        return [_ChoiceText(echo, prompt_ids,
                            reasoning(opens) if chat and reasoning is not None else None,
                            None if body.num_logprobs() is None
                            else _Logprobs(client.tokenizer, chat), tools)
                for _ in range(body.n)]

    def whole_response(chat: bool, request_id: str, created: int,
                       choices: Choices, texts: list[_ChoiceText]) -> dict[str, Any]:
        """A non-streamed reply: every choice (`text` or `message`) and the usage."""
        out = []
        for choice, text in zip(choices.choices, texts, strict=True):
            lps = text.logprobs
            if lps is None and text.formatter is not None:
                lps = text.formatter.format([])
            out.append({"index": choice.index, **(text.message() if chat else text.text()),
                        "logprobs": lps,
                        "finish_reason": text.finish_reason(choice.finish_reason)})
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model_name, "choices": out,
                "usage": choices.usage()}

    async def respond(body: Any, http: Request, chat: bool, request_id: str,
                      request: GenerateRequest, field: str, tools: ToolPlan | None = None
                      ) -> Any:
        choices = await start(request, field, body.n)
        texts = choice_texts(body, chat, request, choices, tools)
        now = int(time.time())
        if not body.stream:
            await until_disconnect(http, collect(choices, texts, access(http)))
            return whole_response(chat, request_id, now, choices, texts)
        return streaming_response(body, chat, request_id, now, choices, texts, access(http))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Any:
        request_id = request_id_of(http, "chatcmpl")
        check_model(body.model)
        params = params_of(body)
        try:
            template_kwargs = body.template_kwargs(trust_request_chat_template)
            tools = body.tool_plan()
        except BadField as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        if tools is not None:
            template_kwargs["tools"] = tools.tools
            tools.parser = TOOL_PARSERS[tool_call_parser]()
        await check_constraint(params, body.structured_outputs()[0])
        request = await admit(body, params, request_id, "messages",
                              messages=body.template_messages(),
                              template_kwargs=template_kwargs)
        return await respond(body, http, True, request_id, request, "messages", tools)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Any:
        request_id = request_id_of(http, "cmpl")
        check_model(body.model)
        params = params_of(body)
        await check_constraint(params, body.structured_outputs()[0])
        request = await admit(body, params, request_id, "prompt", prompt=body.prompt)
        return await respond(body, http, False, request_id, request, "prompt")

    def tokenizer_for(model: str | None) -> Any:
        """The tokenizer requests are tokenized with (`model`, when given, must be ours)."""
        if model is not None:
            check_model(model)
        elif loading():
            check_model(model_name)  # the loading 503
        tokenizer = getattr(client, "tokenizer", None)
        if tokenizer is None:
            raise ApiError(501, "this server has no copy of the model's tokenizer",
                           "server_error")
        return tokenizer

    @app.post("/tokenize")
    async def tokenize_text(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: the token ids a prompt (or chat messages, templated) costs."""
        tokenizer = tokenizer_for(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        try:
            kwargs = body.template_kwargs(trust_request_chat_template)
        except BadField as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

        def run() -> list[int]:
            prompt = body.prompt
            if body.messages is not None:
                prompt = render_chat_prompt(tokenizer, template_messages(body.messages),
                                            **kwargs)
            return encode_text(tokenizer, prompt or "")

        try:
            ids = await asyncio.to_thread(run)
        except ValueError as exc:  # a prompt that tokenizes to nothing
            field = "prompt" if body.messages is None else "messages"
            raise ApiError(400, f"{field}: {str(exc).removeprefix('prompt: ')}",
                           param=field) from None
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": context_len(), "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's: the text of token ids."""
        tokenizer = tokenizer_for(body.model)
        size = len(tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < size), None)
        if bad is not None:
            raise ApiError(400, f"tokens: {bad} is not a token id of this model (0 to "
                           f"{size - 1})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("minivllm")}

    return app
