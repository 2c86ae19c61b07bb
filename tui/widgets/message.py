"""One message in a transcript. Model output is Markdown (plain text, never console markup)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rich.cells import cell_len
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.css.styles import RulesMap
from textual.geometry import Region
from textual.strip import Strip
from textual.style import Style
from textual.visual import RenderOptions, Visual
from textual.widget import Widget
from textual.widgets import Collapsible, Markdown, Static

from ..conversation import Status
from ..markdown import chat_markdown_parser
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


class _Finished:
    """What the finished paragraphs (text up to its last newline) render to, kept
    between renders; started over when `key` (what they are rendered with) changes."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.length = 0  # text[:length] ends at a newline (or is empty)
        self.items: list[Any] = []  # per paragraph: its strips, or its height

    def catch_up(self, text: str, key: tuple[Any, ...],
                 per_line: Callable[[str], list[Any]]) -> None:
        if key != self.key:
            self.key, self.length, self.items = key, 0, []
        cut = text.rfind("\n") + 1
        if cut > self.length:
            for line in text[self.length:cut - 1].split("\n"):
                self.items.extend(per_line(line))
            self.length = cut


class GrowingText(Visual):
    """Text that only grows, rendered a paragraph at a time: the strips (and heights) of
    finished paragraphs are kept, so a render wraps only the last paragraph again, not
    the whole reply. Renders exactly as `Content(text)` does (Content wraps each line on
    its own); with a selection it renders as that Content.
    """

    def __init__(self) -> None:
        self.text = ""
        self._strips = _Finished()
        self._heights = _Finished()

    def __str__(self) -> str:
        return self.text

    def set(self, text: str) -> None:
        if not text.startswith(self.text):  # not a continuation: start over
            self._strips, self._heights = _Finished(), _Finished()
        self.text = text

    def render_strips(
        self, width: int, height: int | None, style: Style, options: RenderOptions
    ) -> list[Strip]:
        if not width:
            return []
        if options.selection is not None:  # selection offsets span the whole text
            return Content(self.text).render_strips(width, height, style, options)

        def render(line: str) -> list[Strip]:
            return Content(line).render_strips(width, None, style, options)

        get_rule = options.rules.get
        key = (width, style, get_rule("text_align", "left"), get_rule("text_overflow", "fold"),
               get_rule("text_wrap", "wrap"), get_rule("line_pad", 0))
        self._strips.catch_up(self.text, key, render)
        strips = self._strips.items + render(self.text[self._strips.length:])
        return strips if height is None else strips[:height]

    def get_optimal_width(self, rules: RulesMap, container_width: int) -> int:
        return max(cell_len(line) for line in self.text.split("\n"))

    def get_height(self, rules: RulesMap, width: int) -> int:
        get_rule = rules.get
        key = (width, get_rule("text_overflow", "fold"), get_rule("text_wrap", "wrap"),
               get_rule("line_pad", 0))
        self._heights.catch_up(self.text, key,
                               lambda line: [Content(line).get_height(rules, width)])
        return sum(self._heights.items) + Content(
            self.text[self._heights.length:]).get_height(rules, width)


