"""A pane's context: how many tokens its next prompt costs, and leaving out the oldest
turns when the prompt would leave no room for a reply."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .engine_client import render_prompt

if TYPE_CHECKING:
    from .conversation import Conversation
    from .store import SessionStore
    from .widgets.pane import ConversationPane


def count_prompt_tokens(tokenizer: Any, conv: Conversation) -> int | None:
    """Tokens of the conversation's next prompt (chat template included), or None
    without a tokenizer. NOTE: runs on the UI thread while the engine thread may
    tokenize too; encoding with a fast tokenizer only reads it."""
    if tokenizer is None:
        return None
    try:
        text = render_prompt(tokenizer, conv.template_messages(), conv.settings.thinking)
        return len(tokenizer.encode(text, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - then the engine's own check speaks
        return None


def count_context(pane: ConversationPane, tokenizer: Any, max_len: int) -> None:
    """The title's context figure for a pane that already holds a conversation (a
    resumed or reopened one): its history as the next prompt would send it."""
    if pane.conversation.messages and max_len:
        pane.context_tokens = count_prompt_tokens(tokenizer, pane.conversation) or 0
        pane.max_len = max_len


async def fit_context(pane: ConversationPane, tokenizer: Any, max_len: int,
                      store: SessionStore) -> None:
    """Leave out the oldest turns (never the system prompt, never the new message)
    until the prompt leaves room for a reply, and mark the cut in the transcript."""
    conv = pane.conversation
    tokens = count_prompt_tokens(tokenizer, conv)
    if tokens is None or not max_len:
        return
    room = min(conv.settings.max_tokens, max(1, max_len // 4))
    dropped = conv.dropped
    while tokens + room > max_len and conv.next_turn_start() is not None:
        conv.dropped = conv.next_turn_start()
        tokens = count_prompt_tokens(tokenizer, conv) or 0
    pane.context_tokens = tokens
    pane.max_len = max_len
    if conv.dropped != dropped:
        await pane.show_context_cut(max_len)
        store.context_cut(conv.key, conv.dropped)
