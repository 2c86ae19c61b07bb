"""The engine's kernel set, chosen once per engine: Triton on CUDA, the torch references
elsewhere.

`select_kernels(device)` makes the choice; the model runner binds the result to every
layer that launches kernels (`bind_kernels`), so no layer asks which device it is on
per call. The torch set is the default a freshly built layer holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from minivllm.kernels.decode_attention import decode_attention_ref
from minivllm.kernels.fill_tokens import fill_tokens_ref
from minivllm.kernels.prefill_attention import prefill_attention_ref
from minivllm.kernels.rms_norm import rms_norm_ref
from minivllm.kernels.rotary import rotary_ref
from minivllm.kernels.sample import sample_rows_ref
from minivllm.kernels.silu_and_mul import silu_and_mul_ref
from minivllm.kernels.store_kvcache import store_kvcache_ref


@dataclass(frozen=True)
class Kernels:
    """One implementation of each kernel the model launches (same signatures as the
    `*_ref` functions in minivllm.kernels)."""

    name: str
    is_triton: bool
    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    store_kvcache: Callable
    prefill_attention: Callable
    decode_attention: Callable
    # The fused decode-path ops (kernels/gemv.py, kernels/qkv_rotary_store.py,
    # kernels/decode_attention.py): Triton, and `qkv_rotary_store` in the CPU set too
    # (kernels/cpu_ops.py); None in a set without them, where callers take the unfused path.
    gemv: Callable | None = None
    rms_norm_gemv: Callable | None = None
    qkv_rotary_store: Callable | None = None
    qkv_decode_attention: Callable | None = None
    # A decode step's inputs from the previous step's tokens, and its tokens from its
    # logits (the picking decode graphs).
    fill_tokens: Callable = fill_tokens_ref
    sample_rows: Callable = sample_rows_ref


def _decode_attention_ref(q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits=None,
                          k_scale=1.0, v_scale=1.0):
    # The reference has no splits; accept the argument so both sets share one signature.
    return decode_attention_ref(q, k_cache, v_cache, seq_lens, block_tables, scale,
                                k_scale, v_scale)


TORCH_KERNELS = Kernels(
    name="torch",
    is_triton=False,
    rms_norm=rms_norm_ref,
    rotary=rotary_ref,
    silu_and_mul=silu_and_mul_ref,
    store_kvcache=store_kvcache_ref,
    prefill_attention=prefill_attention_ref,
    decode_attention=_decode_attention_ref,
)


class CheckedFirst:
    """A Triton wrapper whose input checks run on its first launch only.

    The wrappers' checks (ranks, dtypes, devices, strides) cost tens of microseconds a
    call, several times the launch itself. An engine's shapes come from its own model
    and batch code, so the first launch (the start-up compile pass) is checked and later
    ones pass `check=False`.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.checked = False

    def __call__(self, *args, **kwargs):
        if self.checked:
            return self.fn(*args, check=False, **kwargs)
        out = self.fn(*args, **kwargs)
        self.checked = True
        return out


def triton_kernels() -> Kernels:
    from minivllm.kernels.decode_attention import decode_attention, qkv_decode_attention
    from minivllm.kernels.fill_tokens import fill_tokens
    from minivllm.kernels.gemv import gemv, rms_norm_gemv
    from minivllm.kernels.prefill_attention import prefill_attention
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.rotary import rotary
    from minivllm.kernels.sample import sample_rows
    from minivllm.kernels.silu_and_mul import silu_and_mul
    from minivllm.kernels.store_kvcache import store_kvcache

    return Kernels(
        name="triton",
        is_triton=True,
        rms_norm=CheckedFirst(rms_norm),
        rotary=CheckedFirst(rotary),
        silu_and_mul=CheckedFirst(silu_and_mul),
        store_kvcache=CheckedFirst(store_kvcache),
        prefill_attention=CheckedFirst(prefill_attention),
        decode_attention=CheckedFirst(decode_attention),
        gemv=CheckedFirst(gemv),
        rms_norm_gemv=CheckedFirst(rms_norm_gemv),
        qkv_rotary_store=CheckedFirst(qkv_rotary_store),
        qkv_decode_attention=CheckedFirst(qkv_decode_attention),
        fill_tokens=CheckedFirst(fill_tokens),
        sample_rows=CheckedFirst(sample_rows),
    )


@functools.cache
def cpu_kernels() -> Kernels:
    """The torch references, with the norm, the SiLU and the q/k rotary + K/V store of
    fp32 rows in C++ (kernels/cpu_ops.py) where the CPU extension builds (it is built once
    per machine, with the weight-only kernels); else the references alone. One set per
    process."""
    from minivllm.kernels import cpu_lowp_linear

    if cpu_lowp_linear.unavailable_reason() is not None:
        return TORCH_KERNELS
    from minivllm.kernels.cpu_ops import qkv_rotary_store_cpu, rms_norm_cpu, silu_and_mul_cpu

    return replace(TORCH_KERNELS, name="cpu", rms_norm=rms_norm_cpu,
                   silu_and_mul=silu_and_mul_cpu, qkv_rotary_store=qkv_rotary_store_cpu)


def with_prefill_dtype(kernels: Kernels, dtype: torch.dtype) -> Kernels:
    """`kernels` whose prefill attention computes in `dtype` (the CPU's bf16 prefill, where
    SDPA in bf16 takes about a third of fp32's time)."""
    assert not kernels.is_triton, "the Triton prefill computes in the cache's dtype"
    attention = functools.partial(prefill_attention_ref, compute_dtype=dtype)
    name = f"{kernels.name}, {str(dtype).removeprefix('torch.')} prefill"
    return replace(kernels, name=name, prefill_attention=attention)


def select_kernels(device: torch.device) -> Kernels:
    """Triton kernels on CUDA (or on the CPU under Triton's interpreter when asked for),
    else the CPU set on a CPU, else the torch references. Called once when an engine
    starts."""
    from minivllm.kernels.dispatch import use_triton

    if use_triton(device):
        return triton_kernels()
    return cpu_kernels() if device.type == "cpu" else TORCH_KERNELS


def bind_kernels(model: nn.Module, kernels: Kernels) -> None:
    """Point every layer of `model` that launches kernels at `kernels`."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
