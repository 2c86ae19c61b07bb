"""minivllm: a fast, readable LLM inference engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import EngineConfig, ModelConfig
from .outputs import Delta, EngineStats, TokenLogprob
from .sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from .engine.llm_engine import LLMEngine

__all__ = [
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "EngineConfig",
    "ModelConfig",
    "Delta",
    "EngineStats",
    "TokenLogprob",
]


def __getattr__(name: str):
    # NOTE: lazy, so that the torch-free parts (config, scheduler, block manager) can be
    # imported without torch.
    if name == "LLMEngine":
        from .engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
