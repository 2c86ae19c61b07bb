"""The messages the app posts to itself from other threads, as dataclasses.

The thread that builds or connects the engine posts progress, then `EngineReady` (or
`LoadFailed`) with `App.post_message`, which is thread-safe and does not block. Request
outputs are not messages: the app reads them from the client's streams. High-rate ones
set `can_replace` so the UI's queue keeps only the newest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message

from minivllm.frontend import EngineInfo
from minivllm.outputs import EngineStats

__all__ = ["EngineInfo", "EngineReady", "LoadFailed", "LoadProgress", "StatsSnapshot"]


@dataclass
class LoadProgress(Message):
    stage: str
    fraction: float

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadProgress)


@dataclass
class EngineReady(Message):
    info: EngineInfo
    client: Any  # the started EngineClient


@dataclass
class LoadFailed(Message):
    error: str
    headline: str = "the engine failed to load"  # or: could not connect to the server


@dataclass
class StatsSnapshot(Message):
    """An engine stats snapshot for the panel (the app polls the client for them)."""

    stats: EngineStats
    at: float  # time.monotonic() when taken

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsSnapshot)
