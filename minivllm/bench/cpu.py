"""`minivllm bench latency --device cpu`: minivllm and transformers side by side.

minivllm runs with `minivllm generate`'s CPU weights (`--cpu-weight-dtype`, default
`compact`: the embedded SmolLM2's own Q4_1 / Q8_0 weights, fp32 compute), transformers in
the engine's compute dtype (fp32 then). Both
engines run the same token-id prompts in the same process, interleaved round by round
(minivllm, then transformers, for every figure), so a machine shared with other work slows
both alike; each figure is the median over the rounds. Figures:

- start-up to first token: engine construction (weights read, packed, KV pool allocated)
  plus one 16-token prompt's first token; torch is already imported, the files are in the
  page cache after the first read (warm caches); measured once per engine, minivllm first;
- batch-1 decode: a 128-token prompt, `--new-tokens` greedy tokens; tokens 2.. over the
  time after the first;
- TTFT for a 128- and a `--ttft-prompt-len` (512) token prompt: one new token;
- 8 prompts x `--new-tokens`: all submitted together, output tokens over the whole run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from .. import LLMEngine, SamplingParams
from ..config import APP_CPU_WEIGHT_DTYPE
from ..frontend.engine_frontend import dtype_label
from .common import Row, build_engine, load_hf_model, report

# Greedy tokens compared with transformers once a round (the engine's pool must hold them).
PARITY_TOKENS = 32


def _mv_engine(args: argparse.Namespace) -> LLMEngine:
    # A pool for the 8 sequences of the batch figure, not the CPU's 2 GiB default.
    max_len = max(args.prompt_len, args.ttft_prompt_len) + max(args.new_tokens, PARITY_TOKENS)
    blocks_per_seq = -(-max_len // args.block_size)
    # The precision a user gets from `minivllm generate` unless asked otherwise.
    weights = args.cpu_weight_dtype or APP_CPU_WEIGHT_DTYPE
    return build_engine(
        args,
        max_model_length=max_len,
        max_cached_blocks=9 * blocks_per_seq,
        cpu_weight_dtype=weights,
    )


def _mv_generate(llm: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(seconds to the last token, seconds to every prompt's first token)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        llm.add_prompt(p, params)
    first = None
    while not llm.scheduler.is_finished():
        llm.step()
        if first is None and all(s.num_completion_tokens > 0 for s in llm.scheduler.running):
            if not llm.scheduler.waiting:
                first = time.perf_counter()
    end = time.perf_counter()
    return end - start, (first or end) - start


def _mv_tokens(llm: LLMEngine, prompt: list[int], new_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return llm.generate([prompt], params)["token_ids"][0]


def _hf_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = model.generate(
        torch.tensor(prompts),  # equal lengths: no padding
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, len(prompts[0]) :].tolist()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_latency_cpu(args: argparse.Namespace):
    new_tokens = args.new_tokens
    report(f"starting minivllm ({args.model})")
    start = time.perf_counter()
    llm = _mv_engine(args)
    vocab = llm.config.model.vocab_size
    rng = random.Random(0)
    short = [rng.randrange(vocab) for _ in range(16)]
    _mv_tokens(llm, short, 1)
    mv_start = time.perf_counter() - start
    dtype = llm.dtype
    report(f"minivllm start-up {mv_start:.1f} s; starting transformers")

    start = time.perf_counter()
    with torch.inference_mode():
        hf, note = load_hf_model(args, torch.device("cpu"), dtype)
        _hf_generate(hf, [short], 1)
    hf_start = time.perf_counter() - start
    report(f"transformers start-up {hf_start:.1f} s; warming up, then {args.repeats} rounds "
           f"(each: decode of {new_tokens} tokens, TTFT {args.prompt_len} and "
           f"{args.ttft_prompt_len}, 8 x {new_tokens}; both engines)")

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]

    figures = ("decode", "ttft128", "batch8", "ttft_long")
    times: dict[str, dict[str, list[float]]] = {e: {f: [] for f in figures} for e in ("mv", "hf")}
    same_tokens = []
    # Warm-up of each shape (untimed), then the rounds.
    _mv_generate(llm, prompts(8, args.prompt_len), 4)
    with torch.inference_mode():
        _hf_generate(hf, prompts(8, args.prompt_len), 4)
    for i in range(args.repeats):
        p1, p8 = prompts(1, args.prompt_len), prompts(8, args.prompt_len)
        p_long = prompts(1, args.ttft_prompt_len)
        total, first = _mv_generate(llm, p1, new_tokens)
        times["mv"]["decode"].append((new_tokens - 1) / (total - first))
        times["mv"]["ttft128"].append(_mv_generate(llm, p1, 1)[0])
        times["mv"]["batch8"].append(8 * new_tokens / _mv_generate(llm, p8, new_tokens)[0])
        times["mv"]["ttft_long"].append(_mv_generate(llm, p_long, 1)[0])
        with torch.inference_mode():
            hf_total = _timed(lambda p=p1: _hf_generate(hf, p, new_tokens))
            hf_first = _timed(lambda p=p1: _hf_generate(hf, p, 1))
            times["hf"]["decode"].append((new_tokens - 1) / (hf_total - hf_first))
            times["hf"]["ttft128"].append(hf_first)
            hf_8 = _timed(lambda p=p8: _hf_generate(hf, p, new_tokens))
            times["hf"]["batch8"].append(8 * new_tokens / hf_8)
            times["hf"]["ttft_long"].append(_timed(lambda p=p_long: _hf_generate(hf, p, 1)))
            ref = _hf_generate(hf, p1, PARITY_TOKENS)[0]
        same_tokens.append(_mv_tokens(llm, p1[0], PARITY_TOKENS) == ref)
        for engine, label in (("mv", "minivllm"), ("hf", "transformers")):
            t = {figure: values[-1] for figure, values in times[engine].items()}
            report(f"round {i + 1}/{args.repeats}, {label}: decode {t['decode']:,.1f} tok/s, "
                   f"TTFT {args.prompt_len} {t['ttft128'] * 1e3:,.0f} ms, TTFT "
                   f"{args.ttft_prompt_len} {t['ttft_long'] * 1e3:,.0f} ms, 8 x {new_tokens} "
                   f"{t['batch8']:,.1f} tok/s")
    llm.exit()

    def med(engine: str, figure: str) -> float:
        return statistics.median(times[engine][figure])

    hf_dt = str(dtype).replace("torch.", "")
    mv_dt = dtype_label(llm)
    rounds = f"median of {args.repeats} interleaved rounds, {torch.get_num_threads()} threads"
    rows = []
    for engine, label in (("mv", "minivllm"), ("hf", "transformers")):
        rows += [
            Row(
                f"{label} batch-1 decode",
                med(engine, "decode"),
                "tok/s",
                f"{mv_dt if engine == 'mv' else hf_dt}; {args.prompt_len}-token prompt, "
                f"{new_tokens} greedy tokens; {rounds}",
            ),
            Row(f"{label} TTFT {args.prompt_len}", med(engine, "ttft128") * 1e3, "ms", ""),
            Row(
                f"{label} 8 x {new_tokens}",
                med(engine, "batch8"),
                "output tok/s",
                f"8 prompts of {args.prompt_len} tokens, prefill included",
            ),
            Row(f"{label} TTFT {args.ttft_prompt_len}", med(engine, "ttft_long") * 1e3, "ms", ""),
            Row(
                f"{label} start-up",
                mv_start if engine == "mv" else hf_start,
                "s",
                "to the first token, warm caches" + ("" if engine == "mv" else f"; {note}"),
            ),
        ]
    rows.append(
        Row(
            "decode ratio",
            med("mv", "decode") / med("hf", "decode"),
            "x",
            f"minivllm / transformers; greedy {PARITY_TOKENS} tokens equal in "
            f"{sum(same_tokens)}/{len(same_tokens)} rounds",
        )
    )
    return rows
