"""Rotary position embedding with an optional `llama3` frequency rescaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from minivllm.kernels.rotary import apply_rotary_folded, folded_cos_sin_at

from . import ops


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1+'s rescaling: long wavelengths slowed by `factor`, a smooth band between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

        self.kernels = ops.TORCH_KERNELS  # the engine binds its own set (ops.bind_kernels)
        self._positions: torch.Tensor | None = None  # the step whose cos/sin are memoised
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.kernels.is_triton:
            return self.kernels.rotary(positions, q, k, self.cos_sin_cache)
        # NOTE: one module serves every layer, and a step's layers share one positions
        # tensor: look its cos/sin up once per step, not once per layer.
        if positions is not self._positions:
            self._positions = positions
            self._cos_sin = folded_cos_sin_at(self.cos_sin_cache, positions)
        return apply_rotary_folded(q, k, *self._cos_sin)
