"""The real `LLMEngine` over a model runner with no model behind it.

Two uses. `stand_in_engine` (for `bench serve`) makes tokens at GPU rates on any machine:
the server's cost per token only shows when the engine is fast, and on a CPU the real
model takes tens of milliseconds a step. `ScriptedEngine` (the tests, the app's demo and
its GPU-like bench) streams scripted replies through a tokenizer of its own, so a test
knows every token a reply will have. In both the scheduler, block manager, prefix cache,
output processor and detokenizer all run as they do with a model.

The runner spends, per step, `host_ms` of Python holding the GIL (what preparing inputs
and launching kernels costs the engine thread) and then waits `device_ms` without the GIL
(what the CUDA sync is). The defaults split a decode step of Qwen3-0.6B at 32 sequences
on an H200 into its host and device parts.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..engine.llm_engine import LLMEngine
from ..layers.sampler import StepSamples
from ..sampling_params import SamplingParams

DEFAULT_HOST_MS = 0.3
DEFAULT_DEVICE_MS = 1.4
PREFILL_US_PER_TOKEN = 0.5  # device time a prompt token adds to a step (a little above an H200's)


@dataclass
class _Handle:
    ready_at: float  # time.perf_counter() when the "device" is done with the step
    num_seqs: int
    forced: dict[int, int]  # row -> its token (scripted, or one its grammar allows)
    rows: list[int]  # the rows under a grammar


class StandInRunner:
    """The parts of `ModelRunner` the engine calls, with no model behind them.

    A row whose sequence has a script (`scripts`, by seq id) samples the script's next
    token, then the end token `eos_id`; any other row samples a random id."""

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
        self.scripts: dict[int, list[int]] = {}
        self.eos_id = 0
        # (seq id, prompt length) of each row of the step being launched (the engine's
        # `_launch` sets it: a forward batch carries no sequence ids).
        self.rows: list[tuple[int, int]] = []
        # When the engine began the step being launched, if it says (`ScriptedEngine`): the
        # host part then counts its own scheduling, and the launch holds the GIL the rest.
        self.step_started: float | None = None

    def size_kv_pool(self) -> int:
        if self.config.max_cached_blocks is not None:
            return self.config.max_cached_blocks
        # Room for every sequence at full length: the stand-in never preempts.
        per_seq = -(-self.config.max_len // self.config.block_size)
        return per_seq * self.config.max_num_sequences

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def release(self) -> None:
        pass  # no pool, graphs or weights to free

    def launch(self, batch: Any) -> _Handle:
        return self.sample(self.forward(batch))

    def forward(self, batch: Any) -> _Handle:
        now = time.perf_counter()
        end = (self.step_started or now) + self.host_s
        while time.perf_counter() < end:  # Python holding the GIL, as a launch does
            pass
        # The device runs steps in order: this one starts when the previous one is done.
        start = max(end, self._device_free_at)
        work = self.device_s + len(batch.input_ids) * PREFILL_US_PER_TOKEN / 1e6
        self._device_free_at = start + work
        forced = {}
        if self.scripts:
            for row, (seq_id, num_prompt) in enumerate(self.rows):
                script = self.scripts.get(seq_id)
                if script is not None:
                    # The token this row samples is the completion's token number
                    # (context after the step) - (prompt length).
                    at = batch.seq_lens[row] - num_prompt
                    forced[row] = script[at] if 0 <= at < len(script) else self.eos_id
        return _Handle(self._device_free_at, batch.num_seqs, forced, batch.bitmask_rows)

    def sample(self, handle: _Handle, bitmask: Any = None) -> _Handle:
        if handle.rows:  # a constrained row samples one of the tokens it may
            import numpy as np

            # A word of the row with an allowed token, then one of its set bits: not
            # uniform over the allowed tokens, but cheap for the host, as sampling on a
            # device is.
            mask = bitmask.numpy().view(np.uint32)
            rng = self._rng
            for row in handle.rows:
                words = np.flatnonzero(mask[row])
                w = int(words[rng.randrange(len(words))])
                word, turn = int(mask[row, w]), rng.randrange(32)
                # The lowest set bit of the word turned by `turn`, turned back.
                turned = ((word >> turn) | (word << (32 - turn))) & 0xFFFFFFFF
                bit = ((turned & -turned).bit_length() - 1 + turn) % 32
                handle.forced[row] = w * 32 + bit
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
    seconds more, as loading weights would. Its tokens are random ids."""
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


