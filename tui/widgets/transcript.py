"""A pane's transcript: every message of a conversation in ONE widget that draws lines.

Each entry (a user message, a reply, a notice: `entries.py`) renders itself to lines once
per width; a streaming reply wraps again only its last line or two. The widget keeps the
lines of all entries in one list and repaints only the lines that changed. While a reply
streams at the bottom, the view follows it in jumps (the last line moves up near the top
of the pane), so most frames repaint a line or two instead of scrolling, and repainting,
the whole pane.

NOTE: one widget, not a widget per message: with widgets, every few new lines of a reply
meant a screen layout, and each scroll repainted every widget of the pane; with eight
panes streaming at a GPU's speed that took all of the UI thread.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.color import Color
from textual.filter import LineFilter
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from .entries import Entry, Look, Reply

_SPACE = Segment(" ")
_NO_STYLE = Style()
SCROLL_LINES = 3  # lines a mouse wheel step scrolls
# A view that follows a streaming reply jumps when the text reaches its bottom: the last
# line moves up to 1/JUMP_KEEP of the view (a jump repaints the whole pane; the frames
# until the next one repaint only the lines that changed).
JUMP_KEEP = 4


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
        # Each line's row as drawn (the line plus its scroll-bar cell, through the line
        # filters), kept so that a repaint of an unchanged line costs a lookup.
        self._rows: dict[tuple[int, bool], tuple[Strip, Strip]] = {}
        self._rows_look: tuple[Any, ...] = ((), None)  # the filters the rows went through

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
        while first < end and old[first] is new[first - start]:
            first += 1  # the same strips (kept lines): no call per line
        while first < end and _looks_same(old[first], new[first - start]):
            # Unchanged lines (the old strip is kept): finished paragraphs are the same
            # strips; a paragraph once complete is drawn again as it streamed, though
            # perhaps in other segments.
            first += 1
        before = len(old)
        if first == before and first == start + len(new):
            return
        # The same from the end: a block drawn again above lines that stay (a heading
        # that streamed as plain text, say) repaints its own lines only.
        same_end = 0
        if start + len(new) == before:
            while (first < before - same_end
                   and _looks_same(old[before - 1 - same_end], new[-1 - same_end])):
                same_end += 1
        old[first:before - same_end] = new[first - start:len(new) - same_end]
        self._show_changes(first, before, before - same_end if same_end else None)

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

    def _show_changes(self, first: int, before: int, last: int | None = None) -> None:
        """Repaint lines `first` on (there were `before` lines, now `len(_lines)`), or
        only up to `last` (exclusive) where the lines after it stayed; a view that
        follows the end jumps when the text passes its bottom (`JUMP_KEEP`)."""
        view = self.view_height
        count = len(self._lines)
        if self.follow and count > self.top + view:
            streaming = bool(self.entries) and getattr(self.entries[-1], "streaming", False)
            self.top = count - max(1, view // JUMP_KEEP) if streaming else count - view
            self.refresh()
            return
        y = max(0, first - self.top)
        end = min(view, (max(count, before) if last is None else last) - self.top)
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
        the pane at several times the cost of drawing it. Here a row is built once for
        its line, through the same filters, and kept (`_row`); what reaches the screen is
        the same (tests/test_tui_compositor.py compares)."""
        width, height = self.size
        if (not self._width or (width, height) != self._view or not _bare_box(self)
                or (self.auto_links and self.hover_style.link_id)):
            return super().render_lines(crop)
        filters = tuple(self.get_line_filters())
        background = self.background_colors[1]
        self._keep_rows_for(filters, background)
        strips = [self._row(y, filters, background) for y in crop.line_range]
        if crop.column_span != (0, width):
            x1, x2 = crop.column_span
            strips = [strip.crop(x1, x2) for strip in strips]
        return strips

    def render_line(self, y: int) -> Strip:
        if not self._width:
            return Strip.blank(self._view[0])
        self._keep_rows_for((), None)
        return self._row(y)  # Textual's styles cache filters it

    def _keep_rows_for(self, filters: tuple[LineFilter, ...], background: Color | None) -> None:
        """The rows kept are for one set of filters and background at a time."""
        look = (filters, background)
        if look != self._rows_look:
            self._rows.clear()
            self._rows_look = look

    def _row(self, y: int, filters: tuple[LineFilter, ...] = (),
             background: Color | None = None) -> Strip:
        """Row `y` of the view: its line and the scroll bar's column, through `filters`
        (those of `_keep_rows_for`). Kept per line: a jump or a scroll shows the same rows
        elsewhere."""
        i = self.top + y
        line = self._lines[i] if i < len(self._lines) else self._blank
        thumb = y in self._thumb_rows()
        key = (id(line), thumb)
        kept = self._rows.get(key)
        if kept is not None and kept[0] is line:
            return kept[1]
        if len(self._rows) > 2 * len(self._lines) + 256:
            self._rows.clear()  # rows of lines a streaming reply has replaced since
        segments = [*line, self._thumb if thumb else _SPACE]
        for line_filter in filters:
            segments = line_filter.apply(segments, background)
        row = Strip(segments, self._width + 1)
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


def _looks_same(a: Strip, b: Strip) -> bool:
    """Whether two lines draw the same cells, however their segments split the text (no
    style and the null style look alike)."""
    return a is b or a == b or (a.text == b.text and _style_runs(a) == _style_runs(b))


def _style_runs(strip: Strip) -> list[tuple[Style, int]]:
    """The strip's styles in runs: (style, characters) each, adjacent equal ones merged."""
    runs: list[tuple[Style, int]] = []
    for segment in strip:
        style = segment.style or _NO_STYLE
        if runs and runs[-1][0] == style:
            runs[-1] = (style, runs[-1][1] + len(segment.text))
        else:
            runs.append((style, len(segment.text)))
    return runs
