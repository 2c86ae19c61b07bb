"""A Textual compositor that renders, for a partial screen update, only the rows it changes.

Textual's compositor answers a partial update (some regions of the screen marked dirty)
by rendering every widget under the rectangle around all the dirty regions, each widget
whole, every one of its lines, and then keeping only the dirty rows. With several panes
streaming side by side, each pane dirties a line or two near its reply's end, at
different heights: the rectangle around them is most of the screen, so each frame
rendered every widget's every line (the inputs' themes and the panes' borders included)
to keep a few rows of it.

`RowCompositor` renders of each widget only the rows where a dirty region overlaps it,
in runs of consecutive rows. An update writes to the terminal only the dirty regions'
spans, and on each row the widget in front at a span's columns overlaps that span: the
rows skipped are never written. So the screen is the same, byte for byte
(tests/test_tui_compositor.py compares the two). Full updates (a layout, a resize, a
new screen) take the stock path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from textual._compositor import ChopsUpdate, Compositor
from textual.geometry import Region
from textual.strip import Strip


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

    def _get_renders(
        self, crop: Region | None = None
    ) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if not self._dirty:
            return super()._get_renders(crop)
        return self._row_renders(self._dirty, crop)

    def _row_renders(
        self, dirty: list[Region], crop: Region | None
    ) -> Iterator[tuple[Region, Region, list[Strip]]]:
        # Front to back, as the stock renders: the first strip a row's cut gets wins.
        for widget, (region, clip) in self.visible_widgets.items():
            if crop is not None and not crop.overlaps(clip):
                continue
            rows = _rows_within(dirty, clip)
            for top, height in _runs(rows):
                band = clip.intersection(Region(clip.x, top, clip.width, height))
                x, y, width, band_height = region.intersection(band)
                if width and band_height:
                    lines = widget.render_lines(
                        Region(x - region.x, y - region.y, width, band_height)
                    )
                    yield region, band, lines


def _rows_within(regions: list[Region], clip: Region) -> list[int]:
    """The rows (sorted) where some of `regions` overlaps `clip`."""
    rows: set[int] = set()
    for region in regions:
        if region.overlaps(clip):
            rows.update(range(max(region.y, clip.y), min(region.bottom, clip.bottom)))
    return sorted(rows)


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
