"""`minivllm-chat`: the Textual app, or with `--plain` (or no terminal) a line REPL.

What can be checked before the screen opens is (options, the model, the device, the
keymap); a user error ends with one line naming the option and the value, exit status 1.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

from minivllm.chat_defaults import SMALL_MODEL_PARAMS, SMALL_MODEL_REPETITION_PENALTY
from minivllm.config import APP_CPU_WEIGHT_DTYPE
from minivllm.engine_args import EngineArgs
from minivllm.envs import default_openmp_waits

from .conversation import Settings
from .engine_client import EngineFactory
from .engine_defaults import CPU_STEP_TOKENS, runs_on_cpu

FAKE_OPTIONS: dict[str, Any] = {"thinking": True, "step_delay": 0.02, "load_delay": 1.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minivllm-chat",
        description="Chat with a local model in several conversations side by side, "
        "with a live view of the engine (KV blocks, running/waiting requests, throughput).",
    )
    p.add_argument("--conversations", type=int, default=2, metavar="N",
                   help="panes side by side at start (default: 2)")
    p.add_argument("--system", default="", metavar="TEXT", help="system prompt for every pane")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (0 is greedy; default: the model's "
                   "generation_config, else 0.7)")
    p.add_argument("--max-tokens", type=int, default=None, help="reply length cap")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="X",
                   help="above 1 discourages repeating tokens (default: the model's, else "
                   f"{SMALL_MODEL_REPETITION_PENALTY:g} below {SMALL_MODEL_PARAMS // 10**6:,}M "
                   "parameters, else 1)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="ID",
                   help="restore the newest session with messages, or session ID")
    p.add_argument("--sessions", action="store_true",
                   help="list saved sessions (id, date, panes, first words) and exit")
    p.add_argument("--plain", action="store_true",
                   help="line-oriented REPL instead of the full-screen app")
    p.add_argument("--keymap", type=Path, default=None, metavar="FILE",
                   help="JSON {binding id: keys} (default: $XDG_CONFIG_HOME/minivllm/keymap.json)")
    p.add_argument("--url", default=None, metavar="URL",
                   help="chat with a running `minivllm serve` (http://HOST:PORT) instead of "
                   "loading a model here")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="with --url: the server's API key")
    p.add_argument("--engine-process", default="auto", choices=["auto", "on", "off"],
                   help="run the engine in a child process, so the screen never holds the "
                   "engine up (one GIL per process); auto: on, except for a remote "
                   "server (--url) and the scripted test engine (default: auto)")
    p.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)  # scripted engine
    EngineArgs.add_cli_args(
        p.add_argument_group("engine"),
        defaults={"cpu_weight_dtype": APP_CPU_WEIGHT_DTYPE},
        help_defaults={"max_num_batched_tokens": f"{CPU_STEP_TOKENS} on a CPU, so steps stay "
                       "short; else the engine's"},
    )
    return p


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    return EngineArgs.from_cli_args(args).engine_config()


def check_config(args: argparse.Namespace) -> dict[str, Any]:
    """The engine config, validated before the engine is built (raises with the option
    named); on a CPU the step budget defaults to `CPU_STEP_TOKENS`."""
    return checked_config(args)[0]


def checked_config(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float]]:
    """`check_config`'s config, and the model's default chat sampling
    (`minivllm.chat_defaults`; empty for a server or the scripted engine)."""
    config = engine_config(args)
    if args.fake or getattr(args, "url", None):  # nothing local to check
        return config, {}
    from minivllm.chat_defaults import chat_sampling_defaults
    from minivllm.cli import check_engine_config

    checked = check_engine_config(config)
    if args.max_num_batched_tokens is None and runs_on_cpu(checked.device):
        # Not above max_model_length: the engine needs a step to hold one sequence's chunk.
        config["max_num_batched_tokens"] = min(CPU_STEP_TOKENS, checked.max_len)
    return config, chat_sampling_defaults(checked)


def use_engine_process(args: argparse.Namespace) -> bool:
    """`--engine-process`: auto is on for a local engine. NOTE: in one process the UI thread
    and the engine share a GIL: on a GPU the UI took it at every device wait, and on a CPU
    the app's rendering slowed the engine's steps too."""
    choice = getattr(args, "engine_process", "off")
    if getattr(args, "url", None) or choice == "off":
        return False
    return choice == "on" or not args.fake


def engine_factory(args: argparse.Namespace, config: dict[str, Any]) -> EngineFactory:
    def build(on_progress: Any) -> Any:
        if getattr(args, "url", None):
            from .remote import RemoteClient  # an EngineClient: the worker starts it

            return RemoteClient(args.url, args.api_key)
        if use_engine_process(args):
            from .engine_spec import EngineSpec, engine_process_client  # the worker starts it

            if args.fake:
                return engine_process_client(EngineSpec("fake", config, FAKE_OPTIONS))
            return engine_process_client(EngineSpec("llm", config))
        if args.fake:
            from minivllm.server.standin import ScriptedEngine

            return ScriptedEngine(config, on_progress, **FAKE_OPTIONS)
        from minivllm import LLMEngine
        from minivllm.frontend import EngineFrontend

        def llm(on_progress: Any) -> Any:
            params = inspect.signature(LLMEngine).parameters
            if "on_progress" in params:
                return LLMEngine(config, on_progress=on_progress)
            return LLMEngine(config)

        # In this process too, the engine is built on the thread that steps it (a CPU
        # engine steps at half speed elsewhere: EngineFrontend); the worker starts it.
        return EngineFrontend(engine_factory=llm, owns_engine=True)

    return build


def default_keymap_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
    return Path(base) / "minivllm" / "keymap.json"


def load_keymap(path: Path | None, known: set[str] | None = None) -> dict[str, str]:
    """The keymap file (binding id -> keys); errors name the file."""
    if path is None:
        path = default_keymap_path()
        if not path.is_file():
            return {}
    try:
        with open(path, encoding="utf-8") as f:
            keymap = json.load(f)
    except OSError as exc:
        raise ValueError(f"--keymap {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"keymap {path}: not valid JSON: {exc}") from None
    if not isinstance(keymap, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in keymap.items()
    ):
        raise ValueError(f"keymap {path}: expected a JSON object of binding id -> keys, "
                         'such as {"chat.new_pane": "f5"}')
    if known is not None:
        unknown = sorted(set(keymap) - known)
        if unknown:
            raise ValueError(f"keymap {path}: unknown binding id(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
    return keymap


def settings_from(args: argparse.Namespace, model_defaults: dict[str, float] | None = None
                  ) -> Settings:
    """Each pane's starting settings: the model's default sampling, then the options."""
    s = Settings(system_prompt=args.system)
    for key, value in (model_defaults or {}).items():
        if hasattr(s, key):  # Settings has no min_p
            setattr(s, key, value)
    if args.temperature is not None:
        s.temperature = args.temperature
    if args.max_tokens is not None:
        s.max_tokens = args.max_tokens
    if args.repetition_penalty is not None:
        s.repetition_penalty = args.repetition_penalty
    s.sampling_params()  # a bad value fails here, naming the field
    return s


def list_sessions_text() -> str:
    from .store import data_dir, describe_session, list_sessions, sessions_dir

    sessions = list_sessions(data_dir())
    if not sessions:
        return f"no saved sessions with messages in {sessions_dir(data_dir())}"
    return "\n".join(describe_session(s) for s in sessions)


def fail(error: BaseException | str) -> int:
    from minivllm.cli import OPTION_OF_KEY, describe_error

    text = error if isinstance(error, str) else describe_error(
        error, {**OPTION_OF_KEY, "temperature": "--temperature", "max_tokens": "--max-tokens"})
    print(f"minivllm-chat: error: {text}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    default_openmp_waits()
    argv = sys.argv[1:] if argv is None else argv
    if "--bench" in argv:  # the app's benchmark, with its own options
        from minivllm.bench.chat_app import main as bench_main

        return bench_main([a for a in argv if a != "--bench"])
    args = build_parser().parse_args(argv)
    if args.sessions:
        print(list_sessions_text())
        return 0
    plain = args.plain or not (sys.stdin.isatty() and sys.stdout.isatty())
    try:
        if args.conversations < 1:
            raise ValueError(f"--conversations={args.conversations}: must be >= 1")
        settings_from(args)  # a bad option value fails before the model is looked for
        keymap = {}
        if args.keymap is not None or default_keymap_path().is_file():
            # Checked in every mode: a keymap that is wrong stays wrong in --plain too.
            from .app import binding_ids

            keymap = load_keymap(args.keymap, binding_ids())
        resume: bool | Path = False
        if args.resume is not None:
            from .store import data_dir, find_session

            resume = find_session(args.resume, data_dir()) if args.resume else True
        config, model_defaults = checked_config(args)
        settings = settings_from(args, model_defaults)
    except (ValueError, TypeError, OSError) as exc:
        return fail(exc)
    except KeyboardInterrupt:
        return 130
    factory = engine_factory(args, config)
    if plain:
        from .plain import run_plain

        if not args.plain:
            print("minivllm-chat: stdin or stdout is not a terminal: the plain line mode "
                  "(--plain) runs instead of the full-screen app", file=sys.stderr)
        return run_plain(engine_factory=factory, settings=settings)
    from .app import create_app

    app = create_app(
        engine_factory=factory, model=args.url or args.model, conversations=args.conversations,
        settings=settings, resume=resume, keymap=keymap,
    )
    app.run()
    if app.load_error:
        return fail(app.load_error)
    return app.return_code or 0


if __name__ == "__main__":
    sys.exit(main())
