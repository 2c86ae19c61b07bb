"""What `LLMEngine.stats` reports of its steps: totals since start, the last step, and the
token rates over a sliding window."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from ..outputs import EngineStats

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .scheduler import Scheduler

STATS_WINDOW_S = 1.0


class StepStats:
    """Step counters, fed by the engine once a step (`record`), read by `snapshot`."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.last_step_time = 0.0
        self.last_batch_size = 0
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, prompt, generated)

    def record(self, start: float, now: float, prompt: int, generated: int, size: int) -> None:
        """A step that began at `start` and ended at `now` (perf_counter seconds) computed
        `prompt` prompt tokens and `generated` new ones over `size` sequences."""
        self.num_steps += 1
        self.num_prompt_tokens += prompt
        self.num_generated_tokens += generated
        self.last_step_time = now - start
        self.last_batch_size = size
        self._recent.append((now, prompt, generated))
        while self._recent and self._recent[0][0] < now - STATS_WINDOW_S:
            self._recent.popleft()

    def snapshot(self, block_manager: BlockManager, scheduler: Scheduler) -> EngineStats:
        """These counters with the KV pool's and the queues' state, as one `EngineStats`."""
        now = time.perf_counter()
        recent = [r for r in self._recent if r[0] >= now - STATS_WINDOW_S]
        bm = block_manager
        return EngineStats(
            block_size=bm.block_size,
            num_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_hit_rate=bm.hit_rate,
            prompt_tokens_per_s=sum(r[1] for r in recent) / STATS_WINDOW_S,
            generation_tokens_per_s=sum(r[2] for r in recent) / STATS_WINDOW_S,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            last_step_time_s=self.last_step_time,
            last_batch_size=self.last_batch_size,
            window_s=STATS_WINDOW_S,
        )
