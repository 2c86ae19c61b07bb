"""Model output is untrusted: show it as plain text, never as terminal control codes."""

from __future__ import annotations

import re

# ESC-introduced sequences: CSI (ESC [ ... final), OSC (ESC ] ... BEL or ST), DCS/SOS/PM/APC
# (ESC P/X/^/_ ... ST), and two-byte escapes. Then the 8-bit C1 forms of CSI and OSC.
_ESCAPES = re.compile(
    r"""
    \x1b\[[0-?]*[ -/]*[@-~]?            # CSI
    | \x1b\][^\x07\x1b]*(?:\x07|\x1b\\)? # OSC
    | \x1b[PX^_][^\x1b]*(?:\x1b\\)?      # DCS, SOS, PM, APC
    | \x1b[@-Z\\-_]?                     # other two-byte escapes, or a lone ESC
    | \x9b[0-?]*[ -/]*[@-~]?             # C1 CSI
    | \x9d[^\x07\x9c]*(?:\x07|\x9c)?     # C1 OSC
    """,
    re.VERBOSE,
)
# Remaining C0 controls except tab and newline, DEL, and C1 controls.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean_text(text: str) -> str:
    """Remove terminal escape sequences and control characters; keep tabs and newlines.

    `\\r\\n` becomes `\\n` and a lone `\\r` is dropped, so a reply cannot overwrite what is
    already on screen.
    """
    if not text:
        return text
    text = text.replace("\r\n", "\n")
    text = _ESCAPES.sub("", text)
    return _CONTROLS.sub("", text)


# An escape sequence still open at the end of a chunk: its end may come in the next one.
_OPEN_SEQUENCE = re.compile(
    r"""
    ( \x1b
    | (?:\x1b\[|\x9b)[0-?]*[ -/]*
    | (?:\x1b\]|\x9d)[^\x07\x1b\x9c]*\x1b?
    | \x1b[PX^_][^\x1b]*\x1b?
    )\Z
    """,
    re.VERBOSE,
)
_MAX_HELD = 256


class StreamCleaner:
    """`clean_text` for a stream: a sequence split across chunks (ESC in one delta, `[2J`
    in the next) is held back until it is complete, so no fragment of it shows."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> str:
        text = self._held + text
        self._held = ""
        start = max(text.rfind("\x1b"), text.rfind("\x9b"), text.rfind("\x9d"))
        if start >= 0 and len(text) - start <= _MAX_HELD and _OPEN_SEQUENCE.match(text, start):
            text, self._held = text[:start], text[start:]
        return clean_text(text)

    def finish(self) -> str:
        text, self._held = self._held, ""
        return clean_text(text)
