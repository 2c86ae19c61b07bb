"""A reply's common Markdown blocks drawn without rich's Markdown pipeline, exactly as it
draws them.

rich's Markdown parses a block with markdown-it, builds an element per token and renders
each through several layers of `console.render` and line splitting; for a short block
that costs more than the wrapping itself. `block_rows` reads the blocks chat replies are
made of and draws them as rich does: the same styled pieces of text (a code block's
pygments tokens in the same theme styles), wrapped and padded as `Text.wrap` does it (by
a loop of its own for ASCII text, by rich for other text):
paragraphs whose inline content is words, `**strong**`, `*em*` / `_em_` and `` `code` ``
spans; bullet and numbered lists of such items (a line after an item continues it);
ATX headings; fenced code blocks. Anything it does not read with certainty (links, HTML,
escapes, nested emphasis, blank lines, a lone `*`) gives None, and the caller draws the
block with rich's Markdown.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from itertools import pairwise

from pygments.lexer import Lexer
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound
from rich.console import Console, JustifyMethod
from rich.segment import Segment
from rich.style import Style
from rich.syntax import Syntax
from rich.text import Text

_TAB_SIZE = Syntax("", "text").tab_size  # rich's default for a code block
CODE_THEME = "monokai"  # the theme of the app's code blocks (rich Markdown's default)


@functools.lru_cache(maxsize=64)
def lexer(name: str) -> Lexer | None:
    """Pygments' lexer for a code block's language, as rich's `Syntax` makes it, made once
    per language (rich looks it up again for every block it draws)."""
    try:
        return get_lexer_by_name(name, stripnl=False, ensurenl=True, tabsize=_TAB_SIZE)
    except ClassNotFound:
        return None


Row = list[Segment]

# --- Reading a block ------------------------------------------------------------------

# Inline kinds, in the order rich enters their styles.
_STRONG, _EM, _CODE = "strong", "em", "code"
Inline = list[tuple[str, tuple[str, ...]]]  # a line's text, each piece with its kinds


@dataclass
class _Paragraph:
    """A paragraph's lines."""

    lines: list[Inline]


@dataclass
class _Heading:
    level: int
    pieces: Inline


@dataclass
class _List:
    marker: str  # the bullet character, or an ordered item's delimiter
    ordered: bool
    start: int
    items: list[_Paragraph] = field(default_factory=list)


@dataclass
class _Code:
    language: str
    code: str


_HEADING = re.compile(r"(#{1,6}) (\S.*)")
_BULLET = re.compile(r"([-*+]) (\S.*)")
_ORDERED = re.compile(r"(\d{1,9})([.)]) (\S.*)")
_MARKER = re.compile(r"(?:[-*+]|\d{1,9}[.)])(?: |$)")
# A run of characters read as themselves anywhere in a line: ASCII without escapes,
# entities, HTML, links, tables or strikethrough (`*`, `_` and backticks are read by
# `_inline`), or characters outside ASCII.
_LITERAL_RUN = re.compile(r"[A-Za-z0-9 ,.;:'\"?!()%$/@^{}+=#-]+|[^\x00-\x7f]+")
_ASCII_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_FENCE_OPEN = re.compile(r"(`{3,}|~{3,})([A-Za-z0-9_+#.-]*)")


def _kind_of(char: str) -> str | None:
    """A delimiter's neighbour as CommonMark's flanking rules see it: "space" (also the
    line's ends), "punct" or "word"; None for a character outside ASCII (whose Unicode
    class this reader does not decide)."""
    if char in ("", " "):
        return "space"
    if not char.isascii():
        return None
    return "punct" if char in _ASCII_PUNCT else "word"


def _can_open_close(line: str, start: int, end: int) -> tuple[bool, bool] | None:
    """Whether the delimiter run `line[start:end]` can open or close emphasis."""
    before = _kind_of(line[start - 1] if start else "")
    after = _kind_of(line[end] if end < len(line) else "")
    if before is None or after is None:
        return None
    left = after != "space" and (after != "punct" or before != "word")
    right = before != "space" and (before != "punct" or after != "word")
    if line[start] == "*":
        return left, right
    return left and (not right or before == "punct"), right and (not left or after == "punct")


