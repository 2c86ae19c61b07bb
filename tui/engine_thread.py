"""The one thread that owns the engine.

The engine is not thread-safe, so only this thread calls `add_prompt`, `step`,
`pop_deltas`, `abort` and `stats`. The UI sends commands through a queue and gets
results back as posted messages (`messages.py`). Loop: drain commands; step if any
request is live (else wait on the queue briefly); pop deltas and post them; post a stats
snapshot a few times a second.

Failure policy: a bad request (add_prompt raises) fails only that request; an exception
from `step()` fails the requests that were live and the loop keeps serving; if the loop
itself dies, `EngineDied` is posted so every pane can say so.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .messages import (
    DeltaBatch,
    EngineDied,
    EngineInfo,
    EngineReady,
    LoadFailed,
    LoadProgress,
    RequestAccepted,
    RequestDelta,
    RequestFailed,
    StatsSnapshot,
)

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


def engine_info(engine: Any) -> EngineInfo:
    """Read what the header shows. Call on the engine thread (it calls `stats()`)."""
    cfg = engine.config
    stats = engine.stats()
    dtype = str(getattr(engine, "dtype", "?")).replace("torch.", "")
    return EngineInfo(
        model=str(getattr(cfg, "model_name_or_path", "?")),
        device=str(getattr(engine, "device", getattr(cfg, "device", "?"))),
        dtype=dtype,
        world_size=int(getattr(cfg, "world_size", 1)),
        block_size=int(stats.block_size),
        num_blocks=int(stats.num_blocks),
        max_len=int(getattr(cfg, "max_len", 0) or 0),
    )


def render_prompt(
    tokenizer: Any, messages: list[dict[str, str]], enable_thinking: bool | None
) -> str:
    """The chat template over the whole history, ending with the assistant's turn."""
    kwargs: dict[str, Any] = {}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )


