"""The chat's commands: the slash commands typed in a message (one table for the app and
plain mode), what each does in the app, and the app's command palette (ctrl+p; Textual
adds theme, keys and quit)."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from textual.app import SystemCommand

    from .app import ChatApp
    from .widgets.pane import ConversationPane


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


def app_help() -> str:
    """The app's /help: its keys, then the commands."""
    return ("Enter sends · ctrl+j newline · Esc or ctrl+c stops · alt+a or /all sends to "
            "every pane · ctrl+r regenerates · ctrl+n/ctrl+w new/close · ctrl+o reopens · "
            "alt+1..9 focus · alt+c copies the reply · PgUp/PgDn scroll · ctrl+p commands\n"
            + commands_help())


async def run_slash(app: ChatApp, pane: ConversationPane, text: str
                    ) -> tuple[bool, str | None]:
    """Run the command a message to `pane` starts with, in the app. Returns (handled,
    text to send; None for an unknown or incomplete command, which stays in the input for
    fixing). A first word that is not a command word (`/usr/bin ...`) is sent as typed."""
    slash = parse_slash(text)
    if slash is None:
        return False, text
    if slash.error is not None:
        app.notify(slash.error, severity="warning", markup=False)
        return True, None
    name, rest = slash.command.name, slash.rest
    if name == "/all":
        await app.broadcast(rest)
    elif name in ("/think", "/no_think"):
        app.set_thinking(pane, name == "/think")
        return (not rest), rest
    elif name == "/system" and rest:
        new = copy.deepcopy(pane.conversation.settings)
        new.system_prompt = rest
        app.apply_settings(pane, new)
        app.notify(f"pane #{pane.number}: system prompt set")
    elif name == "/system":
        app.action_settings("system")
    elif name == "/rep":
        _set_repetition_penalty(app, pane, rest)
    elif name == "/clear":
        app.focus_pane(pane)
        await app.action_clear()
    elif name == "/stats":
        app.notify("the engine's stats are in the panel at the bottom")
    elif name == "/help":
        app.notify(app_help(), timeout=10, markup=False)
    elif name == "/exit":
        await app.action_quit()
    return True, ""


def _set_repetition_penalty(app: ChatApp, pane: ConversationPane, rest: str) -> None:
    """/rep: without X, say the pane's penalty; with X, set it (a bad X is refused)."""
    settings = pane.conversation.settings
    if not rest:
        app.notify(f"pane #{pane.number}: repetition penalty "
                   f"{settings.repetition_penalty:g}")
        return
    try:
        value = parse_repetition_penalty(rest)
    except ValueError as exc:
        app.notify(f"not set: {exc}", severity="warning", markup=False)
        return
    new = copy.deepcopy(settings)
    new.repetition_penalty = value
    app.apply_settings(pane, new)
    app.notify(f"pane #{pane.number}: repetition penalty set to {value:g}")


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
