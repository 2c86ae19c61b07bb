"""Does the chat app slow the engine down? N panes streaming vs the same load headless.

    minivllm-chat --bench [--model M] [--panes 4] [--max-tokens 128] [--rounds 2]
                          [--engine real|gpu-like] [--engine-process off|on|both]

Rounds alternate headless, app, headless, app, ..., headless, so a machine whose load
drifts (a shared CI box) biases neither side. A headless round sends the requests through
the app's engine loop (`EngineFrontend`, its own thread) with no UI; an app round drives
every pane of the real app through Textual's headless driver at 160x48, rendering as it
streams; an app round starts once the chat screen has drawn itself. Same greedy requests
(the panes' templated prompts) after an untimed warm-up of each. Prints generation tok/s
of every round and two ratios (the app rounds' mean over the headless rounds' mean):
until every pane is idle (the replies rendered as Markdown), and engine side, until the
engine produced the last token (what the app costs the engine); and the UI thread's CPU
time per generated token (steadier than tok/s on a shared machine).

`--engine gpu-like` measures the GPU case on a CPU: the real engine over a scripted model
runner (`minivllm.server.standin.gpu_like_engine`) whose step holds the GIL `--host-ms`
(0.3) and then waits `--device-ms` (1.0) with it released, as a CUDA sync does.

The engine runs in a child process (`EngineProcessClient`), as the app's does by default
(`--engine-process on`); headless rounds then send the requests to that process with no
UI (so they include the pipe). `off` keeps the engine in the bench's process; `both`
interleaves app rounds of both kinds over one in-process headless baseline (two engines:
not on one GPU).

A model without tokenizer files (`--load-format dummy` on a known config such as
Qwen/Qwen3-0.6B, as on the GPU machine) gets `BenchTokenizer`: the app needs text, and
random weights produce ids anywhere in the vocabulary.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from minivllm.config import APP_CPU_WEIGHT_DTYPE
from minivllm.engine_args import EngineArgs
from minivllm.sampling_params import SamplingParams
from minivllm.tui.conversation import Settings
from minivllm.tui.engine_client import render_prompt
from minivllm.tui.engine_defaults import CPU_STEP_TOKENS, runs_on_cpu

DRAWN_AFTER = 0.3  # seconds from the chat screen's appearing to a round's first send
TOPICS = ["a lighthouse keeper", "a robot learning to paint", "a city under the sea",
          "a dragon who collects books", "a time-travelling cat", "the first Mars colony",
          "a haunted library", "a chess tournament"]
WARMUP_TOKENS = 8

def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    """The engine `minivllm-chat` would build: its CPU weights and, on a CPU, its step
    budget (without them the bench measured a bf16 engine on AVX-512 BF16 CPUs, 4x slower
    than the app's)."""
    config = EngineArgs.from_cli_args(args).engine_config()
    if args.max_num_batched_tokens is None and runs_on_cpu(args.device):
        config["max_num_batched_tokens"] = CPU_STEP_TOKENS
    return config


def run_headless(engine: Any, texts: list[str], max_tokens: int,
                 frontend: Any = None, timeout: float | None = None) -> tuple[int, float]:
    """The same requests through the app's engine loop (`EngineFrontend`, on its own
    thread as in the app), with no UI: what the engine does without the app. With a
    running `frontend` (any started `EngineClient`, such as the engine process), through
    that one.

    NOTE: not a `step()` loop on the main thread: on a busy 2-core machine torch ran the
    same steps ~15x slower on the main thread than on a worker thread (measured 2 vs 30
    tok/s), which made the ratio meaningless.
    """
    from minivllm.frontend import EngineFrontend, GenerateRequest

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    own = frontend is None
    if own:
        frontend = EngineFrontend(engine, owns_engine=False)
        frontend.start()
    lock = threading.Lock()
    done = threading.Event()
    counts = {"tokens": 0, "live": len(texts)}
    end = [0.0]

    def on_output(out: Any) -> None:
        with lock:
            counts["tokens"] += len(out.token_ids)
            if out.finished:
                counts["live"] -= 1
                if counts["live"] == 0:
                    end[0] = time.perf_counter()
                    done.set()

    try:
        start = time.perf_counter()
        for i, text in enumerate(texts):
            frontend.add_request(GenerateRequest(f"bench-{i}", params, prompt=text), on_output)
        if not done.wait(timeout):
            raise TimeoutError(f"a headless round did not finish within {timeout:.0f} s "
                               f"({counts['tokens']} tokens so far)")
    finally:
        if own:
            frontend.close()
    return counts["tokens"], end[0] - start


class _Borrowed:
    """A started client lent to one app round: the app's `start()` gets its info and its
    `close()` leaves it running for the next round.

    NOTE: every `EngineClient` member is spelled out: from Python 3.12 on, isinstance()
    against a runtime-checkable protocol looks members up statically, so a `__getattr__`
    proxy is not a client there (the app then took it for an engine and never started)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    @property
    def info(self) -> Any:
        return self._client.info

    @property
    def error(self) -> str | None:
        return self._client.error

    def start(self, on_progress: Any = None) -> Any:
        return self._client.info

    def add_request(self, request: Any, on_output: Any) -> None:
        self._client.add_request(request, on_output)

    def abort(self, request_id: str) -> None:
        self._client.abort(request_id)

    def stats(self) -> Any:
        return self._client.stats()

    def generate(self, request: Any) -> Any:
        return self._client.generate(request)

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:  # the client's extras (prompt_progress, ...)
        return getattr(self._client, name)


@dataclass
class AppRound:
    tokens: int
    seconds: float  # from the first send until every pane is idle (Markdown rendered)
    engine_seconds: float  # ... until the engine produced the last token
    ui_cpu: float  # the UI thread's CPU seconds over `seconds`
    lags: list[float]  # per pane and frame: seconds from the oldest new token to its frame


async def run_app(engine: Any, users: list[str], max_tokens: int,
                  ui_cpu: list[float] | None = None, client: Any = None,
                  timeout: float = 3600.0) -> AppRound:
    """One round through the app (the engine in this process, or a started `client`);
    appends the UI thread's CPU seconds to `ui_cpu`."""
    from minivllm.tui.app import create_app
    from minivllm.tui.testing import wait_idle, wait_ready

    settings = Settings(temperature=0.0, top_p=1.0, max_tokens=max_tokens)
    options: dict[str, Any] = {"conversations": len(users), "save_sessions": False,
                               "settings": settings}
    if client is not None:
        borrowed = _Borrowed(client)
        app = create_app(engine_factory=lambda on_progress: borrowed, **options)
    else:
        app = create_app(engine, owns_engine=False, **options)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_ready(pilot, timeout)
        # A user sends into a screen already drawn: the chat screen's first layout and
        # paints (tens of ms on a busy CPU) are the app starting, not what it costs to
        # stream, and are left out of the round.
        await asyncio.sleep(DRAWN_AFTER)
        start, cpu = time.monotonic(), time.thread_time()
        for pane, text in zip(app.panes, users, strict=True):
            await app.send(pane, text)
        try:
            await wait_idle(pilot, timeout)
        except AssertionError:
            tokens = sum(p.tokens for p in app.panes)
            raise TimeoutError(f"an app round did not finish within {timeout:.0f} s "
                               f"({tokens} tokens so far)") from None
        end, cpu = time.monotonic(), time.thread_time() - cpu
        # The engine's time of each pane's last token (RequestOutput.at: monotonic, which
        # is one clock for every process of the machine).
        last = max(p.last_token_at for p in app.panes)
        result = AppRound(sum(p.tokens for p in app.panes), end - start, last - start, cpu,
                          list(app.streams.frame_lags))
        if ui_cpu is not None:
            ui_cpu.append(cpu)
        await pilot.press("ctrl+q")
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm-chat --bench",
                                description="generation tok/s with the chat app vs headless")
    p.add_argument("--engine", default="real", choices=["real", "gpu-like"],
                   help="real: the model (default); gpu-like: a stand-in with a GPU engine's "
                   "timing (each step holds the GIL --host-ms, then waits --device-ms with it "
                   "released), to measure the GPU case on a CPU")
    p.add_argument("--host-ms", type=float, default=0.3,
                   help="gpu-like: host (GIL-held) ms per step (default 0.3)")
    p.add_argument("--device-ms", type=float, default=1.0,
                   help="gpu-like: GIL-free device wait ms per step (default 1.0)")
    p.add_argument("--engine-process", choices=["off", "on", "both"], default="on",
                   help="run the engine in a child process, as `minivllm-chat` does by "
                   "default: on (every round; the default), off (in the app's process), "
                   "both (app rounds in-process and with the engine process, interleaved; "
                   "two engines, so not on one GPU)")
    p.add_argument("--panes", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="app rounds (headless: one more)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 is steadier on a shared machine)")
    p.add_argument("--round-timeout", type=float, default=300.0, metavar="S",
                   help="a round that takes longer fails, printing where every thread is "
                   "(default 300)")
    # The engine `minivllm-chat` builds, with a context that holds the bench's replies.
    EngineArgs.add_cli_args(
        p.add_argument_group("engine"),
        defaults={"device": "auto", "max_model_length": 2048,
                  "cpu_weight_dtype": APP_CPU_WEIGHT_DTYPE},
        help_defaults={"max_num_batched_tokens": f"{CPU_STEP_TOKENS} on a CPU, else the "
                       "engine's"},
    )
    return p


