"""What every face of the engine speaks: requests in, per-request outputs out.

`EngineClient` is the one interface the chat app, the plain REPL and the HTTP server use.
Two implementations: `EngineFrontend` (an engine in this process, driven by one thread)
and `minivllm.tui.remote.RemoteClient` (a `minivllm serve` over HTTP).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..outputs import EngineStats, TokenLogprob
from ..sampling_params import SamplingParams

ProgressFn = Callable[[str, float], None]


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about the engine behind a client (what a header or /v1/models shows)."""

    model: str
    device: str
    dtype: str
    world_size: int
    block_size: int
    num_blocks: int
    max_len: int


@dataclass(frozen=True)
class GenerateRequest:
    """One request. Give `prompt` (text or token ids) or chat `messages` (the engine's
    chat template is applied where the engine runs, with `chat_template_kwargs`)."""

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("GenerateRequest: give exactly one of prompt and messages")


@dataclass
class RequestOutput:
    """What one request gained since its previous output. Treat it as read-only.

    The first output of an accepted request has `accepted=True` and no text; it carries
    `num_prompt_tokens`. A request that was refused (bad input) gets one output with
    `finished=True`, `finish_reason="error"` and `rejected=True`. `finish_reason` is
    "stop", "length", "abort" or "error" (then `error` says why). `at` is the
    `time.monotonic()` when the engine produced it; an output merged from several
    (`merge_outputs`) has the last one's `at` and the first one's in `first_at`.
    `num_cached_tokens` counts the prompt tokens found in the prefix cache (known from
    the first generated token on). `logprobs` has one entry per token in `token_ids`
    when the request asked for logprobs; `prompt_logprobs` (one per prompt token, None
    for the first) comes with the first generated token when it asked for those.

    NOTE: not a frozen dataclass: one is built per request per engine step, and a frozen
    one's __init__ (object.__setattr__ per field) costs ~4x as much on the engine thread.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # total so far, this output's included
    accepted: bool = False
    rejected: bool = False
    opens_thinking: bool = False  # the templated prompt ends inside <think>
    at: float = 0.0
    first_at: float = 0.0  # 0: not merged (the output's own `at`)
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def since(self) -> float:
        """When the engine produced the oldest token in this output."""
        return self.first_at or self.at


OutputCallback = Callable[[RequestOutput], None]


class RequestRejected(ValueError):
    """The engine refused a request (its message names the field and value)."""


class EngineUnavailable(RuntimeError):
    """The engine stopped or could not be reached."""


@runtime_checkable
class EngineClient(Protocol):
    """The engine as its users see it. Every method is safe to call from any thread."""

    @property
    def info(self) -> EngineInfo | None:
        """Known once `start()` returned."""
        ...

    @property
    def error(self) -> str | None:
        """Why the engine stopped for good (None while it serves)."""
        ...

    def start(self, on_progress: ProgressFn | None = None) -> EngineInfo:
        """Load (or connect to) the engine; blocks until it serves. Raises on failure."""
        ...

    def add_request(self, request: GenerateRequest, on_output: OutputCallback) -> None:
        """Queue a request; `on_output` is called (on some other thread) with each output,
        the last one `finished`. Never raises for bad input: that is a rejected output."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request; its last output has finish_reason "abort". Unknown ids: ignored."""
        ...

    def stats(self) -> EngineStats | None:
        """The latest stats snapshot (refreshed a few times a second)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Queue the request now and return its outputs as an async stream (call it on
        the event loop that reads the stream); leaving the loop early aborts it."""
        ...

    def close(self) -> None:
        """Abort everything and release the engine (or connection). Idempotent."""
        ...


def render_chat_prompt(
    tokenizer: Any, messages: list[dict[str, str]], **chat_template_kwargs: Any
) -> str:
    """The chat template over the whole history, ending with the assistant's turn."""
    kwargs = {k: v for k, v in chat_template_kwargs.items() if v is not None}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )
