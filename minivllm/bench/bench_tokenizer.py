"""A tokenizer for a model without one (random weights), so the app's bench has text to
render: `minivllm-chat --bench --load-format dummy`, in this process or its engine process
(`ensure_tokenizer` is what the bench's `EngineSpec` prepares the built engine with)."""

from __future__ import annotations

import re
import zlib
from typing import Any

from ..server.standin import PROSE_WORDS

# What a dummy model's ids decode to: the GPU-like stand-in's words, punctuation and
# Markdown (paragraphs, lists, emphasis, code), so the app renders roughly what a real
# reply costs it.
_BENCH_PIECES = (
    [f" {w}" for w in PROSE_WORDS]
    + [".", ",", ";", ":", "!", "?", "\n\n", "\n- ", "\n1. ", " **", "** ", " `", "` ",
       "\n## ", " _", "_ ", "\n```python\n", "\n```\n", " (", ")", " 42", " 3.14"]
)
_PIECE_RE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


class BenchTokenizer:
    """Text <-> ids for a model without a tokenizer (random weights): id i decodes to
    `_BENCH_PIECES[i % len]`; text encodes piece by piece to ids below `vocab_size`.
    Only for measuring the app: the text means nothing."""

    chat_template = "{# bench stand-in #}"  # no `enable_thinking`: no thinking switch
    bos_token_id = None
    eos_token = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._index = {p: i for i, p in enumerate(_BENCH_PIECES)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self._index.get(p, zlib.crc32(p.encode()) % self.vocab_size)
                for p in _PIECE_RE.findall(text)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(_BENCH_PIECES[i % len(_BENCH_PIECES)] for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = False, tokenize: bool = False,
                            **_: Any) -> str | list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return self.encode(text) if tokenize else text


def ensure_tokenizer(engine: Any) -> bool:
    """Give a tokenizer-less engine a `BenchTokenizer`; returns whether it did."""
    if engine.tokenizer is not None:
        return False
    engine.tokenizer = BenchTokenizer(engine.config.model.vocab_size)
    engine.output_processor.tokenizer = engine.tokenizer  # detokenizes new requests
    return True
