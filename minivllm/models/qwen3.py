"""Qwen3: the Llama decoder with q/k RMSNorm per head (ModelConfig.qk_norm)."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
