"""A pane's transcript: every message of a conversation in ONE widget that draws lines.

Each entry (a user message, a reply, a notice) renders itself to lines once per width; a
streaming reply wraps again only its last line or two. The widget keeps the lines of all
entries in one list and repaints only the lines that changed. While a reply streams at the
bottom, the view follows it in jumps (the last line moves up near the top of the pane), so
most frames repaint a line or two instead of scrolling, and repainting, the whole pane.

NOTE: one widget, not a widget per message: with widgets, every few new lines of a reply
meant a screen layout, and each scroll repainted every widget of the pane; with eight
panes streaming at a GPU's speed that took all of the UI thread.
"""

from __future__ import annotations

import copy
import io
import re
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

from markdown_it import MarkdownIt
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from ..conversation import Status
from ..markdown import is_plain_paragraph, keep_line_breaks, split_blocks
from ..thinking import ThinkParser, split_thinking

_SPACE = Segment(" ")
PAD = 1  # columns of padding left and right of a message's text
SCROLL_LINES = 3  # lines a mouse wheel step scrolls
# A view that follows a streaming reply jumps when the text reaches its bottom: the last
# line moves up to 1/JUMP_KEEP of the view (a jump repaints the whole pane; the frames
# until the next one repaint only the lines that changed).
JUMP_KEEP = 4
STATUS_NOTES: dict[str, str] = {
    "stopped": "stopped",
    "interrupted": "interrupted (the app stopped mid-reply)",
    "length": "cut at max tokens",
}


@dataclass(frozen=True)
class Look:
    """The styles entries are drawn with (from the transcript's CSS)."""

    console: Console = field(compare=False)
    user: Style
    bar: Style
    muted: Style
    thinking: Style
    error: Style


# NOTE: rich builds a new parser for every Markdown (~0.4 ms, as much as drawing a short
# paragraph); a reply is drawn block by block, so the app parses with one parser and
# copies one built Markdown.
_PARSER = MarkdownIt().enable("strikethrough").enable("table")  # what rich parses with
_MARKDOWN = RichMarkdown("", hyperlinks=False)


def markdown(source: str, style: Style | str = "none") -> RichMarkdown:
    """`source` as rich Markdown whose single line breaks stay line breaks: a chat reply's
    poem, address or list written without blank lines keeps its shape (CommonMark would
    join the lines)."""
    md = copy.copy(_MARKDOWN)
    md.style = style
    md.parsed = _PARSER.parse(source)
    keep_line_breaks(md.parsed)
    return md


def render_lines(console: Console, renderable: RenderableType, width: int,
                 style: Style | None = None, left: str = " " * PAD,
                 left_style: Style | None = None, right: str = " " * PAD) -> list[Strip]:
    """`renderable` rendered `width` columns wide, between `left` and `right` margins."""
    inner = max(1, width - len(left) - len(right))
    options = console.options.update(width=inner, height=None, highlight=False)
    rows = console.render_lines(renderable, options, style=style, pad=True)
    head, tail = Segment(left, left_style), Segment(right, style)
    return [Strip([head, *row, tail], width) for row in rows]


def paragraph_lines(console: Console, text: str, width: int, style: Style) -> list[Strip]:
    """One paragraph of plain text, wrapped (never parsed as Markdown or markup)."""
    if not text:
        return [Strip.blank(width)]
    return render_lines(console, Text(text, style=style, end=""), width, style)


_WORDS = re.compile(r"\s+|\S+")


def _cells(text: str) -> int:
    return len(text) if text.isascii() else cell_len(text)


def wrap(paragraph: str, width: int) -> list[tuple[int, str]]:
    """Greedy word wrap of one paragraph to `width` cells: (offset, text) of each line.
    Spaces where a line breaks are dropped; a word longer than a line is folded.
    Greedy: appending text never changes any line but the last."""
    lines: list[tuple[int, str]] = []
    start, line, used = 0, "", 0
    for match in _WORDS.finditer(paragraph):
        word = match.group()
        size = _cells(word)
        if used + size <= width:
            line += word
            used += size
            continue
        if word[0].isspace():  # break at the spaces
            lines.append((start, line))
            start, line, used = match.end(), "", 0
            continue
        if line:
            lines.append((start, line))
        start, line, used = match.start(), "", 0
        while size > width:  # fold a word longer than the line
            cut = width if word.isascii() else _fit(word, width)
            lines.append((start, word[:cut]))
            start, word = start + cut, word[cut:]
            size = _cells(word)
        line, used = word, size
    lines.append((start, line))
    return lines


