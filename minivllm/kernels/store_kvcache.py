"""Write this step's K and V into the paged cache at `slot_mapping`.

An fp8 cache (float8 e4m3) stores x / scale, saturated to e4m3's range, with one scale per
layer for K and one for V; attention reads x_fp8 * scale. `quantize_kv` / `dequantize_kv`
are the references' conversions; the Triton kernels do the same arithmetic in registers.
"""

from __future__ import annotations

import torch

from minivllm.kernels.dispatch import (
    INDEX_DTYPES,
    check_kv_cache,
    check_tensor,
    require_triton,
    tl,
    triton,
)

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448: larger magnitudes saturate


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`x` as the cache stores it: in `dtype`, or for fp8 x / scale (in fp32), saturated."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached values in the compute `dtype`: an fp8 cache's times its scale."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return x.to(dtype) * scale


def store_kvcache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
    k_scale: float = 1.0,  # fp8 caches only: the cache holds key / k_scale
    v_scale: float = 1.0,
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    slots = slot_mapping.long()
    key = quantize_kv(key, k_cache.dtype, k_scale)
    value = quantize_kv(value, v_cache.dtype, v_scale)
    if is_fp8(k_cache.dtype):  # the CPU has no index_copy_ for float8: copy the bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)


@triton.jit
def to_kv(x, scale, cache_ptr, KV_FP8: tl.constexpr):
    """`x` as the cache at `cache_ptr` stores it (`quantize_kv`'s arithmetic): fp8 holds
    x / scale, saturated to +-448 (e4m3's largest finite value)."""
    if KV_FP8:
        x = x.to(tl.float32) / scale
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # One program per token: copies all its KV heads into one cache slot.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding tokens (CUDA graph buckets) have no slot
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < NUM_KV_HEADS
    src = token.to(tl.int64) * key_stride_t + heads * key_stride_h + dims
    k = tl.load(key_ptr + src, mask=mask)  # [HEADS_PAD, HEAD_DIM]
    src = token.to(tl.int64) * value_stride_t + heads * value_stride_h + dims
    v = tl.load(value_ptr + src, mask=mask)
    # NOTE: int64 offsets: a layer's pool can exceed 2**31 elements.
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    tl.store(k_cache_ptr + dst, to_kv(k, k_scale, k_cache_ptr, KV_FP8), mask=mask)
    tl.store(v_cache_ptr + dst, to_kv(v, v_scale, v_cache_ptr, KV_FP8), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 skips the token
    *,
    k_scale: float = 1.0,  # fp8 caches only: the cache holds key / k_scale
    v_scale: float = 1.0,
    check: bool = True,
) -> None:
    """Triton version of `store_kvcache_ref`. key/value may be strided views (e.g. slices
    of a fused QKV output) as long as head_dim is contiguous. `check=False` skips the
    input checks (an engine checks each kernel's first launch)."""
    if check:
        require_triton()
        check_kv_cache(k_cache, v_cache)
    num_tokens = key.shape[0]
    _, _, num_kv_heads, head_dim = k_cache.shape
    if check:
        check_tensor("key", key, 3, device=k_cache.device)
        check_tensor("value", value, 3, device=k_cache.device)
        check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, device=k_cache.device)
        expected = (num_tokens, num_kv_heads, head_dim)
        if tuple(key.shape) != expected or tuple(value.shape) != expected:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                f"{expected} to match the cache"
            )
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens"
            )
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_scale,
        v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        KV_FP8=is_fp8(k_cache.dtype),
    )
