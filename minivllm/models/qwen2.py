"""Qwen2 / Qwen2.5: the Llama decoder with a bias on the q, k and v projections
(ModelConfig.qkv_bias, set by the registry for this family)."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
