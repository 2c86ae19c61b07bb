"""Inputs shared by the kernel tests and the kernel benchmark: random paged caches, the
models' decode shapes, a rotary table."""

from __future__ import annotations

import contextlib
import inspect
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    """A layer's K/V pool holding `seq_lens` contexts in randomly placed blocks."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32


def paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    spare_blocks: int = 3,
    spare_columns: int = 2,
) -> PagedKV:
    """Blocks are shuffled (tables are not contiguous runs) and the pool has blocks no
    sequence owns; `spare_columns` pads the block table past the longest context, as a
    CUDA-graph bucket does."""
    per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks).int()
    width = max(per_seq, default=0) + spare_columns
    block_tables = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        block_tables[i, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedKV(
        k_cache=torch.randn(shape, device=device).to(dtype),
        v_cache=torch.randn(shape, device=device).to(dtype),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def poison_unowned_slots(cache: PagedKV, seq_lens: list[int]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the cache's K and V with NaN in every slot no sequence owns (the pages'
    tails, spare blocks): a kernel that reads past a sequence puts NaN in its output."""
    block_size = cache.k_cache.shape[1]
    device = cache.k_cache.device
    owned = torch.zeros(cache.k_cache.shape[:2], dtype=torch.bool, device=device)
    for i, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len, device=device)
        owned[cache.block_tables[i, pos // block_size].long(), pos % block_size] = True
    poisoned = []
    for c in (cache.k_cache.clone(), cache.v_cache.clone()):
        if c.dtype == torch.float8_e4m3fn:  # no indexed writes of float8 on the CPU
            c.view(torch.uint8)[~owned] = 0x7F  # e4m3fn's NaN
        else:
            c[~owned] = float("nan")
        poisoned.append(c)
    return poisoned[0], poisoned[1]


# (name, hidden, heads, kv_heads, head_dim, intermediate, vocab) of the models the decode
# kernels are measured and tested at.
DECODE_MODELS = [
    ("qwen3-0.6b", 1024, 16, 8, 128, 3072, 151936),
    ("llama-3.2-1b", 2048, 32, 8, 64, 8192, 128256),
    ("smollm2-135m", 576, 9, 3, 64, 1536, 49152),
]


def projections(
    hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int
) -> list[tuple[str, int, int]]:
    """(name, N, K) of each matrix a decode step multiplies by."""
    return [
        ("qkv", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o", hidden, heads * head_dim),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
        ("lm_head", vocab, hidden),
    ]


def cos_sin_table(
    max_position: int, head_dim: int, device: torch.device | str = "cpu", theta: float = 1e6
) -> torch.Tensor:  # [max_position, head_dim]: cos in the first half, sin after
    """A rotary table as the model's RotaryEmbedding builds one (no scaling)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    freqs = torch.arange(max_position, device=device).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def qk_norm_weights(head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict:
    """Random per-head q/k RMSNorm weights near 1 (Qwen3), as keyword arguments."""
    return {name: (1 + 0.1 * torch.randn(head_dim, device=device)).to(dtype)
            for name in ("q_norm_weight", "k_norm_weight")}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when `out` has any non-finite element, so
    unwritten (NaN-poisoned) outputs fail."""
    if not torch.isfinite(out).all():
        return float("inf")
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Inside, torch.empty & co. return NaN-filled floats (and max-valued ints), so an
    output element a kernel forgets to write fails the comparison."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def decode_tile_variants(dtype: torch.dtype) -> list[dict]:
    """Decode tile configurations the benchmark sweeps and the GPU tests check, so a
    default can move to any of them with its correctness already shown."""
    from minivllm.kernels.decode_attention import _tile_config

    default = _tile_config(dtype)
    return [
        dict(default, BLOCK_N=32),
        dict(default, BLOCK_N=64),
        dict(default, num_stages=1),
        dict(default, num_stages=3),
        dict(default, num_warps=8),
        dict(default, BLOCK_N=64, num_warps=8, num_stages=3),
    ]


def prefill_tile_variants(dtype: torch.dtype, head_dim: int) -> list[dict]:
    """Prefill tile configurations the benchmark sweeps and the GPU tests check."""
    from minivllm.kernels.prefill_attention import _tile_config

    default = _tile_config(dtype, head_dim)
    flags = dict(TMA=False, LAST_FIRST=False)
    return [
        dict(default, **flags, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(default, **flags, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
        dict(default, **flags, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
        dict(default, **flags, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
        dict(default, **flags, BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
        dict(default, BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, TMA=False,
             LAST_FIRST=True),
        dict(default, BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=3, TMA=True,
             LAST_FIRST=False),
        dict(default, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, TMA=True,
             LAST_FIRST=True),
    ]


def describe_tiles(tiles: dict) -> str:
    """'M64 N64 w4 s2': query and key tile sizes, warps, pipeline stages (prefill: then
    'tma' and 'last' where set)."""
    parts = [f"M{tiles['BLOCK_M']}"] if "BLOCK_M" in tiles else []
    parts += [f"N{tiles['BLOCK_N']}", f"w{tiles['num_warps']}", f"s{tiles['num_stages']}"]
    parts += [name for key, name in (("TMA", "tma"), ("LAST_FIRST", "last")) if tiles.get(key)]
    return " ".join(parts)


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int = 4,
                 num_stages: int = 1, **options):
    """Compiles a kernel for an H100/H200 (sm_90) without a GPU: Triton's frontend, its
    passes and ptxas, with the divisibility hints the launcher gives aligned arguments.
    `signature`: the non-constexpr arguments' types that are not i32; `options`: Triton's
    other compile options (maxnreg, ...). Returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # A constexpr the caller leaves out takes its default, as a launch gives it.
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty},
                  **constexprs}
    sig = {name: signature.get(name, "constexpr" if name in constexprs else "i32")
           for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig)
             if sig[name].startswith("*") or "stride" in name or name in ("N", "K")}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median milliseconds of one replay of a captured CUDA graph, each timed by events
    around it on an otherwise idle stream."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
