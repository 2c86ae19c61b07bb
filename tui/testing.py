"""Helpers for driving the app in tests and scripts (Textual's `run_test` pilot)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from textual.pilot import Pilot


async def wait_until(
    pilot: Pilot, condition: Callable[[], Any], timeout: float = 10.0, what: str = ""
) -> None:
    """Poll `condition` (letting the app run) until it is true; fail after `timeout` s.

    NOTE: polls with `asyncio.sleep`, not `pilot.pause`, which also forces a full screen
    refresh each time: polling with it renders at 100 Hz and skews any timing.
    """
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(0.01)


async def wait_ready(pilot: Pilot, timeout: float = 30.0) -> None:
    """Until the chat screen is up with the first pane's input focused."""
    app = pilot.app
    await wait_until(pilot, lambda: app.chat is not None and app.panes
                     and app.focused is app.panes[0].input, timeout, "the chat screen")


async def type_and_send(pilot: Pilot, pane_index: int, text: str) -> None:
    """Focus a pane's input, put `text` in it and send it (what Enter does).

    NOTE: not `pilot.press("enter")`: that waits for every widget's queue to drain, which
    while another pane streams can take until its reply ends.
    """
    pane = pilot.app.panes[pane_index]
    pane.input.focus()
    pane.input.text = text
    before = len(pane.conversation.messages)
    pane.input.action_send()
    await pilot.pause()
    # On a loaded machine one pause may not be enough for the app to take the message:
    # wait (briefly, without failing: a refused send keeps the text) until its reply has
    # begun (the user's message and the reply's are both in), or the input was taken
    # without a message (a command).
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        count = len(pane.conversation.messages)
        if count >= before + 2 or (count == before and pane.input.text != text):
            break
        await asyncio.sleep(0.01)


async def wait_idle(pilot: Pilot, timeout: float = 30.0) -> None:
    """Until no pane has a request in flight."""
    await wait_until(pilot, lambda: not any(p.busy for p in pilot.app.panes), timeout,
                     "every pane to finish")
