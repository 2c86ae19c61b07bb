"""Per-pane settings: system prompt, sampling parameters, thinking."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, Switch, TextArea

from ..conversation import Settings


class SettingsModal(ModalScreen[Settings | None]):
    """Returns the new `Settings`, or None if cancelled. Bad values are refused with the
    engine's own `ValueError` message (which names the field). ctrl+s, or Enter in a
    one-line field, saves; Esc cancels."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="settings.cancel"),
        Binding("ctrl+s", "save", "Save", id="settings.save"),
    ]

    def __init__(self, settings: Settings, pane_number: int, focus: str = "system") -> None:
        super().__init__(id="settings")
        self.settings = settings
        self.pane_number = pane_number
        self.focus_field = focus

    def compose(self) -> ComposeResult:
        s = self.settings
        # Scrolls when the terminal is shorter than the form (80x24).
        with VerticalScroll(id="settings-box"):
            yield Label(f"Pane #{self.pane_number} settings", id="settings-title")
            yield Label("System prompt")
            yield TextArea(s.system_prompt, id="system", soft_wrap=True)
            with Grid(id="settings-grid"):
                yield Label("temperature")
                yield Input(str(s.temperature), id="temperature", type="number")
                yield Label("top_p")
                yield Input(str(s.top_p), id="top_p", type="number")
                yield Label("top_k")
                yield Input(str(s.top_k), id="top_k", type="integer")
                yield Label("max_tokens")
                yield Input(str(s.max_tokens), id="max_tokens", type="integer")
                yield Label("rep. penalty")
                yield Input(str(s.repetition_penalty), id="repetition_penalty", type="number")
                yield Label("thinking")
                yield Switch(s.thinking, id="thinking")
            yield Static("", id="settings-error", markup=False)
            with Horizontal(id="settings-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(f"#{self.focus_field}").focus()

    def read(self) -> Settings:
        """The form as `Settings`; raises `ValueError` naming the bad field."""

        def number(field: str, kind: type) -> float | int:
            raw = self.query_one(f"#{field}", Input).value.strip()
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{field}={raw!r}: not a valid {kind.__name__}") from None

        new = Settings(
            system_prompt=self.query_one("#system", TextArea).text.strip(),
            temperature=number("temperature", float),
            top_p=number("top_p", float),
            top_k=number("top_k", int),
            max_tokens=number("max_tokens", int),
            repetition_penalty=number("repetition_penalty", float),
            thinking=self.query_one("#thinking", Switch).value,
        )
        new.sampling_params()  # validate like the engine will
        return new

    def action_save(self) -> None:
        try:
            settings = self.read()
        except ValueError as exc:
            self.query_one("#settings-error", Static).update(str(exc))
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in a field saves, as in most forms."""
        event.stop()
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()
