"""The app draws a reply's common Markdown blocks without rich's Markdown pipeline
(`tui/blocks.py`): whatever it draws must be what rich's Markdown draws, cell for cell."""

from __future__ import annotations

import io

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from minivllm.tui.blocks import block_rows
from minivllm.tui.markdown import split_blocks
from minivllm.tui.widgets.entries import markdown, markdown_lines, render_lines
from rich.console import Console
from rich.style import Style

CONSOLE = Console(width=80, file=io.StringIO(), color_system="truecolor")
THINKING = Style(color="grey50", italic=True)  # a base style, as the thinking block's


def cells(strips):
    """Each line's cells: its character and style."""
    return [[(char, segment.style or Style()) for segment in strip for char in segment.text]
            for strip in strips]


def rich_lines(block, width, style="none"):
    return render_lines(CONSOLE, markdown(block, style), width)


# Words: letters, digits, punctuation Markdown leaves alone, an underscore inside a word,
# letters outside ASCII (one of them two cells wide), words too long for a line.
_WORD = st.one_of(
    st.text(alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789"),
            min_size=1, max_size=8),
    st.text(alphabet=st.sampled_from("abcxyz09,.;:'\"?!()%$/@^{}-+=#"), min_size=1,
            max_size=6),
    st.sampled_from(["snake_case", "a_b_c", "café", "naïve", "日本語", "x—y", "it’s"]),
    st.text(alphabet=st.sampled_from("abcdefghij"), min_size=20, max_size=90),
)
# Characters Markdown reads, sprinkled in to exercise the way back to rich.
_ODD = st.sampled_from(["*", "_", "`", "**", "[x](y)", "<b>", "&amp;", "\\*", "~~s~~",
                        "a|b", "***", "__", "``", "*a**", " "])


@st.composite
def _span(draw):
    """A word, or a few words as strong, emphasis or code."""
    kind = draw(st.sampled_from(["word"] * 12 + ["strong", "em", "under", "code"] * 2 + ["odd"]))
    if kind == "word":
        return draw(_WORD)
    if kind == "odd":
        return draw(_ODD)
    words = " ".join(draw(st.lists(_WORD, min_size=1, max_size=3)))
    if kind == "code":
        inner = draw(st.sampled_from([words, "x * y", "a_b", "<tag>", "[i]", "|", "#"]))
        return f"`{inner}`"
    if kind == "strong":
        inner = draw(st.sampled_from([words, f"{words} `c`", f"`{words}`"]))
        return f"**{inner}**"
    mark = "*" if kind == "em" else "_"
    return f"{mark}{words}{mark}"


@st.composite
def _inline(draw):
    spans = draw(st.lists(_span(), min_size=1, max_size=10))
    text = " ".join(spans)
    if draw(st.booleans()):  # punctuation right after a span: "**this**." "`x`,"
        text += draw(st.sampled_from([".", ",", ":", ")", "!"]))
    return text


@st.composite
def _line(draw):
    kind = draw(st.sampled_from(["text"] * 4 + ["bullet", "ordered", "heading"]))
    content = draw(_inline())
    if kind == "bullet":
        return f"{draw(st.sampled_from('-*+'))} {content}"
    if kind == "ordered":
        number = draw(st.sampled_from([1, 1, 2, 3, 9, 10, 99, 0]))
        return f"{number}{draw(st.sampled_from('..)'))} {content}"
    if kind == "heading":
        return f"{'#' * draw(st.integers(1, 6))} {content}"
    return content


_CODE_LINE = st.one_of(
    st.sampled_from(["for wave in sea:", "    print(wave)  # a comment", "x = [1, 2, 3]",
                     'name = "keeper"', "def f(a, b):", "    return a * b", "", "fn main() {}",
                     "    let x = 1;", "}", "`tick` and ``two``", "```not a fence"]),
    st.text(alphabet=st.sampled_from("abcdef ghi()[]{}=+-*/#:'\"._ "), max_size=60),
    st.text(alphabet=st.sampled_from("abcdefghij"), min_size=30, max_size=100),
)


@st.composite
def _code_block(draw):
    language = draw(st.sampled_from(["python", "rust", "text", "", "no-such-language",
                                     "js"]))
    fence = draw(st.sampled_from(["```", "```", "~~~", "````"]))
    lines = draw(st.lists(_CODE_LINE, min_size=1, max_size=6))
    return "\n".join([fence + language, *lines, fence])


_BLOCK = st.one_of(
    st.lists(_line(), min_size=1, max_size=6).map("\n".join),
    _code_block(),
)


