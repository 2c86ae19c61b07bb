"""`minivllm-chat --plain`: one conversation in a line REPL (prompt-toolkit on a terminal,
plain line reading on a pipe). Same engine client, session file and chat template as the
full-screen app; a reply's outputs come from the client's callbacks, one per engine step
(or fewer, merged, when the engine is ahead).

Keys on a terminal: Enter sends, Esc Enter or ctrl+j inserts a newline, Ctrl-C stops the
reply (or clears the line), Ctrl-D exits. On a pipe each line is a prompt (a line ending
in a backslash continues on the next). Commands: /stats /reset /system [TEXT] /think
/no_think /help /exit.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from minivllm.frontend import EngineClient, EngineUnavailable, GenerateRequest, RequestOutput

from .commands import commands_help, parse_repetition_penalty, parse_slash
from .conversation import FINISH_TO_STATUS, ChatMessage, Conversation, Settings
from .engine_client import EngineFactory, EngineSource
from .sanitize import StreamCleaner
from .stats import StatsHistory, cache_line, kv_line, queue_line, throughput_line
from .store import SessionStore, data_dir, new_session_path
from .thinking import ThinkParser
from .widgets.header import header_text

HELP = ("Enter sends; Esc Enter or ctrl+j: newline; Ctrl-C stops the reply; Ctrl-D exits.\n"
        + commands_help())
DIM, RESET = "\x1b[2m", "\x1b[0m"


class PlainChat:
    def __init__(self, source: EngineSource, settings: Settings, out: TextIO, err: TextIO,
                 store: SessionStore | None, color: bool) -> None:
        self.source = source
        self.client: EngineClient | None = None
        self.conv = Conversation(1, settings)
        self.out = out
        self.err = err
        self.store = store
        self.color = color
        self.stdin: TextIO | None = None  # a terminal: echo is off while a reply streams
        self.history = StatsHistory()
        self._last_stats: Any = None
        self.dead: str | None = None
        self._next_request = 1
        if store is not None:
            store.pane(1, settings)

    # -- the engine ---------------------------------------------------------------------

    def connect(self) -> bool:
        """Build or connect the engine, printing each loading stage once."""
        stages: list[str] = []

        def progress(stage: str, fraction: float) -> None:
            if not stages or stages[-1] != stage:
                stages.append(stage)
                self.err.write(f"{stage}…\n")
                self.err.flush()

        try:
            self.client = self.source.connect(progress)
        except Exception as exc:  # noqa: BLE001 - one line, as for every CLI error
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            what = ("could not connect to the server" if isinstance(exc, EngineUnavailable)
                    else "the engine failed to load")
            self.err.write(f"minivllm-chat: error: {what}: {first}\n")
            return False
        assert self.client.info is not None
        self.err.write(header_text(self.client.info) + "\n")
        self.err.flush()
        return True

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def _sample_stats(self) -> None:
        stats = self.client.stats() if self.client is not None else None
        if stats is not None and stats is not self._last_stats:
            self._last_stats = stats
            self.history.add(time.monotonic(), stats)

    # -- commands ----------------------------------------------------------------------

    def command(self, text: str) -> bool:
        """Handle a message that may start with a slash command
        (`commands.SLASH_COMMANDS`); returns False to exit."""
        slash = parse_slash(text)
        if slash is None:
            return self.send(text)
        if slash.error is not None:
            self._say(f"({slash.error})")
            return True
        name, rest = slash.command.name, slash.rest
        if name == "/exit":
            return False
        if name == "/all":  # every conversation of plain mode is this one
            return self.send(rest)
        if name == "/stats":
            self.print_stats()
        elif name == "/clear":
            self.conv.messages.clear()
            if self.store is not None:
                self.store.clear(1)
            self._say("(conversation reset)")
        elif name == "/system" and rest:
            self._set(system_prompt=rest)
            self._say("(system prompt set)")
        elif name == "/system":
            self._say(f"(system prompt: {self.conv.settings.system_prompt or 'none'})")
        elif name in ("/think", "/no_think"):
            if not self.supports_thinking:
                self._say("(this model has no thinking mode: its chat template has no "
                          "enable_thinking switch)")
                return True
            self._set(thinking=name == "/think")
            self._say(f"(thinking {'on' if name == '/think' else 'off'})")
            if rest:
                return self.send(rest)
        elif name == "/rep":
            self._set_repetition_penalty(rest)
        elif name == "/help":
            self._say(HELP)
        return True

    @property
    def supports_thinking(self) -> bool:
        tokenizer = (getattr(self.client, "tokenizer", None)
                     or getattr(self.source.engine, "tokenizer", None))
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
            value = parse_repetition_penalty(rest)
        except ValueError as exc:
            self._say(f"(not set: {exc})")
            return
        self._set(repetition_penalty=value)
        self._say(f"(repetition penalty set to {value:g})")

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def print_stats(self) -> None:
        self._sample_stats()
        s = self._last_stats
        if s is None:
            self._say("(no stats yet)")
            return
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
        req = str(self._next_request)
        self._next_request += 1
        thinking = self.conv.settings.thinking
        request = GenerateRequest(
            req, params, messages=self.conv.template_messages(),
            chat_template_kwargs={} if thinking is None else {"enable_thinking": thinking})
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        assert self.client is not None
        self.client.add_request(request, outputs.put)
        with no_echo(self.stdin if self.color else None):
            self._stream(req, outputs, reply)
        if self.store is not None:
            self.store.end(1, reply.status, reply.content, reply.error)
        return True

    def _stream(self, req: str, outputs: queue.SimpleQueue[RequestOutput],
                reply: ChatMessage) -> None:
        """Print the request's outputs until its last one (Ctrl-C aborts it: the abort's
        output ends the loop)."""
        assert self.client is not None
        parser = ThinkParser()
        cleaner = StreamCleaner()
        kind = "answer"
        interrupted = False  # Ctrl-C: the user's stop (any other abort is the engine's)
        while reply.status == "streaming":
            try:
                try:
                    out = outputs.get(timeout=0.25)
                except queue.Empty:
                    self._sample_stats()
                    if self.client.error is not None:  # its requests end with an error
                        self.dead = self.client.error
                    continue
                if out.accepted and out.opens_thinking:
                    parser = ThinkParser(in_think=True)
                text = cleaner.feed(out.text) + (cleaner.finish() if out.finished else "")
                reply.content += text
                for seg_kind, seg in parser.feed(text):
                    kind = self._write(seg_kind, seg, kind)
                if out.finished:
                    for seg_kind, seg in parser.finish():
                        kind = self._write(seg_kind, seg, kind)
                    reply.status = FINISH_TO_STATUS.get(out.finish_reason, "done")
                    reply.error = out.error
                    if reply.status == "stopped" and not interrupted:
                        reply.status = "error"
                        reply.error = reply.error or ("the engine stopped this reply (a "
                                                      "server that is shutting down, or "
                                                      "went away)")
                    if self.client.error is not None:
                        self.dead = self.client.error
            except KeyboardInterrupt:
                interrupted = True
                self.client.abort(req)  # the abort's output ends the loop
        self._sample_stats()
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
    next prompt, an Enter among them still an Enter. Does nothing when `stream` is not a
    terminal."""
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
    # iflags: keep a typed-ahead Enter a carriage return. With ICRNL the terminal turns it
    # into a line feed, which the next prompt takes for ctrl+j (a newline), not "send".
    quiet[0] &= ~termios.ICRNL
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

    def storage_failed(error: str) -> None:
        stderr.write(f"minivllm-chat: warning: the conversation is not being saved: {error}\n")

    store = SessionStore(new_session_path(root), on_error=storage_failed) if save else None
    chat = PlainChat(EngineSource(engine, engine_factory), settings or Settings(), stdout,
                     stderr, store, color=interactive)
    chat.stdin = stdin
    code = 0
    try:
        if not chat.connect():
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
        chat.close()
        if store is not None:
            store.close()
    return code
