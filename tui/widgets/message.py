"""One message in a transcript. Model output is Markdown (plain text, never console markup)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Collapsible, Markdown, Static

from ..conversation import Status
from ..thinking import ThinkParser, split_thinking

# A streaming block grows this many lines at a time: one screen layout per 4 new lines
# of text instead of one per line (the blank lines below the text fill as it streams).
RESERVE_LINES = 4
STATUS_NOTES: dict[str, str] = {
    "stopped": "stopped",
    "interrupted": "interrupted (the app stopped mid-reply)",
    "length": "cut at max tokens",
}


def set_growing_text(widget: Static, text: str, reserve: int = 1) -> None:
    """Show `text` in a Static that changes often (the stats panel), laying the screen out
    again only when its height changes.

    NOTE: `Static.update` lays out the whole screen by default, and a layout re-renders
    every widget on it: with four panes streaming on a 2-core CPU that was most of the
    UI's time per token. Text that keeps its height only repaints the widget.
    """
    region = widget.content_region
    widget.update(text, layout=False)
    if region.width <= 0:  # not laid out yet
        widget.refresh(layout=True)
        return
    height = widget.get_content_height(region.size, region.size, region.width)
    if height != region.height:
        widget.refresh(layout=True)


class LiveText(Static):
    """Streaming text that only grows: a repaint per update, a screen layout only when
    the text outgrows its lines (see `set_growing_text`), and then `RESERVE_LINES` lines
    at a time, so the text fills them without another layout.

    Its height is counted incrementally: the finished lines' wrapped height is kept, so
    an update wraps only the last line again, not the whole reply.
    """

    def __init__(self, classes: str) -> None:
        super().__init__("", markup=False, classes=classes)
        self._text = ""
        self._done_len = 0  # text[:_done_len] ends at a newline (or is empty) ...
        self._done_lines = 0  # ... and wraps to this many lines
        self._width = 0

    def _lines(self, line: str, width: int) -> int:
        return Content(line).get_height(self.styles, width)

    def _height(self, text: str, width: int) -> int:
        if width != self._width or not text.startswith(self._text):
            self._done_len = self._done_lines = 0  # start over (a resize)
            self._width = width
        self._text = text
        cut = text.rfind("\n") + 1
        if cut > self._done_len:
            self._done_lines += sum(self._lines(line, width) for line in
                                    text[self._done_len:cut - 1].split("\n"))
            self._done_len = cut
        return self._done_lines + self._lines(text[self._done_len:], width)

    def set_text(self, text: str) -> None:
        region = self.content_region
        self.update(text, layout=False)
        if region.width <= 0:  # not laid out yet
            self.refresh(layout=True)
            return
        height = self._height(text, region.width)
        if height > region.height:
            self.styles.min_height = height + RESERVE_LINES - 1  # a layout, as below
            self.refresh(layout=True)


class UserMessage(Static):
    """What the user typed, shown verbatim."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="user-message")


class AssistantMessage(Vertical):
    """A reply: an optional collapsible thinking block, the answer, and a status note.

    While streaming, each block is plain text in a `Static` (no Markdown parsing: with
    four panes streaming on a 2-core CPU, rendering Markdown as it streamed cost the
    engine a third of its tokens/s). When the reply ends the answer is rendered as
    Markdown once (a code fence streamed in pieces can otherwise render blank anyway).
    """

    def __init__(
        self,
        text: str = "",
        status: Status = "streaming",
        error: str | None = None,
        opens_thinking: bool = False,
    ) -> None:
        super().__init__(classes="assistant-message")
        self.raw = text
        self.status: Status = status
        self.error = error
        self._parser = ThinkParser(opens_thinking)
        self.thinking_text = ""
        self.answer_text = ""
        if status != "streaming":
            self.thinking_text, self.answer_text = split_thinking(text, opens_thinking)
        self._think_box: Collapsible | None = None
        self._think_md: Markdown | None = None
        self.answer_md = Markdown(self.answer_text.strip() or None, open_links=False)
        self._live: LiveText | None = None  # the answer while it streams
        self._think_live: LiveText | None = None  # the thinking while it streams
        self._note = Static("", markup=False, classes="note")

    def compose(self) -> ComposeResult:
        if self.thinking_text.strip():
            self._make_think_box(self.thinking_text.strip(), collapsed=True)
            yield self._think_box
        if self.status == "streaming":
            self._live = LiveText(classes="live")
            self.answer_md.display = False
            yield self._live
        yield self.answer_md
        yield self._note

    def on_mount(self) -> None:
        self._show_note()

    def _make_think_box(self, text: str | None, collapsed: bool) -> None:
        self._think_md = Markdown(text, open_links=False, classes="thinking")
        if text is None:  # streaming: plain text until the reply ends
            self._think_md.display = False
            self._think_live = LiveText(classes="thinking live")
            children = (self._think_live, self._think_md)
        else:
            children = (self._think_md,)
        self._think_box = Collapsible(*children, title="Thinking", collapsed=collapsed)

    def start_in_thinking(self) -> None:
        """The prompt opened the thinking block; the reply starts inside it."""
        if not self.raw:
            self._parser = ThinkParser(in_think=True)

    @property
    def thinking_expanded(self) -> bool:
        return self._think_box is not None and not self._think_box.collapsed

    @property
    def has_thinking(self) -> bool:
        return self._think_box is not None

    async def append(self, raw: str) -> None:
        """Add streamed text (already sanitized)."""
        self.raw += raw
        for kind, text in self._parser.feed(raw):
            await self._write(kind, text)

    async def _write(self, kind: str, text: str) -> None:
        if kind == "think":
            if self._think_box is None:
                self._make_think_box(None, collapsed=False)
                await self.mount(self._think_box, before=self._live or self.answer_md)
            self.thinking_text += text
            if self._think_live is not None:
                self._think_live.set_text(self.thinking_text)
            return
        if self._think_box is not None and not self._think_box.collapsed and text.strip():
            self._think_box.collapsed = True  # the answer has started
        self.answer_text += text
        if self._live is not None:
            self._live.set_text(self.answer_text.lstrip("\n"))

    async def finish(self, status: Status, error: str | None = None) -> None:
        """The reply ended: render the Markdown once and show how it ended."""
        for kind, text in self._parser.finish():
            await self._write(kind, text)
        if self._think_md is not None:
            await self._think_md.update(self.thinking_text.strip())
            if self._think_live is not None:
                self._think_md.display = True
                await self._think_live.remove()
                self._think_live = None
            if self.answer_text.strip() and self._think_box is not None:
                self._think_box.collapsed = True
        await self.answer_md.update(self.answer_text.strip())
        if self._live is not None:
            self.answer_md.display = True
            await self._live.remove()
            self._live = None
        self.status = status
        self.error = error
        self._show_note()

    def _show_note(self) -> None:
        note = STATUS_NOTES.get(self.status, "")
        if self.status == "error":
            note = f"error: {self.error or 'unknown'}"
        self._note.update(f"[{note}]" if note else "")
        self._note.display = bool(note)
        self.set_class(self.status == "error", "error")
        self.set_class(self.status in ("stopped", "interrupted"), "stopped")