@settings(max_examples=500, deadline=None)
@given(_BLOCK, st.integers(8, 80), st.sampled_from(["none", THINKING]))
def test_a_block_drawn_without_rich_is_drawn_cell_for_cell_as_rich_draws_it(block, width,
                                                                            style):
    """Paragraphs with strong / emphasis / code spans, bullet and numbered lists, headings
    and fenced code, at any width: where `block_rows` draws a block, its lines are rich
    Markdown's lines, cell for cell (character and style), line for line."""
    block = block.strip()
    if block_rows(CONSOLE, block, width - 2, style) is None:
        event("left to rich")
        return
    event("drawn without rich")
    ours = markdown_lines(CONSOLE, block, width, style)
    theirs = rich_lines(block, width, style)
    assert len(ours) == len(theirs)
    assert cells(ours) == cells(theirs)


HANDLED = [
    "A paragraph with **strong**, *emphasis*, _emphasis_ and `code` in it.\nA second line.",
    "- **one**: the first item\n- two, *stressed*\n- three with `x = 1`",
    "* star bullets\n* and more",
    "1. first\n2. second, which is long enough to wrap at narrow widths\n3. third",
    "3) from three\n4) on",
    "Intro line:\n- **keeper** stone dark is light lamp from quietly every as",
    "Intro line:\n1. only from one\n2. two",
    "- an item\nthat goes on on the next line",
    "# A title",
    "### A *smaller* title with `code`",
    "## Heading\nand a paragraph after it",
    "```python\nfor wave in sea:\n    print(wave)\n```",
    "```\nno language\n\nand a blank line\n```",
    "```rust\nfn main() { println!(\"a line long enough that it has to wrap\"); }\n```",
    "~~~no-such-language\nplain text\n~~~",
    "snake_case names and a_b_c stay words",
    '"Quoted" lines and (parenthesised) ones are paragraphs too\n(like this one)',
]


@pytest.mark.parametrize("block", HANDLED)
def test_the_common_blocks_are_drawn_without_rich(block):
    """Each kind of block the fast path reads is read (not left to rich) at the widths a
    pane has, and drawn exactly as rich draws it."""
    for width in (18, 40, 80):
        for style in ("none", THINKING):
            assert block_rows(CONSOLE, block, width - 2, style) is not None, (block, width)
            ours = markdown_lines(CONSOLE, block, width, style)
            theirs = rich_lines(block, width, style)
            assert [list(strip) for strip in ours] == [list(strip) for strip in theirs]


@pytest.mark.parametrize("block", [
    "see [a link](https://example.com)", "a <b>tag</b>", "AT&amp;T", "a \\* star",
    "***both***", "**a *nested* b**", "~~struck~~", "a | b\n--- | ---", "> a quote",
    "---", "text\n---", "para\n2. not from one", "- a\n* other bullet", "- a\n1. ordered",
    "    indented code", "```python\nx = 1", "```\ncode\n```\nafter", "a\tb", "a *b",
    "2 * 3 * 4", "foo*bar*", "- # heading in an item", "line  \nnext", "```py extra\nx\n```",
])
def test_blocks_it_does_not_read_are_left_to_rich(block):
    assert block_rows(CONSOLE, block, 30) is None


def test_most_blocks_of_the_benchmark_reply_are_drawn_without_rich():
    """The app benchmark's stand-in reply: every block that is not plain text is read."""
    from minivllm.server.standin import gpu_like_reply

    blocks = split_blocks(gpu_like_reply(0, words=400))[0]
    assert blocks
    for block in blocks:
        assert block_rows(CONSOLE, block.strip(), 16) is not None, block


def test_a_finished_reply_draws_its_blocks_and_thinking_as_rich_would(monkeypatch):
    """A finished reply (answer blocks and an opened thinking block, in its own style) is
    drawn line for line as through rich's Markdown alone."""
    from minivllm.tui.widgets import entries
    from minivllm.tui.widgets.entries import Look, Reply

    look = Look(CONSOLE, Style(), Style(), Style(), THINKING, Style())
    thinking = "First **check** the `cache`:\n- it is warm\n- it holds *two* pages"
    text = (f"<think>{thinking}</think>## Result\n\nThe keeper **lit** the lamp.\n"
            "1. one\n2. two\n\n```python\nfor wave in sea:\n    print(wave)\n```\n\n"
            "see [x](y) too")
    assert block_rows(CONSOLE, thinking, 28, THINKING) is not None

    def lines():
        reply = Reply(text, status="done")
        reply.thinking_expanded = True
        return [list(strip) for strip in reply.lines(look, 30)]

    fast = lines()
    monkeypatch.setattr(entries, "block_rows", lambda *args, **kwargs: None)
    assert lines() == fast  # everything through rich
