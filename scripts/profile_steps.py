"""Where a step's time goes on the GPU: host phases and the top kernels.

python3 scripts/profile_steps.py  (Qwen3-0.6B config, random weights, bf16)
python3 scripts/profile_steps.py --decode 1x128 --decode 1x32768 --decode 8x128
    per-kernel time of one decode step (batch x context) and the bandwidth each reaches
    (--kv-cache-dtype fp8: over an fp8 KV cache)
python3 scripts/profile_steps.py --prefill 8192 --prefill 32768 [--kv-cache-dtype fp8]
    where a lone prompt's time to first token goes: wall, GPU busy, kernels by name
python3 scripts/profile_steps.py --throughput [--kv-cache-dtype fp8]
    `bench throughput`'s workload step by step: wall and GPU busy / idle time a step in a few
    profiled windows, and where the busy time goes
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

import torch
from decode_ab import time_past_earlier  # scripts/, the folder of this script
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
        llm.scheduler.update_from_output(out, sampled.token_ids)
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


MATMUL_NAMES = ("gemv", "gemm", "xmma", "cutlass", "nvjet")
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def kernel_engine(max_model_length: int, kv_cache_dtype: str, **config) -> LLMEngine:
    """The per-kernel profiles' engine: Qwen3-0.6B's config, random weights, steps of up
    to 8,192 tokens, half the GPU's memory."""
    return LLMEngine({
        "model_name_or_path": "Qwen/Qwen3-0.6B",
        "load_format": "dummy",
        "max_model_length": max_model_length,
        "max_num_batched_tokens": 8192,
        "gpu_memory_utilization": 0.5,
        "kv_cache_dtype": kv_cache_dtype,
        **config,
    })


def cuda_events(prof: profile) -> list:
    """The profiled kernels and copies on the GPU, in start order."""
    from torch.autograd import DeviceType

    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def decode_kernels(batch: int, context: int, steps: int = 5, kv_cache_dtype: str = "auto"
                   ) -> None:
    """Per-kernel GPU time of a decode step at `batch` x `context` and each one's GB/s.

    Matrix-product launches are labelled by their order in the step (qkv, o, gate_up, down
    per layer, then the LM head) and charged their weight bytes; decode attention is
    charged the K/V bytes of the context; other kernels show time only."""
    llm = kernel_engine(context + 512, kv_cache_dtype, max_num_sequences=max(8, batch))
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    for _ in range(batch):
        llm.add_prompt([rng.randrange(150000) for _ in range(context)], greedy)
    while llm.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in llm.scheduler.running):
        llm.step()
    for _ in range(3):
        llm.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    events = cuda_events(prof)
    model = llm.runner.model
    layers = model.model.layers
    itemsize = llm.runner.dtype.itemsize
    weight_bytes = {
        "qkv": layers[0].self_attn.qkv_proj.weight.numel() * itemsize,
        "o": layers[0].self_attn.o_proj.weight.numel() * itemsize,
        "gate_up": layers[0].mlp.gate_up_proj.weight.numel() * itemsize,
        "down": layers[0].mlp.down_proj.weight.numel() * itemsize,
        "lm_head": model.lm_head.weight.numel() * itemsize,
    }
    attn = llm.runner.attention_layers[0]
    kv_bytes = (batch * (context + 50) * 2 * attn.num_kv_heads * attn.head_dim
                * llm.runner.kv_dtype.itemsize)
    per_step_matmuls = 4 * len(layers) + 1
    times: dict[str, float] = defaultdict(float)
    # How far each kernel moves the step's end (decode_ab.time_past_earlier): the sum is
    # the GPU's busy time.
    critical: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    nbytes: dict[str, float] = defaultdict(float)
    matmul_index = 0
    proj = "?"
    for e, gain in zip(events, time_past_earlier(events), strict=True):
        name = e.name
        label = name[:48]
        if "splitkreduce" in name.lower():  # cuBLAS's second pass of the product before
            label = f"{proj}: {name[:40]}"
        elif any(k in name.lower() for k in MATMUL_NAMES):
            pos = matmul_index % per_step_matmuls
            proj = "lm_head" if pos == per_step_matmuls - 1 else PROJECTIONS[pos % 4]
            label = f"{proj}: {name[:40]}"
            nbytes[label] += weight_bytes[proj]
            matmul_index += 1
        elif "decode_attention" in name:
            nbytes[label] += kv_bytes
        times[label] += e.time_range.elapsed_us()
        critical[label] += gain
        calls[label] += 1
    aligned = matmul_index % per_step_matmuls == 0
    total = sum(times.values())
    print(f"\n== decode step, batch {batch}, context {context}, KV {kv_cache_dtype}: "
          f"{wall_ms:.3f} ms a step "
          f"(wall), {total / steps / 1e3:.3f} ms of kernels ==")
    if not aligned:
        print(f"NOTE: {matmul_index} matrix-product launches is not a multiple of "
              f"{per_step_matmuls}: projection labels are unreliable")
    busy = sum(critical.values())
    print(f"GPU busy {busy / steps:.1f} us a step (kernels' time past the earlier ones' end)")
    print(f"{'kernel':58} {'calls':>6} {'us/step':>9} {'share':>6} {'GB/s':>7} "
          f"{'critical':>9} {'share':>6}")
    for label, t in sorted(times.items(), key=lambda kv: -kv[1]):
        gbs = f"{nbytes[label] / (t * 1e-6) / 1e9:7.0f}" if nbytes[label] else ""
        print(f"{label:58} {calls[label] // steps:6d} {t / steps:9.1f} "
              f"{100 * t / total:5.1f}% {gbs:>7} {critical[label] / steps:9.1f} "
              f"{100 * critical[label] / busy:5.1f}%")
    llm.exit()


