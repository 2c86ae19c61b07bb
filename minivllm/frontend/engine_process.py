"""`EngineProcessClient`: the engine in a child process, as an `EngineClient`.

Why a process: Python runs one thread at a time per process (the GIL). With the engine
thread in the server's process, every token's HTTP work (outputs to the event loop, SSE
chunks, socket writes) competes with the engine's own Python, and the engine, which
gives the GIL up at every device sync, waits up to a switch interval to get it back: at
many streams on a GPU that held the server well below the engine's rate.
In its own process the engine runs as fast as in-process; the server's work runs on
another core and falls behind gracefully (outputs of one request merge into one chunk).

The child is a fresh interpreter (`python -c`, not fork: the parent may have touched
CUDA through torch, and a forked child could not use it) that gets the engine factory
pickled over a socket pair. It runs an `EngineFrontend` (the same loop the app uses)
whose outputs are collected during a step and sent by a thread of their own: one
message a step, or, while the parent reads slowly, one message for every step since the
last send (the engine never waits on the pipe). The parent routes them to each
request's callback from a reader thread. Requests, aborts and shutdown go the other
way. The child ignores SIGINT (the parent decides when it stops) and exits when the
socket closes, so a parent that dies leaves no engine behind.
"""

from __future__ import annotations

import faulthandler
import functools
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..outputs import EngineStats
from .engine_frontend import EngineFrontend, PrefixCacheCounters, describe
from .outputs import stream_outputs
from .protocol import EngineInfo, GenerateRequest, OutputCallback, ProgressFn, RequestOutput

EngineFactory = Callable[[ProgressFn], Any]

# NOTE: the GIL switch interval of both processes. A thread that gives the GIL up for a
# system call (a socket read, a device sync) and wants it back waits until the holder
# releases it or the interval passes (5 ms by default). Here the holder is busy for long
# stretches (the engine stepping; the event loop writing chunks), so with the default each
# request handed to the engine and each step's outputs handed to the event loop waited
# milliseconds, and a burst of requests started late.
SWITCH_INTERVAL_S = 0.0005

# The exception types a failed start is raised as in the parent (others: RuntimeError).
_START_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError, "TypeError": TypeError, "FileNotFoundError": FileNotFoundError,
}


