"""Tensor-parallel workers: ranks 1..N-1 of one engine, each in a process of its own.

Rank 0 is the engine's own process. It starts one worker process per extra rank and
talks to each over a private connection (one end of a socket pair, inherited by the
child): it sends a typed command, the worker runs it on its own ModelRunner (joining the
collectives rank 0 runs at the same time) and answers with exactly one `Reply`. Messages
are length-prefixed pickles, so any size goes through whole and in order; the next
command is sent only after every reply to the previous one has come back.

The one exception is the hot path: a step (`StepInput`) carries only what changed since
the last one (block-table entries appended, sequences ended) and is not answered, so
rank 0 never waits on a worker between steps. A worker whose step fails sends its
traceback unasked and exits; rank 0 raises it at its next command or when the step's
collectives fail.

Rank 0 never blocks on a worker without watching it: each wait polls the connection
with a timeout and checks that the process is alive, so a dead worker becomes a
`WorkerDiedError` within about a second instead of a hang. On CUDA a watchdog thread
also aborts the NCCL communicators when a worker dies, since a collective whose peer is
gone would otherwise never return.

No shared memory is used. The rendezvous (a TCPStore on a socket rank 0 binds itself)
and gloo's connections are bound to 127.0.0.1 on ports the kernel picks, and each engine
has its own process group (see distributed.py), so several engines, in one process or
many, never collide.

A worker exits when told (`Shutdown`), when its connection reaches EOF, or when its
parent changes (rank 0 died; a watchdog thread checks twice a second). It lives in its
own session and ignores SIGINT: Ctrl-C belongs to rank 0, whose `close()` (idempotent,
also run at interpreter exit) stops the workers, then terminates and reaps any that do
not stop in time. A normal shutdown prints nothing.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..distributed import TPGroup, set_tp, use_tp
from .batch import ForwardBatch, RowExtras
from .model_runner import ModelRunner

T = TypeVar("T")

# A collective waits this long for a slow (not dead) peer before failing.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
# Joining the group: every worker has already said hello, so this only bounds a worker
# that dies in the few milliseconds between its hello and its join.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=60)
POLL_S = 0.2  # how often a wait on a worker checks that it is still alive
SHUTDOWN_GRACE_S = 3.0  # after Shutdown, before SIGTERM (then 1 s more before SIGKILL)
ORPHAN_CHECK_S = 0.5


# -- the commands: rank 0 -> worker, each answered by one Reply ------------------------


@dataclass(frozen=True)
class InitWorker:
    """Sent once, first: who the worker is. Its reply means the worker is up."""

    config: EngineConfig
    rank: int
    device: torch.device
    dtype: torch.dtype
    store_port: int
    backend: str  # "gloo" or "nccl"


@dataclass(frozen=True)
class JoinGroup:
    """Create this engine's process group (rank 0 joins at the same time)."""


@dataclass(frozen=True)
class LoadModel:
    """Build the model shard and load its weights."""


@dataclass(frozen=True)
class SizeKVPool:
    """Reply with how many KV blocks fit on this rank."""


@dataclass(frozen=True)
class AllocateKVCache:
    num_blocks: int


@dataclass(frozen=True)
class StepInput:
    """One forward step as a change to what the worker already holds; never answered.

    The worker keeps each live sequence's block table: a step carries only the entries
    appended since the last one (`tables`: seq_id, entries kept, entries appended; kept
    is 0 after a preemption) and the ids of sequences that ended (`finished`). A
    placeholder input (overlapped scheduling) is 0 here and received from rank 0 on the
    device. No reply on success, so rank 0 never waits for a worker between steps; a
    worker that fails sends its traceback and exits, which fails rank 0's collectives.
    """

    seq_ids: list[int]
    starts: list[int]
    num_tokens: list[int]
    input_ids: list[int]
    fill_rows: list[int]
    tables: list[tuple[int, int, list[int]]]
    finished: list[int]
    # Rows with prompt logprobs -> how many prompt positions: every rank's LM head
    # computes those logits rows (they are gathered to rank 0).
    prompt_rows: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Shutdown:
    """Reply, then exit."""


Command = InitWorker | JoinGroup | LoadModel | SizeKVPool | AllocateKVCache | StepInput | Shutdown