def _inline(line: str) -> Inline | None:
    """One line's inline content as (text, kinds) pieces; None where it holds anything
    but words, code spans and single-level strong / emphasis. (`line` is printable.)"""
    pieces: Inline = []
    open_kind: str | None = None  # the emphasis open at this point
    open_run = ""
    text = ""
    i = 0
    n = len(line)

    def kinds() -> tuple[str, ...]:
        return (open_kind,) if open_kind else ()

    while i < n:
        literal = _LITERAL_RUN.match(line, i)
        if literal:
            text += literal.group()
            i = literal.end()
            continue
        char = line[i]
        if char == "`":
            close = line.find("`", i + 1)
            if close < 0 or close == i + 1 or line[close + 1:close + 2] == "`":
                return None
            code = line[i + 1:close]
            if code[0] == " " or code[-1] == " " or not code.isprintable():
                return None
            if text:
                pieces.append((text, kinds()))
                text = ""
            pieces.append((code, (*kinds(), _CODE)))
            i = close + 1
            continue
        if char not in "*_":
            return None
        end = i
        while end < n and line[end] == char:
            end += 1
        run = line[i:end]
        if run not in ("*", "**", "_"):
            return None
        flanking = _can_open_close(line, i, end)
        if flanking is None:
            return None
        can_open, can_close = flanking
        if char == "_" and line[i - 1:i].isalnum() and line[end:end + 1].isalnum():
            text += run  # an underscore inside a word is itself
            i = end
            continue
        if text:
            pieces.append((text, kinds()))
            text = ""
        if open_kind is None and can_open and not can_close:
            open_kind, open_run = (_STRONG if run == "**" else _EM), run
        elif open_kind is not None and run == open_run and can_close and not can_open:
            open_kind = None
        else:
            return None
        i = end
    if open_kind is not None:
        return None
    if text:
        pieces.append((text, ()))
    return pieces


# Characters a paragraph's line may start with that start no other block.
_TEXT_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                        "\"'(){}$%@^,.;:?!/")


def _starts_text(line: str) -> bool:
    """Whether `line` is a paragraph's line and no other block's start (a list item, a
    heading, a quote, a fence, a rule, HTML, a table's row, a setext underline)."""
    first = line[0]
    if first in _TEXT_START or (not first.isascii() and first.isprintable()):
        return True
    return first in "0123456789*_`" and not _MARKER.match(line)


def _read_code(lines: list[str]) -> _Code | None:
    """A block that is one fenced code block, from its opening line to its closing one."""
    opened = _FENCE_OPEN.fullmatch(lines[0])
    if not opened or len(lines) < 2 or lines[-1] != opened.group(1):
        return None
    fence = opened.group(1)
    body = lines[1:-1]
    for line in body:
        if "\t" in line or not line.isprintable() or line.lstrip().startswith(fence[:3]):
            return None  # a tab, a control character, a line that might close the fence
    return _Code(opened.group(2) or "text", "\n".join(body))


def _read(block: str) -> list[object] | None:
    """`block` as the elements rich's Markdown draws, or None."""
    lines = block.split("\n")
    if lines[0].startswith(("```", "~~~")):
        code = _read_code(lines)
        return None if code is None else [code]
    elements: list[object] = []
    current: _Paragraph | _List | None = None  # what a following plain line continues
    for line in lines:
        if not line or line[0] == " " or line[-1] == " " or not line.isprintable():
            return None
        heading = _HEADING.fullmatch(line)
        if heading:
            pieces = _inline(heading.group(2))
            if pieces is None or "#" in heading.group(2):
                return None
            elements.append(_Heading(len(heading.group(1)), pieces))
            current = None
            continue
        item = _BULLET.fullmatch(line) or _ORDERED.fullmatch(line)
        if item:
            content = item.groups()[-1]
            pieces = _inline(content) if _starts_text(content) else None
            if pieces is None:
                return None
            ordered = item.re is _ORDERED
            marker = item.group(2) if ordered else item.group(1)
            if isinstance(current, _List):
                if current.ordered != ordered or current.marker != marker:
                    return None  # a list of another kind right after: left to rich
            else:
                # An ordered list interrupts a paragraph only from 1.
                if isinstance(current, _Paragraph) and ordered and int(item.group(1)) != 1:
                    return None
                current = _List(marker, ordered, int(item.group(1)) if ordered else 1)
                elements.append(current)
            current.items.append(_Paragraph([pieces]))
            continue
        if not _starts_text(line):
            return None
        pieces = _inline(line)
        if pieces is None:
            return None
        if isinstance(current, _List):
            current.items[-1].lines.append(pieces)  # a lazy continuation of the item
        elif isinstance(current, _Paragraph):
            current.lines.append(pieces)
        else:
            current = _Paragraph([pieces])
            elements.append(current)
    return elements


# --- Drawing it -----------------------------------------------------------------------


Pieces = list[tuple[str, Style]]  # a line's text, each piece in its style


class _Styles:
    """The styles rich's Markdown draws with on `console`, from the base `style`."""

    def __init__(self, console: Console, style: Style | str) -> None:
        get = functools.partial(console.get_style, default="none")
        self.get = get
        self.base = get(style)
        self.inline = {kind: get(f"markdown.{kind}") for kind in (_STRONG, _EM, _CODE)}

    def styled(self, lines: list[Inline], style: Style) -> list[Pieces]:
        """Each piece of `lines` in the style rich's Markdown gives it: the element's
        `style` plus its inline styles, in the order rich enters them."""
        inline = self.inline
        out = []
        for pieces in lines:
            line = []
            for piece, kinds in pieces:
                piece_style = style
                for kind in kinds:
                    piece_style = piece_style + inline[kind]
                line.append((piece, piece_style))
            out.append(line)
        return out


