"""The chat app's panes' lifecycle: open, close (asking first when there is something to
lose), reopen, clear, and the collector's passes once panes close or replies end."""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING

from minivllm.heap import settle

from .context import count_context
from .conversation import Conversation
from .widgets.confirm import ConfirmModal
from .widgets.pane import ConversationPane

if TYPE_CHECKING:
    from .app import ChatApp

MAX_PANES = 9
FULL_SETTLE_AFTER = 2.0  # seconds after a pane closes (see `PaneControl.close`)
SETTLE_AFTER = 0.5  # seconds of nothing streaming before the heap is settled (`settle`)


class PaneControl:
    """Opens and closes the app's panes; remembers the closed ones for reopening."""

    def __init__(self, app: ChatApp, closed: list[Conversation], next_key: int) -> None:
        self.app = app
        # Closed panes' conversations, newest last (ctrl+o reopens).
        self.closed = closed
        self._next_key = next_key

    def _room(self) -> bool:
        """Whether another pane fits (says so when not)."""
        if len(self.app.panes) >= MAX_PANES:
            self.app.notify(f"at most {MAX_PANES} panes", severity="warning")
            return False
        return True

    async def new(self) -> None:
        """A fresh pane with the default settings, focused."""
        app = self.app
        if app.chat is None or not self._room():
            return
        conv = Conversation(self._next_key, copy.deepcopy(app.default_settings))
        self._next_key += 1
        app.store.pane(conv.key, conv.settings)
        pane = ConversationPane(conv, len(app.panes) + 1)
        await app.chat.panes_box.mount(pane)
        app.focus_pane(pane)

    async def close_asking(self, pane: ConversationPane) -> None:
        """Close `pane`; one holding messages or a draft asks first (ctrl+w is also
        "delete a word" to shell users). ctrl+o reopens it."""
        app = self.app
        if len(app.panes) == 1:
            app.notify("this is the last pane (ctrl+q quits)", severity="warning")
            return
        if not (pane.conversation.messages or pane.input.text.strip()):
            await self.close(pane)
            return
        what = "its reply is streaming" if pane.busy else "it holds a conversation"
        question = (f"Close pane #{pane.number}? {what[0].upper() + what[1:]}. "
                    "ctrl+o (or Reopen in ctrl+p) brings it back.")
        # A worker waits for the answer, so the key's action returns at once.
        app.run_worker(functools.partial(self._confirm_close, pane, question),
                       name="confirm close", group="confirm-close", exclusive=True)

    async def _confirm_close(self, pane: ConversationPane, question: str) -> None:
        yes = await self.app.push_screen_wait(ConfirmModal(question))
        if pane not in self.app.panes:
            return
        if yes:
            await self.close(pane)
        else:
            self.app.focus_pane(pane)

    async def close(self, pane: ConversationPane) -> None:
        """Close `pane` now: a streaming reply is kept as stopped, the draft is kept for
        reopening, and the other panes are renumbered."""
        app = self.app
        streams = app.streams
        panes = app.panes
        if pane.busy and pane.request_id is not None:  # keep what streamed, as stopped
            request_id = pane.request_id
            streams.cancel(pane)
            await streams.finish(pane, request_id, "stopped")
        else:
            streams.cancel(pane)
        pane.conversation.draft = pane.input.text
        app.store.close_pane(pane.conversation.key)
        self.closed.append(pane.conversation)
        index = panes.index(pane)
        await pane.remove()
        rest = app.panes
        for i, p in enumerate(rest):
            p.renumber(i + 1)
        app.focus_pane(rest[min(index, len(rest) - 1)])
        # A full pass frees the closed pane's widgets, once nothing refers to them (Textual
        # drops its last references to a removed widget at a later refresh).
        app.set_timer(FULL_SETTLE_AFTER, self._settle_everything)

    async def reopen(self) -> None:
        """The last closed pane again, with its draft."""
        app = self.app
        if app.chat is None:
            return
        if not self.closed:
            app.notify("no closed pane to reopen")
            return
        if not self._room():
            return
        conv = self.closed.pop()
        app.store.reopen_pane(conv.key)
        pane = ConversationPane(conv, len(app.panes) + 1)
        count_context(pane, app.tokenizer, app.max_len)
        await app.chat.panes_box.mount(pane)
        if getattr(conv, "draft", ""):
            pane.input.text = conv.draft
        app.focus_pane(pane)

    async def clear(self, pane: ConversationPane) -> None:
        """Empty the pane's conversation (its live request is dropped)."""
        self.app.streams.cancel(pane)
        pane.request_id = None
        self.app.store.clear(pane.conversation.key)
        await pane.clear()

    # -- the collector -------------------------------------------------------------------

    def settle_when_idle(self) -> None:
        """A reply ended: once nothing streams, settle the heap a little later."""
        if not any(p.busy for p in self.app.panes):
            self.app.set_timer(SETTLE_AFTER, self._settle)

    def _settle(self) -> None:
        """Nothing has streamed for a while: what the last turns made is collected or
        frozen now, not in a frame."""
        if not any(p.busy for p in self.app.panes):
            settle()

    def _settle_everything(self) -> None:
        if any(p.busy for p in self.app.panes):
            self.app.set_timer(FULL_SETTLE_AFTER, self._settle_everything)  # not mid-stream
        else:
            settle(everything=True)
