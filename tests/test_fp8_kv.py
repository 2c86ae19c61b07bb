"""The fp8 KV cache (`kv_cache_dtype` fp8) on CPU: the config key, the e4m3 round trip with
scales, attention over an fp8 cache against fp32 attention over its dequantized values,
the Triton kernels under Triton's interpreter (and compiled for sm_90), the pool's size,
engine equivalences in fp8 mode and the quality on SmolLM2's real weights."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from conftest import run_kernel_checks, tiny_engine

from minivllm import EngineConfig, SamplingParams
from minivllm.kernels.store_kvcache import (
    FP8_KV_DTYPE,
    FP8_MAX,
    dequantize_kv,
    quantize_kv,
    store_kvcache_ref,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
# e4m3 keeps 3 mantissa bits: a normal value rounds within 2**-4 of itself (relative);
# below 2**-6 (subnormals) the step is 2**-9, so the error is within 2**-10 (absolute).
REL, ABS = 2.0**-4, 2.0**-10


def _within_e4m3(got: torch.Tensor, want: torch.Tensor, scale: float) -> None:
    bound = REL * want.abs() + ABS * scale
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"max error {float((err - bound).max()):.3g} past e4m3's"


# -- the config key -----------------------------------------------------------------------


def test_kv_cache_dtype_key() -> None:
    for value in ("auto", "fp8", "fp8_e4m3"):
        config = EngineConfig(model_name_or_path="x", kv_cache_dtype=value)
        assert config.kv_fp8 == (value != "auto")
    for bad in ("fp16", "float8", "", None):
        with pytest.raises(ValueError, match=r"kv_cache_dtype=.*must be one of 'auto', 'fp8'"):
            EngineConfig(model_name_or_path="x", kv_cache_dtype=bad)
    d = {"model_name_or_path": "t", "load_format": "dummy", "kv_cache_dtype": "fp8"}
    assert EngineConfig.from_dict(d).kv_cache_dtype == "fp8"


def test_kv_cache_dtype_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--kv-cache-dtype` reaches the engine config from every CLI that takes engine
    options; a bad value is argparse's one-line error."""
    from minivllm.tui.cli import build_parser as chat_parser
    from minivllm.tui.cli import engine_config as chat_config

    from minivllm.bench import common, workloads
    from minivllm.server.cli import build_parser as serve_parser
    from minivllm.server.cli import engine_config as serve_config

    args = serve_parser().parse_args(["m", "--kv-cache-dtype", "fp8"])
    args.model = "m"
    assert serve_config(args)["kv_cache_dtype"] == "fp8"
    assert chat_config(chat_parser().parse_args(["--kv-cache-dtype", "fp8"]))[
        "kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in chat_config(chat_parser().parse_args([]))
    seen = {}

    class Engine:
        def __init__(self, config, on_progress=None):
            seen.update(config)

    parser = argparse.ArgumentParser()
    workloads.add_arguments(parser)
    monkeypatch.setattr(common, "LLMEngine", Engine)
    common.build_engine(parser.parse_args(["throughput", "--kv-cache-dtype", "fp8_e4m3"]))
    assert seen["kv_cache_dtype"] == "fp8_e4m3"
    proc = subprocess.run([sys.executable, "-m", "minivllm.cli", "generate", "--kv-cache-dtype",
                           "fp4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--kv-cache-dtype: invalid choice: 'fp4'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gpu_script_imports_and_parses() -> None:
    """scripts/fp8_kv_gpu.py (run on a GPU) imports, parses its options into the bench's
    and says in one line that it needs a GPU here."""
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "fp8_kv_gpu.py")
    spec = importlib.util.spec_from_file_location("fp8_kv_gpu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.parse_args(["--long", "4096", "--num-seqs", "64"])
    bench = script.bench_args(args, "fp8", "--max-model-len", "4300")
    assert (bench.kv_cache_dtype, bench.num_seqs, bench.max_model_length) == ("fp8", 64, 4300)
    assert bench.model == "Qwen/Qwen3-0.6B"
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, path, "--skip-throughput"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr.strip() == "fp8_kv_gpu.py: needs a CUDA GPU"


# -- the round trip and the references ------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.05, 4.0])
def test_round_trip_within_e4m3_rounding(scale: float) -> None:
    """Stored through the cache's slots, read back upcast and scaled: each value within
    e4m3's rounding of the bf16 one; magnitudes past 448 * scale saturate, slot -1 is
    skipped, other slots keep their contents."""
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads, dim = 4, 16, 2, 32
    key = (torch.randn(9, heads, dim, generator=g) * 8 * scale).bfloat16()
    value = (torch.randn(9, heads, dim, generator=g) * scale).bfloat16()
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 449.0]) * scale  # saturate / zero
    k_cache = torch.zeros(num_blocks, block_size, heads, dim, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, 0, 63, 40, -1, 5, 22, 31])
    store_kvcache_ref(key, value, k_cache, v_cache, slots, k_scale=scale, v_scale=scale / 2)
    keep = slots >= 0
    k_read = dequantize_kv(k_cache.flatten(0, 1)[slots[keep]], torch.float32, scale)
    v_read = dequantize_kv(v_cache.flatten(0, 1)[slots[keep]], torch.float32, scale / 2)
    k_want = key[keep].float().clamp(-FP8_MAX * scale, FP8_MAX * scale)
    _within_e4m3(k_read, k_want, scale)
    _within_e4m3(v_read, value[keep].float(), scale / 2)
    sat = torch.tensor([FP8_MAX, -FP8_MAX, 0.0]) * scale
    assert torch.equal(k_read[0, 0, :3], sat)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[keep]] = True
    assert not k_cache.flatten(0, 1)[~written].float().any(), "a slot nobody wrote changed"
    # The reference's quantize / dequantize: the same bits as the store.
    assert torch.equal(quantize_kv(key[keep], FP8_KV_DTYPE, scale).view(torch.uint8),
                       k_cache.flatten(0, 1)[slots[keep]].view(torch.uint8))


