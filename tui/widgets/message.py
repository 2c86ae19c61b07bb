"""One message in a transcript. Model output is Markdown (plain text, never console markup)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rich.cells import cell_len
from rich.markdown import Markdown as RichMarkdown
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.css.styles import RulesMap
from textual.geometry import Region
from textual.strip import Strip
from textual.style import Style
from textual.visual import RenderOptions, RichVisual, Visual
from textual.widget import Widget
from textual.widgets import Collapsible, Static

from ..conversation import Status
from ..markdown import keep_line_breaks
from ..thinking import ThinkParser, split_thinking

# A streaming block grows several lines at a time, so one screen layout serves many new
# lines (the blank lines below the text fill as it streams): at least RESERVE_LINES, and
# as many as the text gained in the last RESERVE_SECONDS, up to MAX_RESERVE_LINES. A
# layout arranges every widget on the screen and repaints every pane that moved: at a
# GPU's speed, four panes growing 4 lines at a time took most of the UI thread.
RESERVE_LINES = 4
RESERVE_SECONDS = 0.5
MAX_RESERVE_LINES = 16
# A streaming answer longer than FREEZE_CHARS moves its finished lines (all but the last
# KEEP_CHARS or so) into a block that is no longer repainted: each repaint of the live
# block renders all of its lines, so without this a frame cost grew with the reply.
FREEZE_CHARS = 1600
KEEP_CHARS = 400
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
    several lines at a time (`RESERVE_LINES`), so the text fills them without another
    layout.
    """

    DEFAULT_CSS = "LiveText { height: auto; }"

    def __init__(self, classes: str) -> None:
        super().__init__(classes=classes)
        self._visual = GrowingText()
        self._shown = (0, 0)  # (width, wrapped height) of the last repaint
        self._grown = (0.0, 0)  # (time.monotonic(), wrapped height) of the last growth
        self._reserve = RESERVE_LINES  # lines the last growth reserved
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

    def restart(self, text: str) -> None:
        """Show `text` in place of what was shown (its start moved to a `FrozenText`)."""
        self._visual = GrowingText()
        self._shown = (0, 0)
        self._grown = (time.monotonic(), 0)
        self.styles.min_height = None
        self.set_text(text, grow=False)
        self.refresh(layout=True)

    def grow(self, ahead: bool = False) -> bool:
        """Lay out again if the text outgrew its lines (or, `ahead`, has used half of the
        lines it reserved: the app grows every streaming block in the layout one of them
        needs), reserving room for what it is likely to gain before the next growth;
        returns whether it did."""
        free = self.content_region.height - self._shown[1]
        if not (self.needs_layout or (ahead and free < self._reserve // 2)):
            return False
        self.needs_layout = False
        now, height = time.monotonic(), self._shown[1]
        then, before = self._grown
        rate = (height - before) / max(now - then, RESERVE_SECONDS)  # lines a second
        reserve = min(MAX_RESERVE_LINES, max(RESERVE_LINES, round(rate * RESERVE_SECONDS)))
        self._grown, self._reserve = (now, height), reserve
        self.styles.min_height = height + reserve - 1
        self.refresh(layout=True)
        return True


class FrozenText(Widget):
    """Finished lines of a streaming reply: rendered once per width, never repainted
    while the reply streams on (see `FREEZE_CHARS`)."""

    DEFAULT_CSS = "FrozenText { height: auto; }"

    def __init__(self, text: str) -> None:
        super().__init__(classes="frozen")
        self._visual = GrowingText()
        self._visual.set(text)

    @property
    def text(self) -> str:
        return self._visual.text

    def render(self) -> Visual:
        return self._visual


async def gather(awaitables: list[Awaitable[Any]]) -> None:
    """Await Textual's awaitables (mounts, removals, Markdown updates) together."""

    async def wait(aw: Awaitable[Any]) -> None:
        await aw

    await asyncio.gather(*(wait(aw) for aw in awaitables))


class KeptBreaksMarkdown(RichMarkdown):
    """Markdown whose single line breaks stay line breaks: a chat reply's poem, address
    or list written without blank lines keeps its shape (CommonMark would join the
    lines)."""

    def __init__(self, markup: str) -> None:
        super().__init__(markup, hyperlinks=False)
        keep_line_breaks(self.parsed)


class _RenderedOnce(RichVisual):
    """A Rich renderable whose lines are rendered once per width and style, and its
    height once per width. NOTE: Textual's own wrapper renders the renderable again for
    every height query and every repaint: each screen layout re-rendered every finished
    reply on the screen (with eight panes, most of a layout's ~85 ms on 2 cores)."""

    def __init__(self, widget: Widget, renderable: Any) -> None:
        super().__init__(widget, renderable)
        self._heights: dict[int, int] = {}
        self._strips: dict[tuple[Any, ...], list[Strip]] = {}

    def get_height(self, rules: RulesMap, width: int) -> int:
        height = self._heights.get(width)
        if height is None:
            height = self._heights[width] = super().get_height(rules, width)
        return height

    def render_strips(
        self, width: int, height: int | None, style: Style, options: RenderOptions
    ) -> list[Strip]:
        key = (width, height, style)
        strips = self._strips.get(key)
        if strips is None:
            if len(self._strips) > 8:  # a resized window: keep only recent sizes
                self._strips.clear()
            strips = self._strips[key] = super().render_strips(width, height, style, options)
        return strips


class MarkdownBlock(Widget):
    """Finished Markdown in ONE widget, rendered by Rich once per width.

    NOTE: not Textual's `Markdown` widget, which mounts a widget per block: a 512-token
    reply became dozens of widgets, each styled on mount and laid out in every later
    screen layout (4 such replies took ~1.3 s of the UI thread to mount on 2 cores).
    """

    DEFAULT_CSS = "MarkdownBlock { height: auto; }"

    def __init__(self, source: str | None = None, classes: str = "") -> None:
        super().__init__(classes=f"markdown {classes}".strip())
        self.source = ""
        self._visual: Visual = Content("")
        self.set_source(source or "")

    def set_source(self, source: str) -> None:
        self.source = source
        self._visual = (_RenderedOnce(self, KeptBreaksMarkdown(source)) if source
                        else Content(""))
        self.refresh(layout=True)

    def render(self) -> Visual:
        return self._visual


class UserMessage(Static):
    """What the user typed, shown verbatim."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="user-message")


class AssistantMessage(Vertical):
    """A reply: an optional collapsible thinking block, the answer, and a status note.

    While streaming, each block is plain text in a `LiveText` (no Markdown parsing: with
    four panes streaming on a 2-core CPU, rendering Markdown as it streamed cost the
    engine a third of its tokens/s). When the reply ends the answer is rendered as
    Markdown once, in one widget (`MarkdownBlock`).
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
        self._think_md: MarkdownBlock | None = None
        self.answer_md = MarkdownBlock(self.answer_text.strip())
        self._live: LiveText | None = None  # the answer while it streams
        self._frozen: list[FrozenText] = []  # its finished lines, above it
        self._frozen_chars = 0  # characters of the shown answer in `_frozen`
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
        self._think_md = MarkdownBlock(text, classes="thinking")
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

    @property
    def needs_layout(self) -> bool:
        """A streaming block's text is taller than its lines (see `LiveText.grow`)."""
        return any(live.needs_layout for live in (self._think_live, self._live)
                   if live is not None)

    def grow(self, ahead: bool = False) -> bool:
        """Apply deferred growth of the streaming blocks; returns whether any grew."""
        grew = [live.grow(ahead) for live in (self._think_live, self._live)
                if live is not None]
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
        if self._live is None:
            return
        tail = self.answer_text.lstrip("\n")[self._frozen_chars:]
        cut = tail.rfind("\n", 0, len(tail) - KEEP_CHARS) if len(tail) > FREEZE_CHARS else -1
        if cut > 0:  # lines wrap on their own: split at a line break, they look the same
            frozen = FrozenText(tail[:cut])
            self._frozen.append(frozen)
            self.mount(frozen, before=self._live)
            self._frozen_chars += cut + 1
            self._live.restart(tail[cut + 1:])
        else:
            self._live.set_text(tail, grow)

    async def finish(self, status: Status, error: str | None = None) -> None:
        """The reply ended: render the Markdown once and show how it ended."""
        for kind, text in self._parser.finish():
            await self._write(kind, text)
        # NOTE: the removals are started together and awaited once: awaited one by one,
        # each waited for its own screen refresh (~0.25 s per reply on 2 busy cores).
        pending: list[Awaitable[Any]] = []
        if self._think_md is not None:
            self._think_md.set_source(self.thinking_text.strip())
            if self._think_live is not None:
                self._think_md.display = True
                self._think_live.display = False
                pending.append(self._think_live.remove())
                self._think_live = None
            if self.answer_text.strip() and self._think_box is not None:
                self._think_box.collapsed = True
        self.answer_md.set_source(self.answer_text.strip())
        if self._live is not None:
            self.answer_md.display = True
            for block in (*self._frozen, self._live):
                block.display = False
                pending.append(block.remove())
            self._live, self._frozen = None, []
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
