"""Split streamed model output into thinking (`<think>...</think>`) and answer parts.

A pure, incremental parser: tags may arrive split across any number of deltas. The app
shows the two parts apart; the server returns the thinking as `reasoning_content`, with
the parser `--reasoning-parser` names (`REASONING_PARSERS`, vLLM's names).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"

Kind = Literal["think", "answer"]
Segment = tuple[Kind, str]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkParser:
    """Feed text as it streams; get back `(kind, text)` segments in order.

    A reply thinks only if it opens with `<think>` (after optional whitespace), as Qwen3
    does; the block ends at the first `</think>` and everything after it is answer, so a
    literal tag later in an answer stays text. With `in_think=True` the reply is taken to
    start inside the block (templates that open it in the prompt). Invariant: the segment
    texts from `feed()` and `finish()` concatenate to the input minus the two tags (and
    any whitespace before the opening tag).
    """

    def __init__(self, in_think: bool = False) -> None:
        self.state: Literal["start", "think", "answer"] = "think" if in_think else "start"
        self._hold = ""

    @property
    def in_think(self) -> bool:
        return self.state == "think"

    def feed(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        buf = self._hold + text
        self._hold = ""
        while buf:
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(OPEN_TAG):
                    self.state = "think"
                    buf = stripped[len(OPEN_TAG):]
                elif OPEN_TAG.startswith(stripped):  # whitespace and maybe part of the tag
                    self._hold = buf
                    break
                else:
                    self.state = "answer"
            elif self.state == "think":
                i = buf.find(CLOSE_TAG)
                if i >= 0:
                    _emit(out, "think", buf[:i])
                    self.state = "answer"
                    buf = buf[i + len(CLOSE_TAG):]
                else:
                    keep = _partial_suffix(buf, CLOSE_TAG)
                    _emit(out, "think", buf[: len(buf) - keep])
                    self._hold = buf[len(buf) - keep:]
                    break
            else:
                _emit(out, "answer", buf)
                break
        return out

    def finish(self) -> list[Segment]:
        """Flush held-back text (the stream ended inside a possible tag)."""
        out: list[Segment] = []
        _emit(out, "think" if self.state == "think" else "answer", self._hold)
        self._hold = ""
        return out


def _emit(out: list[Segment], kind: Kind, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


def split_thinking(text: str, in_think: bool = False) -> tuple[str, str]:
    """Whole-text form: `(thinking, answer)`."""
    parser = ThinkParser(in_think)
    parts: dict[str, list[str]] = {"think": [], "answer": []}
    for kind, chunk in parser.feed(text) + parser.finish():
        parts[kind].append(chunk)
    return "".join(parts["think"]), "".join(parts["answer"])


class ReasoningParser(Protocol):
    """An incremental splitter of one reply: `feed` each delta, `finish` at the end."""

    def feed(self, text: str) -> list[Segment]: ...

    def finish(self) -> list[Segment]: ...


# Parser name -> factory taking `in_think` (the templated prompt ends inside the block, as
# DeepSeek-R1's template opens it). A family with another format adds its parser here.
REASONING_PARSERS: dict[str, Callable[[bool], ReasoningParser]] = {
    "qwen3": ThinkParser,
    "deepseek_r1": ThinkParser,
}