# -- scripted replies -----------------------------------------------------------------------

_PIECES = re.compile(r"\s+|[A-Za-z]+|\d+|[^\sA-Za-z\d]")
_WORD_PIECES = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


class ScriptTokenizer:
    """Text <-> ids over a vocabulary that grows with the pieces it meets (pieces of up to
    three characters, so tags and words split across tokens); id 0 is the end token. A
    tiny chat template with a thinking switch, as Qwen3's has."""

    eos_token = "<|end|>"
    eos_token_id = 0
    bos_token_id = None
    # What the app reads to know the template has a thinking switch.
    chat_template = "{# scripted; apply_chat_template honours enable_thinking #}"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {self.eos_token: self.eos_token_id}
        self._pieces: list[str] = [self.eos_token]
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # the lock does not pickle
        return {"_ids": dict(self._ids), "_pieces": list(self._pieces)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _id(self, piece: str) -> int:
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            return self._ids[piece]

    def tokenize(self, text: str) -> list[str]:
        out: list[str] = []
        for m in _PIECES.finditer(text):
            word = m.group(0)
            out += [word[i:i + 3] for i in range(0, len(word), 3)]
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self._id(p) for p in self.tokenize(text)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        pieces = self._pieces
        if skip_special_tokens and self.eos_token_id in ids:
            ids = [i for i in ids if i != self.eos_token_id]
        return "".join([pieces[i] for i in ids])

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        enable_thinking: bool | None = None,
        **_: Any,
    ) -> str | list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>\n"
            if enable_thinking is False:
                text += "<think>\n\n</think>\n\n"
        return self.encode(text) if tokenize else text


class WordTokenizer(ScriptTokenizer):
    """`ScriptTokenizer` with a word (and its leading space) per token, ~5 characters,
    near what a BPE tokenizer makes of English prose."""

    def tokenize(self, text: str) -> list[str]:
        return _WORD_PIECES.findall(text)


def last_user_text(prompt: str) -> str:
    """The last user message in a prompt rendered by `ScriptTokenizer`'s template."""
    i = prompt.rfind("<|user|>\n")
    if i < 0:
        return prompt
    rest = prompt[i + len("<|user|>\n"):]
    return rest.split("<|end|>", 1)[0]


def default_reply(prompt: str, thinking: bool) -> str:
    """The demo's reply: the user's words back, Markdown, and a thought when asked."""
    user = last_user_text(prompt).strip()
    text = ""
    if thinking and not prompt.endswith("</think>\n\n"):
        text += f"<think>\nThe user wrote {len(user)} characters. Answer briefly.\n</think>\n\n"
    text += (
        f"You said: {user}\n\nA reply from the **scripted** engine:\n\n"
        f"- first point\n- second point\n\n```python\nprint({user[:40]!r})\n```\n\nDone."
    )
    return text


# The words of the GPU-like engine's Markdown-ish prose (punctuation, paragraphs, lists and
# a code fence come from `gpu_like_reply`), so the app renders roughly what a real reply
# costs it; the app's bench decodes a model without a tokenizer to them too.
PROSE_WORDS = (
    "the a of and to in is was that it for on with as his her they at be this from keeper "
    "light sea ship night storm lamp tower waves stone old young lonely bright dark cold "
    "warm slowly quietly every long story began when would could never always"
).split()


def gpu_like_reply(seed: int, words: int = 900) -> str:
    """A long reply of prose with Markdown (a heading, lists, emphasis, a code fence)."""
    rng = random.Random(seed)
    parts = ["## A story\n\n"]
    for i in range(words):
        word = rng.choice(PROSE_WORDS)
        if i % 97 == 40:
            parts.append("\n\n```python\nfor wave in sea:\n    print(wave)\n```\n\n")
        elif i % 61 == 30:
            parts.append(f"\n- **{word}**")
            continue
        elif i % 23 == 0 and i:
            parts.append(".\n\n" if i % 3 == 0 else ". ")
            parts.append(word.capitalize())
            continue
        parts.append(f" {word}" if parts[-1][-1:] not in ("\n", "") else word)
    return "".join(parts) + ".\n"


Reply = Callable[[str], str] | str | list[str] | None

# What a scripted engine is unless its config says otherwise: the app's demo values.
SCRIPTED_CONFIG: dict[str, Any] = {"model_name_or_path": "fake/scripted-model",
                                   "block_size": 16, "max_model_length": 4096}


