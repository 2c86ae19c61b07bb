"""The engine options, defined once in `EngineArgs`: every command that runs an engine has
a flag for every engine config key, in vLLM's spelling; older spellings still work with a
one-line note; internal knobs stay out of the users' --help."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from minivllm.config import ENGINE_KEYS, EngineConfig
from minivllm.engine_args import EngineArgs, config_keys

# The older spellings, each with the config key it sets and a value to give it.
RENAMED = {
    "--max-model-length": ("max_model_length", "512"),
    "--world-size": ("world_size", "2"),
    "--max-num-sequences": ("max_num_sequences", "4"),
    "--max-num-batch-tokens": ("max_num_batched_tokens", "64"),
}
INTERNAL = ["--stand-in-ms", "--stand-in-load-s", "--eos-token-id", "--bench", "--fake",
            *RENAMED]
VLLM_FLAGS = ["--model", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
              "--tensor-parallel-size", "-tp", "--gpu-memory-utilization", "--kv-cache-dtype",
              "--enforce-eager", "--block-size", "--dtype", "--seed", "--load-format",
              "--enable-prefix-caching", "--enable-chunked-prefill",
              "--num-gpu-blocks-override"]


def _generate() -> argparse.ArgumentParser:
    from minivllm.cli import build_parser

    return _subparser(build_parser(with_bench=False), "generate")


def _bench() -> argparse.ArgumentParser:
    from minivllm.cli import build_parser

    return _subparser(build_parser(with_bench=True), "bench")


def _serve() -> argparse.ArgumentParser:
    from minivllm.server.cli import build_parser

    return build_parser()


def _bench_serve() -> argparse.ArgumentParser:
    from minivllm.bench.serve import build_parser

    return build_parser()


def _chat() -> argparse.ArgumentParser:
    from minivllm.tui.cli import build_parser

    return build_parser()


def _chat_bench() -> argparse.ArgumentParser:
    from minivllm.bench.chat_app import build_parser

    return build_parser()


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


COMMANDS = {"generate": _generate, "bench": _bench, "serve": _serve,
            "bench serve": _bench_serve, "minivllm-chat": _chat,
            "minivllm-chat --bench": _chat_bench}
# What a command needs on its line besides the options under test.
POSITIONAL = {"bench": ["throughput"]}


def test_the_fields_are_the_engine_config_keys():
    assert config_keys() == ENGINE_KEYS


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_key_has_a_flag(command):
    parser = COMMANDS[command]()
    args = parser.parse_args(POSITIONAL.get(command, []))
    names = {"model" if k == "model_name_or_path" else k for k in ENGINE_KEYS}
    assert names <= set(vars(args)), names - set(vars(args))


@pytest.mark.parametrize("command", ["serve", "minivllm-chat"])
def test_help_lists_user_options_in_vllm_spelling(command):
    text = COMMANDS[command]().format_help()
    words = set(text.replace(",", " ").replace("[", " ").replace("]", " ").split())
    assert not words & set(INTERNAL), words & set(INTERNAL)
    assert set(VLLM_FLAGS) <= words, set(VLLM_FLAGS) - words


def test_bench_serve_help_shows_the_stand_in():
    assert "--stand-in-ms" in _bench_serve().format_help()


@pytest.mark.parametrize("command", COMMANDS)
def test_old_spellings_work_and_say_the_new_one(command, capsys):
    parser = COMMANDS[command]()
    argv = [*POSITIONAL.get(command, [])]
    for flag, (_, value) in RENAMED.items():
        argv += [flag, value]
    config = EngineArgs.from_cli_args(parser.parse_args(argv)).engine_config()
    for _, (key, value) in RENAMED.items():
        assert config[key] == int(value)
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == len(RENAMED)
    assert notes[0].endswith("--max-model-length is deprecated; use --max-model-len")
    assert notes[1].endswith("--world-size is deprecated; use --tensor-parallel-size")


def test_flags_set_only_what_is_given():
    """An option left out keeps the engine's default (or the command's)."""
    config = EngineArgs.from_cli_args(_serve().parse_args([])).engine_config()
    assert config == {"model_name_or_path": EngineArgs.model}
    config = EngineArgs.from_cli_args(_generate().parse_args(["--no-enable-prefix-caching",
                                                              "-tp", "2"])).engine_config()
    assert config["enable_prefix_caching"] is False and config["world_size"] == 2
    assert config["max_model_length"] == 4096  # generate's own default


def test_cli_args_give_the_same_options_to_another_command():
    args = EngineArgs(model="m", max_model_length=300, world_size=2, enforce_eager=True,
                      enable_chunked_prefill=False, eos=[5, 7], kv_cache_dtype="fp8")
    parsed = EngineArgs.from_cli_args(_serve().parse_args(args.cli_args()))
    assert parsed == args


def test_the_old_config_key_is_read_as_vllms_with_a_warning():
    with pytest.warns(FutureWarning, match="'max_num_batch_tokens' is deprecated; use "
                      "'max_num_batched_tokens'"):
        config = EngineConfig.from_dict({"model_name_or_path": "Qwen/Qwen3-0.6B",
                                         "load_format": "dummy", "max_num_batch_tokens": 64})
    assert config.max_num_batched_tokens == 64


def test_an_error_names_the_flag_in_vllms_spelling():
    """Given with the old spelling, a bad value is reported under the new one, after the
    note; one line each, no traceback."""
    run = subprocess.run(
        [sys.executable, "-m", "minivllm.cli", "generate", "--load-format", "dummy",
         "--model", "Qwen/Qwen3-0.6B", "--max-model-length", "999999999", "--prompt", "x"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert lines[0] == ("minivllm generate: --max-model-length is deprecated; use "
                        "--max-model-len")
    assert lines[-1].startswith("minivllm: error: --max-model-len=999999999 is above")
    assert "Traceback" not in run.stderr
