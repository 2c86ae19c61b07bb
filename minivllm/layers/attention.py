"""Attention over the paged KV cache, driven by one per-step metadata object."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.kernels.decode_attention import decode_attention_at_slots

from . import ops


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [num_tokens]
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1]
    seq_lens: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    is_decode: bool  # every sequence computes exactly one token
    # Decode attention's split count, fixed per batch-size bucket so that a graph replay
    # and an eager step reduce in the same order (identical greedy output). None: the
    # kernel chooses.
    decode_splits: int | None = None
    # CPU decode: the cache slot of every context position, computed once a step.
    context_slots: torch.Tensor | None = None  # [num_seqs, max_len]


_metadata: AttentionMetadata | None = None


@contextmanager
def attention_metadata(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make `meta` the current step's metadata; always reset afterwards."""
    global _metadata
    _metadata = meta
    try:
        yield meta
    finally:
        _metadata = None


def get_attention_metadata() -> AttentionMetadata:
    assert _metadata is not None, "attention ran outside attention_metadata()"
    return _metadata


class Attention(nn.Module):
    """Stores this step's K/V, then attends over the whole cached context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Set by the model runner once the KV pool is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        # kv_stored: this step's K/V are already in the cache (a fused kernel put them there).
        meta = get_attention_metadata()
        if self.k_cache.numel() == 0:  # warm-up before the pool exists: plain causal attention
            return _no_cache_attention(q, k, v, meta, self.scale)
        if not kv_stored:
            ops.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.is_decode and meta.context_slots is not None:
            return decode_attention_at_slots(
                q, self.k_cache, self.v_cache, meta.context_slots, meta.seq_lens, self.scale
            )
        if meta.is_decode:
            return ops.decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                meta.seq_lens,
                meta.block_tables,
                self.scale,
                num_splits=meta.decode_splits,
            )
        return ops.prefill_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            self.scale,
        )


def _no_cache_attention(q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention within each sequence's own tokens (used only to profile memory)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    bounds = meta.cu_seqlens_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=False):
        qi = q[start:end].transpose(0, 1)
        ki = k[start:end].repeat_interleave(group, dim=1).transpose(0, 1)
        vi = v[start:end].repeat_interleave(group, dim=1).transpose(0, 1)
        o = nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
