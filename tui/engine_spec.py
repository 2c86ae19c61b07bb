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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minivllm.frontend.engine_process import EngineProcessClient
from minivllm.frontend.protocol import ProgressFn

# The engines the child builds by name; any other is given as a builder (see `EngineSpec`).
KINDS = ("llm", "gpu-like", "fake")


@dataclass(frozen=True)
class EngineSpec:
    """What the child builds: `kind` "llm" (`LLMEngine(config)`), "gpu-like" (the bench's
    `gpu_like_engine(config, **options)`), "fake" (`ScriptedEngine(config, **options)`), or
    an engine builder called as `kind(config, on_progress, **options)` (a test's own
    engine class). `prepare`, if given, runs on the built engine before it serves (the
    bench gives a model without a tokenizer one). Both callables travel to the child
    pickled: module-level functions or classes, of a module the child can import."""

    kind: str | Callable[..., Any]
    config: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[Any], Any] | None = None
    threads: int | None = None  # torch threads in the child (None: torch's default)

    def __post_init__(self) -> None:
        if not callable(self.kind) and self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: expected 'llm', 'gpu-like', 'fake' or an "
                             "engine builder")


def build_engine(spec: EngineSpec, on_progress: ProgressFn) -> Any:
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    if callable(spec.kind):
        engine: Any = spec.kind(spec.config, on_progress, **spec.options)
    elif spec.kind == "gpu-like":
        from minivllm.server.standin import gpu_like_engine

        engine = gpu_like_engine(spec.config, on_progress, **spec.options)
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
    if spec.prepare is not None:
        spec.prepare(engine)
    return engine


def engine_process_client(spec: EngineSpec, *, quiet: bool = True) -> EngineProcessClient:
    """The engine of `spec` in a child process; its tokenizer comes over (the app counts
    prompt tokens with it). `quiet`: its output goes to a log file in the temp dir, not
    over the screen (the bench, which has no screen, keeps it visible)."""
    log = os.path.join(tempfile.gettempdir(), f"minivllm-chat-engine-{os.getpid()}.log")
    return EngineProcessClient(functools.partial(build_engine, spec),
                               log_path=log if quiet else None)
