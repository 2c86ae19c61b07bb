"""A decode step's input ids, some of them the tokens the step before sampled.

With overlapped scheduling the host launches step N+1 before it has read step N's tokens:
those inputs are filled on the device. Inside a decode CUDA graph this is one tiny launch
(the graph's first) instead of an index copy before every replay.
"""

from __future__ import annotations

import torch

from minivllm.kernels.dispatch import check_tensor, require_triton, tl, triton


def fill_tokens_ref(
    input_ids: torch.Tensor,  # [num_seqs] int64
    fill_from: torch.Tensor,  # [num_seqs] int64: a row of prev_tokens, or -1 (keep the id)
    prev_tokens: torch.Tensor,  # [>= max(fill_from) + 1] int64
) -> torch.Tensor:  # [num_seqs] int64
    taken = prev_tokens.index_select(0, fill_from.clamp(min=0))
    return torch.where(fill_from >= 0, taken, input_ids)


@triton.jit
def _fill_tokens_kernel(ids_ptr, fill_ptr, prev_ptr, out_ptr, n, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    mask = rows < n
    ids = tl.load(ids_ptr + rows, mask=mask, other=0)
    src = tl.load(fill_ptr + rows, mask=mask, other=-1)
    taken = tl.load(prev_ptr + tl.maximum(src, 0), mask=mask & (src >= 0), other=0)
    tl.store(out_ptr + rows, tl.where(src >= 0, taken, ids), mask=mask)


def fill_tokens(
    input_ids: torch.Tensor,
    fill_from: torch.Tensor,
    prev_tokens: torch.Tensor,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Triton version of `fill_tokens_ref` (one program: decode batches are small)."""
    if check:
        require_triton()
        for name, t in (("input_ids", input_ids), ("fill_from", fill_from),
                        ("prev_tokens", prev_tokens)):
            check_tensor(name, t, 1, (torch.int64,), device=input_ids.device)
        if fill_from.shape != input_ids.shape:
            raise ValueError(f"fill_from {tuple(fill_from.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)}")
    n = input_ids.shape[0]
    out = torch.empty_like(input_ids)
    if n:
        _fill_tokens_kernel[(1,)](input_ids, fill_from, prev_tokens, out, n,
                                  BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)
    return out