def engine_spec(args: argparse.Namespace) -> Any:
    """What the bench's engine is, here or in its engine process; a real model without
    tokenizer files (random weights) gets `BenchTokenizer` once built."""
    from minivllm.tui.engine_spec import EngineSpec

    # Here, not at the top: it imports the engine (torch), which `--help` does without.
    from .bench_tokenizer import ensure_tokenizer

    if args.engine == "gpu-like":
        return EngineSpec("gpu-like", options={"host_ms": args.host_ms,
                                               "device_ms": args.device_ms},
                          threads=args.threads)
    return EngineSpec("llm", engine_config(args), prepare=ensure_tokenizer, threads=args.threads)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.panes < 1 or args.max_tokens < 1 or args.rounds < 1:
        print(f"minivllm-chat --bench: error: --panes={args.panes}, --max-tokens="
              f"{args.max_tokens} and --rounds={args.rounds} must be >= 1")
        return 1
    from minivllm.tui.engine_spec import build_engine, engine_process_client

    from .bench_tokenizer import BenchTokenizer

    spec = engine_spec(args)
    engine: Any = None
    client: Any = None
    modes = {"off": ["app"], "on": ["app (engine process)"],
             "both": ["app", "app (engine process)"]}[args.engine_process]
    t0 = time.monotonic()

    def note(what: str) -> None:  # progress, so a slow phase shows where it is
        print(f"  [{time.monotonic() - t0:6.1f} s] {what}", flush=True)

    timeout = args.round_timeout
    try:
        if args.engine_process != "on":
            engine = build_engine(spec, lambda stage, fraction: None)
            note("engine ready in this process")
        if args.engine_process != "off":
            client = engine_process_client(spec, quiet=False)
            client.start()
            note(f"engine process ready (pid {client.pid})")
        tokenizer = engine.tokenizer if engine is not None else client.tokenizer
        if isinstance(tokenizer, BenchTokenizer):
            print("no tokenizer with this model: BenchTokenizer turns ids into Markdown-ish "
                  "words", flush=True)
        users = prompts(args.panes)
        texts = [render_prompt(tokenizer, [{"role": "user", "content": u}], True)
                 for u in users]

        def headless(max_tokens: int) -> tuple[int, float]:
            if engine is not None:
                return run_headless(engine, texts, max_tokens, timeout=timeout)
            return run_headless(None, texts, max_tokens, client, timeout=timeout)

        def app_round(mode: str, max_tokens: int, ui: list[float] | None = None) -> AppRound:
            in_child = mode != "app"
            return asyncio.run(run_app(None if in_child else engine, users, max_tokens, ui,
                                       client if in_child else None, timeout))

        headless(WARMUP_TOKENS)
        note("headless warm-up done")
        for mode in modes:
            app_round(mode, WARMUP_TOKENS)
            note(f"{mode} warm-up done")
        base: list[float] = []
        rounds: dict[str, list[AppRound]] = {m: [] for m in modes}
        for r in range(2 * args.rounds + 1):
            if r % 2 == 0:
                tokens, seconds = headless(args.max_tokens)
                base.append(tokens / seconds)
                print(f"{'headless':>9}: {tokens:6d} tokens in {seconds:7.2f} s = "
                      f"{base[-1]:8.1f} tok/s", flush=True)
                continue
            for mode in (modes if r % 4 == 1 else modes[::-1]):
                a = app_round(mode, args.max_tokens)
                rounds[mode].append(a)
                print(f"{mode:>9}: {a.tokens:6d} tokens in {a.seconds:7.2f} s = "
                      f"{a.tokens / a.seconds:8.1f} tok/s (engine's last token at "
                      f"{a.engine_seconds:.2f} s: {a.tokens / a.engine_seconds:.1f} tok/s)",
                      flush=True)
    except TimeoutError as exc:
        print(f"minivllm-chat --bench: error: {exc}; every thread's stack follows", flush=True)
        for thread_id, frame in sys._current_frames().items():
            print(f"-- thread {thread_id}:\n" + "".join(traceback.format_stack(frame)),
                  flush=True)
        if client is not None and client.pid is not None:
            os.kill(client.pid, signal.SIGUSR1)  # the engine process prints its own
            time.sleep(1.0)
        return 1
    finally:
        if client is not None:
            client.close()
        if engine is not None:
            engine.exit()
    mean_base = statistics.mean(base)
    for mode, done in rounds.items():
        app = statistics.mean(a.tokens / a.seconds for a in done)
        eng = statistics.mean(a.tokens / a.engine_seconds for a in done)
        label = "" if mode == "app" else " [engine process]"
        print(f"app / headless: {app / mean_base:.2f}{label} ({args.panes} panes streaming, "
              f"{args.max_tokens} tokens each; mean of {len(done)} app rounds over "
              f"{len(base)} interleaved headless rounds; until every pane is idle)")
        print(f"app / headless, engine side: {eng / mean_base:.2f}{label} (until the engine's "
              "last token, without the final Markdown render)")
        # CPU time is steadier than tok/s on a shared machine: what the UI thread spent.
        ui = 1000 * sum(a.ui_cpu for a in done) / max(1, sum(a.tokens for a in done))
        print(f"UI thread CPU: {ui:.3f} ms per generated token{label}")
        lags = sorted(lag for a in done for lag in a.lags)
        if lags:
            p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
            print(f"frame lag (a token's production to the frame that shows it): p50 "
                  f"{1000 * lags[len(lags) // 2]:.0f} ms, p99 {1000 * p99:.0f} ms, max "
                  f"{1000 * lags[-1]:.0f} ms{label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
