"""Where a step's time goes on the GPU: host phases and the top kernels.

python3 scripts/profile_steps.py  (Qwen3-0.6B config, random weights, bf16)
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLMEngine, SamplingParams
from minivllm.engine.batch import build_forward_batch


def phases(llm: LLMEngine, steps: int) -> dict[str, float]:
    """Median milliseconds of each phase of `steps` engine steps."""
    times: dict[str, list[float]] = {}

    def mark(name, t0):
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        times.setdefault(name, []).append((t1 - t0) * 1e3)
        return t1

    for _ in range(steps):
        t = time.perf_counter()
        out = llm.scheduler.schedule()
        t = mark("schedule", t)
        batch = build_forward_batch(out, llm.config.block_size)
        t = mark("build batch", t)
        ids, pos, meta = llm.runner.prepare(batch)
        t = mark("prepare", t)
        sampled = llm.runner.run(batch)  # includes its own prepare
        t = mark("run (prepare+forward+sample)", t)
        llm.scheduler.update_from_output(out, sampled)
        mark("update", t)
    return {k: statistics.median(v) for k, v in times.items()}


def top_kernels(llm: LLMEngine, n: int = 12) -> str:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            llm.step()
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="self_cuda_time_total", row_limit=n, max_name_column_width=60
    )


def main() -> None:
    llm = LLMEngine(
        {
            "model_name_or_path": "Qwen/Qwen3-0.6B",
            "load_format": "dummy",
            "max_model_length": 4096,
            "max_num_sequences": 256,
            "max_num_batched_tokens": 8192,
            "gpu_memory_utilization": 0.5,
            # phases() drives the scheduler by hand, one step at a time
            "async_scheduling": False,
        }
    )
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)

    print("== batch 1 decode ==")
    llm.add_prompt([rng.randrange(150000) for _ in range(128)], greedy)
    llm.step()
    for _ in range(5):
        llm.step()
    print(phases(llm, 20))
    print(top_kernels(llm))
    for seq in list(llm.scheduler.running):
        llm.abort(seq.seq_id)

    print("== prefill 1024 ==")
    for _ in range(2):
        llm.add_prompt([rng.randrange(150000) for _ in range(1024)], greedy)
        print(phases(llm, 1))
    for seq in list(llm.scheduler.running):
        llm.abort(seq.seq_id)
    llm.add_prompt([rng.randrange(150000) for _ in range(1024)], greedy)
    print(top_kernels(llm))
    for seq in list(llm.scheduler.running):
        llm.abort(seq.seq_id)
    import cProfile
    import pstats

    llm.add_prompt([rng.randrange(150000) for _ in range(1024)], greedy)
    prof = cProfile.Profile()
    prof.enable()
    llm.step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    for seq in list(llm.scheduler.running):
        llm.abort(seq.seq_id)

    print("== batch 256 decode, ~1000 context, temperature 0.6 ==")
    sampled = SamplingParams(temperature=0.6, max_tokens=4000, ignore_eos=True)
    for _ in range(256):
        llm.add_prompt([rng.randrange(150000) for _ in range(1000)], sampled)
    while llm.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in llm.scheduler.running):
        llm.step()
    print(phases(llm, 10))
    print(top_kernels(llm))
    llm.exit()


if __name__ == "__main__":
    main()
