"""minivllm: a fast, readable LLM inference engine."""

from .config import EngineConfig, ModelConfig
from .engine.llm_engine import LLMEngine
from .outputs import Delta, EngineStats
from .sampling_params import SamplingParams

__all__ = ["LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "Delta", "EngineStats"]
