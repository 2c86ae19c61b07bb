"""Per-request sampling and stopping settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _fail(name: str, value: object, why: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r}: {why}")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature=0` is greedy. `top_k=-1` (or 0) and `top_p=1` disable those filters.
    `stop` strings are matched on the decoded text, across token boundaries; the text
    returned ends before the stop string. `max_model_length` caps prompt + completion
    for this request (the engine's own limit applies too).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    max_model_length: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            _fail("temperature", t, "must be a finite number >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            _fail("top_k", self.top_k, "must be an int >= 1, or -1/0 to disable")
        p = self.top_p
        if not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            _fail("top_p", p, "must be in (0, 1]")
        m = self.min_p
        if not isinstance(m, (int, float)) or not math.isfinite(m) or not 0 <= m <= 1:
            _fail("min_p", m, "must be in [0, 1]")
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            _fail("max_tokens", mt, "must be an int >= 1")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                _fail("stop", self.stop, "stop strings must be non-empty strings")
        for tid in self.stop_token_ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                _fail("stop_token_ids", self.stop_token_ids, "must be non-negative ints")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            _fail("seed", self.seed, "must be an int or None")
        ml = self.max_model_length
        if ml is not None and (isinstance(ml, bool) or not isinstance(ml, int) or ml < 1):
            _fail("max_model_length", ml, "must be an int >= 1 or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