def _fp8_paged(seq_lens, heads, dim, block_size, k_scale, v_scale, g):
    from minivllm.kernels.testing import paged_kv

    cache = paged_kv(seq_lens, heads, dim, block_size, torch.float32, "cpu")
    cache.k_cache = quantize_kv(cache.k_cache * 3 * k_scale, FP8_KV_DTYPE, k_scale)
    cache.v_cache = quantize_kv(cache.v_cache * v_scale, FP8_KV_DTYPE, v_scale)
    return cache


def test_reference_attention_reads_the_dequantized_cache() -> None:
    """Decode and prefill attention over an fp8 cache equal fp32 attention over the cache's
    dequantized values (upcast, times the scales)."""
    from minivllm.kernels.decode_attention import decode_attention_ref
    from minivllm.kernels.prefill_attention import prefill_attention_ref

    g = torch.Generator().manual_seed(1)
    k_scale, v_scale = 0.5, 0.02
    cache = _fp8_paged([37, 5, 64], 2, 32, 16, k_scale, v_scale, g)
    k32 = dequantize_kv(cache.k_cache, torch.float32, k_scale)
    v32 = dequantize_kv(cache.v_cache, torch.float32, v_scale)
    args = (cache.seq_lens, cache.block_tables, 0.2)
    q = torch.randn(3, 6, 32, generator=g)
    got = decode_attention_ref(q, cache.k_cache, cache.v_cache, *args, k_scale, v_scale)
    torch.testing.assert_close(got, decode_attention_ref(q, k32, v32, *args))
    q = torch.randn(3 + 5 + 10, 6, 32, generator=g)  # the last 3, 5 and 10 positions
    cu = torch.tensor([0, 3, 8, 18])
    got = prefill_attention_ref(q, cache.k_cache, cache.v_cache, cu, *args,
                                k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(got, prefill_attention_ref(q, k32, v32, cu, *args))
    assert got.dtype == torch.float32


# -- the Triton kernels on the CPU (interpreter) and compiled for sm_90 ---------------------


def check_interpreted() -> None:
    """fp32 activations (the interpreter's bf16 `tl.dot` is wrong) over an fp8 cache."""
    from minivllm.kernels.decode_attention import (
        decode_attention,
        decode_attention_ref,
        qkv_decode_attention,
    )
    from minivllm.kernels.prefill_attention import prefill_attention, prefill_attention_ref
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store, qkv_rotary_store_ref
    from minivllm.kernels.store_kvcache import store_kvcache
    from minivllm.kernels.testing import cos_sin_table, poison_unowned_slots, qk_norm_weights

    g = torch.Generator().manual_seed(2)
    ks, vs = 0.25, 0.05
    scales = dict(k_scale=ks, v_scale=vs)
    heads, kv_heads, dim, bs = 4, 2, 64, 16

    def same_cache(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        # Equal, except where Triton's interpreter converts float -> e4m3 wrongly: a value
        # that rounds up to a power of two b comes out as b / 2 (the mantissa's carry is
        # dropped), and subnormals may land one step (2**-9) off. The GPU's conversion
        # rounds to nearest as torch's does (tests/test_fp8_kv_gpu.py checks the bits).
        a, b = a.float(), b.float()
        power_of_two = torch.frexp(b).mantissa.abs() == 0.5
        subnormal = (b.abs() <= 2.0**-6) & ((a - b).abs() <= 2.0**-9)
        known = (power_of_two & (a == b / 2)) | subnormal
        bad = ~((a == b) | known)
        assert not bool(bad.any()), f"{what}: {torch.stack([a[bad], b[bad]])[:, :8]}"
        assert known.float().mean() < 0.05, f"{what}: too many values differ"

    # The store.
    cache = _fp8_paged([40, 7], kv_heads, dim, bs, ks, vs, g)
    key = torch.randn(9, kv_heads, dim, generator=g) * 4 * ks
    value = torch.randn(9, kv_heads, dim, generator=g) * vs
    slots = torch.randperm(cache.k_cache.shape[0] * bs, generator=g)[:9]
    slots[4] = -1
    k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slots, ks, vs)
    store_kvcache(key, value, cache.k_cache, cache.v_cache, slots.int(), **scales)
    same_cache(cache.k_cache, k_ref, "store k")
    same_cache(cache.v_cache, v_ref, "store v")

    # The fused q/k norm + rotary + store.
    table = cos_sin_table(256, dim)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g)
    positions = torch.tensor([0, 3, 17, 100, 255])
    slots = torch.tensor([1, 2, 30, 31, -1])
    norms = qk_norm_weights(dim, torch.float32)
    k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
    q_ref = qkv_rotary_store_ref(positions, qkv, heads, table, k_ref, v_ref, slots,
                                 norms["q_norm_weight"], norms["k_norm_weight"], 1e-6, ks, vs)
    q = qkv_rotary_store(positions, qkv, heads, table, cache.k_cache, cache.v_cache, slots,
                         norms["q_norm_weight"], norms["k_norm_weight"], 1e-6, **scales)
    torch.testing.assert_close(q, q_ref)
    same_cache(cache.k_cache, k_ref, "fused store k")
    same_cache(cache.v_cache, v_ref, "fused store v")

    # Attention against fp32 attention over the dequantized cache.
    cache = _fp8_paged([40, 7, 90], kv_heads, dim, bs, ks, vs, g)
    k32 = dequantize_kv(cache.k_cache, torch.float32, ks)
    v32 = dequantize_kv(cache.v_cache, torch.float32, vs)
    args = (cache.seq_lens, cache.block_tables, 0.125)
    q = torch.randn(3, heads, dim, generator=g)
    want = decode_attention_ref(q, k32, v32, *args)
    for splits in (1, 4):
        got = decode_attention(q, cache.k_cache, cache.v_cache, *args, num_splits=splits,
                               **scales)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    cu = torch.tensor([0, 20, 27, 57], dtype=torch.int32)
    q = torch.randn(57, heads, dim, generator=g)
    got = prefill_attention(q, cache.k_cache, cache.v_cache, cu, *args, **scales)
    want = prefill_attention_ref(q, k32, v32, cu, *args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # fp8 K/V tiles through TMA descriptors, NaN in the slots no sequence owns. NOTE: the
    # interpreter reads e4m3's NaN as 480, so this checks the fp8 loads, not the guard on
    # a tile's slots past its sequence (test_kernels.py's check and the GPU test do).
    k_nan, v_nan = poison_unowned_slots(cache, [40, 7, 90])
    tiles = dict(BLOCK_M=16, BLOCK_N=16, DOT_PRECISION="ieee", num_warps=4, num_stages=1,
                 TMA=True, LAST_FIRST=True)
    got = prefill_attention(q, k_nan, v_nan, cu, *args, **scales, tile_config=tiles)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    # The one-launch decode: store the new token, then attend over the cache with it
    # (compared with the reference's attention over the kernel's own store, which the
    # interpreter's conversion may round differently).
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=g)
    positions = (cache.seq_lens - 1).long()
    pages = cache.block_tables[torch.arange(3), positions // bs].long()
    slots = pages * bs + positions % bs
    k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
    q = qkv_rotary_store_ref(positions, qkv, heads, table, k_ref, v_ref, slots, None, None,
                             1e-6, ks, vs)
    for splits, prefetch in ((1, False), (4, True)):
        k_c, v_c = cache.k_cache.clone(), cache.v_cache.clone()
        got = qkv_decode_attention(positions, qkv, heads, table, k_c, v_c, slots,
                                   cache.seq_lens, cache.block_tables, 0.125,
                                   num_splits=splits, prefetch=prefetch, **scales)
        same_cache(k_c, k_ref, "decode store k")
        same_cache(v_c, v_ref, "decode store v")
        want = decode_attention_ref(q, k_c, v_c, *args, ks, vs)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    # fp16 q (the GPU's compute dtype over an fp8 cache): V tiles loaded as 32-bit words
    # (FP8_V_WORDS), and one block-table entry a tile (ONE_PAGE: tiles of 16 positions in
    # pages of 16), give the byte loads' values a position at a time, bit for bit, split or
    # not.
    q = torch.randn(3, heads, dim, generator=g).half()
    want = decode_attention_ref(q.float(), k32, v32, *args)
    for splits, block_n in ((1, 32), (4, 32), (4, bs)):
        outs = [decode_attention(q, cache.k_cache, cache.v_cache, *args, num_splits=splits,
                                 tile_config=dict(BLOCK_N=block_n, DOT_PRECISION="tf32",
                                                  num_warps=4, num_stages=2,
                                                  FP8_V_WORDS=words, ONE_PAGE=one_page),
                                 **scales)
                for words, one_page in ((False, False), (True, False), (True, True))]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        torch.testing.assert_close(outs[1].float(), want, rtol=2e-3, atol=2e-3)


def check_compile_sm90() -> None:
    """The fp8 variants compile for an H100 (Triton's passes and ptxas, no GPU)."""
    from minivllm.kernels.decode_attention import _decode_attention_kernel
    from minivllm.kernels.prefill_attention import _prefill_kernel
    from minivllm.kernels.qkv_rotary_store import _qkv_rotary_store_kernel
    from minivllm.kernels.store_kvcache import _store_kvcache_kernel
    from minivllm.kernels.testing import compile_sm90

    fp8 = dict(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
    scalars = dict(k_scale="fp32", v_scale="fp32", eps="fp32", qk_scale="fp32")
    sig = {n: "*bf16" for n in _store_kvcache_kernel.arg_names if n.endswith("_ptr")}
    sig.update(fp8, slot_mapping_ptr="*i64", **scalars)
    compile_sm90(_store_kvcache_kernel, sig,
                  dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, KV_FP8=True))
    sig = {n: "*bf16" for n in _qkv_rotary_store_kernel.arg_names if n.endswith("_ptr")}
    sig.update(fp8, positions_ptr="*i64", slot_mapping_ptr="*i64", cos_sin_ptr="*fp32",
               **scalars)
    compile_sm90(_qkv_rotary_store_kernel, sig,
                  dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, BLOCK_T=16,
                       QK_NORM=True, PDL=True, KV_FP8=True), 2)
    sig = {n: "*bf16" for n in _prefill_kernel.arg_names if n.endswith("_ptr")}
    sig.update(fp8, cu_seqlens_ptr="*i32", seq_lens_ptr="*i32", block_tables_ptr="*i32",
               **scalars)
    tiles = dict(GROUP=2, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_M=128,
                 BLOCK_N=64, DOT_PRECISION="tf32", KV_FP8=True, LAST_FIRST=True)
    compile_sm90(_prefill_kernel, sig, dict(tiles, k_desc=None, v_desc=None, TMA=False), 4, 3)
    desc = "tensordesc<fp8e4nv[64, 128]>"  # TMA loads of the fp8 tiles
    compile_sm90(_prefill_kernel, dict(sig, k_desc=desc, v_desc=desc), dict(tiles, TMA=True),
                  4, 3)
    sig = {n: "*fp32" for n in _decode_attention_kernel.arg_names if n.endswith("_ptr")}
    sig.update(fp8, q_ptr="*bf16", out_ptr="*bf16", block_tables_ptr="*i32",
               seq_lens_ptr="*i32", counters_ptr="*i32", positions_ptr="*i64",
               slot_mapping_ptr="*i64", q_norm_ptr="*bf16", k_norm_ptr="*bf16", **scalars)
    # Upcast to q's dtype, to fp16, and to fp16 by inline PTX (which the interpreter
    # cannot run: this compile is its CPU check).
    # The last two: V tiles as 32-bit words, each upcast by a four-output PTX call, with
    # one block-table entry a tile in the last.
    for splits, from_qkv, prefetch, f16, asm, words, one_page in (
            (1, False, False, False, False, False, False),
            (32, False, False, True, True, False, False),
            (32, True, True, True, False, False, False),
            (1, True, True, True, True, False, False),
            (32, True, False, True, True, True, False),
            (32, True, True, True, True, True, True)):
        compile_sm90(_decode_attention_kernel, sig,
                      dict(GROUP=2, GROUP_PAD=16, NUM_KV_HEADS=8, HEAD_DIM=128,
                           BLOCK_SIZE=256, BLOCK_N=128, NUM_SPLITS=splits,
                           MERGE_CHUNK=min(splits, 32), FROM_QKV=from_qkv, QK_NORM=from_qkv,
                           DOT_PRECISION="tf32", PDL=True, PREFETCH=prefetch,
                           MIN_SPLIT_LEN=128, LATE_TRIGGER=0, KV_FP8=True, FP8_AS_F16=f16,
                           FP8_ASM=asm, FP8_V_WORDS=words, ONE_PAGE=one_page), 4, 2)


