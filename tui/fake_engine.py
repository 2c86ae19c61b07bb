"""A scripted stand-in for `minivllm.LLMEngine`, with the same public API.

For tests and demos without weights: replies are scripted text cut into small "tokens"
(so tags and words split across deltas), one token per sequence per step, with optional
step delay, a toy prefix cache, a waiting queue, and fault injection.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from minivllm.outputs import Delta, EngineStats
from minivllm.sampling_params import SamplingParams

_PIECES = re.compile(r"\s+|[A-Za-z]+|\d+|[^\sA-Za-z\d]")


class FakeTokenizer:
    """Text <-> ids over a growing vocabulary of short pieces; a tiny chat template."""

    eos_token = "<|end|>"
    # What the app reads to know the template has a thinking switch (as Qwen3's has).
    chat_template = "{# a stand-in; apply_chat_template honours enable_thinking #}"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []
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

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._pieces[i] for i in ids)

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


def last_user_text(prompt: str) -> str:
    """The last user message in a prompt rendered by `FakeTokenizer`'s template."""
    i = prompt.rfind("<|user|>\n")
    if i < 0:
        return prompt
    rest = prompt[i + len("<|user|>\n"):]
    return rest.split("<|end|>", 1)[0]


def default_reply(prompt: str, thinking: bool) -> str:
    user = last_user_text(prompt).strip()
    text = ""
    if thinking and not prompt.endswith("</think>\n\n"):
        text += f"<think>\nThe user wrote {len(user)} characters. Answer briefly.\n</think>\n\n"
    text += (
        f"You said: {user}\n\nA reply from the **scripted** engine:\n\n"
        f"- first point\n- second point\n\n```python\nprint({user[:40]!r})\n```\n\nDone."
    )
    return text


@dataclass
class _Seq:
    seq_id: int
    prompt_ids: list[int]
    reply_ids: list[int]
    params: SamplingParams
    out_ids: list[int] = field(default_factory=list)
    prefilled: bool = False


Reply = Callable[[str], str] | str | list[str] | None


