"""`minivllm bench`: PERF.md's workloads, optionally against transformers in-process."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from .. import LLMEngine, SamplingParams
from ..engine_args import EngineArgs
from .coldstart import bench_coldstart
from .common import Row, build_engine, report, sync
from .cpu import bench_latency_cpu
from .hf import hf_latency, hf_throughput

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
CPU_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The bench's engine options where they are not the engine's defaults (`--model` None:
# chosen per workload in `main`; seed 0: the same workload on every run).
BENCH_DEFAULTS = {"model": None, "device": "auto", "max_model_length": 4096,
                  "max_num_sequences": 256, "max_num_batched_tokens": 8192, "block_size": 256,
                  "seed": 0}


# -- the throughput workload (nano-vllm's benchmark script) -------------------------------


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
    del llm._timed_stages  # type: ignore[attr-defined]  # it references the runner


# -- latency --------------------------------------------------------------------------------


def on_cpu(args: argparse.Namespace) -> bool:
    return args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())


def bench_latency(args: argparse.Namespace) -> list[Row]:
    if on_cpu(args):

        return bench_latency_cpu(args)
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
        report(f"batch {batch}: {batch * args.new_tokens / t:,.1f} tok/s, prefill included")
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
    report(f"TTFT of a {args.ttft_prompt_len}-token prompt, {args.ttft_repeats} times")
    for i in range(args.ttft_repeats):
        prompt = [rng.randrange(vocab) for _ in range(args.ttft_prompt_len)]
        seconds = one_token(llm, prompt)
        if i > 0:  # the first one warms up this shape
            ttfts.append(seconds)
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
        report("transformers, the same runs")
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


# -- prefill-only requests and TTFT ------------------------------------------------------


def one_token(llm: LLMEngine, prompt: list[int]) -> float:
    """Seconds from add_prompt to the first token of a lone request (idle engine)."""
    sync(llm)
    start = time.perf_counter()
    llm.add_prompt(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while not llm.scheduler.is_finished():
        llm.step()
    sync(llm)
    return time.perf_counter() - start


def bench_prefill(args: argparse.Namespace) -> list[Row]:
    """A lone prefill-only request per length (fresh tokens: no prefix hit): TTFT. A
    prompt longer than a step's token budget is prefilled in chunks."""
    llm = build_engine(args)
    vocab = llm.config.model.vocab_size
    rng = random.Random(0)
    rows = []
    lengths = [n for n in args.prefill_lens if n < llm.config.max_len]
    for n in lengths:
        times = []
        for i in range(args.repeats + 1):
            t = one_token(llm, [rng.randrange(vocab) for _ in range(n)])
            if i > 0:  # the first one warms this shape up
                times.append(t)
        name = "TTFT, 1024-token prompt" if n == 1024 else f"prefill {n} tokens"
        rows.append(Row(name, statistics.median(times) * 1e3, "ms",
                        f"lone request, 1 output token, median of {len(times)}"))
    llm.exit()
    return rows


