"""A conversation as data: its settings, its messages, and how it becomes a prompt."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from minivllm.sampling_params import SamplingParams

from .markdown import hard_line_breaks
from .thinking import split_thinking

Role = Literal["user", "assistant"]
# "streaming" while the engine works on it; "done" (eos/stop), "length" (hit max tokens),
# "stopped" (the user pressed Esc), "interrupted" (the app died mid-reply), "error".
Status = Literal["streaming", "done", "length", "stopped", "interrupted", "error"]

FINISH_TO_STATUS: dict[str | None, Status] = {
    "stop": "done",
    "length": "length",
    "abort": "stopped",
    "error": "error",
    None: "done",
}


@dataclass
class Settings:
    """Per-pane settings: the system prompt, sampling parameters and thinking switch."""

    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = -1
    max_tokens: int = 1024
    repetition_penalty: float = 1.0  # small models (SmolLM2) loop less with ~1.1
    thinking: bool = True  # passed to the chat template as `enable_thinking`

    def sampling_params(self) -> SamplingParams:
        """Raises `ValueError` naming the field for a bad value."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            repetition_penalty=self.repetition_penalty,
        )

    def summary(self) -> str:
        """The short form shown in a pane's title."""
        parts = [f"T={self.temperature:g}"]
        if self.top_p != 1:
            parts.append(f"top_p={self.top_p:g}")
        if self.top_k not in (-1, 0):
            parts.append(f"top_k={self.top_k}")
        parts.append(f"max={self.max_tokens}")
        if self.repetition_penalty != 1:
            parts.append(f"rep={self.repetition_penalty:g}")
        if not self.thinking:
            parts.append("no_think")
        if self.system_prompt:
            parts.append("system✓")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Settings:
        """From a session record; unknown keys are ignored (older or newer files), a bad
        value raises ValueError naming the field."""
        if not isinstance(d, dict):
            raise ValueError(f"settings={d!r}: not an object")
        defaults = cls()
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            value, default = d[f.name], getattr(defaults, f.name)
            if isinstance(default, bool) or isinstance(default, str):
                ok = type(value) is type(default)
            elif isinstance(default, int):
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif isinstance(default, float):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            else:
                ok = True
            if not ok:
                raise ValueError(f"{f.name}={value!r}: expected {type(default).__name__}")
            values[f.name] = value
        settings = cls(**values)
        settings.sampling_params()  # the engine's own checks, naming the field
        return settings


@dataclass
class ChatMessage:
    role: Role
    content: str  # raw text; an assistant's includes its <think> block
    status: Status = "done"
    error: str | None = None

    @property
    def answer(self) -> str:
        """What goes back into the history: the reply without its thinking."""
        if self.role != "assistant":
            return self.content
        return split_thinking(self.content)[1].strip()


@dataclass
class Conversation:
    key: int  # stable id in the session file; the pane's on-screen number may change
    settings: Settings = field(default_factory=Settings)
    messages: list[ChatMessage] = field(default_factory=list)
    # The first `dropped` messages no longer fit the context and are left out of the
    # prompt (whole turns; the system prompt is always kept).
    dropped: int = 0
    draft: str = ""  # the input's text when the pane was closed (reopen restores it)

    def next_turn_start(self) -> int | None:
        """Where the prompt would start with one more turn left out: the next user
        message after `dropped`, if it is not the newest one (which is always sent)."""
        last = self.last_user_index()
        for i in range(self.dropped + 1, len(self.messages)):
            if self.messages[i].role == "user":
                return i if last is not None and i <= last else None
        return None

    def template_messages(self) -> list[dict[str, str]]:
        """The history for `apply_chat_template`: system prompt, then user/assistant turns.

        Thinking is left out, and so are assistant messages with nothing to show (a reply
        interrupted before its first token) and failed turns (a user message whose reply
        is an error: a rejected prompt must not poison every later turn).
        """
        out: list[dict[str, str]] = []
        if self.settings.system_prompt:
            out.append({"role": "system", "content": self.settings.system_prompt})
        msgs = self.messages[self.dropped:]
        for i, m in enumerate(msgs):
            nxt = msgs[i + 1] if i + 1 < len(msgs) else None
            if m.status == "error" or (
                m.role == "user" and nxt is not None and nxt.role == "assistant"
                and nxt.status == "error"
            ):
                continue
            text = m.answer
            if m.role == "assistant" and (not text or m.status == "streaming"):
                continue
            out.append({"role": m.role, "content": text})
        return out

    def last_user_index(self) -> int | None:
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "user":
                return i
        return None

    def drop_last_reply(self) -> bool:
        """For regenerate: remove the assistant messages after the last user message."""
        i = self.last_user_index()
        if i is None:
            return False
        del self.messages[i + 1:]
        self.dropped = min(self.dropped, i)
        return True

    def to_markdown(self, title: str = "Conversation") -> str:
        """The conversation as a Markdown document; texts keep their single line breaks
        (as hard breaks), as the app shows them."""
        lines = [f"# {title}", ""]
        s = self.settings
        lines.append(f"_Settings: {s.summary()}_")
        lines.append("")
        if s.system_prompt:
            lines += ["## System", "", hard_line_breaks(s.system_prompt), ""]
        for m in self.messages:
            if m.role == "user":
                lines += ["## User", "", hard_line_breaks(m.content), ""]
                continue
            thinking, answer = split_thinking(m.content)
            lines += ["## Assistant", ""]
            if thinking.strip():
                quoted = "\n".join(
                    "> " + line for line in hard_line_breaks(thinking.strip()).splitlines()
                )
                lines += ["> **Thinking**", ">", quoted, ""]
            lines += [hard_line_breaks(answer.strip()), ""]
            if m.status not in ("done", "streaming"):
                note = f"_[{m.status}{': ' + m.error if m.error else ''}]_"
                lines += [note, ""]
        return "\n".join(lines).rstrip() + "\n"
