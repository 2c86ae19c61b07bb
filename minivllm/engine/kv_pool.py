"""The KV pool of one rank: its element type, its size in blocks (a byte budget on the CPU;
on CUDA, a share of the memory a warm-up forward leaves free) and its one tensor, whose
per-layer views every attention layer reads and writes."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch import nn

from minivllm.kernels.store_kvcache import FP8_KV_DTYPE

from ..config import EngineConfig
from ..layers.attention import Attention, AttentionMetadata, attention_metadata
from .cpu_step import lazily_zeroed

CPU_KV_BUDGET_BYTES = 2 << 30  # the CPU pool's default size, when max_cached_blocks is unset
# An fp8 pool's (k_scale, v_scale), the same for every layer: static, as vLLM's default
# without calibrated scales. e4m3's relative precision is the same from 2**-6 to 448, so a
# scale only matters at those edges: on SmolLM2 (24 prompts x 64 greedy tokens against an
# fp32 cache) scales calibrated from the run's own K/V maxima (amax / 448), per layer or
# per KV head, agreed no better than 1.0 (mean |delta logprob| 0.045 and 0.048 against
# 0.041; scripts/fp8_kv_accuracy.py --scales static layer head).
FP8_KV_SCALES = (1.0, 1.0)


def kv_pool_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: float8 e4m3 (`kv_cache_dtype` fp8) or the model's."""
    return FP8_KV_DTYPE if config.kv_fp8 else dtype


def block_bytes(layers: list[Attention], block_size: int, kv_dtype: torch.dtype) -> int:
    """The bytes of one block: the K and V of `block_size` tokens in every layer."""
    layer = layers[0]
    per_token = 2 * len(layers) * layer.num_kv_heads * layer.head_dim
    return per_token * block_size * kv_dtype.itemsize


def size_kv_pool(
    model: nn.Module,
    config: EngineConfig,
    device: torch.device,
    bytes_per_block: int,
    progress: Callable[[str, float], None],
) -> int:
    """How many blocks the pool gets on this rank."""
    if device.type != "cuda":
        if config.max_cached_blocks is not None:
            return config.max_cached_blocks
        return max(1, CPU_KV_BUDGET_BYTES // bytes_per_block)
    return _size_kv_pool_cuda(model, config, device, bytes_per_block, progress)


def _size_kv_pool_cuda(
    model: nn.Module,
    config: EngineConfig,
    device: torch.device,
    bytes_per_block: int,
    progress: Callable[[str, float], None],
) -> int:
    """Warm up with the largest batch, then give the KV pool its share of what is free.

    `gpu_memory_utilization` is the share of the memory still free after the weights
    and the warm-up's peak activations that the pool takes (the seed's semantics).
    """
    progress("warming up", 0.45)
    torch.cuda.synchronize(device)
    gc.collect()  # an earlier engine's unreachable cycles may still hold its pool
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warm_up(model, config, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    current = torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    available = (free - (peak - current)) * config.gpu_memory_utilization
    return max(0, int(available) // bytes_per_block)


@torch.inference_mode()
def warm_up(model: nn.Module, config: EngineConfig, device: torch.device) -> None:
    """One forward pass over `max_num_batched_tokens` tokens without a cache."""
    num_tokens = config.max_num_batched_tokens
    max_len = config.max_len
    num_seqs = min(config.max_num_sequences, max(1, num_tokens // max(1, max_len)))
    lens = [num_tokens // num_seqs] * num_seqs
    ids = torch.zeros(sum(lens), dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full_like(ids, -1),
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32, device=device),
        is_decode=False,
    )
    with attention_metadata(meta):
        hidden = model(ids, positions)
    model.compute_logits(hidden[cu[1:].long() - 1])


def allocate_kv_pool(
    layers: list[Attention],
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    kv_fp8: bool,
) -> torch.Tensor:
    """The pool, [K/V, layer, block, token, KV head, head dim]; each layer is given its
    K and V views (and an fp8 pool's scales)."""
    layer = layers[0]
    shape = (
        2,
        len(layers),
        num_blocks,
        block_size,
        layer.num_kv_heads,
        layer.head_dim,
    )
    if device.type == "cpu":
        kv_cache = lazily_zeroed(shape, kv_dtype)
    else:
        kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    for i, attn in enumerate(layers):
        attn.k_cache = kv_cache[0, i]
        attn.v_cache = kv_cache[1, i]
        attn.kv_scales = FP8_KV_SCALES if kv_fp8 else (1.0, 1.0)
    return kv_cache
