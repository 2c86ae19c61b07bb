"""What the engine hands back to its callers: streamed deltas and stats snapshots."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the token there (sampled, or the prompt's) and
    the `top` most likely tokens, most likely first (`top` may include `token_id`).
    `rank` is 1 for the most likely token."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


@dataclass(frozen=True)
class Delta:
    """What one sequence gained since the previous `LLMEngine.pop_deltas()` call.

    `text` never ends inside a multi-byte character: bytes of a character split across
    tokens are held back until the character is complete. `finish_reason` is one of
    "stop" (eos, stop id or stop string), "length" (max_tokens or max_model_length),
    "abort" or "error"; `error` holds the message when it is "error".
    `logprobs` has one entry per new token when the request asked for logprobs;
    `prompt_logprobs` comes once, with the sequence's first delta (None for the first
    prompt token, which nothing predicts). `num_cached_tokens`: the prompt tokens found
    in the prefix cache when the sequence was first scheduled.
    """

    seq_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine, in vLLM's vocabulary.

    Counters are totals since start; the `*_per_s` rates are over a short sliding window
    (`window_s`), so a UI can show both the current rate and an average.
    """

    block_size: int
    num_blocks: int
    num_used_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    num_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int = 0
    last_step_time_s: float = 0.0
    last_batch_size: int = 0
    window_s: float = 1.0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0
