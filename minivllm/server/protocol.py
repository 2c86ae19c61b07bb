"""OpenAI's request bodies as pydantic models, and the sampling parameters they map to.

Fields the engine does not support are refused when set to anything but their neutral
value (a 400 naming the field), never silently ignored. Fields that do not change the
output (`user`, `metadata`, ...) are accepted and ignored, as OpenAI-compatible servers
do; fields nobody here knows are ignored too (as vLLM does), and `unknown_fields()` names
them for the server's warning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from ..sampling_params import SamplingParams, StructuredOutputsParams
from .errors import BadField


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: running usage on every chunk


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


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them (OpenAI's `developer` is a system turn;
    an assistant's `tool_calls` and a tool reply's `tool_call_id` pass through)."""
    from .tools import template_fields

    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
             **template_fields(m)} for m in messages]


# Fields (OpenAI's or vLLM's extensions) that change the output and that the engine cannot
# honour: accepted only at their neutral values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "prompt_logprobs": (None,),
    "guided_whitespace_pattern": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
}
# Accepted and ignored without a word: they do not change the output.
_HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                       "skip_special_tokens", "spaces_between_special_tokens",
                       "guided_decoding_backend"})
# vLLM's older spellings of the `structured_outputs` members.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# apply_chat_template()'s own arguments, which the server sets: a request may not.
_TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


MAX_LOGPROBS = 20  # the most top tokens a request may ask for (vLLM's default cap)
MAX_CHOICES = 64  # the most choices (`n`) one request may ask for


