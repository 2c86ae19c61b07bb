"""Every message the engine thread posts to the UI, as dataclasses.

The engine thread calls `post(message)` (for the app, `App.post_message`, which is
thread-safe and does not block). High-rate ones set `can_replace` so the UI's queue keeps
only the newest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from textual.message import Message

from minivllm.outputs import EngineStats


@dataclass(frozen=True)
class EngineInfo:
    """What the header shows; gathered by the engine thread once the engine is up."""

    model: str
    device: str
    dtype: str
    world_size: int
    block_size: int
    num_blocks: int
    max_len: int


@dataclass(frozen=True)
class RequestDelta:
    """One request's new output since the previous batch (UI request ids, not seq ids)."""

    request_id: int
    text: str
    num_tokens: int
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    first_at: float = 0.0  # time.monotonic() of the engine step that produced the first token
    last_at: float = 0.0  # ... and the last one in this delta


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
    deltas: list[RequestDelta]
    at: float  # time.monotonic() when popped from the engine


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
