"""minivllm's on-disk cache: its entries, what each was made from, and their pruning.

The cache (`gguf_cache_dir()`) holds two kinds of entries, one folder each:
- gguf/<name>-<digest>/: a GGUF converted into a safetensors checkpoint, keyed by the
  file's content; the CPU linears' packed weights of that checkpoint lie in its packed/.
- packed/<key>/: the packed weights of a checkpoint outside the cache, keyed by its
  location and its weight files' sizes and mtimes.
Packed weights are files named `<tag>.safetensors` (plus `<tag>-prefill-<dtype>.safetensors`
beside them), the tag naming the format and the version of the code that packed them.

Each entry records what it was made from in ENTRY_FILE (written atomically with it), whose
mtime is its last use (touched at each hit). An entry is stale when none of its sources
still leads to it: the source is gone (a deleted temporary checkpoint) or a newer entry
was made from it (a GGUF or checkpoint whose contents changed). Within one entry, a tag
is stale when a newer tag of the same format and block width was written (another
version of the packing code or of torch). An entry without ENTRY_FILE (written before
entries recorded their source) is stale once unused for STALE_AFTER_S.

Removal never pulls an entry from under a reader: a process using an entry holds a shared
`flock` on its folder, and one using packed weights holds one on the tag's file, for as
long as it may read them; a remover takes the exclusive lock without waiting (in use:
kept), renames the entry aside, then deletes it. A concurrent remover only finds the
entry gone.

NOTE: nothing heavy at import time: `minivllm cache` and a cached start import this.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..envs import read

try:
    import fcntl
except ImportError:  # Windows: no locks; an open file cannot be removed there anyway
    fcntl = None  # type: ignore[assignment]

# The kinds of entries, each a folder of the cache's root.
KINDS = ("gguf", "packed")
# In each entry: what it was made from; its mtime is the entry's last use.
ENTRY_FILE = "minivllm_cache.json"
# Digest memos of GGUF files (gguf/digests/), kept apart from the entries.
DIGESTS = "digests"
DAY = 24 * 3600
# An entry without ENTRY_FILE, or a digest memo, unused this long is removed by a prune.
STALE_AFTER_S = 30 * DAY
# Why a remover kept an entry or packed weights that a process holds.
IN_USE = "in use by another process"
# Prefix of what a remover renamed aside before deleting it.
_TRASH = ".trash-"
# A packing tag: the format, the kernel's block width, a hash of the code and torch.
_TAG = re.compile(r"(?P<group>.+-w\d+)-[0-9a-f]{12}")
_PREFILL = "-prefill-"

# Converted GGUF folders this process uses: their shared locks, held until it exits.
_held: dict[Path, int] = {}
_held_lock = threading.Lock()


def gguf_cache_dir() -> Path:
    """Where converted GGUF checkpoints live: $MINIVLLM_CACHE, else the XDG cache."""
    configured = read("MINIVLLM_CACHE")
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "minivllm"


@dataclass
class Entry:
    """One folder of the cache, as `entries` finds it."""

    path: Path
    kind: str
    # Where it was made from ({} for an entry written before entries recorded it), each
    # with the time it was recorded.
    sources: dict[str, float]
    # When it was written, and when it was last used (the newest mtime among its files
    # for an entry without ENTRY_FILE).
    created: float
    last_use: float

    @property
    def recorded(self) -> bool:
        return bool(self.sources)


@dataclass
class Removal:
    """What a prune or a clear removed (or kept: `removed` False) and why."""

    path: Path
    size: int
    reason: str
    removed: bool = True


# -- recording and using an entry (a start: small reads and writes only) ------------------


def record_entry(entry: Path, kind: str, source: str | os.PathLike[str],
                 identity: str) -> None:
    """Record in `entry` that it was made from `source` (whose content or version
    `identity` names); a source recorded already only marks the entry used. Written
    aside and renamed into place, so a reader never sees half a file."""
    source = os.path.abspath(source)  # a prune may run from another folder
    meta = entry / ENTRY_FILE
    data = _read_metadata(entry)
    if data is not None and source in data["sources"] and data.get("identity") == identity:
        touch(entry)
        return
    now = time.time()
    sources = dict(data["sources"]) if data is not None else {}
    sources[source] = now
    record = {
        "kind": kind,
        "sources": sources,
        "identity": identity,
        "created": data["created"] if data is not None else now,
    }
    tmp = meta.with_name(f".{meta.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, meta)
    finally:
        tmp.unlink(missing_ok=True)


def is_recorded(entry: Path) -> bool:
    """Whether `entry` has its record (one stat)."""
    return (entry / ENTRY_FILE).is_file()


def touch(entry: Path) -> None:
    """Mark `entry` used now (its ENTRY_FILE's mtime); nothing where it has none or the
    cache is read-only."""
    with contextlib.suppress(OSError):
        os.utime(entry / ENTRY_FILE)


def hold_for_process(entry: Path) -> bool:
    """Keep removers off `entry` until this process exits (a converted GGUF, whose files
    the engine reads at any time of a start); False where it is gone (a remover moved it
    away while we looked)."""
    with _held_lock:
        if entry in _held:
            return True
        fd = _shared_lock(entry)
        if fd is None:
            return entry.is_dir()  # there but not lockable (no flock here): used unlocked
        _held[entry] = fd
        return True


class Lease:
    """Shared locks that keep removers off an entry and a packed-weights file while their
    owner reads them; `release` (or the owner's collection) lets them go."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    def release(self) -> None:
        while self._fds:
            os.close(self._fds.pop())


def lease_packed(file: Path) -> Lease:
    """Shared locks on the entry that holds the packed-weights `file` and on `file`
    itself, those that exist; marks the entry used."""
    fds = []
    entry = entry_of(file)
    if entry is not None:
        touch(entry)
        for path in (entry, file):
            fd = _shared_lock(path)
            if fd is not None:
                fds.append(fd)
    return Lease(fds)


def entry_of(path: Path) -> Path | None:
    """The entry folder `path` lies in, None where it is outside the cache's entries."""
    root = gguf_cache_dir().resolve()
    try:
        parts = path.resolve().relative_to(root).parts
    except ValueError:
        return None
    if len(parts) < 2 or parts[0] not in KINDS or parts[1] == DIGESTS:
        return None
    return root / parts[0] / parts[1]


def _shared_lock(path: Path) -> int | None:
    """An fd holding a shared lock on `path` (a folder or a file), None where `path` is
    missing, was moved away while we waited for a remover to finish, or cannot be locked
    here."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _read_metadata(entry: Path) -> dict | None:
    """ENTRY_FILE's record, None where it is missing or unreadable."""
    try:
        data = json.loads((entry / ENTRY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("sources"), dict):
        return None
    times = [data.get("created"), *data["sources"].values()]
    if not all(isinstance(t, (int, float)) for t in times):
        return None
    return data


# -- listing ---------------------------------------------------------------------------


def entries() -> list[Entry]:
    """Every entry of the cache, oldest first."""
    root = gguf_cache_dir()
    found = []
    for kind in KINDS:
        with contextlib.suppress(FileNotFoundError):
            for path in (root / kind).iterdir():
                if path.name.startswith(".") or path.name == DIGESTS or not path.is_dir():
                    continue
                found.append(_entry(path, kind))
    return sorted(found, key=lambda e: e.created)


def _entry(path: Path, kind: str) -> Entry:
    data = _read_metadata(path)
    if data is None:
        newest = _newest_mtime(path)
        return Entry(path, kind, {}, newest, newest)
    try:
        last_use = (path / ENTRY_FILE).stat().st_mtime
    except OSError:
        last_use = data["created"]
    sources = {str(s): float(t) for s, t in data["sources"].items()}
    return Entry(path, kind, sources, float(data["created"]), last_use)


def _newest_mtime(path: Path) -> float:
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = path.stat().st_mtime
        for child in path.iterdir():
            with contextlib.suppress(OSError):
                newest = max(newest, child.stat().st_mtime)
    return newest


def size_of(path: Path) -> int:
    """Bytes under `path` (a file or a folder)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def stale_reason(entry: Entry, newer: dict[str, float], now: float) -> str | None:
    """Why a prune removes `entry`, None where it stays. `newer` maps each source to the
    time its newest entry recorded it."""
    if not entry.recorded:
        days = (now - entry.last_use) / DAY
        if now - entry.last_use > STALE_AFTER_S:
            return f"unused for {days:.0f} days (written by an older minivllm)"
        return None
    reasons = []
    for source, recorded in entry.sources.items():
        if not os.path.exists(source):
            reasons.append(f"its source {source} no longer exists")
        elif newer.get(source, recorded) > recorded:
            reasons.append(f"{source} has a newer entry")
        else:
            return None
    return "; ".join(reasons)


def newest_by_source(found: list[Entry]) -> dict[str, float]:
    """For each source, when its newest entry recorded it."""
    newest: dict[str, float] = {}
    for entry in found:
        for source, recorded in entry.sources.items():
            newest[source] = max(newest.get(source, recorded), recorded)
    return newest


# -- removing --------------------------------------------------------------------------


def prune(now: float | None = None) -> list[Removal]:
    """Remove stale entries and stale packed weights (see the module's docstring), old
    digest memos and what a killed writer or remover left behind; returns what was
    removed, and what was stale but in use (kept)."""
    now = time.time() if now is None else now
    found = entries()
    _sweep_leftovers(found, now)
    newer = newest_by_source(found)
    done = []
    for entry in found:
        reason = stale_reason(entry, newer, now)
        if reason is not None:
            done.append(_remove_entry(entry.path, reason))
            continue
        folder = packed_folder(entry)
        for tag, newest in stale_tags(folder).items():
            done.append(_remove_tag(folder, tag, f"replaced by {newest}"))
    done.extend(_prune_digests(now))
    return done


def clear() -> list[Removal]:
    """Remove every entry and digest memo (those in use are kept, and say so)."""
    found = entries()
    _sweep_leftovers(found, time.time())
    done = [_remove_entry(e.path, "cleared") for e in found]
    memos = gguf_cache_dir() / "gguf" / DIGESTS
    if memos.is_dir():
        done.append(Removal(memos, size_of(memos), "cleared"))
        shutil.rmtree(memos, ignore_errors=True)
    return done


def packed_folder(entry: Entry) -> Path:
    """Where `entry` keeps its packed weights."""
    return entry.path / "packed" if entry.kind == "gguf" else entry.path


def stale_tags(folder: Path) -> dict[str, str]:
    """In a folder of packed weights, each tag that a newer tag of the same format and
    block width replaced, with that newer tag."""
    groups: dict[str, dict[str, float]] = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for file in folder.iterdir():
            tag = _tag_of(file.name)
            match = _TAG.fullmatch(tag) if tag else None
            if match is None:
                continue
            # A tag's age is its packed weights' file's: an older engine may write its
            # prefill copies later. Prefill copies without that file count as oldest.
            tags = groups.setdefault(match["group"], {})
            tags.setdefault(tag, 0.0)
            if file.name == f"{tag}.safetensors":
                with contextlib.suppress(OSError):
                    tags[tag] = file.stat().st_mtime
    stale = {}
    for tags in groups.values():
        newest = max(tags, key=tags.__getitem__)
        stale.update({tag: newest for tag in tags if tag != newest})
    return stale


def tag_files(folder: Path, tag: str) -> list[Path]:
    """The files of packed weights `tag` (and its prefill copies) in `folder`."""
    try:
        return [f for f in folder.iterdir() if _tag_of(f.name) == tag]
    except FileNotFoundError:
        return []


def _tag_of(name: str) -> str | None:
    if name.startswith(".") or not name.endswith(".safetensors"):
        return None
    return name.removesuffix(".safetensors").partition(_PREFILL)[0]


def _remove_entry(path: Path, reason: str) -> Removal:
    """Rename `path` aside under its exclusive lock, then delete it; kept where another
    process holds it (in use), a concurrent remover took it first, or it cannot be
    renamed (a read-only cache)."""
    size = size_of(path)
    with _exclusive_now(path) as locked:
        if not locked:
            return Removal(path, size, IN_USE, removed=False)
        trash = _trash_name(path)
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return Removal(path, 0, "removed meanwhile by another process", removed=False)
        except OSError as e:
            return Removal(path, size, f"cannot be removed: {e}", removed=False)
    shutil.rmtree(trash, ignore_errors=True)
    return Removal(path, size, reason)


def _remove_tag(folder: Path, tag: str, reason: str) -> Removal:
    """Remove a tag's packed-weights files (renamed aside, then deleted), kept where a
    process holds the tag's file."""
    files = tag_files(folder, tag)
    size = sum(size_of(f) for f in files)
    main = folder / f"{tag}.safetensors"
    with _exclusive_now(main if main.exists() else None) as locked:
        if not locked:
            return Removal(main, size, IN_USE, removed=False)
        trash = []
        for file in files:
            aside = _trash_name(file)
            try:
                os.rename(file, aside)
            except FileNotFoundError:
                continue  # a concurrent remover took it
            except OSError as e:
                return Removal(main, size, f"cannot be removed: {e}", removed=False)
            trash.append(aside)
    for file in trash:
        file.unlink(missing_ok=True)
    return Removal(main, size, reason)


@contextlib.contextmanager
def _exclusive_now(path: Path | None) -> Iterator[bool]:
    """Yields whether an exclusive lock on `path` was taken without waiting (True for
    None: nothing to lock); the lock is held until the block ends."""
    if path is None:
        yield True
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield False
        return
    try:
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            still_there = os.stat(path).st_ino == os.fstat(fd).st_ino
        except OSError:
            still_there = False
        yield still_there
    finally:
        os.close(fd)


def _trash_name(path: Path) -> Path:
    return path.with_name(f"{_TRASH}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _sweep_leftovers(found: list[Entry], now: float) -> None:
    """Delete what a remover renamed aside but did not delete (it was killed), and what
    a killed writer left: the hidden temporary files and folders of a conversion or a
    save, once a day old (no writer takes that long)."""
    root = gguf_cache_dir()
    folders = {root / kind for kind in KINDS} | {root / "gguf" / DIGESTS}
    folders |= {e.path for e in found} | {packed_folder(e) for e in found}
    for folder in folders:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for path in folder.iterdir():
                if not path.name.startswith(".") or path.name.endswith(".lock"):
                    continue
                with contextlib.suppress(OSError):
                    if not path.name.startswith(_TRASH) and now - path.stat().st_mtime < DAY:
                        continue
                    if path.is_dir():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)


def _prune_digests(now: float) -> list[Removal]:
    """Remove the GGUF digest memos unused for STALE_AFTER_S (a later start hashes the
    file once again)."""
    done = []
    days = STALE_AFTER_S // DAY
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for memo in (gguf_cache_dir() / "gguf" / DIGESTS).iterdir():
            with contextlib.suppress(OSError):
                st = memo.stat()
                if now - st.st_mtime > STALE_AFTER_S:
                    memo.unlink()
                    done.append(Removal(memo, st.st_size, f"digest memo unused for {days} days"))
    return done
