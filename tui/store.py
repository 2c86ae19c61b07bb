"""Conversations on disk: one append-only JSONL file per session, replayed on --resume.

Durability rules: a user message is written and
fsynced before it is submitted; a reply's text is written as it streams (buffered, flushed
to the OS about once a second) and fsynced when it finishes; replaying a file whose last
line was torn by a crash skips that line; a reply with no end record was interrupted.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minivllm.envs import read

from .conversation import ChatMessage, Conversation, Settings

SESSION_SUFFIX = ".jsonl"


def data_dir() -> Path:
    """`$MINIVLLM_DATA_DIR`, else `$XDG_DATA_HOME/minivllm`, else `~/.local/share/minivllm`."""
    configured = read("MINIVLLM_DATA_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "minivllm"


def sessions_dir(root: Path | None = None) -> Path:
    return (root or data_dir()) / "sessions"


def new_session_path(root: Path | None = None) -> Path:
    """A fresh session file's path (nothing is created until the first message)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return sessions_dir(root) / f"{stamp}-{os.getpid()}{SESSION_SUFFIX}"


class SessionStore:
    """Appends records to one session file. Used from the UI thread only.

    The file is created at the first user message: records before it (the session
    header, pane settings) wait in memory, so a start that fails or a run that never
    chats leaves no empty session behind for `--resume` to pick.

    Storage faults (an unwritable data dir, a full disk, a file-size limit) never reach
    the caller: the store switches to memory-only, keeps `error`, and calls `on_error`
    once so the UI can say so. The conversations stay on screen and can be exported.
    """

    def __init__(self, path: Path, on_error: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.on_error = on_error
        self.error: str | None = None
        self._file: Any = None
        self._waiting: list[dict[str, Any]] = []  # records before the file exists
        self._partial: dict[int, list[str]] = {}
        self._unsynced = False  # records handed to the OS, not yet to the disk
        self.closed = False
        if self.path.exists():  # resuming: keep appending to the same file
            self._open()

    @property
    def created(self) -> bool:
        return self._file is not None

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._file = os.fdopen(fd, "a", encoding="utf-8")
            # NOTE: a crash may have left half a line at the end; start on a fresh line so
            # the next record is not glued to it (the torn half is then skipped on replay).
            size = self.path.stat().st_size
            if size:
                with open(self.path, "rb") as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        self._file.write("\n")
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        """Stop writing (memory only from now on) and tell the UI once."""
        if self.error is not None:
            return
        self.error = f"{exc.strerror or exc} ({exc.filename or self.path})"
        try:
            if self._file is not None:
                self._file.close()
        except OSError:
            pass
        self._file = None
        if self.on_error is not None:
            self.on_error(self.error)

    # -- low level ---------------------------------------------------------------------

    def append(self, record: dict[str, Any], sync: bool = False) -> None:
        """Write `record`: at once to the disk when `sync`, else to the OS (a crash or a
        kill of the app keeps it; the next `flush_partial` puts it on the disk)."""
        if self.closed or self.error is not None:
            return
        if self._file is None:
            if record.get("type") != "user":
                self._waiting.append(record)
                return
            self._open()
            if self._file is None:
                return
            waiting, self._waiting = self._waiting, []
            for r in waiting:
                self.append(r)
        try:
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            if sync:
                self.sync()
            else:
                self._file.flush()
                self._unsynced = True
        except OSError as exc:
            self._failed(exc)

    def sync(self) -> None:
        if self._file is None:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._unsynced = False
        except OSError as exc:
            self._failed(exc)

    def flush_partial(self) -> None:
        """Write buffered reply text and hand it to the OS (survives a kill -9); records
        written since the last tick without a sync (replies that ended) go to the disk,
        one sync for all of them (the app calls this every second)."""
        if self.closed:
            return
        unsynced = self._unsynced
        for key, parts in self._partial.items():
            if parts:
                self.append({"type": "chunk", "pane": key, "text": "".join(parts)})
        self._partial.clear()
        self._unsynced = unsynced
        if unsynced:
            self.sync()
        elif self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:
                self._failed(exc)

    def close(self) -> None:
        if self.closed:
            return
        self.flush_partial()
        self.sync()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        self.closed = True

    # -- records -----------------------------------------------------------------------

    def session(self, model: str) -> None:
        self.append({"type": "session", "version": 1, "model": model, "started": time.time()})

    def pane(self, key: int, settings: Settings) -> None:
        self.append({"type": "pane", "pane": key, "settings": settings.to_dict()}, sync=True)

    def theme(self, name: str) -> None:
        self.append({"type": "theme", "theme": name})

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
        # NOTE: not synced here: panes that end in one frame would each wait for the
        # disk on the UI thread; the next second's tick syncs them all at once.
        self.append(record)

    def regenerate(self, key: int) -> None:
        self._partial.pop(key, None)
        self.append({"type": "regen", "pane": key}, sync=True)

    def clear(self, key: int) -> None:
        self._partial.pop(key, None)
        self.append({"type": "clear", "pane": key}, sync=True)

    def close_pane(self, key: int) -> None:
        self._partial.pop(key, None)
        self.append({"type": "close", "pane": key}, sync=True)

    def context_cut(self, key: int, dropped: int) -> None:
        self.append({"type": "cut", "pane": key, "dropped": dropped})

    def reopen_pane(self, key: int) -> None:
        self.append({"type": "reopen", "pane": key}, sync=True)


class NullStore(SessionStore):
    """Keeps nothing (benchmarks, throwaway runs)."""

    def __init__(self) -> None:  # noqa: D107 - no file
        self.path = Path("/dev/null")
        self.on_error = None
        self.error = None
        self._file = None
        self._waiting = []
        self._partial = {}
        self._unsynced = False
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
    skipped_lines: int = 0  # torn or unreadable lines
    bad_records: int = 0  # valid JSON with values that make no sense (skipped)
    interrupted: list[int] = field(default_factory=list)  # pane keys with an open reply
    closed: dict[int, Conversation] = field(default_factory=dict)  # closed panes, by key
    theme: str | None = None
    model: str = ""
    started: float = 0.0

    @property
    def id(self) -> str:
        return self.path.stem

    @property
    def num_messages(self) -> int:
        return sum(len(c.messages) for c in self.conversations)

    def notice(self) -> str:
        """What a resume should tell the user about skipped lines, or ''."""
        parts = []
        if self.skipped_lines:
            parts.append(f"{self.skipped_lines} unreadable line(s)")
        if self.bad_records:
            parts.append(f"{self.bad_records} record(s) with bad values")
        return f"{self.path.name}: skipped " + " and ".join(parts) if parts else ""


@dataclass
class OpenedSession:
    """The app's session at start: its file, its panes' conversations, the closed panes'
    (newest last), what to tell the user about the resume, and the theme it used."""

    store: SessionStore
    conversations: list[Conversation]
    closed: list[Conversation]
    note: str = ""
    theme: str | None = None


def open_session(root: Path, resume: bool | Path, n: int, settings: Settings, model: str,
                 save: bool = True, on_error: Callable[[str], None] | None = None
                 ) -> OpenedSession:
    """Resume a session (`resume`: its file, or True for the latest one) or start one
    with `n` conversations of `settings`; `save` False keeps a new one in memory only."""
    path = resume if isinstance(resume, Path) else (latest_session(root) if resume else None)
    note, theme, closed = "", None, []
    if path is not None:
        loaded = load_session(path)
        store = SessionStore(path, on_error=on_error)
        for key in loaded.interrupted:  # close the open replies in the file too
            conv = next(c for c in loaded.conversations if c.key == key)
            store.end(key, "interrupted", conv.messages[-1].content)
        note, theme, closed = loaded.notice(), loaded.theme, list(loaded.closed.values())
        if loaded.conversations:
            return OpenedSession(store, loaded.conversations, closed, note, theme)
    else:
        store = (SessionStore(new_session_path(root), on_error=on_error) if save
                 else NullStore())
        if resume:
            note = "no earlier session with messages to resume"
    store.session(model)
    convs = [Conversation(k + 1, copy.deepcopy(settings)) for k in range(max(1, n))]
    for c in convs:
        store.pane(c.key, c.settings)
    return OpenedSession(store, convs, closed, note, theme)


class BadRecord(ValueError):
    """A session line that parses but whose values make no sense."""


STATUSES = ("streaming", "done", "length", "stopped", "interrupted", "error")


def load_session(path: Path) -> LoadedSession:
    """Replay a session file. Unreadable lines (a torn last line) and records with bad
    values are skipped and counted; the rest of the file still loads."""
    loaded = LoadedSession(Path(path))
    convs: dict[int, Conversation] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                loaded.skipped_lines += 1
                continue
            try:
                _apply(loaded, convs, rec)
            except (ValueError, KeyError, TypeError, AttributeError):
                loaded.bad_records += 1
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


def _text(rec: dict[str, Any], name: str) -> str:
    value = rec[name]
    if not isinstance(value, str):
        raise BadRecord(f"{name}={value!r}: not a string")
    return value


def _apply(loaded: LoadedSession, convs: dict[int, Conversation], rec: dict[str, Any]) -> None:
    kind = rec["type"]
    if kind == "session":
        loaded.model = str(rec.get("model", ""))
        loaded.started = float(rec.get("started", 0.0))
        return
    if kind == "theme":
        loaded.theme = _text(rec, "theme")
        return
    key = rec["pane"]
    if isinstance(key, bool) or not isinstance(key, int):
        raise BadRecord(f"pane={key!r}: not an int")
    if kind == "close":
        if key in convs:
            loaded.closed[key] = convs.pop(key)
        return
    if kind == "reopen":
        if key in loaded.closed:
            convs[key] = loaded.closed.pop(key)
        return
    if kind not in ("pane", "user", "chunk", "end", "regen", "clear", "cut"):
        raise BadRecord(f"type={kind!r}: unknown record")
    if kind == "pane":
        settings = Settings.from_dict(rec["settings"])  # validated: raises on bad values
    conv = convs.get(key)
    if conv is None:
        conv = convs[key] = Conversation(key)
    if kind == "pane":
        conv.settings = settings
    elif kind == "user":
        conv.messages.append(ChatMessage("user", _text(rec, "text")))
    elif kind == "chunk":
        text = _text(rec, "text")
        last = conv.messages[-1] if conv.messages else None
        if last is None or last.role != "assistant" or last.status != "streaming":
            last = ChatMessage("assistant", "", status="streaming")
            conv.messages.append(last)
        last.content += text
    elif kind == "end":
        status = rec.get("status", "done")
        if status not in STATUSES:
            raise BadRecord(f"status={status!r}: not one of {STATUSES}")
        error = rec.get("error")
        if error is not None and not isinstance(error, str):
            raise BadRecord(f"error={error!r}: not a string")
        text = _text(rec, "text") if "text" in rec else None
        last = conv.messages[-1] if conv.messages else None
        if last is None or last.role != "assistant" or last.status != "streaming":
            last = ChatMessage("assistant", "")
            conv.messages.append(last)
        if text is not None:
            last.content = text
        last.status = status
        last.error = error
    elif kind == "regen":
        conv.drop_last_reply()
    elif kind == "clear":
        conv.messages.clear()
        conv.dropped = 0
    elif kind == "cut":
        dropped = rec["dropped"]
        if isinstance(dropped, bool) or not isinstance(dropped, int) or not (
            0 <= dropped <= len(conv.messages)
        ):
            raise BadRecord(f"dropped={dropped!r}: not a message index")
        conv.dropped = dropped


# -- finding sessions ----------------------------------------------------------------------


def session_files(root: Path | None = None) -> list[Path]:
    """Session files, newest first."""
    folder = sessions_dir(root)
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if p.suffix == SESSION_SUFFIX and p.is_file()]
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name), reverse=True)


