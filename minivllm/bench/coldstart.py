"""`minivllm bench coldstart`: start-up and the first requests' slowest step with an empty
Triton cache, measured in a child process of its own."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from .. import SamplingParams
from ..engine_args import EngineArgs
from .common import Row, build_engine, sync


def bench_coldstart(args: argparse.Namespace) -> list[Row]:
    """Start-up and the first requests' slowest step with an empty Triton cache: the
    measurement runs in a child process whose TRITON_CACHE_DIR is a new empty folder."""
    if args.child:
        print(json.dumps(coldstart_child(args)))
        return []
    with tempfile.TemporaryDirectory(prefix="minivllm-triton-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        argv = [sys.executable, "-m", "minivllm.cli", "bench", "coldstart",
                *_coldstart_argv(args), "--child"]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the cold-start run failed: {done.stderr.strip()[-2000:]}")
    result = json.loads(lines[-1])
    rows = [
        Row("cold start-up", result["startup_s"], "s", "LLMEngine(...) with an empty Triton cache"),
        Row("cold slowest step", result["slowest_step_ms"], "ms",
            f"over the first requests ({result['requests']})"),
    ]
    for name, ms in result["first_steps"]:
        rows.append(Row(f"cold first step, {name}", ms, "ms", "slowest step of that request"))
    return rows


def _coldstart_argv(args: argparse.Namespace) -> list[str]:
    return [*EngineArgs.from_cli_args(args).cli_args(),
            "--cold-lens", *map(str, args.cold_lens),
            "--cold-decoders", str(args.cold_decoders),
            "--cold-arrival", str(args.cold_arrival)]


def coldstart_child(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    llm = build_engine(args)
    sync(llm)
    startup = time.perf_counter() - start
    vocab = llm.config.model.vocab_size
    rng = random.Random(0)
    limit = min(llm.config.max_len - 1, llm.config.max_num_batched_tokens)
    lens = [n for n in args.cold_lens if n <= limit]

    def slowest_step(prompts: list[list[int]], max_tokens: int) -> float:
        for p in prompts:
            llm.add_prompt(p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                             ignore_eos=True))
        worst = 0.0
        while not llm.scheduler.is_finished():
            sync(llm)
            t = time.perf_counter()
            llm.step()
            sync(llm)
            worst = max(worst, time.perf_counter() - t)
        return worst * 1e3

    first_steps = []
    for n in lens:  # lone requests of varied lengths
        first_steps.append((f"{n} tokens", slowest_step([[rng.randrange(vocab)
                                                          for _ in range(n)]], 4)))
    # Mid-stream: sequences decoding while a long prompt arrives (a mixed step).
    decoders = [[rng.randrange(vocab) for _ in range(rng.randint(20, 200))]
                for _ in range(args.cold_decoders)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for p in decoders:
        llm.add_prompt(p, params)
    llm.step()  # their prefill
    arriving = [rng.randrange(vocab) for _ in range(min(args.cold_arrival, limit))]
    first_steps.append((f"{args.cold_decoders} decoding + {len(arriving)}-token arrival",
                        slowest_step([arriving], 4)))
    llm.exit()
    return {
        "startup_s": startup,
        "slowest_step_ms": max(ms for _, ms in first_steps),
        "first_steps": first_steps,
        "requests": ", ".join(name for name, _ in first_steps),
    }
