"""Shown while the engine loads weights, sizes the KV pool and captures CUDA graphs."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Label, ProgressBar, Static


class LoadingScreen(Screen):
    BINDINGS = [Binding("escape", "app.quit", "Quit", id="loading.quit")]

    def __init__(self, model: str) -> None:
        super().__init__(id="loading")
        self.model = model
        self.stage = Label("starting…", id="loading-stage", markup=False)
        self.bar = ProgressBar(total=100, show_eta=False, id="loading-bar")
        self.error = Static("", markup=False, id="loading-error")

    def compose(self) -> ComposeResult:
        with Middle(), Center():
            yield Label(f"minivllm-chat · loading {self.model}", id="loading-title", markup=False)
        with Center():
            yield self.stage
        with Center():
            yield self.bar
        with Center():
            yield self.error

    def progress(self, stage: str, fraction: float) -> None:
        self.stage.update(stage)
        self.bar.update(progress=max(0.0, min(1.0, fraction)) * 100)

    def failed(self, error: str, headline: str = "the engine failed to load") -> None:
        self.stage.update(f"{headline} (ctrl+q or Esc quits)")
        self.error.update(error)