class LiveText(Widget):
    """Streaming text that only grows, cheap to update (see `GrowingText`): an update
    repaints only the lines that changed (the last line before it and what follows); a
    screen layout happens only when the text outgrows its lines, and then it gets
    `RESERVE_LINES` lines at a time, so the text fills them without another layout.
    """

    DEFAULT_CSS = "LiveText { height: auto; }"

    def __init__(self, classes: str) -> None:
        super().__init__(classes=classes)
        self._visual = GrowingText()
        self._shown = (0, 0)  # (width, wrapped height) of the last repaint
        self.needs_layout = False  # the text is taller than the block (see `grow`)

    @property
    def text(self) -> str:
        return self._visual.text

    def render(self) -> Visual:
        return self._visual

    def set_text(self, text: str, grow: bool = True) -> None:
        """Show `text` (the previous text plus more). `grow=False` defers the layout that
        text outgrowing the block needs (its last lines stay hidden until `grow()`): the
        app grows every streaming block in one layout a few times a second."""
        self._visual.set(text)
        region = self.content_region
        if region.width <= 0:  # not laid out yet
            self.refresh(layout=True)
            return
        height = self._visual.get_height(self.styles, region.width)
        width, shown = self._shown
        self._shown = (region.width, height)
        self.needs_layout = height > region.height
        if self.needs_layout and grow:
            self.grow()
        elif width != region.width or shown == 0:
            self.refresh()
        else:
            # NOTE: appended text changes only the last wrapped line before it (a word may
            # move down) and the lines after it: the rest of the reply is not repainted.
            first = max(0, min(shown, region.height) - 1)
            last = min(height, region.height)
            if last > first:
                self.refresh(Region(0, first, region.width, last - first))

    def grow(self) -> bool:
        """Lay out again if the text outgrew its lines, reserving `RESERVE_LINES`;
        returns whether it did."""
        if not self.needs_layout:
            return False
        self.needs_layout = False
        self.styles.min_height = self._shown[1] + RESERVE_LINES - 1
        self.refresh(layout=True)
        return True


async def gather(awaitables: list[Awaitable[Any]]) -> None:
    """Await Textual's awaitables (mounts, removals, Markdown updates) together."""

    async def wait(aw: Awaitable[Any]) -> None:
        await aw

    await asyncio.gather(*(wait(aw) for aw in awaitables))


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
        self.answer_md = Markdown(self.answer_text.strip() or None, open_links=False,
                                  parser_factory=chat_markdown_parser)
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
        self._think_md = Markdown(text, open_links=False, classes="thinking",
                                  parser_factory=chat_markdown_parser)
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

    async def append(self, raw: str, grow: bool = True) -> None:
        """Add streamed text (already sanitized); `grow`: see `LiveText.set_text`."""
        self.raw += raw
        for kind, text in self._parser.feed(raw):
            await self._write(kind, text, grow)

    def grow(self) -> bool:
        """Apply deferred growth of the streaming blocks; returns whether any grew."""
        grew = [live.grow() for live in (self._think_live, self._live) if live is not None]
        return any(grew)

    async def _write(self, kind: str, text: str, grow: bool = True) -> None:
        if kind == "think":
            if self._think_box is None:
                self._make_think_box(None, collapsed=False)
                await self.mount(self._think_box, before=self._live or self.answer_md)
            self.thinking_text += text
            if self._think_live is not None:
                self._think_live.set_text(self.thinking_text, grow)
            return
        if self._think_box is not None and not self._think_box.collapsed and text.strip():
            self._think_box.collapsed = True  # the answer has started
        self.answer_text += text
        if self._live is not None:
            self._live.set_text(self.answer_text.lstrip("\n"), grow)

    async def finish(self, status: Status, error: str | None = None) -> None:
        """The reply ended: render the Markdown once and show how it ended."""
        for kind, text in self._parser.finish():
            await self._write(kind, text)
        # NOTE: the renders and removals are started together and awaited once: awaited one
        # by one, each waited for its own screen refresh (~0.25 s per reply on 2 busy cores).
        pending: list[Awaitable[Any]] = []
        if self._think_md is not None:
            pending.append(self._think_md.update(self.thinking_text.strip()))
            if self._think_live is not None:
                self._think_md.display = True
                self._think_live.display = False
                pending.append(self._think_live.remove())
                self._think_live = None
            if self.answer_text.strip() and self._think_box is not None:
                self._think_box.collapsed = True
        pending.append(self.answer_md.update(self.answer_text.strip()))
        if self._live is not None:
            self.answer_md.display = True
            self._live.display = False
            pending.append(self._live.remove())
            self._live = None
        await gather(pending)
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
