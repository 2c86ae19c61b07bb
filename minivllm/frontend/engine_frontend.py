"""`EngineFrontend`: an engine in this process, owned by one thread, as an `EngineClient`.

The engine is not thread-safe, so only the front end's thread calls `add_prompt`, `step`,
`pop_deltas`, `abort` and `stats`. Callers on any thread queue commands; the thread
drains them, steps while any request is live, turns the engine's deltas into
per-request `RequestOutput`s (calling each request's callback) and publishes a stats
snapshot a few times a second.

Failure policy: a bad request (add_prompt raises) is rejected alone; an exception from
`step()` fails the requests that were live and the loop keeps serving; if the loop itself
dies, every live request gets an error output and `error` says why.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..heap import settle
from ..outputs import EngineStats
from .outputs import stream_outputs
from .protocol import (
    EngineInfo,
    GenerateRequest,
    OutputCallback,
    ProgressFn,
    RequestOutput,
    render_chat_prompt,
)

EngineFactory = Callable[[ProgressFn], Any]


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def dtype_label(engine: Any) -> str:
    """The compute dtype, and the CPU's weight-only format, prefill dtype and decode
    activations where they differ from it ("float32, q4_1/q8_0 weights, bfloat16 prefill,
    int8 decode")."""
    dtype = str(getattr(engine, "dtype", "?")).replace("torch.", "")
    label = [dtype]
    weights = getattr(engine, "cpu_weight_format", None)
    if weights:
        label.append(f"{weights} weights")
    prefill = getattr(engine, "cpu_prefill_dtype", None)
    if prefill is not None:
        label.append(f"{str(prefill).replace('torch.', '')} prefill")
    decode = getattr(engine, "cpu_decode_dtype", None)
    if decode is not None:
        label.append(f"{decode} decode")
    return ", ".join(label)


def engine_info(engine: Any) -> EngineInfo:
    """What a header shows. Call where the engine may be touched (it calls `stats()`)."""
    cfg = engine.config
    stats = engine.stats()
    return EngineInfo(
        model=str(getattr(cfg, "model_name_or_path", "?")),
        device=str(getattr(engine, "device", getattr(cfg, "device", "?"))),
        dtype=dtype_label(engine),
        world_size=int(getattr(cfg, "world_size", 1)),
        block_size=int(stats.block_size),
        num_blocks=int(stats.num_blocks),
        max_len=int(getattr(cfg, "max_len", 0) or 0),
    )


@dataclass(frozen=True)
class _Add:
    request: GenerateRequest
    on_output: OutputCallback


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Quit:
    pass


class _AbortAll:
    pass


@dataclass
class _Live:
    request: GenerateRequest
    on_output: OutputCallback
    seq_id: int
    num_prompt_tokens: int
    num_generated_tokens: int = 0


@dataclass(frozen=True)
class PrefixCacheCounters:
    queries: int  # prompt tokens looked up in the prefix cache
    hits: int  # ... and found there


class EngineFrontend:
    """An `EngineClient` for an engine in this process.

    Give a built `engine`, or an `engine_factory(on_progress)` that the engine thread
    calls, `start()` waiting for it and raising what it raised: on the CPU an engine
    steps at full speed only on the thread that built it (each thread that runs OpenMP
    work keeps its own pool, and with more pool threads than cores libgomp stops spinning
    between the kernels' short parallel regions: a step on another thread took about twice
    as long).
    `owns_engine` decides whether `close()` calls `engine.exit()` (default: when the
    front end built it). `on_iteration`, if given, runs on the engine thread after each
    turn of the loop (after a step's outputs went out): a caller that buffers outputs
    flushes them there, once a step.
    """

    def __init__(
        self,
        engine: Any = None,
        *,
        engine_factory: EngineFactory | None = None,
        owns_engine: bool | None = None,
        stats_interval: float = 0.1,
        idle_wait: float = 0.05,
        on_iteration: Callable[[], None] | None = None,
    ) -> None:
        if (engine is None) == (engine_factory is None):
            raise ValueError("give exactly one of engine and engine_factory")
        self.engine = engine
        self._factory = engine_factory
        self._owns = owns_engine if owns_engine is not None else engine is None
        self._stats_interval = stats_interval
        self._idle_wait = idle_wait
        self._on_iteration = on_iteration
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._info: EngineInfo | None = None
        self._stats: EngineStats | None = None
        self._prefix_counters = PrefixCacheCounters(0, 0)
        self._error: str | None = None
        self._refusing: str | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        # Engine-thread state.
        self._live: dict[str, _Live] = {}
        self._by_seq: dict[int, _Live] = {}

    # -- any thread ------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo | None:
        return self._info

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def tokenizer(self) -> Any:
        return getattr(self.engine, "tokenizer", None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, on_progress: ProgressFn | None = None) -> EngineInfo:
        if self._thread is not None:
            raise RuntimeError("EngineFrontend.start() was already called")
        progress = on_progress or (lambda stage, fraction: None)
        built = threading.Event()
        failure: list[BaseException] = []

        def build_then_serve() -> None:
            try:
                if self.engine is None:
                    assert self._factory is not None
                    self.engine = self._factory(progress)
                    if self.engine is None:
                        raise TypeError("the engine factory returned None, not an engine")
                self._info = engine_info(self.engine)
                self._publish_stats()
                # The engine's objects (torch's, the model's) leave the collector's full
                # passes, which would stall every stream for tens of milliseconds.
                settle()
            except BaseException as exc:  # noqa: BLE001 - start() raises it
                failure.append(exc)
                return
            finally:
                built.set()
            self._run()

        self._thread = threading.Thread(target=build_then_serve, name="minivllm-engine",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            raise failure[0]
        assert self._info is not None
        return self._info

    def add_request(self, request: GenerateRequest, on_output: OutputCallback) -> None:
        refusal = self._error or self._refusing or ("the engine is closed" if self._closed
                                                     else None)
        if refusal is not None:
            on_output(self._refusal(request.request_id, refusal))
            return
        self._commands.put(_Add(request, on_output))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def abort_all(self, refuse_new: bool = False) -> None:
        """Abort every live request (each ends with "abort"); with `refuse_new`, later
        requests are refused (a server that is shutting down)."""
        if refuse_new:
            self._refusing = "the server is shutting down"
        self._commands.put(_AbortAll())

    def stats(self) -> EngineStats | None:
        return self._stats

    def prefix_cache_counters(self) -> PrefixCacheCounters:
        return self._prefix_counters

    def prompt_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens computed so far, prompt tokens) of a live request, or None: a
        long prefill's progress. Safe from any thread (the engine reads two ints)."""
        live = self._live.get(request_id)
        progress = getattr(self.engine, "prompt_progress", None)
        return progress(live.seq_id) if live is not None and progress is not None else None

    def prompt_progresses(self) -> dict[str, tuple[int, int]]:
        """`prompt_progress` of every live request (call on the engine thread, or where
        a snapshot that may be a step old is fine)."""
        progress = getattr(self.engine, "prompt_progress", None)
        if progress is None:
            return {}
        out = {}
        for request_id, live in list(self._live.items()):
            p = progress(live.seq_id)
            if p is not None:
                out[request_id] = p
        return out

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        return stream_outputs(self, request)

    def close(self, timeout: float = 30.0) -> None:
        """Abort every live request, stop the thread, then `exit()` an owned engine."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._commands.put(_Quit())
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout)
        if self._owns and self.engine is not None:
            try:
                self.engine.exit()
            except Exception:  # noqa: BLE001 - already shutting down
                pass

    # -- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - every caller must hear about it
            error = describe(exc)
            # The live requests hear first, then `error` is set: a client that sees it can
            # rely on having every output of the requests that were live.
            self._fail(list(self._live.values()), f"the engine stopped: {error}")
            self._error = error
            # Requests queued after the failure are refused too.
            for cmd in self._drain(0.0):
                if isinstance(cmd, _Add):
                    cmd.on_output(self._refusal(cmd.request.request_id, error))

    def _serve(self) -> None:
        engine = self.engine
        next_stats = 0.0
        while True:
            now = time.monotonic()
            wait = 0.0 if self._live else max(0.0, min(self._idle_wait, next_stats - now))
            commands = self._drain(wait)
            for cmd in commands:
                if isinstance(cmd, _Quit):
                    self._abort_all()
                    return
                if isinstance(cmd, _AbortAll):
                    self._abort_all()
                elif isinstance(cmd, _Add):
                    self._handle_add(cmd)
                elif isinstance(cmd, _Abort):
                    live = self._live.get(cmd.request_id)
                    if live is not None:
                        engine.abort(live.seq_id)
            if self._live:
                try:
                    engine.step()
                except Exception as exc:  # noqa: BLE001 - fail the live requests, keep serving
                    self._fail_live(describe(exc))
            if self._live or commands:
                self._dispatch(engine.pop_deltas())
            now = time.monotonic()
            if now >= next_stats:
                self._publish_stats()
                next_stats = now + self._stats_interval
            if self._on_iteration is not None:
                self._on_iteration()

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

    def _refusal(self, request_id: str, error: str) -> RequestOutput:
        return RequestOutput(request_id, finished=True, finish_reason="error", error=error,
                             rejected=True, at=time.monotonic())

    def _handle_add(self, cmd: _Add) -> None:
        request = cmd.request
        if request.request_id in self._live:
            cmd.on_output(self._refusal(
                request.request_id, f"request_id: {request.request_id!r} is already in use"))
            return
        engine = self.engine
        try:
            prompt = request.prompt
            if request.messages is not None:
                prompt = render_chat_prompt(
                    engine.tokenizer, request.messages, **request.chat_template_kwargs
                )
            seq_id = engine.add_prompt(prompt, request.params)
        except Exception as exc:  # noqa: BLE001 - bad input goes back to its caller
            cmd.on_output(self._refusal(request.request_id, str(exc) or describe(exc)))
            return
        num_prompt = _num_prompt_tokens(engine, seq_id)
        live = _Live(request, cmd.on_output, seq_id, num_prompt)
        self._live[request.request_id] = live
        self._by_seq[seq_id] = live
        self._publish_stats()  # stats() counts the request once its caller hears of it
        opens = isinstance(prompt, str) and prompt.rstrip().endswith("<think>")
        self._emit(live, RequestOutput(request.request_id, num_prompt_tokens=num_prompt,
                                       accepted=True, opens_thinking=opens,
                                       at=time.monotonic()))

    def _emit(self, live: _Live, output: RequestOutput) -> None:
        try:
            live.on_output(output)
        except Exception:  # noqa: BLE001 - a broken consumer loses its request, not the engine
            traceback.print_exc()
            if not output.finished:
                self.engine.abort(live.seq_id)

    def _dispatch(self, deltas: list[Any]) -> None:
        now = time.monotonic()
        if any(d.finished for d in deltas):
            # Before the last outputs go out: a caller that hears a request finished and
            # then reads stats() sees it gone, not a snapshot of up to stats_interval ago.
            self._publish_stats()
        for d in deltas:
            live = self._by_seq.get(d.seq_id)
            if live is None:
                continue  # already failed and reported
            live.num_generated_tokens += len(d.token_ids)
            if d.finished:
                self._forget(live)
            self._emit(live, RequestOutput(
                live.request.request_id, d.text, list(d.token_ids), d.finished,
                d.finish_reason, getattr(d, "error", None), live.num_prompt_tokens,
                live.num_generated_tokens, at=now,
                num_cached_tokens=getattr(d, "num_cached_tokens", 0),
                logprobs=getattr(d, "logprobs", None),
                prompt_logprobs=getattr(d, "prompt_logprobs", None),
            ))

    def _forget(self, live: _Live) -> None:
        self._live.pop(live.request.request_id, None)
        self._by_seq.pop(live.seq_id, None)

    def _fail(self, lives: list[_Live], error: str) -> None:
        for live in lives:
            self._forget(live)
            try:
                live.on_output(RequestOutput(
                    live.request.request_id, finished=True, finish_reason="error",
                    error=error, num_prompt_tokens=live.num_prompt_tokens,
                    num_generated_tokens=live.num_generated_tokens, at=time.monotonic()))
            except Exception:  # noqa: BLE001
                pass

    def _fail_live(self, error: str) -> None:
        """A step raised: the live requests fail (callers hear why); free their blocks."""
        engine = self.engine
        try:  # outputs produced before the failure still belong to their requests
            self._dispatch(engine.pop_deltas())
        except Exception:  # noqa: BLE001
            pass
        lives = list(self._live.values())
        for live in lives:
            try:
                engine.abort(live.seq_id)
            except Exception:  # noqa: BLE001 - the engine may be past caring
                pass
        self._fail(lives, f"engine step failed: {error}")
        try:
            engine.pop_deltas()  # drop the abort deltas of the failed requests
        except Exception:  # noqa: BLE001
            pass

    def _abort_all(self) -> None:
        engine = self.engine
        for live in list(self._live.values()):
            try:
                engine.abort(live.seq_id)
            except Exception:  # noqa: BLE001
                pass
        try:
            self._dispatch(engine.pop_deltas())  # each request's last output: "abort"
        except Exception:  # noqa: BLE001
            self._fail(list(self._live.values()), "the engine is shutting down")
        self._publish_stats()

    def _publish_stats(self) -> None:
        engine = self.engine
        self._stats = engine.stats()
        bm = getattr(engine, "block_manager", None)
        if bm is not None:
            self._prefix_counters = PrefixCacheCounters(
                int(getattr(bm, "num_query_tokens", 0)), int(getattr(bm, "num_hit_tokens", 0))
            )


def _num_prompt_tokens(engine: Any, seq_id: int) -> int:
    count = getattr(engine, "num_prompt_tokens", None)  # a scripted test engine may lack it
    return int(count(seq_id)) if count is not None else 0
