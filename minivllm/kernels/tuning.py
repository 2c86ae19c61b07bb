"""Decode-path switches, read once per process from the environment.

Each switch names a choice that only a measurement on the GPU settles; the default is the
setting that measured faster (`scripts/decode_ab.py` runs one process per setting and
prints decode tok/s at batch 1 and 8 and at a 32k context side by side). Their meanings
are declared with the other variables in `minivllm.envs`: MINIVLLM_GEMV_MAX_K,
MINIVLLM_GEMV_SILU_TILE, MINIVLLM_GEMV_WIDE, MINIVLLM_DECODE_PREFETCH,
MINIVLLM_DECODE_MIN_SPLIT, MINIVLLM_DECODE_MAX_SPLITS, MINIVLLM_DECODE_TILE,
MINIVLLM_DECODE_LOADED_TILE(_FP8), MINIVLLM_DECODE_LOADED_REGS_FP8,
MINIVLLM_DECODE_FP8_V_WORDS, MINIVLLM_DECODE_ONE_PAGE,
MINIVLLM_DECODE_SHORT_TILE, MINIVLLM_PREFILL_TILE,
MINIVLLM_PREFILL_SMALL(_TILE), MINIVLLM_PREFILL_TMA, MINIVLLM_PREFILL_LAST_FIRST,
MINIVLLM_DECODE_SHORT, MINIVLLM_DECODE_LATE_TRIGGER and MINIVLLM_GRAPH_GREEDY.

With the short launch's own tiles and contexts up to DECODE_MIN_SPLIT, DECODE_SHORT gives
the same result bit for bit as the bucket's launch; decode graphs are captured for both.
GRAPH_GREEDY puts the LM head and the token pick (greedy or at a plain temperature)
inside the decode graphs (engine side: cuda_graph.py).
"""

from __future__ import annotations

import functools

from ..envs import read


def _choice(name: str) -> str:
    value = read(name)
    assert value is not None  # every switch has a default
    return value


@functools.cache
def gemv_max_k_tile() -> int:
    return int(_choice("MINIVLLM_GEMV_MAX_K"))


@functools.cache
def gemv_silu_tile() -> int:
    return int(_choice("MINIVLLM_GEMV_SILU_TILE"))


@functools.cache
def gemv_wide() -> bool:
    return _choice("MINIVLLM_GEMV_WIDE") == "1"


@functools.cache
def decode_prefetch() -> bool:
    return _choice("MINIVLLM_DECODE_PREFETCH") == "1"


@functools.cache
def decode_min_split() -> int:
    return int(_choice("MINIVLLM_DECODE_MIN_SPLIT"))


@functools.cache
def decode_max_splits() -> int:
    return int(_choice("MINIVLLM_DECODE_MAX_SPLITS"))


def _tile(name: str) -> tuple[int, ...]:
    """A tile switch's 'AxBx...' sizes, as integers."""
    return tuple(int(x) for x in _choice(name).split("x"))


@functools.cache
def decode_tile() -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) of the 16-bit decode attention's tiles."""
    return _tile("MINIVLLM_DECODE_TILE")


@functools.cache
def decode_loaded_tile(kv_fp8: bool = False) -> tuple[int, int, int]:
    """The same for launches of several waves (decode_attention.is_loaded), per KV dtype."""
    if kv_fp8:
        return _tile("MINIVLLM_DECODE_LOADED_TILE_FP8")
    return _tile("MINIVLLM_DECODE_LOADED_TILE")


@functools.cache
def decode_loaded_regs_fp8() -> int:
    """Register cap a thread of the fp8 loaded launch (0: none)."""
    return int(_choice("MINIVLLM_DECODE_LOADED_REGS_FP8"))


@functools.cache
def decode_fp8_v_words(loaded: bool, short: bool = False) -> bool:
    """Whether a launch loads fp8 V as words: `loaded` as decode_attention.is_loaded says,
    `short` the engine's short launch (MINIVLLM_DECODE_SHORT)."""
    choice = _choice("MINIVLLM_DECODE_FP8_V_WORDS")
    return choice == "1" or (choice == "light" and not loaded and not short)


@functools.cache
def decode_one_page() -> bool:
    return _choice("MINIVLLM_DECODE_ONE_PAGE") == "1"


@functools.cache
def decode_short_tile() -> tuple[int, int, int]:
    """The same for the engine's short launch (DECODE_SHORT)."""
    return _tile("MINIVLLM_DECODE_SHORT_TILE")


def prefill_tile(num_tokens: int = 0) -> dict:
    """The 16-bit prefill attention's tiles and loads (kernels/prefill_attention.py) for a
    step of `num_tokens` query rows (0: the large steps' tiles)."""
    small = 0 < num_tokens <= prefill_small_max()
    return _prefill_tiles("MINIVLLM_PREFILL_SMALL_TILE" if small else "MINIVLLM_PREFILL_TILE")


@functools.cache
def prefill_small_max() -> int:
    return int(_choice("MINIVLLM_PREFILL_SMALL"))


@functools.cache
def _prefill_tiles(name: str) -> dict:
    block_m, block_n, warps, stages = _tile(name)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                TMA=_choice("MINIVLLM_PREFILL_TMA") == "1",
                LAST_FIRST=_choice("MINIVLLM_PREFILL_LAST_FIRST") == "1")


@functools.cache
def decode_late_trigger() -> int:
    return int(_choice("MINIVLLM_DECODE_LATE_TRIGGER"))


@functools.cache
def decode_short_max() -> int:
    return int(_choice("MINIVLLM_DECODE_SHORT"))


@functools.cache
def graph_picks() -> bool:
    return _choice("MINIVLLM_GRAPH_GREEDY") == "1"


def clear() -> None:
    """Forget the values read (tests that change the environment)."""
    for fn in (gemv_max_k_tile, gemv_silu_tile, gemv_wide, decode_prefetch, decode_min_split,
               decode_max_splits, decode_tile, decode_loaded_tile, decode_loaded_regs_fp8,
               decode_fp8_v_words, decode_one_page, decode_short_tile, decode_late_trigger,
               decode_short_max, graph_picks, _prefill_tiles, prefill_small_max):
        fn.cache_clear()
