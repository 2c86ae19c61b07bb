"""How close weight-only bf16 / int8 weights (`cpu_weight_dtype`) stay to fp32 weights on
SmolLM2-135M-Instruct: greedy agreement over N chat prompts, the first divergence, and
whether the diverging token is in fp32's top-5 there (fp32's logprobs at that position:
both runs share the prefix up to it).

    .venv/bin/python scripts/cpu_weight_accuracy.py [--tokens 64] [--formats bfloat16 int8]
        [--cpu-decode-dtype auto|int8|float32]

`--cpu-decode-dtype` runs the formats as the apps do (dtype auto, that decode dtype:
int8 activations with q4_1 / q8_0 weights need AVX512-VNNI); without it they keep fp32
compute throughout.
"""

from __future__ import annotations

import argparse
import statistics

import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Tell me a joke about computers.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish and German.",
    "Who wrote Romeo and Juliet?",
    "Give me a short tip for learning to code.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "What are the planets of the solar system?",
    "Describe a cat in one sentence.",
    "What should I pack for a weekend hike?",
    "Summarise the plot of Cinderella.",
    "What is the difference between a list and a tuple in Python?",
    "Name three famous painters.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a bakery.",
    "What is machine learning?",
    "Write a limerick about a dog.",
    "How many days are in a leap year?",
    "What is the boiling point of water in Fahrenheit?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--formats", nargs="+", default=["bfloat16", "int8"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-decode-dtype", default=None, choices=["auto", "int8", "float32"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from minivllm import LLMEngine, SamplingParams
    from minivllm.loader import resolve_model

    path = str(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))

    def engine(weights: str) -> LLMEngine:
        config = {"model_name_or_path": path, "device": "cpu", "dtype": "float32",
                  "cpu_weight_dtype": weights, "max_model_length": 1024}
        if args.cpu_decode_dtype and weights != "float32":
            config.update(dtype="auto", cpu_decode_dtype=args.cpu_decode_dtype)
        return LLMEngine(config)

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=5)
    ref_llm = engine("float32")
    prompts = [
        ref_llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    ref = ref_llm.generate(prompts, params)
    ref_llm.exit()
    print(f"{len(prompts)} chat prompts x {args.tokens} greedy tokens, against fp32 weights")
    for fmt in args.formats:
        llm = engine(fmt)
        out = llm.generate(prompts, params)
        decode = llm.cpu_decode_dtype or "float32"
        llm.exit()
        same, firsts, in_top5, gaps = 0, [], 0, []
        for want, got, lps in zip(ref["token_ids"], out["token_ids"], ref["logprobs"],
                                  strict=True):
            d = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
            if d is None:
                same += 1
                continue
            firsts.append(d)
            top = lps[d].top  # fp32's top-5 at the first divergence
            in_top5 += got[d] in top
            if got[d] in top:  # how close fp32's two candidates were there
                gaps.append(top[want[d]] - top[got[d]])
        diverged = len(prompts) - same
        print(
            f"{fmt} ({decode} decode): identical {same}/{len(prompts)}; diverged {diverged}"
            + (
                f" (first divergence at token {min(firsts)}..{max(firsts)}, median "
                f"{statistics.median(firsts)}; diverging token in fp32's top-5: "
                f"{in_top5}/{diverged}; fp32 logprob gap there: median "
                f"{statistics.median(gaps):.3f}, max {max(gaps):.3f})"
                if diverged
                else ""
            )
        )


if __name__ == "__main__":
    main()
