"""Prefill attention's tiles and loads on the GPU: one long prompt's chunks at Qwen3-0.6B's
shapes (16 query heads, 8 KV heads, head_dim 128, blocks of 256), each variant's time and
TFLOP/s (causal pairs only), its error against torch's SDPA over the gathered K/V, and the
best variant as the environment that selects it (kernels/tuning.py), printed last.

    python scripts/prefill_attn_sweep.py [--fp8] [--baseline DIR]
    python scripts/prefill_attn_sweep.py --qkv   # the fused q/k norm + rotary + KV store
    python scripts/prefill_attn_sweep.py --ttft [--baseline DIR]
        # bench prefill's TTFT at 1k / 8k / 32k; with --baseline, with that tree's prefill
        # attention in this tree's engine

--baseline DIR: another tree of the repository whose prefill kernel runs first with its
default tiles (before/after in one process). Cases: an 8k prompt in one chunk, and the last
8k chunk of a 32k prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

from minivllm.kernels.prefill_attention import _tile_config, gather_kv, prefill_attention
from minivllm.kernels.store_kvcache import FP8_KV_DTYPE
from minivllm.kernels.testing import describe_tiles, paged_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 256
CASES = [(8192, 8192), (32768, 8192)]  # (context, queries): the chunk ends the context
SCALE = HEAD_DIM**-0.5


def variants() -> list[dict]:
    """(BLOCK_M, BLOCK_N, warps, stages) x pointer / TMA loads x the grid's order."""
    base = dict(_tile_config(torch.bfloat16, HEAD_DIM), TMA=False, LAST_FIRST=False)
    out = []
    for tma in (False, True):
        for m, n, w, s in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 3),
                           (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 2),
                           (128, 128, 8, 3)):
            out.append(dict(base, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, TMA=tma))
    for m, n, w, s in ((128, 32, 4, 3), (128, 128, 4, 3), (256, 64, 8, 3), (256, 128, 8, 2)):
        out.append(dict(base, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, TMA=True))
    for m, n, w, s in ((128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3)):
        out.append(dict(base, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, TMA=True,
                        LAST_FIRST=True))
    return out


def env_of(tiles: dict) -> str:
    flag = {True: "1", False: "0"}
    return (f"MINIVLLM_PREFILL_TILE={tiles['BLOCK_M']}x{tiles['BLOCK_N']}x"
            f"{tiles['num_warps']}x{tiles['num_stages']} "
            f"MINIVLLM_PREFILL_TMA={flag[tiles['TMA']]} "
            f"MINIVLLM_PREFILL_LAST_FIRST={flag[tiles['LAST_FIRST']]}")


