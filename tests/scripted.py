"""The scripted engine with a test's pause on its replies (`HeldEngine`).

A module of its own, not conftest's, so that an engine process (`EngineSpec(HeldEngine,
...)`) imports it by name: the child gets the tests' folder on its import path from the
parent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from minivllm.server.standin import ScriptedEngine


class HeldEngine(ScriptedEngine):
    """`ScriptedEngine` whose requests stop after `hold_at` tokens, still running, until
    `release()`: a test acts on a reply that surely streams, however fast or slow the
    machine. `hold_at=0` holds every request before its first token (its prefill too)."""

    def __init__(self, config: dict[str, Any] | None = None,
                 on_progress: Callable[[str, float], None] | None = None, *,
                 hold_at: int | None = None, **options: Any) -> None:
        super().__init__(config, on_progress, **options)
        self.hold_at = hold_at

    def release(self) -> None:
        """Let held replies go on. Safe from any thread."""
        self.hold_at = None

    def step(self) -> tuple[list[tuple[int, list[int]]], int, bool]:
        hold = self.hold_at
        if hold is None:
            return super().step()
        with self._lock:
            # Held requests sit out the step, as if they were not there; they keep their
            # blocks and their place in line.
            sched = self.scheduler
            held_running = [s for s in sched.running if s.num_completion_tokens >= hold]
            held_waiting = [s for s in sched.waiting if s.num_completion_tokens >= hold]
            for s in held_running:
                sched.running.remove(s)
            for s in held_waiting:
                sched.waiting.remove(s)
            try:
                result = super().step()
            finally:
                sched.running[:0] = held_running
                sched.waiting.extendleft(reversed(held_waiting))
        if result == ([], 0, False):
            time.sleep(0.005)  # everything is held: wait, as a device would, not spin
        return result