CHECKS = {"interpreted": check_interpreted, "compile_sm90": check_compile_sm90}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("group", list(CHECKS))
def test_fp8_triton_kernels(group: str) -> None:
    run_kernel_checks(__file__, group)


# -- the engine ------------------------------------------------------------------------------


def test_fp8_pool_holds_twice_the_blocks(tiny_llama) -> None:
    """At the same memory budget the fp8 pool gets twice the blocks of a bf16 one, stored
    as e4m3; its decode runs the eager attention (which upcasts and scales)."""
    from minivllm.engine import kv_pool

    blocks = {}
    for kv in ("auto", "fp8"):
        llm = tiny_engine(tiny_llama, dtype="bfloat16", kv_cache_dtype=kv,
                          max_cached_blocks=None)
        try:
            runner = llm.runner
            assert runner.kv_cache.dtype == (FP8_KV_DTYPE if kv == "fp8" else torch.bfloat16)
            blocks[kv] = runner.num_blocks
            if kv == "fp8":  # the native / compiled decode steps read an fp32 / bf16 cache
                assert runner.cpu_step is None
            assert blocks[kv] == kv_pool.CPU_KV_BUDGET_BYTES // runner.bytes_per_block
        finally:
            llm.exit()
    assert blocks["fp8"] == 2 * blocks["auto"]


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _prompts(n: int = 4, prefix_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 512, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(0, 512, (5 + 7 * i,), generator=g).tolist() for i in range(n)]


