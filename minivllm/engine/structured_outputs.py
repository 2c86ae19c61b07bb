"""Grammar-constrained decoding with xgrammar.

A request's `StructuredOutputsParams` is compiled against the tokenizer on a worker
thread (never on the engine's step), and the compiled grammar is cached by the
constraint's text, so a schema sent again costs nothing. Each constrained sequence then
holds its own matcher: before a step samples it, the matcher writes which tokens may
come next into that sequence's row of a bitmask (one bit per token; the end of sequence
only where the grammar can end), and after the step it accepts the token sampled.
Unconstrained rows keep an all-ones row and are not masked.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (least recently asked for dropped first)
# xgrammar's C++ errors start with "[time] file.cc:line: " and sometimes "Check failed: ...:".
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A constraint that does not compile; the message names the field, `reason` says why."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{kind}: cannot be compiled: {reason}")
        self.reason = reason


def _reason(exc: BaseException) -> str:
    return _ERROR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__


def _choice_ebnf(choice: list[str]) -> str:
    """A grammar whose only sentences are the given strings."""
    # JSON string literals use the escapes EBNF literals take (\\", \\\\, \\n, ...).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def _schema_text(schema: str | dict[str, Any]) -> str:
    if isinstance(schema, str):
        return schema
    return json.dumps(schema, ensure_ascii=False)


def check_grammar(spec: StructuredOutputsParams) -> None:
    """Parse the constraint without a tokenizer (well under a millisecond for a typical
    schema): raise GrammarError naming the field and why, if it cannot compile."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(_schema_text(spec.json), any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec.regex)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
        raise GrammarError(kind, _reason(exc)) from None


