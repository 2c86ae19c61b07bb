"""Rotary position embedding, rotate-half (GPT-NeoX) layout, as Llama and Qwen3 use."""

from __future__ import annotations

import torch

from minivllm.kernels.dispatch import (
    INDEX_DTYPES,
    check_tensor,
    require_triton,
    tl,
    triton,
)


def rotary_ref(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in the first half, sin after
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary_ref(q, k, *cos_sin_at(cos_sin_cache, positions))


def cos_sin_at(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # each [num_tokens, 1, head_dim // 2]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    return cos[:, None, :], sin[:, None, :]


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_ref` with the positions' cos/sin already looked up (shared by all layers)."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def folded_cos_sin_at(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # each [num_tokens, 1, head_dim]
    """cos and sign-folded sin over the full head: (cos, cos) and (-sin, sin)."""
    cos, sin = cos_sin_at(cos_sin_cache, positions)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary_folded(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path: `apply_rotary_ref` in 4 ops a tensor instead of 8, bit-identical
    (x1*cos + x2*(-sin) rounds exactly like x1*cos - x2*sin). cos/sin from
    `folded_cos_sin_at`."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        half = xf.shape[-1] // 2
        swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)  # (x2, x1)
        return (xf * cos + swapped * sin).to(x.dtype)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_t,
    stride_h,
    cos,
    sin,
    num_heads,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    ptr = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF]
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    num_heads,
    num_kv_heads,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    # One program per token rotates all its q and k heads in place.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + dims).to(tl.float32)  # [1, HALF]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + dims).to(tl.float32)
    _rotate_heads(q_ptr, token, q_stride_t, q_stride_h, cos, sin, num_heads, Q_HEADS_PAD, HALF)
    _rotate_heads(k_ptr, token, k_stride_t, k_stride_h, cos, sin, num_kv_heads, K_HEADS_PAD, HALF)


def rotary(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in the first half, sin after
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rotary_ref`. NOTE: rotates q and k IN PLACE (they may be strided
    views of a fused QKV output) and returns them. Positions are not range-checked (that
    would need a host sync); they must be < max_position. `check=False` skips the input
    checks (an engine checks each kernel's first launch)."""
    if check:
        require_triton()
        check_tensor("q", q, 3)
    num_tokens, num_heads, head_dim = q.shape
    if check:
        check_tensor("k", k, 3, (q.dtype,), device=q.device)
        check_tensor("positions", positions, 1, INDEX_DTYPES, device=q.device)
        check_tensor("cos_sin_cache", cos_sin_cache, 2, device=q.device)
        if (k.shape[0] != num_tokens or k.shape[2] != head_dim
                or positions.shape[0] != num_tokens):
            raise ValueError(
                f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions "
                f"{tuple(positions.shape)} disagree on num_tokens or head_dim"
            )
        if cos_sin_cache.shape[1] != head_dim or not cos_sin_cache.is_contiguous():
            raise ValueError(
                f"cos_sin_cache must be a contiguous [max_position, {head_dim}] "
                f"tensor, got shape {tuple(cos_sin_cache.shape)}"
            )
        if head_dim % 2 or triton.next_power_of_2(head_dim) != head_dim:
            raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if num_tokens == 0:
        return q, k
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        num_heads,
        k.shape[1],
        Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=head_dim // 2,
        num_warps=4,
    )
    return q, k
