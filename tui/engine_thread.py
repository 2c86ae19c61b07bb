"""The app's bridge to an `EngineClient` (an engine in this process, or a server).

The engine loop itself lives in `minivllm.frontend.EngineFrontend` (shared with
`minivllm serve`). This thread builds or connects the client behind the loading screen,
turns the app's commands into requests, and turns the client's outputs into the UI's
messages (`messages.py`): deltas merged per request and posted at most 60 times a second,
a stats snapshot a few times a second, `EngineDied` if the engine stops for good.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minivllm.frontend import (
    EngineClient,
    EngineFrontend,
    GenerateRequest,
    RequestOutput,
    engine_info,
    merge_outputs,
    render_chat_prompt,
)

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

__all__ = ["EngineFactory", "EngineWorker", "engine_info", "render_prompt"]

# Builds an LLMEngine (or any engine with its API), or returns an unstarted EngineClient
# (`--url`: a remote server).
EngineFactory = Callable[[Callable[[str, float], None]], Any]
Post = Callable[[Any], Any]


@dataclass(frozen=True)
class _Submit:
    request_id: int
    messages: list[dict[str, str]]
    params: Any
    enable_thinking: bool | None


@dataclass(frozen=True)
class _Abort:
    request_id: int


class _Quit:
    pass


class _Stats:
    pass


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def render_prompt(
    tokenizer: Any, messages: list[dict[str, str]], enable_thinking: bool | None
) -> str:
    """The chat template over the whole history, ending with the assistant's turn."""
    return render_chat_prompt(tokenizer, messages, enable_thinking=enable_thinking)


def _is_client(obj: Any) -> bool:
    return isinstance(obj, EngineClient)


