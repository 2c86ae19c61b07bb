"""The paged KV cache's bookkeeping: block allocation, reference counts, prefix cache.

Plain Python, no torch: the model runner owns the tensors, this owns the block ids.
"""

from __future__ import annotations

import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence as SeqLike
from hashlib import blake2b

from .sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # set once the block is full and registered
        # What the hash covers, compared on every hit so a collision never shares a block.
        self.parent: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hashed={self.hash is not None})"


class BlockManager:
    """A fixed pool of KV blocks shared by all sequences, with prefix caching.

    Invariants (see `check_invariants`): every block is either free (ref count 0, in the
    free queue) or used (ref count = number of block tables holding it). Full blocks are
    registered under a hash chain (parent hash + token ids, keyed per engine); a freed
    block keeps its hash and can still be hit until the free queue hands it out again,
    which evicts it (lazy eviction, least recently freed first). A hit compares the
    stored tokens, so a hash collision never shares a block. Partial blocks are never
    hashed, and the last prompt token is always recomputed (never a full hit).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_key: bytes | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = next handed out); O(1) removal on a hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        # NOTE: a per-engine random key keeps the hash unpredictable across engines.
        self.hash_key = hash_key if hash_key is not None else os.urandom(16)
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # -- sizes -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- hashing -----------------------------------------------------------------------

    def hash_block(self, parent: bytes | None, token_ids: SeqLike[int]) -> bytes:
        """The hash of a full block: its parent's hash and its token ids at full width."""
        h = blake2b(key=self.hash_key, digest_size=16)
        h.update(parent or b"root")
        h.update(array("q", token_ids).tobytes())
        return h.digest()

    # -- admission ---------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that already hold a prefix of `seq` (never all of its tokens).

        Also records the hashes on `seq.block_hashes`, so registration continues the
        chain later without rehashing. Changes nothing else: see `record_lookup`.
        """
        bs = self.block_size
        seq.block_hashes = []
        hits: list[int] = []
        if self.enable_prefix_caching:
            parent = None
            for i in range((seq.num_tokens - 1) // bs):
                tokens = seq.token_ids[i * bs : (i + 1) * bs]
                h = self.hash_block(parent, tokens)
                block_id = self.hash_to_block.get(h)
                if block_id is None or not self._holds(block_id, parent, tokens):
                    break
                hits.append(block_id)
                seq.block_hashes.append(h)
                parent = h
        return hits

    def _holds(self, block_id: int, parent: bytes | None, tokens: list[int]) -> bool:
        block = self.blocks[block_id]
        return block.parent == parent and block.token_ids == tuple(tokens)

    def record_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count an admitted sequence's prefix lookup in the hit-rate statistics."""
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += num_hit_blocks * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Make `seq.block_table` cover its computed tokens plus `num_new_tokens`.

        `cached` are prefix-hit blocks for a sequence being admitted (its table empty);
        they are shared, not copied. Returns False, changing nothing, when the pool
        has too few free blocks.
        """
        num_cached_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(cached)
        if num_new_blocks + num_cached_free > self.num_free_blocks:
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: it can no longer be hit
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
            block.parent = None
            block.token_ids = None
        block.ref_count = 1
        return block_id

    # -- after a step ------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_computed_tokens // bs):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            parent = hashes[-1] if hashes else None
            h = self.hash_block(parent, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and block.hash is None:
                self.hash_to_block[h] = block.block_id
                block.hash = h
                block.parent = parent
                block.token_ids = tuple(tokens)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks reaching zero join the free queue's end.

        The tail is freed first so that, among one sequence's blocks, its later ones are
        evicted before the prefix others are more likely to share.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.block_hashes = []

    # -- checking ----------------------------------------------------------------------

    def check_invariants(self, live: list[Sequence] | None = None) -> None:
        """Assert the pool is consistent; with `live`, also that ref counts match tables."""
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue)
        for block in self.blocks:
            if block.block_id in free:
                assert block.ref_count == 0, block
            else:
                assert block.ref_count > 0, block
        for h, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            assert block.hash == h and block.token_ids is not None, block
            assert len(block.token_ids) == self.block_size
        for block in self.blocks:
            if block.hash is not None:
                assert self.hash_to_block.get(block.hash) == block.block_id, block
        if live is not None:
            counts = [0] * self.num_blocks
            for seq in live:
                assert len(set(seq.block_table)) == len(seq.block_table), seq
                for block_id in seq.block_table:
                    counts[block_id] += 1
            for block in self.blocks:
                assert block.ref_count == counts[block.block_id], (block, counts[block.block_id])
