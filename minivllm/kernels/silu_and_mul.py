"""SiLU(gate) * up over the fused gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.kernels.dispatch import check_tensor, require_triton, tl, triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [.., inter]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor, *, check: bool = True
) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [.., inter]
    """Triton version of `silu_and_mul_ref` (fp32 math, one pass). `check=False` skips
    the input checks (an engine checks each kernel's first launch)."""
    if check:
        require_triton()
        check_tensor("x", x, 2)
        if x.shape[1] % 2:
            raise ValueError(f"x's last dimension must be even (gate and up), got {x.shape[1]}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out
