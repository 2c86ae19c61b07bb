"""Scheduler: token budget, FCFS, chunked prefill, preemption, aborts, no leaks.

The model is simulated: each scheduled sequence gets a fake sampled token, and a
sequence is finished with `finish(seq, "length")` once it has its target number of
completion tokens (the engine's job; the scheduler does not read `max_tokens`).
Plain Python, no torch.
"""

from __future__ import annotations

import itertools
import random

from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

BS = 4


def advance(
    sched: Scheduler,
    out: SchedulerOutput,
    sampled: list[int],
    expected: dict[int, list[int]],
    targets: dict[int, int],
) -> list[Sequence]:
    """Play the engine's part after a forward pass: feed the sampled tokens back, note
    the ones each sequence must keep, and finish sequences that reached their target."""
    for item, token in zip(out.scheduled, sampled, strict=True):
        if item.samples and not item.seq.is_finished:
            expected[item.seq.seq_id].append(token)
    grown = sched.update_from_output(out, sampled)
    for seq in grown:
        if seq.num_completion_tokens >= targets[seq.seq_id]:
            sched.finish(seq, "length")
    return grown


class Sim:
    """A scheduler, its block manager and a fake model that samples 1000, 1001, ..."""

    def __init__(
        self,
        num_blocks: int,
        max_num_sequences: int = 8,
        max_num_batched_tokens: int = 16,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.bm = BlockManager(num_blocks, BS)
        self.sched = Scheduler(
            self.bm, max_num_sequences, max_num_batched_tokens, enable_chunked_prefill
        )
        self.seqs: dict[str, Sequence] = {}
        self.targets: dict[int, int] = {}
        self.expected: dict[int, list[int]] = {}  # completion tokens each should hold
        self.tokens = itertools.count(1000)
        self.trace: list[list[tuple[str, int]]] = []  # per step: (name, num_tokens)

    def add(self, name: str, prompt: list[int], target: int) -> Sequence:
        seq = Sequence(len(self.seqs), prompt, SamplingParams(), max_len=10_000)
        self.seqs[name] = seq
        self.targets[seq.seq_id] = target
        self.expected[seq.seq_id] = []
        self.sched.add(seq)
        return seq

    def name(self, seq: Sequence) -> str:
        return next(n for n, s in self.seqs.items() if s is seq)

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.max_num_sequences
        self.bm.check_invariants(live=self.sched.running)
        self.trace.append([(self.name(s.seq), s.num_tokens) for s in out.scheduled])
        return out

    def update(self, out: SchedulerOutput) -> list[Sequence]:
        sampled = [next(self.tokens) for _ in out.scheduled]
        grown = advance(self.sched, out, sampled, self.expected, self.targets)
        self.bm.check_invariants(live=self.sched.running)
        return grown

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.update(out)
        return out

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if self.sched.is_finished():
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: {self.sched.running}")

    def assert_done(self) -> None:
        for seq in self.seqs.values():
            assert seq.is_finished
            assert seq.completion_token_ids == self.expected[seq.seq_id]
            if seq.finish_reason == "length":
                assert seq.num_completion_tokens == self.targets[seq.seq_id]
        assert_no_leak(self.sched)


def assert_no_leak(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert sched.is_finished() and len(sched) == 0
    assert not sched.waiting and not sched.running
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(bm.free_queue) == list(range(bm.num_blocks))
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_invariants(live=[])


def test_chunked_prefill_mixes_decode_and_prefill_chunks():
    sim = Sim(16, max_num_batched_tokens=8)
    b = sim.add("b", [1, 2, 3], target=3)
    a = sim.add("a", list(range(100, 120)), target=2)

    out = sim.schedule()
    assert [(s.seq, s.num_tokens, s.samples, s.is_prefill) for s in out.scheduled] == [
        (b, 3, True, True),
        (a, 5, False, True),
    ]
    assert b.block_table == [0] and a.block_table == [1, 2]
    sim.update(out)
    assert a.num_computed_tokens == 5 and a.num_tokens == 20  # the chunk's token is dropped
    assert b.num_tokens == 4

    out = sim.schedule()
    assert [(s.seq, s.num_tokens, s.samples, s.is_prefill) for s in out.scheduled] == [
        (b, 1, True, False),  # a decode ...
        (a, 7, False, True),  # ... and a prefill chunk in one step
    ]
    assert out.is_prefill
    assert b.block_table == [0] and a.block_table == [1, 2, 3]
    sim.update(out)

    sim.step()  # b's fifth token crosses into a new block; its third completion ends it
    assert b.is_finished and b.block_table == []
    assert a.block_table == [1, 2, 3, 5, 6] and a.num_computed_tokens == 19
    assert list(sim.bm.free_queue) == [7, 8, 9, 10, 11, 12, 13, 14, 15, 4, 0]

    out = sim.step()
    assert [(s.seq, s.num_tokens, s.samples) for s in out.scheduled] == [(a, 1, True)]
    out = sim.step()
    assert not out.is_prefill and a.is_finished

    assert sim.trace == [
        [("b", 3), ("a", 5)],
        [("b", 1), ("a", 7)],
        [("b", 1), ("a", 7)],
        [("a", 1)],
        [("a", 1)],
    ]
    assert a.completion_token_ids == [1006, 1007]
    assert b.completion_token_ids == [1000, 1002, 1004]
    assert list(sim.bm.free_queue) == [8, 9, 10, 11, 12, 13, 14, 15, 4, 0, 7, 6, 5, 3, 2, 1]
    sim.assert_done()


def test_unchunked_prompt_is_admitted_whole_or_not_at_all():
    sim = Sim(16, max_num_batched_tokens=8, enable_chunked_prefill=False)
    sim.add("b", [1, 2, 3], target=3)
    a = sim.add("a", list(range(100, 108)), target=1)
    sim.add("c", [7, 8], target=1)
    sim.step()
    # a does not fit the 5 tokens left and is not chunked; c waits behind it (FCFS).
    assert [s.seq_id for s in sim.sched.waiting] == [1, 2]
    assert a.block_table == []
    sim.run()
    assert sim.trace == [
        [("b", 3)],
        [("b", 1)],
        [("b", 1)],
        [("a", 8)],
        [("c", 2)],
    ]
    sim.assert_done()


def test_fcfs_admission_under_max_num_sequences():
    sim = Sim(32, max_num_sequences=2, max_num_batched_tokens=64)
    for name, target in zip("01234", [1, 3, 2, 1, 1], strict=True):
        sim.add(name, [int(name)] * 3, target)
    sim.step()
    assert [s.seq_id for s in sim.sched.waiting] == [2, 3, 4]
    sim.run()
    assert sim.trace == [
        [("0", 3), ("1", 3)],
        [("1", 1), ("2", 3)],
        [("1", 1), ("2", 1)],
        [("3", 3), ("4", 3)],
    ]
    sim.assert_done()


def test_budget_limits_every_step():
    sim = Sim(64, max_num_sequences=3, max_num_batched_tokens=10)
    for i in range(8):
        sim.add(f"s{i}", [i] * (3 + 5 * i), target=1 + i % 4)
    sim.run()
    for step in sim.trace:
        assert sum(n for _, n in step) <= 10 and len(step) <= 3
    assert sum(n for step in sim.trace for _, n in step) == sum(
        3 + 5 * i + (1 + i % 4) - 1 for i in range(8)
    )  # no prefix hits: every token computed exactly once
    sim.assert_done()


def test_preemption_frees_newest_requeues_at_front_and_resumes_with_its_cache():
    sim = Sim(5, max_num_sequences=2, max_num_batched_tokens=16)
    a = sim.add("a", list(range(8)), target=4)
    b = sim.add("b", list(range(20, 26)), target=4)
    c = sim.add("c", [40, 41, 42], target=1)

    sim.step()
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    sim.step()
    assert a.block_table == [0, 1, 4] and list(sim.bm.free_queue) == []
    sim.step()
    b_hashes = list(b.block_hashes)
    assert len(b_hashes) == 2 and sim.bm.hash_to_block[b_hashes[1]] == 3

    out = sim.schedule()  # b needs a third block: none free, b is the newest
    assert out.preempted == [b]
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 1)]
    assert list(sim.sched.waiting) == [b, c]  # the front, ahead of c
    assert b.status == SequenceStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_tokens == 9
    assert b.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert list(sim.bm.free_queue) == [3, 2]
    assert sim.sched.running == [a]  # no admission in a step that preempted
    sim.update(out)
    assert a.is_finished
    assert list(sim.bm.free_queue) == [3, 2, 4, 1, 0]

    out = sim.schedule()  # b hits its own blocks 2 and 3 and computes one token
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(b, 1), (c, 3)]
    assert b.block_table == [2, 3, 4] and c.block_table == [1]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 0
    assert sim.bm.blocks[2].ref_count == 1 and sim.bm.blocks[3].ref_count == 1
    assert sim.bm.num_hit_tokens == 8
    sim.update(out)

    assert sim.trace == [
        [("a", 8), ("b", 6)],
        [("a", 1), ("b", 1)],
        [("a", 1), ("b", 1)],
        [("a", 1)],
        [("b", 1), ("c", 3)],
    ]
    assert b.num_completion_tokens == 4
    assert b.completion_token_ids == [1001, 1003, 1005, 1007]  # none lost or repeated
    assert list(sim.bm.free_queue) == [0, 4, 3, 2, 1]
    # Hashes outlive the sequences (lazy eviction): a's block 0, b's blocks 2 and 3;
    # a's block 1 lost its hash when c reused it.
    assert sorted(sim.bm.hash_to_block.values()) == [0, 2, 3]
    sim.assert_done()


