"""Decode attention alone at a loaded step's shapes, per KV dtype and tile / grid choice:
microseconds a launch (median) and GB/s on the K/V bytes it must read, against a
read-bandwidth ceiling measured first. The engine's launch (`qkv_decode_attention`: q/k
norm + rotary + store), Qwen3-0.6B's heads, blocks of 256.

    python3 scripts/decode_attn_sweep.py [--shape 256x512 --shape 64x2048] [--quick]
        [--maxnreg 96 80] [--graphs] [--splits 16 32 64 128] [--v-words] [--one-page]

`--maxnreg`: the engine's tiles again with each register cap a thread (more programs an
SM, some registers spilled; `scripts/decode_attn_resources.py` prints both without a GPU).
`--splits`: the engine's launch again with each split count a (sequence, KV head) forced
(its tiles and prefetch as the engine picks them for that count).
`--v-words`: fp8 only, the engine's loaded tile and the 64-position ones with V loaded as
32-bit words and upcast before the products' layout change (FP8_V_WORDS).
`--one-page`: the engine's launch again with one block-table entry a tile
(MINIVLLM_DECODE_ONE_PAGE=1); for fp8 also with its loaded launch capped at 128 registers
(4 programs an SM where the compiler would take 168), and with `--v-words` also with V as
words (MINIVLLM_DECODE_FP8_V_WORDS=1): the engine's own tiles and prefetch choice each time.
`--graphs`: each launch timed as a CUDA-graph replay after an L2 flush (the flush's own
replay subtracted) instead of `do_bench`'s eager launches, whose host time (~55 us a
launch on an H100) hides a batch-1 launch: every tile read 55-57 us at 1 x 8192.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 256
TILES = [(128, 4, 2), (64, 4, 2), (64, 4, 3), (32, 4, 2)]


def ceilings() -> tuple[float, float]:
    """GB/s of a large device read (a sum) and of a copy (bytes read + written)."""
    from triton.testing import do_bench

    x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    t_sum = do_bench(lambda: x.sum(dtype=torch.float32), warmup=50, rep=300,
                     return_mode="median")
    t_copy = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return nbytes / t_sum / 1e6, 2 * nbytes / t_copy / 1e6


def graph_us(run, flush: torch.Tensor, reps: int = 50) -> float:
    """Median microseconds of `run` in a CUDA graph replayed after zeroing `flush` (larger
    than L2, so the launch reads K/V from memory as in a step), less the flush's own."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # captures need a warmed-up launch
    torch.cuda.current_stream().wait_stream(side)
    flushed, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(flush_only):
        flush.zero_()
    with torch.cuda.graph(flushed):
        flush.zero_()
        run()
    from minivllm.kernels.testing import replay_ms

    replay_ms(flushed, reps)  # warm-up
    return 1e3 * (replay_ms(flushed, reps) - replay_ms(flush_only, reps))


