"""A pane's input box: Enter sends; shift+enter and ctrl+j insert a newline."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class ChatInput(TextArea):
    """Multi-line input. The send and newline bindings have ids, so a keymap can move them.

    NOTE: they are run from this widget's own key handler rather than as priority
    bindings. A priority binding runs when the app receives the key, ahead of the keys
    still queued for this widget, so text typed (or pasted by tmux) just before Enter
    would be missed.
    """

    BINDINGS = [
        Binding("enter", "send", "Send", id="input.send"),
        Binding("shift+enter,ctrl+j", "newline", "Newline", id="input.newline", show=False),
    ]

    @dataclass
    class Send(Message):
        """The user asked to send the text; the app clears the box if it accepts it."""

        input: ChatInput
        text: str

    def __init__(self, placeholder: str = "", id: str | None = None) -> None:
        super().__init__(
            "", soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
            placeholder=placeholder, id=id, compact=True, highlight_cursor_line=False,
        )

    async def _on_key(self, event: events.Key) -> None:
        active = self.screen.active_bindings.get(event.key)
        if active is not None and active.node is self and active.binding.action in (
            "send", "newline"
        ):
            event.stop()
            event.prevent_default()
            await self.run_action(active.binding.action)
            return
        await super()._on_key(event)

    def action_send(self) -> None:
        self.post_message(self.Send(self, self.text))

    def action_newline(self) -> None:
        start, end = self.selection
        self._replace_via_keyboard("\n", start, end)
