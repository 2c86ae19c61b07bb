"""`minivllm-chat --plain`: one conversation in a line REPL (prompt-toolkit on a terminal,
plain line reading on a pipe). Same engine thread, session file and chat template as the
full-screen app.

Keys on a terminal: Enter sends, Esc Enter or ctrl+j inserts a newline, Ctrl-C stops the
reply (or clears the line), Ctrl-D exits. On a pipe each line is a prompt (a line ending
in a backslash continues on the next). Commands: /stats /reset /system [TEXT] /think
/no_think /help /exit.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from minivllm.sampling_params import SamplingParams

from .conversation import FINISH_TO_STATUS, ChatMessage, Conversation, Settings
from .engine_thread import EngineFactory, EngineWorker
from .messages import (
    DeltaBatch,
    EngineDied,
    EngineReady,
    LoadFailed,
    LoadProgress,
    RequestAccepted,
    RequestFailed,
    StatsSnapshot,
)
from .sanitize import StreamCleaner
from .stats import StatsHistory, cache_line, kv_line, queue_line, throughput_line
from .store import SessionStore, data_dir, new_session_path
from .thinking import ThinkParser
from .widgets.header import header_text

HELP = (
    "Enter sends; Esc Enter or ctrl+j: newline; Ctrl-C stops the reply; Ctrl-D exits.\n"
    "/stats  engine stats   /reset  forget the conversation   /system [TEXT]  system prompt\n"
    "/think /no_think  thinking on/off (Qwen3)   /rep [X]  repetition penalty (1 = off)   /exit"
)
DIM, RESET = "\x1b[2m", "\x1b[0m"


class PlainChat:
    def __init__(self, worker: EngineWorker, events: queue.Queue, settings: Settings,
                 out: TextIO, err: TextIO, store: SessionStore | None, color: bool) -> None:
        self.worker = worker
        self.events = events
        self.conv = Conversation(1, settings)
        self.out = out
        self.err = err
        self.store = store
        self.color = color
        self.stdin: TextIO | None = None  # a terminal: echo is off while a reply streams
        self.history = StatsHistory()
        self.latest: StatsSnapshot | None = None
        self.dead: str | None = None
        self._next_request = 1
        if store is not None:
            store.pane(1, settings)

    # -- events ------------------------------------------------------------------------

    def _get(self, timeout: float) -> Any:
        try:
            msg = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(msg, StatsSnapshot):
            self.history.add(msg.at, msg.stats)
            self.latest = msg
        elif isinstance(msg, EngineDied):
            self.dead = msg.error
        return msg

    def wait_ready(self) -> bool:
        last_stage = ""
        while True:
            msg = self._get(0.5)
            if isinstance(msg, LoadProgress):
                if msg.stage != last_stage:
                    self.err.write(f"{msg.stage}…\n")
                    self.err.flush()
                    last_stage = msg.stage
            elif isinstance(msg, EngineReady):
                self.err.write(header_text(msg.info) + "\n")
                self.err.flush()
                return True
            elif isinstance(msg, LoadFailed):
                first = msg.error.strip().splitlines()[0] if msg.error.strip() else "?"
                self.err.write(f"minivllm-chat: error: the engine failed to load: {first}\n")
                return False
            elif msg is None and not self.worker.alive:
                return False

    # -- commands ----------------------------------------------------------------------

    def command(self, text: str) -> bool:
        """Handle a /command; returns False to exit."""
        word, _, rest = text.partition(" ")
        rest = rest.strip()
        if word in ("/exit", "/quit"):
            return False
        if word == "/stats":
            self.print_stats()
        elif word == "/reset":
            self.conv.messages.clear()
            if self.store is not None:
                self.store.clear(1)
            self._say("(conversation reset)")
        elif word == "/system":
            if rest:
                self._set(system_prompt=rest)
                self._say("(system prompt set)")
            else:
                self._say(f"(system prompt: {self.conv.settings.system_prompt or 'none'})")
        elif word in ("/think", "/no_think"):
            if not self.supports_thinking:
                self._say("(this model has no thinking mode: its chat template has no "
                          "enable_thinking switch)")
            else:
                self._set(thinking=word == "/think")
                self._say(f"(thinking {'on' if word == '/think' else 'off'})")
        elif word == "/rep":
            self._set_repetition_penalty(rest)
        elif word == "/help":
            self._say(HELP)
        elif re.fullmatch(r"/[A-Za-z_]+", word):
            self._say(f"(unknown command {word}; /help lists the commands)")
        else:
            return self.send(text)
        return True

    @property
    def supports_thinking(self) -> bool:
        tokenizer = (getattr(self.worker.client, "tokenizer", None)
                     or getattr(self.worker.engine, "tokenizer", None))
        if tokenizer is None:  # a remote engine: cannot tell
            return True
        return "enable_thinking" in str(getattr(tokenizer, "chat_template", "") or "")

    def _set(self, **changes: Any) -> None:
        new = copy.deepcopy(self.conv.settings)
        for k, v in changes.items():
            setattr(new, k, v)
        self.conv.settings = new
        if self.store is not None:
            self.store.pane(1, new)

    def _set_repetition_penalty(self, rest: str) -> None:
        if not rest:
            self._say(f"(repetition penalty: {self.conv.settings.repetition_penalty:g})")
            return
        try:
            value = float(rest)
            SamplingParams(repetition_penalty=value)  # the engine's own check
        except ValueError as exc:
            self._say(f"(not set: {exc})")
            return
        self._set(repetition_penalty=value)
        self._say(f"(repetition penalty set to {value:g})")

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def print_stats(self) -> None:
        self.worker.request_stats()
        before = self.latest
        for _ in range(40):
            self._get(0.05)
            if self.latest is not before:
                break
        if self.latest is None:
            self._say("(no stats yet)")
            return
        s = self.latest.stats
        self._say("\n".join([kv_line(s), queue_line(s), throughput_line(self.history.rates()),
                             cache_line(s)]))

    # -- a turn ------------------------------------------------------------------------

    def send(self, text: str) -> bool:
        if self.dead is not None:
            self.err.write(f"the engine is not running: {self.dead}\n")
            return False
        try:
            params = self.conv.settings.sampling_params()
        except ValueError as exc:
            self.err.write(f"{exc}\n")
            return True
        if self.store is not None:
            self.store.user(1, text)  # on disk before it is submitted
        self.conv.messages.append(ChatMessage("user", text))
        reply = ChatMessage("assistant", "", status="streaming")
        self.conv.messages.append(reply)
        req = self._next_request
        self._next_request += 1
        self.worker.submit(req, self.conv.template_messages(), params,
                           self.conv.settings.thinking)
        with no_echo(self.stdin if self.color else None):
            self._stream(req, reply)
        if self.store is not None:
            self.store.end(1, reply.status, reply.content, reply.error)
        return True

    def _stream(self, req: int, reply: ChatMessage) -> None:
        parser = ThinkParser()
        cleaner = StreamCleaner()
        kind = "answer"
        while reply.status == "streaming":
            try:
                msg = self._get(0.1)
                if msg is None:
                    if not self.worker.alive:
                        reply.status, reply.error = "error", self.dead or "engine thread stopped"
                    continue
                if isinstance(msg, RequestAccepted) and msg.request_id == req:
                    if msg.opens_thinking:
                        parser = ThinkParser(in_think=True)
                elif isinstance(msg, RequestFailed) and msg.request_id == req:
                    reply.status, reply.error = "error", msg.error
                elif isinstance(msg, EngineDied):
                    reply.status, reply.error = "error", msg.error
                elif isinstance(msg, DeltaBatch):
                    for d in msg.deltas:
                        if int(d.request_id) != req:
                            continue
                        text = cleaner.feed(d.text) + (cleaner.finish() if d.finished else "")
                        reply.content += text
                        for seg_kind, seg in parser.feed(text):
                            kind = self._write(seg_kind, seg, kind)
                        if d.finished:
                            for seg_kind, seg in parser.finish():
                                kind = self._write(seg_kind, seg, kind)
                            reply.status = FINISH_TO_STATUS.get(d.finish_reason, "done")
                            reply.error = d.error
            except KeyboardInterrupt:
                self.worker.abort(req)  # the abort delta ends the loop
        if self.color and kind == "think":
            self.out.write(RESET)
        note = {"stopped": " [stopped]", "length": " [cut at max tokens]"}.get(reply.status, "")
        if reply.status == "error":
            note = f" [error: {reply.error}]"
        self.out.write(note + "\n\n")
        self.out.flush()

    def _write(self, kind: str, text: str, current: str) -> str:
        if self.color and kind != current:
            self.out.write(DIM if kind == "think" else RESET)
        elif not self.color and kind != current:
            self.out.write("<think>" if kind == "think" else "</think>")
        self.out.write(text)
        self.out.flush()
        return kind


@contextlib.contextmanager
def no_echo(stream: TextIO | None) -> Iterator[None]:
    """Turn the terminal's echo off while a reply streams, so neither Ctrl-C (`^C`) nor
    keys typed meanwhile land in the middle of the reply; typed keys stay queued for the
    next prompt. Does nothing when `stream` is not a terminal."""
    try:
        import termios

        fd = stream.fileno() if stream is not None else -1
        saved = termios.tcgetattr(fd) if fd >= 0 and stream.isatty() else None
    except (ImportError, OSError, ValueError, AttributeError):
        saved = None
    if saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ECHOCTL)  # lflags
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _read_pipe(stdin: TextIO):  # noqa: ANN202 - generator of prompts
    parts: list[str] = []
    for line in stdin:
        line = line.rstrip("\n")
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        parts.append(line)
        text = "\n".join(parts).strip()
        parts = []
        if text:
            yield text
    if parts and "\n".join(parts).strip():
        yield "\n".join(parts).strip()


def _read_terminal(history: Path):  # noqa: ANN202 - generator of prompts
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()

    @kb.add("enter")
    def _send(event: Any) -> None:
        event.current_buffer.validate_and_handle()

    @kb.add("escape", "enter")
    @kb.add("c-j")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        kept: Any = FileHistory(str(history))
    except OSError:  # an unwritable data dir: history for this run only
        from prompt_toolkit.history import InMemoryHistory

        kept = InMemoryHistory()
    session: PromptSession = PromptSession(
        history=kept, multiline=True, key_bindings=kb,
        prompt_continuation="... ",
    )
    while True:
        try:
            text = session.prompt(">>> ")
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt clears the line
        except EOFError:
            return
        if text.strip():
            yield text.strip()


def run_plain(
    *,
    engine: Any = None,
    engine_factory: EngineFactory | None = None,
    settings: Settings | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    interactive: bool | None = None,
    data_root: Path | None = None,
    save: bool = True,
) -> int:
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    if interactive is None:
        interactive = stdin.isatty() and stdout.isatty()
    root = data_root or data_dir()
    events: queue.Queue = queue.Queue()
    worker = EngineWorker(events.put, engine=engine, engine_factory=engine_factory)
    def storage_failed(error: str) -> None:
        stderr.write(f"minivllm-chat: warning: the conversation is not being saved: {error}\n")

    store = SessionStore(new_session_path(root), on_error=storage_failed) if save else None
    chat = PlainChat(worker, events, settings or Settings(), stdout, stderr, store,
                     color=interactive)
    chat.stdin = stdin
    worker.start()
    code = 0
    try:
        if not chat.wait_ready():
            return 1
        if interactive:
            stderr.write("Type a message; /help for commands, Ctrl-D to exit.\n")
        prompts = _read_terminal(root / "plain_history") if interactive else _read_pipe(stdin)
        for text in prompts:
            ok = chat.command(text) if text.startswith("/") else chat.send(text)
            if not ok:
                code = 1 if chat.dead else 0
                break
    except KeyboardInterrupt:
        pass
    finally:
        worker.stop()
        if store is not None:
            store.close()
    return code
