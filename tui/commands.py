"""The chat's commands: the slash commands typed in a message (one table for the app and
plain mode) and the app's command palette (ctrl+p; Textual adds theme, keys and quit)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from textual.app import SystemCommand

    from .app import ChatApp


@dataclass(frozen=True)
class SlashCommand:
    name: str
    args: str  # "" (none), "TEXT" (required) or "[TEXT]" / "[X]" (optional)
    help: str
    aliases: tuple[str, ...] = ()

    @property
    def usage(self) -> str:
        return f"{self.name} {self.args}".rstrip()


SLASH_COMMANDS = (
    SlashCommand("/all", "TEXT", "send TEXT to every pane"),
    SlashCommand("/think", "[TEXT]", "thinking on (a template with the switch), then send TEXT"),
    SlashCommand("/no_think", "[TEXT]", "thinking off, then send TEXT"),
    SlashCommand("/system", "[TEXT]", "set the system prompt (without TEXT: see it)"),
    SlashCommand("/rep", "[X]", "repetition penalty, 1 = off (without X: see it)"),
    SlashCommand("/clear", "", "forget the conversation", aliases=("/reset",)),
    SlashCommand("/stats", "", "the engine's stats"),
    SlashCommand("/help", "", "the keys and these commands"),
    SlashCommand("/exit", "", "quit", aliases=("/quit",)),
)
_BY_NAME = {name: c for c in SLASH_COMMANDS for name in (c.name, *c.aliases)}
# A first word like `/sytem` is a (mistyped) command; `/usr/bin/env ...` is text.
_COMMAND_WORD = re.compile(r"/[A-Za-z_]+")


@dataclass(frozen=True)
class Slash:
    """A message that starts with a command word: `command` None for an unknown one;
    `error` when the command lacks its required argument."""

    word: str
    command: SlashCommand | None
    rest: str

    @property
    def error(self) -> str | None:
        if self.command is None:
            return f"unknown command {self.word} (/help lists the commands)"
        if self.command.args == "TEXT" and not self.rest:
            return f"{self.word} needs TEXT: {self.command.usage}"
        return None


def parse_slash(text: str) -> Slash | None:
    """The command a message starts with, or None for a message to send as typed."""
    word, _, rest = text.strip().partition(" ")
    if not _COMMAND_WORD.fullmatch(word):
        return None
    return Slash(word, _BY_NAME.get(word), rest.strip())


def parse_repetition_penalty(text: str) -> float:
    """/rep's X, checked as the engine checks it (a ValueError names the value)."""
    from minivllm.sampling_params import SamplingParams

    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"repetition_penalty={text!r}: not a number") from None
    SamplingParams(repetition_penalty=value)
    return value


def commands_help() -> str:
    """One line per command, for /help."""
    width = max(len(c.usage) for c in SLASH_COMMANDS)
    return "\n".join(f"{c.usage:<{width}}  {c.help}"
                     + (f" (also {', '.join(c.aliases)})" if c.aliases else "")
                     for c in SLASH_COMMANDS)


def chat_commands(app: ChatApp) -> Iterator[SystemCommand]:
    from textual.app import SystemCommand

    yield SystemCommand("New conversation", "Open a pane (ctrl+n)", app.action_new_pane)
    yield SystemCommand("Close conversation", "Close the focused pane (ctrl+w)",
                        app.action_close_pane)
    yield SystemCommand("Reopen closed pane", "Bring back the last closed pane (ctrl+o)",
                        app.action_reopen_pane)
    yield SystemCommand("Copy reply", "Copy the focused pane's last reply (alt+c)",
                        app.action_copy_reply)
    yield SystemCommand("Clear conversation", "Forget the focused pane's messages (/clear)",
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