class EngineProcessClient:
    """An `EngineClient` whose engine lives in a child process built by `engine_factory`
    (pickled, then called there with a progress callback: a module-level function or a
    `functools.partial` of one).

    The child's stdout and stderr go to `log_path` when given (a full-screen UI must not
    be written over), else to ours. `tokenizer` is a copy of the engine's, sent once at
    start (None if it does not pickle); `stats()`, `prefix_cache_counters()` and
    `prompt_progress()` are snapshots the child sends every `stats_interval`.
    """

    def __init__(self, engine_factory: EngineFactory, *, stats_interval: float = 0.1,
                 log_path: str | Path | None = None) -> None:
        self._factory = engine_factory
        self._stats_interval = stats_interval
        self._log_path = log_path
        self._conn: Connection | None = None
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        # Commands go out through a writer thread, which sends all that queued up as one
        # message: a burst of requests costs the engine process one read, not one each
        # (each read gives the GIL up, and getting it back from the busy engine thread
        # takes up to a switch interval).
        self._outq: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._writer_failed = False
        self._callbacks: dict[str, OutputCallback] = {}
        self._lock = threading.Lock()  # guards _callbacks
        self._info: EngineInfo | None = None
        self._stats: EngineStats | None = None
        self._prefix_counters = PrefixCacheCounters(0, 0)
        self._progresses: dict[str, tuple[int, int]] = {}
        self._tokenizer: Any = None
        self._error: str | None = None
        self._refusing: str | None = None
        self._closed = False

    # -- EngineClient ----------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo | None:
        return self._info

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def alive(self) -> bool:
        return (self._process is not None and self._process.poll() is None
                and self._error is None)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self, on_progress: ProgressFn | None = None) -> EngineInfo:
        if self._process is not None:
            raise RuntimeError("EngineProcessClient.start() was already called")
        ours, theirs = socket.socketpair()
        # -P (3.11+): not the working folder first on sys.path, so the child imports the
        # installed packages whatever folders the working folder holds. The working folder
        # itself is kept (relative paths).
        safe = ["-P"] if sys.version_info >= (3, 11) else []
        cmd = [sys.executable, *safe, "-c", "from minivllm.frontend.engine_process import "
               "child_entry; child_entry()", str(theirs.fileno())]
        if self._log_path is not None:
            with open(self._log_path, "ab") as log:
                self._process = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),),
                                                  stdout=log, stderr=subprocess.STDOUT)
        else:
            self._process = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn = conn = Connection(ours.detach())
        # The factory goes pickled inside the message, so that the child unpickles it only
        # once it has the parent's import path (see `child_entry`).
        conn.send(("start", list(sys.path), pickle.dumps(self._factory),
                   self._stats_interval))
        try:
            while True:
                try:
                    msg = conn.recv()
                except EOFError:
                    code = self._process.wait(30)
                    raise RuntimeError(f"the engine process exited (status {code}) before "
                                       "it was ready") from None
                if msg[0] == "progress" and on_progress is not None:
                    on_progress(msg[1], msg[2])
                elif msg[0] == "failed":
                    self._process.wait(30)
                    raise _START_ERRORS.get(msg[1], RuntimeError)(msg[2])
                elif msg[0] == "ready":
                    self._info, self._tokenizer = msg[1], msg[2]
                    self._stats, self._prefix_counters, self._progresses = msg[3:6]
                    break
        except BaseException:  # a failed start or Ctrl-C: leave no child behind
            if self._process.poll() is None:
                self._process.terminate()
            self._stop_child(timeout=5)
            raise
        self._reader = threading.Thread(target=self._read, name="minivllm-engine-outputs",
                                        daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="minivllm-engine-commands",
                                        daemon=True)
        self._writer.start()
        return self._info

    def add_request(self, request: GenerateRequest, on_output: OutputCallback) -> None:
        refusal = self._error or self._refusing or ("the engine is closed" if self._closed
                                                     else None)
        if refusal is None:
            with self._lock:
                if request.request_id in self._callbacks:
                    refusal = f"request_id: {request.request_id!r} is already in use"
                else:
                    self._callbacks[request.request_id] = on_output
        if refusal is not None:
            on_output(RequestOutput(request.request_id, finished=True, finish_reason="error",
                                    error=refusal, rejected=True, at=time.monotonic()))
            return
        if not self._send(("add", request)):
            self._fail_all(self._error or "the engine process is gone")

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def abort_all(self, refuse_new: bool = False) -> None:
        if refuse_new:
            self._refusing = "the server is shutting down"
        self._send(("abort_all",))

    def stats(self) -> EngineStats | None:
        return self._stats

    def prefix_cache_counters(self) -> PrefixCacheCounters:
        return self._prefix_counters

    def prompt_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens computed, prompt tokens) of a live request, as of the child's
        last snapshot (at most `stats_interval` old), or None."""
        return self._progresses.get(request_id)

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        return stream_outputs(self, request)

    def close(self, timeout: float = 30.0) -> None:
        """Abort what is live, let the child exit its engine, and wait for it."""
        if self._closed:
            return
        self._closed = True
        self._send(("quit",))
        writer = self._writer
        if writer is not None:
            self._outq.put(None)
            writer.join(5)
        self._stop_child(timeout)
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(5)
        self._fail_all("the engine is closed")

    # -- parent internals ------------------------------------------------------------------

    def _send(self, msg: tuple[Any, ...]) -> bool:
        if self._writer is None or self._writer_failed:
            return False
        self._outq.put(msg)
        return True

    def _write(self) -> None:
        """The writer thread: everything queued since the last send, as one message."""
        conn = self._conn
        assert conn is not None
        while True:
            msgs = [self._outq.get()]
            while True:
                try:
                    msgs.append(self._outq.get_nowait())
                except queue.Empty:
                    break
            batch = [m for m in msgs if m is not None]
            if batch:
                try:
                    conn.send(("batch", batch))
                except (OSError, ValueError):  # the child is gone (the reader says why)
                    self._writer_failed = True
                    return
            if len(batch) < len(msgs):  # None: close() is done sending
                return

    def _stop_child(self, timeout: float) -> None:
        process = self._process
        if process is None:
            return
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        if self._conn is not None:
            self._conn.close()

    def _read(self) -> None:
        """Route the child's messages: outputs to their callbacks, stats to `stats()`."""
        conn = self._conn
        assert conn is not None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "out":
                self._deliver(msg[1])
            elif kind == "stats":
                self._stats, self._prefix_counters, self._progresses = msg[1], msg[2], msg[3]
            elif kind == "dead":
                self._error = msg[1]
        if not self._closed and self._error is None:
            code = self._reap()
            self._error = f"the engine process exited (status {code})"
        elif not self._closed:
            self._reap()
        self._fail_all(f"the engine stopped: {self._error}" if self._error else "closed")

    def _reap(self) -> int | None:
        """The child's exit status once it is gone (waited for: no zombie left behind),
        or None if it still runs a few seconds after closing its end."""
        process = self._process
        if process is None:
            return None
        try:
            return process.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def _deliver(self, packed: list[tuple[Any, ...]]) -> None:
        callbacks = self._callbacks
        for fields in packed:
            out = RequestOutput(*fields)
            if out.finished:
                with self._lock:
                    callback = callbacks.pop(out.request_id, None)
            else:
                callback = callbacks.get(out.request_id)
            if callback is not None:
                try:
                    callback(out)
                except Exception:  # noqa: BLE001 - a broken consumer loses its request only
                    self.abort(out.request_id)

    def _fail_all(self, error: str) -> None:
        with self._lock:
            lost, self._callbacks = self._callbacks, {}
        for request_id, callback in lost.items():
            try:
                callback(RequestOutput(request_id, finished=True, finish_reason="error",
                                       error=error, at=time.monotonic()))
            except Exception:  # noqa: BLE001
                pass


