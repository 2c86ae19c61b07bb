"""`minivllm bench`: PERF.md's workloads, optionally against transformers in-process."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from . import LLMEngine, SamplingParams
from .loader import KNOWN_CONFIGS

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"


@dataclass
class Row:
    name: str
    value: float
    unit: str
    note: str = ""


def load_format(args: argparse.Namespace) -> str:
    """Random weights for a known architecture unless a format is asked for."""
    if args.load_format:
        return args.load_format
    return "dummy" if args.model in KNOWN_CONFIGS else "auto"


def build_engine(args: argparse.Namespace, **overrides) -> LLMEngine:
    config = {
        "model_name_or_path": args.model,
        "device": args.device,
        "enforce_eager": args.enforce_eager,
        "max_model_length": args.max_model_length,
        "max_num_sequences": args.max_num_sequences,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "seed": 0,
    }
    config["load_format"] = load_format(args)
    if args.dtype:
        config["dtype"] = args.dtype
    if args.world_size > 1:
        config["world_size"] = args.world_size
    config.update(overrides)
    from .cli import print_progress

    return LLMEngine(config, on_progress=print_progress if sys.stderr.isatty() else None)


def sync(llm: LLMEngine) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


# -- the throughput workload (nano-vllm's bench.py) ---------------------------------------


def throughput_workload(num_seqs: int, max_input: int, max_output: int):
    """PERF.md: seed 0; draw all prompts first, then all output lengths."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, max_input))]
        for _ in range(num_seqs)
    ]
    outs = [random.randint(100, max_output) for _ in range(num_seqs)]
    return prompts, outs


def bench_throughput(args: argparse.Namespace) -> list[Row]:
    prompts, outs = throughput_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    llm = build_engine(args)
    vocab = llm.config.model.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in outs]
    modes = {"default": [None], "both": [True, False], "async": [True], "sync": [False]}
    rows = []
    for mode in modes[args.scheduling]:
        if mode is not None:
            llm.async_scheduling = mode  # switched while idle: the same engine runs both
        suffix = "" if mode is None else (" (async)" if mode else " (sync)")
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up, untimed
        sync(llm)
        steps_before = llm.stats().num_steps
        times = _time_host_work(llm)
        start = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=args.progress)
        sync(llm)
        elapsed = time.perf_counter() - start
        _untime_host_work(llm)
        generated = sum(len(t) for t in out["token_ids"])
        assert generated == sum(outs)
        stats = llm.stats()
        steps = max(1, stats.num_steps - steps_before)
        rows.append(
            Row(
                "throughput" + suffix,
                generated / elapsed,
                "output tok/s",
                f"{len(prompts)} seqs, {sum(map(len, prompts))} prompt + {generated} output "
                f"tokens in {elapsed:.2f} s; {stats.num_preemptions} preemptions, "
                f"{stats.num_blocks} KV blocks",
            )
        )
        per_step = {k: v / steps * 1e3 for k, v in times.items()}
        rows.append(
            Row(
                "host ms/step" + suffix,
                elapsed / steps * 1e3 - per_step["wait"],
                "ms",
                f"{steps} steps of {elapsed / steps * 1e3:.2f} ms; not waiting for the device: "
                f"schedule {per_step['schedule']:.2f}, prepare {per_step['prepare']:.2f}, "
                f"apply {per_step['apply']:.2f}; waiting {per_step['wait']:.2f}",
            )
        )
    llm.exit()
    if args.compare == "hf":
        rows.append(hf_throughput(args, prompts, outs, vocab))
        if rows[-1].value > 0:
            rows.append(
                Row("ratio", rows[0].value / rows[-1].value, "x", "minivllm / transformers")
            )
    return rows


