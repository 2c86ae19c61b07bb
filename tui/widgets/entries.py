"""What a transcript shows: its entries (a user message, a reply, a notice), each drawn
to lines once per width, and the Markdown and wrapping they are drawn with.

A streaming reply wraps again only its last line or two (`GrowingText`: greedy wrapping,
so the lines before the last cannot change); its Markdown is drawn a block at a time, as
each block completes, and a block that Markdown would draw as its plain text keeps the
lines it streamed with. `transcript.py`'s widget holds the lines of all entries.
"""

from __future__ import annotations

import copy
import io
import re
from dataclasses import dataclass, field
from typing import Any

from markdown_it import MarkdownIt
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.markdown import CodeBlock
from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from rich.style import Style
from rich.syntax import Syntax
from rich.text import Text
from textual.strip import Strip

from ..blocks import CODE_THEME, block_rows, lexer
from ..conversation import Status
from ..markdown import is_plain_paragraph, keep_line_breaks, split_blocks
from ..thinking import ThinkParser, split_thinking

PAD = 1  # columns of padding left and right of a message's text
STATUS_NOTES: dict[str, str] = {
    "stopped": "stopped",
    "interrupted": "interrupted (the app stopped mid-reply)",
    "length": "cut at max tokens",
}

@dataclass(frozen=True)
class Look:
    """The styles entries are drawn with (from the transcript's CSS)."""

    console: Console = field(compare=False)
    user: Style
    bar: Style
    muted: Style
    thinking: Style
    error: Style


