"""BlockManager: exact block ids, ref counts, free-queue order and prefix-cache hits.

Plain Python, no torch: every test runs in microseconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams

BS = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(), max_len=10_000)


def queue(bm: BlockManager) -> list[int]:
    return list(bm.free_queue)


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def snapshot(bm: BlockManager) -> tuple:
    return (
        queue(bm),
        refs(bm),
        dict(bm.hash_to_block),
        [(b.hash, b.token_ids) for b in bm.blocks],
    )


def prefill(bm: BlockManager, seq: Sequence, live: list[Sequence]) -> list[int]:
    """Admit `seq` as the scheduler does, compute its whole prompt; returns the hits."""
    hits = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(hits) * bm.block_size, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    bm.check_invariants(live=live)
    return hits


def decode(bm: BlockManager, seq: Sequence, token: int, live: list[Sequence]) -> None:
    """Append a sampled token and compute it (one decode step)."""
    seq.token_ids.append(token)
    assert bm.allocate(seq, 1)
    seq.num_computed_tokens += 1
    bm.cache_full_blocks(seq)
    bm.check_invariants(live=live)


def test_imports_no_torch():
    code = (
        "import sys, minivllm.engine.block_manager, minivllm.engine.scheduler; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_allocation_order_from_free_queue():
    bm = BlockManager(8, BS)
    a, b = make_seq(0, list(range(10))), make_seq(1, list(range(5)))
    assert bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert queue(bm) == [3, 4, 5, 6, 7]
    bm.check_invariants(live=[a])
    assert bm.allocate(b, 5)
    assert b.block_table == [3, 4]
    assert queue(bm) == [5, 6, 7]
    assert refs(bm) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 5
    bm.check_invariants(live=[a, b])


def test_append_across_block_boundary():
    bm = BlockManager(8, BS)
    a = make_seq(0, [1, 2, 3, 4])
    prefill(bm, a, [a])
    assert a.block_table == [0]
    for i, token in enumerate([5, 6, 7, 8]):  # fills block 1
        decode(bm, a, token, [a])
        assert a.block_table == [0, 1], i
        assert queue(bm) == [2, 3, 4, 5, 6, 7]
    decode(bm, a, 9, [a])  # position 8: the first token of block 2
    assert a.block_table == [0, 1, 2]
    assert queue(bm) == [3, 4, 5, 6, 7]
    assert refs(bm) == [1, 1, 1, 0, 0, 0, 0, 0]


def test_allocate_chunks_extend_the_table():
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(11)))
    assert bm.allocate(a, 3)  # chunk [0, 3)
    assert a.block_table == [0]
    a.num_computed_tokens = 3
    assert bm.allocate(a, 6)  # chunk [3, 9)
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert [bm.blocks[i].hash is not None for i in range(3)] == [True, True, False]
    assert bm.allocate(a, 2)  # chunk [9, 11): fits block 2
    assert a.block_table == [0, 1, 2]
    bm.check_invariants(live=[a])


def test_free_returns_blocks_tail_first_to_the_queue_end():
    bm = BlockManager(8, BS)
    a, b = make_seq(0, list(range(10))), make_seq(1, list(range(5)))
    assert bm.allocate(a, 10) and bm.allocate(b, 5)
    bm.free(a)
    assert a.block_table == [] and a.block_hashes == []
    assert queue(bm) == [5, 6, 7, 2, 1, 0]
    bm.check_invariants(live=[b])
    bm.free(b)
    assert queue(bm) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert refs(bm) == [0] * 8
    bm.check_invariants(live=[])


def test_shared_prefix_shares_blocks():
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(10)))
    assert prefill(bm, a, [a]) == []
    assert a.block_table == [0, 1, 2]
    # Blocks 0 and 1 are full and registered; block 2 holds 2 tokens.
    assert bm.hash_to_block == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    b = make_seq(1, list(range(8)) + [100, 101, 102])
    hits = prefill(bm, b, [a, b])
    assert hits == [0, 1]
    assert b.block_table == [0, 1, 3]
    assert b.block_hashes[:2] == a.block_hashes
    assert refs(bm) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert queue(bm) == [4, 5, 6, 7]
    assert bm.num_hit_tokens == 0  # record_lookup is the scheduler's call
    bm.free(a)
    assert refs(bm) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert queue(bm) == [4, 5, 6, 7, 2]  # only the block a held alone
    bm.check_invariants(live=[b])
    bm.free(b)
    assert queue(bm) == [4, 5, 6, 7, 2, 3, 1, 0]
    bm.check_invariants(live=[])


def test_partial_block_is_never_hashed_or_shared():
    bm = BlockManager(8, BS)
    a = make_seq(0, [1, 2, 3, 4, 5, 6])
    prefill(bm, a, [a])
    assert a.block_table == [0, 1]
    assert bm.blocks[1].hash is None and bm.blocks[1].token_ids is None
    assert list(bm.hash_to_block.values()) == [0]
    assert len(a.block_hashes) == 1
    # Same six tokens and more: only the full block is shared.
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 17, 18, 19])
    assert prefill(bm, b, [a, b]) == [0]
    assert b.block_table == [0, 2, 3]
    assert refs(bm) == [2, 1, 1, 1, 0, 0, 0, 0]
    decode(bm, a, 7, [a, b])
    assert bm.blocks[1].hash is None  # 7 of 8 positions computed
    assert len(bm.hash_to_block) == 2  # a's block 0 and b's block 2
    # Once a's block 1 fills with computed tokens it is registered.
    decode(bm, a, 8, [a, b])
    assert bm.blocks[1].hash == a.block_hashes[1]
    assert bm.blocks[1].token_ids == (5, 6, 7, 8)
    assert bm.hash_to_block[a.block_hashes[1]] == 1


def test_same_block_computed_twice_is_registered_once():
    bm = BlockManager(8, BS)
    a = make_seq(0, [1, 2, 3, 4, 5, 6])
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Both admitted before either computed anything: no sharing, both compute block 0.
    assert bm.find_cached_prefix(a) == [] and bm.find_cached_prefix(b) == []
    assert bm.allocate(a, 6) and bm.allocate(b, 9)
    assert a.block_table == [0, 1] and b.block_table == [2, 3, 4]
    a.num_computed_tokens, b.num_computed_tokens = 6, 9
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert a.block_hashes[0] == b.block_hashes[0]
    assert bm.hash_to_block == {b.block_hashes[0]: 0, b.block_hashes[1]: 3}
    assert bm.blocks[2].hash is None  # b's copy of block 0 stays private
    bm.check_invariants(live=[a, b])
    # a's block 1 fills with the tokens b's block 1 holds: the first registration stays.
    decode(bm, a, 7, [a, b])
    decode(bm, a, 8, [a, b])
    assert a.block_hashes[1] == b.block_hashes[1]
    assert bm.blocks[1].hash is None and bm.hash_to_block[a.block_hashes[1]] == 3


def test_freed_block_is_hit_until_reused():
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(9)))
    prefill(bm, a, [a])
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    assert queue(bm) == [3, 4, 5, 6, 7, 2, 1, 0]
    bm.check_invariants(live=[])
    b = make_seq(1, list(range(9)))
    assert prefill(bm, b, [b]) == [0, 1]
    assert b.block_table == [0, 1, 3]  # the new block comes from the queue's front
    assert queue(bm) == [4, 5, 6, 7, 2]
    assert refs(bm) == [1, 1, 0, 1, 0, 0, 0, 0]


def test_reused_block_loses_its_old_hash():
    bm = BlockManager(4, BS)
    a = make_seq(0, list(range(9)))
    prefill(bm, a, [a])
    assert a.block_table == [0, 1, 2]
    h0, h1 = a.block_hashes
    bm.free(a)
    assert queue(bm) == [3, 2, 1, 0]
    c = make_seq(1, [50 + i for i in range(9)])
    assert bm.allocate(c, 9)
    assert c.block_table == [3, 2, 1]  # block 1 (a's second block) is evicted
    assert bm.blocks[1].hash is None and bm.blocks[1].token_ids is None
    assert bm.hash_to_block == {h0: 0}
    assert queue(bm) == [0]
    bm.check_invariants(live=[c])
    # a's prompt again: block 0 still hits, block 1 no longer does.
    a2 = make_seq(2, list(range(9)))
    assert bm.find_cached_prefix(a2) == [0]
    assert a2.block_hashes == [h0]
    bm.check_invariants(live=[c])


def test_forced_hash_collision_does_not_hit(monkeypatch):
    bm = BlockManager(8, BS)
    monkeypatch.setattr(bm, "hash_block", lambda parent, token_ids: b"\x00" * 16)
    a = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, a, [a])
    assert bm.hash_to_block == {b"\x00" * 16: 0}
    b = make_seq(1, [9, 9, 9, 9, 5])  # same hash, other tokens
    assert prefill(bm, b, [a, b]) == []
    assert b.block_table == [2, 3]
    assert refs(bm) == [1, 1, 1, 1, 0, 0, 0, 0]
    # b's full block collides with a's: it is not registered over it.
    assert bm.hash_to_block == {b"\x00" * 16: 0}
    assert bm.blocks[2].hash is None
    bm.free(a)
    c = make_seq(2, [7, 7, 7, 7, 7, 7, 7, 7, 7])
    assert bm.find_cached_prefix(c) == []
    bm.check_invariants(live=[b])


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(8)))
    prefill(bm, a, [a])
    assert a.block_table == [0, 1]
    assert bm.hash_to_block == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    b = make_seq(1, list(range(8)))
    hits = bm.find_cached_prefix(b)
    assert hits == [0]  # never both blocks: the last token must be computed
    assert b.num_tokens - len(hits) * BS == 4
    assert bm.allocate(b, 4, hits)
    assert b.block_table == [0, 2]
    bm.check_invariants(live=[a, b])
    # A one-block prompt finds nothing at all.
    assert bm.find_cached_prefix(make_seq(2, [0, 1, 2, 3])) == []
    # One token more than a full block can hit it.
    assert bm.find_cached_prefix(make_seq(3, [0, 1, 2, 3, 4])) == [0]


@pytest.mark.parametrize("big", [256, 65536, 2**32, 2**40 + 7])
def test_hash_chain_keeps_wide_token_ids_distinct(big):
    bm = BlockManager(8, BS)
    assert bm.hash_block(None, [big, 1, 2, 3]) != bm.hash_block(None, [0, 1, 2, 3])
    assert bm.hash_block(None, [1, big, 2, 3]) != bm.hash_block(None, [1, big % 256, 2, 3])
    a = make_seq(0, [big, 1, 2, 3, 4, 5, 6, 7, 8])
    prefill(bm, a, [a])
    b = make_seq(1, [0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert prefill(bm, b, [a, b]) == []
    assert b.block_table == [3, 4, 5]
    assert refs(bm) == [1, 1, 1, 1, 1, 1, 0, 0]
    # The second blocks hold the same tokens but their parents differ.
    assert a.block_hashes[1] != b.block_hashes[1]
    assert len(bm.hash_to_block) == 4


def test_hash_covers_the_parent():
    bm = BlockManager(8, BS)
    h1 = bm.hash_block(None, [1, 2, 3, 4])
    h2 = bm.hash_block(None, [5, 6, 7, 8])
    assert bm.hash_block(h1, [9, 9, 9, 9]) != bm.hash_block(h2, [9, 9, 9, 9])
    assert bm.hash_block(None, [9, 9, 9, 9]) != bm.hash_block(h1, [9, 9, 9, 9])
    assert bm.hash_block(h1, [9, 9, 9, 9]) == bm.hash_block(h1, (9, 9, 9, 9))


def test_hash_keys_differ_per_engine():
    a, b = BlockManager(8, BS), BlockManager(8, BS)
    assert len(a.hash_key) >= 16 and a.hash_key != b.hash_key
    tokens = [1, 2, 3, 4]
    assert a.hash_block(None, tokens) != b.hash_block(None, tokens)
    # Deterministic within one key.
    c = BlockManager(8, BS, hash_key=a.hash_key)
    assert c.hash_block(None, tokens) == a.hash_block(None, tokens)


def test_allocate_fails_without_changes_when_short():
    bm = BlockManager(4, BS)
    a = make_seq(0, list(range(10)))
    assert bm.allocate(a, 10)
    b = make_seq(1, list(range(5)))
    before = snapshot(bm)
    assert not bm.allocate(b, 5)
    assert b.block_table == [] and snapshot(bm) == before
    bm.check_invariants(live=[a])
    assert bm.allocate(b, 4)  # exactly the last block
    assert b.block_table == [3] and queue(bm) == []
    before = snapshot(bm)
    b.num_computed_tokens = 4
    assert not bm.allocate(b, 1)
    assert b.block_table == [3] and snapshot(bm) == before
    bm.check_invariants(live=[a, b])


def test_allocate_fails_when_cached_blocks_leave_too_few():
    bm = BlockManager(3, BS)
    a = make_seq(0, list(range(9)))
    prefill(bm, a, [a])
    bm.free(a)
    assert queue(bm) == [2, 1, 0]
    x = make_seq(1, [70, 71, 72, 73, 74])
    assert bm.allocate(x, 5)
    assert x.block_table == [2, 1] and queue(bm) == [0]
    b = make_seq(2, list(range(9)))
    hits = bm.find_cached_prefix(b)
    assert hits == [0]  # block 1 was evicted by x
    before = snapshot(bm)
    # The hit block is free too: it counts against the one free block.
    assert not bm.allocate(b, 5, hits)
    assert b.block_table == [] and snapshot(bm) == before
    bm.check_invariants(live=[x])


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(0, list(range(9)))
    prefill(bm, a, [a])
    assert bm.hash_to_block == {} and all(b.hash is None for b in bm.blocks)
    b = make_seq(1, list(range(9)))
    assert prefill(bm, b, [a, b]) == []
    assert b.block_table == [3, 4, 5]


def test_record_lookup_hit_rate():
    bm = BlockManager(8, BS)
    assert bm.hit_rate == 0.0
    bm.record_lookup(10, 0)
    bm.record_lookup(10, 2)
    assert (bm.num_query_tokens, bm.num_hit_tokens) == (20, 8)
    assert bm.hit_rate == pytest.approx(0.4)


# -- the checker catches corruption ------------------------------------------------------


def _two_sharing() -> tuple[BlockManager, Sequence, Sequence]:
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(9)))
    prefill(bm, a, [a])
    b = make_seq(1, list(range(9)))
    prefill(bm, b, [a, b])
    assert b.block_table == [0, 1, 3]
    return bm, a, b


def test_check_invariants_detects_wrong_ref_count():
    bm, a, b = _two_sharing()
    bm.blocks[0].ref_count = 1
    bm.check_invariants()  # still a plausible pool on its own
    with pytest.raises(AssertionError):
        bm.check_invariants(live=[a, b])


def test_check_invariants_detects_missing_table_entry():
    bm, a, b = _two_sharing()
    with pytest.raises(AssertionError):
        bm.check_invariants(live=[a])


def test_check_invariants_detects_free_block_with_refs():
    bm, a, b = _two_sharing()
    bm.free_queue[0] = None
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_detects_lost_block():
    bm, a, b = _two_sharing()
    del bm.free_queue[7]  # neither free nor used
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_detects_bad_hash_entries():
    bm, a, b = _two_sharing()
    h0 = a.block_hashes[0]
    bm.hash_to_block[h0] = 1  # points at a block with another hash
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm, a, b = _two_sharing()
    del bm.hash_to_block[a.block_hashes[0]]  # a hashed block missing from the map
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm, a, b = _two_sharing()
    bm.blocks[0].token_ids = (1, 2)  # not a full block
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_detects_duplicate_in_table():
    bm = BlockManager(8, BS)
    a = make_seq(0, list(range(5)))
    assert bm.allocate(a, 5)
    a.block_table = [0, 0]
    bm.blocks[1].ref_count = 0
    bm.blocks[0].ref_count = 2
    bm.free_queue[1] = None
    bm.check_invariants()
    with pytest.raises(AssertionError):
        bm.check_invariants(live=[a])


def test_forced_collision_on_a_repeated_block_does_not_hit(monkeypatch):
    """Same tokens at another position (after another prefix) must not be shared."""
    bm = BlockManager(8, 4)
    monkeypatch.setattr(bm, "hash_block", lambda parent, token_ids: b"\x00" * 16)
    a = Sequence(0, [7] * 9, SamplingParams(), max_len=100)
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert a.block_table == [0, 1, 2] and bm.hash_to_block == {b"\x00" * 16: 0}
    b = Sequence(1, [7] * 9, SamplingParams(), max_len=100)
    assert bm.find_cached_prefix(b) == [0]
    assert bm.allocate(b, 5, [0])
    bm.check_invariants(live=[a, b])


@pytest.mark.parametrize("start,end", [(0, 1), (6, 7), (3, 4), (0, 12), (2, 11), (5, 5)])
def test_slot_mapping_through_the_block_table(start: int, end: int) -> None:
    """A step's slots (page runs at a time) are each position's page * block size + offset:
    a decode row, a chunk within one page, chunks over page boundaries, an empty range."""
    from minivllm.engine.batch import _extend_slots

    table = [7, 2, 9]  # pages of BS = 4 positions, not in order
    slots = [-1]  # appended to, after what is there
    _extend_slots(slots, table, start, end, BS)
    assert slots == [-1] + [table[p // BS] * BS + p % BS for p in range(start, end)]
