"""Tensor-parallel state of this process: its rank, the group size, the collectives.

With one rank nothing here touches torch.distributed, so a single-process engine
needs no process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_rank = 0
_world_size = 1


def set_tp(rank: int, world_size: int) -> None:
    global _rank, _world_size
    _rank, _world_size = rank, world_size


def get_tp_rank() -> int:
    return _rank


def get_tp_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _world_size > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's `x` along the last dim on rank 0; None elsewhere."""
    if _world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_world_size)] if _rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if _rank == 0 else None
