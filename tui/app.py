"""The chat app: wires panes, the engine thread and the session file together.

`create_app(engine=...)` (tests, benchmarks) or `create_app(engine_factory=...)` (the
CLI: the engine is built on the engine thread behind a loading screen).
"""

from __future__ import annotations

import asyncio
import copy
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from .commands import chat_commands
from .conversation import FINISH_TO_STATUS, Conversation, Settings, Status
from .engine_thread import EngineFactory, EngineWorker, engine_info
from .keys import enable_alt_digits
from .messages import (
    DeltaBatch,
    EngineDied,
    EngineInfo,
    EngineReady,
    LoadFailed,
    LoadProgress,
    RequestAccepted,
    RequestFailed,
    StatsSnapshot,
)
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
from .widgets.loading import LoadingScreen
from .widgets.pane import ConversationPane
from .widgets.settings_modal import SettingsModal

MAX_PANES = 9
FLUSH_HZ = 30
HELP = (
    "Enter sends · ctrl+j newline · Esc stops · alt+a or /all sends to every pane · "
    "ctrl+r regenerates · ctrl+n/ctrl+w new/close · alt+1..9 focus · ctrl+p commands · "
    "/think /no_think /system TEXT /clear"
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
        stats_interval: float = 0.25,
        save_sessions: bool = True,
    ) -> None:
        super().__init__()
        enable_alt_digits()
        self.worker = EngineWorker(
            self.post_message, engine=engine, engine_factory=engine_factory,
            owns_engine=owns_engine, stats_interval=stats_interval,
        )
        # With a built engine nothing else runs yet, so reading it here is safe.
        self.info: EngineInfo | None = engine_info(engine) if engine is not None else None
        self.model = model or (self.info.model if self.info else "?")
        self.default_settings = settings or Settings()
        self.data_root = data_root or data_dir()
        self.export_dir = export_dir or Path.cwd()
        self._keymap = dict(keymap or {})
        self.history = StatsHistory()
        self.active_pane: ConversationPane | None = None
        self.chat: ChatScreen | None = None
        self.loading: LoadingScreen | None = None
        self.engine_dead: str | None = None
        self._requests: dict[int, ConversationPane] = {}
        self._next_request = 1
        self._quitting = False
        self.save_sessions = save_sessions
        self.store, conversations_ = self._open_session(resume, conversations)
        self._next_key = max((c.key for c in conversations_), default=0) + 1
        self._initial = conversations_

    # -- session -----------------------------------------------------------------------

    def _open_session(self, resume: bool | Path, n: int) -> tuple[SessionStore, list[Conversation]]:
        self.resume_note = ""
        path = resume if isinstance(resume, Path) else (
            latest_session(self.data_root) if resume else None
        )
        if path is not None:
            loaded = load_session(path)
            store = SessionStore(path)
            for key in loaded.interrupted:  # close the open replies in the file too
                conv = next(c for c in loaded.conversations if c.key == key)
                store.end(key, "interrupted", conv.messages[-1].content)
            if loaded.skipped_lines:
                self.resume_note = f"skipped {loaded.skipped_lines} unreadable line(s)"
            if loaded.conversations:
                return store, loaded.conversations
        else:
            store = (SessionStore(new_session_path(self.data_root)) if self.save_sessions
                     else NullStore())
            if resume:
                self.resume_note = "no earlier session to resume"
        store.session(self.model)
        convs = [
            Conversation(k + 1, copy.deepcopy(self.default_settings)) for k in range(max(1, n))
        ]
        for c in convs:
            store.pane(c.key, c.settings)
        return store, convs

    # -- start-up ----------------------------------------------------------------------

    def on_mount(self) -> None:
        # NOTE: the UI thread renders in pure Python; a shorter GIL switch interval lets
        # the engine thread back in sooner after each step's host work (measured: the
        # fake engine under three streaming panes finishes ~25% sooner).
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, 0.001))
        if self._keymap:
            self.set_keymap(self._keymap)
        self.worker.start()
        if self.info is not None:
            self._show_chat(self.info)
        else:
            self.loading = LoadingScreen(self.model)
            self.push_screen(self.loading)
        self.set_interval(1 / FLUSH_HZ, self._flush_panes)
        self.set_interval(1.0, self.store.flush_partial)
        if self.resume_note:
            self.notify(self.resume_note, markup=False)

    def _show_chat(self, info: EngineInfo) -> None:
        self.info = info
        panes = [ConversationPane(c, i + 1) for i, c in enumerate(self._initial)]
        self.chat = ChatScreen(info, panes)
        if self.loading is not None:
            self.switch_screen(self.chat)
            self.loading = None
        else:
            self.push_screen(self.chat)

    def on_load_progress(self, msg: LoadProgress) -> None:
        if self.loading is not None:
            self.loading.progress(msg.stage, msg.fraction)

    def on_engine_ready(self, msg: EngineReady) -> None:
        if self.chat is None:
            self._show_chat(msg.info)

    def on_load_failed(self, msg: LoadFailed) -> None:
        self.engine_dead = msg.error
        if self.loading is not None:
            self.loading.failed(msg.error)

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
        pane = self.current_pane()
        panes = self.panes
        if pane is None:
            return
        if len(panes) == 1:
            self.notify("this is the last pane (ctrl+q quits)", severity="warning")
            return
        self._cancel_request(pane)
        self.store.close_pane(pane.conversation.key)
        index = panes.index(pane)
        await pane.remove()
        rest = self.panes
        for i, p in enumerate(rest):
            p.renumber(i + 1)
        self._focus(rest[min(index, len(rest) - 1)])

    def _cancel_request(self, pane: ConversationPane) -> None:
        """Drop a pane's live request (its reply is going away with the pane's text)."""
        if pane.request_id is not None:
            self._requests.pop(pane.request_id, None)
            self.worker.abort(pane.request_id)

    async def action_clear(self) -> None:
        pane = self.current_pane()
        if pane is None:
            return
        self._cancel_request(pane)
        pane.request_id = None
        self.store.clear(pane.conversation.key)
        await pane.clear()

    def action_export(self) -> None:
        pane = self.current_pane()
        if pane is None:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.export_dir / f"minivllm-chat-{stamp}-pane{pane.number}.md"
        try:
            path.write_text(pane.conversation.to_markdown(f"minivllm-chat · pane #{pane.number}"),
                            encoding="utf-8")
        except OSError as exc:
            self.notify(f"export failed: {exc}", severity="error", markup=False)
            return
        self.last_export = path
        self.notify(f"exported to {path}", markup=False)

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

    def _set_thinking(self, pane: ConversationPane, on: bool) -> None:
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
            handled, text = await self._slash_command(pane, text)
            if handled:
                return True
        if pane.busy:
            self.notify(f"pane #{pane.number} is still replying (Esc stops it)",
                        severity="warning")
            return False
        if self.engine_dead is not None:
            self.notify(f"the engine is not running: {self.engine_dead}", severity="error",
                        markup=False)
            return False
        self.store.user(pane.conversation.key, text)  # on disk before it is submitted
        await pane.add_user(text)
        await self._submit(pane)
        return True

    async def _slash_command(self, pane: ConversationPane, text: str) -> tuple[bool, str]:
        """Returns (handled, text to send). `/all X`, `/think [X]`, `/no_think [X]`,
        `/system [TEXT]`, `/clear`, `/help`; anything else is sent as typed."""
        word, _, rest = text.partition(" ")
        rest = rest.strip()
        if word == "/all" and rest:
            await self.broadcast(rest)
            return True, ""
        if word in ("/think", "/no_think"):
            self._set_thinking(pane, word == "/think")
            return (not rest), rest
        if word == "/system":
            if rest:
                new = copy.deepcopy(pane.conversation.settings)
                new.system_prompt = rest
                self._apply_settings(pane, new)
                self.notify(f"pane #{pane.number}: system prompt set")
            else:
                self.action_settings("system")
            return True, ""
        if word == "/clear":
            self._focus(pane)
            await self.action_clear()
            return True, ""
        if word == "/help":
            self.notify(HELP, timeout=10)
            return True, ""
        return False, text

    async def _submit(self, pane: ConversationPane) -> None:
        request_id = self._next_request
        self._next_request += 1
        await pane.begin_reply(request_id)
        try:
            params = pane.conversation.settings.sampling_params()
        except ValueError as exc:
            await self._finish(pane, request_id, "error", str(exc))
            return
        self._requests[request_id] = pane
        self.worker.submit(request_id, pane.conversation.template_messages(), params,
                           pane.conversation.settings.thinking)

    # -- stop / regenerate ----------------------------------------------------------------

    async def action_stop(self) -> None:
        pane = self.current_pane()
        if pane is None or not pane.busy or pane.request_id is None:
            return
        if not self.worker.alive:
            await self._finish(pane, pane.request_id, "stopped")
            return
        pane.set_state(pane.state, "stopping")
        self.worker.abort(pane.request_id)

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

    def on_request_accepted(self, msg: RequestAccepted) -> None:
        pane = self._requests.get(msg.request_id)
        if pane is not None:
            pane.accepted(msg.opens_thinking)

    async def on_request_failed(self, msg: RequestFailed) -> None:
        pane = self._requests.get(msg.request_id)
        if pane is not None:
            await self._finish(pane, msg.request_id, "error", msg.error)

    async def on_delta_batch(self, msg: DeltaBatch) -> None:
        for d in msg.deltas:
            pane = self._requests.get(d.request_id)
            if pane is None:
                continue
            pane.feed(d.text, d.num_tokens, d.first_at or msg.at, d.last_at or msg.at)
            if d.finished:
                status = FINISH_TO_STATUS.get(d.finish_reason, "done")
                await self._finish(pane, d.request_id, status, d.error)

    async def _finish(self, pane: ConversationPane, request_id: int, status: Status,
                      error: str | None = None) -> None:
        self._requests.pop(request_id, None)
        message = await pane.finish(status, error)
        self.store.end(pane.conversation.key, status, message.content, error)
        if status == "error":
            self.notify(f"pane #{pane.number}: {error}", severity="error", markup=False)
        if pane.regenerate_after_stop:
            pane.regenerate_after_stop = False
            await self._regenerate(pane)

    def on_stats_snapshot(self, msg: StatsSnapshot) -> None:
        rates = self.history.add(msg.at, msg.stats)
        if self.chat is None:
            return
        self.chat.stats_panel.show(msg.stats, rates, self.history.spark_data())
        for pane in self.panes:
            if pane.request_id is not None:
                pane.set_queued(pane.request_id in msg.queued)

    async def on_engine_died(self, msg: EngineDied) -> None:
        self.engine_dead = msg.error
        for pane in self.panes:
            if pane.request_id is not None:
                await self._finish(pane, pane.request_id, "error", msg.error)
            await pane.show_error(f"engine stopped: {msg.error}")
            pane.set_state("error", "engine stopped")
            pane.refresh_title()
        self.notify(f"the engine stopped: {msg.error}", severity="error", markup=False,
                    timeout=30)

    async def _flush_panes(self) -> None:
        for pane in self.panes:
            text = await pane.flush()
            if text:
                self.store.chunk(pane.conversation.key, text)

    # -- quitting --------------------------------------------------------------------------

    async def action_quit(self) -> None:
        if self._quitting:
            return
        self._quitting = True
        for pane in self.panes:
            if pane.request_id is not None:
                await self._finish(pane, pane.request_id, "stopped")
        await asyncio.to_thread(self.worker.stop)
        self.store.close()
        self.exit()

    def on_unmount(self) -> None:
        # Also reached when the app ends some other way; nothing here may lose text.
        sys.setswitchinterval(self._switch_interval)
        self.store.close()
        if self.worker.alive:
            self.worker.stop(timeout=5)


def create_app(engine: Any = None, **options: Any) -> ChatApp:
    """The app around a built engine (`engine=`) or one built behind a loading screen
    (`engine_factory=on_progress -> engine`). Options: see `ChatApp`."""
    return ChatApp(engine=engine, **options)
