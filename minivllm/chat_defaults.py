"""Default sampling for chatting with a model: what its authors ship, plus a repetition
penalty for small models.

As vLLM does by default (`--generation-config auto`), a checkpoint's generation_config.json
gives the default temperature, top_p, top_k, min_p and repetition_penalty; values the user
passes win. Used by `minivllm-chat` (the app and `--plain`) and `minivllm generate --chat`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .config import EngineConfig, ModelConfig
from .loader import SMOLLM2_REPO_ID, is_smollm2_name

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# The sampling a model card recommends, for checkpoints whose generation_config.json has
# none: SmolLM2-135M-Instruct's own holds only token ids, and the embedded GGUF records no
# sampling (so its conversion has none either).
MODEL_CARD_SAMPLING: dict[str, dict[str, float]] = {
    SMOLLM2_REPO_ID: {"temperature": 0.2, "top_p": 0.9},
}

# Models below this many parameters get SMALL_MODEL_REPETITION_PENALTY unless their own
# config sets a penalty (SmolLM2-135M and -360M; Qwen3-0.6B ships its own sampling).
SMALL_MODEL_PARAMS = 500_000_000
# 1.1: no looping reply, and no more rambling than without a penalty. Measured with
# scripts/chat_sampling_sweep.py (SmolLM2-135M-Instruct, T=0.2, top_p=0.9, 6 prompts x 3
# seeds, 200 tokens): replies looping (an 8-token span 3 times) 4, 1, 0, 1, 0 of 18 and
# replies cut at 200 tokens 2, 3, 2, 5, 8 of 18 at penalties 1, 1.05, 1.1, 1.15, 1.2.
SMALL_MODEL_REPETITION_PENALTY = 1.1


def generation_config_sampling(model_path: str | Path) -> dict[str, float]:
    """The sampling values in `model_path`/generation_config.json (absent keys, a missing
    or unreadable file: nothing)."""
    path = Path(model_path) / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, float] = {}
    for key in SAMPLING_KEYS:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
            value
        ):
            out[key] = value
    return out


def num_parameters(model: ModelConfig) -> int:
    """The decoder's weight count, from its shape (embeddings, attention, MLP, LM head)."""
    h, layers = model.hidden_size, model.num_layers
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * model.intermediate_size
    embeddings = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    return embeddings + layers * per_layer


def chat_sampling_defaults(config: EngineConfig) -> dict[str, float]:
    """Default sampling for a chat with `config`'s model: its generation_config.json,
    else its model card's values; plus the small-model repetition penalty where the model
    sets none. Keys are `SamplingParams` fields; missing keys keep the caller's defaults."""
    defaults = generation_config_sampling(config.model_path) if config.model_path else {}
    if not defaults and is_smollm2_name(config.model_name_or_path):
        defaults = dict(MODEL_CARD_SAMPLING[SMOLLM2_REPO_ID])
    if "repetition_penalty" not in defaults and num_parameters(config.model) < SMALL_MODEL_PARAMS:
        defaults["repetition_penalty"] = SMALL_MODEL_REPETITION_PENALTY
    return defaults
