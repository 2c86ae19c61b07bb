"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_reduce, gather_last_dim, get_tp_rank, get_tp_size
from . import cpu_linear, ops


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.rows = vocab_size // self.tp_size
        self.start = self.rows * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(0, self.start, self.rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        y = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine[:, None]
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for each rank's vocabulary slice, gathered on rank 0 (None on the others)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.packed: torch.Tensor | None = None  # oneDNN's copy on CPU (cpu_linear)
        self.lowp: cpu_linear.LowpWeight | None = None  # weight-only bf16 / int8 on CPU
        self.kernels = ops.TORCH_KERNELS  # the engine binds its own set (ops.bind_kernels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if hidden.is_cuda:
            from .linear import cuda_linear

            return gather_last_dim(cuda_linear(hidden, self.weight, None, self.kernels.gemv))
        return gather_last_dim(
            cpu_linear.linear(hidden, self.weight, None, self.packed, self.lowp)
        )
