"""The app's engine, as the `EngineClient` every face of minivllm reads.

The engine loop itself lives in the shared front end (`minivllm.frontend`): an
`EngineFrontend` thread in this process, an engine process, or a `minivllm serve` over HTTP
(`remote.py`). The app reads each request's stream from it on its own event loop, as the
server does; the plain REPL reads the same outputs through the client's callbacks. Nothing
here loops, queues or merges on a thread of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minivllm.frontend import EngineClient, EngineFrontend, engine_info, render_chat_prompt
from minivllm.frontend.protocol import ProgressFn

__all__ = ["EngineFactory", "EngineSource", "engine_info", "render_prompt"]

# Builds an LLMEngine (or any engine with its API) or returns an unstarted EngineClient
# (`--url`: a remote server; `--engine-process`: the engine in a child process).
EngineFactory = Callable[[ProgressFn], Any]


def render_prompt(
    tokenizer: Any, messages: list[dict[str, str]], enable_thinking: bool | None
) -> str:
    """The chat template over the whole history, ending with the assistant's turn."""
    return render_chat_prompt(tokenizer, messages, enable_thinking=enable_thinking)


@dataclass
class EngineSource:
    """Where the app's client comes from: a built `engine` (served by an `EngineFrontend`
    thread), or an `engine_factory(on_progress)` returning an engine or an unstarted
    client. `owns_engine` decides whether closing the client exits the engine (default:
    when it was built here)."""

    engine: Any = None
    engine_factory: EngineFactory | None = None
    owns_engine: bool | None = None

    def __post_init__(self) -> None:
        if (self.engine is None) == (self.engine_factory is None):
            raise ValueError("give exactly one of engine= and engine_factory=")

    def connect(self, on_progress: ProgressFn) -> EngineClient:
        """Build or connect the client and start it. Blocks until it serves (call it off
        the UI's event loop); raises what building or starting raised."""
        built = self.engine
        owns = self.owns_engine
        if built is None:
            assert self.engine_factory is not None
            built = self.engine_factory(on_progress)
            owns = True if owns is None else owns
        client = built if isinstance(built, EngineClient) else EngineFrontend(
            built, owns_engine=bool(owns))
        try:
            client.start(on_progress)
        except BaseException:
            client.close()
            raise
        return client