def _fit(word: str, width: int) -> int:
    """How many characters of `word` fit in `width` cells (at least one)."""
    used = 0
    for i, char in enumerate(word):
        used += cell_len(char)
        if used > width:
            return max(1, i)
    return len(word)


def warm_up() -> None:
    """Draw a small finished reply once, off screen: the Markdown parser and the code
    highlighter load (~40 ms on 2 cores) before the first real reply ends."""
    console = Console(width=40, file=io.StringIO(), color_system="truecolor")
    render_lines(console, markdown("**a**\n\n- b\n\n```python\nx = 1\n```\n"), 40)


class GrowingText:
    """Plain text that only grows, wrapped as it grows: lines before the last do not
    change (greedy wrapping), so an update wraps only the last line or two and the new
    text."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self._key: tuple[Any, ...] | None = None
        self._done: list[Strip] = []  # lines that can no longer change
        self._from = 0  # text[_from:] starts the line after them

    def add(self, text: str) -> None:
        self.text += text

    def lines(self, width: int, style: Style) -> list[Strip]:
        key = (width, style)
        if key != self._key:
            self._key, self._done, self._from = key, [], 0
        inner = max(1, width - 2 * PAD)
        paragraphs = self.text[self._from:].split("\n")
        pos = self._from
        last: list[Strip] = []
        for n, paragraph in enumerate(paragraphs):
            wrapped = wrap(paragraph, inner)
            strips = [self._strip(line, width, inner, style) for _, line in wrapped]
            if n < len(paragraphs) - 1:
                self._done.extend(strips)
                pos += len(paragraph) + 1
                continue
            # The last line may still change; so may the one before it when the last is
            # empty: the spaces it broke at may go on.
            keep = len(wrapped) - 1
            if keep and not wrapped[-1][1]:
                keep -= 1
            self._done.extend(strips[:keep])
            self._from = pos + wrapped[keep][0]
            last = strips[keep:]
        return [*self._done, *last]

    @staticmethod
    def _strip(line: str, width: int, inner: int, style: Style) -> Strip:
        pad = " " * PAD
        return Strip([Segment(pad), Segment(line, style),
                      Segment(" " * (inner - _cells(line)) + pad)], width)


class Entry:
    """One item of a transcript; `lines` draws it (`gap`: a blank line above it)."""

    kind = ""
    gap = False

    def lines(self, look: Look, width: int) -> list[Strip]:
        raise NotImplementedError

    def click(self, line: int) -> bool:
        """The user clicked this entry's `line`; returns whether its lines changed."""
        return False


class _Cached(Entry):
    """An entry whose lines depend only on the look and width."""

    def __init__(self) -> None:
        self._cache: tuple[tuple[Any, ...], list[Strip]] | None = None

    def lines(self, look: Look, width: int) -> list[Strip]:
        key = (look, width)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self.draw(look, width))
        return self._cache[1]

    def draw(self, look: Look, width: int) -> list[Strip]:
        raise NotImplementedError


class UserEntry(_Cached):
    """What the user typed, shown verbatim on a band with a bar at its left."""

    kind = "user"
    gap = True

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def draw(self, look: Look, width: int) -> list[Strip]:
        body = Text(self.text, style=look.user, end="")
        inner = max(1, width - 2)  # one column of margin each side
        rows = render_lines(look.console, body, inner, look.user, left="▌ ",
                            left_style=look.bar, right=" ")
        return [Strip([Segment(" "), *row, Segment(" ")], width) for row in rows]


class Notice(_Cached):
    """A line of the app's own: where the context was cut ("cut"), an error ("error")."""

    def __init__(self, text: str, kind: str) -> None:
        super().__init__()
        self.text, self.kind = text, kind
        self.gap = kind == "cut"

    def draw(self, look: Look, width: int) -> list[Strip]:
        style = look.error if self.kind == "error" else look.muted
        return paragraph_lines(look.console, self.text, width, style)