def _time_host_work(llm: LLMEngine) -> dict[str, float]:
    """Wrap the engine's per-step stages with timers (instance attributes, removed by
    `_untime_host_work`): where the host's time goes, and how long it waits."""
    times = {"schedule": 0.0, "prepare": 0.0, "apply": 0.0, "wait": 0.0}
    targets = [
        (llm.scheduler, "schedule", "schedule"),
        (llm.runner, "prepare", "prepare"),
        (llm.scheduler, "update_from_output", "apply"),
        (llm.runner, "collect", "wait"),
    ]
    for obj, name, key in targets:
        fn = getattr(obj, name)

        def timed(*a, _fn=fn, _key=key, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                times[_key] += time.perf_counter() - t

        setattr(obj, name, timed)
    llm._timed_stages = targets  # type: ignore[attr-defined]
    return times


def _untime_host_work(llm: LLMEngine) -> None:
    for obj, name, _ in llm._timed_stages:  # type: ignore[attr-defined]
        delattr(obj, name)


# -- latency --------------------------------------------------------------------------------


def bench_latency(args: argparse.Namespace) -> list[Row]:
    llm = build_engine(args)
    vocab = llm.config.model.vocab_size
    rng = random.Random(0)
    rows = []
    for batch in args.batch_sizes:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        times, decode_times = [], []
        for _ in range(args.repeats):
            total, after_first = timed_run(llm, prompts, params)
            times.append(total)
            decode_times.append(after_first)
        t = statistics.median(times)
        rows.append(
            Row(
                f"decode, batch {batch}",
                batch * args.new_tokens / t,
                "tok/s",
                f"{args.prompt_len}-token prompt, {args.new_tokens} greedy tokens, "
                f"prefill included, median of {args.repeats}",
            )
        )
        rows.append(
            Row(
                f"decode only, batch {batch}",
                batch * (args.new_tokens - 1) / statistics.median(decode_times),
                "tok/s",
                "tokens 2.. after the first, whose step holds the prefill",
            )
        )
    ttfts = []
    for i in range(args.ttft_repeats):
        prompt = [rng.randrange(vocab) for _ in range(args.ttft_prompt_len)]
        sync(llm)
        start = time.perf_counter()
        llm.add_prompt(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        while not llm.scheduler.is_finished():
            llm.step()
        sync(llm)
        if i > 0:  # the first one warms up this shape
            ttfts.append(time.perf_counter() - start)
    rows.append(
        Row(
            "TTFT",
            statistics.median(ttfts) * 1e3,
            "ms",
            f"{args.ttft_prompt_len}-token prompt, median of {len(ttfts)}",
        )
    )
    llm.exit()
    if args.compare == "hf":
        hf, hf_decode = hf_latency(args, vocab)
        rows += [hf, hf_decode]
        rows.append(
            Row(
                "ratio",
                rows[0].value / hf.value,
                "x",
                "minivllm / transformers, batch 1, prefill included",
            )
        )
        rows.append(
            Row(
                "ratio, decode only",
                rows[1].value / hf_decode.value,
                "x",
                "minivllm / transformers, batch 1",
            )
        )
    return rows


def timed_run(llm: LLMEngine, prompts, params) -> tuple[float, float]:
    """(seconds for the whole run, seconds after every prompt got its first token)."""
    for prompt in prompts:
        llm.add_prompt(prompt, params)
    sync(llm)
    start = time.perf_counter()
    first = None
    while not llm.scheduler.is_finished():
        llm.step()
        if (
            first is None
            and not llm.scheduler.waiting
            and all(s.num_completion_tokens > 0 for s in llm.scheduler.running)
        ):
            sync(llm)
            first = time.perf_counter()
    sync(llm)
    end = time.perf_counter()
    return end - start, end - (first or start)


# -- transformers on the same weights -----------------------------------------------------


def load_hf_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """The same checkpoint through transformers; for random-weight runs, the same config
    with transformers' own random init (speed does not depend on the values)."""
    import transformers

    from .config import EngineConfig

    cfg = EngineConfig.from_dict(
        {"model_name_or_path": args.model, "load_format": load_format(args)}
    )
    if cfg.load_format != "dummy":
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=dtype)
        note = "same weights"
    else:
        hf_config = transformers.AutoConfig.for_model(
            **_hf_config_dict(KNOWN_CONFIGS.get(args.model))
        )
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        note = "random weights, same config"
    return model.to(device).eval(), note


def _hf_config_dict(known: dict | None) -> dict:
    if known is None:
        raise ValueError("--compare hf with random weights needs a known model config")
    d = dict(known)
    d["model_type"] = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[
        d["architectures"][0]
    ]
    return d


def _device_dtype(args) -> tuple[torch.device, torch.dtype]:
    device = torch.device(
        "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    return device, dtype


@torch.inference_mode()
def hf_latency(args: argparse.Namespace, vocab: int) -> list[Row]:
    device, dtype = _device_dtype(args)
    model, note = load_hf_model(args, device, dtype)
    prompt = torch.randint(0, vocab, (1, args.prompt_len), device=device)
    kwargs = dict(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    if device.type == "cuda":
        kwargs["cache_implementation"] = "static"
        note += ", static cache"
    model.generate(prompt, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})

    def median_time(new_tokens: int) -> float:
        times = []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(
                prompt, **{**kwargs, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
            )
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    total, first = median_time(args.new_tokens), median_time(1)
    return [
        Row(
            "transformers decode, batch 1",
            args.new_tokens / total,
            "tok/s",
            note + ", prefill included",
        ),
        Row(
            "transformers decode only, batch 1",
            (args.new_tokens - 1) / (total - first),
            "tok/s",
            "(time of N tokens - time of 1) / (N - 1)",
        ),
    ]


def hf_throughput(args, prompts, outs, vocab) -> Row:
    # NOTE: not under inference_mode: transformers' continuous batching updates its
    # static tensors in place from its own thread.
    from transformers import GenerationConfig

    device, dtype = _device_dtype(args)
    model, note = load_hf_model(args, device, dtype)
    n = min(len(prompts), args.hf_num_seqs)
    subset, sub_outs = prompts[:n], outs[:n]
    max_new = max(sub_outs)
    try:
        gen = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=True,
            temperature=0.6,
            eos_token_id=None,
            pad_token_id=0,
        )
        start = time.perf_counter()
        results = model.generate_batch(inputs=subset, generation_config=gen, progress_bar=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        generated = sum(len(r.generated_tokens) for r in results.values())
    except Exception as e:  # transformers' API moves; report rather than crash the bench
        return Row("transformers throughput", 0.0, "output tok/s", f"failed: {e!r:.200}")
    return Row(
        "transformers throughput",
        generated / elapsed,
        "output tok/s",
        f"continuous batching (generate_batch), {n} of the {len(prompts)} seqs, "
        f"{max_new} new tokens each; {note}",
    )


def print_rows(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    width = max(len(r.name) for r in rows)
    for r in rows:
        print(f"  {r.name:<{width}}  {r.value:>12,.1f} {r.unit:<13} {r.note}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", choices=["throughput", "latency"])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=None,
        help="default: dummy for known configs without a checkpoint",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-model-length", type=int, default=4096)
    p.add_argument("--max-num-sequences", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--compare", choices=["hf"], default=None)
    p.add_argument("--progress", action="store_true")
    # throughput
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--hf-num-seqs", type=int, default=64)
    p.add_argument(
        "--scheduling",
        choices=["default", "async", "sync", "both"],
        default="default",
        help="overlapped (async) or synchronous scheduling; both: one engine runs each",
    )
    # latency
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft-prompt-len", type=int, default=1024)
    p.add_argument("--ttft-repeats", type=int, default=11)


def main(args: argparse.Namespace) -> None:
    if args.workload == "throughput":
        rows = bench_throughput(args)
    else:
        rows = bench_latency(args)
    print_rows(f"minivllm bench {args.workload}: {args.model}", rows)
