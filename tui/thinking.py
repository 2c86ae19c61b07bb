"""The thinking/answer splitter the app uses (shared with the server's reasoning output)."""

from __future__ import annotations

from ..reasoning import ThinkParser, split_thinking

__all__ = ["ThinkParser", "split_thinking"]
