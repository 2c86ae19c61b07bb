"""Every engine option, defined once: the flags of `minivllm generate|bench|serve` and
`minivllm-chat` are generated from `EngineArgs` (in the style of vLLM's `EngineArgs`), so
the commands cannot drift apart.

Each field is one `EngineConfig` key (`model` sets `model_name_or_path`); its flag is
spelled as vLLM spells it where vLLM has the option. A field left unset (None) keeps the
engine's default, or the default a command gives (`add_cli_args(defaults=...)`). Older
spellings are still accepted, with a one-line note on stderr naming the new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from .config import CPU_DECODE_DTYPES, CPU_PREFILL_DTYPES, CPU_WEIGHT_DTYPES, KV_CACHE_DTYPES

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "dummy")


def _option(
    flags: tuple[str, ...],
    help: str,
    *,
    default: Any = None,
    shown_default: str | None = None,
    old: tuple[str, ...] = (),
    key: str | None = None,
    type: Any = None,
    choices: tuple[str, ...] | None = None,
    kind: str = "value",
    internal: bool = False,
    checked_later: bool = False,
) -> Any:
    """A field of `EngineArgs` with what its flag needs.

    `kind`: "value" (takes a value), "flag" (store_true), "bool" (--x / --no-x) or
    "append" (repeatable). `shown_default`: the help's default where the field's default
    is None (the engine's own). `internal`: accepted but left out of --help.
    `checked_later`: the choices are shown, and a wrong value is the config's one-line
    error rather than argparse's usage.
    """
    meta = {"flags": flags, "help": help, "shown_default": shown_default, "old": old,
            "key": key, "type": type, "choices": choices, "kind": kind, "internal": internal,
            "checked_later": checked_later}
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    """The engine's options as a command line sets them (None: the engine's default)."""

    model: str = _option(
        ("--model",), "a model folder, a .gguf file or a Hugging Face Hub name",
        default=DEFAULT_MODEL, key="model_name_or_path")
    max_model_length: int | None = _option(
        ("--max-model-len",), "cap on prompt + completion tokens of a request",
        shown_default="the model's", old=("--max-model-length",), type=int)
    max_num_sequences: int | None = _option(
        ("--max-num-seqs",), "sequences in one engine step", shown_default="16",
        old=("--max-num-sequences",), type=int)
    max_num_batched_tokens: int | None = _option(
        ("--max-num-batched-tokens",),
        "tokens one engine step computes (decode tokens + prefill chunks); also the size "
        "of the warm-up pass that measures activation memory", shown_default="1024",
        old=("--max-num-batch-tokens",), type=int)
    block_size: int | None = _option(
        ("--block-size",), "tokens per KV block, a power of two in [16, 256]",
        shown_default="256", type=int)
    world_size: int | None = _option(
        ("-tp", "--tensor-parallel-size"), "tensor-parallel ranks, one process each",
        shown_default="1", old=("--world-size",), type=int)
    gpu_memory_utilization: float | None = _option(
        ("--gpu-memory-utilization",),
        "share of the free GPU memory (after weights and warm-up) the KV pool takes",
        shown_default="0.9", type=float)
    max_cached_blocks: int | None = _option(
        ("--num-gpu-blocks-override",),
        "KV pool size in blocks, on CUDA instead of sizing from free memory",
        shown_default="sized from memory", type=int)
    enforce_eager: bool | None = _option(
        ("--enforce-eager",), "run without CUDA graphs", kind="flag")
    device: str | None = _option(
        ("--device",), "where the engine runs (auto: cuda if present, else cpu)",
        shown_default="auto", choices=DEVICES)
    dtype: str | None = _option(
        ("--dtype",), "weights and activations (auto: bf16 on CUDA and on CPUs that "
        "multiply bf16, else fp32)", shown_default="auto", choices=DTYPES)
    kv_cache_dtype: str | None = _option(
        ("--kv-cache-dtype",), "KV cache storage (auto: the model's dtype; fp8: float8 "
        "e4m3, twice the blocks)", shown_default="auto", choices=KV_CACHE_DTYPES)
    cpu_weight_dtype: str | None = _option(
        ("--cpu-weight-dtype",),
        "CPU linear weights, weight-only formats with fp32 compute (compact: a GGUF "
        "model's own Q4_1 / Q8_0 where they hold its weights exactly, else bfloat16; "
        "auto: the compute dtype)", shown_default="auto", choices=CPU_WEIGHT_DTYPES,
        checked_later=True)
    cpu_prefill_dtype: str | None = _option(
        ("--cpu-prefill-dtype",),
        "a prefill's products (on packed copies of the weights) and attention with a CPU "
        "weight format (auto: bfloat16 where the CPU multiplies bf16, AMX or AVX-512 BF16, "
        "else fp32 copies; float32: no copies, the weight-only kernel)",
        shown_default="auto", choices=CPU_PREFILL_DTYPES)
    cpu_decode_dtype: str | None = _option(
        ("--cpu-decode-dtype",),
        "activations of the products with q4_1 / q8_0 CPU weights (auto: int8 per group "
        "of 32, llama.cpp's arithmetic, where the CPU has AVX512-VNNI, else float32)",
        shown_default="auto", choices=CPU_DECODE_DTYPES)
    load_format: str | None = _option(
        ("--load-format",), "dummy: random weights of the model's architecture",
        shown_default="auto", choices=LOAD_FORMATS)
    enable_prefix_caching: bool | None = _option(
        ("--enable-prefix-caching",), "share the KV blocks of common prompt prefixes",
        shown_default="on", kind="bool")
    enable_chunked_prefill: bool | None = _option(
        ("--enable-chunked-prefill",), "split long prompts across steps",
        shown_default="on", kind="bool")
    async_scheduling: bool | None = _option(
        ("--async-scheduling",), "schedule step N+1 while the device runs step N",
        shown_default="on for CUDA, off for the CPU", kind="bool")
    seed: int | None = _option(
        ("--seed",), "seeds sampling that has no seed of its own", type=int)
    eos: list[int] | None = _option(
        ("--eos-token-id",), "end-of-sequence token id (repeatable; default: the model's)",
        type=int, kind="append", internal=True)

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        *,
        defaults: dict[str, Any] | None = None,
        help_defaults: dict[str, str] | None = None,
    ) -> None:
        """Add a flag for every field. `defaults`: this command's defaults by field name
        (shown in --help); `help_defaults`: the default's text where it is not a value."""
        defaults = defaults or {}
        help_defaults = help_defaults or {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            default = defaults.get(f.name, f.default)
            shown = help_defaults.get(f.name)
            if shown is None:
                shown = meta["shown_default"] if default is None else str(default)
            if meta["kind"] == "flag" and default is None:
                shown = None
            text = meta["help"] + (f" (default: {shown})" if shown else "")
            kw: dict[str, Any] = {"dest": f.name, "default": default,
                                  "help": argparse.SUPPRESS if meta["internal"] else text}
            if meta["kind"] == "flag":
                kw["action"] = "store_true"
            elif meta["kind"] == "bool":
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = meta["type"]
                if meta["kind"] == "append":
                    kw["action"] = "append"
                kw["metavar"] = meta["flags"][-1].removeprefix("--").replace("-", "_").upper()
                if meta["choices"]:
                    kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
                    if not meta["checked_later"]:
                        kw["choices"] = meta["choices"]
            parser.add_argument(*meta["flags"], **kw)
            if meta["old"]:
                new = meta["flags"][-1]
                nargs = 0 if meta["kind"] == "flag" else None
                parser.add_argument(*meta["old"], dest=f.name, action=_Renamed, new=new,
                                    nargs=nargs, type=meta["type"],
                                    default=default, help=argparse.SUPPRESS)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The fields from parsed flags (a field without a flag keeps its default)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})

    def engine_config(self) -> dict[str, Any]:
        """The `LLMEngine` config dict: the fields that are set, by config key."""
        config: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                config[f.metadata["key"] or f.name] = tuple(value) if f.name == "eos" else value
        return config

    def cli_args(self) -> list[str]:
        """The flags that give these fields to another command (`None` fields left out)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value, flag, kind = getattr(self, f.name), f.metadata["flags"][-1], f.metadata["kind"]
            if value is None or (kind == "flag" and not value):
                continue
            if kind == "flag":
                out.append(flag)
            elif kind == "bool":
                out.append(flag if value else "--no-" + flag.removeprefix("--"))
            elif kind == "append":
                for item in value:
                    out += [flag, str(item)]
            else:
                out += [flag, str(value)]
        return out


def config_keys() -> set[str]:
    """The engine config keys the flags set."""
    return {f.metadata["key"] or f.name for f in dataclasses.fields(EngineArgs)}


def option_of_key() -> dict[str, str]:
    """Config key -> the flag that sets it (error messages name the flag, not the key)."""
    return {f.metadata["key"] or f.name: f.metadata["flags"][-1]
            for f in dataclasses.fields(EngineArgs)}


class _Renamed(argparse.Action):
    """An older spelling of a flag: works as the new one, with a note on stderr."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kw: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated; use {self.new}",
              file=sys.stderr)
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