def prefill_kernels(length: int, kv_cache_dtype: str = "auto") -> None:
    """Where a lone `length`-token prompt's time to first token goes (chunks of 8,192
    tokens): its wall time, the GPU's busy time and the kernels' time, by name."""
    llm = kernel_engine(length + 512, kv_cache_dtype)
    rng = random.Random(0)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    steps: list[float] = []  # each step() call's return, ms after the start

    def prefill() -> float:
        llm.add_prompt([rng.randrange(150000) for _ in range(length)], one)  # no prefix hit
        torch.cuda.synchronize()
        start = time.perf_counter()
        steps.clear()
        while not llm.scheduler.is_finished():
            llm.step()
            steps.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    prefill()  # compiles and warms up this shape
    wall_ms = statistics.median(prefill() for _ in range(3))
    print("step() calls of the last run returned at " + ", ".join(f"{t:.1f}" for t in steps)
          + " ms (with overlapped scheduling a call returns once its step is launched)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill()
    events = cuda_events(prof)
    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        label = kernel_group(e.name)
        times[label] += e.time_range.elapsed_us() / 1e3
        calls[label] += 1
    busy = sum(time_past_earlier(events)) / 1e3
    span = (max(e.time_range.end for e in events) - events[0].time_range.start) / 1e3
    total = sum(times.values())
    print(f"\n== prefill of {length} tokens, KV {kv_cache_dtype}: {wall_ms:.1f} ms (wall, "
          f"median of 3), GPU busy {busy:.1f} ms of a {span:.1f} ms span (first kernel to "
          f"last), kernels {total:.1f} ms ==")
    gaps = idle_gaps(events)
    print("idle within the span, longest: " + "; ".join(
        f"{name} {t / 1e3:.2f} ms" for name, t in gaps[:5]))
    print(f"{'kernel':50} {'calls':>6} {'ms':>8} {'share':>6}")
    for label, t in sorted(times.items(), key=lambda kv: -kv[1])[:14]:
        print(f"{label:50} {calls[label]:6d} {t:8.2f} {100 * t / total:5.1f}%")
    llm.exit()


def idle_gaps(events: list) -> list[tuple[str, float]]:
    """Where the GPU waits: each idle gap (us) charged to the kernels on either side,
    summed per pair, longest first."""
    gaps: dict[str, float] = defaultdict(float)
    end = events[0].time_range.end
    last = events[0].name
    for e in events[1:]:
        if e.time_range.start > end:
            gaps[f"{last[:34]} -> {e.name[:34]}"] += e.time_range.start - end
        if e.time_range.end > end:
            end, last = e.time_range.end, e.name
    return sorted(gaps.items(), key=lambda kv: -kv[1])


def kernel_group(name: str) -> str:
    """A coarse label for a kernel of the throughput run's steps."""
    low = name.lower()
    if "decode_attention" in low:
        return "decode attention"
    if "prefill_attention" in low:
        return "prefill attention"
    if any(k in low for k in MATMUL_NAMES) or "splitkreduce" in low:
        return "matrix products (cuBLAS / GEMV)"
    if any(k in low for k in ("softmax", "exponential", "argmax", "topk", "sort", "multinomial",
                              "div_", "reduce", "distribution", "scatter", "gather")):
        return "sampling and reductions"
    return name[:48]


def throughput_windows(kv_cache_dtype: str, windows: tuple[int, ...] = (60, 300, 600, 850),
                       steps: int = 8) -> None:
    """`bench throughput`'s workload and engine (overlapped scheduling, CUDA graphs), driven
    step by step: the run's wall time and steps, then at a few step indices a profiled window
    of `steps` steps: the batch, wall ms a step, the GPU's busy time (kernel intervals'
    union) and idle time a step, the kernel groups' busy time and the longest idle gaps.
    Each window starts from an idle device (its first step is launched after a sync), so
    its idle time includes that first launch: an upper bound on the steady state's."""

    from minivllm.bench.common import build_engine
    from minivllm.bench.workloads import add_arguments, throughput_workload

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["throughput", "--model", "Qwen/Qwen3-0.6B",
                         "--kv-cache-dtype", kv_cache_dtype])
    prompts, outs = throughput_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    llm = build_engine(args)
    vocab = llm.config.model.vocab_size
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up
    for prompt, n in zip(prompts, outs, strict=True):
        llm.add_prompt([t % vocab for t in prompt],
                       SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
    rows = []
    step = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while not llm.scheduler.is_finished():
        if step in windows:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                batches = []
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    if llm.scheduler.is_finished():
                        break
                    llm.step()
                    batches.append(llm.stats().last_batch_size)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e3 / steps
            events = cuda_events(prof)
            gains = time_past_earlier(events)
            groups: dict[str, float] = defaultdict(float)
            for e, gain in zip(events, gains, strict=True):
                groups[kernel_group(e.name)] += gain
            for name, t in idle_gaps(events)[:3]:
                groups[f"idle after: {name}"] = -t
            span = (events[-1].time_range.end - events[0].time_range.start) / 1e3 / steps
            busy = sum(gains) / 1e3 / steps
            rows.append((step, statistics.median(batches), wall, span, busy, groups))
            step += steps
            continue
        llm.step()
        step += 1
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(outs)
    print(f"\n== throughput workload, KV {kv_cache_dtype}: {step} steps in {elapsed:.2f} s "
          f"({generated / elapsed:,.0f} output tok/s, the profiled windows' start and stop "
          f"included) ==")
    for at, batch, wall, span, busy, groups in rows:
        print(f"-- steps {at}-{at + steps - 1}: batch {batch:.0f}, wall {wall:.3f} ms a step, "
              f"GPU busy {busy:.3f} ms, idle {max(0.0, span - busy):.3f} ms within the window")
        for name, t in sorted(groups.items(), key=lambda kv: -kv[1])[:8]:
            print(f"   {name:52} {t / 1e3 / steps:8.3f} ms {100 * t / 1e3 / steps / busy:5.1f}%")
        for name, t in groups.items():
            if t < 0:
                print(f"   {name[:90]:90} {-t / 1e3 / steps:8.3f} ms")
    llm.exit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decode", action="append", default=[], metavar="BATCHxCONTEXT",
                        help="only the per-kernel decode profile of these shapes")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="--decode / --prefill / --throughput: the KV cache's storage")
    parser.add_argument("--throughput", action="store_true",
                        help="profiled windows of `bench throughput`'s workload")
    parser.add_argument("--prefill", action="append", type=int, default=[], metavar="TOKENS",
                        help="only the kernels of a lone prompt of this many tokens")
    opts = parser.parse_args()
    if opts.prefill:
        for length in opts.prefill:
            prefill_kernels(length, opts.kv_cache_dtype)
        return
    if opts.throughput:
        throughput_windows(opts.kv_cache_dtype)
        return
    if opts.decode:
        for shape in opts.decode:
            batch, context = (int(v) for v in shape.lower().split("x"))
            decode_kernels(batch, context, kv_cache_dtype=opts.kv_cache_dtype)
        return
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