class FakeEngine:
    """Honours the `LLMEngine` API used by the app (add_prompt, step, pop_deltas, abort,
    stats, tokenizer, config, exit) and streams scripted text."""

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        on_progress: Callable[[str, float], None] | None = None,
        *,
        reply: Reply = None,
        thinking: bool = False,
        step_delay: float = 0.0,
        load_delay: float = 0.0,
        frozen_stats: EngineStats | None = None,
        hold_at: int | None = None,
    ) -> None:
        config = dict(config or {})
        self.config = SimpleNamespace(
            model_name_or_path=config.get("model_name_or_path", "fake/scripted-model"),
            world_size=config.get("world_size", 1),
            block_size=config.get("block_size", 16),
            max_len=config.get("max_model_length") or 4096,
            device="cpu",
            max_num_sequences=config.get("max_num_sequences", 16),
        )
        self.device = "cpu"
        self.dtype = "float32"
        self.tokenizer = FakeTokenizer()
        self.num_blocks = config.get("max_cached_blocks") or 512
        self.reply = reply
        self.thinking = thinking
        self.step_delay = step_delay
        self.frozen_stats = frozen_stats
        # Every reply stops after this many tokens, still running, until `release()`: a
        # test acts on a reply that is surely streaming, however fast or slow the machine.
        self.hold_at = hold_at
        self.fail_steps = 0  # the next N calls to step() raise
        self.reject_prompts_containing: str | None = None
        self.exited = False
        self.peak_running = 0  # most sequences in one step, for tests
        self.scheduler = SimpleNamespace(is_finished=lambda: not (self._running or self._waiting))
        self._next_id = 0
        self._replies_made = 0
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._deltas: dict[int, Delta] = {}
        self._cached_blocks: set[tuple[int, ...]] = set()
        self._hit_tokens = 0
        self._queried_tokens = 0
        self._num_prompt = 0
        self._num_gen = 0
        self._num_steps = 0
        self._last_step_time = 0.0
        self._last_batch = 0
        self._history: deque[tuple[float, int, int]] = deque()
        for i, stage in enumerate(("loading weights", "sizing KV cache", "capturing CUDA graphs")):
            for j in range(5):
                if on_progress:
                    on_progress(stage, (i * 5 + j + 1) / 15)
                if load_delay:
                    time.sleep(load_delay / 15)

    # -- requests ----------------------------------------------------------------------

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

    def add_prompt(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> int:
        if self.exited:
            raise RuntimeError("engine has exited")
        params = sampling_params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt='': must not be empty")
            text = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            if not prompt:
                raise ValueError("prompt=[]: must not be empty")
            ids = list(prompt)
            text = self.tokenizer.decode(ids)
        bad = self.reject_prompts_containing
        if bad is not None and bad in text:
            raise ValueError(f"prompt: contains the rejected text {bad!r}")
        limit = min(self.config.max_len, params.max_model_length or self.config.max_len)
        if len(ids) >= limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_length={limit} leaves no room"
            )
        seq = _Seq(self._next_id, ids, self.tokenizer.encode(self._reply_text(text)), params)
        self._next_id += 1
        self._waiting.append(seq)
        return seq.seq_id

    def num_prompt_tokens(self, seq_id: int) -> int:
        for seq in (*self._running, *self._waiting):
            if seq.seq_id == seq_id:
                return len(seq.prompt_ids)
        return 0

    def prompt_progress(self, seq_id: int) -> tuple[int, int] | None:
        for seq in (*self._running, *self._waiting):
            if seq.seq_id == seq_id:
                n = len(seq.prompt_ids)
                return (n if seq.prefilled else 0), n
        return None

    def abort(self, seq_id: int) -> None:
        for queue in (self._running, self._waiting):
            for seq in list(queue):
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._emit(seq, [], True, "abort")
                    return

    def release(self) -> None:
        """Let held replies go on (see `hold_at`). Safe from any thread."""
        self.hold_at = None

    # -- stepping ----------------------------------------------------------------------

    def step(self) -> tuple[list[tuple[int, list[int]]], int, bool]:
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        t0 = time.perf_counter()
        is_prefill = False
        num_tokens = 0
        while self._waiting and len(self._running) < self.config.max_num_sequences:
            seq = self._waiting.popleft()
            self._running.append(seq)
        self.peak_running = max(self.peak_running, len(self._running))
        outputs: list[tuple[int, list[int]]] = []
        hold = self.hold_at
        for seq in list(self._running):
            if hold is not None and len(seq.out_ids) >= hold:
                continue  # held: running, no new token
            if not seq.prefilled:
                self._prefill(seq)
                num_tokens += len(seq.prompt_ids)
                is_prefill = True
            else:
                num_tokens += 1
            tok = seq.reply_ids[len(seq.out_ids)]
            seq.out_ids.append(tok)
            self._num_gen += 1
            done = len(seq.out_ids) >= len(seq.reply_ids)
            reason = "stop" if done else None
            if not done and len(seq.out_ids) >= seq.params.max_tokens:
                done, reason = True, "length"
            if not done and len(seq.prompt_ids) + len(seq.out_ids) >= self.config.max_len:
                done, reason = True, "length"
            self._emit(seq, [tok], done, reason)
            if done:
                self._running.remove(seq)
                outputs.append((seq.seq_id, list(seq.out_ids)))
        if self.step_delay or hold is not None:
            time.sleep(max(self.step_delay, 0.005 if hold is not None else 0.0))
        self._num_steps += 1
        self._last_batch = len(self._running) + len(outputs)
        self._last_step_time = time.perf_counter() - t0
        self._history.append((time.monotonic(), self._num_prompt, self._num_gen))
        return outputs, num_tokens, is_prefill

    def _prefill(self, seq: _Seq) -> None:
        seq.prefilled = True
        bs = self.config.block_size
        ids = seq.prompt_ids
        self._num_prompt += len(ids)
        self._queried_tokens += len(ids)
        parent: tuple[int, ...] = ()
        hitting = True
        for start in range(0, len(ids) - len(ids) % bs, bs):
            key = parent + tuple(ids[start:start + bs])
            if hitting and key in self._cached_blocks and start + bs < len(ids):
                self._hit_tokens += bs
            else:
                hitting = False
            self._cached_blocks.add(key)
            parent = key

    def _emit(self, seq: _Seq, ids: list[int], finished: bool, reason: str | None) -> None:
        old = self._deltas.get(seq.seq_id)
        all_ids = (old.token_ids if old else []) + ids
        self._deltas[seq.seq_id] = Delta(
            seq.seq_id, all_ids, self.tokenizer.decode(all_ids), finished, reason
        )

    def pop_deltas(self) -> list[Delta]:
        out = list(self._deltas.values())
        self._deltas.clear()
        return out

    # -- introspection -----------------------------------------------------------------

    def stats(self) -> EngineStats:
        if self.frozen_stats is not None:
            return self.frozen_stats
        bs = self.config.block_size
        used = sum(math.ceil((len(s.prompt_ids) + len(s.out_ids)) / bs) for s in self._running)
        now = time.monotonic()
        while self._history and self._history[0][0] < now - 1.0:
            self._history.popleft()
        if self._history:
            t0, p0, g0 = self._history[0]
            span = max(now - t0, 1e-3)
            p_rate = (self._num_prompt - p0) / span
            g_rate = (self._num_gen - g0) / span
        else:
            p_rate = g_rate = 0.0
        return EngineStats(
            block_size=bs,
            num_blocks=self.num_blocks,
            num_used_blocks=used,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_preemptions=0,
            prefix_cache_hit_rate=self._hit_tokens / self._queried_tokens
            if self._queried_tokens else 0.0,
            prompt_tokens_per_s=p_rate,
            generation_tokens_per_s=g_rate,
            num_prompt_tokens=self._num_prompt,
            num_generated_tokens=self._num_gen,
            num_steps=self._num_steps,
            last_step_time_s=self._last_step_time,
            last_batch_size=self._last_batch,
        )

    def generate(self, prompts: list[str] | list[list[int]], sampling_params: Any = None) -> dict:
        params = sampling_params if isinstance(sampling_params, list) else None
        ids = [
            self.add_prompt(p, params[i] if params else sampling_params)
            for i, p in enumerate(prompts)
        ]
        done: dict[int, list[int]] = {}
        while len(done) < len(ids):
            for seq_id, toks in self.step()[0]:
                done[seq_id] = toks
        self.pop_deltas()
        return {
            "text": [self.tokenizer.decode(done[i]) for i in ids],
            "token_ids": [done[i] for i in ids],
        }

    def exit(self) -> None:
        self.exited = True