# -- the child ---------------------------------------------------------------------------------


def _pack(o: RequestOutput) -> tuple[Any, ...]:
    """`RequestOutput`'s fields in order (`RequestOutput(*t)` rebuilds it): a tuple
    pickles in half the time of the dataclass, and this runs on the engine's thread."""
    return (o.request_id, o.text, o.token_ids, o.finished, o.finish_reason, o.error,
            o.num_prompt_tokens, o.num_generated_tokens, o.accepted, o.rejected,
            o.opens_thinking, o.at, o.first_at, o.num_cached_tokens, o.logprobs, o.prompt_logprobs)


class _Outbox:
    """Outputs gathered on the engine thread, sent to the parent by a thread of their own.

    The engine thread only appends a step's outputs and wakes the sender (`flush`): it
    never waits on the pipe. A parent that reads slowly (its event loop busy writing
    chunks) once filled the socket's buffer, and the engine thread then sat in `send`,
    stepping nobody. Now, while one send waits, the outputs of the steps meanwhile pile
    up and go in the next message, all of them. With each message, a new stats snapshot
    whenever the front end published one.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.frontend: EngineFrontend | None = None
        self.items: list[RequestOutput] = []
        self.lock = threading.Lock()  # guards items
        self.send_lock = threading.Lock()  # one writer at a time: messages must not interleave
        self.sent_stats: Any = None
        self._wake = threading.Event()
        self._stopping = False
        self._sender: threading.Thread | None = None

    def put(self, output: RequestOutput) -> None:
        with self.lock:
            self.items.append(output)

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def start(self) -> None:
        self._sender = threading.Thread(target=self._send_loop, name="minivllm-engine-outbox",
                                        daemon=True)
        self._sender.start()

    def flush(self) -> None:
        """Have what was gathered sent soon (on the sender thread)."""
        self._wake.set()

    def drain(self) -> None:
        """Send what was gathered now, on the calling thread."""
        frontend = self.frontend
        assert frontend is not None
        with self.send_lock:
            with self.lock:
                items, self.items = self.items, []
            stats = frontend.stats()
            try:
                # Stats first: a caller that hears a request finished and then reads
                # stats() must see it gone (as with the in-process front end). They are
                # read after the outputs were taken, so they are never older than those.
                if stats is not self.sent_stats:
                    self.sent_stats = stats
                    self.conn.send(("stats", stats, frontend.prefix_cache_counters(),
                                    frontend.prompt_progresses()))
                if items:
                    self.conn.send(("out", [_pack(o) for o in items]))
            except (OSError, ValueError):
                pass  # the parent is gone: the command loop sees EOF and exits

    def stop(self) -> None:
        """Stop the sender, then send what is left."""
        self._stopping = True
        self._wake.set()
        if self._sender is not None:
            self._sender.join(10)
        self.drain()

    def _send_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            self.drain()


def _run_commands(frontend: EngineFrontend, outbox: _Outbox, batch: list[tuple[Any, ...]]
                  ) -> bool:
    """Apply the parent's commands in order; False once told to quit."""
    for msg in batch:
        kind = msg[0]
        if kind == "add":
            frontend.add_request(msg[1], outbox.put)
            if frontend.error is not None or not frontend.alive:
                outbox.flush()  # refused at once: nobody else will flush it
        elif kind == "abort":
            frontend.abort(msg[1])
        elif kind == "abort_all":
            frontend.abort_all()
        elif kind == "quit":
            return False
    return True


