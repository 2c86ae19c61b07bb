"""How long an engine step takes on this CPU while a long paste is prefilled beside a
streaming reply, per step token budget (`max_num_batched_tokens`): the numbers behind
`minivllm-chat`'s CPU default (`tui/cli.py`, CPU_STEP_TOKENS).

    python3 scripts/cpu_step_budget.py [--budgets 64 128 256 512] [--words 3000]
        [--threads N]

Per budget: one request streams (a short prompt, `ignore_eos`); once it decodes, a paste
of `--words` words is added in a second request (one reply token). Every step until the
paste's first token is timed: p50 / p90 / max of the step's wall time and of its CPU
time (the process's; on a shared machine the steadier figure: with one thread it is what
one idle core would take), the streaming request's tok/s meanwhile, and the paste's time
to its first token (TTFT). A throwaway prefill of one budget warms the shapes up first.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from minivllm import LLMEngine, SamplingParams

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WORDS = (
    "the engine schedules every request in steps and each step computes a bounded number of "
    "tokens so that a long prompt is split into chunks while other requests keep decoding "
    "one token at a time the cache holds keys and values in blocks that are shared between "
    "requests with the same prefix and freed when a request ends"
).split()


def paste(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def measure(budget: int, words: int, seed: int) -> dict[str, float]:
    engine = LLMEngine({"model_name_or_path": MODEL, "device": "cpu",
                        "max_model_length": 8192, "max_num_batched_tokens": budget})
    try:
        tok = engine.tokenizer
        engine.pop_deltas()  # streaming on
        warm = engine.add_prompt(list(range(1000, 1000 + budget)), SamplingParams(max_tokens=1))
        while not any(d.seq_id == warm and d.finished for d in engine.pop_deltas()):
            engine.step()
        chat = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
        stream = engine.add_prompt(
            tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
            SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True))
        for _ in range(3):  # the streaming request is past its prefill and decoding
            engine.step()
        engine.pop_deltas()
        long_chat = [{"role": "user", "content": "Summarise: " + paste(words, seed)}]
        start = time.perf_counter()
        big = engine.add_prompt(
            tok.apply_chat_template(long_chat, add_generation_prompt=True, tokenize=False),
            SamplingParams(temperature=0.0, max_tokens=1))
        prompt_tokens = engine.num_prompt_tokens(big)
        steps: list[float] = []
        cpu: list[float] = []
        streamed = 0
        ttft = None
        while ttft is None:
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step()
            steps.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            for d in engine.pop_deltas():
                if d.seq_id == stream:
                    streamed += len(d.token_ids)
                elif d.seq_id == big and d.token_ids:
                    ttft = time.perf_counter() - start
        engine.abort(stream)
        return {"prompt": prompt_tokens, "steps": len(steps), "p50": pct(steps, 50),
                "p90": pct(steps, 90), "max": max(steps), "cpu50": pct(cpu, 50),
                "cpu90": pct(cpu, 90), "cpumax": max(cpu), "stream_tok_s": streamed / ttft,
                "ttft": ttft}
    finally:
        engine.exit()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--words", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    print("| budget | paste tokens | steps | step wall p50 / p90 / max (s) | "
          "step CPU p50 / p90 / max (s) | streaming tok/s | paste TTFT (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for budget in args.budgets:
        r = measure(budget, args.words, args.seed)
        print(f"| {budget} | {r['prompt']:,} | {r['steps']} | {r['p50']:.2f} / "
              f"{r['p90']:.2f} / {r['max']:.2f} | {r['cpu50']:.2f} / {r['cpu90']:.2f} / "
              f"{r['cpumax']:.2f} | {r['stream_tok_s']:.2f} | {r['ttft']:.1f} |", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
