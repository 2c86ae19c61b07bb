"""Markdown as a chat shows it: every single line break in a reply is kept.

CommonMark joins the lines of a paragraph (a "soft break" renders as a space), so a poem,
an address or a list written without blank lines would change shape once the reply is
rendered. Chat front ends keep them as hard breaks; so does this app, on screen
(`keep_line_breaks` on the parsed reply) and in the Markdown export (`hard_line_breaks`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from markdown_it import MarkdownIt

# The preset Textual's Markdown widget parses with (the export is read by such renderers).
_PRESET = "gfm-like"
# Blocks whose lines are literal text: a hard break marker there would change the text.
_VERBATIM_BLOCKS = frozenset({"fence", "code_block", "html_block"})


def keep_line_breaks(tokens: Iterable[Any]) -> None:
    """Turn the soft line breaks of parsed Markdown (markdown-it's block tokens) into
    hard ones, in place."""
    for token in tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type, child.tag = "hardbreak", "br"


def hard_line_breaks(text: str) -> str:
    """`text` with two trailing spaces (CommonMark's hard break) on each line that another
    line follows in the same block, outside code blocks: any Markdown renderer then shows
    the line breaks the chat showed. Blank lines, code and raw HTML are left as they are."""
    lines = text.split("\n")
    verbatim: set[int] = set()
    for token in MarkdownIt(_PRESET).parse(text):
        if token.type in _VERBATIM_BLOCKS and token.map:
            verbatim.update(range(*token.map))
    out = []
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if i in verbatim or not line.strip() or not nxt.strip() or line.endswith("  "):
            out.append(line)
        else:
            out.append(line + "  ")
    return "\n".join(out)


# A fence opens or closes a code block: three or more backticks or tildes.
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_LIST_ITEM = re.compile(r"\s*([-*+]|\d{1,9}[.)])(\s|$)")
_CODE_INDENT = "    "


def split_blocks(text: str, final: bool = True) -> tuple[list[str], int]:
    """Cut Markdown `text` at blank lines into blocks that render the same apart as
    together: returns the complete blocks and where the rest starts.

    A reply streams: each block is rendered once, when the next one starts, instead of
    the whole reply when it ends. A cut is never inside a code fence, nor before a line
    that may continue the block before it: an indented line after a list item (the item's
    next paragraph, a nested list), indented code after indented code, HTML. The items
    of a list written with blank lines between them (a "loose" list) are blocks of their
    own, drawn a blank line apart, each with its own number. While `text` still grows
    (`final` False) a cut also waits until the line after it is complete, so a cut made
    while streaming is one the whole text makes too. `final`: the rest is the last block.
    """
    blocks: list[str] = []
    start = pos = 0
    fence = ""  # the open fence's marker ("" outside a code block)
    blank_before = in_list = False
    last = ""  # the block's last line that is not blank
    while pos < len(text):
        end = text.find("\n", pos)
        complete = end >= 0
        end = end if complete else len(text)
        line = text[pos:end]
        if fence:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = ""
        elif not line.strip():
            blank_before = True
        else:
            continues = line.startswith("<") or line[0].isspace() and (
                in_list or line.startswith(_CODE_INDENT) and last.startswith(_CODE_INDENT))
            if (blank_before and not continues and (complete or final)
                    and text[start:pos].strip()):
                blocks.append(text[start:pos].strip("\n"))
                start, in_list = pos, False
            blank_before = False
            in_list = in_list or bool(_LIST_ITEM.match(line))
            opened = _FENCE.match(line)
            if opened:
                fence = opened.group(1)
        if line.strip():
            last = line
        pos = end + 1
    if final and text[start:].strip():
        blocks.append(text[start:].strip("\n"))
        start = len(text)
    return blocks, start


# Text Markdown leaves as it is: ASCII letters, digits, single spaces and punctuation
# that no CommonMark or table / strikethrough rule reads, on lines that do not start a
# list item (`-`, `+`, `1.`) and neither start nor end with a space.
_PLAIN_WORD = r"[A-Za-z0-9,.;:'\"?!()%$/@^{}-]+"
_PLAIN_LINE = re.compile(rf"(?![-+]|\d+[.)]){_PLAIN_WORD}(?: {_PLAIN_WORD})*")


def is_plain_paragraph(block: str) -> bool:
    """Whether `block` (one block of a reply) is a paragraph that Markdown draws as its
    plain text, wrapped: the app then draws it as the streamed text it already showed."""
    return all(_PLAIN_LINE.fullmatch(line) for line in block.split("\n"))
