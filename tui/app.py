"""The chat app: wires panes, the engine client and the session file together.

`create_app(engine=...)` (tests, benchmarks) or `create_app(engine_factory=...)` (the
CLI: the engine is built or connected behind a loading screen).

The app holds the start-up, the session and the keys' actions (the slash commands run
through `commands.run_slash`); two controllers do the rest: `PaneControl` (panes.py)
opens, closes and reopens panes, and `RequestStreams` (streams.py) sends messages, reads
each reply's stream and shows what streamed once a frame.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.theme import Theme

from minivllm.frontend import EngineClient, EngineUnavailable
from minivllm.heap import settle

from .commands import chat_commands, run_slash
from .context import count_context, count_prompt_tokens
from .conversation import Conversation, Settings
from .engine_client import EngineFactory, EngineSource, engine_info
from .keys import enable_alt_digits
from .messages import EngineInfo, EngineReady, LoadFailed, LoadProgress, StatsSnapshot
from .panes import PaneControl
from .stats import StatsHistory
from .store import data_dir, open_session
from .streams import FRAME_HZ, RequestStreams
from .widgets.chat_input import ChatInput
from .widgets.chat_screen import ChatScreen
from .widgets.confirm import ConfirmModal
from .widgets.entries import warm_up
from .widgets.loading import LoadingScreen
from .widgets.pane import ConversationPane
from .widgets.settings_modal import SettingsModal

SWITCH_INTERVAL = 0.001  # seconds; see on_mount


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
        self.client_closed = False
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
        self._keymap = dict(keymap or {})
        self.history = StatsHistory()
        self.active_pane: ConversationPane | None = None
        self.chat: ChatScreen | None = None
        self.loading: LoadingScreen | None = None
        self.engine_dead: str | None = None
        self.streams = RequestStreams(self)
        self._quitting = False
        session = open_session(self.data_root, resume, conversations, self.default_settings,
                               self.model, save_sessions, on_error=self._storage_failed)
        self.store = session.store
        self.resume_note, self.resume_theme = session.note, session.theme
        next_key = max((c.key for c in session.conversations), default=0) + 1
        self.pane_control = PaneControl(self, session.closed, next_key)
        self._initial = session.conversations

    # -- session and theme -------------------------------------------------------------

    def get_theme(self, theme_name: str) -> Theme | None:
        # NOTE: Textual's own looks the name up in a fresh copy of every registered theme,
        # twice for each widget it repaints: ~7% of the UI thread with eight panes
        # streaming. One name (no comma list) is looked up directly.
        themes = getattr(self, "_registered_themes", None)
        if themes is None or "," in theme_name:
            return super().get_theme(theme_name)
        return themes.get(theme_name.strip())

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
        self.set_interval(1 / FRAME_HZ, self.streams.frame)
        self.set_interval(self._stats_interval, self.streams.poll_engine)
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
            count_context(pane, self.tokenizer, self.max_len)
        self.chat = ChatScreen(info, panes)
        if self.loading is not None:
            self.switch_screen(self.chat)
            self.loading = None
        else:
            self.push_screen(self.chat)
        self.call_after_refresh(self.streams.poll_engine)  # the panel's first figures at once

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
        if self.client is not None and not self.client_closed:
            self.client_closed = True
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

    def focus_pane(self, pane: ConversationPane) -> None:
        """Make `pane` the focused one (its input takes the keys)."""
        self.active_pane = pane
        pane.input.focus()

    def action_focus_pane(self, number: int) -> None:
        panes = self.panes
        if 1 <= number <= len(panes):
            self.focus_pane(panes[number - 1])

    def action_focus_step(self, step: int) -> None:
        panes = self.panes
        pane = self.current_pane()
        if panes and pane is not None:
            self.focus_pane(panes[(panes.index(pane) + step) % len(panes)])

    async def action_new_pane(self) -> None:
        await self.pane_control.new()

    async def action_close_pane(self) -> None:
        pane = self.current_pane()
        if pane is not None:
            await self.pane_control.close_asking(pane)

    async def action_reopen_pane(self) -> None:
        await self.pane_control.reopen()

    async def action_clear(self) -> None:
        pane = self.current_pane()
        if pane is not None:
            await self.pane_control.clear(pane)

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
                self.apply_settings(pane, new)

        self.push_screen(SettingsModal(pane.conversation.settings, pane.number, focus), done)

    def apply_settings(self, pane: ConversationPane, new: Settings) -> None:
        pane.conversation.settings = new
        self.store.pane(pane.conversation.key, new)
        pane.refresh_title(force=True)

    def action_toggle_thinking(self) -> None:
        pane = self.current_pane()
        if pane is not None:
            self.set_thinking(pane, not pane.conversation.settings.thinking)

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

    def set_thinking(self, pane: ConversationPane, on: bool) -> None:
        if not self.supports_thinking:
            self.notify(f"{self.model} has no thinking mode (its chat template has no "
                        "enable_thinking switch)", severity="warning", markup=False)
            return
        new = copy.deepcopy(pane.conversation.settings)
        new.thinking = on
        self.apply_settings(pane, new)
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
            handled, rest = await run_slash(self, pane, text)
            if rest is None:  # an unknown command: the input keeps it for fixing
                return False
            if handled:
                return True
            text = rest
        return await self.streams.send(pane, text)

    # -- context -------------------------------------------------------------------------

    def count_prompt_tokens(self, conv: Conversation) -> int | None:
        """Tokens of the conversation's next prompt (chat template included), or None
        without a tokenizer."""
        return count_prompt_tokens(self.tokenizer, conv)

    @property
    def max_len(self) -> int:
        """The engine's context length (0 until it is known)."""
        return self.info.max_len if self.info is not None else 0

    # -- stop / regenerate ----------------------------------------------------------------

    async def action_stop(self) -> None:
        pane = self.current_pane()
        if pane is not None:
            await self.streams.stop(pane)

    async def action_regenerate(self) -> None:
        pane = self.current_pane()
        if pane is not None:
            await self.streams.regenerate(pane)

    def on_stats_snapshot(self, msg: StatsSnapshot) -> None:
        self.streams.show_stats(msg)

    # -- quitting --------------------------------------------------------------------------

    async def action_quit(self) -> None:
        if self._quitting:
            return
        self._quitting = True
        await self.streams.stop_all()
        await asyncio.to_thread(self._close_client)
        self.store.close()
        self.exit(return_code=1 if self.load_error else 0)

    def on_unmount(self) -> None:
        # Also reached when the app ends some other way; nothing here may lose text.
        sys.setswitchinterval(self._switch_interval)
        self.store.close()
        self._close_client()


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