class Reply(Entry):
    """A reply: a thinking block (collapsed once the answer starts; a click on its title
    opens or closes it), the answer and a note on how it ended.

    The answer is drawn as Markdown a block at a time (`split_blocks`): while it streams,
    each block is rendered once, when the next one starts, and the text after the last
    complete block is plain, wrapped as it grows; when the reply ends only that last block
    is left to render. (Rendering the whole reply at its end stalled the frames: eight
    replies ending together took a fifth of the app's time on a GPU's stream.)
    """

    kind = "reply"
    gap = True

    def __init__(self, text: str = "", status: Status = "streaming",
                 error: str | None = None, opens_thinking: bool = False) -> None:
        self.raw = text
        self.status: Status = status
        self.error = error
        self._parser = ThinkParser(opens_thinking)
        self.thinking_text = ""
        self.answer_text = ""
        self.has_thinking = False
        self.thinking_expanded = False
        self._think = GrowingText()
        self._blocks: list[str] = []  # the answer's complete Markdown blocks
        self._rest = GrowingText()  # the answer after them
        # The blocks' lines and the blank line between blocks, drawn for a look and width.
        self._drawn: tuple[tuple[Any, ...], Strip, list[list[Strip]]] | None = None
        self._cache: tuple[tuple[Any, ...], list[Strip]] | None = None  # once finished
        if status != "streaming":
            self.thinking_text, self.answer_text = split_thinking(text, opens_thinking)
            self.has_thinking = bool(self.thinking_text.strip())
            self._blocks = split_blocks(self.answer_text)[0]

    @property
    def streaming(self) -> bool:
        return self.status == "streaming"

    @property
    def markdown_source(self) -> str | None:
        """The answer as rendered in Markdown, once the reply has ended."""
        return None if self.streaming else self.answer_text.strip()

    def start_in_thinking(self) -> None:
        """The prompt opened the thinking block; the reply starts inside it."""
        if not self.raw:
            self._parser = ThinkParser(in_think=True)

    def append(self, raw: str) -> None:
        """Add streamed text (already sanitized)."""
        self.raw += raw
        for kind, text in self._parser.feed(raw):
            self._write(kind, text)

    def _write(self, kind: str, text: str) -> None:
        if kind == "think":
            if not self.has_thinking:
                self.has_thinking = self.thinking_expanded = True  # open while it thinks
            if not self.thinking_text:
                text = text.lstrip("\n")
            self.thinking_text += text
            self._think.add(text)
            return
        if self.thinking_expanded and text.strip():
            self.thinking_expanded = False  # the answer has started
        if not self.answer_text:
            text = text.lstrip("\n")
        self.answer_text += text
        self._rest.add(text)
        blocks, rest = split_blocks(self._rest.text, final=False)
        if blocks:
            self._blocks += blocks
            self._rest = GrowingText(self._rest.text[rest:])

    def finish(self, status: Status, error: str | None = None) -> None:
        """The reply ended: from now on it is drawn as Markdown, with how it ended."""
        for kind, text in self._parser.finish():
            self._write(kind, text)
        if self.answer_text.strip():
            self.thinking_expanded = False
        self._blocks += split_blocks(self._rest.text)[0]
        self._rest = GrowingText()
        self.status, self.error = status, error
        self._cache = None

    def click(self, line: int) -> bool:
        if not self.has_thinking or line != 0:
            return False
        self.thinking_expanded = not self.thinking_expanded
        self._cache = None
        return True

    def note(self) -> str:
        if self.status == "error":
            return f"[error: {self.error or 'unknown'}]"
        note = STATUS_NOTES.get(self.status, "")
        return f"[{note}]" if note else ""

    def lines(self, look: Look, width: int) -> list[Strip]:
        if self.streaming:
            return self._streaming_lines(look, width)
        key = (look, width, self.thinking_expanded)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._finished_lines(look, width))
        return self._cache[1]

    def _title(self, look: Look, width: int) -> list[Strip]:
        mark = "▼" if self.thinking_expanded else "▶"
        return paragraph_lines(look.console, f"{mark} Thinking", width, look.muted)

    def _streaming_lines(self, look: Look, width: int) -> list[Strip]:
        out: list[Strip] = []
        if self.has_thinking:
            out += self._title(look, width)
            if self.thinking_expanded:
                out += self._think.lines(width, look.thinking)
        out += self._answer_lines(look, width)
        if self._rest.text:
            if self._blocks:
                out.append(self._drawn[1] if self._drawn else Strip.blank(width))
            out += self._rest.lines(width, Style())
        return out

    def _finished_lines(self, look: Look, width: int) -> list[Strip]:
        console = look.console
        out: list[Strip] = []
        if self.has_thinking:
            out += self._title(look, width)
            if self.thinking_expanded:
                source = self.thinking_text.strip()
                out += render_lines(console, markdown(source, look.thinking), width)
        out += self._answer_lines(look, width)
        note = self.note()
        if note:
            style = look.error if self.status == "error" else look.muted
            out += paragraph_lines(console, note, width, style)
        return out

    def _answer_lines(self, look: Look, width: int) -> list[Strip]:
        """The answer's complete blocks as Markdown, a blank line between blocks; each
        block is rendered once per width."""
        key = (look, width)
        if self._drawn is None or self._drawn[0] != key:
            self._drawn = (key, Strip.blank(width), [])
        _, gap, drawn = self._drawn
        for block in self._blocks[len(drawn):]:
            block = block.strip()
            lines = plain_lines(block, width)  # drawn as it streamed: no Markdown pass
            if lines is None:
                lines = _trim(render_lines(look.console, markdown(block), width))
            drawn.append(lines)
        out: list[Strip] = []
        for lines in drawn:
            if out:
                out.append(gap)  # the same strip every frame: unchanged lines stay unpainted
            out += lines
        return out


