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
    """One sequence's share of a step, fixed when the step is scheduled."""

    seq: Sequence
    num_tokens: int  # tokens computed for it this step, from `start`
    start: int = 0  # the first position computed this step
    samples: bool = False  # the step reaches the sequence's end: its sampled token is kept
    is_prefill: bool = True
    # Row of the previous (in-flight) step whose sampled token is this step's last input,
    # not yet known on the host: the runner fills it in on the device. None: all known.
    fill_from: int | None = None
    epoch: int = 0  # the sequence's preemption count: a result for an older epoch is stale


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
        self.finished_ids: list[int] = []  # since the engine last took them (for TP workers)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- scheduling --------------------------------------------------------------------

    def schedule(self, masked_in_flight: bool = False) -> SchedulerOutput:
        """Choose the next step's work. May run while the previous step is in flight: a
        sequence then continues from `num_scheduled_tokens`, and one whose in-flight
        token ends it by length is left out (its end is already known).

        Sequences under a grammar sit a step out while others run, when their newest
        token is still being sampled (their bitmask needs it: the step's sampling would
        wait for the mask) or when the step in flight samples under a mask
        (`masked_in_flight`: they all take the same steps, every other one, and the
        steps between sample as plain ones do)."""
        out = SchedulerOutput()
        budget, num_ending, held = self._schedule_running(
            out, sit_out=True, align=masked_in_flight)
        held += self._admit(out, budget, num_ending, hold_grammar=masked_in_flight)
        if held and not out.scheduled and not out.preempted:
            # Nothing else runs: those held back for their grammar run now.
            budget, num_ending, _ = self._schedule_running(out, sit_out=False)
            self._admit(out, budget, num_ending, hold_grammar=False)

        # The step is now in flight for its sequences.
        for row, item in enumerate(out.scheduled):
            seq = item.seq
            seq.num_inflight_tokens += item.num_tokens
            if item.samples:
                seq.num_placeholders += 1
                seq.sample_row = row
        return out

    def _admit(self, out: SchedulerOutput, budget: int, num_ending: int,
               hold_grammar: bool) -> int:
        """Admit waiting sequences in arrival order with what is left of the budget
        (`num_ending`: running ones that end when the step in flight is collected).
        Returns how many under a grammar it held back (`hold_grammar`: their turn is the
        step after)."""
        bm = self.block_manager
        held = 0
        # Admitting while preempting would only thrash: wait for blocks to come back.
        w = 0  # the first waiting sequence not passed over
        while (
            w < len(self.waiting)
            and not out.preempted
            and budget > 0
            and len(self.running) - num_ending < self.max_num_sequences
        ):
            seq = self.waiting[w]
            if seq.awaiting_grammar or (hold_grammar and seq.grammar is not None):
                # Its grammar still compiles, or its turn is the next step: those behind
                # it go first.
                held += not seq.awaiting_grammar
                w += 1
                continue
            if seq.num_placeholders:  # preempted while its token was in flight
                break
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
            del self.waiting[w]
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = len(cached) * bm.block_size
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, seq.num_computed_tokens, num_tokens))
            budget -= num_tokens
        return held

    def _schedule_running(self, out: SchedulerOutput, sit_out: bool,
                          align: bool = False) -> tuple[int, int, int]:
        """Give the running sequences their tokens, in order, preempting the newest where
        the pool runs out. Returns the budget left, how many end when the step in flight
        is collected, and how many sat out (`sit_out`: those under a grammar whose newest
        token is in flight, and with `align` every one under a grammar)."""
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        num_ending = num_sat_out = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_scheduled_tokens
            num_tokens = min(seq.num_tokens_ahead - start, budget)
            if num_tokens <= 0 or (seq.num_placeholders and seq.finishes_by_length):
                num_ending += 1
                i += 1
                continue
            if sit_out and seq.grammar is not None and (seq.num_placeholders or align):
                num_sat_out += 1
                i += 1
                continue
            # The pool must cover what is in flight too (allocate counts from computed).
            while not bm.allocate(seq, seq.num_inflight_tokens + num_tokens):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._scheduled(seq, start, num_tokens))
                budget -= num_tokens
                i += 1
        return budget, num_ending, num_sat_out

    def _scheduled(self, seq: Sequence, start: int, num_tokens: int) -> ScheduledSeq:
        end = start + num_tokens
        fill_from = None
        if end > seq.num_tokens:
            # Only the newest token can be unknown, and only from the step just before.
            assert end == seq.num_tokens + 1 and seq.num_placeholders == 1, seq
            fill_from = seq.sample_row
        return ScheduledSeq(
            seq,
            num_tokens,
            start,
            samples=end == seq.num_tokens_ahead,
            is_prefill=not (num_tokens == 1 and start >= seq.num_prompt_tokens),
            fill_from=fill_from,
            epoch=seq.num_preemptions,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        # Its step in flight still runs (and may still sample its next token, which is
        # kept), but the K/V it writes are given up with the blocks.
        seq.num_inflight_tokens = 0
        seq.num_synced_blocks = 0
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
            if seq.is_finished:  # aborted, or ended by the step before, while this one ran
                continue
            if item.epoch == seq.num_preemptions:
                seq.num_inflight_tokens -= item.num_tokens
                seq.num_computed_tokens += item.num_tokens
                self.block_manager.cache_full_blocks(seq)
            # else: preempted since; its K/V went with its blocks, but the token sampled
            # from the full context is still its right next token.
            if item.samples:
                seq.num_placeholders -= 1
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
        self.finished_ids.append(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
