"""What an engine runs on and with, settled before it loads: the device, the weights' dtype,
the CPU's weight format where nothing was asked for, and whether the KV pool holds one
request of the longest length."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..config import EngineConfig
from ..loader import GGUF_SOURCE_FILE


def resolve_device(device: str) -> torch.device:
    """The device `device` names ("auto": a CUDA GPU if there is one, else the CPU)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda': no CUDA GPU is available here")
    return torch.device(device)


def default_plan(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with the CPU's weights chosen for the machine where nothing was asked for
    (`dtype` and `cpu_weight_dtype` "auto", real weights, one rank): see
    `cpu_features.default_cpu_weights`. `dtype="float32"` keeps fp32 weights (exact)."""
    if (device.type != "cpu" or config.dtype != "auto" or config.cpu_weight_dtype != "auto"
            or config.model_path is None or config.load_format == "dummy"
            or config.world_size > 1):
        return config
    from ..cpu_features import default_cpu_weights

    gguf = (Path(config.model_path) / GGUF_SOURCE_FILE).is_file()
    return dataclasses.replace(config, cpu_weight_dtype=default_cpu_weights(gguf))


def resolve_dtype(
    dtype: str, device: torch.device, cpu_weight_dtype: str = "auto"
) -> torch.dtype:
    """"auto": bf16 on GPUs. On a CPU: fp32 where a weight format is asked for (the
    weight-only kernels and the native decode step multiply fp32 activations: even on an
    AVX-512 BF16 CPU, SmolLM2 with its Q4_1 weights decodes several times faster so than in
    bf16), else bf16 where the CPU multiplies bf16 (AVX-512 BF16, AMX), else
    fp32."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if device.type != "cpu" or cpu_weight_dtype != "auto":
            return torch.float32
        from ..cpu_features import default_cpu_dtype

        return default_cpu_dtype()
    return getattr(torch, dtype)


def check_pool_fits(config: EngineConfig, num_blocks: int, bytes_per_block: int) -> None:
    """One request of max_model_length must fit the pool, or nothing could be promised."""
    needed = (config.max_len + config.block_size - 1) // config.block_size
    if num_blocks >= needed:
        return
    gib = 1 << 30
    need_gib = needed * bytes_per_block / gib
    have_gib = num_blocks * bytes_per_block / gib
    raise ValueError(
        f"KV cache too small for max_model_length={config.max_len}: "
        f"{need_gib:.2f} GiB needed, {have_gib:.2f} GiB available; "
        f"the largest length that fits is {num_blocks * config.block_size} "
        f"(lower max_model_length or raise gpu_memory_utilization / max_cached_blocks)"
    )
