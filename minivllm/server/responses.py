"""What the server sends back, in OpenAI's shapes: the error body, a streamed response's
SSE chunks, and each choice's text, thinking, tool calls and logprobs."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..frontend import RequestOutput
from ..outputs import TokenLogprob
from ..reasoning import ReasoningParser
from .tools import ToolPlan

# The engine's reasons in OpenAI's vocabulary ("abort": the server stopped the request).
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}
# pydantic's names for the member of a union a value failed (`stop.str`): not a field.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "true or false", dict: "an object"}


class ApiError(Exception):
    """A request the server refuses or fails: raised in a route, answered as OpenAI's
    error body with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


_dumps = orjson.dumps  # compact UTF-8 JSON, as bytes


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + _dumps(payload) + b"\n\n"


class Chunks:
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
        return sse_event(payload)

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
        return sse_event({**self.head, "choices": [], "usage": usage})

    def tool_calls(self, index: int, deltas: list[dict[str, Any]],
                   usage: dict[str, Any] | None = None) -> bytes:
        return self._event({"index": index, "delta": {"tool_calls": deltas},
                            "logprobs": None, "finish_reason": None}, usage)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """A request body that does not parse or validate, as a 400 naming its field."""
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
    return error_response(400, f"{param}: {what} (got {first.get('input')!r})", param=param)


class Logprobs:
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


class ChoiceText:
    """One choice's outputs as its response shows them: the prompt first (`echo`, with
    its logprobs once the engine sent them), the thinking apart from the answer (a
    reasoning parser), the tool calls apart from the content (a chat request's tools),
    the logprobs formatted. `delta()` gives one output's part of a chunk; `add()`
    gathers the whole reply for `message()` / `text()`."""

    def __init__(self, echo: str | None, prompt_ids: list[int] | None,
                 parser: ReasoningParser | None, logprobs: Logprobs | None,
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