def plain_lines(block: str, width: int) -> list[Strip] | None:
    """`block` drawn as plain wrapped text, where that is exactly how Markdown draws it
    (`is_plain_paragraph`, and no word wider than a line: rich folds those otherwise);
    else None."""
    inner = max(1, width - 2 * PAD)
    if not is_plain_paragraph(block) or any(len(word) > inner for word in block.split()):
        return None
    return GrowingText(block).lines(width, Style())


def _bare_box(widget: Widget) -> bool:
    """Whether Textual's styles add nothing to the widget's rows: no border, outline,
    padding, hatch or tint, fully opaque."""
    styles = widget.styles
    return (
        not any(edge for edge, _ in styles.border)
        and not any(edge for edge, _ in styles.outline)
        and not any(styles.padding)
        and not styles.tint.a
        and widget.opacity == 1.0
        and styles.text_opacity == 1.0
        and not (styles.has_rule("hatch") and styles.hatch != "none")
    )


def _trim(lines: list[Strip]) -> list[Strip]:
    """`lines` without the blank lines rich leaves at a block's start or end (after a list,
    before a table), so blocks are one blank line apart; a code block's shaded margin
    lines stay."""
    def blank(strip: Strip) -> bool:
        return not strip.text.strip() and all(
            seg.style is None or seg.style.bgcolor is None for seg in strip)

    start, end = 0, len(lines)
    while start < end and blank(lines[start]):
        start += 1
    while end > start and blank(lines[end - 1]):
        end -= 1
    return lines[start:end]


