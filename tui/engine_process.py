"""`ProcessClient`: the engine in a child process, as an `EngineClient`
(`minivllm-chat --engine-process`).

Why: in one process the engine loop, the UI bridge and Textual share one GIL. On a GPU the
engine's step is short and mostly a wait on the device, with the GIL released; whenever it
is released the UI thread takes it, and the engine waits for it back (up to the switch
interval) after every device sync. Rendering four fast streams kept the UI thread busy most
of the time, and the engine made a quarter of its tokens. In its own process the engine
never waits for the UI; what crosses the pipe is batched (each request's outputs since the
last batch, at most `BATCH_HZ` times a second, and at once for a request's first and last
output).

The child builds the engine from an `EngineSpec` (picklable: the child is spawned, not
forked, so CUDA and the parent's threads stay out of it), serves it with `EngineFrontend`,
and sends the engine's tokenizer (when it pickles) so the app can count prompt tokens.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from minivllm.frontend import (
    EngineFrontend,
    EngineInfo,
    GenerateRequest,
    RequestOutput,
    merge_outputs,
    stream_outputs,
)
from minivllm.frontend.protocol import OutputCallback, ProgressFn
from minivllm.outputs import EngineStats

BATCH_HZ = 60  # outputs cross the pipe at most this often (first and last ones at once)
STATS_PERIOD = 0.1  # seconds between stats snapshots sent to the parent


@dataclass(frozen=True)
class EngineSpec:
    """What the child builds: `kind` "llm" (`LLMEngine(config)`), "gpu-like" (the bench's
    `GpuLikeEngine(**options)`) or "fake" (`FakeEngine(config, **options)`).
    `bench_tokenizer`: give a tokenizer-less engine (random weights) the bench's."""

    kind: str
    config: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    bench_tokenizer: bool = False
    threads: int | None = None  # torch threads in the child (None: torch's default)

    def __post_init__(self) -> None:
        if self.kind not in ("llm", "gpu-like", "fake"):
            raise ValueError(f"kind={self.kind!r}: expected 'llm', 'gpu-like' or 'fake'")


def build_engine(spec: EngineSpec, on_progress: ProgressFn) -> Any:
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    if spec.kind == "gpu-like":
        from .fake_engine import GpuLikeEngine

        engine: Any = GpuLikeEngine(spec.config, on_progress, **spec.options)
    elif spec.kind == "fake":
        from .fake_engine import FakeEngine

        engine = FakeEngine(spec.config, on_progress, **spec.options)
    else:
        import inspect

        from minivllm import LLMEngine

        if "on_progress" in inspect.signature(LLMEngine).parameters:
            engine = LLMEngine(spec.config, on_progress=on_progress)
        else:
            engine = LLMEngine(spec.config)
    if spec.bench_tokenizer:
        from .bench import ensure_tokenizer

        ensure_tokenizer(engine)
    return engine


# -- the child ---------------------------------------------------------------------------


