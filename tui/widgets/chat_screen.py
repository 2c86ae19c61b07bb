"""The main screen: header, panes side by side, engine stats, footer; and its key bindings.

Every binding has an id (`chat.*`), so `App.set_keymap({"chat.new_pane": "f2"})` can
move it. The actions live on the app. Bindings that a focused input would otherwise
swallow (ctrl+w deletes a word there, ctrl+left/right move by word, ctrl+c copies,
PgUp/PgDn move the cursor) are priority ones.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.events import DescendantFocus
from textual.screen import Screen
from textual.widgets import Footer

from ..compositor import screen_compositor
from ..messages import EngineInfo
from .header import EngineHeader
from .pane import ConversationPane
from .stats_panel import StatsPanel


def _binding(key: str, action: str, desc: str, id: str, show: bool = True,
             priority: bool = True) -> Binding:
    return Binding(key, f"app.{action}", desc, show=show, id=f"chat.{id}", priority=priority)


class ChatScreen(Screen):
    BINDINGS = [
        _binding("escape", "stop", "Stop", "stop"),
        # ctrl+c stops the reply too (what a terminal user reaches for); it never quits.
        _binding("ctrl+c", "interrupt", "Stop", "interrupt", show=False),
        # NOTE: the footer shows few keys, so ctrl+q still fits on an 80-column terminal;
        # the rest are in ctrl+p's palette, /help and the README.
        _binding("alt+a", "broadcast", "Send to all", "broadcast", show=False),
        _binding("ctrl+r", "regenerate", "Regenerate", "regenerate", show=False),
        _binding("ctrl+n", "new_pane", "New", "new_pane"),
        _binding("ctrl+w", "close_pane", "Close", "close_pane"),
        _binding("ctrl+o", "reopen_pane", "Reopen", "reopen_pane", show=False),
        _binding("f2", "settings", "Settings", "settings"),
        _binding("alt+c", "copy_reply", "Copy reply", "copy_reply", show=False),
        _binding("pageup", "scroll_transcript(-1)", "Scroll up", "page_up", show=False),
        _binding("pagedown", "scroll_transcript(1)", "Scroll down", "page_down", show=False),
        _binding("ctrl+left", "focus_step(-1)", "Previous pane", "focus_previous", show=False),
        _binding("ctrl+right", "focus_step(1)", "Next pane", "focus_next", show=False),
        *[
            _binding(f"alt+{i}", f"focus_pane({i})", f"Pane {i}", f"focus_{i}", show=False)
            for i in range(1, 10)
        ],
    ]

    def __init__(self, info: EngineInfo, panes: list[ConversationPane]) -> None:
        super().__init__(id="chat")
        # Streaming panes dirty a few rows each frame: render only those (compositor.py).
        self._compositor = screen_compositor()
        self.info = info
        self.initial_panes = panes
        self.panes_box = Horizontal(id="panes")
        self.stats_panel = StatsPanel()

    def compose(self) -> ComposeResult:
        yield EngineHeader(self.info)
        with self.panes_box:
            yield from self.initial_panes
        self.initial_panes = []  # the box holds them now: a pane closed later can be freed
        yield self.stats_panel
        yield Footer(compact=True)

    def on_mount(self) -> None:
        panes = self.panes
        if panes:
            panes[0].input.focus()

    @property
    def panes(self) -> list[ConversationPane]:
        # NOTE: the box's children, not a DOM query: the frame and the stats read this
        # several times a second, and a query costs ~0.1 ms (selector matching).
        return [w for w in self.panes_box.children if isinstance(w, ConversationPane)]

    def on_descendant_focus(self, event: DescendantFocus) -> None:
        for node in event.widget.ancestors_with_self:
            if isinstance(node, ConversationPane):
                self.app.active_pane = node
                break
