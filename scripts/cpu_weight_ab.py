"""fp32 vs bf16 vs int8 CPU weights (`cpu_weight_dtype`, issue 10), and the native vs the
compiled decode step (`--steps`), in one process, interleaved round by round.

One engine per (weights, step) on SmolLM2-135M-Instruct (fp32 compute); each round
times, on each engine in turn: batch-1 decode (ms a token after the prefill), 8 prompts x
`--new-tokens` (ms a decode step, and output tok/s over the whole run, prefill included),
and a 512-token prompt's first token. CPU time of this process and wall time are both
printed: on a machine shared with other work, CPU time is the steadier figure. Start-up to
the first token (engine built, warm caches, the kernel's extension loaded from its cache,
then a 16-token prompt's first token) is measured once per engine. `--profile` adds where a
batch-1 token's time goes (torch.profiler: the weights' products vs the rest).

    .venv/bin/python scripts/cpu_weight_ab.py [--rounds 3] [--threads 1] [--profile]
        [--formats float32 bfloat16 int8] [--steps native compiled]

(The native step calls the products from C++: its profile counts them as "rest".)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

FORMATS = ("float32", "bfloat16", "int8")
# A "format" that is not a cpu_weight_dtype: the model in bf16 (oneDNN's products; on a CPU
# with AVX-512 BF16 / AMX, dtype="auto" picks it).
BF16_COMPUTE = "bf16-compute"
# Self time of these ops is "the weights' products" in the profile.
LINEAR_OPS = ("minivllm_cpu::lowp_linear", "aten::mm", "aten::addmm", "aten::linear",
              "mkldnn::_linear_pointwise")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--steps", nargs="+", default=["native"],
                        choices=["native", "compiled"])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from minivllm import LLMEngine, SamplingParams
    from minivllm.loader import resolve_model

    path = str(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))
    rng = random.Random(0)
    engines: dict[str, LLMEngine] = {}
    startup: dict[str, float] = {}
    os.environ["MINIVLLM_CPU_COMPILE"] = "1"
    variants = [(fmt, step) for fmt in args.formats for step in args.steps]
    for fmt, step_kind in variants:
        os.environ["MINIVLLM_CPU_STEP"] = step_kind
        if len(args.steps) > 1:
            fmt = f"{fmt}/{step_kind}"
        start = time.perf_counter()
        weights = fmt.split("/")[0]
        bf16 = weights == BF16_COMPUTE
        llm = LLMEngine({"model_name_or_path": path, "device": "cpu",
                         "dtype": "bfloat16" if bf16 else "float32",
                         "cpu_weight_dtype": "auto" if bf16 else weights,
                         "max_model_length": 1024,
                         "max_cached_blocks": 24, "block_size": 256})
        llm.generate([[rng.randrange(1000) for _ in range(16)]],
                     SamplingParams(temperature=0, max_tokens=1))
        startup[fmt] = time.perf_counter() - start
        if llm.runner.cpu_step is None:
            print(f"{fmt}: the model's eager decode step (no native or compiled step here)")
        engines[fmt] = llm
    vocab = next(iter(engines.values())).config.model.vocab_size

    def decode(llm: LLMEngine, batch: int, new_tokens: int) -> tuple[float, ...]:
        """(CPU, wall) ms a decode step, then (CPU, wall) s of the whole run."""
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(batch):
            llm.add_prompt([rng.randrange(vocab) for _ in range(128)], params)
        llm.step()  # the prefill
        cpu, wall, steps = time.process_time(), time.perf_counter(), 0
        while not llm.scheduler.is_finished():
            llm.step()
            steps += 1
        cpu1, wall1 = time.process_time(), time.perf_counter()
        return ((cpu1 - cpu) * 1e3 / steps, (wall1 - wall) * 1e3 / steps,
                cpu1 - cpu0, wall1 - wall0)

    def ttft(llm: LLMEngine) -> tuple[float, float]:
        prompt = [rng.randrange(vocab) for _ in range(512)]
        cpu, wall = time.process_time(), time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        return (time.process_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3

    results: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    for llm in engines.values():  # untimed warm-up of each shape
        decode(llm, 1, 4), decode(llm, 8, 4), ttft(llm)
    for _ in range(args.rounds):
        for fmt, llm in engines.items():
            results.setdefault((fmt, "b1"), []).append(decode(llm, 1, 33))
            results.setdefault((fmt, "b8"), []).append(decode(llm, 8, args.new_tokens))
            results.setdefault((fmt, "ttft"), []).append(ttft(llm))

    def med(fmt: str, fig: str, i: int) -> float:
        return statistics.median(x[i] for x in results[(fmt, fig)])

    steps = "/".join(args.steps)
    print(f"\nSmolLM2-135M, fp32 compute, {steps} decode step; {args.rounds} interleaved "
          f"rounds, {args.threads} thread(s); medians, CPU time (wall in brackets)")
    print(f"{'weights':17s} {'batch-1 ms/token':>22s} {'batch-1 tok/s':>15s} "
          f"{'batch-8 ms/step':>22s} {f'8x{args.new_tokens} out tok/s':>20s} "
          f"{'TTFT-512 ms':>22s} {'start-up s':>11s}")
    for fmt in engines:
        b1c, b1w = med(fmt, "b1", 0), med(fmt, "b1", 1)
        b8c, b8w = med(fmt, "b8", 0), med(fmt, "b8", 1)
        out = 8 * args.new_tokens
        print(f"{fmt:17s} {b1c:10.1f} ({b1w:8.1f}) {1e3 / b1c:6.1f} ({1e3 / b1w:5.1f}) "
              f"{b8c:10.1f} ({b8w:8.1f}) {out / med(fmt, 'b8', 2):8.1f} "
              f"({out / med(fmt, 'b8', 3):7.1f}) {med(fmt, 'ttft', 0):10.1f} "
              f"({med(fmt, 'ttft', 1):8.1f}) {startup[fmt]:11.1f}")
    if args.profile:
        from torch.profiler import profile

        print("\nwhere a batch-1 token goes (torch.profiler, 20 steps; ms a token)")
        for fmt, llm in engines.items():
            params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
            llm.add_prompt([rng.randrange(vocab) for _ in range(128)], params)
            for _ in range(3):
                llm.step()
            with profile() as prof:
                steps = 0
                while not llm.scheduler.is_finished():
                    llm.step()
                    steps += 1
            events = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
            linear = sum(e.self_cpu_time_total for e in events if e.key in LINEAR_OPS)
            linear = linear / 1e3 / steps
            print(f"{fmt:17s} total {total:6.1f}  weights' products {linear:6.1f}  "
                  f"rest {total - linear:6.1f}")
    for llm in engines.values():
        llm.exit()


if __name__ == "__main__":
    main()
