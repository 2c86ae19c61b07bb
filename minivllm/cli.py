"""The `minivllm` command: `generate`, `warmup`, `bench` and `cache`.

User errors (a bad option value, a missing model, no GPU for `--device cuda`) end with
one line naming the option and the value, and exit status 1; never a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from .chat_defaults import (
    SMALL_MODEL_PARAMS,
    SMALL_MODEL_REPETITION_PENALTY,
    chat_sampling_defaults,
)
from .config import APP_CPU_WEIGHT_DTYPE
from .engine_args import DEFAULT_MODEL, EngineArgs, option_of_key
from .envs import default_openmp_waits
from .progress import print_progress

# Config key -> the command-line option that sets it, for error messages.
OPTION_OF_KEY = option_of_key()
# `minivllm generate`'s engine defaults where they are not the engine's.
GENERATE_DEFAULTS = {"max_model_length": 4096, "cpu_weight_dtype": APP_CPU_WEIGHT_DTYPE}
# What loading can raise for a user's mistake (bad values, missing or broken files).
USER_ERRORS = (ValueError, TypeError, OSError)


def check_engine_config(config: dict[str, Any]) -> Any:
    """Validate what can be validated before the engine is built: the keys and values,
    the model (found, with its config.json), the device and the GPU count. Returns the
    `EngineConfig`; raises ValueError / TypeError / OSError naming the key and value."""
    from .config import EngineConfig

    checked = EngineConfig.from_dict(config)
    if checked.device == "cuda" or checked.world_size > 1:
        import torch

        if checked.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda': no CUDA GPU is available here")
        if torch.cuda.is_available() and checked.device != "cpu":
            from .engine.worker import tp_device

            tp_device(torch.device("cuda"), checked.world_size)
    return checked


def describe_error(exc: BaseException, options: dict[str, str] | None = None) -> str:
    """One line for a user: config keys in the message become the options that set them
    (`max_model_length=999999999 is ...` -> `--max-model-len=999999999 is ...`)."""
    text = str(exc).strip() or type(exc).__name__
    for key, option in (options or OPTION_OF_KEY).items():
        text = re.sub(rf"(?<![\w.-])(?:[A-Za-z]\w*\.)?{key}=", f"{option}=", text)
    return " ".join(text.split())  # one line


def torch_gpu_build() -> bool:
    """Whether the installed torch is built for a GPU (CUDA, ROCm or XPU), read from
    torch/version.py, which records None for each backend it was not built with: known without
    importing torch (seconds of a start)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version.read_text()
    except OSError:
        return True  # unknown: the caller asks torch itself
    backends = re.findall(r"^(cuda|hip|xpu)\b[^=\n]*=\s*(.+)$", text, re.MULTILINE)
    return not backends or any(value.strip() != "None" for _, value in backends)


def build_cpu_kernel_meanwhile(device: str) -> Any:
    """On a CPU, start loading the CPU kernel on a thread (compiling it on a first start,
    while the GGUF conversion runs); returns the thread to join before exiting, or None."""
    if device == "cuda" or (device == "auto" and torch_gpu_build()):
        return None
    from .kernels import cpu_lowp_linear

    return cpu_lowp_linear.build_in_background()


def generate(args: argparse.Namespace) -> None:
    build = build_cpu_kernel_meanwhile(args.device)
    try:
        _generate(args)
    finally:
        if build is not None:
            build.join()  # a build cut short by the exit would leave its lock file behind


def _generate(args: argparse.Namespace) -> None:
    from . import LLMEngine, SamplingParams

    config = EngineArgs.from_cli_args(args).engine_config()
    checked = check_engine_config(config)
    # A chat gets the model's default sampling (`chat_defaults`); a plain completion is
    # greedy. Options given win either way.
    sampling: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                "repetition_penalty": 1.0}
    if args.chat:
        sampling.update(chat_sampling_defaults(checked))
    for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.seed, **sampling)
    llm = LLMEngine(config, on_progress=print_progress if sys.stderr.isatty() else None)
    try:
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
    finally:
        llm.exit()


def warmup(args: argparse.Namespace) -> None:
    """A first start's one-time work, done ahead (`make install` runs it): the GGUF
    conversion, the CPU kernel's build (both at once) and the packed weights of the apps'
    default plan, then one decode step to prove the engine runs."""
    import time

    from . import LLMEngine, SamplingParams

    start = time.perf_counter()
    build = build_cpu_kernel_meanwhile(args.device)
    config = {"model_name_or_path": args.model, "device": args.device,
              "cpu_weight_dtype": APP_CPU_WEIGHT_DTYPE, "max_model_length": 256}
    try:
        llm = LLMEngine(config, on_progress=print_progress if sys.stderr.isatty() else None)
        try:
            # Two prompt tokens: a prefill, whose products make (and cache) the linears'
            # prefill copies, so that the first prompt of a chat does not wait for them.
            llm.generate([[0, 0]], SamplingParams(max_tokens=2, ignore_eos=True))
            done = f"{llm.device.type}, {str(llm.dtype).removeprefix('torch.')}"
            if llm.cpu_weight_format:
                done += f", {llm.cpu_weight_format} weights"
        finally:
            llm.exit()
    finally:
        if build is not None:
            build.join()
    if build is not None:
        from .kernels import cpu_lowp_linear

        reason = cpu_lowp_linear.unavailable_reason()
        if reason is not None:
            print(f"minivllm warmup: the CPU kernel did not build ({reason}); the engine "
                  "runs without it, slower", file=sys.stderr)
    print(f"minivllm warmup: {args.model} ready ({done}) in {time.perf_counter() - start:.1f} s")

