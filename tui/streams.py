"""The chat app's requests: sending a pane's message, reading its reply's stream, the
frame that shows what streamed, and the engine's stats and health.

Each request is read from the client's stream (`EngineClient.generate`) by a task on the
app's event loop, as the server reads its requests: no thread or queue of the app's own.
A stream is read once a frame, at its start, so everything the engine produced for a
request since the last read arrives as one piece and is shown by that same frame.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from minivllm.frontend import GenerateRequest, RequestOutput

from .context import fit_context
from .conversation import FINISH_TO_STATUS, Status
from .messages import StatsSnapshot
from .widgets.pane import ConversationPane

if TYPE_CHECKING:
    from .app import ChatApp

FRAME_HZ = 30  # frames a second: streams are read and new text is shown at most this often
LAGS_KEPT = 10_000  # frame lags kept for the bench (`RequestStreams.frame_lags`)
# A pane with only a little new text (under SHOW_CHARS, as at a CPU's speed: a token or two a
# frame) waits until its oldest new token is SHOW_WITHIN old: a repaint costs the same for
# one token as for a line of them.
SHOW_WITHIN = 0.05
SHOW_CHARS = 40


class RequestStreams:
    """Every live request of the app's panes, from submission to its pane's last text."""

    def __init__(self, app: ChatApp) -> None:
        self.app = app
        self._requests: dict[int, ConversationPane] = {}
        self._no_tokens_yet: list[int] = []  # accepted requests without output, FCFS
        self._last_stats: object = None
        self._next_request = 1
        # Frames shown so far, and for each pane's new text how long after the engine
        # produced its oldest token it was shown (seconds; the bench reports them).
        self.frames = 0
        self.frame_lags: deque[float] = deque(maxlen=LAGS_KEPT)
        # One event per request stream, set as a frame starts (the streams read then) and
        # by the stream itself when its request ends (the pane ends without waiting).
        self._wakes: set[asyncio.Event] = set()

    # -- sending -----------------------------------------------------------------------

    async def send(self, pane: ConversationPane, text: str) -> bool:
        """A user message (no command) for `pane`. Returns whether it was sent."""
        app = self.app
        if pane.busy:
            app.notify(f"pane #{pane.number} is still replying (Esc stops it)",
                       severity="warning")
            return False
        if app.engine_dead is not None:
            app.notify(f"the engine is not running: {app.engine_dead}", severity="error",
                       markup=False)
            return False
        app.store.user(pane.conversation.key, text)  # on disk before it is submitted
        pane.add_user(text)
        await self.submit(pane)
        return True

    async def submit(self, pane: ConversationPane) -> None:
        """Ask for a reply to the pane's conversation as it stands."""
        app = self.app
        request_id = self._next_request
        self._next_request += 1
        pane.begin_reply(request_id)
        try:
            params = pane.conversation.settings.sampling_params()
        except ValueError as exc:
            await self.finish(pane, request_id, "error", str(exc))
            return
        await fit_context(pane, app.tokenizer, app.max_len, app.store)
        if app.client is None or app.engine_dead is not None:
            await self.finish(pane, request_id, "error",
                              app.engine_dead or "the engine is not ready")
            return
        self._requests[request_id] = pane
        thinking = pane.conversation.settings.thinking
        request = GenerateRequest(
            str(request_id), params, messages=pane.conversation.template_messages(),
            chat_template_kwargs={} if thinking is None else {"enable_thinking": thinking})
        # The request is queued now; a worker reads its stream.
        stream = app.client.generate(request)
        app.run_worker(self._stream(pane, request_id, stream), name=f"request {request_id}",
                       group="requests", exit_on_error=False)

    # -- stop / regenerate ----------------------------------------------------------------

    async def stop(self, pane: ConversationPane) -> None:
        """Stop the pane's reply: the engine ends it and its stream says so."""
        if not pane.busy or pane.request_id is None:
            return
        client = self.app.client
        if client is None or client.error is not None:
            await self.finish(pane, pane.request_id, "stopped")
            return
        pane.set_state(pane.state, "stopping")
        self.abort(pane.request_id)

    async def regenerate(self, pane: ConversationPane) -> None:
        """Ask again for the last reply (once the one streaming has stopped)."""
        if pane.conversation.last_user_index() is None:
            return
        if pane.busy:
            pane.regenerate_after_stop = True
            await self.stop(pane)
            return
        await self._regenerate(pane)

    async def _regenerate(self, pane: ConversationPane) -> None:
        if self.app.engine_dead is not None:
            return
        self.app.store.regenerate(pane.conversation.key)
        await pane.drop_last_reply()
        await self.submit(pane)

    def cancel(self, pane: ConversationPane) -> None:
        """Drop a pane's live request (its reply is going away with the pane's text)."""
        if pane.request_id is not None:
            self._requests.pop(pane.request_id, None)
            self.abort(pane.request_id)

    def abort(self, request_id: int) -> None:
        if self.app.client is not None:
            self.app.client.abort(str(request_id))

    async def stop_all(self) -> None:
        """Every reply ends as stopped, its text kept (the app is quitting)."""
        for pane in self.app.panes:
            if pane.request_id is not None:
                await self.finish(pane, pane.request_id, "stopped")

    # -- engine results --------------------------------------------------------------------

    async def _stream(self, pane: ConversationPane, request_id: int,
                      stream: AsyncIterator[RequestOutput]) -> None:
        """Read one request's stream into its pane until it ends.

        After the first tokens the stream is read once a frame, as the frame starts: what
        the engine produced meanwhile comes as one merged output (one wake-up of this loop
        per frame, whatever the engine's step rate) and that frame shows it. The first
        tokens are taken at once, so a pane's TTFT is the engine's, and so is the last
        output (the stream's `on_end`): the pane ends without waiting for a frame."""
        streaming = False
        wake = asyncio.Event()
        self._wakes.add(wake)
        # The protocol asks only for an async iterator; the project's clients' streams
        # (in-process, engine process, remote) all have `on_end`.
        on_end = getattr(stream, "on_end", None)
        if on_end is not None:
            on_end(wake.set)
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
                    await wake.wait()
                    wake.clear()
        except Exception as exc:  # noqa: BLE001 - a broken client fails this request only
            if self._requests.get(request_id) is pane:
                await self.finish(pane, request_id, "error", f"{type(exc).__name__}: {exc}")
        finally:
            self._wakes.discard(wake)
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
        if out.num_prompt_tokens and self.app.max_len:
            # The engine's count (a remote server's too, where the app has no tokenizer
            # to count with); `finish` adds the reply's tokens.
            pane.context_tokens = out.num_prompt_tokens
            pane.max_len = self.app.max_len
        status, error = _status(out), out.error
        if status == "stopped" and pane.state_detail != "stopping":
            # Not this app's Esc: the engine or the server ended the reply.
            status = "error"
            error = error or ("the engine stopped this reply (a server that is shutting "
                              "down, or went away)")
        await self.finish(pane, request_id, status, error)

    async def finish(self, pane: ConversationPane, request_id: int, status: Status,
                     error: str | None = None) -> None:
        """End the pane's reply: saved, shown with its status, regenerated if asked."""
        app = self.app
        self._requests.pop(request_id, None)
        if request_id in self._no_tokens_yet:
            self._no_tokens_yet.remove(request_id)
        message = await pane.finish(status, error)
        app.store.end(pane.conversation.key, status, message.content, error)
        app.pane_control.settle_when_idle()
        if status == "error":
            app.notify(f"pane #{pane.number}: {error}", severity="error", markup=False)
        if pane.regenerate_after_stop:
            pane.regenerate_after_stop = False
            await self._regenerate(pane)

    # -- the engine's state ----------------------------------------------------------------

    async def poll_engine(self) -> None:
        """A few times a second: the client's latest stats snapshot for the panel, and
        whether the engine stopped for good."""
        app = self.app
        client = app.client
        if client is None or app.client_closed:
            return
        if client.error is not None and app.engine_dead is None:
            await self._engine_died(client.error)
            return
        away = getattr(client, "disconnected", None)  # a server whose /metrics fails
        if app.chat is not None:
            app.chat.stats_panel.show_disconnected(away)
        if away:
            return
        stats = client.stats()
        if stats is not None and stats is not self._last_stats:
            self._last_stats = stats
            self.show_stats(StatsSnapshot(stats, time.monotonic()))

    def show_stats(self, msg: StatsSnapshot) -> None:
        """The panel's figures, and which panes' requests still wait for the engine."""
        app = self.app
        rates = app.history.add(msg.at, msg.stats)
        if app.chat is None:
            return
        app.chat.stats_panel.show(msg.stats, rates, app.history.spark_data())
        # FCFS: the newest accepted requests without output are the ones still waiting.
        waiting = min(msg.stats.num_waiting, len(self._no_tokens_yet))
        queued = set(self._no_tokens_yet[len(self._no_tokens_yet) - waiting:])
        for pane in app.panes:
            if pane.request_id is not None:
                pane.set_queued(pane.request_id in queued)

    async def _engine_died(self, error: str) -> None:
        """The engine stopped for good: every pane says so, its text kept."""
        app = self.app
        app.engine_dead = error
        for pane in app.panes:
            if pane.request_id is not None:
                await self.finish(pane, pane.request_id, "error", error)
            await pane.show_error(f"engine stopped: {error}")
            pane.set_state("error", "engine stopped")
            pane.refresh_title()
        app.notify(f"the engine stopped: {error}", severity="error", markup=False,
                   timeout=30)

    # -- the frame -------------------------------------------------------------------------

    async def frame(self) -> None:
        """Show every pane's new text (one repaint each), at most FRAME_HZ times a second."""
        self.frames += 1
        for wake in self._wakes:
            wake.set()
        await asyncio.sleep(0)  # the streams it woke read what the engine sent since
        app = self.app
        progress = getattr(app.client, "prompt_progress", None)  # a remote has none
        now = time.monotonic()
        panes = app.panes
        for pane in panes:
            if progress is not None and pane.state in ("queued", "prefill") \
                    and pane.request_id is not None:
                pane.set_prefill_progress(progress(str(pane.request_id)))
        for pane in panes:
            oldest = pane.pending_since
            if (oldest is not None and now - oldest < SHOW_WITHIN
                    and pane.pending_chars < SHOW_CHARS):
                continue  # a token or two: shown with the next ones, still within SHOW_WITHIN
            text = pane.flush()
            if text:
                if oldest is not None:
                    self.frame_lags.append(now - oldest)
                app.store.chunk(pane.conversation.key, text)


def _status(out: RequestOutput) -> Status:
    return FINISH_TO_STATUS.get(out.finish_reason, "done")
