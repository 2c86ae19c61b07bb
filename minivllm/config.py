"""Engine and model configuration: frozen, validated once, built from the seed's dict."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .models.registry import ARCHITECTURES, supported

# The seed's architecture keys -> ModelConfig field names.
ARCH_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_heads": "num_heads",
    "head_dim": "head_dim",
    "num_kv_heads": "num_kv_heads",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_layers",
    "tie_word_embeddings": "tie_word_embeddings",
    "base": "rope_theta",
    "rms_norm_epsilon": "rms_norm_eps",
    "qkv_bias": "qkv_bias",
    "scale": "scale",
    "max_position": "max_position",
    "ffn_bias": "ffn_bias",
    "architecture": "architecture",
}

# `cpu_weight_dtype` values: "auto" keeps the CPU's linear weights in the compute dtype.
CPU_WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8", "q8_0", "q4_1", "compact")
CPU_PREFILL_DTYPES = ("auto", "bfloat16", "float32")
CPU_DECODE_DTYPES = ("auto", "int8", "float32")
# `kv_cache_dtype` values: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3")
# stores them as float8 e4m3 with a per-layer scale, half the bytes of bf16.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# `cpu_weight_dtype` of `minivllm generate`, `minivllm-chat` and `bench latency --device cpu`
# (EngineConfig's "auto" takes the same plan where `dtype` is "auto" too; dtype "float32"
# keeps fp32 weights, the exact parity with transformers).
# "compact" keeps a model converted from a Q4_1 GGUF (the embedded SmolLM2) in its own
# Q4_1 / Q8_0 weights, exactly, with fewer bytes a token to stream than bf16 (a CPU decode
# step is bound by them), and takes bf16 weights elsewhere (faster than fp32 at nearly its
# greedy tokens; PERF.md's CPU decisions); where the CPU multiplies bf16, the compute dtype
# is bf16 already and this changes nothing.
APP_CPU_WEIGHT_DTYPE = "compact"

ENGINE_KEYS = {
    "model_name_or_path",
    "world_size",
    "max_num_sequences",
    "max_num_batched_tokens",
    "max_cached_blocks",
    "block_size",
    "eos",
    "enforce_eager",
    "gpu_memory_utilization",
    "max_model_length",
    "device",
    "dtype",
    "cpu_weight_dtype",
    "cpu_prefill_dtype",
    "cpu_decode_dtype",
    "load_format",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "seed",
    "async_scheduling",
    "kv_cache_dtype",
}
# Older key -> its current name (vLLM's), still accepted with a deprecation warning.
# `max_num_batch_tokens` sized the warm-up pass alone; that pass is now one step's budget.
RENAMED_KEYS = {"max_num_batch_tokens": "max_num_batched_tokens"}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only model (a family in models/registry.py)."""

    architecture: str = "Qwen3ForCausalLM"
    vocab_size: int = 151936
    hidden_size: int = 1024
    num_heads: int = 16
    head_dim: int = 128
    num_kv_heads: int = 8
    intermediate_size: int = 3072
    num_layers: int = 28
    tie_word_embeddings: bool = True
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    scale: float | None = None  # attention softmax scale; None means head_dim ** -0.5
    max_position: int = 40960
    ffn_bias: bool = False
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported; supported: {supported()}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_heads",
            "head_dim",
            "num_kv_heads",
            "intermediate_size",
            "num_layers",
            "max_position",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head of q and k before rotary."""
        return ARCHITECTURES[self.architecture].qk_norm

    @property
    def attn_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim**-0.5

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4.x or 5.x layout).

        A sliding window (Mistral v0.1, Qwen2 with use_sliding_window) is not
        implemented: the length is capped at the window, where full attention is exact.
        """
        if not isinstance(hf, dict):
            raise ValueError(f"config.json: expected a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or [hf.get("model_type", "?")]
        arch = archs[0] if isinstance(archs, list) and archs else archs
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture={arch!r} is not supported; supported: {supported()}")
        family = ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in hf:
                raise ValueError(f"config.json lacks {key!r}, which {arch} needs")
            return hf[key]

        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (
            None,
            "default",
        ):
            scaling = None
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        max_position = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window")
        if window and hf.get("use_sliding_window", arch == "MistralForCausalLM"):
            max_position = min(max_position, window)
        qkv_bias = family.qkv_bias
        if qkv_bias is None:
            qkv_bias = bool(hf.get("attention_bias", False))
        try:
            return cls(
                architecture=arch,
                vocab_size=need("vocab_size"),
                hidden_size=hidden,
                num_heads=heads,
                head_dim=hf.get("head_dim") or hidden // heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                intermediate_size=need("intermediate_size"),
                num_layers=need("num_hidden_layers"),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                rope_theta=float(theta),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                qkv_bias=qkv_bias,
                max_position=max_position,
                ffn_bias=bool(hf.get("mlp_bias", False)),
                rope_scaling=dict(scaling) if scaling else None,
                eos_token_ids=eos_ids,
                bos_token_id=hf.get("bos_token_id"),
            )
        except (TypeError, ZeroDivisionError) as e:  # a value of the wrong type
            why = f"{type(e).__name__}: {e}"
            raise ValueError(f"config.json has a malformed value ({why})") from None

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model_name_or_path={str(path)!r}: no config.json in {path}")
        try:
            model = cls.from_hf_config(_read_json(config_file))
        except ValueError as e:
            message = str(e).removeprefix("config.json: ")
            raise ValueError(f"{config_file}: {message}") from None
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen = _read_json(gen_file)
            eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
            if eos is not None:
                ids = tuple(eos) if isinstance(eos, list) else (eos,)
                model = dataclasses.replace(
                    model, eos_token_ids=tuple(dict.fromkeys(ids + model.eos_token_ids))
                )
        return model


def _read_json(path: Path) -> Any:
    """A JSON file's content; a broken file is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint is broken") from None


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an int >= {minimum}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, validated in `__post_init__`.

    `from_dict` takes the seed's dict, resolves the checkpoint and checks that any
    architecture keys given agree with it. Runtime facts (the KV block count found by
    sizing) live on the engine, not here; `LLMEngine.config` is a copy with
    `max_cached_blocks` set to the block count in use.
    """

    model_name_or_path: str
    model: ModelConfig = field(default_factory=ModelConfig)
    model_path: str | None = None  # resolved local folder with the weights, None for dummy
    world_size: int = 1
    max_num_sequences: int = 16
    max_num_batched_tokens: int = 1024
    max_cached_blocks: int | None = None
    block_size: int = 256
    eos: tuple[int, ...] | None = None
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    max_model_length: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    # The CPU's linear weights: "auto" = the machine's plan where `dtype` is "auto" too (a
    # GGUF's own Q4_1 / Q8_0, or bf16 weights where the CPU multiplies bf16:
    # cpu_features.default_cpu_weights), else in `dtype`; "bfloat16" / "int8" (per output
    # channel) = weight-only formats with fp32 activations (needs dtype float32); ignored
    # on CUDA.
    cpu_weight_dtype: str = "auto"
    # The dtype of a prefill's products under a weight-only format: "auto" = bf16 where
    # `dtype` is "auto" and the CPU multiplies bf16 (AMX, AVX-512 BF16), else fp32 (the
    # weight-only kernel's exact sums); "bfloat16" / "float32" force one.
    cpu_prefill_dtype: str = "auto"
    # The activations of the weight-only kernel's products with q4_1 / q8_0 weights (a
    # decode step's, and a prefill's where it is not bf16): "auto" = int8 per group of 32
    # (llama.cpp's arithmetic, AVX512-VNNI) where `dtype` is "auto" and the CPU has
    # AVX512-VNNI and -VBMI, else fp32 (exact sums); "int8" / "float32" force one.
    cpu_decode_dtype: str = "auto"
    load_format: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int | None = None
    # Schedule step N+1 while the device runs step N. None: on for CUDA, off for the CPU
    # (where a step computes as it is launched, so there is nothing to overlap).
    async_scheduling: bool | None = None
    # The KV cache's storage: "auto" = the model's dtype; "fp8" / "fp8_e4m3" = float8 e4m3
    # (twice the blocks in the same memory), upcast in attention.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size, 1)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling={self.async_scheduling!r}: must be True, False or None"
            )
        _check_int("max_num_sequences", self.max_num_sequences, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size={bs!r}: must be a power of two in [16, 256]")
        g = self.gpu_memory_utilization
        if not isinstance(g, (int, float)) or not math.isfinite(g) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization={g!r}: must be in (0, 1]")
        if self.max_cached_blocks is not None:
            _check_int("max_cached_blocks", self.max_cached_blocks, 1)
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device={self.device!r}: must be 'auto', 'cuda' or 'cpu'")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"dtype={self.dtype!r}: must be 'auto', 'bfloat16', 'float16' or 'float32'"
            )
        if self.cpu_weight_dtype not in CPU_WEIGHT_DTYPES:
            raise ValueError(
                f"cpu_weight_dtype={self.cpu_weight_dtype!r}: must be one of "
                + ", ".join(repr(d) for d in CPU_WEIGHT_DTYPES)
            )
        if self.cpu_prefill_dtype not in CPU_PREFILL_DTYPES:
            raise ValueError(
                f"cpu_prefill_dtype={self.cpu_prefill_dtype!r}: must be one of "
                + ", ".join(repr(d) for d in CPU_PREFILL_DTYPES)
            )
        if self.cpu_decode_dtype not in CPU_DECODE_DTYPES:
            raise ValueError(
                f"cpu_decode_dtype={self.cpu_decode_dtype!r}: must be one of "
                + ", ".join(repr(d) for d in CPU_DECODE_DTYPES)
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}: must be one of "
                + ", ".join(repr(d) for d in KV_CACHE_DTYPES)
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r}: must be 'auto' or 'dummy'")
        if self.eos is not None:
            vocab = self.model.vocab_size
            for t in self.eos:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"eos={self.eos!r}: ids must be ints in [0, vocab_size)")
        ml = self.max_model_length
        if ml is not None:
            _check_int("max_model_length", ml, 1)
            if ml > self.model.max_position:
                raise ValueError(
                    f"max_model_length={ml} is above the model's "
                    f"max_position={self.model.max_position}"
                )
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        self._check_parallel()

    def _check_parallel(self) -> None:
        n = self.world_size
        m = self.model
        for name, value in (
            ("num_heads", m.num_heads),
            ("num_kv_heads", m.num_kv_heads),
            ("intermediate_size", m.intermediate_size),
            ("vocab_size", m.vocab_size),
        ):
            if value % n:
                raise ValueError(
                    f"{name}={value} is not divisible by world_size={n}: each rank needs an "
                    f"equal share"
                )

    # -- derived ---------------------------------------------------------------------

    @property
    def max_len(self) -> int:
        """The longest prompt + completion a request may reach."""
        return self.max_model_length or self.model.max_position

    @property
    def kv_fp8(self) -> bool:
        """Whether the KV cache stores float8 e4m3."""
        return self.kv_cache_dtype != "auto"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.eos if self.eos is not None else self.model.eos_token_ids

    # -- building from the seed's dict -------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        d = _renamed_keys(d)
        unknown = sorted(set(d) - ENGINE_KEYS - set(ARCH_KEYS))
        if unknown:
            raise ValueError(
                f"unknown config key(s): {', '.join(unknown)}; known keys: "
                f"{', '.join(sorted(ENGINE_KEYS | set(ARCH_KEYS)))}"
            )
        if "model_name_or_path" not in d:
            raise ValueError("config key 'model_name_or_path' is required")
        name = d["model_name_or_path"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"model_name_or_path={name!r}: must be a non-empty string")
        load_format = d.get("load_format", "auto")
        given = {ARCH_KEYS[k]: v for k, v in d.items() if k in ARCH_KEYS}

        model_path = None
        if load_format == "dummy":
            model = _dummy_model_config(name, given)
        else:
            from .loader import resolve_model

            model_path = resolve_model(name)
            model = ModelConfig.from_checkpoint(model_path)
            for key, value in given.items():
                if getattr(model, key) != value:
                    seed_key = next(k for k, v in ARCH_KEYS.items() if v == key)
                    raise ValueError(
                        f"config key {seed_key}={value!r} disagrees with the checkpoint's "
                        f"{getattr(model, key)!r} ({model_path}/config.json)"
                    )
        engine = {k: v for k, v in d.items() if k in ENGINE_KEYS and k != "model_name_or_path"}
        if engine.get("eos") is not None:
            eos = engine["eos"]
            engine["eos"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        if "max_cached_blocks" in engine and engine["max_cached_blocks"] in (None, -1):
            engine.pop("max_cached_blocks")
        return cls(
            model_name_or_path=name,
            model=model,
            model_path=str(model_path) if model_path else None,
            **engine,
        )


def _renamed_keys(d: dict[str, Any]) -> dict[str, Any]:
    """The dict with each older key under its current name, and a note for each."""
    old = [k for k in RENAMED_KEYS if k in d]
    if not old:
        return d
    d = dict(d)
    for key in old:
        new = RENAMED_KEYS[key]
        warnings.warn(f"config key {key!r} is deprecated; use {new!r}", FutureWarning,
                      stacklevel=3)
        value = d.pop(key)
        d.setdefault(new, value)
    return d


def _dummy_model_config(name: str, given: dict[str, Any]) -> ModelConfig:
    """Random weights: the architecture from a checkpoint if one resolves, else from the keys."""
    from .loader import KNOWN_CONFIGS, resolve_model

    base: ModelConfig | None = None
    if name in KNOWN_CONFIGS:
        base = ModelConfig.from_hf_config(KNOWN_CONFIGS[name])
    elif (Path(name) / "config.json").is_file():  # a config (and tokenizer), no weights
        base = ModelConfig.from_checkpoint(name)
    else:
        try:
            base = ModelConfig.from_checkpoint(resolve_model(name, allow_download=False))
        except (FileNotFoundError, OSError, ValueError):
            base = None
    if base is None:
        return ModelConfig(**given)
    return dataclasses.replace(base, **given)
