"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model is bound by kernel launches (hundreds per step), not by
the GPU: replaying a captured graph launches them all at once. Graphs are captured
largest bucket first so the smaller ones fit in the memory pool the largest one made;
all share static input buffers, and a batch is padded up to its bucket.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..layers.attention import AttentionMetadata, attention_metadata


def batch_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


class CUDAGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        buckets: list[int],
        max_blocks_per_seq: int,
        decode_splits: Callable[[int], int | None],
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        on_progress: Callable[[str, float], None] | None = None,
    ) -> None:
        self.model = model
        self.buckets = buckets
        self.max_blocks_per_seq = max_blocks_per_seq
        self.decode_splits = decode_splits
        n = buckets[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.long)
            self.positions = torch.zeros(n, dtype=torch.long)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.long)
            self.seq_lens = torch.ones(n, dtype=torch.int32)
            self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
            self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32)
            self.hidden = torch.zeros(n, hidden_size, dtype=dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for i, bs in enumerate(reversed(self.buckets)):
            if on_progress is not None:
                on_progress(
                    f"capturing CUDA graphs ({i + 1}/{len(self.buckets)})",
                    0.8 + 0.2 * i / len(self.buckets),
                )
            meta = self._metadata(bs)
            with attention_metadata(meta):
                self.hidden[:bs] = model(self.input_ids[:bs], self.positions[:bs])  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), attention_metadata(meta):
                self.hidden[:bs] = model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            is_decode=True,
            decode_splits=self.decode_splits(bs),
        )

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.buckets[-1] and width <= self.max_blocks_per_seq

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_seqs, hidden]
        bs = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= bs)
        self.input_ids[:bs] = input_ids
        self.positions[:bs] = positions
        self.slot_mapping[:bs] = meta.slot_mapping
        self.seq_lens[:bs] = meta.seq_lens
        width = meta.block_tables.shape[1]
        self.block_tables[:bs, :width] = meta.block_tables
        if bucket > bs:  # padding rows write nowhere and attend to one token of block 0
            self.slot_mapping[bs:bucket] = -1
            self.seq_lens[bs:bucket] = 1
        self.graphs[bucket].replay()
        return self.hidden[:bs]
