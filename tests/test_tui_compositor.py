"""The chat screen's compositor renders partial updates row by row: the screen it draws
must be the stock compositor's, cell for cell, whatever rows an update dirties."""

from __future__ import annotations

import io
import random
from pathlib import Path

from minivllm.tui.app import create_app
from minivllm.tui.compositor import DirtyRows, RowCompositor, _runs
from rich.cells import cell_len
from rich.console import Console
from rich.segment import ControlType
from rich.style import Style
from textual._compositor import Compositor
from textual.geometry import Region

from minivllm.server.standin import ScriptedEngine

REPLY = "Streaming **Markdown**:\n\n- one\n- two\n\n```python\nprint('hi')\n```\n\n" + " ".join(
    f"word{i}" for i in range(120))


def _screen_cells(update) -> dict[tuple[int, int], tuple[str, Style | None]]:
    """What an update draws: each cell it writes, with its character and style."""
    console = Console(file=io.StringIO(), width=200, force_terminal=True,
                      color_system="truecolor", legacy_windows=False)
    cells: dict[tuple[int, int], tuple[str, Style | None]] = {}
    x = y = 0
    for segment in console.render(update):
        if segment.control:
            for code in segment.control:
                if code[0] == ControlType.CURSOR_MOVE_TO:
                    x, y = code[1], code[2]
            continue
        if segment.text == "\n":  # between rows: each row's writes start with a move
            continue
        for char in segment.text:
            cells[x, y] = (char, segment.style)
            x += cell_len(char)
    return cells


def test_a_widget_is_drawn_where_it_shows_dirty_columns_nothing_in_front_covers():
    dirty = [Region(0, 0, 5, 40),  # beside the widgets: none of their rows
             Region(12, 3, 4, 4),  # rows 3-6, inside the front widget
             Region(25, 9, 50, 1), Region(0, 10, 11, 2), Region(29, 33, 3, 9)]
    uncovered = DirtyRows(dirty)
    front = Region(10, 5, 20, 30)  # columns 10-29, rows 5-34
    assert uncovered.cover(front) == [5, 6, 9, 10, 11, 33, 34]
    behind = Region(8, 0, 30, 40)  # a container around it: only what sticks out
    assert uncovered.cover(behind) == [3, 4, 9, 10, 11, 33, 34, 35, 36, 37, 38, 39]
    spans = uncovered.spans
    assert spans[9] == [(0, 5), (38, 75)] and spans[10] == [(0, 5), (0, 8)]
    assert spans[5] == [(0, 5)]  # what the two widgets covered is gone
    assert uncovered.cover(Region(0, 0, 80, 50)) == list(range(42))
    assert not uncovered  # all drawn: nothing behind is drawn
    assert list(_runs([5, 6, 9, 10, 11, 33, 34])) == [(5, 2), (9, 3), (33, 2)]
    assert list(_runs([])) == []


async def test_row_updates_draw_what_the_stock_compositor_draws(tmp_path: Path):
    app = create_app(ScriptedEngine(reply=REPLY, step_delay=0.001), conversations=6,
                     data_root=tmp_path / "data", export_dir=tmp_path)
    async with app.run_test(size=(150, 40)) as pilot:
        screen = app.screen
        assert isinstance(screen._compositor, RowCompositor)
        for pane in app.panes[:4]:
            pane.input.insert("hello")
            await app.send(pane, "hello")
        await pilot.pause(0.3)  # replies partway: Markdown, code, a long paragraph
        rows = screen._compositor
        stock = Compositor()
        stock.reflow(screen, screen.size)
        rng = random.Random(0)
        patterns = [[Region(0, y, 150, 1)] for y in (0, 5, 39)]
        patterns.append([Region(p.transcript.region.x, p.transcript.region.bottom - 2,
                                p.transcript.region.width, 2) for p in app.panes])
        patterns.append([p.input.region for p in app.panes])
        for _ in range(40):
            patterns.append([Region(rng.randrange(150), rng.randrange(40), rng.randint(1, 60),
                                    rng.randint(1, 12)) for _ in range(rng.randint(1, 6))])
        for regions in patterns:
            drawn = []
            for compositor in (rows, stock):
                compositor._dirty_regions.clear()  # the live app's own, pending
                compositor._dirty_regions.update(r.intersection(screen.region) for r in regions)
                drawn.append(_screen_cells(compositor.render_update()))
            assert drawn[0] == drawn[1], regions


async def test_transcript_rows_are_the_rows_textual_styles_would_draw(tmp_path: Path):
    """A transcript draws its own rows (no styles cache): the strips must equal what
    Textual's styles cache makes of its lines, streaming, finished, scrolled and cropped."""
    from minivllm.tui.widgets.transcript import _bare_box
    from textual.widget import Widget

    app = create_app(ScriptedEngine(reply=REPLY, step_delay=0.002), conversations=3,
                     data_root=tmp_path / "data", export_dir=tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        panes = app.panes
        for pane in panes[:2]:
            await app.send(pane, "hello")

        def compare() -> None:
            for pane in panes:
                t = pane.transcript
                assert _bare_box(t)  # the transcript's own path is the one compared
                width, height = t.size
                for crop in (Region(0, 0, width, height), Region(0, 3, width, 4),
                             Region(2, 0, width - 5, height - 1)):
                    fast = t.render_lines(crop)
                    t._styles_cache.clear()
                    assert fast == Widget.render_lines(t, crop), (pane, crop)

        await pilot.pause(0.1)
        compare()  # streaming, the view following the reply
        await pilot.pause(1.5)
        compare()  # finished: Markdown, a code block, the scroll bar's thumb
        panes[0].transcript.scroll_to_line(3)
        compare()
        app.theme = "textual-light" if app.theme != "textual-light" else "nord"
        await pilot.pause(0.1)
        compare()
