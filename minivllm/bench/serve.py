"""`minivllm bench serve`: N concurrent streaming clients against `minivllm serve`, and
the same load in-process, in one run.

For each concurrency N: N requests start together, each a random token-id prompt of
`--prompt-len` tokens and `--output-len` new tokens (`ignore_eos`, greedy). Reported per
mode: output tok/s (all tokens / wall time from the first request sent to the last token),
time to first token and inter-token latency percentiles. Modes: `server` (HTTP + SSE
through a `minivllm serve` subprocess), `frontend` (the same requests through an
in-process `EngineFrontend`, what the app uses), `engine` (the bare add_prompt / step /
pop_deltas loop). The server runs first and is stopped before the in-process engine is
built (one KV pool fits the GPU at a time).

`--json-fraction F [F ...]`: that fraction of each run's clients ask for a JSON schema
(structured outputs; they stop where the grammar ends), each fraction measured in turn,
interleaved within a round; `plain tok/s` is the rate of the unconstrained clients alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..server.cli import add_engine_arguments, build_engine
from ..server.launch import descendants, launch_server

# What the constrained clients ask for: an object whose array of strings can go on for as
# long as the model likes (the stand-in's random tokens close it late, if ever).
BENCH_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "items": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "items"]}


@dataclass
class Trace:
    """One request as its client saw it: when it was sent, and when tokens arrived."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, new tokens)
    constrained: bool = False  # asked for BENCH_SCHEMA

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    def ttft(self) -> float:
        return self.arrivals[0][0] - self.sent

    def itls(self) -> list[float]:
        out = []
        for (t0, _), (t1, n) in zip(self.arrivals, self.arrivals[1:], strict=False):
            out.extend([(t1 - t0) / n] * n)
        return out


@dataclass
class Result:
    mode: str
    concurrency: int
    wall_s: float
    traces: list[Trace]
    # CPU seconds the server spent: its event loop thread, its other threads (the engine
    # thread, or the thread reading the engine process's outputs), its child processes
    # (the engine process); nan where not measured.
    loop_cpu_s: float = float("nan")
    threads_cpu_s: float = float("nan")
    children_cpu_s: float = float("nan")

    @property
    def tokens(self) -> int:
        return sum(t.num_tokens for t in self.traces)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def plain_tok_s(self) -> float:
        """Output tok/s of the unconstrained clients: their tokens over the time from the
        first request sent to their last token."""
        plain = [t for t in self.traces if not t.constrained and t.arrivals]
        if not plain:
            return float("nan")
        start = min(t.sent for t in self.traces)
        end = max(t.arrivals[-1][0] for t in plain)
        return sum(t.num_tokens for t in plain) / (end - start)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def workload(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, min(vocab, 10000) - 1) for _ in range(prompt_len)]
            for _ in range(n)]


def num_constrained(n: int, fraction: float) -> int:
    """How many of n clients ask for the schema (the first ones)."""
    return round(n * fraction)


# -- server -----------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, argv: list[str], checkout: str | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """`minivllm serve` with our engine flags; from `checkout` (another clone of the
    repository, imported first) when given, for a before/after comparison."""
    tag = f"-{Path(checkout).name}" if checkout else ""
    log = Path(tempfile.gettempdir()) / f"minivllm-bench-serve-{os.getpid()}{tag}.log"
    env = cwd = None
    if checkout:
        # `python -c` puts its working folder first on sys.path: run it in the checkout.
        cwd = Path(checkout).resolve()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(cwd), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return launch_server(["--served-model-name", "bench", *argv], log, cwd=cwd,
                         timeout=args.start_timeout, env=env)


def cpu_seconds(pid: int) -> tuple[float, float, float]:
    """CPU seconds of the server's main thread (the event loop), its other threads, and
    its child processes (the engine process, its workers) from /proc; nan without it."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    main = other = children = 0.0
    try:
        pids = [pid, *descendants(pid)]
    except OSError:
        return float("nan"), float("nan"), float("nan")
    for p in pids:
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            used = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            if int(task) == pid:
                main += used
            elif p == pid:
                other += used
            else:
                children += used
    return main, other, children


async def _http_request(client: Any, prompt: list[int], max_tokens: int,
                        model: str = "bench", constrained: bool = False) -> Trace:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "return_token_ids": True}
    if constrained:  # the end comes where the grammar ends
        body.update(ignore_eos=False, structured_outputs={"json": BENCH_SCHEMA})
    trace = Trace(time.perf_counter(), constrained=constrained)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            for choice in json.loads(line[6:]).get("choices", ()):
                n = len(choice.get("token_ids") or ())
                if n:
                    trace.arrivals.append((now, n))
    return trace


