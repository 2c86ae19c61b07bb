"""Incremental detokenization that never splits a multi-byte character."""

from __future__ import annotations

from typing import Any

# Tokens of context decoded before the new ones, so that a token's leading space or
# merge with its neighbour comes out as it would in a full decode.
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, a piece at a time.

    It decodes a short window (some already-shown tokens + the new ones) and emits the
    part past what the window's old tokens decode to. While the window's text ends in
    U+FFFD (a character whose bytes are split across tokens) nothing is emitted: the
    bytes wait for the token that completes them.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # ids before this are already in `text`
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly complete text (possibly empty)."""
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        shown = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if window.endswith("\ufffd") or len(window) <= len(shown):
            return ""
        new = window[len(shown) :]
        self.prefix_offset = max(self.prefix_offset, self.read_offset - CONTEXT_TOKENS)
        self.read_offset = len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end: whatever is still held back, even an incomplete character."""
        if self.read_offset == len(self.ids):
            return ""
        shown = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        new = window[len(shown) :]
        self.read_offset = len(self.ids)
        self.text += new
        return new
