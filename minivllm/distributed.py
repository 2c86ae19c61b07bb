"""Tensor-parallel state of this process: its rank, the group size, the collectives.

With one rank nothing here touches torch.distributed, so a single-process engine
needs no process group.

NOTE: each engine has its own process group (not torch.distributed's global default
one), so two tensor-parallel engines can live in one process. The group in use is held
in a context variable: rank 0 enters `use_tp(...)` around building and running its
model, a worker process calls `set_tp(...)` once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in one engine's tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    # The engine's own c10d backend (ProcessGroupGloo / ProcessGroupNCCL); None means
    # torch.distributed's default group, when someone initialised one.
    group: Any = None


_SINGLE = TPGroup()
_current: ContextVar[TPGroup] = ContextVar("minivllm_tp_group", default=_SINGLE)


def set_tp(rank: int, world_size: int, group: Any = None) -> None:
    """Set the TP group for the current context (a worker process calls this once)."""
    _current.set(TPGroup(rank, world_size, group))


@contextmanager
def use_tp(tp: TPGroup) -> Iterator[TPGroup]:
    """Make `tp` the current TP group for the duration of the block."""
    token = _current.set(tp)
    try:
        yield tp
    finally:
        _current.reset(token)


def get_tp_rank() -> int:
    return _current.get().rank


def get_tp_size() -> int:
    return _current.get().world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place."""
    tp = _current.get()
    if tp.world_size > 1:
        if tp.group is None:
            dist.all_reduce(x)
        else:
            tp.group.allreduce([x]).wait()
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's `x` along the last dim on rank 0; None elsewhere."""
    tp = _current.get()
    if tp.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)] if tp.rank == 0 else None
    if tp.group is None:
        dist.gather(x, parts, dst=0)
    else:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        tp.group.gather([parts] if parts is not None else [], [x], opts).wait()
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Overwrite `x` (contiguous) on every rank with rank 0's values, in place."""
    tp = _current.get()
    if tp.world_size > 1:
        if tp.group is None:
            dist.broadcast(x, src=0)
        else:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            tp.group.broadcast([x], opts).wait()
    return x
