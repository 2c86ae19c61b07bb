"""The command palette's chat commands (ctrl+p); Textual adds theme, keys and quit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from textual.app import SystemCommand

if TYPE_CHECKING:
    from .app import ChatApp


def chat_commands(app: ChatApp) -> Iterator[SystemCommand]:
    yield SystemCommand("New conversation", "Open a pane (ctrl+n)", app.action_new_pane)
    yield SystemCommand("Close conversation", "Close the focused pane (ctrl+w)",
                        app.action_close_pane)
    yield SystemCommand("Reopen closed pane", "Bring back the last closed pane (ctrl+o)",
                        app.action_reopen_pane)
    yield SystemCommand("Copy reply", "Copy the focused pane's last reply (alt+c)",
                        app.action_copy_reply)
    yield SystemCommand("Clear conversation", "Forget the focused pane's messages",
                        app.action_clear)
    yield SystemCommand("Regenerate", "Ask again for the last reply (ctrl+r)",
                        app.action_regenerate)
    yield SystemCommand("Stop", "Stop the focused pane's reply (Esc, ctrl+c)", app.action_stop)
    yield SystemCommand("Send to all panes", "Send the focused input to every pane (alt+a)",
                        app.action_broadcast)
    yield SystemCommand("Export to Markdown", "Write the focused pane to a .md file in the "
                        "data dir's exports/",
                        app.action_export)
    yield SystemCommand("System prompt", "Set the focused pane's system prompt",
                        lambda: app.action_settings("system"))
    yield SystemCommand("Sampling parameters", "temperature, top_p, top_k, max_tokens (F2)",
                        lambda: app.action_settings("temperature"))
    yield SystemCommand("Toggle thinking", "enable_thinking in the chat template (/think)",
                        app.action_toggle_thinking)