def _run(path, prompts, **kw):
    llm = tiny_engine(path, kv_cache_dtype="fp8", **kw)
    try:
        return llm.generate(prompts, GREEDY)["token_ids"], llm.stats()
    finally:
        llm.exit()


def test_fp8_prefix_cache_and_chunked_prefill_same_tokens(tiny_qwen3) -> None:
    """In fp8 mode, prefix-cache hits and chunked prefill give the tokens of a run without
    them (each reads the same e4m3 K/V back); so does preemption (below)."""
    prompts = _prompts(prefix_len=70)
    plain, _ = _run(tiny_qwen3, prompts, enable_prefix_caching=False,
                    enable_chunked_prefill=False, max_num_batched_tokens=1024)
    cached, stats = _run(tiny_qwen3, prompts, max_num_sequences=2)
    assert stats.prefix_cache_hit_rate > 0.3
    assert cached == plain
    chunked, stats = _run(tiny_qwen3, prompts, max_num_batched_tokens=24,
                          enable_prefix_caching=False)
    assert stats.num_steps > len(prompts) * GREEDY.max_tokens / 6
    assert chunked == plain
    assert len({tuple(t) for t in plain}) > 1  # the model is not degenerate


def test_fp8_preemption_same_tokens(tiny_qwen3) -> None:
    prompts = _prompts()
    roomy, _ = _run(tiny_qwen3, prompts, max_cached_blocks=256)
    # 9 blocks of 16 tokens cannot hold four ~60-token sequences at once.
    tight, stats = _run(tiny_qwen3, prompts, max_cached_blocks=9, max_model_length=128)
    assert stats.num_preemptions > 0
    assert tight == roomy


