from __future__ import annotations

import torch
from torch import nn

from . import ops


class RMSNorm(nn.Module):
    """RMSNorm; given a residual, adds it first and returns (normed, new residual)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.kernels = ops.TORCH_KERNELS  # the engine binds its own set (ops.bind_kernels)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, residual_out = self.kernels.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual_out)
