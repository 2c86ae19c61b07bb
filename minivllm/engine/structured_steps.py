"""Structured outputs in the engine's steps: the constrained requests whose grammar is
still compiling, and the steps whose sampling waits for the bitmask of their constrained
rows. The grammar backend itself (compiling, matchers, filling a bitmask) is
`structured_outputs`."""

from __future__ import annotations

import importlib.util
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .structured_outputs import GrammarCompiler, GrammarError, MaskFill

if TYPE_CHECKING:
    from .model_runner import LaunchedForward
    from .scheduler import SchedulerOutput
    from .sequence import Sequence


@dataclass
class MaskedForward:
    """A step with rows under a grammar: its forward is launched, its sampling waits for
    their bitmask, which the mask thread fills (`mask`) once their matchers hold every
    token sampled before: at launch if none is in flight, else once the step before is
    applied. The sampling is launched when something needs it: the next step's forward,
    or reading this step."""

    forward: LaunchedForward
    rows: list[int]
    mask: MaskFill | None = None


class GrammarRequests:
    """The engine's constrained requests: the grammar backend (built at the first one),
    the sequences whose grammar is compiling, by id, and each step's bitmask."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 pinned: bool = False) -> None:
        self._tokenizer = tokenizer
        self._pinned = pinned  # bitmasks in pinned memory (a CUDA engine)
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self.compiler: GrammarCompiler | None = None
        self.compiling: dict[int, tuple[Sequence, Future]] = {}

    def _compiler(self) -> GrammarCompiler:
        if self.compiler is None:
            self.compiler = GrammarCompiler(self._tokenizer, self._vocab_size,
                                            self._stop_token_ids, self._pinned)
        return self.compiler

    def prepare(self) -> bool:
        """Start reading the vocabulary for the backend on its thread; False where there
        is nothing to prepare (no tokenizer, or xgrammar not installed)."""
        if self._tokenizer is None or importlib.util.find_spec("xgrammar") is None:
            return False
        self._compiler().prepare()
        return True

    def add(self, seq: Sequence) -> None:
        """Compile `seq`'s constraint on the compile thread; the scheduler holds the
        sequence back until its matcher is ready."""
        future = self._compiler().compile(seq.params.structured_outputs)
        seq.awaiting_grammar = True
        self.compiling[seq.seq_id] = (seq, future)

    def poll(self) -> list[Sequence]:
        """Give each sequence whose grammar compiled its matcher (the scheduler may then
        admit it). Returns those whose grammar failed, their error set."""
        assert self.compiler is not None
        failed = []
        for seq_id, (seq, future) in list(self.compiling.items()):
            if seq.is_finished:  # aborted while its grammar compiled
                del self.compiling[seq_id]
                continue
            if not future.done():
                continue
            del self.compiling[seq_id]
            try:
                seq.grammar = self.compiler.matcher(future.result())
            except Exception as e:  # noqa: BLE001 - the request fails, the engine serves on
                seq.error = str(e) if isinstance(e, GrammarError) else (
                    f"structured_outputs: {type(e).__name__}: {e}")
                failed.append(seq)
            else:
                seq.awaiting_grammar = False
        return failed

    def wait(self, timeout: float) -> None:
        """Wait until a compiling grammar is ready, at most `timeout` seconds."""
        futures = [future for _, future in self.compiling.values()]
        wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def rows(self, out: SchedulerOutput) -> list[int]:
        """The rows of a step that sample under a grammar."""
        if self.compiler is None:
            return []
        return [i for i, item in enumerate(out.scheduled)
                if item.samples and item.seq.grammar is not None]

    def fill_bitmask(self, out: SchedulerOutput, rows: list[int]) -> MaskFill:
        """A future of the bitmask of `rows` (each under a grammar) of a step, filled on
        the mask thread. A row whose sequence ended since its step was scheduled (its
        token will be dropped) is left all ones. Until the future is done, nothing else
        may use those matchers: their next tokens come from this step's sampling."""
        assert self.compiler is not None
        live = [i for i in rows if not out.scheduled[i].seq.is_finished]
        matchers = [out.scheduled[i].seq.grammar for i in live]
        return self.compiler.fill_bitmask_async(len(out.scheduled), live, matchers)

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
        self.compiling.clear()