# -- the chat workload --------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_turn(llm: LLMEngine, prompts: list[list[int]], max_tokens: list[int]):
    """Submit every prompt at once; (TTFT seconds of each, completions)."""
    start = {}
    ids = []
    for p, n in zip(prompts, max_tokens, strict=True):
        sync(llm)
        seq_id = llm.add_prompt(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        start[seq_id] = time.perf_counter()
        ids.append(seq_id)
    ttft: dict[int, float] = {}
    completions: dict[int, list[int]] = {i: [] for i in ids}
    while not llm.scheduler.is_finished():
        llm.step()
        deltas = llm.pop_deltas()
        now = time.perf_counter()
        for d in deltas:
            if d.token_ids and d.seq_id not in ttft:
                ttft[d.seq_id] = now - start[d.seq_id]
            completions[d.seq_id].extend(d.token_ids)
    return [ttft[i] for i in ids], [completions[i] for i in ids]


def bench_chat(args: argparse.Namespace) -> list[Row]:
    """PERF.md's chat workload: conversations of a system prompt and growing turns, every
    conversation's next turn submitted at once; then a lone follow-up on an idle engine."""
    llm = build_engine(args)
    vocab = llm.config.model.vocab_size
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    system = tokens(args.system_len)
    histories = [list(system) for _ in range(args.conversations)]
    one_token(llm, tokens(16))  # warm-up, untimed
    first, follow = [], []
    for turn in range(args.turns):
        prompts = [h + tokens(rng.randint(*args.user_len)) for h in histories]
        replies = [rng.randint(*args.reply_len) for _ in histories]
        ttfts, completions = run_turn(llm, prompts, replies)
        (first if turn == 0 else follow).extend(ttfts)
        histories = [p + c for p, c in zip(prompts, completions, strict=True)]
    hit_rate = llm.stats().prefix_cache_hit_rate
    # A lone follow-up: a long conversation's history is cached, a short user turn new.
    history = histories[0][: args.lone_cached]
    history += tokens(args.lone_cached - len(history))
    one_token(llm, history + tokens(args.lone_new))  # caches the history
    lone = [one_token(llm, history + tokens(args.lone_new)) for _ in range(args.repeats)]
    llm.exit()
    setting = f"{args.conversations} conversations x {args.turns} turns"
    rows = [
        Row("chat first-turn TTFT median", statistics.median(first) * 1e3, "ms", setting),
        Row("chat first-turn TTFT p90", percentile(first, 0.9) * 1e3, "ms", ""),
    ]
    if follow:
        rows += [
            Row("chat follow-up TTFT median", statistics.median(follow) * 1e3, "ms",
                "turns 2.., all conversations submitted at once"),
            Row("chat follow-up TTFT p90", percentile(follow, 0.9) * 1e3, "ms", ""),
        ]
    rows += [
        Row("chat prefix hit rate", hit_rate * 100, "%", f"block size {args.block_size}"),
        Row("chat lone follow-up TTFT", statistics.median(lone) * 1e3, "ms",
            f"{args.lone_cached} cached + {args.lone_new} new tokens, idle engine, "
            f"median of {len(lone)}"),
    ]
    return rows


def print_rows(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    width = max(len(r.name) for r in rows)
    for r in rows:
        print(f"  {r.name:<{width}}  {r.value:>12,.1f} {r.unit:<13} {r.note}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", choices=list(WORKLOADS))
    EngineArgs.add_cli_args(
        p.add_argument_group("engine"),
        defaults=BENCH_DEFAULTS,
        help_defaults={
            "model": f"{DEFAULT_MODEL}; {CPU_MODEL} for latency on CPU",
            "load_format": "dummy for known configs without a checkpoint",
            "cpu_weight_dtype": "auto; latency --device cpu: minivllm generate's default",
        },
    )
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
    p.add_argument("--new-tokens", type=int, default=None, help="default: 256; 128 on CPU")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft-prompt-len", type=int, default=None, help="default: 1024; 512 on CPU")
    p.add_argument("--ttft-repeats", type=int, default=11)
    # prefill
    p.add_argument("--prefill-lens", type=int, nargs="+",
                   default=[16, 128, 512, 1024, 2048, 4096, 8192])
    # chat
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-len", type=int, default=300)
    p.add_argument("--user-len", type=int, nargs=2, default=[50, 300], metavar=("MIN", "MAX"))
    p.add_argument("--reply-len", type=int, nargs=2, default=[100, 400], metavar=("MIN", "MAX"))
    p.add_argument("--lone-cached", type=int, default=2500)
    p.add_argument("--lone-new", type=int, default=100)
    # coldstart
    p.add_argument("--cold-lens", type=int, nargs="+", default=[37, 300, 2000, 5000])
    p.add_argument("--cold-decoders", type=int, default=32)
    p.add_argument("--cold-arrival", type=int, default=8000, help="prompt arriving mid-stream")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


WORKLOADS: dict[str, Callable[[argparse.Namespace], list[Row]]] = {
    "throughput": bench_throughput,
    "latency": bench_latency,
    "prefill": bench_prefill,
    "chat": bench_chat,
    "coldstart": bench_coldstart,
}


def main(args: argparse.Namespace) -> None:
    cpu_latency = args.workload == "latency" and on_cpu(args)
    if args.model is None:
        args.model = CPU_MODEL if cpu_latency else DEFAULT_MODEL
    if args.new_tokens is None:
        args.new_tokens = 128 if cpu_latency else 256
    if args.ttft_prompt_len is None:
        args.ttft_prompt_len = 512 if cpu_latency else 1024
    for name in ("user_len", "reply_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            raise ValueError(f"--{name.replace('_', '-')}: need 1 <= MIN <= MAX, got {low} {high}")
    rows = WORKLOADS[args.workload](args)
    if not rows:  # the cold-start child printed its result as JSON
        return
    print_rows(f"minivllm bench {args.workload}: {args.model}", rows)
