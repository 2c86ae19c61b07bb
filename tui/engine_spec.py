"""What the app's engine process builds: an `EngineSpec` (picklable) and `build_engine`,
for `minivllm.frontend.EngineProcessClient` (`minivllm-chat --engine-process`, the bench).

Why a process: on a GPU the engine's step is about a millisecond, mostly a device wait with
the GIL released, and in one process the UI thread took the GIL at every wait; rendering
four fast streams kept the engine far below its rate.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from minivllm.frontend.engine_process import EngineProcessClient
from minivllm.frontend.protocol import ProgressFn


@dataclass(frozen=True)
class EngineSpec:
    """What the child builds: `kind` "llm" (`LLMEngine(config)`), "gpu-like" (the bench's
    `gpu_like_engine(config, **options)`) or "fake" (`ScriptedEngine(config, **options)`).
    `bench_tokenizer`: give a tokenizer-less engine (random weights) the bench's."""

    kind: str
    config: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    bench_tokenizer: bool = False
    threads: int | None = None  # torch threads in the child (None: torch's default)

    def __post_init__(self) -> None:
        if self.kind not in ("llm", "gpu-like", "fake"):
            raise ValueError(f"kind={self.kind!r}: expected 'llm', 'gpu-like' or 'fake'")


def build_engine(spec: EngineSpec, on_progress: ProgressFn) -> Any:
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    if spec.kind == "gpu-like":
        from minivllm.server.standin import gpu_like_engine

        engine: Any = gpu_like_engine(spec.config, on_progress, **spec.options)
    elif spec.kind == "fake":
        from minivllm.server.standin import ScriptedEngine

        engine = ScriptedEngine(spec.config, on_progress, **spec.options)
    else:
        import inspect

        from minivllm import LLMEngine

        if "on_progress" in inspect.signature(LLMEngine).parameters:
            engine = LLMEngine(spec.config, on_progress=on_progress)
        else:
            engine = LLMEngine(spec.config)
    if spec.bench_tokenizer:
        from .bench_tokenizer import ensure_tokenizer

        ensure_tokenizer(engine)
    return engine


def engine_process_client(spec: EngineSpec, *, quiet: bool = True) -> EngineProcessClient:
    """The engine of `spec` in a child process; its tokenizer comes over (the app counts
    prompt tokens with it). `quiet`: its output goes to a log file in the temp dir, not
    over the screen (the bench, which has no screen, keeps it visible)."""
    log = os.path.join(tempfile.gettempdir(), f"minivllm-chat-engine-{os.getpid()}.log")
    return EngineProcessClient(functools.partial(build_engine, spec),
                               log_path=log if quiet else None)
