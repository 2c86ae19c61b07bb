"""Linear layers that know their tensor-parallel shard.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this
rank's slice of a full checkpoint tensor into it, so the weight loader stays generic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_reduce, get_tp_rank, get_tp_size
from . import cpu_linear, ops


def cuda_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemv: Callable | None = None,
):
    """F.linear on CUDA, or `gemv` (the kernel set's Triton GEMV; None: not in the set)
    for the few-row shapes where it measured faster than cuBLAS (kernels/gemv.py's table)."""
    from minivllm.kernels.gemv import MAX_ROWS, gemv_wins

    if (
        gemv is not None
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and gemv_wins(x.shape[0], *weight.shape, x.dtype)
    ):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # oneDNN's packed copy of the weight on CPU (cpu_linear.pack_linears, after loading).
        self.packed: torch.Tensor | None = None
        # A weight-only bf16 / int8 copy replacing the weight on CPU (cpu_linear.lowp_linears).
        self.lowp: cpu_linear.LowpWeight | None = None
        self.kernels = ops.TORCH_KERNELS  # the engine binds its own set (ops.bind_kernels)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            return cuda_linear(x, self.weight, bias, self.kernels.gemv)
        return cpu_linear.linear(x, self.weight, bias, self.packed, self.lowp)


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank computes its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features // get_tp_size(), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up -> gate_up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split across ranks by head."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp  # per rank
        self.num_kv_heads = num_kv_heads // tp
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id
        ]
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features // get_tp_size(), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is whole, added once after the sum
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y)