@dataclass(frozen=True)
class Reply:
    value: Any = None
    error: str | None = None  # the worker's traceback when the command raised


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed a command or died; the group cannot go on."""


class WorkerDiedError(WorkerError):
    """A tensor-parallel worker process is gone."""


# -- rank 0's side -----------------------------------------------------------------------


@dataclass
class _Worker:
    rank: int
    conn: Connection
    proc: subprocess.Popen


def tp_device(device: torch.device, world_size: int, rank: int = 0) -> torch.device:
    """The device of `rank`: cuda:rank on CUDA. Checks that there are enough GPUs."""
    if device.type != "cuda":
        return device
    available = torch.cuda.device_count()
    if world_size > available:
        raise ValueError(
            f"world_size={world_size} needs {world_size} CUDA GPUs but {available} "
            f"{'is' if available == 1 else 'are'} visible"
        )
    return torch.device("cuda", rank)


class WorkerGroup:
    """Ranks 1..N-1 of one engine, seen from rank 0.

    `run(command, local)` sends `command` to every worker, runs `local` (rank 0's share
    of the same work) inside this group's TP context, then waits for every reply.
    After any error the group is unusable: the caller closes it.
    """

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        n = config.world_size
        self.world_size = n
        self.device = tp_device(device, n, 0)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.tp = TPGroup(0, n)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # one command round at a time
        self._closed = False  # no more commands
        self._reaped = False  # every worker has exited and been waited for
        atexit.register(self.close)
        try:
            # The rendezvous: a socket we bind ourselves, so it is on 127.0.0.1 only and
            # on a port the kernel found free (no race between finding and binding).
            listener = socket.create_server(("127.0.0.1", 0))
            port = listener.getsockname()[1]
            self._store = dist.TCPStore(
                "127.0.0.1",
                port,
                n,
                is_master=True,
                wait_for_workers=False,
                timeout=RENDEZVOUS_TIMEOUT,
                master_listen_fd=listener.detach(),
            )
            for rank in range(1, n):
                self._workers.append(_spawn(rank))
            with self._lock:
                for w in self._workers:
                    rank_device = tp_device(device, n, w.rank)
                    self._send(
                        w, InitWorker(config, w.rank, rank_device, dtype, port, self.backend)
                    )
                self._collect()
            group, _ = self.run(
                JoinGroup(), lambda: _new_group(self.backend, self._store, 0, n, self.device)
            )
            self.tp = TPGroup(0, n, group)
        except BaseException:
            self.close()
            raise
        if self.backend == "nccl":
            threading.Thread(target=self._abort_if_a_worker_dies, daemon=True).start()

    def run(self, command: Command, local: Callable[[], T]) -> tuple[T, list[Any]]:
        """Run `command` on every worker and `local` here; returns (local's result,
        the workers' values in rank order)."""
        with self._lock:
            if self._closed:
                raise WorkerError("the tensor-parallel workers were shut down")
            self._raise_unsolicited()
            for w in self._workers:
                self._send(w, command)
            try:
                with use_tp(self.tp):
                    result = local()
            except Exception as e:
                # A collective fails when a peer dies; report the death, not the symptom.
                self._raise_if_a_worker_died(wait_s=1.0, cause=e)
                raise
            return result, self._collect()

    def run_nowait(self, command: StepInput, local: Callable[[], T]) -> T:
        """Send `command` (which the workers do not answer) and run `local` here.

        A worker's failure still surfaces within about a second: an earlier command's
        traceback waiting on a connection is raised here, and a collective that fails
        because a peer died or gave up is reported as that worker's failure."""
        with self._lock:
            if self._closed:
                raise WorkerError("the tensor-parallel workers were shut down")
            self._raise_unsolicited()
            for w in self._workers:
                self._send(w, command)
            try:
                with use_tp(self.tp):
                    return local()
            except Exception as e:
                self._raise_unsolicited(wait_s=1.0, cause=e)
                self._raise_if_a_worker_died(wait_s=1.0, cause=e)
                raise

    def close(self) -> None:
        """Stop the workers and release the group. Idempotent; safe at interpreter exit
        and from another thread mid-step (the workers are then terminated). If it is
        itself interrupted (a second Ctrl-C), the atexit hook finishes the job."""
        if self._reaped:
            return
        self._closed = True
        locked = self._lock.acquire(timeout=2 * POLL_S + 1)
        try:
            for w in self._workers:
                if w.proc.poll() is None:
                    try:
                        # Never block here: a worker stuck mid-collective reads nothing.
                        os.set_blocking(w.conn.fileno(), False)
                        w.conn.send(Shutdown())
                    except OSError:
                        pass
            group = self.tp.group
            self.tp = TPGroup(0, self.world_size)
            if group is not None and self.backend == "nccl":
                _abort(group)
            # Dropping rank 0's end of the group also frees a worker blocked in a gloo
            # collective ("connection closed"), which then reads its Shutdown.
            del group
            self._store = None
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for w in self._workers:
                _reap(w.proc, deadline)
                w.conn.close()
            self._reaped = True
            atexit.unregister(self.close)
        finally:
            if locked:
                self._lock.release()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    # -- internals -------------------------------------------------------------------

    def _send(self, w: _Worker, command: Command) -> None:
        try:
            w.conn.send(command)
        except OSError as e:
            raise self._died(w) from e

    def _recv(self, w: _Worker) -> Reply:
        while True:
            try:
                if w.conn.poll(POLL_S):
                    return w.conn.recv()
            except (EOFError, OSError) as e:
                raise self._died(w) from e
            if w.proc.poll() is not None:
                raise self._died(w)

    def _raise_unsolicited(self, wait_s: float = 0.0, cause: BaseException | None = None):
        """Raise a worker's error reply to a command that expects none (a failed step)."""
        deadline = time.monotonic() + wait_s
        while True:
            for w in self._workers:
                try:
                    waiting = w.conn.poll(0)
                except (EOFError, OSError):
                    waiting = False
                if waiting:
                    reply = self._recv(w)
                    raise WorkerError(
                        f"tensor-parallel worker rank {w.rank} failed:\n"
                        f"{(reply.error or repr(reply.value)).rstrip()}"
                    ) from cause
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _collect(self) -> list[Any]:
        """One reply from every worker (all read, so none is left for the next round)."""
        replies = [self._recv(w) for w in self._workers]
        for w, reply in zip(self._workers, replies, strict=True):
            if reply.error is not None:
                raise WorkerError(
                    f"tensor-parallel worker rank {w.rank} failed:\n{reply.error.rstrip()}"
                )
        return [reply.value for reply in replies]

    def _died(self, w: _Worker) -> WorkerDiedError:
        try:
            code = w.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            how = "closed its connection"
        else:
            if code < 0:
                how = f"was killed by {signal.Signals(-code).name}"
            else:
                how = f"exited with code {code}"
        return WorkerDiedError(
            f"tensor-parallel worker rank {w.rank} (pid {w.proc.pid}) {how}; "
            f"the engine cannot continue"
        )

    def _raise_if_a_worker_died(self, wait_s: float, cause: BaseException) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            for w in self._workers:
                if w.proc.poll() is not None:
                    raise self._died(w) from cause
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _abort_if_a_worker_dies(self) -> None:
        # NOTE: an NCCL collective whose peer died never returns; aborting the
        # communicators makes rank 0's step fail, and run() then reports the death.
        while not self._closed:
            time.sleep(POLL_S)
            if any(w.proc.poll() is not None for w in self._workers):
                if not self._closed and self.tp.group is not None:
                    _abort(self.tp.group)
                return


def _spawn(rank: int) -> _Worker:
    """Start a fresh interpreter (no fork: CUDA and threads do not survive one) that
    inherits one end of a socket pair and nothing else."""
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from minivllm.engine.worker import worker_main; worker_main()",
                str(theirs.fileno()),
                str(os.getpid()),
            ],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C at the terminal goes to rank 0 only
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return _Worker(rank, Connection(ours.detach()), proc)