class EngineWorker:
    """The app's engine, served by a thread. Every public method is safe from any thread.

    Give one of: a built `engine` (wrapped in an `EngineFrontend`), an
    `engine_factory(on_progress)` called on this thread (it may return an engine or an
    unstarted `EngineClient`), or a `client`. `owns_engine` decides whether stopping
    calls `engine.exit()` (default: when the engine was built here).
    """

    def __init__(
        self,
        post: Post,
        *,
        engine: Any = None,
        engine_factory: EngineFactory | None = None,
        client: EngineClient | None = None,
        owns_engine: bool | None = None,
        stats_interval: float = 0.25,
        delta_interval: float = 1 / 60,
        idle_wait: float = 0.05,
    ) -> None:
        if sum(x is not None for x in (engine, engine_factory, client)) != 1:
            raise ValueError("give exactly one of engine=, engine_factory= and client=")
        self._post = post
        self.engine = engine
        self._factory = engine_factory
        self.client: EngineClient | None = client
        self._owns = owns_engine if owns_engine is not None else engine is None
        self._stats_interval = stats_interval
        self._delta_interval = delta_interval
        self._idle_wait = idle_wait
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()  # commands and outputs
        self._thread = threading.Thread(target=self._run, name="minivllm-ui-bridge", daemon=True)
        # Bridge-thread state.
        self._live: set[int] = set()
        self._no_tokens_yet: list[int] = []  # accepted requests without output, FCFS
        # Outputs are merged per request and posted at most every `delta_interval`: one UI
        # message per step would cost the UI (and, through the GIL, the engine) more than
        # the text is worth.
        self._outbox: dict[int, list[RequestOutput]] = {}
        self._next_post = 0.0
        self.died: str | None = None

    # -- UI side -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self,
        request_id: int,
        messages: list[dict[str, str]],
        params: Any,
        enable_thinking: bool | None = None,
    ) -> None:
        self._commands.put(_Submit(request_id, messages, params, enable_thinking))

    def abort(self, request_id: int) -> None:
        self._commands.put(_Abort(request_id))

    def request_stats(self) -> None:
        self._commands.put(_Stats())

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything, stop the loop and wait for the thread (and engine exit)."""
        self._commands.put(_Quit())
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- bridge thread -------------------------------------------------------------------

    def _run(self) -> None:
        client = None
        try:
            try:
                client = self._connect()
            except BaseException as exc:  # noqa: BLE001 - reported to the UI
                self.died = _describe(exc)
                self._post(LoadFailed(self.died + "\n" + traceback.format_exc()))
                return
            self._serve(client)
        except BaseException as exc:  # noqa: BLE001 - the UI must hear about it
            self.died = _describe(exc)
            self._post(EngineDied(self.died))
        finally:
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001 - already shutting down
                    pass

    def _connect(self) -> EngineClient:
        client = self.client
        if client is None:
            engine = self.engine
            if engine is None:
                assert self._factory is not None
                built = self._factory(self._on_progress)
                if _is_client(built):
                    client = built
                else:
                    engine = self.engine = built
            if client is None:
                client = EngineFrontend(engine, owns_engine=self._owns)
            self.client = client
        info = client.start(self._on_progress)
        self._post(EngineReady(info))
        return client

    def _on_progress(self, stage: str, fraction: float) -> None:
        self._post(LoadProgress(str(stage), float(fraction)))

    def _serve(self, client: EngineClient) -> None:
        next_stats = 0.0
        while True:
            now = time.monotonic()
            wait = min(next_stats - now, self._idle_wait)
            if self._outbox:
                wait = min(wait, self._next_post - now)
            want_stats = False
            for item in self._drain(max(0.0, wait)):
                if isinstance(item, RequestOutput):
                    self._collect(item)
                elif isinstance(item, _Quit):
                    for req in list(self._live):
                        client.abort(str(req))
                    return
                elif isinstance(item, _Submit):
                    self._live.add(item.request_id)
                    kwargs = {}
                    if item.enable_thinking is not None:
                        kwargs["enable_thinking"] = item.enable_thinking
                    client.add_request(
                        GenerateRequest(str(item.request_id), item.params,
                                        messages=item.messages, chat_template_kwargs=kwargs),
                        self._commands.put,
                    )
                elif isinstance(item, _Abort):
                    if item.request_id in self._live:
                        client.abort(str(item.request_id))
                elif isinstance(item, _Stats):
                    want_stats = True
            now = time.monotonic()
            if self._outbox and (now >= self._next_post or not self._live):
                self._flush_outbox(now)
            if client.error is not None:
                # Outputs sent before the engine stopped still belong to their panes.
                for item in self._drain(0.0):
                    if isinstance(item, RequestOutput):
                        self._collect(item)
                self._flush_outbox(time.monotonic())
                self.died = client.error
                self._post(EngineDied(client.error))
                return
            if want_stats or now >= next_stats:
                self._post_stats(client, now)
                next_stats = now + self._stats_interval

    def _drain(self, wait: float) -> list[Any]:
        items: list[Any] = []
        try:
            if wait > 0:
                items.append(self._commands.get(timeout=wait))
            while True:
                items.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return items

    def _collect(self, out: RequestOutput) -> None:
        req = int(out.request_id)
        if req not in self._live:
            return
        if out.rejected:
            self._forget(req)
            self._post(RequestFailed(req, out.error or "the request was refused"))
            return
        if out.accepted:
            self._no_tokens_yet.append(req)
            self._post(RequestAccepted(req, -1, out.opens_thinking))
            if not (out.text or out.token_ids or out.finished):
                return
        self._outbox.setdefault(req, []).append(out)
        if req in self._no_tokens_yet and (out.token_ids or out.text):
            self._no_tokens_yet.remove(req)
            # The first tokens go out at once: the pane's TTFT is their `at`, not that
            # of the end of a batching interval.
            self._flush_outbox(time.monotonic())
        elif out.finished:
            self._flush_outbox(time.monotonic())
        if out.finished:
            self._forget(req)

    def _flush_outbox(self, now: float) -> None:
        if self._outbox:
            self._post(DeltaBatch([merge_outputs(o) for o in self._outbox.values()], now))
            self._outbox = {}
        self._next_post = now + self._delta_interval

    def _post_stats(self, client: EngineClient, now: float) -> None:
        stats = client.stats()
        if stats is None:
            return
        waiting = min(stats.num_waiting, len(self._no_tokens_yet))
        # FCFS: the newest accepted requests without output are the ones still waiting.
        queued = frozenset(self._no_tokens_yet[len(self._no_tokens_yet) - waiting:])
        self._post(StatsSnapshot(stats, now, queued))

    def _forget(self, req: int) -> None:
        self._live.discard(req)
        if req in self._no_tokens_yet:
            self._no_tokens_yet.remove(req)
