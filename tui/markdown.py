"""Markdown as a chat shows it: every single line break in a reply is kept.

CommonMark joins the lines of a paragraph (a "soft break" renders as a space), so a poem,
an address or a list written without blank lines would change shape once the reply is
rendered. Chat front ends keep them as hard breaks; so does this app, on screen
(`keep_line_breaks` on the parsed reply) and in the Markdown export (`hard_line_breaks`).
"""

from __future__ import annotations

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
