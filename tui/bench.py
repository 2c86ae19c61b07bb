"""Does the chat app slow the engine down? N panes streaming vs the same load headless.

    minivllm-chat --bench [--model M] [--panes 4] [--max-tokens 128] [--rounds 2]

One engine in one process; rounds alternate headless, app, headless, app, ..., headless,
so a machine whose load drifts (a shared CI box) biases neither side. A headless round
sends the requests through the app's engine loop (`EngineFrontend`, its own thread) with
no UI; an app round drives every pane of the real app through Textual's headless driver
at 160x48, rendering as it streams, with the engine on the same kind of loop. Same
greedy requests (the panes' templated prompts) after an untimed warm-up of each. Prints
generation tok/s of every round and app / headless (the app rounds' mean over the
headless rounds' mean), and the UI thread's CPU time per generated token (steadier than
tok/s on a shared machine).

A model without tokenizer files (`--load-format dummy` on a known config such as
Qwen/Qwen3-0.6B, as on the GPU machine) gets `BenchTokenizer`: the app needs text, and
random weights produce ids anywhere in the vocabulary.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import threading
import time
import zlib
from typing import Any

from minivllm.sampling_params import SamplingParams

from .conversation import Settings
from .engine_thread import render_prompt

TOPICS = ["a lighthouse keeper", "a robot learning to paint", "a city under the sea",
          "a dragon who collects books", "a time-travelling cat", "the first Mars colony",
          "a haunted library", "a chess tournament"]
WARMUP_TOKENS = 8

# What a dummy model's ids decode to: words, punctuation and Markdown (paragraphs, lists,
# emphasis, code), so the app renders roughly what a real reply costs it.
_BENCH_PIECES = (
    [f" {w}" for w in (
        "the a of and to in is was that it for on with as his her they at be this from "
        "keeper light sea ship night storm lamp tower waves stone old young lonely bright "
        "dark cold warm slowly quietly every long story began when would could never always"
    ).split()]
    + [".", ",", ";", ":", "!", "?", "\n\n", "\n- ", "\n1. ", " **", "** ", " `", "` ",
       "\n## ", " _", "_ ", "\n```python\n", "\n```\n", " (", ")", " 42", " 3.14"]
)
_PIECE_RE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


class BenchTokenizer:
    """Text <-> ids for a model without a tokenizer (random weights): id i decodes to
    `_BENCH_PIECES[i % len]`; text encodes piece by piece to ids below `vocab_size`.
    Only for measuring the app: the text means nothing."""

    chat_template = "{# bench stand-in #}"  # no `enable_thinking`: no thinking switch
    bos_token_id = None
    eos_token = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._index = {p: i for i, p in enumerate(_BENCH_PIECES)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self._index.get(p, zlib.crc32(p.encode()) % self.vocab_size)
                for p in _PIECE_RE.findall(text)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(_BENCH_PIECES[i % len(_BENCH_PIECES)] for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = False, tokenize: bool = False,
                            **_: Any) -> str | list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return self.encode(text) if tokenize else text


def ensure_tokenizer(engine: Any) -> bool:
    """Give a tokenizer-less engine a `BenchTokenizer`; returns whether it did."""
    if engine.tokenizer is not None:
        return False
    engine.tokenizer = BenchTokenizer(engine.config.model.vocab_size)
    engine.output_processor.tokenizer = engine.tokenizer  # detokenizes new requests
    return True


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    config = {"model_name_or_path": args.model, "device": args.device,
              "load_format": args.load_format, "max_model_length": 2048}
    if args.max_num_batched_tokens:
        config["max_num_batched_tokens"] = args.max_num_batched_tokens
    return config


def run_headless(engine: Any, texts: list[str], max_tokens: int) -> tuple[int, float]:
    """The same requests through the app's engine loop (`EngineFrontend`, on its own
    thread as in the app), with no UI: what the engine does without the app.

    NOTE: not a `step()` loop on the main thread: on a busy 2-core machine torch ran the
    same steps ~15x slower on the main thread than on a worker thread (measured 2 vs 30
    tok/s), which made the ratio meaningless.
    """
    from minivllm.frontend import EngineFrontend, GenerateRequest

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
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
        done.wait()
    finally:
        frontend.close()
    return counts["tokens"], end[0] - start


async def run_app(engine: Any, users: list[str], max_tokens: int,
                  ui_cpu: list[float] | None = None) -> tuple[int, float]:
    """One round through the app; appends the UI thread's CPU seconds to `ui_cpu`."""
    from .app import create_app
    from .testing import wait_idle, wait_ready

    app = create_app(engine, owns_engine=False, conversations=len(users), save_sessions=False,
                     settings=Settings(temperature=0.0, top_p=1.0, max_tokens=max_tokens))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_ready(pilot, 600)
        start, cpu = time.perf_counter(), time.thread_time()
        for pane, text in zip(app.panes, users, strict=True):
            await app.send(pane, text)
        await wait_idle(pilot, 3600)
        result = sum(p.tokens for p in app.panes), time.perf_counter() - start
        if ui_cpu is not None:
            ui_cpu.append(time.thread_time() - cpu)
        await pilot.press("ctrl+q")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minivllm-chat --bench",
                                description="generation tok/s with the chat app vs headless")
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--panes", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="app rounds (headless: one more)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 is steadier on a shared machine)")
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from minivllm import LLMEngine

    engine = LLMEngine(engine_config(args))
    try:
        if ensure_tokenizer(engine):
            print("no tokenizer with this model: BenchTokenizer turns ids into Markdown-ish "
                  "words", flush=True)
        users = prompts(args.panes)
        texts = [render_prompt(engine.tokenizer, [{"role": "user", "content": u}], True)
                 for u in users]
        run_headless(engine, texts, WARMUP_TOKENS)
        asyncio.run(run_app(engine, users, WARMUP_TOKENS))
        rates: dict[str, list[float]] = {"headless": [], "app": []}
        ui_cpu: list[float] = []
        tokens_app = 0
        for r in range(2 * args.rounds + 1):
            name = "headless" if r % 2 == 0 else "app"
            if name == "headless":
                tokens, seconds = run_headless(engine, texts, args.max_tokens)
            else:
                tokens, seconds = asyncio.run(run_app(engine, users, args.max_tokens, ui_cpu))
                tokens_app += tokens
            rates[name].append(tokens / seconds)
            print(f"{name:>9}: {tokens:6d} tokens in {seconds:7.2f} s = "
                  f"{rates[name][-1]:8.1f} tok/s", flush=True)
    finally:
        engine.exit()
    base = statistics.mean(rates["headless"])
    app = statistics.mean(rates["app"])
    print(f"app / headless: {app / base:.2f} ({args.panes} panes streaming, {args.max_tokens} "
          f"tokens each; mean of {len(rates['app'])} app rounds over "
          f"{len(rates['headless'])} interleaved headless rounds)")
    # CPU time is steadier than tok/s on a shared machine: what the UI thread spent.
    print(f"UI thread CPU: {1000 * sum(ui_cpu) / max(1, tokens_app):.2f} ms per generated token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
