"""The `minivllm` command: `generate` and `bench`."""

from __future__ import annotations

import argparse
import sys

DEFAULT_CHAT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def print_progress(stage: str, fraction: float) -> None:
    """The engine's start-up stages (weights, KV sizing, CUDA graphs) on stderr."""
    end = "\n" if fraction >= 1 else ""
    print(f"\r\033[Kminivllm: {stage} [{fraction:4.0%}]", end=end, file=sys.stderr, flush=True)


def generate(args: argparse.Namespace) -> None:
    from . import LLMEngine, SamplingParams

    llm = LLMEngine(
        {
            "model_name_or_path": args.model,
            "device": args.device,
            "max_model_length": args.max_model_length,
        },
        on_progress=print_progress if sys.stderr.isatty() else None,
    )
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    for prompt in prompts:
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=False,
            )
        seq_id = llm.add_prompt(prompt, params)
        done = False
        while not done:
            llm.step()
            for d in llm.pop_deltas():
                if d.seq_id == seq_id:
                    print(d.text, end="", flush=True)
                    done = d.finished
        print()
    llm.exit()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "chat"]:  # the app's own benchmark, with its own options
        from .tui.bench import main as bench_chat

        sys.exit(bench_chat(argv[2:]))
    if argv[:1] == ["serve"]:  # the HTTP server, with vLLM's flag names
        from .server.cli import main as serve

        sys.exit(serve(argv[1:]))
    if argv[:2] == ["bench", "serve"]:
        from .server.bench import main as bench_serve

        sys.exit(bench_serve(argv[2:]))
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete prompts (streamed to stdout)")
    g.add_argument("--model", default=DEFAULT_CHAT_MODEL)
    g.add_argument("--prompt", action="append", help="repeatable; default: lines of stdin")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--max-model-length", type=int, default=4096)

    from .bench import add_arguments

    b = sub.add_parser("bench", help="PERF.md's throughput and latency workloads")
    add_arguments(b)

    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            generate(args)
        else:
            from .bench import main as bench_main

            bench_main(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.exit(2, f"minivllm: error: {e}\n")


if __name__ == "__main__":
    main()