def test_fp8_tp2_follows_tp1(tiny_qwen3) -> None:
    """Tensor parallelism (each rank its KV heads' fp8 pool) with prefix hits, chunked
    prefill and preemption: TP=1's fp8 tokens, or a first difference in TP=1's top-5 there
    (the ranks' sums round in another order, as in fp32)."""
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    llm = tiny_engine(tiny_qwen3, kv_cache_dtype="fp8")
    try:
        want = llm.generate(prompts, params)
    finally:
        llm.exit()
    llm = tiny_engine(tiny_qwen3, kv_cache_dtype="fp8", world_size=2, max_cached_blocks=9,
                      max_num_batched_tokens=32, max_model_length=128)
    try:
        got = llm.generate(prompts, params)["token_ids"]
        stats = llm.stats()
    finally:
        llm.exit()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
    for w, g, lps in zip(want["token_ids"], got, want["logprobs"], strict=True):
        d = next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), None)
        if d is not None:
            assert g[d] in lps[d].top, (d, g[d], lps[d].top)


# 24 chat prompts (scripts/fp8_kv_accuracy.py measures on the same ones).
QUALITY_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.", "List three uses of a paperclip.",
    "What is 17 times 23?", "Tell me a joke about computers.", "How do I boil an egg?",
    "Translate 'good morning' into Spanish and German.", "Who wrote Romeo and Juliet?",
    "Give me a short tip for learning to code.", "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "What are the planets of the solar system?", "Describe a cat in one sentence.",
    "What should I pack for a weekend hike?", "Summarise the plot of Cinderella.",
    "What is the difference between a list and a tuple in Python?",
    "Name three famous painters.", "How does a refrigerator keep food cold?",
    "Suggest a name for a bakery.", "What is machine learning?",
    "Write a limerick about a dog.", "How many days are in a leap year?",
    "What is the boiling point of water in Fahrenheit?",
]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two SmolLM2 runs of 24 x 64 tokens, the fp8 one's decode eager
def test_fp8_quality_on_smollm2(smollm2, smollm2_path) -> None:
    """SmolLM2's real weights, 64 greedy tokens on 24 chat prompts, fp8 KV against fp32
    KV: at each first divergence, each run's token is in the other's top-5 there (both
    share the prefix up to it), and the chosen tokens' logprobs over the shared prefixes
    differ by 0.041 on average (measured; bound 0.08)."""
    from minivllm import LLMEngine

    prompts = [
        smollm2.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUALITY_PROMPTS
    ]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    ref = smollm2.generate(prompts, params)
    fp8 = LLMEngine({"model_name_or_path": str(smollm2_path), "device": "cpu",
                     "dtype": "float32", "max_model_length": 2048, "block_size": 16,
                     "kv_cache_dtype": "fp8"})
    try:
        got = fp8.generate(prompts, params)
    finally:
        fp8.exit()
    deltas = []
    for w, g, lw, lg in zip(ref["token_ids"], got["token_ids"], ref["logprobs"],
                            got["logprobs"], strict=True):
        d = next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), len(w))
        deltas += [abs(lw[i].logprob - lg[i].logprob) for i in range(d)]
        if d < len(w):
            assert g[d] in lw[d].top, (d, g[d], lw[d].top)
            assert w[d] in lg[d].top, (d, w[d], lg[d].top)
    mean = sum(deltas) / len(deltas)
    assert mean < 0.08, f"mean |delta logprob| {mean:.4f}"


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