def _picklable(value: Any) -> Any:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - a tokenizer holding a lock, say: the parent gets None
        return None
    return value


def child_entry() -> None:
    """`python -c` entry of the engine process: argv[1] is its end of the socket pair."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    # `kill -USR1 <pid>` prints every thread's stack to the child's stderr (a hang's where).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    conn = Connection(int(sys.argv[1]))
    try:
        kind, parent_path, factory_bytes, stats_interval = conn.recv()
    except (EOFError, OSError):
        return
    assert kind == "start"
    # The parent's import path after the child's own: the installed packages still come
    # first (see `-P` in `start`), and a factory from a module the parent found in a
    # folder of its own (a test's helper module) unpickles here too.
    sys.path.extend(p for p in parent_path if p not in sys.path)
    _child_main(functools.partial(_unpickled_factory, factory_bytes), conn, stats_interval)


def _unpickled_factory(factory_bytes: bytes, on_progress: ProgressFn) -> Any:
    """Unpickle the parent's engine factory and call it, on the engine thread: a factory
    that does not unpickle fails the start with its reason, as one that raises does."""
    return pickle.loads(factory_bytes)(on_progress)


def _child_main(factory: EngineFactory, conn: Connection, stats_interval: float) -> None:
    outbox = _Outbox(conn)
    # Built on the engine thread, the one that steps it (EngineFrontend: on the CPU an
    # engine steps at half speed on a thread other than the one that built it).
    frontend = outbox.frontend = EngineFrontend(
        engine_factory=factory, owns_engine=True, stats_interval=stats_interval,
        on_iteration=outbox.flush)
    try:
        with outbox.send_lock:  # the first message: nothing else is sent before it
            info = frontend.start(
                lambda stage, fraction: conn.send(("progress", stage, fraction)))
            engine = frontend.engine
            conn.send(("ready", info, _picklable(getattr(engine, "tokenizer", None)),
                       frontend.stats(), frontend.prefix_cache_counters(), {}))
        outbox.start()
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        try:
            conn.send(("failed", type(exc).__name__, str(exc) or describe(exc)))
        finally:
            conn.close()
        return
    dead_reported = False
    try:
        while True:
            if not conn.poll(0.2):
                if frontend.error is not None and not dead_reported:
                    outbox.drain()  # the failed requests' last outputs, then why
                    outbox.send(("dead", frontend.error))
                    dead_reported = True
                continue
            kind, batch = conn.recv()
            assert kind == "batch"
            if not _run_commands(frontend, outbox, batch):
                break
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        frontend.close()
        outbox.stop()
        conn.close()
