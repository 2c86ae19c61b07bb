"""The CPU kernel set's C++ norm and SiLU (kernels/cpu_ops.py) against the torch references,
on one engine, interleaved round by round: time to first token of a 512-token prompt.

    .venv/bin/python scripts/cpu_prefill_ab.py [--rounds 5] [--threads 2]
        [--cpu-weight-dtype compact] [--tokens 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-weight-dtype", default="compact")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from minivllm import LLMEngine, SamplingParams
    from minivllm.layers.ops import TORCH_KERNELS, bind_kernels
    from minivllm.loader import resolve_model

    path = str(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))
    llm = LLMEngine({"model_name_or_path": path, "device": "cpu",
                     "cpu_weight_dtype": args.cpu_weight_dtype, "max_model_length": 2048,
                     "enable_prefix_caching": False})
    sets = {"cpu (C++ norm, SiLU)": llm.runner.kernels, "torch references": TORCH_KERNELS}
    rng = random.Random(0)
    vocab = llm.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1)

    def ttft() -> tuple[float, float]:
        prompt = [rng.randrange(vocab) for _ in range(args.tokens)]
        cpu, wall = time.process_time(), time.perf_counter()
        llm.generate([prompt], params)
        return (time.process_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3

    results: dict[str, list[tuple[float, float]]] = {name: [] for name in sets}
    for kernels in sets.values():  # untimed warm-up
        bind_kernels(llm.runner.model, kernels)
        ttft()
    for _ in range(args.rounds):
        for name, kernels in sets.items():
            bind_kernels(llm.runner.model, kernels)
            results[name].append(ttft())
    print(f"\nSmolLM2-135M, {llm.cpu_weight_format or 'fp32'} weights, {args.threads} thread(s), "
          f"TTFT of a {args.tokens}-token prompt, median of {args.rounds} interleaved rounds")
    for name, xs in results.items():
        cpu = statistics.median(x[0] for x in xs)
        wall = statistics.median(x[1] for x in xs)
        print(f"{name:22s} wall {wall:8.1f} ms   CPU {cpu:8.1f} ms")
    llm.exit()


if __name__ == "__main__":
    main()
