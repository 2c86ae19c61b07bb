"""The CPU's norm and activation over fp32 rows in C++ (`minivllm_cpu::rms_norm_rows`,
`silu_and_mul_rows` in cpu_decode_step.cpp): the CPU kernel set's `rms_norm` and
`silu_and_mul` (layers/ops.py): one pass each where torch's versions are 5-7 ops a call over
[tokens, hidden]; other dtypes take the torch references."""

from __future__ import annotations

import torch

from minivllm.kernels.rms_norm import rms_norm_ref
from minivllm.kernels.silu_and_mul import silu_and_mul_ref


def rms_norm_cpu(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rms_norm_ref`'s contract: (normed, new residual); with a residual, x + residual is
    normed and returned."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return rms_norm_ref(x, weight, eps, residual)
    rows = x.reshape(-1, x.shape[-1])
    res = None if residual is None else residual.reshape(rows.shape)
    out, total = torch.ops.minivllm_cpu.rms_norm_rows(rows, weight, eps, res)
    return out.view(x.shape), (None if residual is None else total.view(x.shape))


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * inter] -> [..., inter]
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return silu_and_mul_ref(x)
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.minivllm_cpu.silu_and_mul_rows(rows).view(*x.shape[:-1], -1)