def load_baseline(tree: str):
    """The baseline tree's prefill_attention (its own module; shared helpers from here)."""
    path = f"{tree}/minivllm/kernels/prefill_attention.py"
    spec = importlib.util.spec_from_file_location("baseline_prefill", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prefill_attention


def qkv_table(num_tokens: int = 8192) -> None:
    """qkv_rotary_store over one 8k chunk per (tokens a program, warps): time and GB/s
    (the qkv read, q and the K/V written)."""
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store
    from minivllm.kernels.testing import cos_sin_table, qk_norm_weights

    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(num_tokens, width, device="cuda").to(torch.bfloat16)
    cache = paged_kv([num_tokens], NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    table = cos_sin_table(40960, HEAD_DIM, device="cuda")
    positions = torch.arange(num_tokens, device="cuda")
    block = cache.block_tables[0].long()
    slots = block[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    weights = qk_norm_weights(HEAD_DIM, torch.bfloat16, "cuda")
    moved = qkv.numel() * 2 + num_tokens * (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM * 2
    print(f"\nqkv_rotary_store, {num_tokens} tokens ({moved / 1e6:.0f} MB moved)")
    for block_tokens, warps in ((1, 1), (4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4),
                                (32, 8), (64, 8)):
        ms = triton.testing.do_bench(lambda b=block_tokens, w=warps: qkv_rotary_store(
            positions, qkv, NUM_HEADS, table, cache.k_cache, cache.v_cache, slots, **weights,
            block_tokens=b, num_warps=w), warmup=25, rep=100)
        print(f"  {block_tokens:3d} tokens x {warps} warps: {ms * 1e3:7.1f} us "
              f"{moved / (ms * 1e-3) / 1e9:6.0f} GB/s", flush=True)


def ttft(baseline: str | None, kv_cache_dtype: str) -> None:
    """`minivllm bench prefill` at 1k / 8k / 32k tokens; with `baseline`, that tree's
    prefill attention takes this one's place before the engine picks its kernels."""
    from minivllm.cli import main as cli

    if baseline:
        import minivllm.kernels.prefill_attention as module

        module.prefill_attention = load_baseline(baseline)
        print(f"prefill attention from {baseline}", flush=True)
    sys.argv = ["minivllm", "bench", "prefill", "--model", "Qwen/Qwen3-0.6B", "--load-format",
                "dummy", "--max-model-len", "33280", "--prefill-lens", "1024", "8192", "32768",
                "--repeats", "3", "--kv-cache-dtype", kv_cache_dtype]
    cli()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fp8", action="store_true", help="an fp8 (e4m3) KV cache")
    parser.add_argument("--baseline", default=None)
    parser.add_argument("--qkv", action="store_true",
                        help="only qkv_rotary_store's table (tokens a program x warps)")
    parser.add_argument("--ttft", action="store_true",
                        help="only bench prefill at 1k / 8k / 32k (--baseline: its kernel)")
    opts = parser.parse_args()
    if opts.qkv:
        qkv_table()
        return
    if opts.ttft:
        ttft(opts.baseline, "fp8" if opts.fp8 else "auto")
        return
    torch.manual_seed(0)
    kv_dtype = FP8_KV_DTYPE if opts.fp8 else torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; KV {kv_dtype}", flush=True)
    cases = []
    for context, queries in CASES:
        cache = paged_kv([context], NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
        if opts.fp8:
            cache.k_cache, cache.v_cache = (c.to(kv_dtype) for c in (cache.k_cache,
                                                                    cache.v_cache))
        q_all = torch.randn(context, NUM_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
        q = q_all[context - queries:].contiguous()
        cu = torch.tensor([0, queries], dtype=torch.int32, device="cuda")
        args = (q, cache.k_cache, cache.v_cache, cu, cache.seq_lens, cache.block_tables, SCALE)
        # The reference: torch's causal SDPA over the whole context (its flash kernel), of
        # which the chunk is the last rows.
        qt, kt, vt = (x[None].transpose(1, 2) for x in (
            q_all, *(gather_kv(c, cache.block_tables[0], context).to(torch.bfloat16)
                     for c in (cache.k_cache, cache.v_cache))))

        def sdpa(qt=qt, kt=kt, vt=vt):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=SCALE,
                                                  enable_gqa=True)

        ref = sdpa()[0].transpose(0, 1)[context - queries:]
        pairs = sum(context - queries + i + 1 for i in range(queries))
        flops = 4 * pairs * NUM_HEADS * HEAD_DIM
        # torch's kernel on contiguous K/V, for scale: the whole context's causal TFLOP/s.
        sdpa_ms = None if opts.fp8 else triton.testing.do_bench(sdpa, warmup=25, rep=100)
        sdpa_flops = 4 * context * (context + 1) // 2 * NUM_HEADS * HEAD_DIM
        sdpa_tf = None if sdpa_ms is None else sdpa_flops / (sdpa_ms * 1e-3) / 1e12
        cases.append((f"ctx {context // 1024}k q {queries // 1024}k", args, ref, flops,
                      sdpa_tf))

    rows = []  # (variant, tiles or None, [(ms, tflops, err) per case])

    def run(name: str, fn, tiles: dict | None) -> None:
        results = []
        for _, args, ref, flops, _ in cases:
            try:
                out = fn(*args)
                torch.cuda.synchronize()
            except Exception as exc:  # a variant that does not compile here
                print(f"{name}: failed: {str(exc).splitlines()[-1][:200]}", flush=True)
                return
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            ms = triton.testing.do_bench(lambda args=args: fn(*args), warmup=25, rep=100)
            results.append((ms, flops / (ms * 1e-3) / 1e12, err))
        rows.append((name, tiles, results))
        print(name, " ".join(f"{ms:.3f} ms {tf:.0f} TF/s err {err:.1e}"
                             for ms, tf, err in results), flush=True)

    if opts.baseline:
        baseline = load_baseline(opts.baseline)
        run("baseline tree, its tiles", baseline, None)
    for tiles in variants():
        run(describe_tiles(tiles), lambda *a, t=tiles: prefill_attention(*a, tile_config=t),
            tiles)

    print(f"\n{'variant':28}" + "".join(f"{name:>26}" for name, *_ in cases))
    if cases[0][4] is not None:
        print("torch SDPA, causal over the whole context (contiguous K/V): " + ", ".join(
            f"{name.split(' q')[0]} {tf:.0f} TF/s" for name, _, _, _, tf in cases))
    for name, _, results in rows:
        print(f"{name:28}" + "".join(f"{ms:9.3f} ms {tf:5.0f} TF/s {err:6.0e}"
                                     for ms, tf, err in results))
    tuned = [(sum(ms for ms, _, _ in r), t) for _, t, r in rows if t is not None
             and max(err for _, _, err in r) < 2e-2]
    best = min(tuned, key=lambda x: x[0])[1]
    print(f"\nbest: {describe_tiles(best)}")
    print(f"BEST_ENV {env_of(best)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
