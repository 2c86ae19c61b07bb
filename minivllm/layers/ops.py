"""Picks each kernel's implementation: Triton on CUDA, the pure-torch reference elsewhere."""

from __future__ import annotations

import functools

import torch

from minivllm.kernels.decode_attention import decode_attention_ref
from minivllm.kernels.prefill_attention import prefill_attention_ref
from minivllm.kernels.rms_norm import rms_norm_ref
from minivllm.kernels.rotary import rotary_ref
from minivllm.kernels.silu_and_mul import silu_and_mul_ref
from minivllm.kernels.store_kvcache import store_kvcache_ref


def uses_triton(device: torch.device) -> bool:
    """Whether kernels on `device` are the Triton ones (else the torch references)."""
    return _triton_for(device.type)



@functools.cache
def _triton_for(device_type: str) -> bool:
    # NOTE: decided once per device type: this sits on every layer's hot path.
    from minivllm.kernels.dispatch import use_triton

    return use_triton(torch.device(device_type))


def rms_norm(x, weight, eps, residual=None):
    if uses_triton(x.device):
        from minivllm.kernels.rms_norm import rms_norm as kernel

        return kernel(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rotary(positions, q, k, cos_sin_cache):
    if uses_triton(q.device):
        from minivllm.kernels.rotary import rotary as kernel

        return kernel(positions, q, k, cos_sin_cache)
    return rotary_ref(positions, q, k, cos_sin_cache)


def silu_and_mul(x):
    if uses_triton(x.device):
        from minivllm.kernels.silu_and_mul import silu_and_mul as kernel

        return kernel(x)
    return silu_and_mul_ref(x)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    if uses_triton(key.device):
        from minivllm.kernels.store_kvcache import store_kvcache as kernel

        return kernel(key, value, k_cache, v_cache, slot_mapping)
    return store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping)


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    if uses_triton(q.device):
        from minivllm.kernels.prefill_attention import prefill_attention as kernel

        return kernel(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)
    return prefill_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits=None):
    if uses_triton(q.device):
        from minivllm.kernels.decode_attention import decode_attention as kernel

        return kernel(q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits=num_splits)
    return decode_attention_ref(q, k_cache, v_cache, seq_lens, block_tables, scale)


# -- fused decode-path ops (Triton only: callers take them where `uses_triton` holds) -----


def qkv_rotary_store(positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache, slot_mapping,
                     q_norm_weight=None, k_norm_weight=None, eps=1e-6):
    """q/k RMSNorm (optional) + rotary + KV store in one launch; returns q."""
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store as kernel

    return kernel(positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache, slot_mapping,
                  q_norm_weight, k_norm_weight, eps)


def rms_norm_gemv(x, residual, norm_weight, eps, weight, bias=None, silu_mul=False):
    """Residual add + RMSNorm + few-row projection (+ SiLU-and-mul) in one launch."""
    from minivllm.kernels.gemv import rms_norm_gemv as kernel

    return kernel(x, residual, norm_weight, eps, weight, bias, silu_mul=silu_mul)
