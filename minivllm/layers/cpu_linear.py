"""CPU linears with the weight packed once for oneDNN (the path vLLM's CPU backend takes).

`F.linear` at one token per step reorders nothing and runs at ~14 GB/s; a weight packed into
oneDNN's blocked layout at load time halves the time of SmolLM2's fp32 linears (PERF.md).
The two ops are private to torch (`torch.ops.mkldnn`), so every use goes through
`pack_weight` / `linear`: where they are missing or refuse the dtype, the layer keeps
`F.linear`, and tests/test_cpu_path.py checks the two agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,  # from pack_weight(weight), or None for F.linear
) -> torch.Tensor:  # [num_tokens, out]
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
