"""Programmatic dependent launch (PDL, Hopper and later): which kernels use it.

A kernel launched with PDL may start while the kernel before it in the stream is still
running, once every program of that one has called `gdc_launch_dependents`. Until its
own `gdc_wait` it may only read memory no earlier kernel writes (weights, the step's
input buffers); after it, everything the earlier kernels wrote is complete and visible.
Kept inside CUDA graphs (programmatic edges).

MINIVLLM_PDL selects: "all" (default) the GEMVs, which stream their weights before the
wait, and the attention path (q/k norm + rotary + KV store, decode attention); "1" the
GEMVs only; "0" none. Each level made batch-1 decode faster than the one below it.
"""

from __future__ import annotations

import functools

import torch

from ..envs import read


@functools.cache
def _pdl_level(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # the CPU interpreter has no grid dependency control
    setting = read("MINIVLLM_PDL")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] < 9:
        return 0
    return {"0": 0, "1": 1, "all": 2}[setting]


def gemv_pdl(device: torch.device) -> bool:
    """Whether the GEMVs launch with PDL on `device`."""
    return _pdl_level(device) >= 1


def attention_pdl(device: torch.device) -> bool:
    """Whether the attention-path kernels launch with PDL on `device`."""
    return _pdl_level(device) >= 2
