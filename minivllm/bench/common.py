"""What the bench modules share: result rows, progress lines, the engine the flags ask for
and transformers' model for comparisons."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from .. import LLMEngine
from ..engine_args import EngineArgs
from ..loader import KNOWN_CONFIGS
from ..models.registry import ARCHITECTURES


@dataclass
class Row:
    name: str
    value: float
    unit: str
    note: str = ""


def sync(llm: LLMEngine) -> None:
    """Wait for the device (a CUDA engine's steps return before the GPU is done)."""
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def report(text: str) -> None:
    """A progress line or a partial result on stderr, as the bench goes (a full run takes
    minutes; the table on stdout comes at the end)."""
    print(f"minivllm bench: {text}", file=sys.stderr, flush=True)


def load_format(args: argparse.Namespace) -> str:
    """Random weights for a known architecture unless a format is asked for."""
    if args.load_format:
        return args.load_format
    return "dummy" if args.model in KNOWN_CONFIGS else "auto"


def build_engine(args: argparse.Namespace, **overrides) -> LLMEngine:
    config = EngineArgs.from_cli_args(args).engine_config()
    config["load_format"] = load_format(args)
    config.update(overrides)
    from ..progress import print_progress

    return LLMEngine(config, on_progress=print_progress if sys.stderr.isatty() else None)


def load_hf_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """The same checkpoint through transformers; for random-weight runs, the same config
    with transformers' own random init (speed does not depend on the values)."""
    import transformers

    from ..config import EngineConfig

    cfg = EngineConfig.from_dict(
        {"model_name_or_path": args.model, "load_format": load_format(args)}
    )
    if cfg.load_format != "dummy":
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=dtype)
        note = "same weights"
    else:
        hf_config = transformers.AutoConfig.for_model(
            **_hf_config_dict(KNOWN_CONFIGS.get(args.model))
        )
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        note = "random weights, same config"
    return model.to(device).eval(), note


def _hf_config_dict(known: dict | None) -> dict:
    if known is None:
        raise ValueError("--compare hf with random weights needs a known model config")
    d = dict(known)
    d["model_type"] = ARCHITECTURES[d["architectures"][0]].model_type
    return d