def _count(name: str, value: Any) -> int | None:
    """A count of top logprobs: None, or an int in [0, MAX_LOGPROBS]."""
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= MAX_LOGPROBS:
        raise BadField(name, f"{name}={value!r}: must be an integer from 0 to {MAX_LOGPROBS}")
    return value


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    # `type(...) is bool` keeps `True` from passing as 1 (best_of=true is not best_of=1).
    return any(value == a and (type(value) is bool) == (type(a) is bool) for a in allowed)


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
    repetition_penalty: float | None = None  # vLLM's extension, as in transformers
    min_tokens: int = 0  # vLLM's extension
    response_format: dict[str, Any] | None = None
    logprobs: Any = None
    echo: bool = False
    return_token_ids: bool = False  # vLLM's extension: each choice carries its token ids

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """The completion-length field the request used, and its value (None: unset)."""
        return "max_tokens", self.max_tokens

    def num_logprobs(self) -> int | None:
        """How many top tokens each generated token's logprobs list (None: no logprobs)."""
        return None if self.logprobs is False else _count("logprobs", self.logprobs)

    def unknown_fields(self) -> list[str]:
        """Fields nobody here knows (ignored, as vLLM does; the server logs them)."""
        extra = self.model_extra or {}
        return sorted(k for k in extra
                      if k not in _NEUTRAL and k not in _HARMLESS and k != "best_of")

    def check_supported(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise BadField("n", f"n={self.n}: must be an integer from 1 to {MAX_CHOICES}")
        extra = self.model_extra or {}
        best_of = extra.get("best_of")
        if best_of is not None and best_of != self.n:
            # vLLM's best_of samples that many and returns the n most likely: not done here.
            raise BadField("best_of", f"best_of={best_of!r}: only best_of equal to n "
                           f"(n={self.n}) is supported (no picking the best of more samples)")
        for name, allowed in _NEUTRAL.items():
            if name in extra and not _neutral(extra[name], allowed):
                raise BadField(name, f"{name}={extra[name]!r}: not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise BadField("stream_options", "stream_options: only allowed with stream=true")

    def structured_outputs(self) -> tuple[str, StructuredOutputsParams | None]:
        """The request's output constraint and the field it came in (`response_format`,
        vLLM's `structured_outputs` or a `guided_*` field); at most one may be given."""
        extra = self.model_extra or {}
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt != {"type": "text"}:
            given.append(("response_format", _response_format(fmt)))
        so = extra.get("structured_outputs")
        if so is not None:
            if not isinstance(so, dict) or not so:
                raise BadField("structured_outputs", f"structured_outputs={so!r:.200}: must be "
                               "an object with one of " + ", ".join(_STRUCTURED_KEYS))
            unknown = sorted(k for k in so if k not in _STRUCTURED_KEYS)
            if unknown:
                raise BadField(f"structured_outputs.{unknown[0]}",
                               f"structured_outputs.{unknown[0]}: not supported (give one of "
                               + ", ".join(_STRUCTURED_KEYS) + ")")
            given.append(("structured_outputs", so))
        for name, kind in _GUIDED.items():
            if extra.get(name) is not None:
                given.append((name, {kind: extra[name]}))
        if not given:
            return "", None
        if len(given) > 1:
            names = " and ".join(name for name, _ in given)
            raise BadField(given[1][0], f"{names}: give only one output constraint")
        field, kwargs = given[0]
        try:
            return field, StructuredOutputsParams(**kwargs)
        except ValueError as exc:
            message = str(exc)
            raise BadField(field, message if message.startswith(field)
                           else f"{field}: {message}") from None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters with `max_tokens` (the request's, or the server's
        default); a bad value raises BadField naming the request field."""
        self.check_supported()
        name = self.requested_max_tokens()[0]
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
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": (1.0 if self.repetition_penalty is None
                                   else self.repetition_penalty),
            "min_tokens": self.min_tokens,
            "logprobs": self.num_logprobs(),
            "structured_outputs": self.structured_outputs()[1],
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


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's `response_format` as StructuredOutputsParams' arguments."""
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadField("response_format", "response_format.json_schema.schema: a JSON "
                           "schema (an object) is required with type json_schema")
        return {"json": schema}
    raise BadField("response_format", f"response_format.type={kind!r}: must be 'text', "
                   "'json_object' or 'json_schema'")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] = Field(...)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_or_ids(cls, value: Any) -> Any:
        """A string or a list of token ids; anything else is refused naming the bad item."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise PydanticCustomError(
                "prompt", "must be a string or a list of token ids (integers)")
        for i, item in enumerate(value):
            if type(item) is not int:
                raise PydanticCustomError(
                    "prompt", "must be a string or a list of token ids (integers); "
                    "item {i} ({item}) is not an integer", {"i": i, "item": repr(item)})
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise BadField("suffix", "suffix: not supported")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """With `echo` and `logprobs`, the prompt's logprobs too (they are echoed)."""
        params = super().sampling_params(max_tokens)
        if self.echo and params.logprobs is not None:
            params.prompt_logprobs = params.logprobs
        return params


def _template_kwargs(given: dict[str, Any] | None, chat_template: str | None,
                     trust_chat_template: bool) -> dict[str, Any]:
    """A request's `chat_template_kwargs` for apply_chat_template(). A template sent by
    the request (it runs the client's Jinja in the server) is refused unless the server
    trusts them; the arguments the server sets itself are refused always."""
    kwargs = dict(given or {})
    for key in kwargs:
        if key in _TEMPLATE_RESERVED:
            raise BadField(f"chat_template_kwargs.{key}",
                           f"chat_template_kwargs.{key}: set by the server, not by a "
                           "request")
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if kwargs.get("chat_template") is not None and not trust_chat_template:
        param = ("chat_template" if chat_template is not None
                 else "chat_template_kwargs.chat_template")
        raise BadField(param, f"{param}: this server does not accept a chat template "
                       "from a request (start it with --trust-request-chat-template "
                       "to allow that)")
    return kwargs


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a `prompt`, or chat `messages` (templated as for a chat
    completion)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    return_token_strs: bool = False

    def template_kwargs(self, trust_chat_template: bool) -> dict[str, Any]:
        return _template_kwargs(self.chat_template_kwargs, self.chat_template,
                                trust_chat_template)


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's extension: refused unless trusted
    tools: Any = None
    tool_choice: Any = None

    def tool_plan(self) -> Any:
        """How the request uses its tools (a `tools.ToolPlan`), or None: no tools, or
        tool_choice "none"."""
        from .tools import plan_tools

        return plan_tools(self.tools, self.tool_choice)

    def structured_outputs(self) -> tuple[str, StructuredOutputsParams | None]:
        """A `required` or named tool_choice constrains the output as a schema does."""
        field, spec = super().structured_outputs()
        plan = self.tool_plan()
        if plan is None or plan.constraint is None:
            return field, spec
        if spec is not None:
            raise BadField("tool_choice", f"tool_choice={self.tool_choice!r:.80}: cannot be "
                           f"combined with {field}")
        return "tool_choice", plan.constraint

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().requested_max_tokens()

    def template_kwargs(self, trust_chat_template: bool) -> dict[str, Any]:
        return _template_kwargs(self.chat_template_kwargs, self.chat_template,
                                trust_chat_template)

    top_logprobs: Any = None

    def num_logprobs(self) -> int | None:
        """Chat's `logprobs` is true or false; `top_logprobs` says how many top tokens."""
        if self.logprobs not in (None, True, False):
            raise BadField("logprobs", f"logprobs={self.logprobs!r}: must be true or false "
                           "(top_logprobs says how many top tokens)")
        top = _count("top_logprobs", self.top_logprobs)
        if top is not None and self.logprobs is not True:
            raise BadField("top_logprobs", f"top_logprobs={top}: needs logprobs=true")
        return (top or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise BadField("echo", "echo: only on /v1/completions")

    def template_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages)
