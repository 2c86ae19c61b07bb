"""Building one rank's model and loading its weights (a checkpoint, else random ones),
with the CPU's weight settings: the weight-only formats (packed once, cached beside the
checkpoint), oneDNN-packed linears, bf16 copies for prefill rows and int8 activations."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from minivllm.kernels.cpu_lowp_linear import unavailable_reason as lowp_kernel_unavailable

from ..config import EngineConfig
from ..distributed import get_tp_size
from ..layers.cpu_linear import (
    add_wide_copies,
    decode_dtype,
    int8_activations,
    lowp_linears,
    pack_linears,
    packing_tag,
    prefill_dtype,
    read_lowp_linears,
    replaced_weights,
    save_lowp_linears,
    use_lowp_linears,
    weight_format,
)
from ..loader import packed_weights_file, packed_weights_read, packed_weights_written
from ..loader.cache import lease_packed
from ..models import build_model
from ..models.weights import init_dummy_weights, load_weights

Progress = Callable[[str, float], None]


@dataclass
class LoadedModel:
    """A rank's model in eval mode and the CPU weight settings it took here."""

    model: nn.Module
    # The weight-only formats taken ("q4_1/q8_0"); None where weights stay in the dtype.
    cpu_weight_format: str | None
    # The dtype of a prefill's products on oneDNN-packed copies; None: the weight-only kernel.
    cpu_prefill_dtype: torch.dtype | None
    # "int8" where the q4_1 / q8_0 products take int8 activations, else None.
    cpu_decode_dtype: str | None


def load_model(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, seed: int, progress: Progress
) -> LoadedModel:
    """Build the model on `device` in `dtype` and load its weights (random ones from `seed`
    for the dummy format or without a checkpoint)."""
    progress("building the model", 0.1)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(config.model)
    finally:
        torch.set_default_dtype(old_dtype)
    # Weight-only formats (config.cpu_weight_dtype): None where weights stay `dtype`,
    # else the formats taken ("q4_1/q8_0"); the kernel builds at the first start on a
    # machine (~30-60 s), then loads from cache, and so do the packed weights.
    fmt = weight_format(config.cpu_weight_dtype, device, dtype)
    cache: Path | None = None  # where the packed weights are cached on disk
    if config.load_format == "dummy" or config.model_path is None:
        progress("random weights", 0.2)
        init_dummy_weights(model, seed)
        if fmt is not None:
            fmt = _lowp_linears(model, fmt, None, progress)
    else:
        progress("loading weights", 0.2)
        copies = None
        # One rank only: a tensor-parallel rank packs its own shard of each weight.
        if fmt is not None and get_tp_size() == 1 and lowp_kernel_unavailable() is None:
            cache = packed_weights_file(config.model_path, packing_tag(fmt))
            _hold_while_alive(model, cache)
            copies = read_lowp_linears(model, cache)
        # The packed weights cached replace the linears' weights: those stay unread.
        skip = replaced_weights(model) if copies is not None else frozenset()
        load_weights(model, config.model_path, skip)
        if copies is not None:
            fmt = use_lowp_linears(model, copies)
            packed_weights_read(config.model_path, cache)
        elif fmt is not None:
            fmt = _lowp_linears(model, fmt, cache, progress)
            if cache is not None:
                # A new entry: record its source, prune the stale ones, hold the files
                # (the lease above found none of them).
                packed_weights_written(config.model_path, cache)
                _hold_while_alive(model, cache)
    model.eval()
    # NOTE: fp32 stays unpacked: it is the exact-parity path checked against
    # transformers (oneDNN's packed sums differ from F.linear by ~1e-6, enough to move
    # logprobs past 1e-4); bf16 is where packing pays (PERF.md's CPU facts).
    if device.type == "cpu" and dtype != torch.float32:
        pack_linears(model)
    # The dtype of a prefill's products on oneDNN-packed copies (bf16 on AMX, fp32
    # elsewhere), None where they stay on the weight-only kernel.
    prefill = prefill_dtype(config.cpu_prefill_dtype, config.dtype, fmt)
    if prefill is not None and not add_wide_copies(model, prefill, cache):
        prefill = None  # oneDNN does not pack that dtype here
    # "int8" where the q4_1 / q8_0 products take int8 activations (VNNI), else None.
    decode = decode_dtype(config.cpu_decode_dtype, config.dtype, fmt)
    if decode is not None:
        int8_activations(model)
    return LoadedModel(model, fmt, prefill, decode)


def _hold_while_alive(model: nn.Module, cache: Path) -> None:
    """Lease the packed weights' files in `cache` while `model` lives: a prune in another
    process keeps them (the prefill copies beside them are read at the first prefill)."""
    lease = lease_packed(cache)
    weakref.finalize(model, lease.release)


def _lowp_linears(
    model: nn.Module, fmt: str, cache: Path | None, progress: Progress
) -> str | None:
    """Pack the linears' weights into `fmt` (building the kernel at the first start on
    a machine) and save them to `cache` for the next start; returns the formats taken,
    None where the kernel did not build here (warned)."""
    from minivllm.kernels.cpu_lowp_linear import is_built

    stage = f"packing {fmt} weights (once)"
    progress(stage if is_built() else f"building the CPU kernel, {stage}", 0.3)
    taken = lowp_linears(model, fmt)
    if taken is not None and cache is not None:
        with contextlib.suppress(OSError):  # a read-only cache: pack again next time
            save_lowp_linears(model, cache)
    return taken