class Transcript(Widget):
    """The entries of one conversation, drawn line by line (Textual's line API), with a
    one-column scroll bar at the right. The view follows the end of the transcript
    (`follow`) until the user scrolls up; scrolling back to the end follows again."""

    COMPONENT_CLASSES = {"transcript--user", "transcript--bar", "transcript--muted",
                         "transcript--thinking", "transcript--error", "transcript--thumb"}
    DEFAULT_CSS = """
    Transcript { height: 1fr; }
    Transcript > .transcript--user { background: $boost; }
    Transcript > .transcript--bar { color: $accent; background: $boost; }
    Transcript > .transcript--muted { color: $text-muted; text-style: italic; }
    Transcript > .transcript--thinking { color: $text-muted; }
    Transcript > .transcript--error { color: $error; }
    Transcript > .transcript--thumb { color: $panel-lighten-3; }
    """

    def __init__(self, entries: list[Entry] | None = None, classes: str = "") -> None:
        super().__init__(classes=classes)
        self.entries: list[Entry] = list(entries or [])
        self.top = 0  # index of the first line shown
        self.follow = True
        self._look: Look | None = None
        self._width = 0  # the width `_lines` are drawn for (0: not drawn)
        self._lines: list[Strip] = []
        self._starts: list[int] = []  # the first line of each entry (its gap included)
        self._blank = Strip.blank(0)
        self._thumb = _SPACE
        self._view = (0, 0)  # (width, height), read at each layout (see `rebuild`)
        self._thumb_key: tuple[int, int] | None = None
        self._thumb_range = range(0)
        # Each line's row as drawn (the line plus its scroll-bar cell), kept so that a
        # repaint of an unchanged line hands Textual the very strip it filtered before.
        self._rows: dict[tuple[int, bool], tuple[Strip, Strip]] = {}

    # -- what other code reads ---------------------------------------------------------

    @property
    def view_height(self) -> int:
        return self._view[1]

    @property
    def line_count(self) -> int:
        return len(self._lines)

    @property
    def scroll_y(self) -> int:
        return self.top

    @property
    def max_scroll_y(self) -> int:
        return max(0, len(self._lines) - self.view_height)

    @property
    def replies(self) -> list[Reply]:
        return [e for e in self.entries if isinstance(e, Reply)]

    def text_lines(self) -> list[str]:
        """The text of every line of the transcript (right spaces dropped)."""
        return [strip.text.rstrip() for strip in self._lines]

    # -- changing entries --------------------------------------------------------------

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        if not self._width:
            return
        before = len(self._lines)
        self._starts.append(before)
        self._lines.extend(self._entry_lines(len(self.entries) - 1))
        self._show_changes(before, before)

    def changed(self, entry: Entry) -> None:
        """`entry`'s lines changed (streamed text, the end of a reply)."""
        if not self._width:
            return
        i = self.entries.index(entry) if self.entries[-1] is not entry else len(self.entries) - 1
        if i != len(self.entries) - 1:
            self.rebuild()
            return
        start = self._starts[i]
        new = self._entry_lines(i)
        old = self._lines
        first = start
        end = min(len(old), start + len(new))
        while first < end and (old[first] is new[first - start]
                               or old[first] == new[first - start]):
            # Unchanged lines: finished paragraphs are the same strips; a plain paragraph
            # once complete is drawn again equal to how it streamed.
            first += 1
        before = len(old)
        if first == before and first == start + len(new):
            return
        del old[first:]
        old.extend(new[first - start:])
        self._show_changes(first, before)

    def insert(self, index: int, entry: Entry) -> None:
        self.entries.insert(index, entry)
        self.rebuild()

    def remove_kind(self, kind: str) -> None:
        kept = [e for e in self.entries if e.kind != kind]
        if len(kept) != len(self.entries):
            self.entries = kept
            self.rebuild()

    def truncate(self, count: int) -> None:
        """Keep the first `count` entries."""
        if count < len(self.entries):
            del self.entries[count:]
            self.rebuild()

    def clear(self) -> None:
        self.entries.clear()
        self.top = 0
        self.rebuild()

    def rebuild(self) -> None:
        """Draw every entry again (a new width, a new look, an entry in the middle)."""
        # NOTE: Textual's `size` looks the widget up in the screen's map on every read;
        # it is read here, once per layout, not for every line drawn.
        self._view = (self.size.width, self.size.height)
        self._thumb_key = None
        width = max(0, self._view[0] - 1)  # the last column is the scroll bar
        if not width:
            self._width = 0
            return
        self._look = self._make_look()
        self._width = width
        self._blank = Strip.blank(width)
        self._thumb = Segment("┃", self.get_component_rich_style("transcript--thumb"))
        self._lines, self._starts = [], []
        self._rows.clear()
        for i in range(len(self.entries)):
            self._starts.append(len(self._lines))
            self._lines.extend(self._entry_lines(i))
        if self.follow:
            self.top = self.max_scroll_y
        self.top = min(self.top, self.max_scroll_y)
        self.refresh()

    def _entry_lines(self, i: int) -> list[Strip]:
        assert self._look is not None
        entry = self.entries[i]
        lines = entry.lines(self._look, self._width)
        return [self._blank, *lines] if entry.gap and i else lines

    def _make_look(self) -> Look:
        get = self.get_component_rich_style
        return Look(console=self.app.console, user=get("transcript--user", partial=False),
                    bar=get("transcript--bar", partial=False),
                    muted=get("transcript--muted", partial=True),
                    thinking=get("transcript--thinking", partial=True),
                    error=get("transcript--error", partial=True))

    def _show_changes(self, first: int, before: int) -> None:
        """Repaint lines `first` on (there were `before` lines, now `len(_lines)`); a
        view that follows the end jumps when the text passes its bottom (`JUMP_KEEP`)."""
        view = self.view_height
        count = len(self._lines)
        if self.follow and count > self.top + view:
            streaming = bool(self.entries) and getattr(self.entries[-1], "streaming", False)
            self.top = count - max(1, view // JUMP_KEEP) if streaming else count - view
            self.refresh()
            return
        y = max(0, first - self.top)
        end = min(view, max(count, before) - self.top)
        if end > y:
            self.refresh(Region(0, y, self._view[0], end - y))

    # -- scrolling ---------------------------------------------------------------------

    def scroll_to_line(self, top: int) -> None:
        """Show from line `top` on (never further down than the view is now: it is past
        the end only while it follows a stream); at the end, follow it again."""
        top = max(0, min(top, max(self.max_scroll_y, self.top)))
        self.follow = top >= self.max_scroll_y
        if top != self.top:
            self.top = top
            self.refresh()

    def anchor(self) -> None:
        """Show the end and follow it."""
        self.follow = True
        top = self.max_scroll_y
        if top != self.top:
            self.top = top
            self.refresh()

    def scroll_page_up(self) -> None:
        self.scroll_to_line(min(self.top, self.max_scroll_y) - max(1, self.view_height - 1))

    def scroll_page_down(self) -> None:
        self.scroll_to_line(self.top + max(1, self.view_height - 1))

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        event.stop()
        self.scroll_to_line(min(self.top, self.max_scroll_y) - SCROLL_LINES)

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        event.stop()
        self.scroll_to_line(self.top + SCROLL_LINES)

    def on_click(self, event: events.Click) -> None:
        line = self.top + event.y
        if not self._starts or line >= len(self._lines):
            return
        i = bisect_right(self._starts, line) - 1
        entry = self.entries[i]
        offset = line - self._starts[i] - (1 if entry.gap and i else 0)
        if offset >= 0 and entry.click(offset):
            event.stop()
            self.follow = False
            self.rebuild()
            # The clicked line stays where it was on screen.
            self.scroll_to_line(line - event.y)

    # -- drawing -----------------------------------------------------------------------

    def on_resize(self) -> None:
        self.rebuild()

    def on_mount(self) -> None:
        self.rebuild()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        if self._width:
            self.rebuild()  # a new theme: new colors for every entry

    def render_lines(self, crop: Region) -> list[Strip]:
        """The rows in `crop`, drawn here rather than through Textual's styles cache when
        nothing of the widget's box is styled (border, padding, tint, opacity).

        The styles cache wraps every row it draws, unchanged or not, into new strips for
        the box's styles and then filters them: a jump or a scroll repainted each row of
        the pane at several times the cost of drawing it. Here a row is the strip kept for
        its line (`_row`) through the same filters, which remember their result per strip;
        what reaches the screen is the same (tests/test_tui_compositor.py compares)."""
        width, height = self.size
        if (not self._width or (width, height) != self._view or not _bare_box(self)
                or (self.auto_links and self.hover_style.link_id)):
            return super().render_lines(crop)
        strips = [self._row(y) for y in crop.line_range]
        background = self.background_colors[1]
        for line_filter in self.get_line_filters():
            strips = [strip.apply_filter(line_filter, background) for strip in strips]
        if crop.column_span != (0, width):
            x1, x2 = crop.column_span
            strips = [strip.crop(x1, x2) for strip in strips]
        return strips

    def render_line(self, y: int) -> Strip:
        if not self._width:
            return Strip.blank(self._view[0])
        return self._row(y)

    def _row(self, y: int) -> Strip:
        i = self.top + y
        line = self._lines[i] if i < len(self._lines) else self._blank
        thumb = y in self._thumb_rows()
        key = (id(line), thumb)
        kept = self._rows.get(key)
        if kept is not None and kept[0] is line:
            return kept[1]
        if len(self._rows) > 2 * len(self._lines) + 256:
            self._rows.clear()  # rows of lines a streaming reply has replaced since
        row = Strip([*line, self._thumb if thumb else _SPACE], self._width + 1)
        self._rows[key] = (line, row)
        return row

    def _thumb_rows(self) -> range:
        """The rows of the scroll bar's thumb (none when everything fits)."""
        key = (self.top, len(self._lines))
        if key != self._thumb_key:
            view = self.view_height
            total = max(len(self._lines), self.top + view)
            size = max(1, view * view // total)
            start = min(view - size, self.top * view // total)
            self._thumb_key = key
            self._thumb_range = range(start, start + size) if total > view else range(0)
        return self._thumb_range
