"""Registers, spilled bytes and shared memory of decode attention's loaded launch for an
H100/H200 (sm_90), per tile and register cap, and the programs an SM holds with them:
compiled by Triton and read from the binary by cuobjdump, no GPU needed.

    MINIVLLM_TRITON=1 python scripts/decode_attn_resources.py [--maxnreg 96 80] [--v-words]

The kernel as the engine launches it at a loaded step: q/k norm + rotary + store in its
prologue, one split, no prefetched tile, Qwen3-0.6B's heads, blocks of 256. The figures
are the installed Triton's: versions allocate differently (fp8, 128x4x2: 130 registers
and 3 programs an SM with Triton 3.9; Nsight Compute read 4 programs an SM on an H100 with
Triton 3.6), so run it beside the Triton that runs the kernels (`pip install --target DIR
triton==3.6.0`, then DIR first on PYTHONPATH, gives the H100 host's). Each row ends with the
SASS instructions of the K/V loop (one tile). `--v-words`: the fp8 rows again with V loaded
as 32-bit words (FP8_V_WORDS); `--one-page`: every row again with one block-table entry a
tile (ONE_PAGE).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

TILES = [(128, 4, 2), (128, 4, 1), (64, 4, 2), (64, 4, 1), (64, 8, 1), (32, 4, 2), (32, 4, 1)]
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024  # of which each program also takes 1 KB reserved
MAX_WARPS_PER_SM = 64


def compile_decode_attention(fp8: bool, block_n: int, warps: int, stages: int,
                             maxnreg: int | None, v_words: bool = False,
                             one_page: bool = False):
    from minivllm.kernels.decode_attention import _decode_attention_kernel as kernel
    from minivllm.kernels.testing import compile_sm90

    kv = "*fp8e4nv" if fp8 else "*bf16"
    types = {name: "*fp32" for name in kernel.arg_names if name.endswith("_ptr")}
    types.update(q_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv, out_ptr="*bf16",
                 block_tables_ptr="*i32", seq_lens_ptr="*i32", counters_ptr="*i32",
                 positions_ptr="*i64", slot_mapping_ptr="*i64", q_norm_ptr="*bf16",
                 k_norm_ptr="*bf16", qk_scale="fp32", eps="fp32", k_scale="fp32",
                 v_scale="fp32")
    constants = dict(GROUP=2, GROUP_PAD=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256,
                     BLOCK_N=block_n, NUM_SPLITS=1, MERGE_CHUNK=1, FROM_QKV=True,
                     QK_NORM=True, DOT_PRECISION="tf32", PDL=True, PREFETCH=False,
                     MIN_SPLIT_LEN=block_n, LATE_TRIGGER=0, KV_FP8=fp8, FP8_AS_F16=fp8,
                     FP8_ASM=fp8, FP8_V_WORDS=v_words, ONE_PAGE=one_page)
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    return compile_sm90(kernel, types, constants, warps, stages, **options)


def cuobjdump(compiled, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def loop_instructions(compiled) -> int:
    """SASS instructions of the kernel's longest loop (the K/V tiles'): from the target
    of the backward branch that spans the most code to that branch."""
    addresses = []
    loops = []
    for line in cuobjdump(compiled, "-sass").splitlines():
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not found:
            continue
        address = int(found.group(1), 16)
        addresses.append(address)
        branch = re.search(r"BRA (0x[0-9a-f]+)", found.group(2))
        if branch and int(branch.group(1), 16) < address:
            loops.append((int(branch.group(1), 16), address))
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return sum(start <= a <= end for a in addresses)


def resources(compiled) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread) from the binary."""
    usage = cuobjdump(compiled, "-res-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert found, usage
    return int(found.group(1)), int(found.group(2))


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Resident programs an SM: registers go out in 256 a warp, shared memory plus 1 KB."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(REGISTERS_PER_SM // (per_warp * warps), SHARED_PER_SM // (shared + 1024),
               MAX_WARPS_PER_SM // warps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--maxnreg", type=int, nargs="+", default=[], metavar="REGISTERS",
                   help="also each tile capped at these registers a thread")
    p.add_argument("--v-words", action="store_true",
                   help="also the fp8 tiles with V loaded as 32-bit words")
    p.add_argument("--one-page", action="store_true",
                   help="also every row with one block-table entry a tile (ONE_PAGE)")
    args = p.parse_args()
    print(f"{'KV':10} {'tile':8} {'cap':>4} {'regs':>5} {'stack B':>8} {'shared B':>9} "
          f"{'programs/SM':>12} {'warps/SM':>9}  loop instr")
    kinds = [(False, False), (True, False)] + ([(True, True)] if args.v_words else [])
    pages = [False, True] if args.one_page else [False]
    for (fp8, v_words), one_page in ((k, o) for o in pages for k in kinds):
        for (block_n, warps, stages), cap in ((t, c) for t in TILES
                                              for c in [None, *args.maxnreg]):
            compiled = compile_decode_attention(fp8, block_n, warps, stages, cap, v_words,
                                                one_page)
            registers, stack = resources(compiled)
            shared = compiled.metadata.shared
            programs = programs_per_sm(registers, shared, warps)
            kv = ("fp8 w" if v_words else "fp8" if fp8 else "bf16") + (" 1p" if one_page else "")
            print(f"{kv:10} {block_n}x{warps}x{stages:<3} "
                  f"{cap or '-':>4} {registers:5} {stack:8} {shared:9} {programs:12} "
                  f"{programs * warps:9} {loop_instructions(compiled):11}", flush=True)


if __name__ == "__main__":
    main()
