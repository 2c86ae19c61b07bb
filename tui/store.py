"""Conversations on disk: one append-only JSONL file per session, replayed on --resume.

Durability rules (RELIABILITY.md, the chat app fault): a user message is written and
fsynced before it is submitted; a reply's text is written as it streams (buffered, flushed
to the OS about once a second) and fsynced when it finishes; replaying a file whose last
line was torn by a crash skips that line; a reply with no end record was interrupted.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .conversation import ChatMessage, Conversation, Settings

SESSION_SUFFIX = ".jsonl"


def data_dir() -> Path:
    """`$MINIVLLM_DATA_DIR`, else `$XDG_DATA_HOME/minivllm`, else `~/.local/share/minivllm`."""
    if os.environ.get("MINIVLLM_DATA_DIR"):
        return Path(os.environ["MINIVLLM_DATA_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "minivllm"


def sessions_dir(root: Path | None = None) -> Path:
    return (root or data_dir()) / "sessions"


def latest_session(root: Path | None = None) -> Path | None:
    """The most recently written session file, or None."""
    folder = sessions_dir(root)
    if not folder.is_dir():
        return None
    files = [p for p in folder.iterdir() if p.suffix == SESSION_SUFFIX and p.is_file()]
    if not files:
        return None
    return max(files, key=lambda p: (p.stat().st_mtime, p.name))


def new_session_path(root: Path | None = None) -> Path:
    folder = sessions_dir(root)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return folder / f"{stamp}-{os.getpid()}{SESSION_SUFFIX}"


class SessionStore:
    """Appends records to one session file. Used from the UI thread only."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        # NOTE: a crash may have left half a line at the end; start on a fresh line so the
        # next record is not glued to it (the torn half is then skipped on replay).
        size = self.path.stat().st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self._file.write("\n")
        self._partial: dict[int, list[str]] = {}
        self.closed = False

    # -- low level ---------------------------------------------------------------------

    def append(self, record: dict[str, Any], sync: bool = False) -> None:
        if self.closed:
            return
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        if sync:
            self.sync()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def flush_partial(self) -> None:
        """Write buffered reply text and hand it to the OS (survives a kill -9)."""
        if self.closed:
            return
        for key, parts in self._partial.items():
            if parts:
                self.append({"type": "chunk", "pane": key, "text": "".join(parts)})
        self._partial.clear()
        self._file.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.flush_partial()
        self.sync()
        self._file.close()
        self.closed = True

    # -- records -----------------------------------------------------------------------

    def session(self, model: str) -> None:
        self.append({"type": "session", "version": 1, "model": model, "started": time.time()})

    def pane(self, key: int, settings: Settings) -> None:
        self.append({"type": "pane", "pane": key, "settings": settings.to_dict()}, sync=True)

    def user(self, key: int, text: str) -> None:
        self.append({"type": "user", "pane": key, "text": text, "at": time.time()}, sync=True)

    def chunk(self, key: int, text: str) -> None:
        if text:
            self._partial.setdefault(key, []).append(text)

    def end(self, key: int, status: str, text: str, error: str | None = None) -> None:
        self._partial.pop(key, None)
        record = {"type": "end", "pane": key, "status": status, "text": text}
        if error:
            record["error"] = error
        self.append(record, sync=True)

    def regenerate(self, key: int) -> None:
        self._partial.pop(key, None)
        self.append({"type": "regen", "pane": key}, sync=True)

    def clear(self, key: int) -> None:
        self._partial.pop(key, None)
        self.append({"type": "clear", "pane": key}, sync=True)

    def close_pane(self, key: int) -> None:
        self._partial.pop(key, None)
        self.append({"type": "close", "pane": key}, sync=True)


class NullStore(SessionStore):
    """Keeps nothing (benchmarks, throwaway runs)."""

    def __init__(self) -> None:  # noqa: D107 - no file
        self.path = Path("/dev/null")
        self._partial = {}
        self.closed = False

    def append(self, record: dict[str, Any], sync: bool = False) -> None:
        pass

    def sync(self) -> None:
        pass

    def flush_partial(self) -> None:
        self._partial.clear()

    def close(self) -> None:
        self.closed = True


@dataclass
class LoadedSession:
    path: Path
    conversations: list[Conversation] = field(default_factory=list)
    skipped_lines: int = 0
    interrupted: list[int] = field(default_factory=list)  # pane keys with an open reply


def load_session(path: Path) -> LoadedSession:
    """Replay a session file. Unreadable lines (a torn last line) are skipped and counted."""
    loaded = LoadedSession(Path(path))
    convs: dict[int, Conversation] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                _apply(convs, rec)
            except (ValueError, KeyError, TypeError):
                loaded.skipped_lines += 1
    for key, conv in convs.items():
        for m in conv.messages[:-1]:
            if m.status == "streaming":  # an older reply left open by an earlier crash
                m.status = "interrupted"
        last = conv.messages[-1] if conv.messages else None
        if last is not None and last.role == "assistant" and last.status == "streaming":
            last.status = "interrupted"
            loaded.interrupted.append(key)
        elif last is not None and last.role == "user":
            conv.messages.append(ChatMessage("assistant", "", status="interrupted"))
            loaded.interrupted.append(key)
    loaded.conversations = list(convs.values())
    return loaded


def _apply(convs: dict[int, Conversation], rec: dict[str, Any]) -> None:
    kind = rec["type"]
    if kind == "session":
        return
    key = int(rec["pane"])
    if kind == "close":
        convs.pop(key, None)
        return
    conv = convs.get(key)
    if conv is None:
        conv = convs[key] = Conversation(key)
    if kind == "pane":
        conv.settings = Settings.from_dict(rec["settings"])
    elif kind == "user":
        conv.messages.append(ChatMessage("user", str(rec["text"])))
    elif kind == "chunk":
        last = conv.messages[-1] if conv.messages else None
        if last is None or last.role != "assistant" or last.status != "streaming":
            last = ChatMessage("assistant", "", status="streaming")
            conv.messages.append(last)
        last.content += str(rec["text"])
    elif kind == "end":
        last = conv.messages[-1] if conv.messages else None
        if last is None or last.role != "assistant" or last.status != "streaming":
            last = ChatMessage("assistant", "")
            conv.messages.append(last)
        last.content = str(rec.get("text", last.content))
        last.status = rec.get("status", "done")
        last.error = rec.get("error")
    elif kind == "regen":
        conv.drop_last_reply()
    elif kind == "clear":
        conv.messages.clear()