class _CodeBlock(CodeBlock):
    """rich's code block, highlighted with the lexer made once per language."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        code = str(self.text).rstrip()
        # An unknown language goes to rich by name: it falls back to plain text.
        yield Syntax(code, lexer(self.lexer_name) or self.lexer_name, theme=self.theme,
                     word_wrap=True, padding=1)


class _Markdown(RichMarkdown):
    elements = {**RichMarkdown.elements, "fence": _CodeBlock, "code_block": _CodeBlock}


# NOTE: rich builds a new parser for every Markdown (~0.4 ms, as much as drawing a short
# paragraph); a reply is drawn block by block, so the app parses with one parser and
# copies one built Markdown.
_PARSER = MarkdownIt().enable("strikethrough").enable("table")  # what rich parses with
_MARKDOWN = _Markdown("", hyperlinks=False, code_theme=CODE_THEME)


def markdown(source: str, style: Style | str = "none") -> RichMarkdown:
    """`source` as rich Markdown whose single line breaks stay line breaks: a chat reply's
    poem, address or list written without blank lines keeps its shape (CommonMark would
    join the lines)."""
    md = copy.copy(_MARKDOWN)
    md.style = style
    md.parsed = _PARSER.parse(source)
    keep_line_breaks(md.parsed)
    return md


def render_lines(console: Console, renderable: RenderableType, width: int,
                 style: Style | None = None, left: str = " " * PAD,
                 left_style: Style | None = None, right: str = " " * PAD) -> list[Strip]:
    """`renderable` rendered `width` columns wide, between `left` and `right` margins."""
    inner = max(1, width - len(left) - len(right))
    options = console.options.update(width=inner, height=None, highlight=False)
    rows = console.render_lines(renderable, options, style=style, pad=True)
    head, tail = Segment(left, left_style), Segment(right, style)
    return [Strip([head, *row, tail], width) for row in rows]


def paragraph_lines(console: Console, text: str, width: int, style: Style) -> list[Strip]:
    """One paragraph of plain text, wrapped (never parsed as Markdown or markup)."""
    if not text:
        return [Strip.blank(width)]
    return render_lines(console, Text(text, style=style, end=""), width, style)


_WORDS = re.compile(r"\s+|\S+")


def _cells(text: str) -> int:
    return len(text) if text.isascii() else cell_len(text)


def wrap(paragraph: str, width: int) -> list[tuple[int, str]]:
    """Greedy word wrap of one paragraph to `width` cells: (offset, text) of each line.
    Spaces where a line breaks are dropped; a word longer than a line is folded.
    Greedy: appending text never changes any line but the last."""
    lines: list[tuple[int, str]] = []
    start, line, used = 0, "", 0
    for match in _WORDS.finditer(paragraph):
        word = match.group()
        size = _cells(word)
        if used + size <= width:
            line += word
            used += size
            continue
        if word[0].isspace():  # break at the spaces
            lines.append((start, line))
            start, line, used = match.end(), "", 0
            continue
        if line:
            lines.append((start, line))
        start, line, used = match.start(), "", 0
        while size > width:  # fold a word longer than the line
            cut = width if word.isascii() else _fit(word, width)
            lines.append((start, word[:cut]))
            start, word = start + cut, word[cut:]
            size = _cells(word)
        line, used = word, size
    lines.append((start, line))
    return lines


def _fit(word: str, width: int) -> int:
    """How many characters of `word` fit in `width` cells (at least one)."""
    used = 0
    for i, char in enumerate(word):
        used += cell_len(char)
        if used > width:
            return max(1, i)
    return len(word)


def warm_up() -> None:
    """Draw a small finished reply once, off screen: the Markdown parser and the code
    highlighter load (~40 ms on 2 cores) before the first real reply ends."""
    console = Console(width=40, file=io.StringIO(), color_system="truecolor")
    render_lines(console, markdown("**a**\n\n- b\n\n```python\nx = 1\n```\n"), 40)


def _shows_on_spaces(style: Style) -> bool:
    """Whether a space drawn in `style` looks unlike a blank cell."""
    return bool(style.bgcolor or style.underline or style.underline2 or style.strike
                or style.reverse or style.overline)


class GrowingText:
    """Plain text that only grows, wrapped as it grows: lines before the last do not
    change (greedy wrapping), so an update wraps only the last line or two and the new
    text."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self._key: tuple[Any, ...] | None = None
        self._done: list[Strip] = []  # lines that can no longer change
        self._from = 0  # text[_from:] starts the line after them

    def add(self, text: str) -> None:
        self.text += text

    def lines(self, width: int, style: Style) -> list[Strip]:
        key = (width, style)
        if key != self._key:
            self._key, self._done, self._from = key, [], 0
        inner = max(1, width - 2 * PAD)
        # A line's trailing spaces go into its padding where they look the same: a line
        # drawn before and after the space that ends its last word arrived is then one
        # strip, not a change that repaints it and every line below it.
        trim = not _shows_on_spaces(style)
        paragraphs = self.text[self._from:].split("\n")
        pos = self._from
        last: list[Strip] = []
        for n, paragraph in enumerate(paragraphs):
            wrapped = wrap(paragraph, inner)
            strips = [self._strip(line.rstrip(" ") if trim else line, width, inner, style)
                      for _, line in wrapped]
            if n < len(paragraphs) - 1:
                self._done.extend(strips)
                pos += len(paragraph) + 1
                continue
            # The last line may still change; so may the one before it when the last is
            # empty: the spaces it broke at may go on.
            keep = len(wrapped) - 1
            if keep and not wrapped[-1][1]:
                keep -= 1
            self._done.extend(strips[:keep])
            self._from = pos + wrapped[keep][0]
            last = strips[keep:]
        return [*self._done, *last]

    @staticmethod
    def _strip(line: str, width: int, inner: int, style: Style) -> Strip:
        pad = " " * PAD
        return Strip([Segment(pad), Segment(line, style),
                      Segment(" " * (inner - _cells(line)) + pad)], width)


class Entry:
    """One item of a transcript; `lines` draws it (`gap`: a blank line above it)."""

    kind = ""
    gap = False

    def lines(self, look: Look, width: int) -> list[Strip]:
        raise NotImplementedError

    def click(self, line: int) -> bool:
        """The user clicked this entry's `line`; returns whether its lines changed."""
        return False


class _Cached(Entry):
    """An entry whose lines depend only on the look and width."""

    def __init__(self) -> None:
        self._cache: tuple[tuple[Any, ...], list[Strip]] | None = None

    def lines(self, look: Look, width: int) -> list[Strip]:
        key = (look, width)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self.draw(look, width))
        return self._cache[1]

    def draw(self, look: Look, width: int) -> list[Strip]:
        raise NotImplementedError


