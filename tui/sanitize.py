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