class _Child:
    """The child's side: commands come in on the main thread, outputs go out in batches
    from a sender thread. One lock guards the pipe (two threads send)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.outbox: list[RequestOutput] = []
        self.wake = threading.Event()
        self.stopping = False
        self.frontend: EngineFrontend | None = None
        self.live: set[str] = set()  # requests whose prefill progress the parent may show
        self.waiting: set[str] = set()  # accepted, no tokens sent yet (see merge_batch)

    def send(self, message: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(message)

    def on_output(self, out: RequestOutput) -> None:
        with self.lock:
            self.outbox.append(out)
            if out.finished or out.token_ids:
                self.live.discard(out.request_id)  # prefill is over
        if out.accepted or out.finished or out.rejected:
            self.wake.set()  # TTFT and the end go out at once; the rest in batches

    def sender(self) -> None:
        next_stats = 0.0
        while True:
            self.wake.wait(1 / BATCH_HZ)
            self.wake.clear()
            with self.lock:
                batch, self.outbox = self.outbox, []
            batch = merge_batch(batch, self.waiting)
            frontend = self.frontend
            now = time.monotonic()
            stats = progress = None
            if frontend is not None and now >= next_stats:
                stats = frontend.stats()
                with self.lock:
                    prefilling = list(self.live)
                progress = {rid: frontend.prompt_progress(rid) for rid in prefilling}
                next_stats = now + STATS_PERIOD
            if batch or stats is not None:
                try:
                    self.send(("out", batch, stats, progress,
                               frontend.error if frontend else None))
                except (OSError, EOFError, BrokenPipeError):
                    return  # the parent is gone
            if self.stopping and not batch:
                return
            # NOTE: a short pause even when woken early, so a burst of first tokens is one
            # batch, not one message each.
            time.sleep(1 / (4 * BATCH_HZ))


def merge_batch(batch: list[RequestOutput], waiting: set[str]) -> list[RequestOutput]:
    """Each request's outputs in `batch` merged into one (`merge_outputs`), except that an
    acceptance and a request's first tokens stay outputs of their own, so the pane's TTFT
    is the engine's time of the first token. `waiting`: requests accepted without tokens
    yet (kept across batches, updated here)."""
    heads: list[RequestOutput] = []
    groups: dict[str, list[RequestOutput]] = {}
    for out in batch:
        if out.accepted and not (out.token_ids or out.text or out.finished):
            heads.append(out)
            waiting.add(out.request_id)
            continue
        groups.setdefault(out.request_id, []).append(out)
    merged = heads
    for request_id, group in groups.items():
        if request_id in waiting:
            waiting.discard(request_id)
            merged.append(group[0])
            group = group[1:]
        if group:
            merged.append(merge_outputs(group))
    return merged


def _child_main(conn: Any, spec: EngineSpec) -> None:
    # NOTE: Ctrl-C in a terminal signals the whole process group; it is the parent's to
    # handle (stop a reply), and the child ends when the parent says so or goes away.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent's screen is the terminal: the child's own output (warnings, a consumer's
    # traceback) goes to a log file instead of over it.
    log = os.path.join(tempfile.gettempdir(), f"minivllm-engine-{os.getpid()}.log")
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    child = _Child(conn)
    try:
        engine = build_engine(spec, lambda stage, fraction: child.send(
            ("progress", str(stage), float(fraction))))
        frontend = EngineFrontend(engine, owns_engine=True)
        info = frontend.start()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        child.send(("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    try:
        tokenizer = pickle.dumps(engine.tokenizer)
    except Exception:  # noqa: BLE001 - the app then does without token counts
        tokenizer = None
    child.frontend = frontend
    child.send(("ready", info, tokenizer))
    sender = threading.Thread(target=child.sender, name="minivllm-engine-sender", daemon=True)
    sender.start()
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the parent died: stop
            what = message[0]
            if what == "add":
                with child.lock:
                    child.live.add(message[1].request_id)
                frontend.add_request(message[1], child.on_output)
            elif what == "abort":
                frontend.abort(message[1])
            elif what == "headless":
                from .bench import run_headless

                _, texts, max_tokens = message
                child.send(("headless", run_headless(None, texts, max_tokens, frontend)))
            elif what == "quit":
                break
    finally:
        frontend.close()
        child.stopping = True
        child.wake.set()
        sender.join(5)
        if os.path.getsize(log) == 0:  # nothing to read
            os.remove(log)


# -- the parent --------------------------------------------------------------------------


class ProcessClient:
    """An `EngineClient` whose engine runs in a child process (see the module docstring).
    Every public method is safe from any thread."""

    def __init__(self, spec: EngineSpec, *, start_timeout: float = 3600.0) -> None:
        self.spec = spec
        self.tokenizer: Any = None
        self._start_timeout = start_timeout
        self._info: EngineInfo | None = None
        self._stats: EngineStats | None = None
        self._progress: dict[str, tuple[int, int] | None] = {}
        self._error: str | None = None
        self._callbacks: dict[str, OutputCallback] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._conn: Any = None
        self._proc: Any = None
        self._reader: threading.Thread | None = None
        self._headless: Future[tuple[int, float]] | None = None
        self._closed = False

    @property
    def info(self) -> EngineInfo | None:
        return self._info

    @property
    def error(self) -> str | None:
        return self._error

    def start(self, on_progress: ProgressFn | None = None) -> EngineInfo:
        if self._proc is not None:
            raise RuntimeError("ProcessClient.start() was already called")
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        # NOTE: not a daemon: a tensor-parallel engine starts processes of its own. The
        # child exits when the pipe closes, so it does not outlive the app.
        self._proc = ctx.Process(target=_child_main, args=(child_conn, self.spec),
                                 name="minivllm-engine")
        # NOTE: multiprocessing passes sys.stderr's descriptor to the helper processes it
        # starts; inside a Textual app sys.stderr is a capture object without a real one.
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = sys.__stdout__ or saved[0], sys.__stderr__ or saved[1]
        try:
            self._proc.start()
        finally:
            sys.stdout, sys.stderr = saved
        child_conn.close()
        # multiprocessing joins live non-daemon children at exit: close ours first (atexit
        # runs handlers last-registered first) so an app that did not close it still exits.
        atexit.register(self.close, 5.0)
        deadline = time.monotonic() + self._start_timeout
        while True:
            if not self._conn.poll(0.2):
                if not self._proc.is_alive():
                    raise RuntimeError(f"the engine process exited with status "
                                       f"{self._proc.exitcode} while loading")
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("the engine process did not start in time")
                continue
            try:
                message = self._conn.recv()
            except EOFError:
                self._proc.join(5)
                raise RuntimeError(f"the engine process exited with status "
                                   f"{self._proc.exitcode} while loading") from None
            if message[0] == "progress" and on_progress is not None:
                on_progress(message[1], message[2])
            elif message[0] == "failed":
                self._proc.join(5)
                raise RuntimeError(message[1])
            elif message[0] == "ready":
                self._info = message[1]
                if message[2] is not None:
                    self.tokenizer = pickle.loads(message[2])
                break
        self._reader = threading.Thread(target=self._read, name="minivllm-engine-reader",
                                        daemon=True)
        self._reader.start()
        return self._info

    def _send(self, message: tuple[Any, ...]) -> bool:
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (OSError, EOFError, BrokenPipeError, AttributeError):
            return False

    def add_request(self, request: GenerateRequest, on_output: OutputCallback) -> None:
        refusal = self._error or ("the engine is closed" if self._closed else None)
        with self._lock:
            if refusal is None and request.request_id in self._callbacks:
                refusal = f"request_id: {request.request_id!r} is already in use"
            if refusal is None:
                self._callbacks[request.request_id] = on_output
        if refusal is None and not self._send(("add", request)):
            with self._lock:
                self._callbacks.pop(request.request_id, None)
            refusal = "the engine process is gone"
        if refusal is not None:
            on_output(RequestOutput(request.request_id, finished=True, finish_reason="error",
                                    error=refusal, rejected=True, at=time.monotonic()))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> EngineStats | None:
        return self._stats

    def prompt_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens computed, prompt tokens) of a request still in prefill, as of the
        child's last stats message (a long paste's progress in its pane's title)."""
        return self._progress.get(request_id)

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        return stream_outputs(self, request)

    def run_headless(self, texts: list[str], max_tokens: int) -> tuple[int, float]:
        """The bench's headless round, run by the child on its engine with no UI and no
        pipe traffic: (generated tokens, seconds)."""
        self._headless = Future()
        if not self._send(("headless", texts, max_tokens)):
            raise RuntimeError("the engine process is gone")
        return self._headless.result()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (it aborts everything and exits the engine) and wait for it."""
        if self._closed:
            return
        self._closed = True
        if self._proc is None:
            return
        atexit.unregister(self.close)
        self._send(("quit",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        try:
            self._conn.close()
        except OSError:
            pass

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # noqa: BLE001 - a message that does not unpickle
                self._error = f"bad message from the engine process: {exc}"
                break
            if message[0] == "out":
                _, batch, stats, progress, error = message
                if stats is not None:
                    self._stats = stats
                    self._progress = progress or {}
                self._deliver(batch)
                if error is not None:
                    self._error = error
            elif message[0] == "headless" and self._headless is not None:
                self._headless.set_result(message[1])
        # The child is gone: every live request hears it, then `error` is set.
        if not self._closed and self._error is None:
            code = self._proc.exitcode if self._proc is not None else None
            reason = f"the engine process exited (status {code})"
            with self._lock:
                live, self._callbacks = self._callbacks, {}
            for request_id, callback in live.items():
                _call(callback, RequestOutput(request_id, finished=True, finish_reason="error",
                                              error=reason, at=time.monotonic()))
            self._error = reason
        if self._headless is not None and not self._headless.done():
            self._headless.set_exception(RuntimeError("the engine process is gone"))

    def _deliver(self, batch: list[RequestOutput]) -> None:
        for out in batch:
            with self._lock:
                callback = self._callbacks.get(out.request_id)
                if out.finished:
                    self._callbacks.pop(out.request_id, None)
            if callback is not None:
                _call(callback, out)


def _call(callback: Callable[[RequestOutput], None], out: RequestOutput) -> None:
    try:
        callback(out)
    except Exception:  # noqa: BLE001 - a broken consumer loses its request, not the client
        traceback.print_exc()
