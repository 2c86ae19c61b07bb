"""The engine panel: KV cache, queues, throughput and a sparkline, in vLLM's words."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Sparkline, Static

from minivllm.outputs import EngineStats

from ..stats import Rates, cache_line, kv_line, queue_line, throughput_line


class StatsPanel(Horizontal):
    """Numbers on the left, generation tok/s over the last minute on the right."""

    def __init__(self) -> None:
        super().__init__(id="stats-panel")
        self.text = Static("waiting for the first stats snapshot…", markup=False, id="stats-text")
        self.spark = Sparkline([], id="stats-spark", summary_function=max)
        self.spark_label = Static("", markup=False, id="stats-spark-label")
        self.lines: list[str] = []

    def compose(self) -> ComposeResult:
        yield self.text
        with Vertical(id="stats-spark-box"):
            yield self.spark_label
            yield self.spark

    def show(self, stats: EngineStats, rates: Rates, spark: list[float]) -> None:
        self.lines = [kv_line(stats) + "   " + queue_line(stats), throughput_line(rates),
                      cache_line(stats)]
        self.text.update("\n".join(self.lines))
        self.spark.data = spark or [0.0]
        peak = max(spark) if spark else 0.0
        self.spark_label.update(f"Generation tok/s, last 60 s (peak {peak:,.1f})")
