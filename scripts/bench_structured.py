"""What constrained requests cost the unconstrained ones batched with them.

The same batch runs twice, interleaved over several rounds: every request unconstrained,
then with a share of them (default 1/4) under a JSON schema. Both use greedy sampling, and
the plain requests ignore the end of sequence, so every request decodes `--tokens` tokens
unless its grammar ends it first (the schema asks for a long array: it does not). The
figure is what each unconstrained request gets: a token every decode step from the first
one to the plain requests' end, over that time (constrained requests may sit steps out:
with overlapped scheduling they decode every other step beside plain ones), and the ratio
to the same request's rate in the all-unconstrained batch; a constrained request's rate
(its tokens over the time to its end) follows.

    python scripts/bench_structured.py                     # SmolLM2 on the CPU
    python scripts/bench_structured.py --device cuda --load-format dummy \\
        --model /path/to/smollm2-config-and-tokenizer      # random weights on a GPU
    python scripts/bench_structured.py --stand-in-ms 0.3 1.4  # no model, GPU-like steps

`--first-request IDLE_S`: instead, the time to first token of a fresh engine's first
constrained request, sent IDLE_S seconds after the engine is built, with the grammar
backend prepared at build time as the server does (`--no-prepare`: not). One figure a
process (the first request also pays imports), so run it several times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from minivllm import LLMEngine, SamplingParams, StructuredOutputsParams

# An object holding a long array of small records: the grammar stays busy (strings,
# integers, enums, nesting) for every token the benchmark decodes.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 64}},
    "required": ["people"],
    "additionalProperties": False,
}
PROMPTS = [
    "List some people as JSON.",
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe the city of Lisbon.",
]


def batch_params(n: int, constrained: int, tokens: int) -> list[SamplingParams]:
    """`constrained` of `n` requests (spread evenly) under the schema, the rest plain."""
    every = n // constrained if constrained else n + 1
    params = []
    for i in range(n):
        if constrained and i % every == 0 and sum(p.structured_outputs is not None
                                                  for p in params) < constrained:
            params.append(SamplingParams(
                temperature=0, max_tokens=tokens,
                structured_outputs=StructuredOutputsParams(json=SCHEMA)))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return params


def run_batch(llm: LLMEngine, params: list[SamplingParams]) -> dict[str, Any]:
    """Run one batch to the end. A plain request gains a token every decode step until it
    ends, so its rate is the decode steps over the time from the first one to the plain
    requests' end; a constrained request's rate is its tokens over the time to its end."""
    ids = [llm.add_prompt(PROMPTS[i % len(PROMPTS)], sp) for i, sp in enumerate(params)]
    plain = {i for i, sp in zip(ids, params, strict=True) if sp.structured_outputs is None}
    start = plain_end = None
    steps = []  # the decode steps while plain requests run
    constrained = []  # (tokens, seconds from the first decode step to the end)
    while not llm.scheduler.is_finished():
        t0 = time.perf_counter()
        finished, _, is_prefill = llm.step()
        t1 = time.perf_counter()
        if start is None and not is_prefill:
            start = t0
        if start is not None and plain_end is None:
            steps.append(t1 - t0)
        for seq_id, tokens in finished:
            if seq_id in plain:
                plain.discard(seq_id)
                if not plain:
                    plain_end = t1
            elif start is not None:
                constrained.append((len(tokens), t1 - start))
    assert start is not None and (plain_end is not None or not steps)
    return {
        "steps": len(steps),
        "step_ms": statistics.median(steps) * 1e3 if steps else float("nan"),
        "tok_s": len(steps) / (plain_end - start) if steps else float("nan"),
        "constrained_tok_s": (statistics.median(n / s for n, s in constrained)
                              if constrained else float("nan")),
    }


def first_request(llm: LLMEngine, idle_s: float, prepare: bool) -> float:
    """Seconds from adding the engine's first constrained request to its first token."""
    if prepare:
        llm.prepare_structured_outputs()
    time.sleep(idle_s)
    t0 = time.perf_counter()
    seq_id = llm.add_prompt(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    while seq_id not in {i for i, _ in llm.step()[0]}:
        pass
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=16, help="requests in the batch")
    p.add_argument("--constrained", type=float, default=0.25,
                   help="share of the batch under the JSON schema")
    p.add_argument("--tokens", type=int, default=64, help="tokens each request decodes")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--stand-in-ms", type=float, nargs=2, metavar=("HOST", "DEVICE"),
                   help="no model: `bench serve`'s stand-in engine, each step HOST ms of "
                        "Python and DEVICE ms of GIL-free waiting (overlapped scheduling)")
    p.add_argument("--first-request", type=float, metavar="IDLE_S")
    p.add_argument("--no-prepare", action="store_true")
    args = p.parse_args()
    config: dict[str, Any] = {
        "model_name_or_path": args.model, "device": args.device, "dtype": args.dtype,
        "load_format": args.load_format, "max_num_sequences": args.batch,
        "max_model_length": 1024,
    }
    if args.async_scheduling != "auto":
        config["async_scheduling"] = args.async_scheduling == "on"
    if args.stand_in_ms:
        from minivllm.server.standin import stand_in_engine

        llm = stand_in_engine(config, host_ms=args.stand_in_ms[0],
                              device_ms=args.stand_in_ms[1])
    else:
        llm = LLMEngine(config)
    if args.first_request is not None:
        ttft = first_request(llm, args.first_request, not args.no_prepare)
        print(f"first constrained request {1e3 * ttft:.0f} ms to its first token "
              f"(sent {args.first_request:g} s after the engine was built, grammar backend "
              f"{'not ' if args.no_prepare else ''}prepared)")
        llm.exit()
        return
    n_constrained = round(args.batch * args.constrained)
    variants = {
        "all unconstrained": batch_params(args.batch, 0, args.tokens),
        f"{n_constrained}/{args.batch} JSON schema": batch_params(
            args.batch, n_constrained, args.tokens),
    }
    print(f"device {llm.device}, async scheduling {llm.async_scheduling}, batch {args.batch}, "
          f"{args.tokens} tokens, {args.rounds} rounds")
    for params in variants.values():  # warm-up: grammar compilation, kernels, graphs
        run_batch(llm, params)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, params in variants.items():
            results[name].append(run_batch(llm, params))
    base = None
    for name, runs in results.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        step = statistics.median(r["step_ms"] for r in runs)
        base = base or tok_s
        under = statistics.median(r["constrained_tok_s"] for r in runs)
        print(f"{name:>22}: a plain request {tok_s:7.1f} tok/s ({100 * tok_s / base:5.1f}%), "
              f"step {step:7.2f} ms (median of {len(runs)}; per run: "
              + ", ".join(f"{r['tok_s']:.1f}" for r in runs) + ")"
              + (f"; a constrained request {under:.1f} tok/s" if under == under else ""))
    llm.exit()


if __name__ == "__main__":
    main()
