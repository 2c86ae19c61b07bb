"""The supported architectures: the one list every other place reads.

Hugging Face architecture name -> where our class lives and what the configuration
must know about the family. Imports no torch: `ModelConfig` validates against it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Architecture:
    module: str  # minivllm.models.<module> holds the class named like the architecture
    model_type: str  # transformers' model_type (AutoConfig.for_model)
    qk_norm: bool = False  # an RMSNorm on each head of q and k before rotary (Qwen3)
    qkv_bias: bool | None = None  # fixed by the family (Qwen2); None: config's attention_bias


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "llama"),
    "MistralForCausalLM": Architecture("mistral", "mistral"),
    "Qwen2ForCausalLM": Architecture("qwen2", "qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Architecture("qwen3", "qwen3", qk_norm=True),
}


def supported() -> str:
    """The supported names, for error messages."""
    return ", ".join(sorted(ARCHITECTURES))


def model_class(architecture: str) -> type[nn.Module]:
    spec = ARCHITECTURES[architecture]
    module = importlib.import_module(f"minivllm.models.{spec.module}")
    return getattr(module, architecture)
