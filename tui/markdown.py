"""Markdown as a chat shows it: every single line break in a reply is kept.

CommonMark joins the lines of a paragraph (a "soft break" renders as a space), so a poem,
an address or a list written without blank lines would change shape once the reply is
rendered. Chat front ends keep them as hard breaks; so does this app, on screen (the
parser given to Textual's `Markdown`) and in the Markdown export (`hard_line_breaks`).
"""

from __future__ import annotations

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore

# The parser Textual's Markdown widget uses by default.
_PRESET = "gfm-like"
# Blocks whose lines are literal text: a hard break marker there would change the text.
_VERBATIM_BLOCKS = frozenset({"fence", "code_block", "html_block"})


def _soft_breaks_to_hard(state: StateCore) -> None:
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type, child.tag = "hardbreak", "br"


def chat_markdown_parser() -> MarkdownIt:
    """Textual's default Markdown parser, with soft line breaks turned into hard ones
    (a `parser_factory` for `textual.widgets.Markdown`)."""
    parser = MarkdownIt(_PRESET)
    parser.core.ruler.push("chat_hard_breaks", _soft_breaks_to_hard)
    return parser


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
