"""One message in a transcript. Model output is Markdown (plain text, never console markup)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from ..conversation import Status
from ..thinking import ThinkParser, split_thinking

STATUS_NOTES: dict[str, str] = {
    "stopped": "stopped",
    "interrupted": "interrupted (the app stopped mid-reply)",
    "length": "cut at max tokens",
}


class UserMessage(Static):
    """What the user typed, shown verbatim."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="user-message")


class AssistantMessage(Vertical):
    """A reply: an optional collapsible thinking block, the answer, and a status note.

    While streaming, text goes through a `MarkdownStream` per block (appends only the tail
    of the document, coalescing writes the UI cannot keep up with). When the reply ends
    the streams stop and each block gets one full `update()` (a code fence streamed in
    pieces can otherwise render blank).
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
        self._streams: dict[str, MarkdownStream] = {}
        self._note = Static("", markup=False, classes="note")

    def compose(self) -> ComposeResult:
        if self.thinking_text.strip():
            self._make_think_box(self.thinking_text.strip(), collapsed=True)
            yield self._think_box
        yield self.answer_md
        yield self._note

    def on_mount(self) -> None:
        self._show_note()

    def _make_think_box(self, text: str | None, collapsed: bool) -> None:
        self._think_md = Markdown(text, open_links=False, classes="thinking")
        self._think_box = Collapsible(self._think_md, title="Thinking", collapsed=collapsed)

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
                await self.mount(self._think_box, before=self.answer_md)
            self.thinking_text += text
            await self._stream(self._think_md).write(text)
            return
        if self._think_box is not None and not self._think_box.collapsed and text.strip():
            self._think_box.collapsed = True  # the answer has started
        self.answer_text += text
        await self._stream(self.answer_md).write(text)

    def _stream(self, md: Markdown) -> MarkdownStream:
        key = "think" if md is self._think_md else "answer"
        if key not in self._streams:
            self._streams[key] = Markdown.get_stream(md)
        return self._streams[key]

    async def finish(self, status: Status, error: str | None = None) -> None:
        """The reply ended: settle the Markdown and show how it ended."""
        for kind, text in self._parser.finish():
            await self._write(kind, text)
        for stream in self._streams.values():
            await stream.stop()
        self._streams.clear()
        if self._think_md is not None:
            await self._think_md.update(self.thinking_text.strip())
            if self.answer_text.strip() and self._think_box is not None:
                self._think_box.collapsed = True
        await self.answer_md.update(self.answer_text.strip())
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
