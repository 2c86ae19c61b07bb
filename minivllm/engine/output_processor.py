"""Outputs as their own stage: token ids -> text, stop strings, what each caller saw.

The scheduler and `Sequence` only know token ids. This module owns everything a caller
sees of a request's output: incremental detokenizing (never splitting a multi-byte
character), stop strings matched across token boundaries and cut from the text, the
characters held back while a stop string may still be forming, and how much of each
request has been reported through `pop_deltas`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..detokenizer import IncrementalDetokenizer
from ..outputs import Delta
from .sequence import Sequence


@dataclass
class _RequestOutputState:
    detokenizer: IncrementalDetokenizer | None
    stop: tuple[str, ...]
    num_detokenized: int = 0  # completion tokens pushed into the detokenizer
    num_reported_tokens: int = 0
    num_reported_chars: int = 0
    stop_text_len: int | None = None  # where a stop string cut the text

    @property
    def hold_back(self) -> int:
        """Characters that could be the start of a stop string, kept until decided."""
        return max((len(s) - 1 for s in self.stop), default=0)


class OutputProcessor:
    """Per-request detokenizer state, stop strings and reporting offsets, by seq id.

    The engine calls `add` when a request is queued, `hit_stop_string` after each new
    token (it decides the finish reason), `delta` when streaming and `final_text` for
    `generate`, and `remove` once the request was reported.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[int, _RequestOutputState] = {}

    def add(self, seq: Sequence) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids)
        self._states[seq.seq_id] = _RequestOutputState(detok, tuple(seq.params.stop or ()))

    def remove(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._states)

    def _catch_up(self, seq: Sequence, state: _RequestOutputState) -> None:
        """Push the completion tokens the detokenizer has not seen yet."""
        assert state.detokenizer is not None
        start = seq.num_prompt_tokens + state.num_detokenized
        state.detokenizer.push(seq.token_ids[start:])
        state.num_detokenized = seq.num_completion_tokens

    def hit_stop_string(self, seq: Sequence) -> bool:
        """Whether the text now contains a stop string; if so, remember where to cut."""
        state = self._states.get(seq.seq_id)
        if state is None or state.detokenizer is None or not state.stop:
            return False
        detok = state.detokenizer
        before = len(detok.text)
        self._catch_up(seq, state)
        # Only the new text and the tail that could join it need searching.
        longest = max(len(s) for s in state.stop)
        search_from = max(0, before - longest + 1)
        cut = min(
            (i for s in state.stop if (i := detok.text.find(s, search_from)) != -1),
            default=-1,
        )
        if cut == -1:
            return False
        state.stop_text_len = cut
        return True

    def _new_text(self, seq: Sequence, state: _RequestOutputState) -> str:
        detok = state.detokenizer
        if detok is None:
            return ""
        self._catch_up(seq, state)
        if seq.is_finished:
            if state.stop_text_len is None:
                detok.flush()
                end = len(detok.text)
            else:
                end = state.stop_text_len
        else:
            end = len(detok.text) - state.hold_back
        if end <= state.num_reported_chars:
            return ""
        text = detok.text[state.num_reported_chars : end]
        state.num_reported_chars = end
        return text

    def delta(self, seq: Sequence) -> Delta | None:
        """What `seq` gained since the previous call; None when nothing (and unfinished)."""
        state = self._states.get(seq.seq_id)
        if state is None:
            return None
        new_ids = seq.completion_token_ids[state.num_reported_tokens :]
        text = self._new_text(seq, state)
        if not new_ids and not text and not seq.is_finished:
            return None
        start = state.num_reported_tokens
        state.num_reported_tokens += len(new_ids)
        logprobs = None if seq.logprobs is None else seq.logprobs[start : start + len(new_ids)]
        # Prompt logprobs are complete once the first token exists: sent with it, once.
        prompt_logprobs = seq.prompt_logprobs if start == 0 and new_ids else None
        return Delta(
            seq.seq_id,
            new_ids,
            text,
            seq.is_finished,
            seq.finish_reason,
            seq.error,
            logprobs,
            prompt_logprobs,
            seq.num_cached_tokens,
        )

    def final_text(self, seq: Sequence) -> str:
        """The whole completion's text, cut at a stop string (for `generate`)."""
        state = self._states.get(seq.seq_id)
        if state is None or state.detokenizer is None:
            return self.decode(seq.completion_token_ids)
        self._new_text(seq, state)  # brings the text up to date (flushes when finished)
        text = state.detokenizer.text
        return text if state.stop_text_len is None else text[: state.stop_text_len]

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
