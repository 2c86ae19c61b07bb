"""Filling a model's parameters: from a checkpoint folder, or random for benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def load_weights(model: nn.Module, path: str | Path, skip: frozenset[str] = frozenset()) -> None:
    """Fill every parameter from the checkpoint, through the parameter's loader.

    The checkpoint's files are mapped, not read: on one rank, a CPU parameter that is a
    whole checkpoint tensor becomes a view of the mapped file (no copy; pages are read as
    they are used). Fused parameters (qkv, gate_up) are filled shard by shard following the
    model's `packed_modules_mapping`. Parameters named in `skip` are left as they are (the
    caller replaces them); any other the checkpoint never fills is an error.
    """
    from ..distributed import get_tp_size
    from ..loader import map_safetensors, safetensors_files

    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    whole = get_tp_size() == 1  # every unfused loader then copies the whole tensor
    filled: set[str] = set(skip)
    for file in safetensors_files(path):
        tensors, _ = map_safetensors(file)
        for name, tensor in tensors.items():
            if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                continue
            for source, (target, shard_id) in packed.items():
                if f".{source}." in name:
                    pname = name.replace(f".{source}.", f".{target}.")
                    if pname not in skip:
                        param = params[pname]
                        param.weight_loader(param, tensor, shard_id)
                    break
            else:
                if name not in params:
                    raise ValueError(
                        f"checkpoint tensor {name!r} matches no parameter of the model"
                    )
                pname = name
                param = params[name]
                if pname in skip:
                    pass
                elif (
                    whole
                    and param.device.type == "cpu"
                    and param.dtype == tensor.dtype
                    and param.shape == tensor.shape
                ):
                    param.data = tensor
                else:
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