def _reap(proc: subprocess.Popen, deadline: float) -> None:
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return
    except subprocess.TimeoutExpired:
        proc.terminate()
    try:
        proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _abort(group: Any) -> None:
    try:
        group.abort()
    except Exception:  # best effort: the group is being thrown away
        pass


def _new_group(backend: str, store: dist.Store, rank: int, size: int, device: torch.device):
    """This engine's own process group (a c10d backend object, not the global default)."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupGloo(store, rank, size, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = COLLECTIVE_TIMEOUT
    group = dist.ProcessGroupNCCL(store, rank, size, opts)
    # Connect now, so a broken setup fails here rather than in the first step.
    group.allreduce([torch.zeros(1, device=device)]).wait()
    torch.cuda.synchronize(device)
    return group


# -- the worker's side -----------------------------------------------------------------


class _WorkerLoop:
    """Runs commands from rank 0 until Shutdown or EOF."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.init: InitWorker | None = None
        self.runner: ModelRunner | None = None
        self.tables: dict[int, list[int]] = {}  # live sequences' block tables

    def run_step(self, step: StepInput) -> None:
        for seq_id in step.finished:
            self.tables.pop(seq_id, None)
        for seq_id, keep, appended in step.tables:
            table = self.tables.setdefault(seq_id, [])
            del table[keep:]
            table.extend(appended)
        bs = self.runner.block_size
        b = ForwardBatch(step.input_ids, [], [], [0], [], [], [], [], [], [], [])
        b.fill_rows = step.fill_rows
        b.extras = {row: RowExtras(prompt_targets=[0] * n) for row, n in step.prompt_rows.items()}
        for seq_id, start, n in zip(step.seq_ids, step.starts, step.num_tokens, strict=True):
            table = self.tables[seq_id]
            end = start + n
            b.positions.extend(range(start, end))
            b.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            b.cu_seqlens_q.append(b.cu_seqlens_q[-1] + n)
            b.seq_lens.append(end)
            b.block_tables.append(table)
        self.runner.launch(b)

    def serve(self) -> None:
        while True:
            command = self.conn.recv()
            if isinstance(command, StepInput):
                try:
                    self.run_step(command)
                except Exception as e:
                    # Nobody waits for a reply: report, then leave so that rank 0's
                    # collectives fail at once instead of waiting for us. (If rank 0 is
                    # gone, which is often why the step failed, there is no one to tell.)
                    try:
                        self.conn.send(Reply(error=traceback.format_exc()))
                    except OSError:
                        pass
                    raise _StepFailed from e
                continue
            try:
                value = self.handle(command)
            except Exception:
                self.conn.send(Reply(error=traceback.format_exc()))
                continue
            self.conn.send(Reply(value))
            if isinstance(command, Shutdown):
                return

    def handle(self, command: Command) -> Any:
        match command:
            case InitWorker():
                self.init = command
                if command.device.type == "cuda":
                    torch.cuda.set_device(command.device)
                else:
                    # NOTE: the ranks compute at the same time; share the cores.
                    cores = os.cpu_count() or 1
                    torch.set_num_threads(max(1, cores // command.config.world_size))
            case JoinGroup():
                init = self.init
                store = dist.TCPStore(
                    "127.0.0.1",
                    init.store_port,
                    init.config.world_size,
                    is_master=False,
                    timeout=RENDEZVOUS_TIMEOUT,
                )
                size = init.config.world_size
                group = _new_group(init.backend, store, init.rank, size, init.device)
                set_tp(init.rank, size, group)
            case LoadModel():
                init = self.init
                self.runner = ModelRunner(init.config, init.device, init.dtype, rank=init.rank)
            case SizeKVPool():
                return self.runner.size_kv_pool()
            case AllocateKVCache(num_blocks=num_blocks):
                self.runner.allocate_kv_cache(num_blocks)
            case Shutdown():
                pass
            case _:
                raise TypeError(f"not a worker command: {command!r}")
        return None


class _StepFailed(Exception):
    """A step failed; its traceback went to rank 0 and the worker exits quietly."""


def _exit_when_orphaned(parent_pid: int) -> None:
    # If rank 0 dies mid-collective, the main thread may never see EOF.
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(0)


def worker_main() -> None:
    """Entry point of a worker process: argv is [connection fd, rank 0's pid]."""
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    code = 0
    try:
        _WorkerLoop(Connection(fd)).serve()
    except (EOFError, OSError):
        pass  # rank 0 closed the connection or is gone: nothing to report to anyone
    except _StepFailed:
        code = 1  # already reported to rank 0 (or rank 0 is gone)
    except BaseException:
        traceback.print_exc()  # a bug in the loop itself; rank 0 sees the exit code
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # NOTE: skip interpreter teardown: destructors of a process group whose peers
        # are gone can block or complain, and the OS frees everything we hold.
        os._exit(code)
