"""The on-disk cache's pruning (`minivllm.loader.cache`): each entry records its source; a
new entry removes those of deleted or changed sources and older packings; an entry in use
is kept; entries without a record go once unused for long; `minivllm cache` lists,
prunes and clears."""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from minivllm import cli
from minivllm.loader import cache
from minivllm.loader import gguf as gguf_loader


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache; the converted folders this test holds are let go at its end."""
    folder = tmp_path / "minivllm-cache"
    monkeypatch.setenv("MINIVLLM_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    held: dict[Path, int] = {}
    monkeypatch.setattr(cache, "_held", held)
    yield folder
    _let_go(held)


def _let_go(held: dict[Path, int]) -> None:
    """Release this process's holds on converted folders (as if it had exited)."""
    for fd in held.values():
        os.close(fd)
    held.clear()


# -- the engine's packed weights -----------------------------------------------------------


def _kernel_or_skip() -> None:
    from minivllm.kernels import cpu_lowp_linear as kernel

    if kernel.unavailable_reason() is not None:
        pytest.skip(f"the CPU kernel does not build here: {kernel.unavailable_reason()}")


def _load(folder: Path):
    """A q8_0 model of the checkpoint in `folder`, as an engine start loads it."""
    import torch

    from minivllm.config import EngineConfig
    from minivllm.engine.model_loading import load_model

    config = EngineConfig.from_dict({"model_name_or_path": str(folder), "device": "cpu",
                                     "dtype": "float32", "cpu_weight_dtype": "q8_0"})
    loaded = load_model(config, torch.device("cpu"), torch.float32, 0, lambda *_: None)
    assert loaded.cpu_weight_format == "q8_0"
    return loaded.model


def _checkpoint(tiny: Path, dest: Path) -> Path:
    """A copy of the tiny checkpoint (the loader only asks that a tokenizer file be there)."""
    shutil.copytree(tiny, dest)
    (dest / "tokenizer.json").write_text("{}")
    return dest


def _packed_entries(root: Path) -> dict[Path, list[str]]:
    """packed/ entries -> the sources each recorded."""
    return {e.path: list(e.sources) for e in cache.entries() if e.kind == "packed"}


