"""Attention over the paged KV cache, driven by one per-step metadata object.

How attention runs is an `AttentionBackend`, chosen once per engine (`make_backend`):
the torch references (CPU, CI, the test oracle) or the Triton kernels (CUDA). A backend
owns the step metadata it needs beyond the batch's own (decode split counts, the CPU's
context slots) and the static buffers CUDA graphs read it from; every Attention layer
goes through its engine's backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.decode_attention import context_slots, decode_attention_at_slots
from minivllm.kernels.store_kvcache import is_fp8

from .ops import TORCH_KERNELS, Kernels, select_kernels


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
    # Set when the tensors are a prefill/mixed CUDA graph's static inputs: its token bucket.
    graph_tokens: int | None = None


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


# -- backends ----------------------------------------------------------------------------


class AttentionBackend:
    """How one engine's attention layers run. Subclasses: torch references, Triton."""

    name = "base"

    def __init__(self, kernels: Kernels, block_size: int) -> None:
        self.kernels = kernels
        self.block_size = block_size
        self.decode_kwargs: dict = {}  # buffers the decode kernel takes from its backend

    def decode_launch(self, num_seqs: int, splits: int | None, dtype: torch.dtype,
                      kv_fp8: bool = False) -> dict:
        """Keyword arguments of a decode-attention launch beside its split count (`dtype`:
        the activations'; `kv_fp8`: the cache is fp8)."""
        return self.decode_kwargs

    def decode_splits(self, num_seqs: int, max_context: int | None = None) -> int | None:
        """Decode attention's split count for a batch of `num_seqs` sequences whose longest
        context is `max_context` (if known); None: the kernel chooses."""
        return None

    def decode_variants(self) -> list[tuple[int, int]]:
        """(batch size, split count) of the decode launches that compile every variant of
        this backend's decode kernel an engine step can ask for; none by default."""
        return []

    def finish_metadata(self, meta: AttentionMetadata, num_seqs: int,
                        max_context: int | None = None) -> AttentionMetadata:
        """Add what this backend needs beyond the batch (once a step, not once a layer);
        `max_context`: the batch's longest context, when the host knows it."""
        return meta

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # kv_stored: this step's K/V are already in the cache (a fused kernel put them
        # there); k and v are None then. kv_scales: an fp8 cache's (k_scale, v_scale).
        kernels = self.kernels
        k_scale, v_scale = kv_scales
        if not kv_stored:
            kernels.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping,
                                  k_scale=k_scale, v_scale=v_scale)
        if meta.is_decode:
            return kernels.decode_attention(
                q,
                k_cache,
                v_cache,
                meta.seq_lens,
                meta.block_tables,
                scale,
                num_splits=meta.decode_splits,
                k_scale=k_scale,
                v_scale=v_scale,
                **self.decode_launch(q.shape[0], meta.decode_splits, q.dtype),
            )
        return kernels.prefill_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale,
            k_scale=k_scale, v_scale=v_scale,
        )


    def forward_qkv(
        self,
        positions: torch.Tensor,  # [num_tokens]
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        num_heads: int,
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention from the QKV projection's output with the fused kernels (a set with
        `qkv_rotary_store`): q/k norm + rotary + KV store, then attention; a decode step in
        one launch where the set has `qkv_decode_attention`."""
        kernels = self.kernels
        k_scale, v_scale = kv_scales
        if meta.is_decode and kernels.qkv_decode_attention is not None:
            return kernels.qkv_decode_attention(
                positions,
                qkv,
                num_heads,
                cos_sin_cache,
                k_cache,
                v_cache,
                meta.slot_mapping,
                meta.seq_lens,
                meta.block_tables,
                scale,
                q_norm_weight,
                k_norm_weight,
                eps,
                num_splits=meta.decode_splits,
                k_scale=k_scale,
                v_scale=v_scale,
                **self.decode_launch(qkv.shape[0], meta.decode_splits, qkv.dtype,
                                     is_fp8(k_cache.dtype)),
            )
        q = kernels.qkv_rotary_store(positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache,
                                     meta.slot_mapping, q_norm_weight, k_norm_weight, eps,
                                     k_scale=k_scale, v_scale=v_scale)
        return self.forward(q, None, None, k_cache, v_cache, meta, scale, kv_stored=True,
                            kv_scales=kv_scales)


class TorchAttentionBackend(AttentionBackend):
    """The pure-torch references over the paged cache (CPU and tests)."""

    name = "torch"

    def __init__(self, block_size: int, kernels: Kernels = TORCH_KERNELS) -> None:
        super().__init__(kernels, block_size)

    def finish_metadata(self, meta: AttentionMetadata, num_seqs: int,
                        max_context: int | None = None) -> AttentionMetadata:
        if meta.is_decode:
            meta.context_slots = context_slots(meta.seq_lens, meta.block_tables, self.block_size)
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, kv_stored=False,
                kv_scales=(1.0, 1.0)):
        if meta.is_decode and meta.context_slots is not None:
            k_scale, v_scale = kv_scales
            if not kv_stored:
                self.kernels.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping,
                                           k_scale=k_scale, v_scale=v_scale)
            return decode_attention_at_slots(
                q, k_cache, v_cache, meta.context_slots, meta.seq_lens, scale, k_scale, v_scale
            )
        return super().forward(q, k, v, k_cache, v_cache, meta, scale, kv_stored, kv_scales)


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels. Decode split counts depend on the batch's graph bucket only,
    so a graph replay and an eager step of the same batch reduce in the same order."""

    name = "triton"

    def __init__(
        self,
        kernels: Kernels,
        block_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        decode_buckets: list[int],
        num_sms: int,
        device: torch.device,
    ) -> None:
        from minivllm.kernels.decode_attention import decode_counters
        from minivllm.kernels.tuning import decode_min_split, decode_short_max

        super().__init__(kernels, block_size)
        self.num_kv_heads = num_kv_heads
        self.max_seq_len = max_seq_len
        self.decode_buckets = decode_buckets
        self.num_sms = num_sms
        self._splits: dict[int, int] = {}
        # Steps whose contexts are all at most this long take the short launch, one split
        # (kernels/tuning.py's DECODE_SHORT; 0: never).
        self.short_context = decode_short_max()
        # NOTE: allocated once, outside every graph: the split kernel's last program of each
        # (sequence, KV head) merges the partials and zeroes its counter for the next layer.
        self.decode_kwargs = {
            "counters": decode_counters(max(decode_buckets), num_kv_heads, device),
            "min_split_len": decode_min_split(),  # kernels/tuning.py
        }
        # The short launch (one program per KV head) has its own tiles: latency, not
        # bandwidth, sets its time (MINIVLLM_DECODE_SHORT_TILE).
        self._short_kwargs: dict[tuple[torch.dtype, bool], dict] = {}

    def decode_launch(self, num_seqs: int, splits: int | None, dtype: torch.dtype,
                      kv_fp8: bool = False) -> dict:
        """The short launch (every context short, so `decode_splits` gave 1 where the bucket
        takes more) gets the short tiles; graph capture and eager steps decide alike. Over
        an fp8 cache it does not load its first tile before the PDL wait: on an H100 at
        batch 1 and 128 positions, 1,194 tok/s without that prefetch against 1,134 with it
        (the 16-bit cache: 1,188 with it, 1,116 without; one run each)."""
        if splits != 1 or not self.short_context or self.decode_splits(num_seqs) == 1:
            return self.decode_kwargs
        kwargs = self._short_kwargs.get((dtype, kv_fp8))
        if kwargs is None:
            from minivllm.kernels.decode_attention import short_tile_config

            kwargs = dict(self.decode_kwargs, tile_config=short_tile_config(dtype))
            if kv_fp8:
                kwargs["prefetch"] = False
            self._short_kwargs[(dtype, kv_fp8)] = kwargs
        return kwargs

    def decode_splits(self, num_seqs: int, max_context: int | None = None) -> int:
        """The split count of a decode launch for `num_seqs` sequences: the bucket's, or 1
        (the short launch) when the longest context (`max_context`, if known) is at most
        `short_context` positions."""
        if max_context is not None and max_context <= self.short_context:
            return 1
        splits = self._splits.get(num_seqs)
        if splits is None:
            from minivllm.kernels.decode_attention import choose_num_splits

            bucket = next((b for b in self.decode_buckets if b >= num_seqs), num_seqs)
            splits = choose_num_splits(bucket, self.num_kv_heads, self.max_seq_len, self.num_sms)
            self._splits[num_seqs] = splits
        return splits

    def all_decode_splits(self) -> list[int]:
        """Every split count an engine step can ask for (kernel variants to compile)."""
        splits = {self.decode_splits(b) for b in self.decode_buckets}
        return sorted(splits | {1} if self.short_context else splits)

    def decode_variants(self) -> list[tuple[int, int]]:
        # Each split count once (the dummy contexts are short: the count is forced).
        variants = []
        for splits in self.all_decode_splits():
            bucket = next((b for b in self.decode_buckets if self.decode_splits(b) == splits),
                          self.decode_buckets[0])
            variants.append((bucket, splits))
        first = self.decode_buckets[0]
        if self.short_context and self.decode_splits(first) != 1:
            # The short launch (one split where the bucket takes more) has its own tiles.
            variants.append((first, 1))
        return variants

    def finish_metadata(self, meta: AttentionMetadata, num_seqs: int,
                        max_context: int | None = None) -> AttentionMetadata:
        if meta.is_decode:
            meta.decode_splits = self.decode_splits(num_seqs, max_context)
        return meta


