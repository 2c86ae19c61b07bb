"""CPU linears: oneDNN-packed weights (bf16 compute) or weight-only bf16 / int8 weights with
fp32 compute (kernels/cpu_lowp_linear.py), chosen once when the engine loads the model.

`F.linear` at one token per step reorders nothing and runs at ~14 GB/s; a weight packed into
oneDNN's blocked layout at load time halves the time of SmolLM2's linears where the CPU
multiplies bf16 (PERF.md). The two ops are private to torch (`torch.ops.mkldnn`), so every
use goes through `pack_weight` / `linear`: where they are missing or refuse the dtype, the
layer keeps `F.linear`, and tests/test_cpu_path.py checks the two agree.

Weight-only formats (`cpu_weight_dtype`): the fp32 weight is replaced by a packed bf16 or
int8 copy (`LowpWeight`), and every product with it, decode and prefill, runs our kernel:
a decode token reads half or a quarter of fp32's bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class LowpWeight(NamedTuple):
    """A linear's weight in a weight-only format (kernels/cpu_lowp_linear.py's layout)."""

    packed: torch.Tensor  # [blocks, in, width] bf16 or int8
    scales: torch.Tensor | None  # [blocks * width] fp32 per output channel (int8 only)
    out_features: int


def _ops_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of `weight` [out, in], or None where it cannot be used (not a
    CPU tensor, a dtype this CPU's oneDNN refuses, e.g. bf16 without AVX-512, or a torch
    without the ops)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not _ops_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        # One tiny product proves the packed weight runs here before the model relies on it.
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return None
    return packed


def linear(
    x: torch.Tensor,  # [num_tokens, in]
    weight: torch.Tensor | None,  # [out, in]; None where `lowp` replaced it
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,  # from pack_weight(weight), or None for F.linear
    lowp: LowpWeight | None = None,
) -> torch.Tensor:  # [num_tokens, out]
    if lowp is not None:
        from minivllm.kernels.cpu_lowp_linear import lowp_linear

        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = lowp_linear(x2, lowp.packed, lowp.scales, bias, lowp.out_features)
        return y.view(*x.shape[:-1], lowp.out_features)
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Pack the weight of every layer that has a `packed` slot; returns how many were packed."""
    count = 0
    for module in model.modules():
        if hasattr(module, "packed") and isinstance(getattr(module, "weight", None), torch.Tensor):
            module.packed = pack_weight(module.weight)
            count += module.packed is not None
    return count


def weight_format(cpu_weight_dtype: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """The weight-only format the engine's CPU linears take ("bfloat16" / "int8"), or None
    where weights stay in the compute dtype. Raises ValueError for a format that needs fp32
    activations when the compute dtype is not fp32."""
    if device.type != "cpu" or cpu_weight_dtype in ("auto", str(dtype).removeprefix("torch.")):
        return None
    if dtype != torch.float32:
        raise ValueError(
            f"cpu_weight_dtype={cpu_weight_dtype!r} needs dtype='float32' (its kernel "
            f"multiplies fp32 activations); the engine's dtype is "
            f"{str(dtype).removeprefix('torch.')!r}"
        )
    return None if cpu_weight_dtype == "float32" else cpu_weight_dtype


def lowp_linears(model: torch.nn.Module, fmt: str) -> int:
    """Replace the fp32 weight of every linear (and the LM head) by its `fmt` copy
    ("bfloat16" or "int8"); returns how many. A weight the LM head shares with the token
    embedding stays (the embedding looks rows up in it). Does nothing, with a warning,
    where the kernel cannot be built here."""
    from minivllm.kernels import cpu_lowp_linear as kernel

    if not kernel.check_available():
        return 0
    width = kernel.block_width()
    shared = {
        id(m.weight) for m in model.modules() if not hasattr(m, "lowp") and hasattr(m, "weight")
    }
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "lowp") or not isinstance(weight, torch.Tensor):
            continue
        assert weight.dtype == torch.float32 and weight.dim() == 2, weight.shape
        if fmt == "bfloat16":
            packed, scales = kernel.pack_bf16(weight, width), None
        else:
            packed, scales = kernel.quantize_int8(weight, width)
        module.lowp = LowpWeight(packed, scales, weight.shape[0])
        if id(weight) not in shared:
            module.weight = None  # the fp32 copy is never read again: free it
        count += 1
    return count
