"""fp8 KV cache against the model's dtype on a GPU, in one table: `minivllm bench
throughput`, batch-1 decode at a short and a long context, and the KV pool's capacity.

    .venv/bin/python scripts/fp8_kv_gpu.py [--model Qwen/Qwen3-0.6B] [--long 32768]

Each KV dtype gets two engines (random weights for a known config): the throughput
workload's (bench defaults: 256 sequences, inputs and outputs up to 1,024 tokens), then
one sized for the long context, which decodes one sequence after a 128-token prompt and
after a `--long`-token one (decode only: tokens after the first). Capacity is that
engine's pool at the same `gpu_memory_utilization`. About 3-4 minutes on an H100.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

KV_DTYPES = ("auto", "fp8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--long", type=int, default=32768, help="the long context (positions)")
    p.add_argument("--short", type=int, default=128, help="the short context (positions)")
    p.add_argument("--new-tokens", type=int, default=128, help="decoded tokens a run")
    p.add_argument("--repeats", type=int, default=3, help="decode runs a context (median)")
    p.add_argument("--num-seqs", type=int, default=256, help="throughput: sequences")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-decode", action="store_true", help="no batch-1 decode / capacity")
    args = p.parse_args(argv)
    for name in ("long", "short", "new_tokens", "repeats", "num_seqs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def bench_args(args: argparse.Namespace, kv: str, *extra: str) -> argparse.Namespace:
    """`minivllm bench throughput`'s arguments with this KV dtype."""
    from minivllm.bench.workloads import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["throughput", "--model", args.model, "--kv-cache-dtype", kv,
                         "--num-seqs", str(args.num_seqs), *extra])


def measure(args: argparse.Namespace, kv: str) -> dict[str, float]:
    from minivllm import SamplingParams
    from minivllm.bench.common import build_engine
    from minivllm.bench.workloads import bench_throughput, timed_run

    out: dict[str, float] = {}
    if not args.skip_throughput:
        row = bench_throughput(bench_args(args, kv))[0]
        out["throughput"] = row.value
        print(f"bench throughput, KV {kv}: {row.value:,.0f} {row.unit}; {row.note}", flush=True)
    if args.skip_decode:
        return out
    length = args.long + args.new_tokens + 16
    llm = build_engine(bench_args(args, kv, "--max-model-len", str(length),
                                  "--max-num-seqs", "8"))
    try:
        out["blocks"] = llm.runner.num_blocks
        out["block_size"] = llm.config.block_size
        vocab = llm.config.model.vocab_size
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        for positions in (args.short, args.long):
            times = []
            for _ in range(args.repeats):
                # A fresh prompt each run: no prefix-cache hit shortens the prefill.
                prompt = [rng.randrange(vocab) for _ in range(positions)]
                times.append(timed_run(llm, [prompt], params)[1])
            out[f"decode@{positions}"] = (args.new_tokens - 1) / statistics.median(times)
    finally:
        llm.exit()
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("fp8_kv_gpu.py: needs a CUDA GPU")
    results = {kv: measure(args, kv) for kv in KV_DTYPES}
    device = torch.cuda.get_device_name()
    rows = []
    if not args.skip_throughput:
        rows.append(("bench throughput", "output tok/s", "throughput"))
    if not args.skip_decode:
        rows += [(f"decode, batch 1, {args.short} positions", "tok/s", f"decode@{args.short}"),
                 (f"decode, batch 1, {args.long} positions", "tok/s", f"decode@{args.long}"),
                 ("KV capacity", "blocks", "blocks")]
    print(f"\n{args.model} (random weights) on {device}; decode: {args.new_tokens} tokens, "
          f"median of {args.repeats}"
          + ("" if args.skip_decode
             else f"; blocks of {results['auto']['block_size']:.0f} tokens"))
    print(f"{'metric':<38} {'unit':<13} {'auto':>10} {'fp8':>10} {'fp8/auto':>9}")
    for name, unit, key in rows:
        a, f = results["auto"][key], results["fp8"][key]
        print(f"{name:<38} {unit:<13} {a:>10,.0f} {f:>10,.0f} {f / a:>8.2f}x")


if __name__ == "__main__":
    main()
