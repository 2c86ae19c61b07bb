"""Reading a checkpoint folder: whether it is complete, its safetensors files (sharded or
not), their tensors one at a time or mapped into memory without a copy.

NOTE: nothing heavy at import time: torch and safetensors are imported by the functions
that read tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"


def folder_problem(folder: Path) -> str | None:
    """What is missing from a checkpoint folder, or None when it is complete."""
    if not (folder / "config.json").is_file():
        return f"no config.json in {folder}"
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{index} is not a valid safetensors index ({type(e).__name__}: {e})"
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return f"shard(s) listed in {index} are missing: {', '.join(missing)}"
    elif not any(folder.glob("*.safetensors")):
        other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(other[:3])}: minivllm reads only safetensors)" if other else ""
        return f"no weights (*.safetensors) in {folder}{hint}"
    has_tokenizer = (
        (folder / "tokenizer.json").is_file()
        or (folder / "tokenizer.model").is_file()
        or ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())
    )
    if not has_tokenizer:
        return (
            f"no tokenizer files in {folder}: need tokenizer.json "
            f"(or tokenizer.model, or vocab.json + merges.txt)"
        )
    return None


def raise_if_incomplete(folder: Path, field: str) -> None:
    problem = folder_problem(folder)
    if problem is not None:
        raise FileNotFoundError(f"{field}: {problem}")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a checkpoint: the shards its index names, else every *.safetensors."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / INDEX_FILE
    if index.is_file():
        # The index is authoritative: a folder may also hold stale files from an older save.
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{index} is not a valid safetensors index ({type(e).__name__}: {e})"
            ) from None
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shard(s) listed in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weights (*.safetensors) in {path}")
    return files


def iter_safetensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint folder (sharded or not), one at a time, on the CPU."""
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensor = f.get_tensor(name)
                    yield name, tensor
        except (SafetensorError, OSError, RuntimeError) as e:
            size = file.stat().st_size if file.is_file() else 0
            raise ValueError(
                f"{file} is not a readable safetensors file ({size} bytes; "
                f"{type(e).__name__}: {first_line(e)}); the checkpoint is truncated or "
                f"corrupt: download or save it again"
            ) from None


# safetensors' dtype names -> torch's (torch's names, imported with torch when mapping).
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}  # fmt: skip


def map_safetensors(file: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of one safetensors file as views of the file mapped into memory, and the
    file's metadata. Nothing is read or copied up front: a page is read when a tensor is
    first used, and the mapping is private, so writing to a tensor never changes the file.
    A truncated or corrupt file raises ValueError naming it."""
    import mmap

    import torch

    file = Path(file)
    size = file.stat().st_size if file.is_file() else 0
    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > size - 8:
                raise ValueError(f"a header of {header_len} bytes does not fit")
            header = json.loads(f.read(header_len))
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        base = 8 + header_len
        metadata = header.pop("__metadata__", None) or {}
        tensors: dict[str, torch.Tensor] = {}
        for name, info in header.items():
            dtype = getattr(torch, _SAFETENSORS_DTYPES[info["dtype"]])
            shape = [int(n) for n in info["shape"]]
            start, end = (int(n) for n in info["data_offsets"])
            numel = 1
            for n in shape:
                numel *= n
            if not 0 <= start <= end <= size - base or end - start != numel * dtype.itemsize:
                raise ValueError(f"tensor {name!r} lies outside the file or has a wrong size")
            if numel == 0:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=end - start,
                                   offset=base + start)
            if (base + start) % dtype.itemsize:
                raw = raw.clone()  # kernels may assume aligned elements
            tensors[name] = raw.view(dtype).view(shape)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{file} is not a readable safetensors file ({size} bytes; "
            f"{type(e).__name__}: {first_line(e)}); the checkpoint is truncated or "
            f"corrupt: download or save it again"
        ) from None
    return tensors, metadata
