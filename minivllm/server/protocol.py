"""OpenAI's request bodies as pydantic models, and the sampling parameters they map to.

Fields the engine does not support are refused when set to anything but their neutral
value (a 400 naming the field), never silently ignored. Fields that do not change the
output (`user`, `metadata`, ...) are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class BadField(ValueError):
    """A request field with a value we refuse; becomes a 400 with `param` = the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _SamplingRequest(BaseModel):
    """The fields the completions and chat endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    echo: bool = False
    return_token_ids: bool = False  # vLLM's extension: each choice carries its token ids

    def _max_tokens(self, default: int) -> tuple[str, int]:
        if self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return "max_tokens", default

    def check_supported(self) -> None:
        if self.n != 1:
            raise BadField("n", f"n={self.n}: only n=1 is supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadField(name, f"{name}={getattr(self, name)}: not supported (use 0)")
        if self.logprobs not in (None, False):
            raise BadField("logprobs", "logprobs: not supported")
        if self.echo:
            raise BadField("echo", "echo: not supported")
        if self.stream_options is not None and not self.stream:
            raise BadField("stream_options", "stream_options: only allowed with stream=true")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters; a bad value raises BadField naming the request field."""
        self.check_supported()
        name, max_tokens = self._max_tokens(default_max_tokens)
        kwargs: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "max_tokens": max_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
        }
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            message = str(exc)
            # "SamplingParams.temperature=-1: ..." -> the request's own field name
            field = message.removeprefix("SamplingParams.").split("=", 1)[0]
            if field == "max_tokens":
                field = name
            raise BadField(field, message.removeprefix("SamplingParams.")
                           .replace("max_tokens=", f"{name}=", 1)) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] = Field(...)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise BadField("suffix", "suffix: not supported")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None

    def _max_tokens(self, default: int) -> tuple[str, int]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super()._max_tokens(default)

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise BadField("tools", "tools: tool calling is not supported")

    def template_messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]
