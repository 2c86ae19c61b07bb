from __future__ import annotations

import torch
from torch import nn

from . import ops


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernels = ops.TORCH_KERNELS  # the engine binds its own set (ops.bind_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * inter] -> [T, inter]
        return self.kernels.silu_and_mul(x)
