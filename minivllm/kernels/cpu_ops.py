"""The CPU's norm, activation and q/k rotary + K/V store over fp32 rows in C++
(`minivllm_cpu::rms_norm_rows`, `silu_and_mul_rows`, `qkv_rotary_store_rows` in
cpu_decode_step.cpp): the CPU kernel set's `rms_norm`, `silu_and_mul` and
`qkv_rotary_store` (layers/ops.py): one pass each where torch's versions are 5-12 ops a
call over [tokens, hidden]; other dtypes take the torch references."""

from __future__ import annotations

import torch

from minivllm.kernels.qkv_rotary_store import qkv_rotary_store_ref
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
    """fp32 rows, or bf16 rows computed in fp32 and rounded once (the reference rounds
    after the SiLU and again after the product)."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return silu_and_mul_ref(x)
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.minivllm_cpu.silu_and_mul_rows(rows).view(*x.shape[:-1], -1)


def qkv_rotary_store_cpu(
    positions: torch.Tensor,  # [num_tokens]
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    num_heads: int,
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in the first half, sin after
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 skips the token's store
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # q: [num_tokens, num_heads, head_dim]
    """`qkv_rotary_store_ref`'s contract; fp32 activations, cos/sin and caches in C++."""
    fp32 = (qkv, cos_sin_cache, k_cache, v_cache)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" for t in fp32)
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        return qkv_rotary_store_ref(positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache,
                                    slot_mapping, q_norm_weight, k_norm_weight, eps, k_scale,
                                    v_scale)
    return torch.ops.minivllm_cpu.qkv_rotary_store_rows(
        positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q_norm_weight, k_norm_weight, eps)