def _text(lines: list[Pieces], style: Style, justify: JustifyMethod) -> Text:
    """The lines as rich's Markdown appends them to an element's `Text`: a line break
    between lines in the element's `style`."""
    text = Text(justify=justify)
    for n, pieces in enumerate(lines):
        if n:
            text.append("\n", style)
        for piece, piece_style in pieces:
            text.append(piece, piece_style)
    return text


def _text_rows(console: Console, lines: list[Pieces], line_style: Style, width: int,
               justify: JustifyMethod = "left", style: Style | None = None) -> list[Row]:
    """The lines (an element's text, `line_style` its style) wrapped and rendered `width`
    cells wide, as rich renders the element's `Text` and `console.render_lines` cuts it
    into rows (`style` added to every segment and padding)."""
    if justify == "left" and all(piece.isascii() for line in lines for piece, _ in line):
        rows = _single_cell_rows(lines, width)  # each row `width` cells: no padding
        if style:
            rows = [list(Segment.apply_style(row, style)) for row in rows]
        return rows
    rows = _rich_rows(console, _text(lines, line_style, justify), width)
    if style:
        rows = [list(Segment.apply_style(row, style)) for row in rows]
    return [Segment.adjust_line_length(row, width, style=style) for row in rows]


def _rich_rows(console: Console, text: Text, width: int) -> list[Row]:
    """`text` wrapped and rendered by rich, `width` cells wide."""
    rows = []
    lines = text.wrap(console, width, justify=text.justify, overflow="fold")
    # rich renders the lines joined: where any line has a styled span, a line without
    # one is drawn in the null style rather than none.
    null = Style.null() if any(line.spans for line in lines) else None
    for line in lines:
        row: Row = list(line.render(console))
        if null is not None and not line.spans:
            row = [Segment(piece, null) for piece, _, _ in row]
        rows.append(row)
    return rows


_WORD_RUN = re.compile(r"\s*\S+\s*")  # a word and the spaces around it, as rich splits


def _breaks(text: str, width: int) -> list[int]:
    """Where rich's `divide_line` (folding) breaks `text` of single-cell characters."""
    breaks: list[int] = []
    if len(text) <= width:
        return breaks
    used = 0
    for match in _WORD_RUN.finditer(text):
        start, end = match.span()
        size = len(match.group().rstrip())
        if width - used >= size:
            used += end - start
        elif size > width:  # folded into lines of `width` characters
            for at in range(start, end, width):
                if at:
                    breaks.append(at)
                used = end - at
        elif used and start:
            breaks.append(start)
            used = end - start
    return breaks


def _single_cell_rows(lines: list[Pieces], width: int) -> list[Row]:
    """Lines of ASCII text wrapped and rendered as rich's `Text.wrap` (justified left,
    folding) and `Text.render` do it: a segment per styled piece, the unstyled text and
    the padding between them merged."""
    rows: list[list[tuple[str, Style | None]]] = []
    styled = False
    for pieces in lines:
        plain = "".join(piece for piece, _ in pieces)
        cuts = [0, *_breaks(plain, width), len(plain)]
        for start, end in pairwise(cuts):
            if end - start > width:  # spaces beyond the width go, then the rest is cut
                spaces = end - start - len(plain[start:end].rstrip())
                end = max(start + width, end - spaces)
                end = min(end, start + width)
            row: list[tuple[str, Style | None]] = []
            plain_run = ""
            at = 0  # where the piece starts in `plain`
            for piece, style in pieces:
                part = piece[max(0, start - at):max(0, end - at)]
                at += len(piece)
                if not part:
                    continue
                if style:
                    if plain_run:
                        row.append((plain_run, None))
                        plain_run = ""
                    row.append((part, style))
                    styled = True
                else:
                    plain_run += part
            plain_run += " " * (width - (end - start))
            if plain_run:
                row.append((plain_run, None))
            rows.append(row)
    # Unstyled text is in the null style where a styled piece is drawn anywhere, else
    # in none (rich renders the wrapped lines joined).
    null = Style.null() if styled else None
    return [[Segment(text, style or null) for text, style in row] for row in rows]


