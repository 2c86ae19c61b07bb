"""Write this step's K and V into the paged cache at `slot_mapping`."""

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


def store_kvcache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


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
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 skips the token
    *,
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
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
    )