class GrammarCompiler:
    """Compiles constraints on a worker thread and makes one matcher per sequence.

    `compile(spec)` returns a future of the compiled grammar (the cached one when the same
    constraint was asked for before, failed ones included: a bad schema fails again at
    once). The tokenizer's vocabulary is read once, on the worker: ahead of any request
    after `prepare()` (the server calls it at start), else at the first request.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 pinned: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # a bitmask row's int32 words
        self.stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-grammar")
        # Masks fill on their own thread: never queued behind a long compilation.
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-bitmask")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._no_control: np.ndarray | None = None  # see `_control_free_words`
        # Two bitmask buffers, used in turn (a step's mask is filled only once every
        # earlier step but the one before was sampled, so their use of it is over); for a
        # CUDA engine in pinned memory, which the device copies from without a staging
        # copy. Each keeps the rows its last mask filled: only those go back to all ones.
        self._pinned = pinned
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._filled: list[set[int]] = [set(), set()]
        self._turn = 0
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, made at the first batch

    def compile(self, spec: StructuredOutputsParams) -> Future:
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def prepare(self) -> Future:
        """Build xgrammar's compiler (its tokenizer info) on the compile thread now,
        ahead of the first constraint: a future of it."""
        return self._pool.submit(self._get_compiler)

    def _get_compiler(self) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            # xgrammar reads a transformers tokenizer: the engine's own (minivllm.tokenizer)
            # hands over the one it stands in for, loaded here, off the engine's step.
            tokenizer = self.tokenizer
            if hasattr(type(tokenizer), "as_transformers"):
                tokenizer = tokenizer.as_transformers()
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._no_control = _control_free_words(info.decoded_vocab, self.vocab_size)
            # NOTE: xgrammar's own cache off: ours holds the futures, failures included.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c = self._get_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                # Compact JSON (", " and ": " only): with any whitespace allowed, small
                # models at temperature > 0 can spend the whole budget on newlines.
                return _Json(c.compile_json_schema(_schema_text(spec.json),
                                                   any_whitespace=False))
            if kind == "json_object":  # any object (OpenAI's json_object), not any value
                return _Json(c.compile_json_schema('{"type": "object"}', any_whitespace=False))
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(_choice_ebnf(spec.choice))
            return c.compile_grammar(spec.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
            raise GrammarError(kind, _reason(exc)) from None

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the grammar's start (cheap: the compiled grammar is shared)."""
        import xgrammar as xgr

        if isinstance(compiled, _Json):
            return _JsonMatcher(xgr.GrammarMatcher(compiled.grammar,
                                                   override_stop_tokens=self.stop_token_ids))
        return xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)

    def fill_bitmask(self, num_rows: int, rows: list[int], matchers: list[Any]) -> Any:
        """A [num_rows, ceil(vocab / 32)] int32 bitmask (CPU, pinned for a CUDA engine):
        all ones, except each of `rows` filled by its matcher with the tokens that may
        come next."""
        if not rows:
            return self.all_ones(num_rows)
        bitmask = self._next_buffer(num_rows, rows)
        inner = [m.matcher if isinstance(m, _JsonMatcher) else m for m in matchers]
        if len(rows) == 1:
            inner[0].fill_next_token_bitmask(bitmask, rows[0])
        else:  # the rows on xgrammar's threads, in one call
            self._batch_matcher().batch_fill_next_token_bitmask(inner, bitmask, rows)
        json_rows = [row for row, m in zip(rows, matchers, strict=True)
                     if isinstance(m, _JsonMatcher)]
        if json_rows:
            assert self._no_control is not None  # set with the compiler
            words = bitmask.numpy()  # a view; numpy's `&=` costs a tenth of torch's
            for row in json_rows:
                np.bitwise_and(words[row], self._no_control, out=words[row])
        return bitmask

    def _batch_matcher(self) -> Any:
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=_mask_threads())
        return self._batch

    def all_ones(self, num_rows: int) -> torch.Tensor:
        """A new bitmask of `num_rows` rows that allows every token."""
        return torch.from_numpy(np.full((num_rows, self.words), -1, dtype=np.int32))

    def _next_buffer(self, num_rows: int, rows: list[int]) -> torch.Tensor:
        """The next buffer's first `num_rows` rows, all ones but for `rows` (which the
        matchers fill whole)."""
        # NOTE: through numpy: torch's fill or copy of this size opens an OpenMP parallel
        # region (3 ms on a loaded 2-core CPU; numpy's memset: ~50 us). Only the rows the
        # buffer's last mask filled are set again.
        self._turn ^= 1
        buffer, filled = self._buffers[self._turn], self._filled[self._turn]
        if buffer is None or buffer.shape[0] < num_rows:
            buffer = torch.empty((num_rows, self.words), dtype=torch.int32,
                                 pin_memory=self._pinned)
            buffer.numpy().fill(-1)
            self._buffers[self._turn] = buffer
            filled.clear()
        view = buffer.numpy()
        for row in filled.difference(rows):
            if row < num_rows:
                view[row] = -1
                filled.discard(row)
        filled.update(rows)
        return buffer[:num_rows]

    def fill_bitmask_async(self, num_rows: int, rows: list[int], matchers: list[Any]) -> MaskFill:
        """`fill_bitmask` on the mask thread."""
        return MaskFill(self._filler, self.fill_bitmask, num_rows, rows, matchers)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._filler.shutdown(wait=False, cancel_futures=True)



def _mask_threads() -> int:
    """xgrammar's threads for a step's masks: half the CPUs, at most 8 (a mask row takes
    tens of microseconds; more threads cost more to wake)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _control_free_words(decoded_vocab: list[bytes], vocab_size: int) -> np.ndarray:
    """A one-row bitmask of the tokens whose bytes hold no control character (< 0x20)."""
    words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32).view(np.uint32)
    for token_id, text in enumerate(decoded_vocab[:vocab_size]):
        if any(byte < 0x20 for byte in text):
            words[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))
    return words.view(np.int32)


class _Json:
    """A compiled JSON grammar (schema or any object): its matchers also refuse control
    characters."""

    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar


class _JsonMatcher:
    """A matcher of compact JSON that never lets a raw control character through.

    JSON allows none inside strings and the compact form none between values, but
    xgrammar's length-limited strings (`maxLength`, `minLength`) accept bytes below 0x20:
    a sampled row could hold a NUL inside a string and fail to parse. `fill_bitmask` clears
    them from the rows of such matchers."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class MaskFill:
    """A bitmask being filled on the mask thread. `result()` fills it on the calling thread
    instead if the mask thread has not started: while the engine thread runs Python, the
    mask thread waits for the GIL, and handing it over would only add a wake-up."""

    def __init__(self, pool: ThreadPoolExecutor, fill: Callable[..., Any], *args: Any) -> None:
        self._fill, self._args = fill, args
        self._future = pool.submit(fill, *args)

    def result(self) -> Any:
        if self._future.cancel():
            return self._fill(*self._args)
        return self._future.result()