def make_backend(
    device: torch.device,
    block_size: int,
    num_kv_heads: int,
    max_seq_len: int,
    decode_buckets: list[int],
    kernels: Kernels | None = None,
) -> AttentionBackend:
    """The engine's attention backend, chosen once from its device (over `kernels`, default:
    the device's set)."""
    kernels = kernels or select_kernels(device)
    if not kernels.is_triton:
        return TorchAttentionBackend(block_size, kernels)
    from minivllm.kernels.dispatch import num_sms

    return TritonAttentionBackend(
        kernels, block_size, num_kv_heads, max_seq_len, decode_buckets, num_sms(device), device
    )


# -- the layer -----------------------------------------------------------------------------


class Attention(nn.Module):
    """Stores this step's K/V, then attends over the whole cached context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Set by the model runner: the engine's backend, then the KV pool once allocated.
        self.backend: AttentionBackend = TorchAttentionBackend(block_size=16)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # An fp8 pool holds K / k_scale and V / v_scale (constants: a CUDA graph bakes
        # them in); a pool in the model's dtype ignores them.
        self.kv_scales: tuple[float, float] = (1.0, 1.0)

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
            return no_cache_attention(q, k, v, meta.cu_seqlens_q.tolist(), self.scale)
        return self.backend.forward(
            q, k, v, self.k_cache, self.v_cache, meta, self.scale, kv_stored=kv_stored,
            kv_scales=self.kv_scales,
        )

    def forward_qkv(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """From the QKV projection's output with the fused kernels (the KV pool exists)."""
        return self.backend.forward_qkv(
            positions, qkv, self.num_heads, cos_sin_cache, self.k_cache, self.v_cache,
            get_attention_metadata(), self.scale, q_norm_weight, k_norm_weight, eps,
            self.kv_scales,
        )


