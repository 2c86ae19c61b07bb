"""The engine panel: KV cache, queues, throughput and a sparkline, in vLLM's words."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.timer import Timer
from textual.widgets import Sparkline, Static

from minivllm.outputs import EngineStats

from ..stats import Rates, cache_line, compact_lines, kv_line, queue_line, throughput_line

SPARK_PERIOD = 1.0  # seconds between sparkline redraws
COMPACT_BELOW = 120  # columns: narrower, the panel condenses and the sparkline goes


def set_growing_text(widget: Static, text: str) -> None:
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


class StatsPanel(Horizontal):
    """Numbers on the left, generation tok/s over the last minute on the right. Below
    `COMPACT_BELOW` columns: two short lines with every figure, no sparkline."""

    def __init__(self) -> None:
        super().__init__(id="stats-panel")
        self.text = Static("waiting for the first stats snapshot…", markup=False, id="stats-text")
        self.spark = Sparkline([], id="stats-spark", summary_function=max)
        self.spark_label = Static("", markup=False, id="stats-spark-label")
        self.lines: list[str] = []
        self._last: tuple[EngineStats, Rates, list[float]] | None = None
        self._spark_at = 0.0
        self._spark_timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield self.text
        with Vertical(id="stats-spark-box"):
            yield self.spark_label
            yield self.spark

    @property
    def compact(self) -> bool:
        return self.has_class("-compact")

    def on_resize(self) -> None:
        compact = self.app.size.width < COMPACT_BELOW
        if compact != self.compact:
            self.set_class(compact, "-compact")
            if self._last is not None:
                self.show(*self._last)

    def show_disconnected(self, why: str | None) -> None:
        """Say the figures are not current (the server stopped answering), or no longer."""
        title = f"disconnected: {why}" if why else None
        if title != self.border_title:
            self.border_title = title
            if why:
                self.lines = [f"Disconnected: {why}; retrying"]
                set_growing_text(self.text, self.lines[0])

    def show(self, stats: EngineStats, rates: Rates, spark: list[float]) -> None:
        self._last = (stats, rates, spark)
        if self.compact:
            self.lines = compact_lines(stats, rates)
        else:
            self.lines = [kv_line(stats) + "   " + queue_line(stats), throughput_line(rates),
                          cache_line(stats)]
        set_growing_text(self.text, "\n".join(self.lines))  # no layout while it fits
        # NOTE: the sparkline is the panel's dearest widget to render: once a second is
        # enough for a minute of history (a skipped redraw happens when the second is up).
        wait = SPARK_PERIOD - (time.monotonic() - self._spark_at)
        if wait <= 0 or not self.spark.data:
            self._draw_spark()
        elif self._spark_timer is None:
            self._spark_timer = self.set_timer(wait, self._draw_spark)

    def _draw_spark(self) -> None:
        self._spark_timer = None
        self._spark_at = time.monotonic()
        spark = self._last[2] if self._last is not None else []
        data = spark or [0.0]
        if list(self.spark.data or ()) != data:
            self.spark.data = data
        peak = max(spark) if spark else 0.0
        self.spark_label.update(f"Generation tok/s, last 60 s (peak {peak:,.1f})",
                                layout=False)
