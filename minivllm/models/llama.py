"""The Llama decoder (Llama 3.x, SmolLM2), written with tensor-parallel layers.

Qwen3 is the same network plus an RMSNorm on each head of q and k (see qwen3.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from minivllm.kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from minivllm.kernels.gemv import gemv_wins

from ..distributed import get_tp_size
from ..layers import ops
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention
from ..layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from ..config import ModelConfig


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        tp = get_tp_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp
        self.num_kv_heads = config.num_kv_heads // tp
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.qkv_bias,
        )
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, config.attn_scale)
        self.kernels = ops.TORCH_KERNELS  # the engine binds its own set (ops.bind_kernels)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention and the output projection, from the QKV projection's output."""
        if self.kernels.qkv_rotary_store is not None and self.attn.k_cache.numel():
            # q/k norm + rotary + KV store in one launch, or (decode) inside the attention
            # kernel (Triton; the CPU path is below).
            o = self.attn.forward_qkv(  # [num_tokens, num_heads, head_dim]
                positions,
                qkv,
                self.rotary_emb.cos_sin_cache,
                self.q_norm.weight if self.qk_norm else None,
                self.k_norm.weight if self.qk_norm else None,
                self.q_norm.eps if self.qk_norm else 1e-6,
            )
            return self.o_proj(o.flatten(1))
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=config.ffn_bias
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=config.ffn_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, rotary_emb)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.kernels = ops.TORCH_KERNELS  # the engine binds its own set (ops.bind_kernels)

    def forward(self, positions, x, residual):
        if self.kernels.rms_norm_gemv is not None and x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS:
            return self._forward_few_rows(positions, x, residual)
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_few_rows(self, positions, x, residual):
        """Decode-sized batches on CUDA: each RMSNorm runs inside the projection after it,
        and SiLU-and-mul inside gate_up, where the GEMV table picks the Triton GEMV."""
        attn, mlp = self.self_attn, self.mlp
        fused = self.kernels.rms_norm_gemv
        qkv, residual = _norm_linear(fused, self.input_layernorm, attn.qkv_proj, x, residual)
        x = attn.attend(positions, qkv)
        h, residual = _norm_linear(
            fused, self.post_attention_layernorm, mlp.gate_up_proj, x, residual, silu_mul=True
        )
        return mlp.down_proj(h), residual


def _norm_linear(
    fused: Callable, norm: RMSNorm, linear: nn.Module, x, residual, silu_mul: bool = False
):
    """linear(norm(x + residual)) (then SiLU-and-mul); returns (output, new residual).
    `fused` is the kernel set's rms_norm_gemv, taken where the GEMV table picks it."""
    w = linear.weight
    if gemv_wins(x.shape[0], w.shape[0], w.shape[1], x.dtype):
        return fused(x, residual, norm.weight, norm.eps, w, linear.bias, silu_mul=silu_mul)
    if residual is None:
        residual, x = x, norm(x)
    else:
        x, residual = norm(x, residual)
    y = linear(x)
    return (norm.kernels.silu_and_mul(y) if silu_mul else y), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One rotary table for every layer (they all rotate by the same positions).
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary_emb) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # Checkpoint projection name -> (our fused parameter, shard id).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)  # [num_seqs, vocab] on rank 0, None elsewhere
