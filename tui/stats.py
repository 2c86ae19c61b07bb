"""Engine stats for display: rates from the counters, history for the sparkline, formatting.

Pure (no Textual) so the numbers are tested exactly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from minivllm.outputs import EngineStats

SPARK_SECONDS = 60.0
AVG_SECONDS = 10.0
WINDOW_SECONDS = 1.0


@dataclass(frozen=True)
class Rates:
    prompt_1s: float
    prompt_10s: float
    gen_1s: float
    gen_10s: float


class StatsHistory:
    """Snapshots with their (monotonic) times; throughput over the last 1 s and 10 s.

    A rate over a window is (counter now - counter at the window's start) / elapsed, using
    the oldest snapshot inside the window. With a single snapshot there is nothing to
    difference, so the engine's own sliding-window rates are used.
    """

    def __init__(self, keep_s: float = SPARK_SECONDS) -> None:
        self.keep_s = keep_s
        self.samples: deque[tuple[float, EngineStats]] = deque()
        self.gen_series: deque[tuple[float, float]] = deque()  # (time, 1 s generation rate)

    def add(self, at: float, stats: EngineStats) -> Rates:
        if self.samples and at < self.samples[-1][0]:
            at = self.samples[-1][0]
        self.samples.append((at, stats))
        while self.samples and self.samples[0][0] < at - max(self.keep_s, AVG_SECONDS) - 1:
            self.samples.popleft()
        rates = self.rates()
        self.gen_series.append((at, rates.gen_1s))
        while self.gen_series and self.gen_series[0][0] < at - self.keep_s:
            self.gen_series.popleft()
        return rates

    def _rate(self, window: float, counter: str, fallback: float) -> float:
        now, latest = self.samples[-1]
        start: tuple[float, EngineStats] | None = None
        for t, s in self.samples:
            if t >= now - window - 1e-9:
                start = (t, s)
                break
        if start is None or start[0] >= now:
            # Nothing older inside the window: use the newest older sample, if any.
            older = [x for x in self.samples if x[0] < now]
            if not older:
                return fallback
            start = older[-1]
        t0, s0 = start
        return max(0.0, (getattr(latest, counter) - getattr(s0, counter)) / (now - t0))

    def rates(self) -> Rates:
        if not self.samples:
            return Rates(0.0, 0.0, 0.0, 0.0)
        latest = self.samples[-1][1]
        p, g = latest.prompt_tokens_per_s, latest.generation_tokens_per_s
        return Rates(
            prompt_1s=self._rate(WINDOW_SECONDS, "num_prompt_tokens", p),
            prompt_10s=self._rate(AVG_SECONDS, "num_prompt_tokens", p),
            gen_1s=self._rate(WINDOW_SECONDS, "num_generated_tokens", g),
            gen_10s=self._rate(AVG_SECONDS, "num_generated_tokens", g),
        )

    def spark_data(self) -> list[float]:
        return [r for _, r in self.gen_series]


# -- formatting ------------------------------------------------------------------------


def kv_bar(used: int, total: int, width: int = 20) -> str:
    frac = used / total if total else 0.0
    filled = min(width, round(frac * width))
    return "█" * filled + "░" * (width - filled)


def kv_line(s: EngineStats, width: int = 20) -> str:
    pct = 100.0 * s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0
    return (
        f"KV cache [{kv_bar(s.num_used_blocks, s.num_blocks, width)}] "
        f"{s.num_used_blocks:,}/{s.num_blocks:,} blocks {pct:.1f}%"
    )


def queue_line(s: EngineStats) -> str:
    return (
        f"Running {s.num_running} reqs  Waiting {s.num_waiting} reqs  "
        f"Preemptions {s.num_preemptions}"
    )


def throughput_line(r: Rates) -> str:
    return (
        f"Prompt throughput {r.prompt_1s:,.1f} tok/s (10 s avg {r.prompt_10s:,.1f})  "
        f"Generation throughput {r.gen_1s:,.1f} tok/s (10 s avg {r.gen_10s:,.1f})"
    )


def cache_line(s: EngineStats) -> str:
    """Hit rate, the last step (where reported: a server's /metrics has no step figures)
    and the token counters."""
    step = (f"Step {1000.0 * s.last_step_time_s:.1f} ms  Batch {s.last_batch_size} seqs  "
            f"Steps {s.num_steps:,}  " if s.num_steps else "")
    return (
        f"Prefix cache hit rate {100.0 * s.prefix_cache_hit_rate:.1f}%  {step}"
        f"Tokens {s.num_prompt_tokens:,} in / {s.num_generated_tokens:,} out"
    )


def compact_lines(s: EngineStats, r: Rates) -> list[str]:
    """The panel for an 80-column terminal: the same figures in two short lines."""
    pct = 100.0 * s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0
    return [
        f"KV [{kv_bar(s.num_used_blocks, s.num_blocks, 10)}] {pct:.1f}%  "
        f"Run {s.num_running} Wait {s.num_waiting} Preempt {s.num_preemptions}  "
        f"Hit {100.0 * s.prefix_cache_hit_rate:.1f}%",
        f"Gen {r.gen_1s:,.1f} tok/s (10 s {r.gen_10s:,.1f})  Prompt {r.prompt_1s:,.1f} tok/s"
        + (f"  Step {1000.0 * s.last_step_time_s:.0f} ms" if s.num_steps else ""),
    ]


def pool_summary(num_blocks: int, block_size: int, max_len: int) -> str:
    """`2,048 blocks x 256 = 524,288 tokens, 128 seqs of 4,096`."""
    tokens = num_blocks * block_size
    text = f"{num_blocks:,} blocks x {block_size} = {tokens:,} tokens"
    if max_len:
        text += f", max concurrency {tokens / max_len:,.1f}x at {max_len:,} tokens"
    return text
