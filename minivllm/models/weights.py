"""Filling a model's parameters: from a checkpoint folder, or random for benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Copy every checkpoint tensor into its parameter, through the parameter's loader.

    Fused parameters (qkv, gate_up) are filled shard by shard following the model's
    `packed_modules_mapping`. A parameter the checkpoint never fills is an error.
    """
    from ..loader import iter_safetensors

    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    filled: set[str] = set()
    for name, tensor in iter_safetensors(path):
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        for source, (target, shard_id) in packed.items():
            if f".{source}." in name:
                pname = name.replace(f".{source}.", f".{target}.")
                param = params[pname]
                param.weight_loader(param, tensor, shard_id)
                break
        else:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            pname = name
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor)
        filled.add(pname)
    missing = sorted(set(params) - filled - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise ValueError(f"checkpoint at {path} lacks weights for: {', '.join(missing[:8])}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of realistic scale: speed does not depend on their values."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0, 0.02, generator=generators[param.device])
