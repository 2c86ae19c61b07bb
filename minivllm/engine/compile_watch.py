"""Counting Triton compilations, to prove that no step compiles after start-up.

Two independent counts: Triton's own post-compile hook (`triton.knobs`, Triton >= 3.4;
it fires for a variant compiled or loaded from the on-disk cache), and the number of
variants held in the in-memory caches of minivllm's kernels (any Triton 3.x).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

KERNEL_PACKAGE = "minivllm.kernels"


def _jit_functions() -> list[tuple[str, Any]]:
    """Every @triton.jit function defined in minivllm.kernels' modules."""
    import minivllm.kernels as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{KERNEL_PACKAGE}.{info.name}")
        for name, value in vars(module).items():
            if hasattr(value, "device_caches") or type(value).__name__ == "JITFunction":
                found.append((f"{info.name}.{name}", value))
    return found


def compiled_variants() -> dict[str, int]:
    """Compiled variants of each minivllm kernel held in memory (all devices)."""
    counts = {}
    for name, fn in _jit_functions():
        caches = getattr(fn, "device_caches", None)
        if caches is not None:  # Triton 3.x: device -> (kernel_cache, ...)
            counts[name] = sum(len(entry[0]) for entry in caches.values())
        else:  # older layout: device -> kernel_cache
            counts[name] = sum(len(c) for c in getattr(fn, "cache", {}).values())
    return counts


class TritonCompileWatch:
    """Context manager: which kernels compiled (or loaded a variant) while it was open.

    `compiled` lists the hook's events (kernel names), `new_variants` the growth of the
    in-memory caches per kernel; both empty means nothing was compiled.
    """

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.new_variants: dict[str, int] = {}
        self.hook_installed = False
        self._before: dict[str, int] = {}
        self._previous = None

    def __enter__(self) -> TritonCompileWatch:
        self._before = compiled_variants()
        try:
            import triton

            runtime = triton.knobs.runtime
        except (ImportError, AttributeError):
            return self
        if not hasattr(runtime, "jit_post_compile_hook"):
            return self  # the cache counts still tell
        self._previous = runtime.jit_post_compile_hook
        previous = self._previous

        def hook(*args: Any, **kwargs: Any) -> Any:
            fn = kwargs.get("fn")
            self.compiled.append(getattr(fn, "name", repr(kwargs.get("repr", fn))))
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        self.hook_installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.hook_installed:
            import triton

            triton.knobs.runtime.jit_post_compile_hook = self._previous
        after = compiled_variants()
        self.new_variants = {
            name: n - self._before.get(name, 0)
            for name, n in after.items()
            if n > self._before.get(name, 0)
        }

    @property
    def count(self) -> int:
        return max(len(self.compiled), sum(self.new_variants.values()))
