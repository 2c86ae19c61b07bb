"""minivllm-chat: several conversations side by side against one engine, with live stats.

`create_app(engine=...)` builds the Textual app around an engine (real or scripted);
`minivllm.tui.cli:main` is the `minivllm-chat` console script; `--plain` runs
`minivllm.tui.plain`. Module map: engine_client (where the app's `EngineClient` comes
from: an engine served by the shared front end, an engine process or a server; the app
reads each request's stream from it on its own event loop), engine_spec (what
`--engine-process` builds in the child: minivllm.frontend's EngineProcessClient),
messages (what the loading thread posts to the UI), conversation / store (data and the session file:
created at the first message, validated on replay, memory-only when it cannot be
written), thinking / sanitize / stats (pure helpers), widgets/ (one widget per module; a
transcript's entries in widgets/entries), compositor (screen updates row by row), app
(wiring), panes (the panes' lifecycle), streams (sending and reading each reply's
stream, once a frame), context (prompt tokens, the oldest turns cut to fit), commands
(the slash commands and the palette); `minivllm-chat --bench` is
`minivllm.bench.chat_app`. The scripted engine of the tests, the demo and the bench's
GPU-like case is `minivllm.server.standin`'s.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(engine: Any = None, **options: Any) -> Any:
    """Build the chat app; see `minivllm.tui.app.create_app` (imported lazily so the
    plain REPL and the pure helpers do not load Textual's widgets)."""
    from .app import create_app as _create_app

    return _create_app(engine, **options)
