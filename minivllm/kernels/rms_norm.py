"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from minivllm.kernels.dispatch import check_tensor, require_triton, tl, triton


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new_residual); with a residual, x + residual is normed and returned."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(x.dtype) * weight).to(x.dtype), residual


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    x_stride_0,
    x_stride_1,
    residual_stride_0,
    residual_stride_1,
    inner_rows,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row; rows are indexed (outer, inner) so strided 3-D views such as
    # per-head q/k slices of a fused QKV output need no copy.
    outer = tl.program_id(0).to(tl.int64)
    inner = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + outer * x_stride_0 + inner * x_stride_1 + cols, mask=mask, other=0.0)
    out_row = (outer * inner_rows + inner) * hidden
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + outer * residual_stride_0 + inner * residual_stride_1 + cols,
                    mask=mask, other=0.0)
        # Round the sum to the activation dtype before norming it, as the reference does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + out_row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def check_norm_inputs(x: torch.Tensor, weight_name: str, weight: torch.Tensor,
                      residual: torch.Tensor | None) -> None:
    """A norm weight of x's hidden size; a residual of x's shape and dtype. (Shared with
    the GEMV's add + RMSNorm prologue.)"""
    hidden = x.shape[-1]
    check_tensor(weight_name, weight, 1, device=x.device)
    if weight.shape[0] != hidden:
        raise ValueError(f"{weight_name} has {weight.shape[0]} elements for hidden size {hidden}")
    if residual is not None:
        check_tensor("residual", residual, x.dim(), (x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden] or [num_tokens, num_heads, head_dim]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of `rms_norm_ref`: one pass that adds the residual, writes the new
    residual and the normed rows (fp32 math). Outputs are new contiguous tensors.
    `check=False` skips the input checks (an engine checks each kernel's first launch)."""
    hidden = x.shape[-1]
    if check:
        require_triton()
        if x.dim() not in (2, 3):
            raise ValueError(f"x must be [num_tokens, hidden] or [num_tokens, heads, head_dim], "
                             f"got shape {tuple(x.shape)}")
        check_tensor("x", x, x.dim())
        check_norm_inputs(x, "weight", weight, residual)
    x3 = x if x.dim() == 3 else x[:, None, :]  # [outer, inner, hidden]
    r3 = x3 if residual is None else (residual if residual.dim() == 3 else residual[:, None, :])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else torch.empty_like(out)
    outer, inner = x3.shape[0], x3.shape[1]
    if x.numel() == 0:
        return out, new_residual
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(outer, inner)](
        x3,
        r3,
        weight,
        out,
        out if new_residual is None else new_residual,
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        inner,
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out, new_residual
