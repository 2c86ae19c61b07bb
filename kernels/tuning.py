"""Decode-path switches, read once per process from the environment (A/B runs).

Each switch names a choice that only a measurement on the GPU can settle; the default is
the measured winner. `scripts/decode_ab.py` runs one process per setting and prints the
batch-1 / 32k / batch-8 figures side by side. H200, 17:16 UTC (kern2@c926010): GEMV_MAX_K,
DECODE_PREFETCH, DECODE_MIN_SPLIT and GRAPH_GREEDY together against all four off,
decode-only tok/s: batch 1 at 128 context 1,043 -> 1,172, batch 8 6,241 -> 6,623, batch 1
at 32k 513 -> 596. GRAPH_GREEDY was off for a while: an engine with it hit an out-of-bounds
index on the device (a sampled step's padding rows read another bucket's inputs; fixed by one
input layout for every bucket). H200, 20:45 UTC: 81 GPU tests pass with it on; against it off,
1,173 vs 1,140 / 6,613 vs 6,486 / 597 vs 590. LATE_TRIGGER (1,166 / 6,608 / 594), SILU_TILE
(1,134 / 6,612 / 586) and WIDE (1,171 / 5,405 / 597) measured no better than the defaults in
the same run and stay off.

- MINIVLLM_GEMV_MAX_K (2048 | 4096): the widest K tile of a one-row GEMV. With 4096,
  a projection with K <= 4096 (Qwen3's down: K = 3072) is one tile, so its weights are
  loaded before the PDL wait, while the kernel before it runs.
- MINIVLLM_GEMV_SILU_TILE (4096 | 8192): elements of each of the one-row gate_up GEMV's two
  weight tiles (8192: half as many programs, 8 warps each). Under PDL a kernel's programs
  wait beside the previous kernel's, so how many fit decides how much of its weights load
  early.
- MINIVLLM_GEMV_WIDE (0 | 1): batches of 2-8 rows take the GEMV for every projection but the
  LM head (cuBLAS measured faster for the wide ones alone, but without them the layer's
  norms and SiLU are separate launches again: eight a layer instead of five).
- MINIVLLM_DECODE_PREFETCH (0 | 1): decode attention loads its first K/V tile before the
  PDL wait (the cache is not written by the kernels before it) and splices the new token
  in from registers.
- MINIVLLM_DECODE_TILE (128x4x2 | ...): BLOCK_N x warps x stages of the 16-bit decode
  attention's tiles; MINIVLLM_DECODE_SHORT_TILE (128x8x2 | ...) those of the short launch
  (DECODE_SHORT), where one program per KV head makes latency, not bandwidth, the cost.
- MINIVLLM_DECODE_LOADED_TILE (64x4x2 | ...) and MINIVLLM_DECODE_LOADED_TILE_FP8 (128x4x2 |
  ...): the tiles of a launch of several waves (more than 2 programs an SM), which also
  skips DECODE_PREFETCH: the tile it holds in registers through the prologue cost programs
  resident per SM. H100, Qwen3-0.6B heads, the launch alone at 256 sequences x 512
  positions (scripts/decode_attn_sweep.py; read ceiling 2,971 GB/s): bf16 N128 w4 s2
  with prefetch 208.9 us, without 194.3, N64 w4 s2 without 192.4 (2,791 GB/s), N32 206.3;
  fp8 (PTX upcast) N128 without prefetch 119.7 us (2,243 GB/s), N64 126.8, N32 151.5,
  N128 with prefetch 169.7. At 64 x 2048 the same order (bf16 N64 193.0, N32 190.9).
- MINIVLLM_DECODE_MIN_SPLIT (0 | 128 | 256 | 512 | 1024): context positions a decode split
  takes at least in an engine's steps (0: one tile, the kernels' own default); a context
  up to that length is one program per KV head that writes its output directly (no
  partials, no merge). H200, 2026-12-04, batch 1 at 128 / 512 / 2k / 32k and batch 8 at
  128: 512 gave 1,293 / 1,003 / 975 / 599 / 6,755 tok/s, 256 1,294 / 1,142 / 1,119 / 599 /
  6,767, 128 1,162 / 1,183 / 1,188 / 599 / 5,948 (there 128-256 contexts lost the short
  launch, which DECODE_SHORT now keeps apart): 128 since.
- MINIVLLM_DECODE_LATE_TRIGGER (0 | 4096): with PDL, decode attention over a context longer
  than this lets the next kernel launch only after its K/V loop (0: at its start). Long
  contexts run the split kernel in two waves; the o projection's waiting programs would
  take room from the second.
- MINIVLLM_DECODE_SHORT (0 | 128 | 256 | 512 | 1024): steps whose longest context is at
  most this many positions launch decode attention with one split (num_seqs x KV heads
  programs, DECODE_SHORT_TILE's tiles) instead of the bucket's split count; 0: never.
  Decode graphs are captured for both launches. With the bucket's tiles and contexts up
  to DECODE_MIN_SPLIT, the result is the same bit for bit. H200, 2026-12-03 22:00 UTC,
  with the bucket's tiles: 1,174 vs 1,172 / 6,507 vs 6,602 / 596 vs 596, no gain (the
  attention kept ~9.6 us a layer at 128 positions with 8 programs as with 256).
  2026-12-04 16:40 UTC, with its own tiles (N128 w8): batch 1 at 128 1,291 vs 1,171,
  batch 8 6,749 vs 6,583, 32k 598 vs 599; at 512 positions the one program per KV head
  lost to splits of 256 (1,003 vs 1,142 tok/s): up to 256 positions since.
- MINIVLLM_GRAPH_GREEDY (0 | 1): the decode
  CUDA graphs also take the previous step's tokens as input and produce the greedy tokens,
  so an all-greedy decode step is two host-to-device copies, one replay and one copy back
  (engine side: cuda_graph.py).
"""

