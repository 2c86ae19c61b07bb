"""Every `MINIVLLM_*` environment variable minivllm reads, with its meaning, read only here.

A variable with `choices` must hold one of them; a wrong value is a ValueError naming the
variable. The decode-path switches (`minivllm.kernels.tuning`) keep their value for the
life of the process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    meaning: str
    choices: tuple[str, ...] | None = None


_SPLIT_LENGTHS = ("0", "128", "256", "512", "1024")
DECODE_TILES = ("128x4x2", "128x4x1", "128x8x1", "128x8x2", "64x4x1", "64x4x2", "64x4x3",
                "64x8x1", "32x4x1", "32x4x2")
PREFILL_TILES = ("64x64x4x2", "64x64x4x3", "128x32x4x3", "128x32x4x4", "128x64x4x2",
                 "128x64x4x3", "128x64x4x4", "128x64x8x3", "128x128x4x3", "128x128x8x2",
                 "128x128x8x3", "256x64x8x3", "256x128x8x2")

VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    # Where files go.
    EnvVar("MINIVLLM_CACHE", None,
           "folder of the GGUF checkpoints converted once and the CPU's packed weights "
           "(default: $XDG_CACHE_HOME/minivllm, else ~/.cache/minivllm; `minivllm cache` "
           "lists, prunes and clears it)"),
    EnvVar("MINIVLLM_DATA_DIR", None,
           "the chat app's sessions and exports (default: $XDG_DATA_HOME/minivllm, else "
           "~/.local/share/minivllm)"),
    # The CPU path.
    EnvVar("MINIVLLM_CPU_STEP", "native",
           "the CPU decode step: native (every layer in one C++ call), compiled (inductor) "
           "or eager (the model's forward); where one is unavailable the next one runs",
           ("native", "compiled", "eager")),
    EnvVar("MINIVLLM_CPU_COMPILE", "1",
           "0: never compile with inductor (the test suite: compiling costs seconds an "
           "engine)", ("0", "1")),
    EnvVar("MINIVLLM_VERBOSE_BUILD", "0",
           "1: show the compiler's output while the CPU kernels build", ("0", "1")),
    EnvVar("MINIVLLM_TRITON", "0",
           "1: import Triton on a CPU build of torch too, and with TRITON_INTERPRET=1 run "
           "the Triton kernels on the CPU under Triton's interpreter (slow; kernel tests)",
           ("0", "1")),
    # The GPU decode path: each default is the faster setting where they differed.
    EnvVar("MINIVLLM_PDL", "all",
           "which kernels launch with programmatic dependent launch: all (the GEMVs and the "
           "attention path), 1 (the GEMVs), 0 (none)", ("0", "1", "all")),
    EnvVar("MINIVLLM_GEMV_MAX_K", "4096",
           "widest K tile of a one-row GEMV: with 4096, a projection with K <= 4096 is one "
           "tile whose weights load before the PDL wait", ("2048", "4096")),
    EnvVar("MINIVLLM_GEMV_SILU_TILE", "4096",
           "elements of each of the one-row gate_up GEMV's two weight tiles (8192: half as "
           "many programs, 8 warps each)", ("4096", "8192")),
    EnvVar("MINIVLLM_GEMV_WIDE", "0",
           "1: batches of 2-8 rows take the GEMV for every projection but the LM head",
           ("0", "1")),
    EnvVar("MINIVLLM_DECODE_PREFETCH", "1",
           "1: decode attention loads its first K/V tile before the PDL wait and splices the "
           "new token in from registers", ("0", "1")),
    EnvVar("MINIVLLM_DECODE_MIN_SPLIT", "128",
           "context positions a decode split takes at least in an engine's steps (0: one "
           "tile); a context up to this length is one program per KV head", _SPLIT_LENGTHS),
    EnvVar("MINIVLLM_DECODE_MAX_SPLITS", "32",
           "most splits a decode launch divides each context into (a batch-1 step at a long "
           "context takes them all)", ("16", "32", "64", "128")),
    EnvVar("MINIVLLM_DECODE_TILE", "128x4x2",
           "BLOCK_N x warps x stages of the 16-bit decode attention's tiles", DECODE_TILES),
    EnvVar("MINIVLLM_DECODE_SHORT_TILE", "128x8x2",
           "the same for the short launch (MINIVLLM_DECODE_SHORT)", DECODE_TILES),
    EnvVar("MINIVLLM_DECODE_LOADED_TILE", "64x4x2",
           "the same for a launch of several waves (more than 2 programs an SM), which also "
           "skips MINIVLLM_DECODE_PREFETCH (the tile held through the prologue cost "
           "programs resident per SM)", DECODE_TILES),
    EnvVar("MINIVLLM_DECODE_LOADED_TILE_FP8", "128x4x2",
           "the same with an fp8 KV cache", DECODE_TILES),
    EnvVar("MINIVLLM_DECODE_LOADED_REGS_FP8", "128",
           "registers a thread the fp8 loaded launch is compiled under (0: the compiler's "
           "choice); fewer let more programs share an SM, at the cost of spills",
           ("0", "72", "80", "88", "96", "104", "112", "120", "128")),
    EnvVar("MINIVLLM_DECODE_FP8_V_WORDS", "light",
           "which decode launches load an fp8 cache's V tiles as 32-bit words and upcast "
           "them before the products' layout change: 0 none, 1 all, light those of at most "
           "two programs an SM but the short launch (MINIVLLM_DECODE_SHORT)",
           ("0", "1", "light")),
    EnvVar("MINIVLLM_DECODE_ONE_PAGE", "1",
           "1: where a cache page holds whole tiles, decode attention reads one block-table "
           "entry a K/V tile (consecutive slots) instead of one a position", ("0", "1")),
    EnvVar("MINIVLLM_PREFILL_TILE", "128x64x4x3",
           "BLOCK_M x BLOCK_N x warps x stages of the 16-bit prefill attention's tiles",
           PREFILL_TILES),
    EnvVar("MINIVLLM_PREFILL_SMALL", "2048",
           "prefill steps of at most this many tokens take MINIVLLM_PREFILL_SMALL_TILE "
           "(more, shorter programs; 0: never)", ("0", "1024", "2048", "4096")),
    EnvVar("MINIVLLM_PREFILL_SMALL_TILE", "64x64x4x3",
           "the prefill tiles of MINIVLLM_PREFILL_SMALL's steps", PREFILL_TILES),
    EnvVar("MINIVLLM_PREFILL_TMA", "1",
           "1: prefill attention loads K/V tiles through TMA descriptors on Hopper and "
           "later (where BLOCK_N divides the KV block)", ("0", "1")),
    EnvVar("MINIVLLM_PREFILL_LAST_FIRST", "1",
           "1: prefill attention's last query tiles (the longest rows) start first",
           ("0", "1")),
    EnvVar("MINIVLLM_DECODE_SHORT", "256",
           "steps whose longest context is at most this many positions launch decode "
           "attention with one split, one program per sequence and KV head (0: never)",
           _SPLIT_LENGTHS),
    EnvVar("MINIVLLM_DECODE_LATE_TRIGGER", "0",
           "with PDL, decode attention over a context longer than this lets the next kernel "
           "launch only after its K/V loop (0: at its start)", ("0", "4096")),
    EnvVar("MINIVLLM_GRAPH_GREEDY", "1",
           "1: the decode CUDA graphs take the previous step's tokens and pick the step's "
           "tokens, greedy or at a plain temperature (such a step is one replay and three "
           "copies)", ("0", "1")),
)}


def read(name: str) -> str | None:
    """The variable's value, its default when unset; checked against its choices."""
    var = VARIABLES[name]  # an undeclared name is a KeyError: declare it above first
    value = os.environ.get(name) or var.default
    if var.choices is not None and value not in var.choices:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(var.choices)}")
    return value


# OpenMP's threads (torch's CPU ops and the CPU kernels) spin at each barrier before they
# sleep: by default for 300,000 turns, which on a machine whose cores are busy with other
# work (the chat app's own thread, another process) holds a core that the thread being
# waited for needs. A sixth of that keeps an idle machine's decode speed and gives a busy
# one back part of what spinning took; sleeping at once (OMP_WAIT_POLICY=passive) halves
# an idle machine's batch-1 decode.
OPENMP_SPIN_TURNS = "50000"


def default_openmp_waits() -> None:
    """The command lines' OpenMP waits (`OPENMP_SPIN_TURNS`), unless the user chose theirs
    (OMP_WAIT_POLICY or GOMP_SPINCOUNT). Call before torch is imported: OpenMP reads them
    once, as it loads."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_TURNS
