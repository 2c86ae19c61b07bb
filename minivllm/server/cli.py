"""`minivllm serve`: the engine behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from ..engine_args import EngineArgs
from ..heap import settle
from ..reasoning import REASONING_PARSERS


def add_engine_arguments(p: argparse.ArgumentParser, *, show_stand_in: bool = False) -> None:
    """Every engine option as a flag (`EngineArgs`; unset flags keep the engine's
    defaults), and the benchmarks' model-less stand-in, shown only in `bench serve`'s help."""
    EngineArgs.add_cli_args(p.add_argument_group("engine"))

    def shown(text: str) -> str:
        return text if show_stand_in else argparse.SUPPRESS

    p.add_argument("--stand-in-ms", type=float, nargs=2, metavar=("HOST", "DEVICE"),
                   help=shown("no model; each step costs HOST ms of Python and DEVICE ms of "
                              "GIL-free waiting (e.g. 0.3 1.4 is an H200's decode step)"))
    p.add_argument("--stand-in-load-s", type=float, default=0.0, metavar="SECONDS",
                   help=shown("with --stand-in-ms: the engine takes this long to load, as "
                              "weights do (to try readiness probes and routers)"))


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    return EngineArgs.from_cli_args(args).engine_config()


def build_engine(args: argparse.Namespace, on_progress: Any = None) -> Any:
    """The engine the flags ask for: the real one, or the benchmark's stand-in."""
    if getattr(args, "stand_in_ms", None):
        from .standin import stand_in_engine

        host_ms, device_ms = args.stand_in_ms
        return stand_in_engine(engine_config(args), host_ms=host_ms, device_ms=device_ms,
                               load_s=getattr(args, "stand_in_load_s", 0.0),
                               on_progress=on_progress)
    from minivllm import LLMEngine

    llm = LLMEngine(engine_config(args), on_progress=on_progress)
    llm.prepare_structured_outputs()  # off the first constrained request's path
    return llm