def test_preemption_takes_the_newest_not_the_one_asking():
    sim = Sim(3, max_num_sequences=3, max_num_batched_tokens=16)
    a = sim.add("a", [1, 2, 3, 4], target=2)
    b = sim.add("b", [5, 6, 7], target=2)
    c = sim.add("c", [8, 9, 10], target=2)
    sim.step()
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    out = sim.schedule()
    assert out.preempted == [c]
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 1), (b, 1)]
    assert a.block_table == [0, 2]
    sim.update(out)
    sim.run()
    assert sim.trace[2:] == [[("c", 4)]]
    assert c.completion_token_ids == [1002, 1005]
    assert list(sim.bm.free_queue) == [0, 1, 2]
    sim.assert_done()


def test_shared_prefix_in_the_scheduler():
    sim = Sim(16, max_num_batched_tokens=32)
    a = sim.add("a", list(range(9)), target=3)
    sim.step()
    b = sim.add("b", list(range(9)), target=2)
    out = sim.step()
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 1), (b, 1)]
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]
    assert [sim.bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert b.num_cached_tokens == 8
    sim.run()
    sim.assert_done()


def test_fully_cached_prompt_computes_its_last_block():
    sim = Sim(16, max_num_batched_tokens=32)
    sim.add("a", list(range(8)), target=1)
    sim.run()
    b = sim.add("b", list(range(8)), target=1)
    out = sim.schedule()
    [item] = out.scheduled
    assert item.seq is b and item.num_tokens == 4 and item.samples
    assert b.num_cached_tokens == 4 and b.block_table[0] == 0
    sim.update(out)
    assert b.num_completion_tokens == 1
    sim.assert_done()


def test_abort_while_waiting():
    sim = Sim(8, max_num_sequences=1)
    a = sim.add("a", [1, 2, 3, 4, 5], target=3)
    b = sim.add("b", [6, 7, 8, 9, 10], target=3)
    sim.step()
    sim.sched.finish(b, "abort")
    assert b.is_finished and b.finish_reason == "abort" and b.block_table == []
    assert list(sim.sched.waiting) == [] and sim.sched.running == [a]
    sim.sched.finish(b, "abort")  # twice is harmless
    sim.run()
    sim.assert_done()


def test_abort_mid_prefill_chunk_frees_at_once():
    sim = Sim(8, max_num_batched_tokens=4)
    a = sim.add("a", list(range(10)), target=2)
    sim.step()
    assert a.block_table == [0] and a.num_computed_tokens == 4
    out = sim.schedule()
    assert a.block_table == [0, 1]
    sim.sched.finish(a, "abort")  # while its chunk is in flight
    assert a.block_table == [] and sim.sched.running == []
    assert list(sim.bm.free_queue) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert [b.ref_count for b in sim.bm.blocks] == [0] * 8
    assert sim.update(out) == []  # the step's result for a is ignored
    assert a.num_computed_tokens == 4 and a.num_tokens == 10
    sim.assert_done()


def test_abort_mid_decode_frees_at_once_and_others_continue():
    sim = Sim(8, max_num_batched_tokens=16)
    a = sim.add("a", list(range(5)), target=5)
    b = sim.add("b", list(range(50, 55)), target=3)
    sim.step()
    sim.step()
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    sim.sched.finish(a, "abort")
    assert list(sim.bm.free_queue) == [4, 5, 6, 7, 1, 0]
    assert sim.sched.running == [b]
    sim.bm.check_invariants(live=[b])
    sim.run()
    assert a.num_completion_tokens == 2 and b.num_completion_tokens == 3
    sim.assert_done()


def test_abort_a_preempted_sequence():
    sim = Sim(3, max_num_sequences=3, max_num_batched_tokens=16)
    sim.add("a", [1, 2, 3, 4], target=3)
    sim.add("b", [5, 6, 7], target=3)
    c = sim.add("c", [8, 9, 10], target=2)
    sim.step()
    out = sim.schedule()
    assert out.preempted == [c]
    sim.update(out)
    sim.sched.finish(c, "abort")
    assert list(sim.sched.waiting) == [] and c.block_table == []
    sim.run()
    sim.assert_done()


# -- a random soak: add / step / abort against a small pool --------------------------------

VOCAB = 3  # token ids 0..2: prompts share prefixes and hit often
PREFIXES = [(), (1, 1, 1, 1, 1, 1, 1, 1), (0, 1, 2, 0, 1, 2, 0, 1, 2)]
MAX_PROMPT = 24
MAX_NEW = 8
SEEDS = st.integers(0, 2**16)


class SchedulerMachine(RuleBasedStateMachine):
    """Random requests, steps and aborts; checks the pool and the KV contents each time.

    `kv` plays the model's KV cache: slot (block, offset) holds the token prefix whose
    K/V were computed there. Every computed position a sequence reads must hold its
    own prefix; this is what prefix sharing must never break. Random choices come from
    small seeds (cheap to generate, still shrinkable).
    """

    @initialize(
        num_blocks=st.integers(8, 12),
        max_seqs=st.integers(1, 8),
        budget=st.integers(1, 40),
        chunked=st.booleans(),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, max_seqs, budget, chunked, caching):
        if not chunked:  # the engine rejects requests that cannot fit one step
            budget = max(budget, MAX_PROMPT + MAX_NEW)
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
        self.sched = Scheduler(self.bm, max_seqs, budget, chunked)
        self.chunked = chunked
        self.seqs: list[Sequence] = []
        self.targets: dict[int, int] = {}
        self.expected: dict[int, list[int]] = {}
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    def _live(self) -> list[Sequence]:
        return list(self.sched.waiting) + self.sched.running

    @rule(
        prefix=st.sampled_from(PREFIXES),
        length=st.integers(1, MAX_PROMPT),
        seed=SEEDS,
        num_new=st.integers(1, MAX_NEW),
    )
    def add(self, prefix, length, seed, num_new):
        rng = random.Random(seed)
        prompt = (list(prefix) + [rng.randrange(VOCAB) for _ in range(MAX_PROMPT)])[:length]
        seq = Sequence(len(self.seqs), prompt, SamplingParams(), max_len=10_000)
        self.seqs.append(seq)
        self.targets[seq.seq_id] = num_new
        self.expected[seq.seq_id] = []
        self.sched.add(seq)

    def _step(self, rng: random.Random | None, abort_in_flight: bool = False) -> None:
        """One engine step; sampled tokens are random, or 0 when `rng` is None."""
        waiting_before = list(self.sched.waiting)
        running_before = list(self.sched.running)
        out = self.sched.schedule()
        self.bm.check_invariants(live=self.sched.running)

        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.max_num_sequences
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        # Preemption takes the newest running sequences and puts them at the front.
        n = len(out.preempted)
        assert out.preempted == running_before[::-1][:n]
        assert list(self.sched.waiting)[:n] == out.preempted[::-1]
        for seq in out.preempted:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq.status == SequenceStatus.WAITING
        # FCFS: the admitted ones are the head of the waiting queue, and none if preempting.
        admitted = [s.seq for s in out.scheduled if s.seq not in running_before]
        assert admitted == waiting_before[: len(admitted)]
        assert not (admitted and out.preempted)
        if waiting_before and not running_before:
            assert admitted, "requests wait, nothing runs, and nothing was admitted"

        for item in out.scheduled:
            seq = item.seq
            assert item.num_tokens >= 1 and seq in self.sched.running
            if not self.chunked:
                assert item.num_tokens == seq.num_uncomputed_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens
            assert end <= seq.num_tokens
            assert len(seq.block_table) == self.bm.blocks_needed(end)
            for p in range(start):  # what it reads
                slot = (seq.block_table[p // BS], p % BS)
                assert self.kv.get(slot) == tuple(seq.token_ids[: p + 1]), (seq, p)
            for p in range(start, end):  # what the forward pass writes
                block_id = seq.block_table[p // BS]
                assert self.bm.blocks[block_id].ref_count == 1, "writes into a shared block"
                self.kv[(block_id, p % BS)] = tuple(seq.token_ids[: p + 1])

        if abort_in_flight and out.scheduled:
            victim = rng.choice(out.scheduled).seq
            self.sched.finish(victim, "abort")
            assert victim.block_table == []
            self.bm.check_invariants(live=self.sched.running)

        sampled = [rng.randrange(VOCAB) if rng else 0 for _ in out.scheduled]
        advance(self.sched, out, sampled, self.expected, self.targets)
        if currently_in_test_context():  # hypothesis statistics: what the runs covered
            if out.preempted:
                event("preempted")
            if any(s.seq.num_preemptions and s.seq not in running_before for s in out.scheduled):
                event("resumed after preemption")
            if any(s.seq.num_cached_tokens for s in out.scheduled):
                event("prefix hit")
            if out.is_prefill and not all(s.is_prefill for s in out.scheduled):
                event("decode mixed with prefill")

    @rule(seed=SEEDS, num_steps=st.integers(1, 8))
    def step(self, seed, num_steps):
        rng = random.Random(seed)
        for _ in range(num_steps):
            self._step(rng)
            self.consistent()

    @rule(seed=SEEDS)
    def step_with_abort_in_flight(self, seed):
        self._step(random.Random(seed), abort_in_flight=True)

    @rule(seed=SEEDS)
    def abort(self, seed):
        live = self._live()
        if not live:
            return
        seq = random.Random(seed).choice(live)
        held = set(seq.block_table)
        others = {b for s in self.sched.running if s is not seq for b in s.block_table}
        self.sched.finish(seq, "abort")
        assert seq.is_finished and seq.block_table == [] and seq not in self._live()
        for block_id in held - others:  # freed at once
            assert block_id in self.bm.free_queue

    @invariant()
    def consistent(self):
        if not hasattr(self, "sched"):
            return
        self.bm.check_invariants(live=self.sched.running)
        assert len(self.sched.running) <= self.sched.max_num_sequences
        for seq in self.sched.waiting:
            assert seq.status == SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in self.sched.running:
            assert seq.status == SequenceStatus.RUNNING
            assert len(seq.block_table) == self.bm.blocks_needed(seq.num_computed_tokens)
        for seq in self.seqs:
            assert seq.completion_token_ids == self.expected[seq.seq_id]

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):  # finish everything: every request fits the pool
            if self.sched.is_finished():
                break
            self._step(None)
            self.consistent()
        assert self.sched.is_finished(), self.sched.running
        for seq in self.seqs:
            assert seq.is_finished
            if seq.finish_reason == "length":
                assert seq.num_completion_tokens == self.targets[seq.seq_id]
        assert_no_leak(self.sched)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=100,
    database=None,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_seeded_soak():
    """Hundreds of requests with random aborts against small pools, without hypothesis'
    per-rule overhead: the same checks, many more steps."""
    rng = random.Random(0)
    stats = {"preempted": 0, "hits": 0, "requests": 0, "aborted": 0}
    for _ in range(12):
        m = SchedulerMachine()
        m.setup(
            num_blocks=rng.randint(8, 12),
            max_seqs=rng.randint(2, 8),
            budget=rng.randint(4, 40),
            chunked=rng.random() < 0.7,
            caching=rng.random() < 0.8,
        )
        for _ in range(500):
            op = rng.random()
            seed = rng.randrange(2**16)
            if op < 0.25:
                m.add(rng.choice(PREFIXES), rng.randint(1, MAX_PROMPT), seed, rng.randint(1, 8))
            elif op < 0.9:
                m.step(seed, 1)
            elif op < 0.97:
                m.step_with_abort_in_flight(seed)
            else:
                m.abort(seed)
            m.consistent()
        m.teardown()
        stats["preempted"] += m.sched.num_preemptions
        stats["hits"] += m.bm.num_hit_tokens
        stats["requests"] += len(m.seqs)
        stats["aborted"] += sum(s.finish_reason == "abort" for s in m.seqs)
    assert stats["preempted"] > 0 and stats["hits"] > 0, stats
    assert stats["aborted"] < stats["requests"] // 2, stats