class UserEntry(_Cached):
    """What the user typed, shown verbatim on a band with a bar at its left."""

    kind = "user"
    gap = True

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def draw(self, look: Look, width: int) -> list[Strip]:
        body = Text(self.text, style=look.user, end="")
        inner = max(1, width - 2)  # one column of margin each side
        rows = render_lines(look.console, body, inner, look.user, left="▌ ",
                            left_style=look.bar, right=" ")
        return [Strip([Segment(" "), *row, Segment(" ")], width) for row in rows]


class Notice(_Cached):
    """A line of the app's own: where the context was cut ("cut"), an error ("error")."""

    def __init__(self, text: str, kind: str) -> None:
        super().__init__()
        self.text, self.kind = text, kind
        self.gap = kind == "cut"

    def draw(self, look: Look, width: int) -> list[Strip]:
        style = look.error if self.kind == "error" else look.muted
        return paragraph_lines(look.console, self.text, width, style)


class Reply(Entry):
    """A reply: a thinking block (collapsed once the answer starts; a click on its title
    opens or closes it), the answer and a note on how it ended.

    The answer is drawn as Markdown a block at a time (`split_blocks`): while it streams,
    each block is rendered once, when the next one starts, and the text after the last
    complete block is plain, wrapped as it grows; when the reply ends only that last block
    is left to render. (Rendering the whole reply at its end stalled the frames: eight
    replies ending together took a fifth of the app's time on a GPU's stream.)
    """

    kind = "reply"
    gap = True

    def __init__(self, text: str = "", status: Status = "streaming",
                 error: str | None = None, opens_thinking: bool = False) -> None:
        self.raw = text
        self.status: Status = status
        self.error = error
        self._parser = ThinkParser(opens_thinking)
        self.thinking_text = ""
        self.answer_text = ""
        self.has_thinking = False
        self.thinking_expanded = False
        self._think = GrowingText()
        self._blocks: list[str] = []  # the answer's complete Markdown blocks
        self._rest = GrowingText()  # the answer after them
        # The blocks' lines and the blank line between blocks, drawn for a look and width.
        self._drawn: tuple[tuple[Any, ...], Strip, list[list[Strip]]] | None = None
        self._cache: tuple[tuple[Any, ...], list[Strip]] | None = None  # once finished
        if status != "streaming":
            self.thinking_text, self.answer_text = split_thinking(text, opens_thinking)
            self.has_thinking = bool(self.thinking_text.strip())
            self._blocks = split_blocks(self.answer_text)[0]

    @property
    def streaming(self) -> bool:
        return self.status == "streaming"

    @property
    def markdown_source(self) -> str | None:
        """The answer as rendered in Markdown, once the reply has ended."""
        return None if self.streaming else self.answer_text.strip()

    def start_in_thinking(self) -> None:
        """The prompt opened the thinking block; the reply starts inside it."""
        if not self.raw:
            self._parser = ThinkParser(in_think=True)

    def append(self, raw: str) -> None:
        """Add streamed text (already sanitized)."""
        self.raw += raw
        for kind, text in self._parser.feed(raw):
            self._write(kind, text)

    def _write(self, kind: str, text: str) -> None:
        if kind == "think":
            if not self.has_thinking:
                self.has_thinking = self.thinking_expanded = True  # open while it thinks
            if not self.thinking_text:
                text = text.lstrip("\n")
            self.thinking_text += text
            self._think.add(text)
            return
        if self.thinking_expanded and text.strip():
            self.thinking_expanded = False  # the answer has started
        if not self.answer_text:
            text = text.lstrip("\n")
        self.answer_text += text
        self._rest.add(text)
        blocks, rest = split_blocks(self._rest.text, final=False)
        if blocks:
            self._blocks += blocks
            self._rest = GrowingText(self._rest.text[rest:])

    def finish(self, status: Status, error: str | None = None) -> None:
        """The reply ended: from now on it is drawn as Markdown, with how it ended."""
        for kind, text in self._parser.finish():
            self._write(kind, text)
        if self.answer_text.strip():
            self.thinking_expanded = False
        self._blocks += split_blocks(self._rest.text)[0]
        self._rest = GrowingText()
        self.status, self.error = status, error
        self._cache = None

    def click(self, line: int) -> bool:
        if not self.has_thinking or line != 0:
            return False
        self.thinking_expanded = not self.thinking_expanded
        self._cache = None
        return True

    def note(self) -> str:
        if self.status == "error":
            return f"[error: {self.error or 'unknown'}]"
        note = STATUS_NOTES.get(self.status, "")
        return f"[{note}]" if note else ""

    def lines(self, look: Look, width: int) -> list[Strip]:
        if self.streaming:
            return self._streaming_lines(look, width)
        key = (look, width, self.thinking_expanded)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._finished_lines(look, width))
        return self._cache[1]

    def _title(self, look: Look, width: int) -> list[Strip]:
        mark = "▼" if self.thinking_expanded else "▶"
        return paragraph_lines(look.console, f"{mark} Thinking", width, look.muted)

    def _streaming_lines(self, look: Look, width: int) -> list[Strip]:
        out: list[Strip] = []
        if self.has_thinking:
            out += self._title(look, width)
            if self.thinking_expanded:
                out += self._think.lines(width, look.thinking)
        out += self._answer_lines(look, width)
        if self._rest.text:
            if self._blocks:
                out.append(self._drawn[1] if self._drawn else Strip.blank(width))
            out += self._rest.lines(width, Style())
        return out

    def _finished_lines(self, look: Look, width: int) -> list[Strip]:
        console = look.console
        out: list[Strip] = []
        if self.has_thinking:
            out += self._title(look, width)
            if self.thinking_expanded:
                source = self.thinking_text.strip()
                out += markdown_lines(console, source, width, look.thinking)
        out += self._answer_lines(look, width)
        note = self.note()
        if note:
            style = look.error if self.status == "error" else look.muted
            out += paragraph_lines(console, note, width, style)
        return out

    def _answer_lines(self, look: Look, width: int) -> list[Strip]:
        """The answer's complete blocks as Markdown, a blank line between blocks; each
        block is rendered once per width."""
        key = (look, width)
        if self._drawn is None or self._drawn[0] != key:
            self._drawn = (key, Strip.blank(width), [])
        _, gap, drawn = self._drawn
        for block in self._blocks[len(drawn):]:
            block = block.strip()
            lines = plain_lines(block, width)  # drawn as it streamed: no Markdown pass
            if lines is None:
                lines = _trim(markdown_lines(look.console, block, width))
            drawn.append(lines)
        out: list[Strip] = []
        for lines in drawn:
            if out:
                out.append(gap)  # the same strip every frame: unchanged lines stay unpainted
            out += lines
        return out


