"""A/B of the decode-path switches (kernels/tuning.py) on the GPU, in one call.

python3 scripts/decode_ab.py [--variants default,off,...] [--rounds 1] [--new-tokens 128]

Each variant runs in its own process (the switches are read once per process) with the
engine's defaults (overlapped scheduling, CUDA graphs): decode-only tok/s at batch 1 with a
128-token prompt, batch 8 with 128-token prompts, batch 1 with a 32k prompt (Qwen3-0.6B
config, random bf16 weights). With several rounds the variants are interleaved (A B C A B
C) and each figure is the median over rounds. A table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

# The defaults (kernels/tuning.py) are the measured winners; "off" is the engine before
# them, the others add one switch to the defaults.
OFF = {"MINIVLLM_GEMV_MAX_K": "2048", "MINIVLLM_DECODE_PREFETCH": "0",
       "MINIVLLM_DECODE_MIN_SPLIT": "0", "MINIVLLM_GRAPH_GREEDY": "0",
       "MINIVLLM_DECODE_SHORT": "0"}
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "off": OFF,
    "no_prefetch": {"MINIVLLM_DECODE_PREFETCH": "0"},
    "no_split": {"MINIVLLM_DECODE_MIN_SPLIT": "0"},
    "no_greedy": {"MINIVLLM_GRAPH_GREEDY": "0"},
    "k2048": {"MINIVLLM_GEMV_MAX_K": "2048"},
    "late": {"MINIVLLM_DECODE_LATE_TRIGGER": "4096"},
    "silu8k": {"MINIVLLM_GEMV_SILU_TILE": "8192"},
    "wide": {"MINIVLLM_GEMV_WIDE": "1"},
    "pdl1": {"MINIVLLM_PDL": "1"},
    "noshort": {"MINIVLLM_DECODE_SHORT": "0"},
    # The engine before 2026-12-04's short launch and splits of 128.
    "start": {"MINIVLLM_DECODE_SHORT": "0", "MINIVLLM_DECODE_MIN_SPLIT": "512"},
    "short_w4": {"MINIVLLM_DECODE_SHORT_TILE": "128x4x2"},
    "short_s1": {"MINIVLLM_DECODE_SHORT_TILE": "128x8x1"},
    "short_64": {"MINIVLLM_DECODE_SHORT_TILE": "64x8x1"},
    "short1k": {"MINIVLLM_DECODE_MIN_SPLIT": "1024"},
    "split256": {"MINIVLLM_DECODE_MIN_SPLIT": "256"},
    "split128": {"MINIVLLM_DECODE_MIN_SPLIT": "128"},
    "tile128x8": {"MINIVLLM_DECODE_TILE": "128x8x2"},
}
SHAPES = [("b1 128", 1, 128), ("b1 512", 1, 512), ("b1 2k", 1, 2048), ("b8 128", 8, 128),
          ("b1 32k", 1, 32768)]


def measure(new_tokens: int, repeats: int, model: str, long: int,
            profile: bool = False) -> dict[str, float]:
    """This process's figures: decode-only tok/s per shape (median of `repeats`)."""
    import torch

    from minivllm import LLMEngine, SamplingParams

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    llm = LLMEngine({
        "model_name_or_path": model,
        "load_format": "dummy",
        "max_model_length": long + new_tokens + 64,
        "max_num_sequences": 8,
        "max_num_batched_tokens": 8192,
        "gpu_memory_utilization": 0.3,
        "seed": 0,
    })
    rng = random.Random(0)
    vocab = min(150000, llm.config.model.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    out = {}
    try:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for name, batch, context in SHAPES:
            context = long if context == 32768 else context
            rates = []
            for _ in range(repeats if context < 8192 else max(1, repeats - 1)):
                # Fresh prompts each time: no prefix hit, the same context lengths.
                for _ in range(batch):
                    llm.add_prompt([rng.randrange(vocab) for _ in range(context)], params)
                first = None
                while not llm.scheduler.is_finished():
                    llm.step()
                    if first is None and not llm.scheduler.waiting and all(
                        s.num_completion_tokens > 0 for s in llm.scheduler.running
                    ):
                        sync()
                        first = time.perf_counter()
                sync()
                rates.append(batch * (new_tokens - 1) / (time.perf_counter() - first))
            out[name] = statistics.median(rates)
        if profile:
            print(f"== {os.environ.get('DECODE_AB_NAME', '?')}: GPU timeline ==", flush=True)
            timeline(llm, 1, 128)
            timeline(llm, 1, long)
    finally:
        llm.exit()
    return out


def time_past_earlier(events: list) -> list[float]:
    """For profiler events sorted by start: how far each moved the end of the work before it
    (its time past every earlier event's end, idle gaps excluded). Under PDL kernels
    overlap, so a kernel's own time overstates what it costs; these add up to the busy
    time."""
    out, end = [], None
    for e in events:
        start, stop = e.time_range.start, e.time_range.end
        out.append(stop - start if end is None else max(0.0, stop - max(start, end)))
        end = stop if end is None else max(end, stop)
    return out


def timeline(llm, batch: int, context: int, steps: int = 10) -> None:
    """Print where `steps` decode steps' GPU time goes: busy / idle, kernels a step, and per
    kernel name the time by which each of its launches moved the step's end forward (under
    PDL kernels overlap; these increments add up to the busy time)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from minivllm import SamplingParams

    rng = random.Random(1)
    vocab = min(150000, llm.config.model.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    for _ in range(batch):
        llm.add_prompt([rng.randrange(vocab) for _ in range(context)], params)
    while llm.scheduler.waiting or any(s.num_completion_tokens == 0
                                       for s in llm.scheduler.running):
        llm.step()
    for _ in range(5):
        llm.step()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.step()
        if cuda:
            torch.cuda.synchronize()
    while not llm.scheduler.is_finished():
        llm.step()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events:
        print("  (no CUDA events)")
        return
    span = events[-1].time_range.end - events[0].time_range.start
    gains = time_past_earlier(events)
    busy = sum(gains)
    moved: dict[str, float] = {}
    count: dict[str, int] = {}
    for e, gain in zip(events, gains, strict=True):
        name = e.name[:44]
        moved[name] = moved.get(name, 0.0) + gain
        count[name] = count.get(name, 0) + 1
    print(f"  timeline b{batch} ctx {context}: {span / steps:7.1f} us a step, GPU busy "
          f"{busy / steps:7.1f}, idle {(span - busy) / steps:6.1f}; "
          f"{len(events) / steps:.0f} kernels a step")
    for name, t in sorted(moved.items(), key=lambda kv: -kv[1])[:14]:
        print(f"    {name:46} {count[name] / steps:6.1f}/step  {t / steps:8.1f} us/step "
              f"(moves the end {t / count[name]:6.2f} us each)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", default="default,off,late,silu8k",
                        help="comma-separated; a name given twice is run twice (median); "
                        "greedy+late: both switches")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--long", type=int, default=32768, help="the long context (b1 32k)")
    parser.add_argument("--profile", default="default",
                        help="variants whose first run also prints a GPU timeline")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        figures = measure(opts.new_tokens, opts.repeats, opts.model, opts.long,
                          profile=os.environ.get("DECODE_AB_PROFILE") == "1")
        print("RESULT " + json.dumps(figures), flush=True)
        return
    names = opts.variants.split(",")
    for name in names:
        for part in name.split("+"):
            if part not in VARIANTS:
                sys.exit(f"--variants: unknown variant {part!r} (known: {', '.join(VARIANTS)}; "
                         "join several with +)")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(opts.rounds):
        for name in names:
            env = {k: v for k, v in os.environ.items() if not k.startswith("MINIVLLM_")}
            for part in name.split("+"):
                env.update(VARIANTS[part])
            env["DECODE_AB_NAME"] = name
            env["DECODE_AB_PROFILE"] = str(int(r == 0 and name in opts.profile.split(",")))
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, __file__, "--child", "--new-tokens", str(opts.new_tokens),
                 "--repeats", str(opts.repeats), "--model", opts.model, "--long", str(opts.long)],
                env=env, capture_output=True, text=True, timeout=300,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(f"{name}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
                continue
            for text in proc.stdout.splitlines():
                if text.startswith(("==", "  ")):
                    print(text, flush=True)  # the timeline
            figures = json.loads(line[7:])
            results[name].append(figures)
            print(f"round {r + 1} {name:9} {time.perf_counter() - t0:5.1f} s  "
                  + "  ".join(f"{k} {v:8.1f}" for k, v in figures.items()), flush=True)
    print("\n== decode A/B (decode-only tok/s; ms a step in brackets; median over rounds) ==")
    print(f"{'variant':14}" + "".join(f"{name:>22}" for name, _, _ in SHAPES) + "  env")
    base = results.get("off") or []
    for name in dict.fromkeys(names):
        runs = results[name]
        if not runs:
            print(f"{name:14} failed")
            continue
        cells = []
        for shape, batch, _ in SHAPES:
            v = statistics.median(run[shape] for run in runs)
            ratio = ""
            if base and name != "off":
                ratio = f" {v / statistics.median(run[shape] for run in base):.2f}x"
            cells.append(f"{v:8.0f} ({1e3 * batch / v:5.3f}){ratio:>6}")
        env = " ".join(f"{k[9:]}={v}" for part in name.split("+")
                       for k, v in VARIANTS[part].items()) or "defaults"
        print(f"{name:14}" + "".join(f"{c:>22}" for c in cells) + f"  {env}")


if __name__ == "__main__":
    main()
