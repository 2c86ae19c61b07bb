"""transformers on the same weights and the same requests, for the bench's comparisons."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import Row, load_hf_model


def device_dtype(args) -> tuple[torch.device, torch.dtype]:
    device = torch.device(
        "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.dtype not in (None, "auto"):
        dtype = getattr(torch, args.dtype)
    return device, dtype


@torch.inference_mode()
def hf_latency(args: argparse.Namespace, vocab: int) -> list[Row]:
    device, dtype = device_dtype(args)
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

    device, dtype = device_dtype(args)
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
