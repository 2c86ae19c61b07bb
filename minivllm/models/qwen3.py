"""Qwen3: the Llama decoder with q/k RMSNorm per head (the registry sets
ModelConfig.qk_norm for this family)."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