class EngineWorker:
    """Runs the engine on its own thread. Every public method is safe from any thread.

    Give it either a built `engine`, or an `engine_factory(on_progress)` that builds one on
    this thread (so the UI can show a loading screen). `owns_engine` decides whether the
    thread calls `engine.exit()` when it stops (default: when it built the engine).
    """

    def __init__(
        self,
        post: Post,
        *,
        engine: Any = None,
        engine_factory: EngineFactory | None = None,
        owns_engine: bool | None = None,
        stats_interval: float = 0.25,
        delta_interval: float = 1 / 60,
        idle_wait: float = 0.05,
    ) -> None:
        if (engine is None) == (engine_factory is None):
            raise ValueError("give exactly one of engine= and engine_factory=")
        self._post = post
        self.engine = engine
        self._factory = engine_factory
        self._owns = owns_engine if owns_engine is not None else engine is None
        self._stats_interval = stats_interval
        self._delta_interval = delta_interval
        self._idle_wait = idle_wait
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        # Engine-thread state.
        self._seq_of: dict[int, int] = {}  # request id -> seq id, for live requests
        self._req_of: dict[int, int] = {}  # seq id -> request id
        self._no_tokens_yet: list[int] = []  # accepted requests without output, FCFS
        # Deltas are merged per request and posted at most every `delta_interval`: one
        # UI message per step would cost the UI (and, through the GIL, the engine) more
        # than the text is worth.
        self._outbox: dict[int, RequestDelta] = {}
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

    # -- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.engine is None:
                try:
                    self.engine = self._factory(self._on_progress)
                except BaseException as exc:  # noqa: BLE001 - reported to the UI
                    self.died = _describe(exc)
                    self._post(LoadFailed(self.died + "\n" + traceback.format_exc()))
                    return
            self._post(EngineReady(engine_info(self.engine)))
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the UI must hear about it
            self.died = _describe(exc)
            self._post(EngineDied(self.died))
        finally:
            if self._owns and self.engine is not None:
                try:
                    self.engine.exit()
                except Exception:  # noqa: BLE001 - already shutting down
                    pass

    def _on_progress(self, stage: str, fraction: float) -> None:
        self._post(LoadProgress(str(stage), float(fraction)))

    def _serve(self) -> None:
        engine = self.engine
        next_stats = 0.0
        while True:
            busy = bool(self._seq_of)
            wait = 0.0 if busy else max(0.0, min(self._idle_wait, next_stats - time.monotonic()))
            commands = self._drain(wait)
            want_stats = False
            for cmd in commands:
                if isinstance(cmd, _Quit):
                    self._abort_all()
                    return
                if isinstance(cmd, _Submit):
                    self._handle_submit(cmd)
                elif isinstance(cmd, _Abort):
                    seq = self._seq_of.get(cmd.request_id)
                    if seq is not None:
                        try:
                            engine.abort(seq)
                        except Exception:  # noqa: BLE001 - it may have just finished
                            pass
                elif isinstance(cmd, _Stats):
                    want_stats = True
            if self._seq_of:
                try:
                    engine.step()
                except Exception as exc:  # noqa: BLE001 - fail the live requests, keep serving
                    self._fail_live(_describe(exc))
            if self._seq_of or commands:
                self._collect(engine.pop_deltas())
            now = time.monotonic()
            if self._outbox and (now >= self._next_post or not self._seq_of):
                self._flush_outbox(now)
            if want_stats or now >= next_stats:
                self._post_stats(now)
                next_stats = now + self._stats_interval

    def _drain(self, wait: float) -> list[Any]:
        commands: list[Any] = []
        try:
            if wait > 0:
                commands.append(self._commands.get(timeout=wait))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _handle_submit(self, cmd: _Submit) -> None:
        engine = self.engine
        try:
            prompt = render_prompt(engine.tokenizer, cmd.messages, cmd.enable_thinking)
            seq = engine.add_prompt(prompt, cmd.params)
        except Exception as exc:  # noqa: BLE001 - bad input goes back to its pane
            self._post(RequestFailed(cmd.request_id, _describe(exc)))
            return
        self._seq_of[cmd.request_id] = seq
        self._req_of[seq] = cmd.request_id
        self._no_tokens_yet.append(cmd.request_id)
        opens = prompt.rstrip().endswith("<think>")
        self._post(RequestAccepted(cmd.request_id, seq, opens))

    def _collect(self, deltas: list[Any]) -> None:
        now = time.monotonic()
        finished = False
        for d in deltas:
            req = self._req_of.get(d.seq_id)
            if req is None:
                continue  # already failed and reported
            if req in self._no_tokens_yet and (d.token_ids or d.text):
                self._no_tokens_yet.remove(req)
            old = self._outbox.get(req)
            self._outbox[req] = RequestDelta(
                req,
                (old.text if old else "") + d.text,
                (old.num_tokens if old else 0) + len(d.token_ids),
                d.finished,
                d.finish_reason,
                getattr(d, "error", None),
                first_at=old.first_at if old else now,
                last_at=now,
            )
            if d.finished:
                finished = True
                self._forget(req)
        if finished:
            self._flush_outbox(now)

    def _flush_outbox(self, now: float) -> None:
        if self._outbox:
            self._post(DeltaBatch(list(self._outbox.values()), now))
            self._outbox = {}
        self._next_post = now + self._delta_interval

    def _post_stats(self, now: float) -> None:
        stats = self.engine.stats()
        waiting = min(stats.num_waiting, len(self._no_tokens_yet))
        # FCFS: the newest accepted requests without output are the ones still waiting.
        queued = frozenset(self._no_tokens_yet[len(self._no_tokens_yet) - waiting:])
        self._post(StatsSnapshot(stats, now, queued))

    def _forget(self, req: int) -> None:
        seq = self._seq_of.pop(req, None)
        if seq is not None:
            self._req_of.pop(seq, None)
        if req in self._no_tokens_yet:
            self._no_tokens_yet.remove(req)

    def _fail_live(self, error: str) -> None:
        """A step raised: the live requests fail (their panes say why); free their blocks."""
        # Deltas produced before the failure still belong to their panes.
        try:
            self._collect(self.engine.pop_deltas())
            self._flush_outbox(time.monotonic())
        except Exception:  # noqa: BLE001
            pass
        for req, seq in list(self._seq_of.items()):
            try:
                self.engine.abort(seq)
            except Exception:  # noqa: BLE001 - the engine may be past caring
                pass
            self._forget(req)
            self._post(RequestFailed(req, f"engine step failed: {error}"))
        try:
            self.engine.pop_deltas()  # drop the abort deltas of the failed requests
        except Exception:  # noqa: BLE001
            pass

    def _abort_all(self) -> None:
        for req, seq in list(self._seq_of.items()):
            try:
                self.engine.abort(seq)
            except Exception:  # noqa: BLE001
                pass
            self._forget(req)
