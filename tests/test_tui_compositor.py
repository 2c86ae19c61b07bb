"""The chat screen's compositor renders partial updates row by row: the screen it draws
must be the stock compositor's, byte for byte, whatever rows an update dirties."""

from __future__ import annotations

import io
import random
from pathlib import Path

from minivllm.tui.app import create_app
from minivllm.tui.compositor import RowCompositor, _runs
from rich.console import Console
from textual._compositor import Compositor
from textual.geometry import Region

from minivllm.server.standin import ScriptedEngine

REPLY = "Streaming **Markdown**:\n\n- one\n- two\n\n```python\nprint('hi')\n```\n\n" + " ".join(
    f"word{i}" for i in range(120))


def _terminal_bytes(update) -> str:
    console = Console(file=io.StringIO(), width=200, force_terminal=True,
                      color_system="truecolor", legacy_windows=False)
    console.print(update, end="")
    return console.file.getvalue()


def test_runs_of_rows_inside_a_band():
    assert list(_runs([1, 2, 3, 7, 9, 10], 0, 20)) == [(1, 3), (7, 1), (9, 2)]
    assert list(_runs([1, 2, 3, 7, 9, 10], 2, 10)) == [(2, 2), (7, 1), (9, 1)]
    assert list(_runs([1, 2], 5, 9)) == []


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
                drawn.append(_terminal_bytes(compositor.render_update()))
            assert drawn[0] == drawn[1], regions
