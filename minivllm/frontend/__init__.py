"""The engine's front end: one loop, three faces (the app, the plain REPL, the server)."""

from __future__ import annotations

from .engine_frontend import EngineFrontend, engine_info
from .outputs import merge_outputs, stream_outputs
from .protocol import (
    EngineClient,
    EngineInfo,
    EngineUnavailable,
    GenerateRequest,
    RequestOutput,
    RequestRejected,
    render_chat_prompt,
)

__all__ = [
    "EngineClient",
    "EngineFrontend",
    "EngineInfo",
    "EngineUnavailable",
    "GenerateRequest",
    "RequestOutput",
    "RequestRejected",
    "engine_info",
    "merge_outputs",
    "render_chat_prompt",
    "stream_outputs",
]