class ScriptedEngine(LLMEngine):
    """The real engine whose replies are scripted: `reply` (a text, a list of texts taken
    in turn, or a function of the prompt text; default: `default_reply`) cut into tokens
    by `ScriptTokenizer`, then the end token.

    `step_delay`: seconds each step waits with the GIL free (a device's compute);
    `host_ms`: milliseconds each step holds the GIL, its scheduling included (a GPU
    engine's host work); `load_delay`: seconds of a loading bar before it is ready.
    """

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        on_progress: Callable[[str, float], None] | None = None,
        *,
        reply: Reply = None,
        thinking: bool = False,
        step_delay: float = 0.0,
        load_delay: float = 0.0,
        host_ms: float = 0.0,
        tokenizer: ScriptTokenizer | None = None,
    ) -> None:
        if step_delay < 0 or load_delay < 0 or host_ms < 0:
            raise ValueError(f"step_delay={step_delay}, load_delay={load_delay}, "
                             f"host_ms={host_ms}: must be >= 0")
        config = {**SCRIPTED_CONFIG, **(config or {}), "load_format": "dummy",
                  "device": "cpu", "eos": [ScriptTokenizer.eos_token_id]}
        for i in range(10 if load_delay else 0):
            if on_progress is not None:
                on_progress("loading weights (scripted)", 0.4 * i / 10)
            time.sleep(load_delay / 10)
        with _runner_replaced(host_ms, step_delay * 1e3):
            super().__init__(config, on_progress=on_progress)
        self.runner.eos_id = ScriptTokenizer.eos_token_id
        self.tokenizer = tokenizer or ScriptTokenizer()
        self.reply = reply
        self.thinking = thinking
        self._replies_made = 0

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        # A test may swap the template: the detokenizer of new requests uses this one.
        self._tokenizer = tokenizer
        if hasattr(self, "output_processor"):
            self.output_processor.tokenizer = tokenizer

    @property
    def step_delay(self) -> float:
        return self.runner.device_s

    @step_delay.setter
    def step_delay(self, seconds: float) -> None:
        self.runner.device_s = seconds

    def _reply_text(self, prompt: str) -> str:
        r = self.reply
        self._replies_made += 1
        if r is None:
            return default_reply(prompt, self.thinking)
        if isinstance(r, str):
            return r
        if isinstance(r, list):
            return r[(self._replies_made - 1) % len(r)]
        return r(prompt)

    def add_prompt(self, prompt: str | list[int],
                   sampling_params: SamplingParams | None = None) -> int:
        with self._lock:  # the script is in place before any step can run the request
            seq_id = super().add_prompt(prompt, sampling_params)
            text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
            self.runner.scripts[seq_id] = self.tokenizer.encode(self._reply_text(text))
            return seq_id

    def _forget(self, seq_id: int) -> Any:
        self.runner.scripts.pop(seq_id, None)
        return super()._forget(seq_id)

    def _launch(self, out: Any) -> Any:
        self.runner.rows = [(item.seq.seq_id, item.seq.num_prompt_tokens)
                            for item in out.scheduled]
        return super()._launch(out)

    def step(self) -> tuple[list[tuple[int, list[int]]], int, bool]:
        self.runner.step_started = time.perf_counter()
        return super().step()


def gpu_like_engine(config: dict[str, Any] | None = None,
                    on_progress: Callable[[str, float], None] | None = None, *,
                    host_ms: float = 0.3, device_ms: float = 1.0) -> ScriptedEngine:
    """A scripted engine with a GPU engine's timing, for `minivllm-chat --bench --engine
    gpu-like` on a machine without one: each step holds the GIL `host_ms` (the engine's own
    scheduling included), then waits `device_ms` with it released. Replies are
    Markdown-ish prose (`gpu_like_reply`) cut into words (`WordTokenizer`). The defaults
    are the step of Qwen3-0.6B on an H200 with 4 panes streaming."""
    if host_ms < 0 or device_ms < 0:
        raise ValueError(f"host_ms={host_ms}, device_ms={device_ms}: must be >= 0")
    config = {"model_name_or_path": "fake/gpu-like", **(config or {})}
    return ScriptedEngine(config, on_progress, reply=[gpu_like_reply(s) for s in range(8)],
                          step_delay=device_ms / 1e3, host_ms=host_ms,
                          tokenizer=WordTokenizer())
