"""Model registry: Hugging Face architecture name -> our class."""

from __future__ import annotations

from torch import nn

from ..config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import LlamaForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def build_model(config: ModelConfig) -> nn.Module:
    return MODEL_REGISTRY[config.architecture](config)
