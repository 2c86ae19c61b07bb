"""What this CPU computes fast, read once when an engine starts (the default dtype follows).

bf16 is only a win where the hardware multiplies bf16 (AVX-512 BF16 or AMX) and torch runs
its AVX-512 kernels; elsewhere bf16 matmuls are emulated and several times slower than
fp32.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# torch's kernel levels (torch.backends.cpu.get_cpu_capability()) that include AVX-512.
AVX512_CAPABILITIES = frozenset({"AVX512"})


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags; empty where /proc/cpuinfo does not exist (macOS, Windows)."""
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def has_fast_bf16(flags: frozenset[str] | None = None, capability: str | None = None) -> bool:
    """Whether bf16 matmuls run in hardware here (defaults: this machine's flags and torch's
    kernel level, which ATEN_CPU_CAPABILITY can lower)."""
    flags = cpu_flags() if flags is None else flags
    if capability is None:
        capability = torch.backends.cpu.get_cpu_capability()
    return bool(flags & BF16_FLAGS) and capability in AVX512_CAPABILITIES


def default_cpu_dtype(
    flags: frozenset[str] | None = None, capability: str | None = None
) -> torch.dtype:
    """The CPU's dtype for `dtype="auto"`: bf16 weights and KV cache where bf16 is fast."""
    return torch.bfloat16 if has_fast_bf16(flags, capability) else torch.float32


def default_cpu_weights(
    gguf_source: bool, flags: frozenset[str] | None = None, capability: str | None = None
) -> str:
    """`cpu_weight_dtype` for an engine whose `dtype` and `cpu_weight_dtype` are both "auto"
    on a CPU: the plan measured fastest for the machine and the checkpoint.

    - A model converted from a GGUF: "compact", its own Q4_1 / Q8_0 weights, exactly (fp32
      compute, int8 activations where the CPU has VNNI): the apps' plan, ~4x the batch-1
      decode of bf16 compute on an AVX-512 BF16 CPU.
    - Safetensors where the CPU multiplies bf16 (AVX-512 BF16, AMX): "compact", which
      keeps such weights in bf16 for the weight-only kernel and the native decode step
      (~2.8x bf16 compute's batch-1 decode), prefill products in bf16.
    - Elsewhere "auto": fp32, the exact path (bf16 products are emulated there).
    """
    return "compact" if gguf_source or has_fast_bf16(flags, capability) else "auto"
