"""A conversation pane: title line, transcript, and its own input box.

The pane owns its `Conversation` (the data) and keeps the view in step with it. The app
drives it: it never talks to the engine itself.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Static

from ..conversation import ChatMessage, Conversation, Status
from ..sanitize import StreamCleaner
from .chat_input import ChatInput
from .entries import Entry, Notice, Reply, UserEntry
from .transcript import Transcript

BUSY_STATES = ("queued", "prefill", "streaming")
TITLE_PERIOD = 0.5  # seconds between title redraws while streaming


def _k(n: int) -> str:
    """A token count in at most 4 characters: 950, 3.1k, 33k, 131k."""
    if n < 1000:
        return str(n)
    return f"{n / 1000:.1f}k" if n < 9950 else f"{n / 1000:.0f}k"


def fit_title(forms: list[str], width: int) -> str:
    """The first form that fits `width` columns (0: not laid out yet, the first), else the
    last."""
    if width <= 0:
        return forms[0]
    return next((f for f in forms if len(f) <= width), forms[-1])


class ConversationPane(Vertical):
    """One conversation. States: idle, queued, prefill, streaming, stopped, error."""

    def __init__(self, conversation: Conversation, number: int) -> None:
        super().__init__(classes="pane")
        self.conversation = conversation
        self.number = number
        self.state = "idle"
        self.state_detail = ""
        self.request_id: int | None = None
        self.regenerate_after_stop = False
        self.context_tokens = 0  # the last prompt's tokens (+ its reply's, once it ends)
        self.max_len = 0  # the engine's max_model_length, once known
        self._prefill: tuple[int, int] | None = None  # (computed, prompt) tokens
        self.title_bar = Static("", markup=False, classes="pane-title")
        self.transcript = Transcript(self._entries(), classes="transcript")
        self.input = ChatInput(placeholder="Message (Enter sends, ctrl+j newline)")
        self._reply: Reply | None = None
        self._cleaner = StreamCleaner()
        self._pending: list[str] = []
        self.pending_since: float | None = None  # engine time of the oldest unshown token
        self.renders = 0  # frames that showed new text in this pane
        self.usage: tuple[int, int] | None = None  # the last reply's (prompt, completion) tokens
        self._sent_at = 0.0
        self._first_at: float | None = None
        self._last_at = 0.0
        self._tokens = 0
        self._title_dirty = True
        self._title_at = 0.0
        self.title_text = ""

    # -- building ----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield self.title_bar
        yield self.transcript
        yield self.input

    def _entries(self) -> list[Entry]:
        entries: list[Entry] = []
        for i, m in enumerate(self.conversation.messages):
            if i == self.conversation.dropped and i:
                entries.append(self._cut_marker(0))
            entries.append(self._entry_for(m))
        return entries

    def _cut_marker(self, max_len: int) -> Notice:
        n = self.conversation.dropped
        limit = f" ({max_len:,} tokens)" if max_len else ""
        return Notice(f"── {n} earlier message{'s' if n != 1 else ''} left out: "
                      f"they no longer fit the context{limit} ──", "cut")

    async def show_context_cut(self, max_len: int) -> None:
        """Move the "left out" marker to just before the first message still sent."""
        self.transcript.remove_kind("cut")
        entries = self.transcript.entries
        messages = [e for e in entries if isinstance(e, (UserEntry, Reply))]
        n = self.conversation.dropped
        if 0 < n < len(messages):
            self.transcript.insert(entries.index(messages[n]), self._cut_marker(max_len))

    def _entry_for(self, m: ChatMessage) -> UserEntry | Reply:
        if m.role == "user":
            return UserEntry(m.content)
        status: Status = "interrupted" if m.status == "streaming" else m.status
        return Reply(m.content, status, m.error)

    def on_mount(self) -> None:
        # The keys that send and break lines, as the keymap has them.
        self.input.placeholder = getattr(self.app, "input_placeholder", self.input.placeholder)
        self.transcript.anchor()
        last = self.conversation.messages[-1] if self.conversation.messages else None
        if last is not None and last.status in ("stopped", "interrupted"):
            self.state = "stopped"
        elif last is not None and last.status == "error":
            self.state = "error"
        self.refresh_title(force=True)

    # -- title -------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.state in BUSY_STATES

    @property
    def tokens(self) -> int:
        """Tokens of the current (or last) reply."""
        return self._tokens

    @property
    def last_token_at(self) -> float:
        """The engine's time (`time.monotonic()`) of the reply's latest token."""
        return self._last_at

    @property
    def ttft(self) -> float | None:
        return None if self._first_at is None else self._first_at - self._sent_at

    @property
    def tokens_per_s(self) -> float | None:
        if self._first_at is None or self._tokens < 2 or self._last_at <= self._first_at:
            return None
        return (self._tokens - 1) / (self._last_at - self._first_at)

    def set_state(self, state: str, detail: str = "") -> None:
        if (state, detail) != (self.state, self.state_detail):
            self.state, self.state_detail = state, detail
            self._title_dirty = True
            self._title_at = 0.0  # show a state change at once
            # NOTE: only the error class: a class change restyles every block of the
            # transcript, too dear to do on each state change.
            self.set_class(state == "error", "-error")

    def refresh_title(self, force: bool = False) -> None:
        """Update the title line: at once when `force`d (a state change), else at most
        twice a second.

        NOTE: the title is a one-line widget, not the border title: setting a border
        title repaints the whole pane, which with a few panes streaming cost the engine
        a fifth of its tokens/s on a 2-core machine.
        """
        now = time.monotonic()
        if not force and (not self._title_dirty or now - self._title_at < TITLE_PERIOD):
            return
        self._title_dirty = False
        self._title_at = now
        title = fit_title(self._title_forms(), self.title_bar.content_region.width)
        if title != self.title_text:
            self.title_text = title
            self.title_bar.update(title, layout=False)  # one line, whatever it says
        subtitle = self.conversation.settings.summary()
        if subtitle != str(self.border_subtitle or ""):
            self.border_subtitle = Content(subtitle)

    def _title_forms(self) -> list[str]:
        """The title from fullest to most condensed (`fit_title` takes the first that fits):
        the state and the context figure are dropped last."""
        state = short = self.state_detail or self.state
        if self.state == "prefill" and self._prefill is not None and not self.state_detail:
            done, total = self._prefill
            state = f"prefill {done:,} / {total:,}"
            short = f"prefill {_k(done)}/{_k(total)}"
        head = f"#{self.number} {state}"
        ttft = f"TTFT {self.ttft:.2f}s" if self.ttft is not None else ""
        rate = self.tokens_per_s
        speed = f"{rate:.1f} tok/s" if rate is not None else ""
        count = f"{self._tokens} tok" if self._tokens else ""
        has_ctx = bool(self.max_len and self.context_tokens)
        ctx = f"ctx {self.context_tokens:,} / {self.max_len:,} tok" if has_ctx else ""
        ctx_short = f"{_k(self.context_tokens)}/{_k(self.max_len)}" if has_ctx else ""
        head_short = f"#{self.number} {short}"
        speed_short = f"{rate:.0f} t/s" if rate is not None else ""

        def join(sep: str, *parts: str) -> str:
            return sep.join(p for p in parts if p)

        return [
            join(" · ", head, ttft, speed, count, ctx),
            join(" · ", head, speed, count, ctx),
            join(" · ", head, speed, ctx),
            join(" · ", head, ctx),
            join(" ", head_short, speed_short, ctx_short),
            join(" ", head_short, ctx_short),
        ]

    def on_resize(self) -> None:
        self.refresh_title(force=True)  # a narrower pane may need a shorter title

    def renumber(self, number: int) -> None:
        self.number = number
        self.refresh_title(force=True)

    # -- a turn --------------------------------------------------------------------------

    def add_user(self, text: str) -> None:
        self.conversation.messages.append(ChatMessage("user", text))
        self.transcript.anchor()
        self.transcript.add(UserEntry(text))

    def begin_reply(self, request_id: int) -> None:
        self.conversation.messages.append(ChatMessage("assistant", "", status="streaming"))
        self._reply = Reply()
        self.transcript.add(self._reply)
        self.request_id = request_id
        self._prefill = None
        self._cleaner = StreamCleaner()
        self._pending.clear()
        self.pending_since = None
        self._sent_at = time.monotonic()
        self._first_at = None
        self._tokens = 0
        self.usage = None
        self.set_state("queued")
        self.refresh_title(force=True)

    def accepted(self, opens_thinking: bool) -> None:
        if self._reply is not None and opens_thinking:
            self._reply.start_in_thinking()
        if self.state == "queued":
            self.set_state("prefill")

    def set_prefill_progress(self, progress: tuple[int, int] | None) -> None:
        """The engine's (prompt tokens computed, prompt tokens) for this request."""
        if progress is not None and progress != self._prefill:
            self._prefill = progress
            self._title_dirty = True
            if progress[0] > 0 and self.state == "queued":
                self.set_state("prefill")  # a chunk is computed: no longer waiting
            self.refresh_title()

    def set_queued(self, queued: bool) -> None:
        """From the stats snapshot: is this request still in the engine's waiting queue?"""
        started = self._prefill is not None and self._prefill[0] > 0
        if self.state in ("queued", "prefill") and self._first_at is None and not started:
            self.set_state("queued" if queued else "prefill")

    def feed(self, text: str, num_tokens: int, at: float, since: float | None = None) -> None:
        """Buffer streamed text that the engine produced from `since` to `at`; `flush()`
        shows it, once a frame."""
        if self._reply is None:
            return
        if num_tokens or text:
            since = at if since is None else since
            if self._first_at is None:
                self._first_at = since  # the engine's time of the first token
            if self.pending_since is None:
                self.pending_since = since
            self._last_at = at
            self._tokens += num_tokens
            self._title_dirty = True
            if self.state != "streaming":
                self.set_state("streaming")
        self._buffer(self._cleaner.feed(text))

    @property
    def pending_chars(self) -> int:
        """Characters buffered and not shown yet."""
        return sum(map(len, self._pending))

    def _buffer(self, text: str) -> None:
        if text:
            self._pending.append(text)
            self.conversation.messages[-1].content += text

    def flush(self) -> str:
        """Show buffered text (only the lines it changed are repainted); returns it (for
        the session file)."""
        text = "".join(self._pending)
        self._pending.clear()
        self.pending_since = None
        if text and self._reply is not None:
            self.renders += 1
            self._reply.append(text)
            self.transcript.changed(self._reply)
        self.refresh_title()
        return text

    async def finish(self, status: Status, error: str | None = None) -> ChatMessage:
        """End the reply in progress; the partial text stays."""
        if self._reply is not None:
            self._buffer(self._cleaner.finish())
        self.flush()
        msg = self.conversation.messages[-1]
        msg.status, msg.error = status, error
        if self._reply is not None:
            self._reply.finish(status, error)
            self.transcript.changed(self._reply)
        self._reply = None
        self.request_id = None
        if self.context_tokens:
            self.context_tokens += self._tokens
        state = {"done": "idle", "length": "idle", "stopped": "stopped"}.get(status, "error")
        self.set_state(state)
        self.refresh_title(force=True)
        self.transcript.anchor()
        return msg

    # -- other -------------------------------------------------------------------------

    async def drop_last_reply(self) -> None:
        """For regenerate: remove the reply after the last user message (data and view)."""
        i = self.conversation.last_user_index()
        if i is None:
            return
        self.conversation.drop_last_reply()
        entries = self.transcript.entries
        messages = [e for e in entries if isinstance(e, (UserEntry, Reply))]
        if len(messages) > i:
            self.transcript.truncate(entries.index(messages[i]) + 1)

    async def clear(self) -> None:
        self.conversation.messages.clear()
        self.conversation.dropped = 0
        self.transcript.clear()
        self._first_at = None
        self._tokens = 0
        self.context_tokens = 0
        self.set_state("idle")
        self.refresh_title(force=True)

    async def show_error(self, error: str) -> None:
        """A notice at the end of the transcript (e.g. the engine thread died)."""
        self.transcript.add(Notice(f"[{error}]", "error"))
        self.transcript.anchor()
