"""Does the chat app slow the engine down? N panes streaming vs the same load headless.

    python -m minivllm.tui.bench [--model M] [--panes 4] [--max-tokens 128] [--device D]

Each run is its own process, set up the way a user would run it: headless builds the
engine and loops `add_prompt` / `step` / `pop_deltas` on the main thread; the app run
builds it on the app's engine thread (as `minivllm-chat` does) and drives every pane
through Textual's headless driver at 160x48, rendering as it streams. Same greedy
requests (the panes' templated prompts) after a short warm-up round in both. Prints
generation tok/s for headless, app, headless again, and the app / headless ratio.
`main(argv)` is what `minivllm bench chat` can call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from minivllm.sampling_params import SamplingParams

from .conversation import Settings
from .engine_thread import render_prompt

TOPICS = ["a lighthouse keeper", "a robot learning to paint", "a city under the sea",
          "a dragon who collects books", "a time-travelling cat", "the first Mars colony",
          "a haunted library", "a chess tournament"]
WARMUP_TOKENS = 8


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"model_name_or_path": args.model, "device": args.device,
            "load_format": args.load_format}


def run_headless(engine: Any, texts: list[str], max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    for text in texts:
        engine.add_prompt(text, params)
    tokens, live = 0, len(texts)
    while live:
        engine.step()
        for d in engine.pop_deltas():
            tokens += len(d.token_ids)
            live -= d.finished
    return tokens, time.perf_counter() - start


def headless(args: argparse.Namespace) -> tuple[int, float]:
    from minivllm import LLMEngine

    engine = LLMEngine(engine_config(args))
    try:
        users = prompts(args.panes)
        texts = [render_prompt(engine.tokenizer, [{"role": "user", "content": u}], True)
                 for u in users]
        run_headless(engine, texts, WARMUP_TOKENS)
        return run_headless(engine, texts, args.max_tokens)
    finally:
        engine.exit()


async def through_app(args: argparse.Namespace) -> tuple[int, float]:
    from minivllm import LLMEngine

    from .app import create_app
    from .testing import wait_idle, wait_ready

    config = engine_config(args)
    app = create_app(
        engine_factory=lambda on_progress: LLMEngine(config, on_progress=on_progress),
        conversations=args.panes, save_sessions=False,
        settings=Settings(temperature=0.0, top_p=1.0, max_tokens=WARMUP_TOKENS),
    )
    users = prompts(args.panes)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_ready(pilot, 600)

        async def round_(max_tokens: int) -> tuple[int, float]:
            for pane in app.panes:
                await pane.clear()
                pane.conversation.settings.max_tokens = max_tokens
            start = time.perf_counter()
            for pane, text in zip(app.panes, users, strict=True):
                await app.send(pane, text)
            await wait_idle(pilot, 3600)
            return sum(p.tokens for p in app.panes), time.perf_counter() - start

        await round_(WARMUP_TOKENS)
        result = await round_(args.max_tokens)
        await pilot.press("ctrl+q")
    return result


def _child(mode: str, argv: list[str]) -> tuple[int, float]:
    out = subprocess.run([sys.executable, "-m", "minivllm.tui.bench", "--mode", mode, *argv],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"bench {mode} failed:\n{out.stderr[-3000:]}")
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    r = json.loads(line)
    return r["tokens"], r["seconds"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minivllm bench chat",
                                description="generation tok/s with the chat app vs headless")
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--panes", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--mode", choices=["headless", "app"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode is not None:  # one measurement, in this process
        tokens, seconds = headless(args) if args.mode == "headless" else asyncio.run(
            through_app(args))
        print(json.dumps({"tokens": tokens, "seconds": seconds}))
        return 0
    argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    rows = [("headless", _child("headless", argv)), ("app", _child("app", argv)),
            ("headless again", _child("headless", argv))]
    rates = {}
    for name, (tokens, seconds) in rows:
        rates[name] = tokens / seconds if seconds else 0.0
        print(f"{name:>15}: {tokens:6d} tokens in {seconds:7.2f} s = {rates[name]:8.1f} tok/s")
    base = (rates["headless"] + rates["headless again"]) / 2
    print(f"{'app / headless':>15}: {rates['app'] / base if base else 0.0:.2f} "
          f"({args.panes} panes streaming; generation tok/s with the app vs headless)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