def make_inputs(num_seqs: int, context: int, kv_dtype: torch.dtype):
    from minivllm.kernels.store_kvcache import quantize_kv
    from minivllm.kernels.testing import cos_sin_table, paged_kv, qk_norm_weights

    cache = paged_kv([context] * num_seqs, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16, "cuda")
    cache.k_cache = quantize_kv(cache.k_cache * 3, kv_dtype, 1.0)
    cache.v_cache = quantize_kv(cache.v_cache, kv_dtype, 1.0)
    table = cos_sin_table(context + 16, HEAD_DIM, device="cuda")
    norms = qk_norm_weights(HEAD_DIM, torch.bfloat16, "cuda")
    qkv = torch.randn(num_seqs, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda").bfloat16()
    positions = (cache.seq_lens - 1).long()
    rows = torch.arange(num_seqs, device="cuda")
    slots = (cache.block_tables[rows, positions // BLOCK].long() * BLOCK + positions % BLOCK)
    return cache, table, norms, qkv, positions, slots


def variants(fp8: bool, tiles: list[tuple[int, int, int]],
             maxnregs: list[int] = (), v_words: bool = False,
             one_page: bool = False) -> list[dict | None]:
    """The engine's default launch (None), then tiles x first tile prefetched or not; for
    fp8 the upcast too: inline PTX or Triton's to fp16 (every tile), Triton's to bf16 (the
    first tile, prefetched: the kernel before this change); then the engine's loaded
    tiles under each register cap in `maxnregs`. An "env" entry: the engine's launch under
    those switches."""
    from minivllm.kernels.decode_attention import _tile_config

    out: list[dict | None] = [None]
    if one_page:
        switches = [{"MINIVLLM_DECODE_ONE_PAGE": "0"}]
        if fp8:
            switches.append(dict(switches[0], MINIVLLM_DECODE_LOADED_REGS_FP8="0",
                                 MINIVLLM_DECODE_FP8_V_WORDS="0"))
            switches.append({"MINIVLLM_DECODE_LOADED_REGS_FP8": "0"})
        if fp8 and v_words:
            switches += [{"MINIVLLM_DECODE_FP8_V_WORDS": words} for words in ("0", "1")]
        out += [dict(env=env) for env in switches]
    for cap in maxnregs:
        engine = _tile_config(torch.bfloat16, loaded=True, kv_fp8=fp8)
        out.append(dict(engine, FP8_AS_F16=fp8, FP8_ASM=fp8, prefetch=False, maxnreg=cap))
    if fp8 and v_words:
        engine = _tile_config(torch.bfloat16, loaded=True, kv_fp8=True)
        engine_tile = (engine["BLOCK_N"], engine["num_warps"], engine["num_stages"])
        for block_n, warps, stages in dict.fromkeys([engine_tile, (64, 4, 2), (64, 4, 3)]):
            out.append(dict(engine, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                            FP8_AS_F16=True, FP8_ASM=True, FP8_V_WORDS=True, prefetch=False))
    upcasts = [(True, True), (True, False)] if fp8 else [(False, False)]
    for prefetch, (f16, asm), (block_n, warps, stages) in itertools.product(
            (True, False), upcasts, tiles):
        out.append(dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                        DOT_PRECISION="tf32", FP8_AS_F16=f16, FP8_ASM=asm, prefetch=prefetch))
    if fp8 and tiles:
        block_n, warps, stages = TILES[0]
        out.append(dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                        DOT_PRECISION="tf32", FP8_AS_F16=False, FP8_ASM=False, prefetch=True))
    return out


def describe(config: dict | None, fp8: bool) -> str:
    if config is None:
        return f"{'fp8' if fp8 else 'bf16'} engine default"
    if "num_splits" in config:
        return f"{'fp8' if fp8 else 'bf16'} engine, {config['num_splits']} splits"
    if "env" in config:
        short = {"MINIVLLM_DECODE_ONE_PAGE": "1p=", "MINIVLLM_DECODE_FP8_V_WORDS": "v-words=",
                 "MINIVLLM_DECODE_LOADED_REGS_FP8": "r"}
        return f"{'fp8' if fp8 else 'bf16'} engine, " + " ".join(
            short[name] + value for name, value in config["env"].items())
    upcast = ""
    if fp8:
        upcast = "/asm" if config["FP8_ASM"] else "/f16" if config["FP8_AS_F16"] else "/bf16"
    cap = f" r{config['maxnreg']}" if "maxnreg" in config else ""
    cap += " v-words" if config.get("FP8_V_WORDS") else ""
    return (f"{'fp8' if fp8 else 'bf16'}{upcast} N{config['BLOCK_N']} "
            f"w{config['num_warps']} s{config['num_stages']}{cap}"
            f"{' prefetch' if config['prefetch'] else ''}")


@contextlib.contextmanager
def switches(env: dict[str, str]):
    """The decode switches (minivllm/envs.py) set to `env` for the calls inside."""
    from minivllm.kernels import tuning

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    tuning.clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
        tuning.clear()


def sweep(shape: str, kv_dtype: torch.dtype, tiles: list, read_gbs: float,
          maxnregs: list[int] = (), graphs: bool = False,
          splits: list[int] = (), v_words: bool = False,
          one_page: bool = False) -> list[tuple]:
    from triton.testing import do_bench

    from minivllm.kernels.decode_attention import (
        decode_attention_ref,
        decode_counters,
        qkv_decode_attention,
    )
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store_ref
    from minivllm.kernels.store_kvcache import FP8_KV_DTYPE, dequantize_kv
    from minivllm.kernels.testing import rel_err

    num_seqs, context = (int(v) for v in shape.lower().split("x"))
    cache, table, norms, qkv, positions, slots = make_inputs(num_seqs, context, kv_dtype)
    k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
    q = qkv_rotary_store_ref(positions, qkv, HEADS, table, k_ref, v_ref, slots,
                             norms["q_norm_weight"], norms["k_norm_weight"], 1e-6)
    want = decode_attention_ref(q.float(), dequantize_kv(k_ref, torch.float32, 1.0),
                                dequantize_kv(v_ref, torch.float32, 1.0),
                                cache.seq_lens, cache.block_tables, HEAD_DIM**-0.5)
    del k_ref, v_ref
    counters = decode_counters(num_seqs, KV_HEADS, "cuda")
    nbytes = num_seqs * context * 2 * KV_HEADS * HEAD_DIM * cache.k_cache.element_size()
    fp8 = kv_dtype == FP8_KV_DTYPE
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if graphs else None
    rows = []
    for config in [dict(num_splits=n) for n in splits] + variants(fp8, tiles, maxnregs,
                                                                  v_words, one_page):
        kwargs = {}
        env = {}
        if config is not None and "env" in config:
            env = config["env"]
        elif config is not None and "num_splits" in config:
            kwargs = dict(config)
        elif config is not None:
            tile_config = dict(config)
            kwargs = dict(prefetch=tile_config.pop("prefetch"), tile_config=tile_config)

        def run(kwargs=kwargs, env=env):
            with switches(env):
                return qkv_decode_attention(
                    positions, qkv, HEADS, table, cache.k_cache, cache.v_cache, slots,
                    cache.seq_lens, cache.block_tables, HEAD_DIM**-0.5,
                    norms["q_norm_weight"], norms["k_norm_weight"], 1e-6,
                    counters=counters, min_split_len=128, check=False, **kwargs)

        name = describe(config, fp8)
        try:
            err = rel_err(run(), want)
            if flush is not None:
                ms = graph_us(run, flush) / 1e3
            else:
                ms = do_bench(run, warmup=25, rep=150, return_mode="median")
        except Exception as exc:  # a tile that does not fit (shared memory)
            print(f"{shape} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        gbs = nbytes / ms / 1e6
        rows.append((shape, name, ms * 1e3, gbs, err))
        print(f"{shape:9} {name:36} {ms * 1e3:8.1f} us {gbs:7,.0f} GB/s "
              f"{100 * gbs / read_gbs:5.1f}% err {err:.1e}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", default=[], metavar="BATCHxCONTEXT")
    p.add_argument("--quick", action="store_true", help="the first tiles only")
    p.add_argument("--engine-only", action="store_true",
                   help="the engine's launch only, no other tiles (with Nsight Compute)")
    p.add_argument("--kv-dtype", choices=["bf16", "fp8", "both"], default="both")
    p.add_argument("--maxnreg", type=int, nargs="+", default=[], metavar="REGISTERS",
                   help="also the engine's loaded tiles capped at these registers a thread")
    p.add_argument("--splits", type=int, nargs="+", default=[], metavar="SPLITS",
                   help="also the engine's launch with these split counts (powers of two)")
    p.add_argument("--v-words", action="store_true",
                   help="also fp8 tiles whose V is loaded as 32-bit words (FP8_V_WORDS)")
    p.add_argument("--one-page", action="store_true",
                   help="also the engine's launch with one block-table entry a tile")
    p.add_argument("--graphs", action="store_true",
                   help="time CUDA-graph replays after an L2 flush, not eager launches")
    args = p.parse_args()
    from minivllm.kernels.store_kvcache import FP8_KV_DTYPE

    torch.manual_seed(0)
    read_gbs, copy_gbs = ceilings()
    print(f"{torch.cuda.get_device_name()}: read {read_gbs:,.0f} GB/s (sum), "
          f"copy {copy_gbs:,.0f} GB/s (read + write)", flush=True)
    tiles = [] if args.engine_only else TILES[:2] if args.quick else TILES
    kv_dtypes = {"bf16": [torch.bfloat16], "fp8": [FP8_KV_DTYPE],
                 "both": [torch.bfloat16, FP8_KV_DTYPE]}[args.kv_dtype]
    rows = []
    for shape in args.shape or ["256x512", "64x2048"]:
        for kv_dtype in kv_dtypes:
            rows += sweep(shape, kv_dtype, tiles, read_gbs, args.maxnreg, args.graphs,
                          args.splits, args.v_words, args.one_page)
            torch.cuda.empty_cache()
    print(f"\n== decode attention alone ({torch.cuda.get_device_name()}; read ceiling "
          f"{read_gbs:,.0f} GB/s) ==")
    for shape, name, us, gbs, err in sorted(rows, key=lambda r: (r[0], r[1][:3], r[2])):
        print(f"{shape:9} {name:36} {us:8.1f} us {gbs:7,.0f} GB/s "
              f"{100 * gbs / read_gbs:5.1f}% err {err:.1e}")


if __name__ == "__main__":
    main()
