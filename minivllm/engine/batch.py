"""The model runner's input for one step, built from the scheduler's output. No torch.

Plain lists, so the same object can be sent to tensor-parallel workers as it is.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from .scheduler import SchedulerOutput


@dataclass
class RowExtras:
    """One sequence's penalties, min_tokens mask and logprobs request for this step."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)  # for the repetition penalty
    output_ids: list[int] = field(default_factory=list)  # for any penalty
    banned_ids: list[int] = field(default_factory=list)  # eos and stop ids before min_tokens
    num_logprobs: int = -1  # -1 = none
    num_prompt_logprobs: int = -1
    # The prompt tokens that this step's first positions of the sequence predict. Every
    # rank reads their number: the LM head computes those logits rows on all ranks.
    prompt_targets: list[int] = field(default_factory=list)


@dataclass
class ForwardBatch:
    input_ids: list[int]  # this step's tokens, sequence after sequence
    positions: list[int]
    slot_mapping: list[int]  # cache slot of each token
    cu_seqlens_q: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # context length of each sequence after this step
    block_tables: list[list[int]]
    # Sampling, one entry per sequence (used on rank 0 only).
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    seeds: list[int | None]
    # Penalties, min_tokens and logprobs: row -> what that sequence needs, only for the
    # sequences that use them (a plain batch carries an empty dict).
    extras: dict[int, RowExtras] = field(default_factory=dict)
    # Inputs not known on the host (overlapped scheduling): input_ids[fill_rows[i]] is
    # the token the previous step sampled in its row fill_from[i]; filled on the device.
    fill_rows: list[int] = field(default_factory=list)
    fill_from: list[int] = field(default_factory=list)
    # Structured outputs (rank 0 only): the rows that sample under a grammar (their
    # bitmask, filled while the forward runs, is handed to the runner's `sample`).
    bitmask_rows: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_seqs


def build_forward_batch(
    out: SchedulerOutput, block_size: int, eos_token_ids: Collection[int] = ()
) -> ForwardBatch:
    b = ForwardBatch([], [], [], [0], [], [], [], [], [], [], [])
    for item in out.scheduled:
        seq = item.seq
        start = item.start
        end = start + item.num_tokens
        b.input_ids.extend(seq.token_ids[start:end])
        if item.fill_from is not None:  # the last input is still being sampled
            b.fill_rows.append(len(b.input_ids))
            b.fill_from.append(item.fill_from)
            b.input_ids.append(0)
        b.positions.extend(range(start, end))
        table = seq.block_table
        _extend_slots(b.slot_mapping, table, start, end, block_size)
        b.cu_seqlens_q.append(b.cu_seqlens_q[-1] + item.num_tokens)
        b.seq_lens.append(end)
        b.block_tables.append(table)
        p = seq.params
        b.temperatures.append(float(p.temperature))
        b.top_ks.append(p.top_k)
        b.top_ps.append(float(p.top_p))
        b.min_ps.append(float(p.min_p))
        # A seeded request's noise depends on its seed and position only.
        b.seeds.append(None if p.seed is None else (p.seed * 1_000_003 + end) % (1 << 62))
        if p.needs_extras:
            b.extras[len(b.seq_lens) - 1] = _extras(seq, start, end, eos_token_ids)
    return b


def _extend_slots(slots: list[int], table: list[int], start: int, end: int,
                  block_size: int) -> None:
    """The cache slots of positions [start, end) through the block table, a page's run at
    a time (an 8k prefill's 8,192 slots in 32 ranges, not 8,192 expressions)."""
    if end - start == 1:  # a decode row
        slots.append(table[start // block_size] * block_size + start % block_size)
        return
    while start < end:
        page, offset = divmod(start, block_size)
        n = min(block_size - offset, end - start)
        first = table[page] * block_size + offset
        slots.extend(range(first, first + n))
        start += n


def _extras(seq, start: int, end: int, eos_token_ids: Collection[int]) -> RowExtras:
    p = seq.params
    n_prompt = seq.num_prompt_tokens
    x = RowExtras(
        repetition_penalty=float(p.repetition_penalty),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        num_logprobs=-1 if p.logprobs is None else p.logprobs,
        num_prompt_logprobs=-1 if p.prompt_logprobs is None else p.prompt_logprobs,
    )
    if p.repetition_penalty != 1:
        x.prompt_ids = seq.token_ids[:n_prompt]
    if p.has_penalties:
        x.output_ids = seq.token_ids[n_prompt:]
    if seq.num_completion_tokens < p.min_tokens:
        x.banned_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
    if p.prompt_logprobs is not None:
        # Position q predicts token q + 1; the first prompt token has no prediction.
        x.prompt_targets = seq.token_ids[start + 1 : max(start, min(end, n_prompt - 1)) + 1]
    return x
