"""Micro-benchmark of the Triton attention kernels at Qwen3-0.6B's shapes (one layer).

Decode is bound by the K/V bytes it reads, so it is reported as achieved GB/s against the
H200's measured ~4.3 TB/s copy bandwidth; prefill as TFLOP/s. Two decode times:
- eager: do_bench median (it flushes L2 between repeats); includes the host's launch cost,
  which dominates small batches (two Triton launches and the wrapper's checks);
- graph: median replay of a CUDA graph of calls over several copies of the cache (enough to
  overflow the 50 MB L2), per call: the kernels alone, as the engine's decode graphs run them.
GB/s and % are from the graph time.

    python scripts/bench_kernels.py            # default tiles, then a small tile sweep
    python scripts/bench_kernels.py --no-sweep
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import triton.testing
from minivllm.kernels.decode_attention import _tile_config as decode_tiles
from minivllm.kernels.decode_attention import choose_num_splits, decode_attention
from minivllm.kernels.dispatch import num_sms
from minivllm.kernels.prefill_attention import _tile_config as prefill_tiles
from minivllm.kernels.prefill_attention import prefill_attention
from minivllm.kernels.testing import (
    decode_tile_variants,
    describe_tiles,
    paged_kv,
    prefill_tile_variants,
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
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def decode_case(
    batch: int, seq_lens: list[int], block_size: int, **kw
) -> tuple[float, float, float]:
    """Returns (eager ms, graph ms, GB/s from the graph time) for one decode-attention call."""
    # K and V of every context position once, plus q and the output.
    kv_bytes = sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
    total = kv_bytes + 2 * batch * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
    copies = min(64, -(-ROTATE_BYTES // kv_bytes))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-sweep", action="store_true", help="default tiles only")
    opts = parser.parse_args()
    random.seed(0)
    torch.manual_seed(0)
    sms = num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}; Qwen3-0.6B attention, one layer, {DTYPE}")

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
