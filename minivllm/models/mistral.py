"""Mistral (v0.3 style): the Llama decoder. A sliding window is not implemented;
`ModelConfig.from_hf_config` caps the length at the window instead, where attention
over the whole context equals windowed attention."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
