"""Micro-benchmark of the Triton kernels at Qwen3-0.6B's shapes (one layer), and of the
few-row GEMV against cuBLAS at the projections of Qwen3-0.6B, Llama-3.2-1B and SmolLM2.

Decode is bound by the K/V bytes it reads, so it is reported as achieved GB/s against the
H200's measured ~4.3 TB/s copy bandwidth; prefill as TFLOP/s. Two decode times:
- eager: do_bench median (it flushes L2 between repeats); includes the host's launch cost,
  which dominates small batches (one Triton launch and the wrapper's checks);
- graph: median replay of a CUDA graph of calls over several copies of the cache (enough to
  overflow the 50 MB L2), per call: the kernels alone, as the engine's decode graphs run them.
GB/s and % are from the graph time.

    python scripts/bench_kernels.py            # default tiles, then a small tile sweep
    python scripts/bench_kernels.py --no-sweep
    python scripts/bench_kernels.py --only decode-fused   # GEMV table, fused ops, 32k decode
    python scripts/bench_kernels.py --only long-decode    # the engine's batch-1 attention, tiles
    python scripts/bench_kernels.py --only decode-latency # ... 128 to 32k, tile shapes;
                                                          # the K/V gather's own ceiling
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from minivllm.kernels.decode_attention import _tile_config as decode_tiles
from minivllm.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_counters,
    qkv_decode_attention,
)
from minivllm.kernels.dispatch import num_sms
from minivllm.kernels.prefill_attention import _tile_config as prefill_tiles
from minivllm.kernels.prefill_attention import prefill_attention
from minivllm.kernels.testing import (
    DECODE_MODELS,
    decode_tile_variants,
    describe_tiles,
    paged_kv,
    prefill_tile_variants,
    projections,
    replay_ms,
)

PEAK_BYTES_PER_S = 4.3e12
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 * 2**20  # K/V touched per graph replay: five times the H200's L2


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(calls: list, reps: int = 30) -> float:
    """Median time per call of a replayed CUDA graph that makes `calls` in turn."""
    for call in calls:  # compile outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    return replay_ms(graph, reps) / len(calls)


def decode_case(
    batch: int, seq_lens: list[int], block_size: int, **kw
) -> tuple[float, float, float]:
    """Returns (eager ms, graph ms, GB/s from the graph time) for one decode-attention call."""
    # K and V of every context position once, plus q and the output.
    kv_bytes = sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
    total = kv_bytes + 2 * batch * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
    copies = min(64, -(-ROTATE_BYTES // kv_bytes))
    kw = dict(kw, counters=decode_counters(batch, NUM_KV_HEADS, "cuda"))  # as an engine does
    calls = []
    for _ in range(copies):
        cache = paged_kv(seq_lens, NUM_KV_HEADS, HEAD_DIM, block_size, DTYPE, "cuda",
                         spare_columns=0)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
        args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, 0.088)
        calls.append(lambda args=args: decode_attention(*args, **kw))
    eager = bench_ms(calls[0])
    graph = graph_ms(calls)
    return eager, graph, total / (graph * 1e-3) / 1e9


def prefill_case(seq_len: int, q_len: int, block_size: int, **kw) -> tuple[float, float]:
    cache = paged_kv([seq_len], NUM_KV_HEADS, HEAD_DIM, block_size, DTYPE, "cuda")
    q = torch.randn(q_len, NUM_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    args = (q, cache.k_cache, cache.v_cache, cu, cache.seq_lens, cache.block_tables, 0.088)
    ms = bench_ms(lambda: prefill_attention(*args, **kw))
    # Causal: each query sees (prefix + its own position) keys; QK^T and PV, 2 FLOP per MAC.
    pairs = sum(seq_len - q_len + i + 1 for i in range(q_len))
    return ms, 4 * pairs * NUM_HEADS * HEAD_DIM / (ms * 1e-3) / 1e12


# -- few-row GEMV, fused decode ops, batch-1 long-context decode ---------------------------

# (model, hidden, heads, kv_heads, head_dim, intermediate, vocab)
def gemv_variants(m: int, n: int, k: int) -> list[dict]:
    """Tiles the sweep tries besides the default (all correct: tests/test_kernels_gpu.py)."""
    from minivllm.kernels.gemv import default_config

    base = default_config(m, n, k, DTYPE)
    if m == 1:
        out = []
        for block_k in (512, 1024, 2048):
            for block_n in (2, 4, 8, 16):
                if block_k > triton.next_power_of_2(k) or block_n * block_k > 32768:
                    continue
                warps = 4 if block_n * block_k <= 8192 else 8
                out.append(dict(base, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps))
        return out
    return [dict(base, BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=w)
            for bn, bk, st, w in ((16, 256, 3, 4), (16, 512, 4, 4), (32, 256, 3, 4),
                                  (16, 1024, 2, 8))]


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Enough copies of an [n, k] weight that a graph of calls over them overflows L2."""
    copies = max(1, min(512, -(-ROTATE_BYTES // (n * k * DTYPE.itemsize))))
    return [(torch.randn(n, k, device="cuda") / k**0.5).to(DTYPE) for _ in range(copies)]


def gemv_time(m: int, weights: list[torch.Tensor], config: dict | None = "cublas") -> float:
    from minivllm.kernels.gemv import gemv

    x = torch.randn(m, weights[0].shape[1], device="cuda").to(DTYPE)
    if config == "cublas":
        calls = [lambda w=w: F.linear(x, w) for w in weights]
    else:
        calls = [lambda w=w: gemv(x, w, config=config) for w in weights]
    return graph_ms(calls)


def gemv_table(sweep: bool) -> None:
    from minivllm.kernels.gemv import default_config

    print(f"\n{'model':14} {'proj':8} {'M':>2} {'N':>7} {'K':>5} {'cuBLAS us':>10} {'GB/s':>6} "
          f"{'triton us':>10} {'GB/s':>6} {'best us':>8} {'GB/s':>6}  best tiles")
    wins = {}
    for model, *dims in DECODE_MODELS:
        for name, n, k in projections(*dims):
            weights = weight_copies(n, k)
            nbytes = n * k * DTYPE.itemsize
            # The engine's model gets every row bucket and the sweep; the others 1 and 8.
            for m in (1, 2, 4, 8) if model == DECODE_MODELS[0][0] else (1, 8):
                cublas = gemv_time(m, weights)
                default = gemv_time(m, weights, None)
                best, best_cfg = default, "default"
                if sweep and model == DECODE_MODELS[0][0]:
                    for cfg in gemv_variants(m, n, k):
                        t = gemv_time(m, weights, cfg)
                        if t < best:
                            best, best_cfg = t, cfg
                wins[(m, n, k)] = best < cublas
                if isinstance(best_cfg, dict):
                    best_cfg = (f"N{best_cfg['BLOCK_N']} K{best_cfg['BLOCK_K']} "
                                f"w{best_cfg['num_warps']} s{best_cfg['num_stages']}"
                                f"{' dot' if best_cfg['USE_DOT'] else ''}")
                print(f"{model:14} {name:8} {m:2d} {n:7d} {k:5d} {cublas * 1e3:10.1f} "
                      f"{nbytes / cublas / 1e6:6.0f} {default * 1e3:10.1f} "
                      f"{nbytes / default / 1e6:6.0f} {best * 1e3:8.1f} "
                      f"{nbytes / best / 1e6:6.0f}  {best_cfg}")
    print("\nMEASURED_WINS = {")
    for (m, n, k), win in wins.items():
        print(f"    ({m}, {n}, {k}): {win},")
    print("}")
    print("default tiles, M=1:", {f"{n}x{k}": default_config(1, n, k, DTYPE)
                                 for _, n, k in projections(*DECODE_MODELS[0][1:])})


def fused_ops_table() -> None:
    """Qwen3-0.6B decode, batch 1 and 8: each fused op against the launches it replaces."""
    print(f"\n{'fused op (qwen3-0.6b)':44} {'M':>2} {'unfused us':>11} {'fused us':>9}")
    for m in (1, 8):
        fused_ops_rows(m)


def fused_ops_rows(m: int) -> None:
    from minivllm.kernels.gemv import rms_norm_gemv
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.rotary import rotary
    from minivllm.kernels.silu_and_mul import silu_and_mul
    from minivllm.kernels.store_kvcache import store_kvcache

    hidden, heads, kv_heads, head_dim, inter = 1024, 16, 8, 128, 3072
    x = torch.randn(m, hidden, device="cuda").to(DTYPE)
    r = torch.randn(m, hidden, device="cuda").to(DTYPE)
    nw = torch.ones(hidden, device="cuda", dtype=DTYPE)

    def unfused(w, silu):
        h, _ = rms_norm(x, nw, 1e-6, r)
        y = F.linear(h, w)
        return silu_and_mul(y) if silu else y

    for name, n, silu in (("add+norm+qkv", (heads + 2 * kv_heads) * head_dim, False),
                          ("add+norm+gate_up+silu", 2 * inter, True)):
        ws = weight_copies(n, hidden)
        t0 = graph_ms([lambda w=w, silu=silu: unfused(w, silu) for w in ws])
        t1 = graph_ms([lambda w=w, silu=silu: rms_norm_gemv(x, r, nw, 1e-6, w, silu_mul=silu)
                       for w in ws])
        print(f"{name:44} {m:2d} {t0 * 1e3:11.1f} {t1 * 1e3:9.1f}")

    cache = paged_kv([4096] * m, kv_heads, head_dim, 256, DTYPE, "cuda")
    qkv = torch.randn(m, (heads + 2 * kv_heads) * head_dim, device="cuda").to(DTYPE)
    pos = torch.arange(m, device="cuda") + 100
    slots = torch.arange(m, device="cuda") * 300
    cs = torch.randn(40960, head_dim, device="cuda")
    hw = torch.ones(head_dim, device="cuda", dtype=DTYPE)

    def unfused_post():
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, _ = rms_norm(q.view(m, heads, head_dim), hw, 1e-6)
        k, _ = rms_norm(k.view(m, kv_heads, head_dim), hw, 1e-6)
        q, k = rotary(pos, q, k, cs)
        store_kvcache(k, v.view(m, kv_heads, head_dim), cache.k_cache, cache.v_cache, slots)

    def fused_post():
        qkv_rotary_store(pos, qkv, heads, cs, cache.k_cache, cache.v_cache, slots, hw, hw)

    t0 = graph_ms([unfused_post] * 8)
    t1 = graph_ms([fused_post] * 8)
    print(f"{'q/k norm+rotary+KV store':44} {m:2d} {t0 * 1e3:11.1f} {t1 * 1e3:9.1f}")

    # The decode step's attention from the QKV output: two launches against one, at a
    # 128-token and a 4k context (the graph sized for 4k, as an engine's is).
    counters = decode_counters(m, kv_heads, "cuda")
    for context in (128, 4096):
        lens = torch.full((m,), context, dtype=torch.int32, device="cuda")
        step = (lens, cache.block_tables, 0.088)
        kw = dict(num_splits=choose_num_splits(m, kv_heads, 4096, num_sms(qkv.device)),
                  counters=counters)

        def two_launches(step=step, kw=kw):
            q = qkv_rotary_store(pos, qkv, heads, cs, cache.k_cache, cache.v_cache, slots, hw, hw)
            decode_attention(q, cache.k_cache, cache.v_cache, *step, **kw)

        def one_launch(step=step, kw=kw):
            qkv_decode_attention(pos, qkv, heads, cs, cache.k_cache, cache.v_cache, slots,
                                 *step, hw, hw, **kw)

        t0 = graph_ms([two_launches] * 8)
        t1 = graph_ms([one_launch] * 8)
        print(f"{f'q/k norm+rotary+store+attention, ctx {context}':44} {m:2d} "
              f"{t0 * 1e3:11.1f} {t1 * 1e3:9.1f}")


def long_decode_table(sms: int) -> None:
    """Batch 1 decode attention at 32k (and 8k) context: split counts and tiles."""
    print(f"\n{'batch 1 decode attention':26} {'variant':>22} {'graph ms':>9} {'GB/s':>6}")
    for context in (8192, 32768):
        chosen = choose_num_splits(1, NUM_KV_HEADS, context + 256, sms)
        for splits in (16, 32, 64, 128, 256):
            tiles_list = [decode_tiles(DTYPE), dict(decode_tiles(DTYPE), BLOCK_N=64)]
            for tiles in tiles_list:
                _, graph, gbs = decode_case(1, [context], 256, num_splits=splits,
                                            tile_config=tiles)
                mark = " (chosen)" if splits == chosen and tiles is tiles_list[0] else ""
                variant = f"splits {splits} N{tiles['BLOCK_N']}{mark}"
                print(f"{'ctx ' + str(context):26} {variant:>22} "
                      f"{graph:9.4f} {gbs:6.0f}")


def fused_decode_table(sms: int, contexts: tuple[int, ...], sweep: str) -> None:
    """Batch 1 decode attention as the engine launches it (q/k norm + rotary + KV store in
    the prologue, the first tile prefetched, splits of >= 512 positions): split counts x
    tile shapes (`sweep` "splits") or tile shapes at the chosen split count ("tiles").
    One layer reads context x 32 KB of K/V (Qwen3-0.6B)."""
    from minivllm.kernels.tuning import decode_min_split

    heads, head_dim = NUM_HEADS, HEAD_DIM
    default = decode_tiles(DTYPE)
    changes = [dict(BLOCK_N=64), dict(num_warps=8)]
    if sweep == "splits":
        changes += [dict(BLOCK_N=64, num_stages=3), dict(num_stages=3),
                    dict(BLOCK_N=64, num_warps=8, num_stages=3), dict(BLOCK_N=64, num_stages=4),
                    dict(BLOCK_N=32, num_stages=4)]
    else:
        changes += [dict(num_warps=8, num_stages=1), dict(BLOCK_N=64, num_warps=8, num_stages=1),
                    dict(BLOCK_N=32, num_warps=2, num_stages=1)]
    variants = [default] + [dict(default, **change) for change in changes]
    print(f"\n{'batch 1 fused decode attention':32} {'variant':>34} {'graph us':>9} {'GB/s':>6}")
    qkv = torch.randn(1, (heads + 2 * NUM_KV_HEADS) * head_dim, device="cuda").to(DTYPE)
    cs = torch.randn(40960, head_dim, device="cuda")
    hw = torch.ones(head_dim, device="cuda", dtype=DTYPE)
    counters = decode_counters(1, NUM_KV_HEADS, "cuda")
    for context in contexts:
        kv_bytes = context * NUM_KV_HEADS * head_dim * 2 * DTYPE.itemsize
        copies = min(64, -(-ROTATE_BYTES // kv_bytes))
        caches = [paged_kv([context], NUM_KV_HEADS, head_dim, 256, DTYPE, "cuda")
                  for _ in range(copies)]
        pos = torch.tensor([context - 1], device="cuda")
        last = (context - 1) // 256
        slots = [(c.block_tables[0, last:last + 1] * 256 + (context - 1) % 256).long()
                 for c in caches]
        chosen = choose_num_splits(1, NUM_KV_HEADS, context + 256, sms)
        split_counts = sorted({chosen, 16, 64}) if sweep == "splits" else [chosen]
        for splits in split_counts:
            for tiles in variants:
                kw = dict(num_splits=splits, counters=counters, tile_config=tiles,
                          prefetch=True, min_split_len=decode_min_split())
                calls = [
                    lambda a=(pos, qkv, heads, cs, c.k_cache, c.v_cache, slot, c.seq_lens,
                              c.block_tables, 0.088, hw, hw), kw=kw: qkv_decode_attention(
                        *a, **kw)
                    for c, slot in zip(caches, slots, strict=True)]
                label = describe_tiles(tiles)
                try:
                    t = graph_ms(calls)
                except Exception as e:  # a shape out of shared memory: say so, go on
                    print(f"{'ctx ' + str(context):32} {label:>34} failed: {type(e).__name__}")
                    continue
                mark = "*" if splits == chosen and tiles is default else " "
                variant = f"splits {splits} {label}{mark}"
                print(f"{'ctx ' + str(context):32} {variant:>34} {t * 1e3:9.1f} "
                      f"{kv_bytes / (t * 1e-3) / 1e9:6.0f}", flush=True)


@triton.jit
def _gather_sum_kernel(k_ptr, v_ptr, table_ptr, out_ptr, seq_len, split_len,
                       HEADS_PER_PROGRAM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr):
    """Reads K and V of `split_len` positions through the block table, as decode attention
    does, and sums them (no attention math): the bandwidth the access pattern allows.
    HEADS_PER_PROGRAM 1: one KV head's 256-byte rows (attention's pattern); NUM_KV_HEADS:
    whole positions, contiguous across heads."""
    group = tl.program_id(0)  # which heads
    split = tl.program_id(1)
    cols = group * HEADS_PER_PROGRAM * HEAD_DIM + tl.arange(0, HEADS_PER_PROGRAM * HEAD_DIM)
    acc = tl.zeros([HEADS_PER_PROGRAM * HEAD_DIM], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    for tile in range(start, end, ROWS):
        offs = tile + tl.arange(0, ROWS)
        valid = offs < end
        page = tl.load(table_ptr + offs // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = (page * BLOCK_SIZE + offs % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
        k = tl.load(k_ptr + rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
    tl.store(out_ptr + (split * NUM_KV_HEADS * HEAD_DIM) + cols, acc)


def gather_ceiling_table(contexts: tuple[int, ...]) -> None:
    """What reading a context's K/V through the block table costs without the math: one
    KV head a program (decode attention's pattern) against whole positions a program."""
    print(f"\n{'K/V gather, no math':32} {'variant':>34} {'graph us':>9} {'GB/s':>6}")
    for context in contexts:
        kv_bytes = context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
        copies = min(64, -(-ROTATE_BYTES // kv_bytes))
        caches = [paged_kv([context], NUM_KV_HEADS, HEAD_DIM, 256, DTYPE, "cuda")
                  for _ in range(copies)]
        for heads_per_program, splits, rows, warps, stages in (
                (1, 32, 128, 4, 1), (1, 32, 128, 4, 3), (1, 64, 64, 4, 3), (1, 32, 128, 8, 3),
                (8, 256, 16, 4, 1), (8, 256, 16, 4, 3), (8, 128, 32, 8, 3), (8, 512, 16, 4, 3)):
            split_len = -(-context // splits)
            out = torch.empty(splits, NUM_KV_HEADS * HEAD_DIM, device="cuda")
            grid = (NUM_KV_HEADS // heads_per_program, splits)
            consts = dict(HEADS_PER_PROGRAM=heads_per_program, NUM_KV_HEADS=NUM_KV_HEADS,
                          HEAD_DIM=HEAD_DIM, BLOCK_SIZE=256, ROWS=rows, num_warps=warps,
                          num_stages=stages)
            calls = [lambda c=c, a=(out, context, split_len), g=grid, kw=consts:
                     _gather_sum_kernel[g](c.k_cache, c.v_cache, c.block_tables, *a, **kw)
                     for c in caches]
            t = graph_ms(calls)
            variant = f"{heads_per_program} head(s) x{splits} rows {rows} w{warps} s{stages}"
            print(f"{'ctx ' + str(context):32} {variant:>34} {t * 1e3:9.1f} "
                  f"{kv_bytes / (t * 1e-3) / 1e9:6.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-sweep", action="store_true", help="default tiles only")
    parser.add_argument("--only", choices=["attention", "decode-fused", "long-decode",
                                           "decode-latency"], default=None)
    opts = parser.parse_args()
    random.seed(0)
    torch.manual_seed(0)
    sms = num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}; Qwen3-0.6B attention, one layer, {DTYPE}")
    if opts.only == "long-decode":
        fused_decode_table(sms, (8192, 32768), "splits")
        return
    if opts.only == "decode-latency":
        fused_decode_table(sms, (128, 512, 2048, 8192, 32768), "tiles")
        gather_ceiling_table((8192, 32768))
        return
    if opts.only != "attention":
        gemv_table(not opts.no_sweep)
        fused_ops_table()
        long_decode_table(sms)
        if opts.only == "decode-fused":
            return

    throughput_lens = [random.randint(1024, 2048) for _ in range(256)]  # ~1.5k mean
    cases = [
        ("batch 256 x ~1.5k", 256, throughput_lens),
        ("batch 64 x 4k", 64, [4096] * 64),
        ("batch 16 x 1k", 16, [1024] * 16),
        ("batch 1 x 8k", 1, [8192]),
        ("batch 1 x 1k", 1, [1024]),
    ]
    rows = []
    for block_size in (256, 16):
        for name, batch, lens in cases:
            splits = choose_num_splits(batch, NUM_KV_HEADS, max(lens), sms)
            row = decode_case(batch, lens, block_size)
            rows.append((f"decode {name}", block_size, f"splits {splits}", *row))
            print(rows[-1])

    if not opts.no_sweep:
        for name, batch, lens in (cases[0], cases[3]):
            for tiles in [decode_tiles(DTYPE), *decode_tile_variants(DTYPE)]:
                row = decode_case(batch, lens, 256, tile_config=tiles)
                rows.append((f"decode {name}", 256, describe_tiles(tiles), *row))
                print(rows[-1])
        for splits in (8, 16, 64):
            row = decode_case(1, [8192], 256, num_splits=splits)
            rows.append(("decode batch 1 x 8k", 256, f"splits {splits}", *row))
            print(rows[-1])

    prefill_rows = []
    for seq_len, q_len in ((1024, 1024), (4096, 4096), (8192, 512)):
        ms, tflops = prefill_case(seq_len, q_len, 256)
        desc = describe_tiles(prefill_tiles(DTYPE, HEAD_DIM))
        prefill_rows.append((f"prefill ctx {seq_len} q {q_len}", desc, ms, tflops))
    if not opts.no_sweep:
        for tiles in prefill_tile_variants(DTYPE, HEAD_DIM):
            ms, tflops = prefill_case(4096, 4096, 256, tile_config=tiles)
            prefill_rows.append(("prefill ctx 4096 q 4096", describe_tiles(tiles), ms, tflops))

    print(f"\n{'case':26} {'block':>5} {'variant':>14} {'eager ms':>9} {'graph ms':>9} "
          f"{'GB/s':>6} {'of 4.3TB/s':>10}")
    for name, block_size, desc, eager, graph, gbs in rows:
        print(f"{name:26} {block_size:5d} {desc:>14} {eager:9.4f} {graph:9.4f} {gbs:6.0f} "
              f"{100 * gbs * 1e9 / PEAK_BYTES_PER_S:9.1f}%")
    for name, desc, ms, tflops in prefill_rows:
        print(f"{name:26} {256:5d} {desc:>14} {ms:9.4f} {'':>9} {tflops:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
