"""An engine that produces tokens at GPU rates on any machine, for `bench serve`.

The server's cost per token only shows when the engine is fast: on a CPU the real model
takes tens of milliseconds a step, so the HTTP side always keeps up. The stand-in is the
real `LLMEngine` (scheduler, block manager, output processor and detokenizer all run as
they do on the GPU) with its model runner replaced by one that, per step, spends
`host_ms` of Python holding the GIL (what preparing inputs and launching kernels costs
the engine thread) and then waits `device_ms` without the GIL (what the CUDA sync is).
Its tokens are drawn at random from the vocabulary (no weights are built).

The defaults split a decode step of Qwen3-0.6B at 32 sequences on an H200 into its host
and device parts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..layers.sampler import StepSamples

DEFAULT_HOST_MS = 0.3
DEFAULT_DEVICE_MS = 1.4
PREFILL_US_PER_TOKEN = 0.5  # device time a prompt token adds to a step (a little above an H200's)


@dataclass
class _Handle:
    ready_at: float  # time.perf_counter() when the "device" is done with the step
    num_seqs: int
    forced: dict[int, int]  # row -> a token its grammar allows (structured outputs)
    rows: list[int]  # the rows under a grammar


class StandInRunner:
    """The parts of `ModelRunner` the engine calls, with no model behind them."""

    def __init__(self, config: Any, device: Any, dtype: Any, on_progress: Any = None,
                 *, host_ms: float, device_ms: float) -> None:
        self.config = config
        self.host_s = host_ms / 1e3
        self.device_s = device_ms / 1e3
        model = config.model
        self.vocab = int(model.vocab_size)
        self._rng = random.Random(0)
        # Ids past the special tokens at the start of every vocabulary we serve.
        self._low = min(1000, self.vocab - 1)
        self._device_free_at = 0.0
        self.cpu_weight_format = None  # no weights, so no packed CPU format either
        self.cpu_prefill_dtype = None
        self.cpu_decode_dtype = None
        head_dim = model.head_dim or model.hidden_size // model.num_heads
        self.bytes_per_block = (2 * model.num_layers * model.num_kv_heads * head_dim
                                * config.block_size * 2)

    def size_kv_pool(self) -> int:
        if self.config.max_cached_blocks is not None:
            return self.config.max_cached_blocks
        # Room for every sequence at full length: the stand-in never preempts.
        per_seq = -(-self.config.max_len // self.config.block_size)
        return per_seq * self.config.max_num_sequences

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def launch(self, batch: Any) -> _Handle:
        return self.sample(self.forward(batch))

    def forward(self, batch: Any) -> _Handle:
        now = time.perf_counter()
        end = now + self.host_s
        while time.perf_counter() < end:  # Python holding the GIL, as a launch does
            pass
        # The device runs steps in order: this one starts when the previous one is done.
        start = max(end, self._device_free_at)
        work = self.device_s + len(batch.input_ids) * PREFILL_US_PER_TOKEN / 1e6
        self._device_free_at = start + work
        return _Handle(self._device_free_at, batch.num_seqs, {}, batch.bitmask_rows)

    def sample(self, handle: _Handle, bitmask: Any = None) -> _Handle:
        if handle.rows:  # a constrained row samples one of the tokens it may
            import numpy as np

            # A word of the row with an allowed token, then one of its set bits: not
            # uniform over the allowed tokens, but cheap, as sampling on a device is.
            mask = bitmask.numpy()
            for row in handle.rows:
                words = np.flatnonzero(mask[row])
                w = int(words[self._rng.randrange(len(words))])
                bits = [b for b in range(32) if (int(mask[row, w]) >> b) & 1]
                handle.forced[row] = w * 32 + bits[self._rng.randrange(len(bits))]
        return handle

    def collect(self, handle: _Handle) -> StepSamples:
        wait = handle.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the CUDA sync: no GIL held
        rng, forced = self._rng, handle.forced
        return StepSamples([forced[i] if i in forced else rng.randrange(self._low, self.vocab)
                            for i in range(handle.num_seqs)])


@contextmanager
def _runner_replaced(host_ms: float, device_ms: float) -> Iterator[None]:
    from ..engine import llm_engine

    real = llm_engine.ModelRunner

    def make(config: Any, device: Any, dtype: Any, on_progress: Any = None) -> StandInRunner:
        return StandInRunner(config, device, dtype, on_progress, host_ms=host_ms,
                             device_ms=device_ms)

    # NOTE: LLMEngine builds its runner inside __init__; swapping the class it names for
    # the duration of the constructor is the one seam that keeps the rest of it real.
    llm_engine.ModelRunner = make  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        llm_engine.ModelRunner = real  # type: ignore[misc]


def stand_in_engine(config: dict[str, Any], *, host_ms: float = DEFAULT_HOST_MS,
                    device_ms: float = DEFAULT_DEVICE_MS, load_s: float = 0.0,
                    on_progress: Any = None) -> Any:
    """An `LLMEngine` for `config` whose steps cost `host_ms` (GIL held) + `device_ms`
    (GIL free), with overlapped scheduling on, as on the GPU; building it takes `load_s`
    seconds more, as loading weights would."""
    from minivllm import LLMEngine

    if host_ms < 0 or device_ms <= 0:
        raise ValueError(f"stand-in step: host_ms={host_ms} must be >= 0 and "
                         f"device_ms={device_ms} > 0")
    # A model with a tokenizer (SmolLM2's folder) makes the stand-in detokenize too.
    config = {**config, "device": "cpu", "async_scheduling": True}
    if load_s > 0:
        if on_progress is not None:
            on_progress("loading (stand-in)", 0.0)
        time.sleep(load_s)
    with _runner_replaced(host_ms, device_ms):
        return LLMEngine(config, on_progress=on_progress)
