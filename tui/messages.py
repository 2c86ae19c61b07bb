"""Every message the engine thread posts to the UI, as dataclasses.

The engine thread calls `post(message)` (for the app, `App.post_message`, which is
thread-safe and does not block). High-rate ones set `can_replace` so the UI's queue keeps
only the newest. What the engine says is in the front end's own types
(`minivllm.frontend`: `EngineInfo`, `RequestOutput`); these messages only carry them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from textual.message import Message

from minivllm.frontend import EngineInfo, RequestOutput
from minivllm.outputs import EngineStats

__all__ = [
    "DeltaBatch", "EngineDied", "EngineInfo", "EngineReady", "LoadFailed", "LoadProgress",
    "RequestAccepted", "RequestFailed", "RequestOutput", "StatsSnapshot",
]


@dataclass
class LoadProgress(Message):
    stage: str
    fraction: float

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadProgress)


@dataclass
class EngineReady(Message):
    info: EngineInfo


@dataclass
class LoadFailed(Message):
    error: str


@dataclass
class RequestAccepted(Message):
    request_id: int
    seq_id: int
    opens_thinking: bool  # the templated prompt ends inside <think>


@dataclass
class RequestFailed(Message):
    """`add_prompt` rejected the request, or a step failed while it ran."""

    request_id: int
    error: str


@dataclass
class DeltaBatch(Message):
    """Each request's output since the previous batch, merged (`merge_outputs`). A
    request's first tokens come in a batch of their own, so their `at` is when the
    engine produced the first token (the pane's TTFT)."""

    deltas: list[RequestOutput]
    at: float  # time.monotonic() when posted


@dataclass
class StatsSnapshot(Message):
    stats: EngineStats
    at: float  # time.monotonic() when taken
    queued: frozenset[int] = field(default_factory=frozenset)  # requests still waiting

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsSnapshot)


@dataclass
class EngineDied(Message):
    """The engine thread stopped for good; every pane shows this, text kept."""

    error: str
