from __future__ import annotations

import torch
from torch import nn

from . import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * inter] -> [T, inter]
        return ops.silu_and_mul(x)
