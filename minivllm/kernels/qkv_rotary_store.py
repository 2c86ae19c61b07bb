"""The QKV projection's post-processing in one launch: per-head RMSNorm of q and k (Qwen3;
optional), rotary embedding of q and k, and the store of k and v into the paged cache.

Replaces up to four launches a layer (q norm, k norm, rotary, KV store). One program per
(BLOCK_TOKENS tokens, head): heads [0, num_heads) are q heads, written to a new q tensor;
the next num_kv_heads programs normalise and rotate a k head and copy its v head into the
cache.
k is not written back to the QKV buffer: attention reads it from the cache.
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
from minivllm.kernels.pdl import attention_pdl
from minivllm.kernels.rms_norm import rms_norm_ref
from minivllm.kernels.rotary import rotary_ref
from minivllm.kernels.store_kvcache import is_fp8, store_kvcache_ref, to_kv

# Tokens a program (with 2 warps at head_dim 128). One (token, head) a program gave each
# program so little work that an 8k-token chunk of Qwen3-0.6B (134 MB read and written) took
# 240 us a layer on an H100, 559 GB/s; 16 tokens: 57.9 us, 2,319 GB/s (8 to 32 tokens and 1
# to 8 warps within 5%; `python scripts/prefill_attn_sweep.py --qkv`).
BLOCK_TOKENS = 16


def qkv_rotary_store_ref(
    positions: torch.Tensor,  # [num_tokens]
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    num_heads: int,
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in the first half, sin after
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 skips the token's store
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,  # an fp8 cache's scales (kernels/store_kvcache.py)
    v_scale: float = 1.0,
) -> torch.Tensor:  # q: [num_tokens, num_heads, head_dim]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)[0]
        k = rms_norm_ref(k, k_norm_weight, eps)[0]
    q, k = rotary_ref(positions, q, k, cos_sin_cache)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


# NOTE: the token count changes every step; not specialised on, so a new step size never
# compiles a new variant mid-run.
@triton.jit(do_not_specialize=["num_tokens"])
def _qkv_rotary_store_kernel(
    positions_ptr,
    qkv_ptr,
    q_out_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    qkv_stride_t,
    num_tokens,
    eps,
    k_scale,  # an fp8 cache's scales (kernels/store_kvcache.py)
    v_scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # HEAD_DIM // 2
    BLOCK_T: tl.constexpr,  # tokens a program
    QK_NORM: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
    KV_FP8: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    head = tl.program_id(1)
    live = (tokens < num_tokens)[:, None]  # [BLOCK_T, 1]
    dims = tl.arange(0, HALF)[None, :]  # [1, HALF]
    # Positions and the table are step inputs no kernel writes: read before the wait.
    pos = tl.load(positions_ptr + tokens[:, None], mask=live, other=0).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + dims, mask=live, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + dims, mask=live,
                  other=0.0).to(tl.float32)  # [BLOCK_T, HALF]
    if PDL:
        tl.extra.cuda.gdc_wait()
    act_dtype = qkv_ptr.dtype.element_ty
    src = qkv_ptr + tokens[:, None] * qkv_stride_t + head * HEAD_DIM  # q heads, then k heads
    x1 = tl.load(src + dims, mask=live, other=0.0)
    x2 = tl.load(src + HALF + dims, mask=live, other=0.0)
    if QK_NORM:
        # As rms_norm_ref: normed rows rounded, times the weight, rounded again.
        is_q = (dims * 0 + head) < NUM_HEADS  # [1, HALF]: q or k weights
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM + eps)
        rstd = rstd[:, None]
        w1 = tl.where(is_q, tl.load(q_norm_ptr + dims), tl.load(k_norm_ptr + dims))
        w2 = tl.where(is_q, tl.load(q_norm_ptr + HALF + dims), tl.load(k_norm_ptr + HALF + dims))
        w1 = w1.to(tl.float32)
        w2 = w2.to(tl.float32)
        x1 = ((f1 * rstd).to(act_dtype).to(tl.float32) * w1).to(act_dtype)
        x2 = ((f2 * rstd).to(act_dtype).to(tl.float32) * w2).to(act_dtype)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    y1 = f1 * cos - f2 * sin
    y2 = f2 * cos + f1 * sin
    if head < NUM_HEADS:
        q_dst = q_out_ptr + (tokens[:, None] * NUM_HEADS + head) * HEAD_DIM
        tl.store(q_dst + dims, y1.to(q_out_ptr.dtype.element_ty), mask=live)
        tl.store(q_dst + HALF + dims, y2.to(q_out_ptr.dtype.element_ty), mask=live)
    else:
        kv_head = head - NUM_HEADS
        # Padding tokens of a CUDA-graph bucket have no slot (-1), nor do the tile's rows
        # past the step's tokens.
        slot = tl.load(slot_mapping_ptr + tokens[:, None], mask=live, other=-1).to(tl.int64)
        keep = slot >= 0  # [BLOCK_T, 1]
        # NOTE: int64 offsets: a layer's pool can exceed 2**31 elements.
        cache_offset = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
        # Rounded to the activation dtype first, as the reference's rotated k is.
        k_dst = k_cache_ptr + cache_offset
        tl.store(k_dst + dims, to_kv(y1.to(act_dtype), k_scale, k_cache_ptr, KV_FP8), mask=keep)
        tl.store(k_dst + HALF + dims, to_kv(y2.to(act_dtype), k_scale, k_cache_ptr, KV_FP8),
                 mask=keep)
        v_dims = tl.arange(0, HEAD_DIM)[None, :]
        v = tl.load(src + NUM_KV_HEADS * HEAD_DIM + v_dims, mask=keep)
        tl.store(v_cache_ptr + cache_offset + v_dims, to_kv(v, v_scale, v_cache_ptr, KV_FP8),
                 mask=keep)


def check_qkv_inputs(positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache, slot_mapping,
                  q_norm_weight, k_norm_weight) -> None:
    device = k_cache.device
    num_tokens, width = qkv.shape
    require_triton()
    _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("qkv", qkv, 2, device=device)
    check_tensor("positions", positions, 1, INDEX_DTYPES, device=device)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, device=device)
    if width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv has {width} columns; {num_heads} q + 2 x {num_kv_heads} kv heads of "
            f"{head_dim} need {(num_heads + 2 * num_kv_heads) * head_dim}"
        )
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"positions {tuple(positions.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must have one entry per token ({num_tokens})"
        )
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or not (
        cos_sin_cache.is_contiguous()
    ):
        raise ValueError(
            f"cos_sin_cache must be a contiguous [max_position, {head_dim}] tensor, "
            f"got shape {tuple(cos_sin_cache.shape)}"
        )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight come together (or neither)")
    if q_norm_weight is not None:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            check_tensor(name, w, 1, device=device)
            if w.shape[0] != head_dim:
                raise ValueError(f"{name} has {w.shape[0]} elements for head_dim {head_dim}")


def qkv_rotary_store(
    positions: torch.Tensor,  # [num_tokens]
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    num_heads: int,
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim], contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 skips the token's store
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    check: bool = True,
    block_tokens: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:  # q: [num_tokens, num_heads, head_dim], a new tensor
    """Triton version of `qkv_rotary_store_ref`. Positions are not range-checked (that
    would need a host sync); they must be < max_position. `check=False` skips the input
    checks (an engine checks each kernel's first launch); `block_tokens` and `num_warps`
    override a program's tokens (BLOCK_TOKENS) and warps (benchmarks, tests)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    device = k_cache.device
    num_tokens = qkv.shape[0]
    if check:
        check_qkv_inputs(positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache,
                      slot_mapping, q_norm_weight, k_norm_weight)
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=device)
    if num_tokens == 0:
        return q
    pdl = attention_pdl(device)
    block_t = BLOCK_TOKENS if block_tokens is None else block_tokens
    _qkv_rotary_store_kernel[(triton.cdiv(num_tokens, block_t), num_heads + num_kv_heads)](
        positions,
        qkv,
        q,
        qkv if q_norm_weight is None else q_norm_weight,
        qkv if k_norm_weight is None else k_norm_weight,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        qkv.stride(0),
        num_tokens,
        eps,
        k_scale,
        v_scale,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        BLOCK_T=block_t,
        QK_NORM=q_norm_weight is not None,
        PDL=pdl,
        KV_FP8=is_fp8(k_cache.dtype),
        num_warps=max(1, min(4, block_t * head_dim // 1024)) if num_warps is None else num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return q