def build_parser() -> argparse.ArgumentParser:
    from .tools import DEFAULT_TOOL_PARSER, TOOL_PARSERS

    p = argparse.ArgumentParser(
        prog="minivllm serve",
        description="Serve a model over OpenAI's HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /metrics).",
    )
    p.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: --model)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a child process, so HTTP work does not compete "
                   "with it for the GIL (default: on)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests replace the chat template (chat_template, or "
                   "chat_template_kwargs.chat_template): their Jinja runs in the server")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="return a chat reply's thinking (<think>...</think>) apart, as "
                   "`reasoning_content` (as vLLM's flag)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body read; larger ones get 413 unread "
                   "(default: 8 MiB)")
    p.add_argument("--restart-engine", action="store_true",
                   help="when the engine dies, start a new one and keep serving (default: "
                   "the server exits with status 1, for a supervisor to restart it)")
    p.add_argument("--tool-call-parser", default=DEFAULT_TOOL_PARSER,
                   choices=sorted(TOOL_PARSERS),
                   help="how the model's tool calls are read under tool_choice auto "
                   f"(default: {DEFAULT_TOOL_PARSER}, the <tool_call> JSON of Qwen and "
                   "Hermes models)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(p)
    return p


def _progress(stage: str, fraction: float) -> None:
    print(f"minivllm serve: {stage} [{fraction:4.0%}]", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model_tag:
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        print(f"minivllm serve: --port {args.port}: must be in [0, 65535]", file=sys.stderr)
        return 1
    if args.stand_in_load_s < 0 or (args.stand_in_load_s and not args.stand_in_ms):
        print(f"minivllm serve: --stand-in-load-s {args.stand_in_load_s}: needs "
              "--stand-in-ms and must be >= 0", file=sys.stderr)
        return 1
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        print(f"minivllm serve: --max-request-bytes {args.max_request_bytes}: must be >= 1",
              file=sys.stderr)
        return 1
    # The port first: a taken one is reported at once, not after the model loaded.
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.create_server((args.host, args.port), family=family, backlog=2048)
    except OSError as exc:
        print(f"minivllm serve: cannot listen on {args.host}:{args.port}: "
              f"{os.strerror(exc.errno) if (exc.errno or 0) > 0 else exc}", file=sys.stderr)
        return 1
    with sock:
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    from ..frontend import EngineFrontend
    from ..frontend.engine_process import SWITCH_INTERVAL_S, EngineProcessClient
    from .api import DEFAULT_MAX_REQUEST_BYTES, build_app

    sys.setswitchinterval(SWITCH_INTERVAL_S)  # see its note
    # The server's own lines (warnings; per-request access lines at info) on stderr,
    # at --log-level like uvicorn's.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    server_log = logging.getLogger("minivllm.server")
    server_log.addHandler(handler)
    server_log.setLevel(args.log_level.upper())
    server_log.propagate = False

    def start_engine(client_box: list[Any] | None = None) -> Any:
        frontend: Any
        if args.engine_process:
            frontend = EngineProcessClient(functools.partial(build_engine, args))
        else:
            # Built on the thread that steps it (EngineFrontend: on the CPU it steps at
            # half speed elsewhere).
            frontend = EngineFrontend(engine_factory=functools.partial(build_engine, args),
                                      owns_engine=True)
        if client_box is not None:
            client_box.append(frontend)
        frontend.start(_progress)
        return frontend

    frontend = _Supervised(start_engine, restart=args.restart_engine)
    name = args.served_model_name or args.model
    app = build_app(frontend, model_name=name, api_key=args.api_key,
                    trust_request_chat_template=args.trust_request_chat_template,
                    max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
                    tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                            access_log=False)
    server = _Server(config, frontend)
    stop = threading.Event()
    # The port answers while the model loads (/health: 503 until it is ready), so a
    # router or an orchestrator's readiness probe can tell loading from down.
    watcher = threading.Thread(target=frontend.load_then_watch, args=(server, stop),
                               name="minivllm-engine-watch", daemon=True)
    try:
        port = sock.getsockname()[1]
        print(f"minivllm serve: {name} on http://{args.host}:{port}/v1 (loading)",
              file=sys.stderr, flush=True)
        watcher.start()
        server.run(sockets=[sock])
    finally:
        stop.set()
        frontend.close()  # aborts what is left and exits the engine (and its TP workers)
        watcher.join(5)
    if frontend.load_failed is not None:
        print(f"minivllm serve: {frontend.load_failed}", file=sys.stderr, flush=True)
        return 1
    if frontend.died is not None:
        print(f"minivllm serve: exiting, the engine stopped: {frontend.died}",
              file=sys.stderr, flush=True)
        return 1
    if not server.started:
        return 1  # uvicorn said why
    print("minivllm serve: stopped", file=sys.stderr, flush=True)
    return 0


class _Supervised:
    """The engine client the app talks to. `load_then_watch` (on its own thread) starts
    the engine while the server already answers (`loading` until then), then polls its
    health: when the engine dies (its process killed, its loop crashed) the server stops
    with status 1, so that whatever supervises it restarts it, or, with `restart`, a new
    engine is started and serves the next request. Open requests have already failed
    with the old engine."""

    def __init__(self, start: Callable[[list[Any] | None], Any], *, restart: bool) -> None:
        self.current: Any = None
        self._start = start
        self._restart = restart
        self._restarting: str | None = None
        self._starting: list[Any] = []  # the client being started, for close()
        self._loaded = threading.Event()
        self._closed = False
        self.load_failed: str | None = None  # why the first start failed
        self.died: str | None = None  # why the server is stopping, once it is

    @property
    def loading(self) -> bool:
        return self.current is None and self.load_failed is None

    @property
    def info(self) -> Any:
        return None if self.current is None else self.current.info

    @property
    def error(self) -> str | None:
        if self._restarting is not None:
            return f"the engine is restarting after it stopped: {self._restarting}"
        if self.load_failed is not None:
            return f"the engine failed to load: {self.load_failed}"
        return None if self.current is None else self.current.error

    @property
    def tokenizer(self) -> Any:
        return None if self.current is None else self.current.tokenizer

    def add_request(self, request: Any, on_output: Any) -> None:
        self.current.add_request(request, on_output)

    def abort(self, request_id: str) -> None:
        if self.current is not None:
            self.current.abort(request_id)

    def abort_all(self, refuse_new: bool = False) -> None:
        if self.current is not None:
            self.current.abort_all(refuse_new)

    def stats(self) -> Any:
        return None if self.current is None else self.current.stats()

    def prefix_cache_counters(self) -> Any:
        return None if self.current is None else self.current.prefix_cache_counters()

    def generate(self, request: Any) -> Any:
        from ..frontend import stream_outputs

        return stream_outputs(self, request)

    def close(self) -> None:
        """Stop a load in progress (its engine process is terminated), then the engine."""
        self._closed = True
        if not self._loaded.is_set():
            pid = getattr(next(iter(self._starting), None), "pid", None)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            self._loaded.wait()
        if self.current is not None:
            self.current.close()

    def load_then_watch(self, server: uvicorn.Server, stop: threading.Event) -> None:
        try:
            client = self._start(self._starting)
            # Before /health says ready: the start-up's objects leave the full passes
            # that would otherwise stall streams under load (see minivllm.heap).
            settle()
            self.current = client
        except BaseException as exc:  # noqa: BLE001 - the server exits with its message
            if not self._closed:  # not a load that close() stopped
                self.load_failed = str(exc) or type(exc).__name__
            server.should_exit = True
            return
        finally:
            self._loaded.set()
        if self._closed:
            return
        print("minivllm serve: the engine is ready", file=sys.stderr, flush=True)
        self.watch(server, stop)

    def watch(self, server: uvicorn.Server, stop: threading.Event) -> None:
        """Poll the engine's health until `stop`; act on its death."""
        while not stop.wait(0.2):
            client = self.current
            error = client.error
            if error is None:
                continue
            if stop.is_set():  # the server is closing the engine itself
                return
            client.close()  # waits for the dead child: no zombie left behind
            if self._restart:
                print(f"minivllm serve: the engine stopped ({error}); starting a new one",
                      file=sys.stderr, flush=True)
                self._restarting = error
                try:
                    self.current = self._start(None)
                    self._restarting = None
                    continue
                except Exception as exc:  # noqa: BLE001 - then the server stops
                    error = f"{error}; a new engine failed to start: {exc}"
            self.died = error
            server.should_exit = True
            return


class _Server(uvicorn.Server):
    """uvicorn's server, whose Ctrl-C / SIGTERM also aborts the requests in flight (so
    streaming responses end at once and the graceful shutdown does not wait on them)
    and ends with exit status 0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, frontend: Any) -> None:
        super().__init__(config)
        self.frontend = frontend

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.frontend.abort_all(refuse_new=True)
        super().handle_exit(sig, frame)
        # uvicorn re-raises the captured signals after shutting down; we exit 0 instead.
        captured = getattr(self, "_captured_signals", None)
        if captured is not None:
            captured.clear()
