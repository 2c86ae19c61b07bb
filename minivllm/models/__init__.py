"""Model classes, built through the registry (models/registry.py: the one list)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import ARCHITECTURES, model_class

if TYPE_CHECKING:
    from torch import nn

    from ..config import ModelConfig

__all__ = ["ARCHITECTURES", "build_model", "model_class"]


def build_model(config: ModelConfig) -> nn.Module:
    return model_class(config.architecture)(config)
