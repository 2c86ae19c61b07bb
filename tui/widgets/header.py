"""One line about the engine: model, device, dtype, world size and the KV pool."""

from __future__ import annotations

from textual.widgets import Static

from ..messages import EngineInfo
from ..stats import pool_summary


def header_text(info: EngineInfo) -> str:
    pool = pool_summary(info.num_blocks, info.block_size, info.max_len)
    return (
        f"minivllm · {info.model} · {info.device} · {info.dtype} · "
        f"world size {info.world_size} · KV pool {pool}"
    )


class EngineHeader(Static):
    def __init__(self, info: EngineInfo) -> None:
        super().__init__(header_text(info), markup=False, id="engine-header")