def cache(args: argparse.Namespace) -> None:
    """List the on-disk cache's entries (size, last use, source), or prune or clear it.
    A clear that had to keep an entry (in use by another process) exits 1."""
    from .loader import cache as disk

    if args.prune or args.clear:
        _remove_from_cache(disk.prune() if args.prune else disk.clear(), args.clear)
    else:
        _list_cache()


def _list_cache() -> None:
    import time

    from .loader import cache as disk

    root = disk.gguf_cache_dir()
    found = disk.entries()
    newer = disk.newest_by_source(found)
    now = time.time()
    sizes = {e.path: disk.size_of(e.path) for e in found}
    print(f"minivllm cache: {root}: {len(found)} entries, {_size(sum(sizes.values()))}")
    if found:
        print(f"{'SIZE':>9}  {'LAST USE':<16}  {'ENTRY':<40}  SOURCE")
    for e in sorted(found, key=lambda e: e.last_use, reverse=True):
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_use))
        source = ", ".join(e.sources) or "(not recorded: an older minivllm)"
        stale = disk.stale_reason(e, newer, now)
        folder = disk.packed_folder(e)
        older = [f for tag in disk.stale_tags(folder) for f in disk.tag_files(folder, tag)]
        if stale is None and older:
            stale = f"older packings, {_size(sum(map(disk.size_of, older)))}"
        if stale is not None:
            source += f" [stale: {stale}]"
        print(f"{_size(sizes[e.path]):>9}  {used:<16}  {_relative(e.path, root):<40}  {source}")


def _remove_from_cache(done: list[Any], clearing: bool) -> None:
    """Print what a prune or a clear removed and kept; raises where a clear kept some."""
    from .loader import cache as disk

    root = disk.gguf_cache_dir()
    for r in done:
        verb = "removed" if r.removed else "kept"
        print(f"{verb} {_relative(r.path, root)} ({_size(r.size)}): {r.reason}")
    print(f"minivllm cache: {root}: freed {_size(sum(r.size for r in done if r.removed))}")
    in_use = sum(1 for r in done if not r.removed and r.reason == disk.IN_USE)
    if clearing and in_use:
        raise OSError(f"{in_use} of the cache's entries were kept: {disk.IN_USE}")


def _relative(path: Any, root: Any) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _size(n: float) -> str:
    """Bytes for a reader: 512 B, 1.3 kB, 96.5 MB, 1.3 GB."""
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} GB"


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """`generate`, `warmup`, `bench` (whose options are added only `with_bench`) and
    `cache`."""
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete prompts (streamed to stdout)")
    g.add_argument("--prompt", action="append", help="repeatable; default: lines of stdin")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    chat = "with --chat the model's default (its generation_config.json)"
    g.add_argument("--temperature", type=float, default=None, help=f"default: 0, greedy; {chat}")
    g.add_argument("--top-p", type=float, default=None, help=f"default: 1; {chat}")
    g.add_argument("--top-k", type=int, default=None, help=f"default: -1, off; {chat}")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"default: 1, off; {chat}, else {SMALL_MODEL_REPETITION_PENALTY:g} "
                   f"for a model under {SMALL_MODEL_PARAMS // 10**6:,}M parameters")
    # `--seed` (an engine option) also seeds each prompt's sampling.
    EngineArgs.add_cli_args(g.add_argument_group("engine"), defaults=GENERATE_DEFAULTS)

    w = sub.add_parser("warmup", help="do a first start's one-time work now: convert the "
                       "model, build the CPU kernel, pack the weights")
    w.add_argument("--model", default=DEFAULT_MODEL)
    w.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])

    b = sub.add_parser(
        "bench", help="PERF.md's workloads: throughput, latency, prefill, chat, coldstart"
    )
    if with_bench:  # the bench module imports the engine: not for `generate`
        from .bench.workloads import add_arguments

        add_arguments(b)

    c = sub.add_parser("cache", help="list the on-disk cache (converted GGUFs, packed "
                       "weights) with sizes and sources; prune or clear it")
    action = c.add_mutually_exclusive_group()
    action.add_argument("--prune", action="store_true", help="remove the stale entries: "
                        "those whose source is gone or has a newer entry, and older packings")
    action.add_argument("--clear", action="store_true",
                        help="remove every entry not in use (the next start rebuilds them)")
    return parser


def main(argv: list[str] | None = None) -> None:
    default_openmp_waits()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the HTTP server, with vLLM's flag names
        from .server.cli import main as serve

        sys.exit(serve(argv[1:]))
    if argv[:2] == ["bench", "serve"]:
        from .bench.serve import main as bench_serve

        sys.exit(bench_serve(argv[2:]))
    parser = build_parser(with_bench=argv[:1] == ["bench"])
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            generate(args)
        elif args.command == "warmup":
            warmup(args)
        elif args.command == "cache":
            try:
                cache(args)
            except BrokenPipeError:  # its reader left (`minivllm cache | head`): quietly
                import os

                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                sys.exit(1)
        else:
            from .bench.workloads import main as bench_main

            bench_main(args)
    except USER_ERRORS as e:
        options = {**OPTION_OF_KEY, "max_tokens": "--max-tokens", "temperature": "--temperature",
                   "top_p": "--top-p", "seed": "--seed", "top_k": "--top-k",
                   "repetition_penalty": "--repetition-penalty"}
        print(f"minivllm: error: {describe_error(e, options)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