def _list_rows(console: Console, styles: _Styles, element: _List,
               width: int) -> list[Row] | None:
    """A list as rich's `ListItem` draws it: each item's paragraph `width` less the
    marker's cells wide, the marker (or its blank) before each line."""
    item_style = styles.base + styles.get("markdown.item")
    paragraph_style = item_style + styles.get("markdown.paragraph")
    if element.ordered:
        last = element.start + len(element.items)
        marker_width = len(str(last)) + 2
        marker_style = styles.get("markdown.item.number")
        markers = [Segment(f"{element.start + n}".rjust(marker_width - 1) + " ", marker_style)
                   for n in range(len(element.items))]
    else:
        marker_width = 3
        marker_style = styles.get("markdown.item.bullet")
        markers = [Segment(" • ", marker_style)] * len(element.items)
    blank = Segment(" " * marker_width, marker_style)
    inner = width - marker_width
    if inner < 2:
        return None
    rows: list[Row] = []
    for marker, item in zip(markers, element.items, strict=True):
        lines = styles.styled(item.lines, paragraph_style)
        for n, row in enumerate(_text_rows(console, lines, paragraph_style, inner,
                                           style=item_style)):
            rows.append([marker if n == 0 else blank, *row])
    return rows


@functools.lru_cache(maxsize=4)
def _theme(name: str) -> tuple[Syntax, Style]:
    """A `Syntax` holding the theme (which caches each token type's style) and the
    theme's background style, once per theme."""
    syntax = Syntax("", "text", theme=name)
    return syntax, syntax._get_base_style()


def _code_lines(element: _Code) -> list[Pieces]:
    """The code block's lines as rich's `Syntax` highlights them: each line's pygments
    tokens in the theme's styles."""
    syntax, _ = _theme(CODE_THEME)
    token_style = syntax._theme.get_style_for_token
    # An unknown language is plain text, as rich's `Syntax` falls back to.
    found = lexer(element.language) or lexer("text")
    assert found is not None
    lines: list[Pieces] = [[]]
    for kind, token in found.get_tokens(element.code.rstrip() + "\n"):
        style = token_style(kind)
        for n, part in enumerate(token.split("\n")):
            if n:
                lines.append([])
            if part:
                lines[-1].append((part, style))
    return lines[:-1]  # the line after the code's last line break is not drawn


def _code_rows(console: Console, element: _Code, width: int) -> list[Row]:
    """A code block as the app's Markdown draws it: rich's `Syntax` (word wrap, one cell
    of padding on every side in the theme's background)."""
    _, base = _theme(CODE_THEME)
    code_width = width - 2
    side = Segment(" ", base)
    blank = [Segment(" " * width, base)]
    drawn: dict[Style | None, Style] = {}

    def style_of(style: Style | None) -> Style:
        """A token's style as drawn: rich renders the line in its base style, adds the
        background style, then the padding's (both the theme's background)."""
        if style not in drawn:
            rendered = Style.combine([base, style]) if style else base
            drawn[style] = base + (base + rendered)
        return drawn[style]

    rows: list[Row] = [blank]
    for pieces in _code_lines(element):
        if all(part.isascii() for part, _ in pieces):
            wrapped = _single_cell_rows([pieces], code_width)
        else:  # rich wraps it
            line = Text(justify="left", style=base)
            line.append_tokens(pieces)
            wrapped = [list(piece.render(console)) for piece in
                       line.wrap(console, code_width, justify="left", overflow="fold")]
        for row in wrapped:
            row = [Segment(part, style_of(style)) for part, style, _ in row]
            row = Segment.adjust_line_length(row, code_width, style=style_of(None))
            rows.append([side, *row, side])
    rows.append(blank)
    return rows


def block_rows(console: Console, block: str, width: int,
               style: Style | str = "none") -> list[Row] | None:
    """`block` (one block of a reply, stripped) drawn `width` cells wide, row by row, as
    rich's Markdown draws it with base `style` (the app's `markdown`), including the
    blank row rich puts before a list that opens the block; None for a block this module
    does not read (the caller draws it with rich)."""
    if width < 6 or not block:
        return None
    elements = _read(block)
    if not elements:
        return None
    styles = _Styles(console, style)
    rows: list[Row] = []
    for n, element in enumerate(elements):
        if n or isinstance(element, _List):
            rows.append([Segment(" " * width)])  # rich's line between elements
        if isinstance(element, _Code):
            rows += _code_rows(console, element, width)
        elif isinstance(element, _List):
            list_rows = _list_rows(console, styles, element, width)
            if list_rows is None:  # too narrow for its numbers
                return None
            rows += list_rows
        elif isinstance(element, _Heading):
            heading = styles.base + styles.get(f"markdown.h{element.level}")
            rows += _text_rows(console, styles.styled([element.pieces], heading), heading,
                               width, "center" if element.level == 1 else "left")
        else:
            assert isinstance(element, _Paragraph)
            paragraph = styles.base + styles.get("markdown.paragraph")
            rows += _text_rows(console, styles.styled(element.lines, paragraph), paragraph,
                               width)
    return rows