def test_a_deleted_checkpoints_entry_is_pruned_when_another_is_packed(
    root: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    _kernel_or_skip()
    first = _checkpoint(tiny_llama, tmp_path / "first")
    model = _load(first)
    assert list(_packed_entries(root).values()) == [[str(first.resolve())]]
    del model
    gc.collect()
    shutil.rmtree(first)  # a temporary checkpoint, gone

    second = _checkpoint(tiny_llama, tmp_path / "second")
    _load(second)
    assert list(_packed_entries(root).values()) == [[str(second.resolve())]]
    assert not list((root / "packed").glob(".trash-*"))


def test_a_repacked_checkpoint_replaces_its_entry_once_no_one_reads_it(
    root: Path, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changed weights (a new key) pack again; the old entry is kept while a model that
    reads it lives, and removed by the next prune once it is gone. A start on unchanged
    weights packs nothing."""
    _kernel_or_skip()
    from minivllm.engine import model_loading

    folder = _checkpoint(tiny_llama, tmp_path / "ckpt")
    old_model = _load(folder)
    (old_entry,) = _packed_entries(root)

    weights = folder / "model.safetensors"
    os.utime(weights, ns=(time.time_ns(), weights.stat().st_mtime_ns + 10**9))
    new_model = _load(folder)
    entries = _packed_entries(root)
    assert len(entries) == 2 and old_entry in entries  # in use by old_model: kept

    del old_model
    gc.collect()
    removed = [r.path for r in cache.prune() if r.removed]
    assert removed == [old_entry]
    assert list(_packed_entries(root).values()) == [[str(folder.resolve())]]

    def never(*args, **kwargs):
        raise AssertionError("a start on cached packed weights packed them again")

    monkeypatch.setattr(model_loading, "lowp_linears", never)
    again = _load(folder)
    assert again is not new_model


def test_a_start_records_an_entry_an_older_version_wrote(
    root: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """Packed weights without a record (an older minivllm) are recorded at their next use,
    so that a prune does not take them for unused ones."""
    _kernel_or_skip()
    folder = _checkpoint(tiny_llama, tmp_path / "ckpt")
    model = _load(folder)
    (entry,) = _packed_entries(root)
    del model
    gc.collect()
    (entry / cache.ENTRY_FILE).unlink()
    assert _packed_entries(root) == {entry: []}
    _load(folder)
    assert _packed_entries(root) == {entry: [str(folder.resolve())]}


# -- entries and tags, without an engine -----------------------------------------------------


def _packed_entry(root: Path, name: str, source: Path | None, tags: list[str]) -> Path:
    """A packed/ entry holding a file per tag; recorded from `source` unless None."""
    entry = root / "packed" / name
    entry.mkdir(parents=True)
    for tag in tags:
        (entry / f"{tag}.safetensors").write_bytes(b"packed")
    if source is not None:
        cache.record_entry(entry, "packed", source, "model.safetensors:1:1")
    return entry


def test_an_entry_in_use_is_never_removed(root: Path, tmp_path: Path) -> None:
    """A reader's shared lock keeps its entry from a prune and a clear; released, both
    remove it. A concurrent remover finds it gone and says so."""
    entry = _packed_entry(root, "a", tmp_path / "gone", ["q8_0-w8-aaaaaaaaaaaa"])
    lease = cache.lease_packed(entry / "q8_0-w8-aaaaaaaaaaaa.safetensors")
    with open(entry / "q8_0-w8-aaaaaaaaaaaa.safetensors", "rb") as reading:
        (kept,) = cache.prune()
        assert not kept.removed and kept.reason == cache.IN_USE
        assert [r.removed for r in cache.clear()] == [False]
        assert reading.read() == b"packed"
    assert entry.is_dir()
    lease.release()
    (removed,) = cache.prune()
    assert removed.removed and removed.path == entry and "no longer exists" in removed.reason
    assert not entry.exists() and not list((root / "packed").iterdir())
    assert not cache._remove_entry(entry, "again").removed  # another remover was first


def test_a_newer_packing_replaces_the_older_tags_of_its_format(root: Path) -> None:
    """In one entry, the older tag of a format and width goes with its prefill copies;
    another format, another width and a tag a reader holds stay."""
    tags = ["q8_0-w8-aaaaaaaaaaaa", "q8_0-w8-bbbbbbbbbbbb", "q8_0-w16-aaaaaaaaaaaa",
            "int8-w8-cccccccccccc", "int8-w8-dddddddddddd"]
    entry = _packed_entry(root, "k", root, tags)
    (entry / "q8_0-w8-aaaaaaaaaaaa-prefill-float32.safetensors").write_bytes(b"copies")
    past = time.time() - 60
    for tag in ("q8_0-w8-aaaaaaaaaaaa", "int8-w8-cccccccccccc"):
        os.utime(entry / f"{tag}.safetensors", (past, past))
    lease = cache.lease_packed(entry / "int8-w8-cccccccccccc.safetensors")
    done = cache.prune()
    lease.release()
    assert {(r.path.name, r.removed) for r in done} == {
        ("q8_0-w8-aaaaaaaaaaaa.safetensors", True),
        ("int8-w8-cccccccccccc.safetensors", False),
    }
    assert sorted(p.name for p in entry.iterdir()) == sorted(
        [cache.ENTRY_FILE, *(f"{t}.safetensors" for t in tags if t != "q8_0-w8-aaaaaaaaaaaa")]
    )


def test_entries_without_a_record_go_once_unused_for_long(root: Path) -> None:
    old = _packed_entry(root, "old", None, ["q8_0-w8-aaaaaaaaaaaa"])
    recent = _packed_entry(root, "recent", None, ["q8_0-w8-aaaaaaaaaaaa"])
    memo = root / "gguf" / "digests" / "0123"
    memo.parent.mkdir(parents=True)
    memo.write_text("f" * 64 + "\n")
    long_ago = time.time() - cache.STALE_AFTER_S - cache.DAY
    for path in (old, old / "q8_0-w8-aaaaaaaaaaaa.safetensors", memo):
        os.utime(path, (long_ago, long_ago))
    removed = {r.path for r in cache.prune() if r.removed}
    assert removed == {old, memo}
    assert recent.is_dir()


def test_what_a_killed_remover_or_writer_left_is_swept(root: Path) -> None:
    """What a remover renamed aside but did not delete goes at the next prune; a writer's
    temporary folder or file once a day old (a younger one may be being written)."""
    left = root / "packed" / ".trash-abc-123-xyz"
    left.mkdir(parents=True)
    (left / "q8_0-w8-aaaaaaaaaaaa.safetensors").write_bytes(b"packed")
    crashed = root / "gguf" / ".model-0123.tmp-abc"
    converting = root / "gguf" / ".model-4567.tmp-def"
    lock = root / "gguf" / ".model-4567.lock"
    for folder in (crashed, converting):
        folder.mkdir(parents=True)
    lock.write_text("")
    day_ago = time.time() - cache.DAY - 60
    os.utime(crashed, (day_ago, day_ago))
    os.utime(lock, (day_ago, day_ago))
    cache.prune()
    assert not left.exists() and not crashed.exists()
    assert converting.is_dir() and lock.is_file()


# -- converted GGUFs -------------------------------------------------------------------------


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the transformers conversion by a stand-in checkpoint; lists the files."""
    calls: list[Path] = []

    def convert(gguf: Path, dest: Path) -> None:
        calls.append(gguf)
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"weights")
        (dest / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(gguf_loader, "_convert_gguf", convert)
    return calls


def test_a_changed_gguf_replaces_its_conversion(
    root: Path, conversions: list[Path], tmp_path: Path
) -> None:
    """The folder records the GGUF it came from; a reinstall elsewhere finds it and is
    recorded as another source. A GGUF whose bytes changed is converted again; the old
    conversion goes once no source leads to it and no process holds it."""
    gguf = tmp_path / "install" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF one")
    first = gguf_loader.converted_gguf(gguf, "model", progress=False)
    record = json.loads((first / cache.ENTRY_FILE).read_text())
    assert record["kind"] == "gguf" and list(record["sources"]) == [str(gguf)]

    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf, copy)
    assert gguf_loader.converted_gguf(copy, "model", progress=False) == first
    assert len(conversions) == 1
    assert set(json.loads((first / cache.ENTRY_FILE).read_text())["sources"]) == {
        str(gguf), str(copy)
    }

    gguf.write_bytes(b"GGUF two")
    second = gguf_loader.converted_gguf(gguf, "model", progress=False)
    assert second != first and first.is_dir()  # the copy elsewhere still leads to it
    copy.unlink()
    assert [r.removed for r in cache.prune()] == [False]  # this process still holds it
    _let_go(cache._held)
    assert [r.path for r in cache.prune() if r.removed] == [first]
    assert second.is_dir()


def test_a_converted_folder_held_by_a_process_is_not_removed(
    root: Path, conversions: list[Path], tmp_path: Path
) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF one")
    folder = gguf_loader.converted_gguf(gguf, "model", progress=False)
    gguf.unlink()
    assert [r.removed for r in cache.prune()] == [False]
    _let_go(cache._held)
    assert [r.removed for r in cache.prune()] == [True]
    assert not folder.exists()


# -- `minivllm cache` ------------------------------------------------------------------------


def _cli(*argv: str) -> int:
    try:
        cli.main(["cache", *argv])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_the_cli_lists_prunes_and_clears(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "ckpt"
    source.mkdir()
    live = _packed_entry(root, "live", source, ["q8_0-w8-aaaaaaaaaaaa"])
    gone = _packed_entry(root, "gone", tmp_path / "deleted", ["q8_0-w8-aaaaaaaaaaaa"])
    (live / "q8_0-w8-bbbbbbbbbbbb.safetensors").write_bytes(b"packed again")
    past = time.time() - 60
    os.utime(live / "q8_0-w8-aaaaaaaaaaaa.safetensors", (past, past))
    assert _cli() == 0
    out = capsys.readouterr().out
    assert f"{root}: 2 entries" in out
    assert "[stale: older packings, 6 B]" in out
    assert "packed/live" in out and str(source) in out
    assert f"[stale: its source {tmp_path / 'deleted'} no longer exists]" in out

    assert _cli("--prune") == 0
    out = capsys.readouterr().out
    assert "removed packed/gone" in out and not gone.exists() and live.is_dir()
    assert "removed packed/live/q8_0-w8-aaaaaaaaaaaa.safetensors" in out
    assert "freed" in out

    lease = cache.lease_packed(live / "q8_0-w8-bbbbbbbbbbbb.safetensors")
    assert _cli("--clear") == 1
    captured = capsys.readouterr()
    assert "kept packed/live" in captured.out and live.is_dir()
    assert captured.err.strip().splitlines() == [
        "minivllm: error: 1 of the cache's entries were kept: in use by another process"
    ]
    lease.release()
    assert _cli("--clear") == 0
    assert not live.exists()


def test_the_cli_fails_in_one_line(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root.parent.mkdir(exist_ok=True)
    root.write_text("not a folder")
    assert _cli() == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minivllm: error: ") and "Traceback" not in err[0]
