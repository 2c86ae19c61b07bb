"""A request's tokens and bookkeeping. Plain Python: no torch."""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

from ..sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its prompt, what it generated, and which KV blocks hold it.

    `num_computed_tokens` counts the tokens whose K/V are in the cache. A step gives a
    sequence some of its uncomputed tokens; when it reaches `num_tokens` the model
    samples the next token. Prefill, chunked prefill, prefix hits and decode are all
    "some tokens this step".

    With overlapped scheduling a step is scheduled before the previous one's result is
    back: `num_inflight_tokens` are scheduled in steps not yet collected, and
    `num_placeholders` tokens are being sampled by them (not yet in `token_ids`). The
    scheduler plans from `num_scheduled_tokens` / `num_tokens_ahead`; both equal the
    plain counts whenever no step is in flight.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_len: int,
    ) -> None:
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_len = max_len  # prompt + completion cap for this request
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache on admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of the full blocks registered so far
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.num_inflight_tokens = 0
        self.num_placeholders = 0  # 0 or 1: one step of lookahead
        self.sample_row = -1  # row of the in-flight step that samples the placeholder
        self.num_synced_blocks = 0  # block-table entries the tensor-parallel workers hold
        self.first_token_time: float | None = None
        # Structured outputs: True while the request's grammar compiles (the scheduler
        # leaves it waiting), then its matcher, which accepts each token sampled.
        self.awaiting_grammar = False
        self.grammar: Any = None
        # Logprobs, when the request asks: one per completion token; one per prompt
        # position (None for the first, which nothing predicts), filled as prefill runs.
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt_token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed, or being computed by a step in flight."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_ahead(self) -> int:
        """Tokens known plus those being sampled by a step in flight."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def finishes_by_length(self) -> bool:
        """Whether the sampled tokens in flight already end it by max_tokens / max_len."""
        ahead = self.num_tokens_ahead
        return ahead - self.num_prompt_tokens >= self.params.max_tokens or ahead >= self.max_len

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]
