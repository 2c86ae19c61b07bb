"""`minivllm serve`: the engine behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import uvicorn

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Every engine config key as a flag, with vLLM's flag name where the meaning is the
    same. Unset flags keep the engine's defaults."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"folder, .gguf file or Hub name (default: {DEFAULT_MODEL})")
    p.add_argument("--max-model-len", type=int, dest="max_model_length",
                   help="cap on prompt + completion tokens (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, dest="max_num_sequences",
                   help="sequences in one step (default: 16)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens in one step (default: 1024)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: 256)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, dest="world_size",
                   help="tensor-parallel ranks (default: 1)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="share of free GPU memory for the KV pool (default: 0.9)")
    p.add_argument("--num-gpu-blocks-override", type=int, dest="max_cached_blocks",
                   help="KV pool size in blocks (CPU: the pool; default: sized)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                   help="weights and activations (default: auto)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage (default: auto, the model's dtype; fp8: e4m3)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="default: auto")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="share KV blocks of common prefixes (default: on)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=None, help="split long prompts across steps (default: on)")
    p.add_argument("--load-format", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's architecture")
    p.add_argument("--seed", type=int, help="seeds unseeded sampling")
    p.add_argument("--eos-token-id", type=int, action="append", dest="eos",
                   help="end-of-sequence id (repeatable; default: the model's)")
    p.add_argument("--max-num-batch-tokens", type=int,
                   help="warm-up batch for memory profiling (default: --max-num-batched-tokens)")
    p.add_argument("--stand-in-ms", type=float, nargs=2, metavar=("HOST", "DEVICE"),
                   help="benchmarks only: no model; each step costs HOST ms of Python and "
                   "DEVICE ms of GIL-free waiting (e.g. 0.3 1.4 is an H200's decode step)")


ENGINE_KEYS = ("max_model_length", "max_num_sequences", "max_num_batched_tokens", "block_size",
               "world_size", "gpu_memory_utilization", "max_cached_blocks", "enforce_eager",
               "dtype", "device", "enable_prefix_caching", "enable_chunked_prefill",
               "load_format", "seed", "eos", "max_num_batch_tokens", "kv_cache_dtype")


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {"model_name_or_path": args.model}
    for key in ENGINE_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            config[key] = tuple(value) if key == "eos" else value
    return config


def build_engine(args: argparse.Namespace, on_progress: Any = None) -> Any:
    """The engine the flags ask for: the real one, or the benchmark's stand-in."""
    if getattr(args, "stand_in_ms", None):
        from .standin import stand_in_engine

        host_ms, device_ms = args.stand_in_ms
        return stand_in_engine(engine_config(args), host_ms=host_ms, device_ms=device_ms,
                               on_progress=on_progress)
    from minivllm import LLMEngine

    return LLMEngine(engine_config(args), on_progress=on_progress)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minivllm serve",
        description="Serve a model over OpenAI's HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /metrics).",
    )
    p.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: --model)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a child process, so HTTP work does not compete "
                   "with it for the GIL (default: on)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(p)
    return p


def _progress(stage: str, fraction: float) -> None:
    print(f"minivllm serve: {stage} [{fraction:4.0%}]", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model_tag:
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        print(f"minivllm serve: --port {args.port}: must be in [0, 65535]", file=sys.stderr)
        return 1
    from ..frontend import EngineFrontend
    from ..frontend.engine_process import SWITCH_INTERVAL_S, EngineProcessClient
    from .api import build_app

    sys.setswitchinterval(SWITCH_INTERVAL_S)  # see its note

    frontend: Any
    try:
        if args.engine_process:
            frontend = EngineProcessClient(functools.partial(build_engine, args))
            frontend.start(_progress)
        else:
            # Built on the thread that steps it (EngineFrontend: on the CPU it steps at half
            # speed elsewhere).
            frontend = EngineFrontend(engine_factory=functools.partial(build_engine, args),
                                      owns_engine=True)
            frontend.start(_progress)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        print(f"minivllm serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    name = args.served_model_name or args.model
    app = build_app(frontend, model_name=name, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    server = _Server(config, frontend)
    try:
        print(f"minivllm serve: {name} on http://{args.host}:{args.port}/v1",
              file=sys.stderr, flush=True)
        server.run()
    finally:
        frontend.close()  # aborts what is left and exits the engine (and its TP workers)
    if not server.started:
        return 1  # the port was taken, say; uvicorn said why
    print("minivllm serve: stopped", file=sys.stderr, flush=True)
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, whose Ctrl-C / SIGTERM also aborts the requests in flight (so
    streaming responses end at once and the graceful shutdown does not wait on them)
    and ends with exit status 0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, frontend: Any) -> None:
        super().__init__(config)
        self.frontend = frontend

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.frontend.abort_all(refuse_new=True)
        super().handle_exit(sig, frame)
        # uvicorn re-raises the captured signals after shutting down; we exit 0 instead.
        captured = getattr(self, "_captured_signals", None)
        if captured is not None:
            captured.clear()