# Markdown-ish prose for the GPU-like stand-in: words, punctuation, paragraphs, lists and
# a code fence, so the app renders roughly what a real reply costs it.
_PROSE_WORDS = (
    "the a of and to in is was that it for on with as his her they at be this from keeper "
    "light sea ship night storm lamp tower waves stone old young lonely bright dark cold "
    "warm slowly quietly every long story began when would could never always"
).split()


def gpu_like_reply(seed: int, words: int = 900) -> str:
    """A long reply of prose with Markdown (a heading, lists, emphasis, a code fence)."""
    import random

    rng = random.Random(seed)
    parts = ["## A story\n\n"]
    for i in range(words):
        word = rng.choice(_PROSE_WORDS)
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


class WordTokenizer(FakeTokenizer):
    """`FakeTokenizer` with a word (and its leading space) per token, ~5 characters, near
    what a BPE tokenizer makes of English prose."""

    def tokenize(self, text: str) -> list[str]:
        return _WORD_PIECES.findall(text)


_WORD_PIECES = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


class GpuLikeEngine(FakeEngine):
    """A stand-in with a GPU engine's timing, for `minivllm-chat --bench --engine gpu-like`
    on a machine without one.

    Each step holds the GIL for `host_s` (pure-Python work: scheduling, inputs, detokenizing)
    and then waits `device_s` with the GIL released (what a CUDA sync does), producing one
    token for each running request. The defaults are the step of Qwen3-0.6B on an H200
    with 4 panes streaming. Replies are Markdown-ish prose
    (`gpu_like_reply`). Only for benchmarks: its timing is what it is for.
    """

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        on_progress: Callable[[str, float], None] | None = None,
        *,
        host_s: float = 0.0003,
        device_s: float = 0.001,
    ) -> None:
        if host_s < 0 or device_s < 0:
            raise ValueError(f"host_s={host_s}, device_s={device_s}: must be >= 0")
        replies = [gpu_like_reply(seed) for seed in range(8)]
        super().__init__(config, on_progress, reply=replies)
        self.config.model_name_or_path = "fake/gpu-like"
        self.tokenizer = WordTokenizer()
        self.host_s = host_s
        self.device_s = device_s

    def step(self) -> tuple[list[tuple[int, list[int]]], int, bool]:
        t0 = time.perf_counter()
        result = super().step()
        # NOTE: a busy loop, not a sleep: host work holds the GIL, as Python code does.
        end = t0 + self.host_s
        while time.perf_counter() < end:
            pass
        if self.device_s:
            time.sleep(self.device_s)  # the GIL is free while the "device" works
        return result
