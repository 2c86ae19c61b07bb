"""Terminal key quirks the app works around."""

from __future__ import annotations


def enable_alt_digits() -> None:
    """Let alt+1..alt+9 arrive as such.

    NOTE: Textual maps ESC+digit (what xterm-like terminals send for alt+digit) to the
    characters macOS's Option key would type ("\\x1b2" -> "™"), so `alt+2` bindings never
    fire. Dropping those entries makes the parser report `alt+2`. Private table: if a
    Textual release moves it, alt+digits fall back to Textual's behaviour and
    ctrl+left/right still move focus.
    """
    try:
        from textual import _ansi_sequences
    except ImportError:  # pragma: no cover - depends on the Textual release
        return
    table = getattr(_ansi_sequences, "ANSI_SEQUENCES_KEYS", None)
    if isinstance(table, dict):
        for digit in "123456789":
            table.pop("\x1b" + digit, None)
