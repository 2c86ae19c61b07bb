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
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.prompts import encode_text
from ..engine.structured_outputs import GrammarError, check_grammar
from ..frontend import GenerateRequest, render_chat_prompt
from ..reasoning import REASONING_PARSERS
from .choices import Choices
from .metrics import CONTENT_TYPE, ServerMetrics
from .middleware import ACCESS_KEY, Access, AccessLog, ApiKeyCheck, BodyLimit
from .protocol import (
    BadField,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    template_messages,
)
from .responses import (
    ApiError,
    ChoiceText,
    Chunks,
    Logprobs,
    error_response,
    sse_event,
    validation_error_response,
)
from .tools import DEFAULT_TOOL_PARSER, TOOL_PARSERS, ToolPlan

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
# The largest request body read (--max-request-bytes). A prompt that fills a 128k-token
# context is ~0.5 MB of text (~3 MB if every character is JSON-escaped) or ~1 MB as a
# token-id list: 8 MiB leaves room for those and bounds what one client makes us parse.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
logger = logging.getLogger("minivllm.server")


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
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.add_middleware(AccessLog)  # outermost: refused requests are logged too
    vocab_bound: dict[int, int | None] = {}  # id(tokenizer) -> _chars_per_token

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

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

    def access(http: Request) -> Access:
        return http.scope.get(ACCESS_KEY) or Access()

    def request_id_of(http: Request, prefix: str) -> str:
        """`prefix-<X-Request-Id>` when the client named its request, else a new id."""
        request_id = f"{prefix}-{http.headers.get('x-request-id') or uuid.uuid4().hex}"
        access(http).request_id = request_id
        return request_id

    def account(record: Access, choices: Choices) -> None:
        record.prompt_tokens = choices.num_prompt_tokens
        record.completion_tokens = choices.num_generated_tokens
        record.ttft = choices.ttft

    async def collect(choices: Choices, texts: list[ChoiceText], record: Access) -> None:
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

    async def sse(choices: Choices, texts: list[ChoiceText], chunks: Chunks,
                  record: Access) -> AsyncIterator[bytes]:
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
                    yield sse_event({"error": {"message": f"generation failed: {out.error}",
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
                           choices: Choices, texts: list[ChoiceText], record: Access
                           ) -> StreamingResponse:
        head = {"id": request_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model_name}
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        # As vLLM: running usage on every chunk needs include_usage too.
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        chunks = Chunks(chat, head, include_usage, body.return_token_ids, continuous)
        return StreamingResponse(sse(choices, texts, chunks, record),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def choice_texts(body: Any, chat: bool, request: GenerateRequest, choices: Choices,
                     tools: ToolPlan | None = None) -> list[ChoiceText]:
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
        return [ChoiceText(echo, prompt_ids,
                           reasoning(opens) if chat and reasoning is not None else None,
                           None if body.num_logprobs() is None
                           else Logprobs(client.tokenizer, chat), tools)
                for _ in range(body.n)]

    def whole_response(chat: bool, request_id: str, created: int,
                       choices: Choices, texts: list[ChoiceText]) -> dict[str, Any]:
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