from __future__ import annotations

import functools
import os


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


@functools.cache
def gemv_max_k_tile() -> int:
    return int(_choice("MINIVLLM_GEMV_MAX_K", "4096", ("2048", "4096")))


@functools.cache
def gemv_silu_tile() -> int:
    return int(_choice("MINIVLLM_GEMV_SILU_TILE", "4096", ("4096", "8192")))


@functools.cache
def gemv_wide() -> bool:
    return _choice("MINIVLLM_GEMV_WIDE", "0", ("0", "1")) == "1"


@functools.cache
def decode_prefetch() -> bool:
    return _choice("MINIVLLM_DECODE_PREFETCH", "1", ("0", "1")) == "1"


@functools.cache
def decode_min_split() -> int:
    return int(_choice("MINIVLLM_DECODE_MIN_SPLIT", "128", ("0", "128", "256", "512", "1024")))


DECODE_TILES = ("128x4x2", "128x4x1", "128x8x1", "128x8x2", "64x4x1", "64x4x2", "64x4x3",
                "64x8x1", "32x4x1", "32x4x2")


def _tile(name: str, default: str) -> tuple[int, int, int]:
    block_n, warps, stages = _choice(name, default, DECODE_TILES).split("x")
    return int(block_n), int(warps), int(stages)


@functools.cache
def decode_tile() -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) of the 16-bit decode attention's tiles."""
    return _tile("MINIVLLM_DECODE_TILE", "128x4x2")


@functools.cache
def decode_loaded_tile(kv_fp8: bool = False) -> tuple[int, int, int]:
    """The same for launches of several waves (decode_attention.is_loaded), per KV dtype."""
    if kv_fp8:
        return _tile("MINIVLLM_DECODE_LOADED_TILE_FP8", "128x4x2")
    return _tile("MINIVLLM_DECODE_LOADED_TILE", "64x4x2")


@functools.cache
def decode_short_tile() -> tuple[int, int, int]:
    """The same for the engine's short launch (DECODE_SHORT)."""
    return _tile("MINIVLLM_DECODE_SHORT_TILE", "128x8x2")


@functools.cache
def decode_late_trigger() -> int:
    return int(_choice("MINIVLLM_DECODE_LATE_TRIGGER", "0", ("0", "4096")))


@functools.cache
def decode_short_max() -> int:
    return int(_choice("MINIVLLM_DECODE_SHORT", "256", ("0", "128", "256", "512", "1024")))


@functools.cache
def graph_greedy() -> bool:
    return _choice("MINIVLLM_GRAPH_GREEDY", "1", ("0", "1")) == "1"


def clear() -> None:
    """Forget the values read (tests that change the environment)."""
    for fn in (gemv_max_k_tile, gemv_silu_tile, gemv_wide, decode_prefetch, decode_min_split,
               decode_tile, decode_loaded_tile, decode_short_tile, decode_late_trigger,
               decode_short_max, graph_greedy):
        fn.cache_clear()
