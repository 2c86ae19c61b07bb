"""A Textual compositor that renders, for a partial screen update, only the rows it changes.

Textual's compositor answers a partial update (some regions of the screen marked dirty)
by rendering every widget under the rectangle around all the dirty regions, each widget
whole, every one of its lines, and then keeping only the dirty rows. With several panes
streaming side by side, each pane dirties a line or two near its reply's end, at
different heights: the rectangle around them is most of the screen, so each frame
rendered every widget's every line (the inputs' themes and the panes' borders included)
to keep a few rows of it.

`RowCompositor` renders of each widget only the rows where it shows dirty columns that
no widget in front of it covers, in runs of consecutive rows. An update writes to the
terminal only the dirty regions' spans, and on each row of a span the widget in front
at its columns supplies them: the rows skipped are never written. So the screen is the
same, cell for cell (tests/test_tui_compositor.py compares the two). Full updates (a
layout, a resize, a new screen) take the stock path. Every update keeps whole a row that
no cut divides, where Textual's divides each row, copying it even into one piece.
"""

from __future__ import annotations

import inspect
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator

from textual._compositor import ChopsUpdate, Compositor
from textual.geometry import Region
from textual.strip import Strip


def screen_compositor() -> Compositor:
    """A `RowCompositor` where the installed Textual's compositor has the methods it
    builds on (they are Textual's internals), else Textual's own."""
    renders = getattr(Compositor, "_get_renders", None)
    chops = getattr(Compositor, "_render_chops", None)
    fits = (
        renders is not None
        and list(inspect.signature(renders).parameters) == ["self", "crop"]
        and chops is not None
        and list(inspect.signature(chops).parameters) == ["self", "crop", "is_rendered_line"]
        and hasattr(Compositor, "cuts")
        and hasattr(Compositor, "render_partial_update")
        and hasattr(Compositor(), "_dirty_regions")
    )
    return RowCompositor() if fits else Compositor()


class RowCompositor(Compositor):
    def __init__(self) -> None:
        super().__init__()
        self._dirty: list[Region] | None = None  # while a partial update runs

    def render_partial_update(self) -> ChopsUpdate | None:
        screen = self.size.region
        self._dirty = [screen.intersection(region) for region in self._dirty_regions]
        try:
            return super().render_partial_update()
        finally:
            self._dirty = None

    def _render_chops(
        self, crop: Region, is_rendered_line: Callable[[int], bool]
    ) -> list[dict[int, Strip | None]]:
        # Textual's, but a row that no cut divides is kept whole: `Strip.divide` copies a
        # strip even into one piece (~20 us for a row not drawn before).
        cuts = self.cuts
        chops: list[dict[int, Strip | None]] = [dict.fromkeys(row[:-1]) for row in cuts]
        for region, clip, strips in self._get_renders(crop):
            shown = region.intersection(clip)
            x = shown.x
            first_cut, last_cut = shown.column_span
            for y, strip in zip(shown.line_range, strips, strict=False):
                if not is_rendered_line(y):
                    continue
                line = chops[y]
                final = [cut for cut in cuts[y] if last_cut >= cut >= first_cut]
                if len(final) == 2 and final[0] == x and strip.cell_length == final[1] - x:
                    pieces: Iterable[Strip] = (strip,)
                else:
                    pieces = strip.divide([cut - x for cut in final[1:]])
                for cut, piece in zip(final, pieces, strict=False):
                    if line.get(cut) is None:  # front to back: the first piece wins
                        line[cut] = piece
        return chops

    def _get_renders(
        self, crop: Region | None = None
    ) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if not self._dirty:
            return super()._get_renders(crop)
        return self._row_renders(self._dirty, crop)

    def _row_renders(
        self, dirty: list[Region], crop: Region | None
    ) -> Iterator[tuple[Region, Region, list[Strip]]]:
        # Front to back, as the stock renders: on each row the first strip a cut gets
        # wins, so a widget is drawn only on the rows where some dirty columns are not
        # yet covered by a widget in front of it.
        uncovered = DirtyRows(dirty)
        for widget, (region, clip) in self.visible_widgets.items():
            if not uncovered:
                return  # every dirty column is drawn: what lies behind stays unseen
            if crop is not None and not crop.overlaps(clip):
                continue
            shown = region.intersection(clip)  # the clip is its container's
            for top, height in _runs(uncovered.cover(shown)):
                band = Region(shown.x, top, shown.width, height)
                lines = widget.render_lines(band.translate((-region.x, -region.y)))
                yield region, band, lines


class DirtyRows:
    """The dirty columns not yet drawn, row by row, as [start, end) spans."""

    def __init__(self, regions: list[Region]) -> None:
        self.spans: dict[int, list[tuple[int, int]]] = {}
        for x, y, width, height in regions:
            if width:
                for row in range(y, y + height):
                    self.spans.setdefault(row, []).append((x, x + width))
        self._rows = sorted(self.spans)  # rows drawn since are dropped from `spans` only
        self._regions = [region for region in regions if region.area]

    def __bool__(self) -> bool:
        return bool(self.spans)

    def cover(self, shown: Region) -> list[int]:
        """The rows (sorted) where `shown` (a widget's visible part) overlaps columns still
        uncovered; those columns are covered from now on (the widget drawn there hides
        whatever lies behind it)."""
        rows: list[int] = []
        if not any(map(shown.overlaps, self._regions)):
            return rows  # a widget beside every dirty region (another pane's, say)
        left, right = shown.x, shown.right
        spans_of = self.spans
        first = bisect_left(self._rows, shown.y)
        last = bisect_left(self._rows, shown.bottom, first)
        for y in self._rows[first:last]:
            spans = spans_of.get(y)
            if not spans or not any(start < right and end > left for start, end in spans):
                continue
            rows.append(y)
            rest = []
            for start, end in spans:
                if start < left:
                    rest.append((start, min(end, left)))
                if end > right:
                    rest.append((max(start, right), end))
            if rest:
                spans_of[y] = rest
            else:
                del spans_of[y]
        return rows


def _runs(rows: list[int]) -> Iterator[tuple[int, int]]:
    """The runs of consecutive `rows` (sorted): (first row, length) each."""
    start = length = 0
    for y in rows:
        if length and y == start + length:
            length += 1
            continue
        if length:
            yield start, length
        start, length = y, 1
    if length:
        yield start, length