async def run_http(url: str, prompts: list[list[int]], max_tokens: int,
                   model: str = "bench", constrained: int = 0, ready: Any = None
                   ) -> tuple[float, list]:
    """The prompts as concurrent streaming requests; the first `constrained` ask for
    BENCH_SCHEMA. With `ready` (a barrier), they start once every client process is
    ready."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        # NOTE: one request before the clock starts. A process's first request paid the
        # HTTP stack's lazy imports and its first connection (50-150 ms), which showed as
        # the server's TTFT p99 in every run (one request per client process).
        await client.get("/health")
        if ready is not None:
            ready.wait()  # blocks the loop, which has nothing else to do yet
        start = time.perf_counter()
        traces = await asyncio.gather(*(_http_request(client, p, max_tokens, model,
                                                      i < constrained)
                                        for i, p in enumerate(prompts)))
    end = max(t.arrivals[-1][0] for t in traces)
    return end - start, list(traces)


def _client_process(url: str, prompts: list[list[int]], max_tokens: int, model: str,
                    ready: Any, results: Any, constrained: int = 0) -> None:
    # Every client process starts its requests at the same moment (`ready`), its client
    # built and warmed up before.
    _, traces = asyncio.run(run_http(url, prompts, max_tokens, model, constrained, ready))
    results.put([(t.sent, t.arrivals, t.constrained) for t in traces])


def run_http_processes(url: str, prompts: list[list[int]], max_tokens: int,
                       processes: int, model: str = "bench", constrained: int = 0
                       ) -> tuple[float, list]:
    """`run_http` with the clients spread over `processes` processes.

    NOTE: one Python client parsing every SSE event of 32-64 fast streams is the slowest
    part of the run (~30-60 us an event): it read late, which showed as the server's
    TTFT and throughput. Spread out, the clients keep up with the server.
    (`time.perf_counter` is the machine's monotonic clock: one clock for all processes.)
    """
    processes = max(1, min(processes, len(prompts)))
    if processes == 1:
        return asyncio.run(run_http(url, prompts, max_tokens, model, constrained))
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Barrier(processes + 1), ctx.Queue()
    # Process i takes prompts i, i + K, ...: the constrained ones among them come first.
    workers = [ctx.Process(target=_client_process, daemon=True,
                           args=(url, prompts[i::processes], max_tokens, model, ready,
                                 results, len(range(i, constrained, processes))))
               for i in range(processes)]
    for w in workers:
        w.start()
    ready.wait(timeout=120)
    traces = [Trace(sent, arrivals, constrained) for _ in workers
              for sent, arrivals, constrained in results.get(timeout=3600)]
    for w in workers:
        w.join(30)
    start = min(t.sent for t in traces)
    return max(t.arrivals[-1][0] for t in traces) - start, traces


# -- in process -------------------------------------------------------------------------------


def bench_params(max_tokens: int, constrained: bool) -> Any:
    from minivllm import SamplingParams, StructuredOutputsParams

    if constrained:
        return SamplingParams(temperature=0, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=BENCH_SCHEMA))
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def run_frontend(frontend: Any, prompts: list[list[int]], max_tokens: int,
                       constrained: int = 0) -> tuple[float, list]:
    from minivllm.frontend import GenerateRequest

    async def one(i: int, prompt: list[int]) -> Trace:
        trace = Trace(time.perf_counter(), constrained=i < constrained)
        params = bench_params(max_tokens, i < constrained)
        request = GenerateRequest(f"bench-{time.monotonic_ns()}-{i}", params, prompt=prompt)
        async for out in frontend.generate(request):
            if out.token_ids:
                trace.arrivals.append((time.perf_counter(), len(out.token_ids)))
        return trace

    start = time.perf_counter()
    traces = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    end = max(t.arrivals[-1][0] for t in traces)
    return end - start, list(traces)


def run_engine(llm: Any, prompts: list[list[int]], max_tokens: int, constrained: int = 0
               ) -> tuple[float, list]:
    start = time.perf_counter()
    traces = {llm.add_prompt(p, bench_params(max_tokens, i < constrained)):
              Trace(start, constrained=i < constrained) for i, p in enumerate(prompts)}
    left = len(traces)
    while left:
        llm.step()
        now = time.perf_counter()
        for d in llm.pop_deltas():
            if d.seq_id in traces:
                if d.token_ids:
                    traces[d.seq_id].arrivals.append((now, len(d.token_ids)))
                left -= d.finished
    end = max(t.arrivals[-1][0] for t in traces.values())
    return end - start, list(traces.values())


# -- main -------------------------------------------------------------------------------------


SERVED_MODES = {"server": [], "server-thread": ["--no-engine-process"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=["server", "frontend", "engine"],
                   choices=[*SERVED_MODES, "frontend", "engine"],
                   help="server: `minivllm serve` (engine in its own process); "
                   "server-thread: the same with --no-engine-process; frontend: "
                   "EngineFrontend in process; engine: the bare step loop")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every measurement; the table shows the median round")
    p.add_argument("--baseline", metavar="CHECKOUT",
                   help="also serve from this other clone of the repository (imported "
                   "first): mode 'baseline' (with --stand-in-ms, interleaved)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json-fraction", type=float, nargs="+", default=[0.0], metavar="F",
                   help="the fraction of clients that ask for a JSON schema (structured "
                   "outputs); several: each measured in turn, interleaved")
    p.add_argument("--client-processes", type=int, default=None, metavar="K",
                   help="processes the HTTP clients are spread over (default: one per 16 "
                   "clients, at most half the CPUs)")
    add_engine_arguments(p, show_stand_in=True)
    return p


_OWN_FLAGS = {"--concurrency", "--prompt-len", "--output-len", "--modes", "--start-timeout",
              "--rounds", "--baseline", "--client-processes", "--json-fraction"}


def _label(mode: str, fraction: float) -> str:
    """The mode's name in the table: with the share of JSON-schema clients, if any."""
    return f"{mode}+json{fraction:.0%}" if fraction > 0 else mode


def client_processes(args: argparse.Namespace, concurrency: int) -> int:
    if args.client_processes is not None:
        return args.client_processes
    return max(1, min(-(-concurrency // 16), (os.cpu_count() or 2) // 2))


def _engine_argv(argv: list[str]) -> list[str]:
    """The engine flags of our command line, passed on to `minivllm serve` as given."""
    out, skip = [], False
    for arg in argv:
        if arg.startswith("--"):
            skip = arg.split("=", 1)[0] in _OWN_FLAGS
        if not skip:
            out.append(arg)
    return out


def _measure_http(mode: str, proc: subprocess.Popen, url: str, prompts: list[list[int]],
                  max_tokens: int, client_processes: int, constrained: int = 0) -> Result:
    before = cpu_seconds(proc.pid)
    wall, traces = run_http_processes(url, prompts, max_tokens, client_processes,
                                      constrained=constrained)
    after = cpu_seconds(proc.pid)
    return Result(mode, len(prompts), wall, traces,
                  *(a - b for a, b in zip(after, before, strict=True)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    bad = [f for f in args.json_fraction if not 0 <= f <= 1]
    if bad:
        print(f"minivllm bench serve: error: --json-fraction {bad[0]}: must be in [0, 1]",
              file=sys.stderr)
        return 2
    results: list[Result] = []
    vocab = 10000
    prompts = {n: workload(n, args.prompt_len, vocab, seed=n) for n in args.concurrency}
    # The warm-up sends the largest load once, a few tokens each: a kernel that compiles
    # on its first prefill of a new shape is then not timed in the first measured run
    # (the in-process engine, built later, would find it compiled in the disk cache).
    warm = workload(max(args.concurrency), args.prompt_len, vocab, seed=12345)
    # Each served mode: (the checkout it runs from, extra `minivllm serve` flags).
    served = {mode: (None, flags) for mode, flags in SERVED_MODES.items() if mode in args.modes}
    if args.baseline:
        served["baseline"] = (args.baseline, [])
    # The stand-in holds no device memory: its servers run side by side, rounds
    # interleaved. Real engines take turns (one KV pool fits the GPU at a time).
    groups = [list(served)] if args.stand_in_ms else [[mode] for mode in served]
    for group in groups:
        servers: dict[str, tuple[subprocess.Popen, str]] = {}
        try:
            for mode in group:
                checkout, flags = served[mode]
                servers[mode] = start_server(args, [*_engine_argv(argv), *flags], checkout)
            for _, url in servers.values():
                # With constrained clients, one warm-up request compiles the schema first.
                asyncio.run(run_http(url, warm, 4, constrained=int(any(args.json_fraction))))
            for _ in range(args.rounds):
                for n in args.concurrency:
                    for f in args.json_fraction:
                        for mode, (proc, url) in servers.items():
                            results.append(_measure_http(
                                _label(mode, f), proc, url, prompts[n], args.output_len,
                                client_processes(args, n), num_constrained(n, f)))
                            print_row(results[-1], results)
        finally:
            for proc, _ in servers.values():
                proc.send_signal(signal.SIGTERM)
            for proc, _ in servers.values():
                proc.wait(60)
    if "frontend" in args.modes or "engine" in args.modes:
        from minivllm.frontend import EngineFrontend

        llm = build_engine(args)
        try:
            run_engine(llm, warm, 4, int(any(args.json_fraction)))
            for _ in range(args.rounds):
                for n, f in ((n, f) for n in args.concurrency for f in args.json_fraction):
                    k = num_constrained(n, f)
                    if "engine" in args.modes:
                        cpu = time.process_time()
                        wall, traces = run_engine(llm, prompts[n], args.output_len, k)
                        results.append(Result(_label("engine", f), n, wall, traces,
                                              float("nan"), time.process_time() - cpu, 0.0))
                        print_row(results[-1], results)
                    if "frontend" in args.modes:
                        frontend = EngineFrontend(llm, owns_engine=False)
                        frontend.start()
                        try:
                            wall, traces = asyncio.run(run_frontend(
                                frontend, prompts[n], args.output_len, k))
                        finally:
                            frontend.close()
                        results.append(Result(_label("frontend", f), n, wall, traces))
                        print_row(results[-1], results)
        finally:
            llm.exit()
    print_table(results)
    return 0


MODES = (*SERVED_MODES, "baseline", "frontend", "engine")
HEADER = (f"{'mode':<17} {'N':>3} {'out tok/s':>10} {'plain tok/s':>11} {'vs engine':>9} "
          f"{'TTFT p50':>9} "
          f"{'p90':>8} {'p99':>8} {'ITL p50':>8} {'p90':>8} {'p99':>8} "
          f"{'CPU us/tok: loop':>16} {'threads':>7} {'children':>8}")


def _median(results: list[Result], mode: str, n: int) -> Result | None:
    """The round with the median tok/s for this mode and concurrency."""
    rs = sorted((r for r in results if r.mode == mode and r.concurrency == n),
                key=lambda r: r.tok_s)
    return rs[(len(rs) - 1) // 2] if rs else None


def _fmt(r: Result, results: list[Result]) -> str:
    base = _median(results, "engine", r.concurrency)
    ratio = f"{r.tok_s / base.tok_s:8.0%}" if base is not None else f"{'':>8}"
    ttft = [t.ttft() * 1e3 for t in r.traces]
    itl = [x * 1e3 for t in r.traces for x in t.itls()]
    per_tok = 1e6 / max(1, r.tokens)
    return (f"{r.mode:<17} {r.concurrency:>3} {r.tok_s:>10.1f} {r.plain_tok_s:>11.1f} "
            f"{ratio:>9} "
            f"{pct(ttft, 50):>9.1f} {pct(ttft, 90):>8.1f} {pct(ttft, 99):>8.1f} "
            f"{pct(itl, 50):>8.1f} {pct(itl, 90):>8.1f} {pct(itl, 99):>8.1f} "
            f"{r.loop_cpu_s * per_tok:>16.1f} {r.threads_cpu_s * per_tok:>7.1f} "
            f"{r.children_cpu_s * per_tok:>8.1f}")


def print_row(r: Result, results: list[Result]) -> None:
    print(_fmt(r, results), file=sys.stderr, flush=True)


def print_table(results: list[Result]) -> None:
    rounds = max((sum(1 for x in results if x.mode == r.mode and x.concurrency == r.concurrency)
                  for r in results), default=1)
    print("\nbench serve: output tok/s, TTFT and inter-token latency (ms) per concurrency"
          + (f" (median of {rounds} rounds)" if rounds > 1 else ""))
    print("CPU per output token (us): the server's event loop thread, its other threads "
          "(the engine's, or the engine process's reader) and its child processes (the "
          "engine process); for 'engine', the whole process")
    print(HEADER)
    concurrencies = sorted({r.concurrency for r in results})
    modes = [*MODES, *dict.fromkeys(r.mode for r in results if r.mode not in MODES)]
    for n in concurrencies:
        for mode in modes:
            r = _median(results, mode, n)
            if r is not None:
                print(_fmt(r, results))
    for n in concurrencies:
        for served in (*SERVED_MODES, "baseline"):
            s = _median(results, served, n)
            for mode in ("frontend", "engine"):
                b = _median(results, mode, n)
                if s is not None and b is not None:
                    print(f"{served} / in-process {mode} at N={n}: {s.tok_s / b.tok_s:.0%}")
