"""Continuous batching under a token budget. Plain Python: no torch.

There is no prefill or decode phase: every sequence has `num_computed_tokens`, and each
step gives some sequences some tokens. Running sequences go first (a decode is one
token; an unfinished prefill chunk continues), then waiting ones are admitted in
arrival order with whatever budget is left, their prompts chunked to fit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's end, so its sampled token is kept."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens

    @property
    def is_prefill(self) -> bool:
        seq = self.seq
        return not (self.num_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_prefill(self) -> bool:
        return any(s.is_prefill for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Chooses each step's work; owns the waiting queue and the running list.

    FCFS: `running` is in admission order. When the pool runs out of blocks the newest
    running sequence is preempted by recompute: its blocks are freed and it goes back
    to the front of the waiting queue (its prefix may still be hit on re-admission).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_sequences: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_sequences = max_num_sequences
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- scheduling --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not bm.allocate(seq, num_tokens):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_tokens))
                budget -= num_tokens
                i += 1

        # Admitting while preempting would only thrash: wait for blocks to come back.
        while (
            self.waiting
            and not out.preempted
            and budget > 0
            and len(self.running) < self.max_num_sequences
        ):
            seq = self.waiting[0]
            cached = bm.find_cached_prefix(seq)
            if seq.params.prompt_logprobs is not None:  # needs every prompt position computed
                cached, seq.block_hashes = [], []
            num_tokens = seq.num_tokens - len(cached) * bm.block_size
            if num_tokens > budget:
                if not self.enable_chunked_prefill:
                    break
                num_tokens = budget
            if not bm.allocate(seq, num_tokens, cached):
                break
            bm.record_lookup(seq.num_tokens, len(cached))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = len(cached) * bm.block_size
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- after the forward pass --------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Advance each scheduled sequence; append the sampled tokens that count.

        `sampled[i]` is the token sampled for `out.scheduled[i]` (ignored for a prefill
        chunk that does not reach the sequence's end). Returns the sequences that
        received a token this step.
        """
        grown = []
        for item, token in zip(out.scheduled, sampled, strict=True):
            seq = item.seq
            if seq.is_finished:  # aborted while its step ran
                continue
            reaches_end = item.samples
            seq.num_computed_tokens += item.num_tokens
            self.block_manager.cache_full_blocks(seq)
            if reaches_end:
                seq.token_ids.append(token)
                grown.append(seq)
        return grown

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence: free its blocks and take it out of the queues."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
