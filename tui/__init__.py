"""minivllm-chat: several conversations side by side against one engine, with live stats.

`create_app(engine=...)` builds the Textual app around an engine (real or fake);
`minivllm.tui.cli:main` is the `minivllm-chat` console script.
"""

from __future__ import annotations

__all__ = ["create_app"]


def create_app(*args, **kwargs):  # noqa: ANN002, ANN003 - thin lazy re-export
    """Build the chat app; see `minivllm.tui.app.create_app`."""
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)
