"""Pick a small model's default repetition penalty: the README's prompts, several seeds,
at the model's default sampling, for each penalty tried.

For each penalty: replies that loop (some 8-token span 3 or more times), replies cut at
max tokens, and the France question answered with "Paris". All replies of one penalty
run as one batch on one engine, built as `minivllm-chat` builds it.

    .venv/bin/python scripts/chat_sampling_sweep.py [--penalties 1.0 1.05 1.1 ...] [--seeds 3]
"""

from __future__ import annotations

import argparse
from collections import Counter

from minivllm import LLMEngine, SamplingParams
from minivllm.chat_defaults import chat_sampling_defaults
from minivllm.cli import check_engine_config
from minivllm.config import APP_CPU_WEIGHT_DTYPE
from minivllm.engine_args import DEFAULT_MODEL as DEFAULT_CHAT_MODEL

# The prompts the README and its screenshot show, and the one that looped at T=0.7.
PROMPTS = [
    "What is the capital of France?",
    "Say hi in French.",
    "Tell me a joke.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for writing clear commit messages, as a list.",
]
SPAN = 8


def loops(ids: list[int], span: int = SPAN, times: int = 3) -> bool:
    """Whether some `span`-token window occurs `times` times or more."""
    counts = Counter(tuple(ids[i:i + span]) for i in range(len(ids) - span + 1))
    return any(n >= times for n in counts.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_CHAT_MODEL)
    p.add_argument("--penalties", type=float, nargs="+", default=[1.0, 1.05, 1.1, 1.15, 1.2])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=None,
                   help="instead of the model's default")
    p.add_argument("--show", action="store_true", help="print seed 0's replies")
    args = p.parse_args()

    config = {"model_name_or_path": args.model, "device": "cpu", "max_model_length": 1024,
              "cpu_weight_dtype": APP_CPU_WEIGHT_DTYPE}
    defaults = chat_sampling_defaults(check_engine_config(config))
    defaults.pop("repetition_penalty", None)
    if args.temperature is not None:
        defaults["temperature"] = args.temperature
    llm = LLMEngine(config)
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, tokenize=False)
        for q in PROMPTS
    ]
    print(f"{args.model}: {defaults}, {len(PROMPTS)} prompts x {args.seeds} seeds, "
          f"max_tokens {args.max_tokens}")
    print("| repetition_penalty | looping replies | cut at max tokens | 'Paris' | mean tokens |")
    print("| --- | --- | --- | --- | --- |")
    for penalty in args.penalties:
        batch, params = [], []
        for seed in range(args.seeds):
            for prompt in prompts:
                batch.append(prompt)
                params.append(SamplingParams(max_tokens=args.max_tokens, seed=seed,
                                             repetition_penalty=penalty, **defaults))
        out = llm.generate(batch, params)
        ids, texts = out["token_ids"], out["text"]
        n = len(ids)
        looped = sum(loops(t) for t in ids)
        cut = sum(len(t) >= args.max_tokens for t in ids)
        paris = sum("Paris" in texts[i] for i in range(0, n, len(PROMPTS)))
        mean = sum(len(t) for t in ids) / n
        print(f"| {penalty:g} | {looped}/{n} | {cut}/{n} | {paris}/{args.seeds} | {mean:.0f} |",
              flush=True)
        if args.show:  # seed 0's replies, to read them
            for q, text in zip(PROMPTS, texts[:len(PROMPTS)], strict=True):
                print(f"    [{q[:24]}] {' '.join(text.split())[:150]}")
    llm.exit()


if __name__ == "__main__":
    main()
