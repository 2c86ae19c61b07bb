"""The chat app: wires panes, the engine client and the session file together.

`create_app(engine=...)` (tests, benchmarks) or `create_app(engine_factory=...)` (the
CLI: the engine is built or connected behind a loading screen).

Each request is read from the client's stream (`EngineClient.generate`) by a task on the
app's event loop, as the server reads its requests: no thread or queue of the app's own.
A stream is read once a frame, at its start, so everything the engine produced for a
request since the last read arrives as one piece and is shown by that same frame.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.theme import Theme

from minivllm.frontend import EngineClient, EngineUnavailable, GenerateRequest, RequestOutput

from .commands import (
    chat_commands,
    commands_help,
    parse_repetition_penalty,
    parse_slash,
)
from .conversation import FINISH_TO_STATUS, Conversation, Settings, Status
from .engine_client import EngineFactory, EngineSource, engine_info, render_prompt
from .heap import settle
from .keys import enable_alt_digits
from .messages import EngineInfo, EngineReady, LoadFailed, LoadProgress, StatsSnapshot
from .stats import StatsHistory
from .store import (
    NullStore,
    SessionStore,
    data_dir,
    latest_session,
    load_session,
    new_session_path,
)
from .widgets.chat_input import ChatInput
from .widgets.chat_screen import ChatScreen
from .widgets.confirm import ConfirmModal
from .widgets.loading import LoadingScreen
from .widgets.pane import ConversationPane
from .widgets.settings_modal import SettingsModal
from .widgets.transcript import warm_up

MAX_PANES = 9
SWITCH_INTERVAL = 0.001  # seconds; see on_mount
FRAME_HZ = 30  # frames a second: streams are read and new text is shown at most this often
FULL_SETTLE_AFTER = 2.0  # seconds after a pane closes (see `_close`)
LAGS_KEPT = 10_000  # frame lags kept for the bench (`ChatApp.frame_lags`)
# A pane with only a little new text (under SHOW_CHARS, as at a CPU's speed: a token or two a
# frame) waits until its oldest new token is SHOW_WITHIN old: a repaint costs the same for
# one token as for a line of them.
SHOW_WITHIN = 0.05
SHOW_CHARS = 40
SETTLE_AFTER = 0.5  # seconds of nothing streaming before the heap is settled (`settle`)
HELP = (
    "Enter sends · ctrl+j newline · Esc or ctrl+c stops · alt+a or /all sends to every pane · "
    "ctrl+r regenerates · ctrl+n/ctrl+w new/close · ctrl+o reopens · alt+1..9 focus · "
    "alt+c copies the reply · PgUp/PgDn scroll · ctrl+p commands\n" + commands_help()
)


class ChatApp(App):
    CSS_PATH = "chat.tcss"
    TITLE = "minivllm-chat"
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True),
        Binding("ctrl+p", "command_palette", "Commands", id="app.command_palette",
                priority=True, show=False),  # the footer shows it on its own
    ]

    def __init__(
        self,
        *,
        engine: Any = None,
        engine_factory: EngineFactory | None = None,
        model: str = "",
        conversations: int = 2,
        settings: Settings | None = None,
        resume: bool | Path = False,
        data_root: Path | None = None,
        keymap: dict[str, str] | None = None,
        export_dir: Path | None = None,
        owns_engine: bool | None = None,
        stats_interval: float = 0.5,
        save_sessions: bool = True,
    ) -> None:
        super().__init__()
        enable_alt_digits()
        self.source = EngineSource(engine, engine_factory, owns_engine)
        self.client: EngineClient | None = None
        self._client_closed = False
        self._stats_interval = stats_interval
        # With a built engine nothing else runs yet, so reading it here is safe.
        self.info: EngineInfo | None = engine_info(engine) if engine is not None else None
        self.model = model or (self.info.model if self.info else "?")
        self.default_settings = settings or Settings()
        self.data_root = data_root or data_dir()
        self.export_dir = export_dir or self.data_root / "exports"
        self.storage_error: str | None = None
        self.load_error: str | None = None
        self._notes: list[tuple[str, str]] = []  # (text, severity) to show once mounted
        # Closed panes' conversations, newest last (ctrl+o reopens). NOTE: not `_closed`,
        # which Textual's message pump uses for its own state.
        self._closed_convs: list[Conversation] = []
        self.resume_theme: str | None = None
        self._keymap = dict(keymap or {})
        self.history = StatsHistory()
        self.active_pane: ConversationPane | None = None
        self.chat: ChatScreen | None = None
        self.loading: LoadingScreen | None = None
        self.engine_dead: str | None = None
        self._requests: dict[int, ConversationPane] = {}
        self._no_tokens_yet: list[int] = []  # accepted requests without output, FCFS
        self._last_stats: Any = None
        self._next_request = 1
        # Frames shown so far, and for each pane's new text how long after the engine
        # produced its oldest token it was shown (seconds; the bench reports them).
        self.frames = 0
        self.frame_lags: deque[float] = deque(maxlen=LAGS_KEPT)
        self._tick = asyncio.Event()  # set as a frame starts: the streams read then
        self._quitting = False
        self.save_sessions = save_sessions
        self.store, conversations_ = self._open_session(resume, conversations)
        self._next_key = max((c.key for c in conversations_), default=0) + 1
        self._initial = conversations_

    # -- session -----------------------------------------------------------------------

    def get_theme(self, theme_name: str) -> Theme | None:
        # NOTE: Textual's own looks the name up in a fresh copy of every registered theme,
        # twice for each widget it repaints: ~7% of the UI thread with eight panes
        # streaming. One name (no comma list) is looked up directly.
        themes = getattr(self, "_registered_themes", None)
        if themes is None or "," in theme_name:
            return super().get_theme(theme_name)
        return themes.get(theme_name.strip())

    def _open_session(self, resume: bool | Path, n: int) -> tuple[SessionStore, list[Conversation]]:
        self.resume_note = ""
        path = resume if isinstance(resume, Path) else (
            latest_session(self.data_root) if resume else None
        )
        if path is not None:
            loaded = load_session(path)
            store = SessionStore(path, on_error=self._storage_failed)
            for key in loaded.interrupted:  # close the open replies in the file too
                conv = next(c for c in loaded.conversations if c.key == key)
                store.end(key, "interrupted", conv.messages[-1].content)
            self.resume_note = loaded.notice()
            self.resume_theme = loaded.theme
            self._closed_convs = list(loaded.closed.values())
            if loaded.conversations:
                return store, loaded.conversations
        else:
            store = (SessionStore(new_session_path(self.data_root), on_error=self._storage_failed)
                     if self.save_sessions else NullStore())
            if resume:
                self.resume_note = "no earlier session with messages to resume"
        store.session(self.model)
        convs = [
            Conversation(k + 1, copy.deepcopy(self.default_settings)) for k in range(max(1, n))
        ]
        for c in convs:
            store.pane(c.key, c.settings)
        return store, convs

    def _storage_failed(self, error: str) -> None:
        """The session file cannot be written: keep going in memory and say so once."""
        self.storage_error = error
        self._note(f"conversations are not being saved: {error}. They stay on screen "
                   "(export still works: ctrl+p, Export).", "warning")

    def _note(self, text: str, severity: str = "information") -> None:
        if self.is_running:
            self.notify(text, severity=severity, markup=False, timeout=15)
        else:
            self._notes.append((text, severity))

    # -- start-up ----------------------------------------------------------------------

    def on_mount(self) -> None:
        # NOTE: the UI thread renders in pure Python; a shorter GIL switch interval lets
        # the engine thread back in sooner after each step's host work (measured: the
        # fake engine under three streaming panes finishes ~25% sooner).
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL))
        if self._keymap:
            self.set_keymap(self._keymap)
        if self.info is not None:  # a built engine: its front end starts at once
            self._connected(self.source.connect(lambda stage, fraction: None))
            self._show_chat(self.info)
        else:
            self.loading = LoadingScreen(self.model)
            self.push_screen(self.loading)
            self.run_worker(self._connect, thread=True, name="connect", exit_on_error=False)
        # Off the UI thread (while the engine loads): the first reply to end pays no imports.
        self.run_worker(warm_up, thread=True, name="warm-up", exit_on_error=False)
        self.set_interval(1 / FRAME_HZ, self._frame)
        self.set_interval(self._stats_interval, self._poll_engine)
        self.set_interval(1.0, self.store.flush_partial)
        if self.resume_theme and self.resume_theme in self.available_themes:
            self.theme = self.resume_theme
        self.theme_changed_signal.subscribe(self, lambda theme: self.store.theme(theme.name))
        if self.resume_note:
            self.notify(self.resume_note, markup=False)
        for text, severity in self._notes:
            self.notify(text, severity=severity, markup=False, timeout=15)
        self._notes.clear()

    def _show_chat(self, info: EngineInfo) -> None:
        self.info = info
        settle(everything=True)  # the engine's and the app's start-up objects, before the chat
        panes = [ConversationPane(c, i + 1) for i, c in enumerate(self._initial)]
        for pane in panes:
            self._count_context(pane)
        self.chat = ChatScreen(info, panes)
        if self.loading is not None:
            self.switch_screen(self.chat)
            self.loading = None
        else:
            self.push_screen(self.chat)
        self.call_after_refresh(self._poll_engine)  # the panel's first figures at once

    def _connect(self) -> None:
        """Thread worker: build or connect the engine's client behind the loading screen."""
        def progress(stage: str, fraction: float) -> None:
            self.post_message(LoadProgress(str(stage), float(fraction)))

        try:
            client = self.source.connect(progress)
        except BaseException as exc:  # noqa: BLE001 - shown on the loading screen
            headline = ("could not connect to the server" if isinstance(exc, EngineUnavailable)
                        else "the engine failed to load")
            self.post_message(LoadFailed(f"{type(exc).__name__}: {exc}\n"
                                         + traceback.format_exc(), headline))
            return
        self.post_message(EngineReady(client.info, client))

    def _connected(self, client: EngineClient) -> None:
        self.client = client
        if self._quitting:  # the user quit while it loaded
            self._close_client()

    def _close_client(self) -> None:
        if self.client is not None and not self._client_closed:
            self._client_closed = True
            self.client.close()

    def on_load_progress(self, msg: LoadProgress) -> None:
        if self.loading is not None:
            self.loading.progress(msg.stage, msg.fraction)

    def on_engine_ready(self, msg: EngineReady) -> None:
        self._connected(msg.client)
        if self.chat is None and not self._quitting:
            self._show_chat(msg.info)

    def on_load_failed(self, msg: LoadFailed) -> None:
        self.engine_dead = msg.error
        # The first line names the error; the traceback after it is for developers.
        self.load_error = msg.error.strip().splitlines()[0] if msg.error.strip() else "?"
        if self.loading is not None:
            self.loading.failed(self.load_error, msg.headline)

    # -- panes -------------------------------------------------------------------------

    @property
    def panes(self) -> list[ConversationPane]:
        return self.chat.panes if self.chat is not None else []

    def current_pane(self) -> ConversationPane | None:
        focused = self.focused
        if focused is not None:
            for node in focused.ancestors_with_self:
                if isinstance(node, ConversationPane):
                    return node
        panes = self.panes
        if self.active_pane in panes:
            return self.active_pane
        return panes[0] if panes else None

    def _focus(self, pane: ConversationPane) -> None:
        self.active_pane = pane
        pane.input.focus()

    def action_focus_pane(self, number: int) -> None:
        panes = self.panes
        if 1 <= number <= len(panes):
            self._focus(panes[number - 1])

    def action_focus_step(self, step: int) -> None:
        panes = self.panes
        pane = self.current_pane()
        if panes and pane is not None:
            self._focus(panes[(panes.index(pane) + step) % len(panes)])

    async def action_new_pane(self) -> None:
        if self.chat is None:
            return
        if len(self.panes) >= MAX_PANES:
            self.notify(f"at most {MAX_PANES} panes", severity="warning")
            return
        conv = Conversation(self._next_key, copy.deepcopy(self.default_settings))
        self._next_key += 1
        self.store.pane(conv.key, conv.settings)
        pane = ConversationPane(conv, len(self.panes) + 1)
        await self.chat.panes_box.mount(pane)
        self._focus(pane)

    async def action_close_pane(self) -> None:
        """Close the focused pane; one holding messages or a draft asks first (ctrl+w is
        also "delete a word" to shell users). ctrl+o reopens it."""
        pane = self.current_pane()
        if pane is None:
            return
        if len(self.panes) == 1:
            self.notify("this is the last pane (ctrl+q quits)", severity="warning")
            return
        if not (pane.conversation.messages or pane.input.text.strip()):
            await self._close(pane)
            return
        what = "its reply is streaming" if pane.busy else "it holds a conversation"
        question = (f"Close pane #{pane.number}? {what[0].upper() + what[1:]}. "
                    "ctrl+o (or Reopen in ctrl+p) brings it back.")

        self._confirm_close(pane, question)

    @work(exclusive=True, group="confirm-close")
    async def _confirm_close(self, pane: ConversationPane, question: str) -> None:
        # A worker waits for the answer, so the key's action returns at once.
        yes = await self.push_screen_wait(ConfirmModal(question))
        if pane not in self.panes:
            return
        if yes:
            await self._close(pane)
        else:
            self._focus(pane)

    async def _close(self, pane: ConversationPane) -> None:
        panes = self.panes
        if pane.busy and pane.request_id is not None:  # keep what streamed, as stopped
            request_id = pane.request_id
            self._cancel_request(pane)
            await self._finish(pane, request_id, "stopped")
        else:
            self._cancel_request(pane)
        pane.conversation.draft = pane.input.text
        self.store.close_pane(pane.conversation.key)
        self._closed_convs.append(pane.conversation)
        index = panes.index(pane)
        await pane.remove()
        rest = self.panes
        for i, p in enumerate(rest):
            p.renumber(i + 1)
        self._focus(rest[min(index, len(rest) - 1)])
        # A full pass frees the closed pane's widgets, once nothing refers to them (Textual
        # drops its last references to a removed widget at a later refresh).
        self.set_timer(FULL_SETTLE_AFTER, self._settle_everything)

    def _settle(self) -> None:
        """Nothing has streamed for a while: what the last turns made is collected or
        frozen now, not in a frame."""
        if not any(p.busy for p in self.panes):
            settle()

    def _settle_everything(self) -> None:
        if any(p.busy for p in self.panes):
            self.set_timer(FULL_SETTLE_AFTER, self._settle_everything)  # not mid-stream
        else:
            settle(everything=True)

    async def action_reopen_pane(self) -> None:
        if self.chat is None:
            return
        if not self._closed_convs:
            self.notify("no closed pane to reopen")
            return
        if len(self.panes) >= MAX_PANES:
            self.notify(f"at most {MAX_PANES} panes", severity="warning")
            return
        conv = self._closed_convs.pop()
        self.store.reopen_pane(conv.key)
        pane = ConversationPane(conv, len(self.panes) + 1)
        self._count_context(pane)
        await self.chat.panes_box.mount(pane)
        if getattr(conv, "draft", ""):
            pane.input.text = conv.draft
        self._focus(pane)

    def _cancel_request(self, pane: ConversationPane) -> None:
        """Drop a pane's live request (its reply is going away with the pane's text)."""
        if pane.request_id is not None:
            self._requests.pop(pane.request_id, None)
            self._abort(pane.request_id)

    async def action_clear(self) -> None:
        pane = self.current_pane()
        if pane is None:
            return
        self._cancel_request(pane)
        pane.request_id = None
        self.store.clear(pane.conversation.key)
        await pane.clear()

    def action_export(self) -> None:
        """Write the focused pane to Markdown in the data dir's exports/ (the current
        directory if that cannot be written) and show the path."""
        pane = self.current_pane()
        if pane is None:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"minivllm-chat-{stamp}-pane{pane.number}.md"
        text = pane.conversation.to_markdown(f"minivllm-chat · pane #{pane.number}")
        errors = []
        for folder in (self.export_dir, Path.cwd()):
            path = folder / name
            try:
                folder.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
            except OSError as exc:
                errors.append(f"{folder}: {exc.strerror or exc}")
                continue
            self.last_export = path
            self.notify(f"exported pane #{pane.number} to {path}", markup=False, timeout=10)
            return
        self.notify("export failed: " + "; ".join(errors), severity="error", markup=False)

    def action_copy_reply(self) -> None:
        """Copy the focused pane's last reply (its answer, without thinking) to the
        terminal's clipboard (OSC 52)."""
        pane = self.current_pane()
        if pane is None:
            return
        reply = next((m for m in reversed(pane.conversation.messages)
                      if m.role == "assistant" and m.answer), None)
        if reply is None:
            self.notify(f"pane #{pane.number} has no reply to copy")
            return
        self.copy_to_clipboard(reply.answer)
        self.notify(f"copied pane #{pane.number}'s last reply ({len(reply.answer):,} characters)")

    def action_scroll_transcript(self, pages: int) -> None:
        pane = self.current_pane()
        if pane is not None:
            if pages < 0:
                pane.transcript.scroll_page_up()
            else:
                pane.transcript.scroll_page_down()

    async def action_interrupt(self) -> None:
        """ctrl+c: stop the focused reply; copy a selection in the input; else say how to
        quit. It never quits and never loses text."""
        pane = self.current_pane()
        if pane is not None and pane.busy:
            await self.action_stop()
            return
        if pane is not None and pane.input.selected_text:
            self.copy_to_clipboard(pane.input.selected_text)
            return
        self.notify("nothing to stop (ctrl+q quits)")

    def action_settings(self, focus: str = "system") -> None:
        pane = self.current_pane()
        if pane is None or self.chat is None:
            return

        def done(new: Settings | None) -> None:
            if new is not None:
                self._apply_settings(pane, new)

        self.push_screen(SettingsModal(pane.conversation.settings, pane.number, focus), done)

    def _apply_settings(self, pane: ConversationPane, new: Settings) -> None:
        pane.conversation.settings = new
        self.store.pane(pane.conversation.key, new)
        pane.refresh_title(force=True)

    def action_toggle_thinking(self) -> None:
        pane = self.current_pane()
        if pane is not None:
            self._set_thinking(pane, not pane.conversation.settings.thinking)

    @property
    def input_placeholder(self) -> str:
        """A pane input's hint, naming the keys the keymap gives to send and newline."""
        send = self._keymap.get("input.send", "Enter").split(",")[0]
        newline = self._keymap.get("input.newline", "ctrl+j").split(",")[-1]
        return f"Message ({send} sends, {newline} newline)"

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, or None (a remote engine). Only read from it."""
        return (getattr(self.client, "tokenizer", None)
                or getattr(self.source.engine, "tokenizer", None))

    @property
    def supports_thinking(self) -> bool:
        """Whether the model's chat template has a thinking switch (Qwen3's
        `enable_thinking`); True when it cannot be told (no tokenizer here)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return True
        return "enable_thinking" in str(getattr(tokenizer, "chat_template", "") or "")

    def _set_thinking(self, pane: ConversationPane, on: bool) -> None:
        if not self.supports_thinking:
            self.notify(f"{self.model} has no thinking mode (its chat template has no "
                        "enable_thinking switch)", severity="warning", markup=False)
            return
        new = copy.deepcopy(pane.conversation.settings)
        new.thinking = on
        self._apply_settings(pane, new)
        self.notify(f"pane #{pane.number}: thinking {'on' if on else 'off'}")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        if self.chat is not None:
            yield from chat_commands(self)
        yield from super().get_system_commands(screen)

    # -- sending -----------------------------------------------------------------------

    async def on_chat_input_send(self, msg: ChatInput.Send) -> None:
        pane = next((p for p in self.panes if p.input is msg.input), None)
        if pane is not None and await self.send(pane, msg.text):
            msg.input.clear()

    async def action_broadcast(self) -> None:
        pane = self.current_pane()
        if pane is not None and pane.input.text.strip():
            if await self.broadcast(pane.input.text):
                pane.input.clear()

    async def broadcast(self, text: str) -> bool:
        sent = False
        for pane in self.panes:
            sent = await self.send(pane, text, allow_commands=False) or sent
        return sent

    async def send(self, pane: ConversationPane, text: str, allow_commands: bool = True) -> bool:
        """A user message for `pane`. Returns whether the input should be cleared."""
        text = text.strip("\n").rstrip()
        if not text.strip():
            return False
        if allow_commands and text.startswith("/"):
            handled, rest = await self._slash_command(pane, text)
            if rest is None:  # an unknown command: the input keeps it for fixing
                return False
            if handled:
                return True
            text = rest
        if pane.busy:
            self.notify(f"pane #{pane.number} is still replying (Esc stops it)",
                        severity="warning")
            return False
        if self.engine_dead is not None:
            self.notify(f"the engine is not running: {self.engine_dead}", severity="error",
                        markup=False)
            return False
        self.store.user(pane.conversation.key, text)  # on disk before it is submitted
        pane.add_user(text)
        await self._submit(pane)
        return True

    async def _slash_command(
        self, pane: ConversationPane, text: str
    ) -> tuple[bool, str | None]:
        """Returns (handled, text to send; None for an unknown or incomplete command,
        which stays in the input for fixing). The commands are `commands.SLASH_COMMANDS`;
        a first word that is not a command word (`/usr/bin ...`) is sent as typed."""
        slash = parse_slash(text)
        if slash is None:
            return False, text
        if slash.error is not None:
            self.notify(slash.error, severity="warning", markup=False)
            return True, None
        name, rest = slash.command.name, slash.rest
        if name == "/all":
            await self.broadcast(rest)
        elif name in ("/think", "/no_think"):
            self._set_thinking(pane, name == "/think")
            return (not rest), rest
        elif name == "/system" and rest:
            new = copy.deepcopy(pane.conversation.settings)
            new.system_prompt = rest
            self._apply_settings(pane, new)
            self.notify(f"pane #{pane.number}: system prompt set")
        elif name == "/system":
            self.action_settings("system")
        elif name == "/rep":
            self._set_repetition_penalty(pane, rest)
        elif name == "/clear":
            self._focus(pane)
            await self.action_clear()
        elif name == "/stats":
            self.notify("the engine's stats are in the panel at the bottom")
        elif name == "/help":
            self.notify(HELP, timeout=10, markup=False)
        elif name == "/exit":
            await self.action_quit()
        return True, ""

    def _set_repetition_penalty(self, pane: ConversationPane, rest: str) -> None:
        settings = pane.conversation.settings
        if not rest:
            self.notify(f"pane #{pane.number}: repetition penalty "
                        f"{settings.repetition_penalty:g}")
            return
        try:
            value = parse_repetition_penalty(rest)
        except ValueError as exc:
            self.notify(f"not set: {exc}", severity="warning", markup=False)
            return
        new = copy.deepcopy(settings)
        new.repetition_penalty = value
        self._apply_settings(pane, new)
        self.notify(f"pane #{pane.number}: repetition penalty set to {value:g}")

    async def _submit(self, pane: ConversationPane) -> None:
        request_id = self._next_request
        self._next_request += 1
        pane.begin_reply(request_id)
        try:
            params = pane.conversation.settings.sampling_params()
        except ValueError as exc:
            await self._finish(pane, request_id, "error", str(exc))
            return
        await self._fit_context(pane)
        if self.client is None or self.engine_dead is not None:
            await self._finish(pane, request_id, "error",
                               self.engine_dead or "the engine is not ready")
            return
        self._requests[request_id] = pane
        thinking = pane.conversation.settings.thinking
        request = GenerateRequest(
            str(request_id), params, messages=pane.conversation.template_messages(),
            chat_template_kwargs={} if thinking is None else {"enable_thinking": thinking})
        # The request is queued now; a worker reads its stream.
        stream = self.client.generate(request)
        self.run_worker(self._stream(pane, request_id, stream), name=f"request {request_id}",
                        group="requests", exit_on_error=False)

    def count_prompt_tokens(self, conv: Conversation) -> int | None:
        """Tokens of the conversation's next prompt (chat template included), or None
        without a tokenizer. NOTE: runs on the UI thread while the engine thread may
        tokenize too; encoding with a fast tokenizer only reads it."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        try:
            text = render_prompt(tokenizer, conv.template_messages(), conv.settings.thinking)
            return len(tokenizer.encode(text, add_special_tokens=False))
        except Exception:  # noqa: BLE001 - then the engine's own check speaks
            return None

    def _count_context(self, pane: ConversationPane) -> None:
        """The title's context figure for a pane that already holds a conversation (a
        resumed or reopened one): its history as the next prompt would send it."""
        max_len = self.info.max_len if self.info is not None else 0
        if pane.conversation.messages and max_len:
            pane.context_tokens = self.count_prompt_tokens(pane.conversation) or 0
            pane.max_len = max_len

    async def _fit_context(self, pane: ConversationPane) -> None:
        """Leave out the oldest turns (never the system prompt, never the new message)
        until the prompt leaves room for a reply, and mark the cut in the transcript."""
        conv = pane.conversation
        max_len = self.info.max_len if self.info is not None else 0
        tokens = self.count_prompt_tokens(conv)
        if tokens is None or not max_len:
            return
        room = min(conv.settings.max_tokens, max(1, max_len // 4))
        dropped = conv.dropped
        while tokens + room > max_len and conv.next_turn_start() is not None:
            conv.dropped = conv.next_turn_start()
            tokens = self.count_prompt_tokens(conv) or 0
        pane.context_tokens = tokens
        pane.max_len = max_len
        if conv.dropped != dropped:
            await pane.show_context_cut(max_len)
            self.store.context_cut(conv.key, conv.dropped)

    # -- stop / regenerate ----------------------------------------------------------------

    async def action_stop(self) -> None:
        pane = self.current_pane()
        if pane is None or not pane.busy or pane.request_id is None:
            return
        if self.client is None or self.client.error is not None:
            await self._finish(pane, pane.request_id, "stopped")
            return
        pane.set_state(pane.state, "stopping")
        self._abort(pane.request_id)

    async def action_regenerate(self) -> None:
        pane = self.current_pane()
        if pane is None or pane.conversation.last_user_index() is None:
            return
        if pane.busy:
            pane.regenerate_after_stop = True
            await self.action_stop()
            return
        await self._regenerate(pane)

    async def _regenerate(self, pane: ConversationPane) -> None:
        if self.engine_dead is not None:
            return
        self.store.regenerate(pane.conversation.key)
        await pane.drop_last_reply()
        await self._submit(pane)

    # -- engine results --------------------------------------------------------------------

    def _abort(self, request_id: int) -> None:
        if self.client is not None:
            self.client.abort(str(request_id))

    async def _stream(self, pane: ConversationPane, request_id: int,
                      stream: AsyncIterator[RequestOutput]) -> None:
        """Read one request's stream into its pane until it ends.

        After the first tokens the stream is read once a frame, as the frame starts: what
        the engine produced meanwhile comes as one merged output (one wake-up of this loop
        per frame, whatever the engine's step rate) and that frame shows it. The first
        tokens are taken at once, so a pane's TTFT is the engine's."""
        streaming = False
        try:
            async for out in stream:
                if self._requests.get(request_id) is not pane:
                    return  # ended here already (stopped by closing, quit, engine gone)
                self._take(pane, request_id, out)
                if out.finished:
                    await self._end(pane, request_id, out)
                    return
                streaming = streaming or bool(out.token_ids or out.text)
                if streaming:
                    await self._tick.wait()
        except Exception as exc:  # noqa: BLE001 - a broken client fails this request only
            if self._requests.get(request_id) is pane:
                await self._finish(pane, request_id, "error", f"{type(exc).__name__}: {exc}")
        finally:
            await stream.aclose()  # aborts the request if it has not finished

    def _take(self, pane: ConversationPane, request_id: int, out: RequestOutput) -> None:
        if out.accepted:
            pane.accepted(out.opens_thinking)
            self._no_tokens_yet.append(request_id)
        if out.token_ids or out.text:
            if request_id in self._no_tokens_yet:
                self._no_tokens_yet.remove(request_id)
            pane.feed(out.text, len(out.token_ids), out.at, out.since)

    async def _end(self, pane: ConversationPane, request_id: int, out: RequestOutput) -> None:
        """A request's last output: its usage, then the pane's reply ends as it says."""
        pane.usage = (out.num_prompt_tokens, out.num_generated_tokens)
        if out.num_prompt_tokens and self.info is not None and self.info.max_len:
            # The engine's count (a remote server's too, where the app has no tokenizer
            # to count with); `finish` adds the reply's tokens.
            pane.context_tokens = out.num_prompt_tokens
            pane.max_len = self.info.max_len
        status, error = _status(out), out.error
        if status == "stopped" and pane.state_detail != "stopping":
            # Not this app's Esc: the engine or the server ended the reply.
            status = "error"
            error = error or ("the engine stopped this reply (a server that is shutting "
                              "down, or went away)")
        await self._finish(pane, request_id, status, error)

    async def _finish(self, pane: ConversationPane, request_id: int, status: Status,
                      error: str | None = None) -> None:
        self._requests.pop(request_id, None)
        if request_id in self._no_tokens_yet:
            self._no_tokens_yet.remove(request_id)
        message = await pane.finish(status, error)
        self.store.end(pane.conversation.key, status, message.content, error)
        if not any(p.busy for p in self.panes):
            self.set_timer(SETTLE_AFTER, self._settle)
        if status == "error":
            self.notify(f"pane #{pane.number}: {error}", severity="error", markup=False)
        if pane.regenerate_after_stop:
            pane.regenerate_after_stop = False
            await self._regenerate(pane)

    async def _poll_engine(self) -> None:
        """A few times a second: the client's latest stats snapshot for the panel, and
        whether the engine stopped for good."""
        client = self.client
        if client is None or self._client_closed:
            return
        if client.error is not None and self.engine_dead is None:
            await self._engine_died(client.error)
            return
        away = getattr(client, "disconnected", None)  # a server whose /metrics fails
        if self.chat is not None:
            self.chat.stats_panel.show_disconnected(away)
        if away:
            return
        stats = client.stats()
        if stats is not None and stats is not self._last_stats:
            self._last_stats = stats
            self.on_stats_snapshot(StatsSnapshot(stats, time.monotonic()))

    def on_stats_snapshot(self, msg: StatsSnapshot) -> None:
        rates = self.history.add(msg.at, msg.stats)
        if self.chat is None:
            return
        self.chat.stats_panel.show(msg.stats, rates, self.history.spark_data())
        # FCFS: the newest accepted requests without output are the ones still waiting.
        waiting = min(msg.stats.num_waiting, len(self._no_tokens_yet))
        queued = set(self._no_tokens_yet[len(self._no_tokens_yet) - waiting:])
        for pane in self.panes:
            if pane.request_id is not None:
                pane.set_queued(pane.request_id in queued)

    async def _engine_died(self, error: str) -> None:
        """The engine stopped for good: every pane says so, its text kept."""
        self.engine_dead = error
        for pane in self.panes:
            if pane.request_id is not None:
                await self._finish(pane, pane.request_id, "error", error)
            await pane.show_error(f"engine stopped: {error}")
            pane.set_state("error", "engine stopped")
            pane.refresh_title()
        self.notify(f"the engine stopped: {error}", severity="error", markup=False,
                    timeout=30)

    async def _frame(self) -> None:
        """Show every pane's new text (one repaint each), at most FRAME_HZ times a second."""
        self.frames += 1
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()
        await asyncio.sleep(0)  # the streams it woke read what the engine sent since
        progress = getattr(self.client, "prompt_progress", None)  # a remote has none
        now = time.monotonic()
        for pane in self.panes:
            if progress is not None and pane.state in ("queued", "prefill") \
                    and pane.request_id is not None:
                pane.set_prefill_progress(progress(str(pane.request_id)))
        for pane in self.panes:
            oldest = pane.pending_since
            if (oldest is not None and now - oldest < SHOW_WITHIN
                    and pane.pending_chars < SHOW_CHARS):
                continue  # a token or two: shown with the next ones, still within SHOW_WITHIN
            text = pane.flush()
            if text:
                if oldest is not None:
                    self.frame_lags.append(now - oldest)
                self.store.chunk(pane.conversation.key, text)

    # -- quitting --------------------------------------------------------------------------

    async def action_quit(self) -> None:
        if self._quitting:
            return
        self._quitting = True
        for pane in self.panes:
            if pane.request_id is not None:
                await self._finish(pane, pane.request_id, "stopped")
        await asyncio.to_thread(self._close_client)
        self.store.close()
        self.exit(return_code=1 if self.load_error else 0)

    def on_unmount(self) -> None:
        # Also reached when the app ends some other way; nothing here may lose text.
        sys.setswitchinterval(self._switch_interval)
        self.store.close()
        self._close_client()


def _status(out: RequestOutput) -> Status:
    return FINISH_TO_STATUS.get(out.finish_reason, "done")


def create_app(engine: Any = None, **options: Any) -> ChatApp:
    """The app around a built engine (`engine=`) or one built behind a loading screen
    (`engine_factory=on_progress -> engine`). Options: see `ChatApp`."""
    return ChatApp(engine=engine, **options)


def binding_ids() -> set[str]:
    """Every binding id a keymap may move."""
    from .widgets.loading import LoadingScreen
    from .widgets.settings_modal import SettingsModal

    ids = set()
    for cls in (ChatApp, ChatScreen, ChatInput, SettingsModal, ConfirmModal, LoadingScreen):
        ids.update(b.id for b in cls.BINDINGS if getattr(b, "id", None))
    return ids
