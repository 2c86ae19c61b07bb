"""Start-up progress on stderr, shared by the `minivllm` commands."""

from __future__ import annotations

import sys


def print_progress(stage: str, fraction: float) -> None:
    """The engine's start-up stages (weights, KV sizing, CUDA graphs) on stderr."""
    end = "\n" if fraction >= 1 else ""
    print(f"\r\033[Kminivllm: {stage} [{fraction:4.0%}]", end=end, file=sys.stderr, flush=True)