def list_sessions(root: Path | None = None) -> list[LoadedSession]:
    """Every session with at least one message, newest first."""
    out = []
    for path in session_files(root):
        try:
            loaded = load_session(path)
        except OSError:
            continue
        if loaded.num_messages or _has_user_record(path):
            out.append(loaded)
    return out


def _has_user_record(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("type") == "user":
                    return True
    except OSError:
        pass
    return False


def latest_session(root: Path | None = None) -> Path | None:
    """The newest session file in which a message was sent (files from before sessions
    were created at the first message may be empty: they are passed over)."""
    return next((p for p in session_files(root) if _has_user_record(p)), None)


def find_session(session_id: str, root: Path | None = None) -> Path:
    """The session whose id (file name without .jsonl) is `session_id`, or starts with
    it when that is unambiguous. Raises ValueError naming the id."""
    files = session_files(root)
    exact = [p for p in files if p.stem == session_id]
    if exact:
        return exact[0]
    matches = [p for p in files if p.stem.startswith(session_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(f"--resume {session_id}: no such session in {sessions_dir(root)} "
                         "(--sessions lists them)")
    raise ValueError(f"--resume {session_id}: matches {len(matches)} sessions: "
                     + ", ".join(p.stem for p in matches[:5]))


def describe_session(loaded: LoadedSession, width: int = 60) -> str:
    """One line for `--sessions`: id, date, panes, messages, first words."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(
        loaded.started or loaded.path.stat().st_mtime))
    first = next((m.content for c in loaded.conversations for m in c.messages
                  if m.role == "user"), "")
    words = " ".join(first.split())
    if len(words) > width:
        words = words[: width - 1] + "…"
    panes = len(loaded.conversations)
    return (f"{loaded.id}  {when}  {panes} pane{'s' if panes != 1 else ''}  "
            f"{loaded.num_messages} msgs  {words}")