# Scores held at once by the warm-up's attention, in elements: the query chunk shrinks as
# sequences grow, so memory stays linear in the token count (2**25 fp32 = 128 MiB).
NO_CACHE_SCORE_BUDGET = 1 << 25


def no_cache_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    cu_seqlens: list[int],  # [num_seqs + 1]
    scale: float,
    score_budget: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention within each sequence's own tokens, used only by the warm-up that
    profiles memory before the KV pool exists.

    NOTE: never a [heads, tokens, tokens] matrix: queries go in chunks sized so that one
    chunk's scores stay under `score_budget` elements (SDPA on 3-D inputs takes the math
    path, which is quadratic: a 32k-token warm-up ran the H200 out of memory)."""
    budget = NO_CACHE_SCORE_BUDGET if score_budget is None else score_budget
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=False):
        n = end - start
        if n == 0:
            continue
        chunk = max(1, min(n, budget // (num_heads * n)))
        ks = k[start:end].transpose(0, 1)[None]  # [1, num_kv_heads, n, head_dim]
        vs = v[start:end].transpose(0, 1)[None]
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            qc = q[start + c0 : start + c1].transpose(0, 1)[None]  # [1, heads, c, head_dim]
            # Query i (position c0 + i) sees keys 0..c0 + i.
            mask = torch.ones(c1 - c0, c1, dtype=torch.bool, device=q.device).tril(c0)
            o = F.scaled_dot_product_attention(
                qc,
                ks[:, :, :c1],
                vs[:, :, :c1],
                attn_mask=mask,
                scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )
            out[start + c0 : start + c1] = o[0].transpose(0, 1)
    return out