def markdown_lines(console: Console, source: str, width: int,
                   style: Style | str = "none") -> list[Strip]:
    """Markdown `source` drawn `width` columns wide between the margins, as
    `render_lines(console, markdown(source, style), width)` draws it: the blocks
    `block_rows` reads without rich's Markdown pipeline, any other through it."""
    inner = max(1, width - 2 * PAD)
    rows = block_rows(console, source, inner, style)
    if rows is None:
        return render_lines(console, markdown(source, style), width)
    head = tail = Segment(" " * PAD)
    return [Strip([head, *row, tail], width) for row in rows]


def plain_lines(block: str, width: int) -> list[Strip] | None:
    """`block` drawn as plain wrapped text, where that is exactly how Markdown draws it
    (`is_plain_paragraph`, and no word wider than a line: rich folds those otherwise);
    else None."""
    inner = max(1, width - 2 * PAD)
    if not is_plain_paragraph(block) or any(len(word) > inner for word in block.split()):
        return None
    return GrowingText(block).lines(width, Style())


def _trim(lines: list[Strip]) -> list[Strip]:
    """`lines` without the blank lines rich leaves at a block's start or end (after a list,
    before a table), so blocks are one blank line apart; a code block's shaded margin
    lines stay."""
    def blank(strip: Strip) -> bool:
        return not strip.text.strip() and all(
            seg.style is None or seg.style.bgcolor is None for seg in strip)

    start, end = 0, len(lines)
    while start < end and blank(lines[start]):
        start += 1
    while end > start and blank(lines[end - 1]):
        end -= 1
    return lines[start:end]
