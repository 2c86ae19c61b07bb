"""`minivllm-chat`: the Textual app, or with `--plain` (or no terminal) a line REPL."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

from .conversation import Settings
from .engine_thread import EngineFactory

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minivllm-chat",
        description="Chat with a local model in several conversations side by side, "
        "with a live view of the engine (KV blocks, running/waiting requests, throughput).",
    )
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model folder, .gguf file or Hub name (default: {DEFAULT_MODEL})")
    p.add_argument("--conversations", type=int, default=2, metavar="N",
                   help="panes side by side at start (default: 2)")
    p.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (default: 1)")
    p.add_argument("--max-model-length", type=int, default=None, metavar="L",
                   help="cap on prompt + reply tokens per conversation")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="where the engine runs (default: auto)")
    p.add_argument("--system", default="", metavar="TEXT", help="system prompt for every pane")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (0 is greedy)")
    p.add_argument("--max-tokens", type=int, default=None, help="reply length cap")
    p.add_argument("--resume", action="store_true", help="restore the last session")
    p.add_argument("--plain", action="store_true",
                   help="line-oriented REPL instead of the full-screen app")
    p.add_argument("--keymap", type=Path, default=None, metavar="FILE",
                   help="JSON {binding id: keys} (default: $XDG_CONFIG_HOME/minivllm/keymap.json)")
    p.add_argument("--url", default=None, metavar="URL",
                   help="chat with a running `minivllm serve` (http://HOST:PORT) instead of "
                   "loading a model here")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="with --url: the server's API key")
    p.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)  # scripted engine
    return p


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_name_or_path": args.model,
        "world_size": args.world_size,
        "device": args.device,
    }
    if args.max_model_length:
        config["max_model_length"] = args.max_model_length
    return config


def engine_factory(args: argparse.Namespace) -> EngineFactory:
    config = engine_config(args)

    def build(on_progress: Any) -> Any:
        if getattr(args, "url", None):
            from .remote import RemoteClient  # an EngineClient: the worker starts it

            return RemoteClient(args.url, args.api_key)
        if args.fake:
            from .fake_engine import FakeEngine

            return FakeEngine(config, on_progress, thinking=True, step_delay=0.02,
                              load_delay=1.0)
        from minivllm import LLMEngine

        params = inspect.signature(LLMEngine).parameters
        if "on_progress" in params:
            return LLMEngine(config, on_progress=on_progress)
        return LLMEngine(config)

    return build


def load_keymap(path: Path | None) -> dict[str, str]:
    if path is None:
        base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
        path = Path(base) / "minivllm" / "keymap.json"
        if not path.is_file():
            return {}
    with open(path, encoding="utf-8") as f:
        keymap = json.load(f)
    if not isinstance(keymap, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in keymap.items()
    ):
        raise ValueError(f"{path}: expected a JSON object of binding id -> keys")
    return keymap


def settings_from(args: argparse.Namespace) -> Settings:
    s = Settings(system_prompt=args.system)
    if args.temperature is not None:
        s.temperature = args.temperature
    if args.max_tokens is not None:
        s.max_tokens = args.max_tokens
    s.sampling_params()  # a bad value fails here, naming the field
    return s


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
        keymap = load_keymap(args.keymap)
    except (ValueError, OSError) as exc:
        print(f"minivllm-chat: {exc}", file=sys.stderr)
        return 2
    if args.conversations < 1:
        print("minivllm-chat: --conversations must be >= 1", file=sys.stderr)
        return 2
    factory = engine_factory(args)
    if args.plain or not (sys.stdin.isatty() and sys.stdout.isatty()):
        from .plain import run_plain

        return run_plain(engine_factory=factory, settings=settings)
    from .app import create_app

    app = create_app(
        engine_factory=factory, model=args.url or args.model, conversations=args.conversations,
        settings=settings, resume=args.resume, keymap=keymap,
    )
    app.run()
    return app.return_code or 0


if __name__ == "__main__":
    sys.exit(main())
