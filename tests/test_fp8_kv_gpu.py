"""The fp8 KV cache on a CUDA GPU: the store kernels write torch's e4m3 bits, the attention
kernels over an fp8 cache match a float64 reference over the dequantized cache, and an
engine with fp8 KV gives the same greedy tokens with and without CUDA graphs. Skipped
without a GPU (conftest.py)."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
import torch
from conftest import dummy_engine

from minivllm import SamplingParams
from minivllm.kernels.store_kvcache import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from minivllm.kernels.testing import cos_sin_table, paged_kv, qk_norm_weights, rel_err

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
# (num_heads, num_kv_heads, head_dim): Qwen3-0.6B, SmolLM2-135M.
HEADS = [(16, 8, 128), (9, 3, 64)]
SCALES = (0.5, 0.125)  # (k_scale, v_scale): not 1, so a missing factor shows
SEQ_LENS = [1, 2, 15, 16, 17, 255, 256, 257, 1000, 1537, 4095, 8192]
CASES = [pytest.param(b, h, id=f"block{b}-{h[0]}q{h[1]}kv{h[2]}d")
         for b, h in itertools.product([16, 256], HEADS)]


@pytest.fixture(autouse=True)
def _poison_and_seed():
    from minivllm.kernels.testing import poisoned_empty

    torch.manual_seed(0)
    with poisoned_empty():
        yield


def _fp8_cache(seq_lens, num_kv_heads, head_dim, block_size):
    """A paged fp8 cache holding K ~ N(0, 3) and V ~ N(0, 1) over SCALES, and its float64
    dequantized copy."""
    k_scale, v_scale = SCALES
    cache = paged_kv(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, DEVICE)
    cache.k_cache = quantize_kv(cache.k_cache * 3, FP8_KV_DTYPE, k_scale)
    cache.v_cache = quantize_kv(cache.v_cache, FP8_KV_DTYPE, v_scale)
    k64 = dequantize_kv(cache.k_cache, torch.float64, k_scale)
    v64 = dequantize_kv(cache.v_cache, torch.float64, v_scale)
    return cache, k64, v64


class _DecodeStep(NamedTuple):
    positions: torch.Tensor
    qkv: torch.Tensor
    table: torch.Tensor
    slots: torch.Tensor
    norms: dict
    want: torch.Tensor  # float64 attention over the cache with the reference's store


def _decode_step(cache, heads: tuple, block_size: int, max_position: int, k_scale: float,
                 v_scale: float) -> _DecodeStep:
    """One decode token for each sequence of `cache` (at its last position): the qkv and
    its slots, and the reference: the q/k norm + rotary + store of the references into a
    copy of the cache, then float64 attention over that copy dequantized."""
    from minivllm.kernels.decode_attention import decode_attention_ref
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store_ref

    num_heads, num_kv_heads, head_dim = heads
    n = len(cache.seq_lens)
    table = cos_sin_table(max_position, head_dim, device=DEVICE)
    norms = qk_norm_weights(head_dim, torch.bfloat16, DEVICE)
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).bfloat16()
    positions = (cache.seq_lens - 1).long()
    rows = torch.arange(n, device=DEVICE)
    slots = (cache.block_tables[rows, positions // block_size].long() * block_size
             + positions % block_size)
    k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
    q = qkv_rotary_store_ref(positions, qkv, num_heads, table, k_ref, v_ref, slots,
                             norms["q_norm_weight"], norms["k_norm_weight"], 1e-6,
                             k_scale, v_scale)
    want = decode_attention_ref(q.double(), dequantize_kv(k_ref, torch.float64, k_scale),
                                dequantize_kv(v_ref, torch.float64, v_scale),
                                cache.seq_lens, cache.block_tables, head_dim**-0.5)
    return _DecodeStep(positions, qkv, table, slots, norms, want)


def _check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2) -> None:
    err = rel_err(out, ref)
    print(f"{name}: rel err {err:.2e}")
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol:g}"


def test_fp8_stores_write_torchs_bits() -> None:
    """The store and the fused q/k norm + rotary + store round to nearest, saturate, and
    skip slot -1 exactly as the references do (same bytes)."""
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store, qkv_rotary_store_ref
    from minivllm.kernels.store_kvcache import store_kvcache, store_kvcache_ref

    k_scale, v_scale = SCALES
    for num_heads, num_kv_heads, head_dim in HEADS:
        cache, _, _ = _fp8_cache([300, 40], num_kv_heads, head_dim, 16)
        n = 64
        key = (torch.randn(n, num_kv_heads, head_dim, device=DEVICE) * 100).bfloat16()
        value = torch.randn(n, num_kv_heads, head_dim, device=DEVICE).bfloat16()
        slots = torch.randperm(cache.k_cache.shape[0] * 16, device=DEVICE)[:n]
        slots[3] = -1
        k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
        store_kvcache_ref(key, value, k_ref, v_ref, slots, k_scale, v_scale)
        store_kvcache(key, value, cache.k_cache, cache.v_cache, slots.int(), k_scale=k_scale,
                      v_scale=v_scale)
        assert torch.equal(cache.k_cache.view(torch.uint8), k_ref.view(torch.uint8))
        assert torch.equal(cache.v_cache.view(torch.uint8), v_ref.view(torch.uint8))

        table = cos_sin_table(4096, head_dim, device=DEVICE)
        qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim,
                          device=DEVICE).bfloat16()
        positions = torch.randint(0, 4096, (n,), device=DEVICE)
        norms = qk_norm_weights(head_dim, torch.bfloat16, DEVICE)
        k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
        q_ref = qkv_rotary_store_ref(positions, qkv, num_heads, table, k_ref, v_ref, slots,
                                     norms["q_norm_weight"], norms["k_norm_weight"], 1e-6,
                                     k_scale, v_scale)
        q = qkv_rotary_store(positions, qkv, num_heads, table, cache.k_cache, cache.v_cache,
                             slots, norms["q_norm_weight"], norms["k_norm_weight"], 1e-6,
                             k_scale=k_scale, v_scale=v_scale)
        _check("fused q", q, q_ref, 1e-2)
        # Rotary in fp32 vs the reference's steps can move a value across a rounding edge.
        differ = (cache.k_cache.view(torch.uint8) != k_ref.view(torch.uint8)).float().mean()
        assert differ < 1e-3, f"fused store: {differ:.2%} of K bytes differ"
        assert torch.equal(cache.v_cache.view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("block_size,heads", CASES)
def test_fp8_decode_attention(block_size: int, heads: tuple) -> None:
    from minivllm.kernels.decode_attention import decode_attention, decode_attention_ref

    num_heads, num_kv_heads, head_dim = heads
    cache, k64, v64 = _fp8_cache(SEQ_LENS, num_kv_heads, head_dim, block_size)
    q = torch.randn(len(SEQ_LENS), num_heads, head_dim, device=DEVICE).bfloat16()
    tables = (cache.seq_lens, cache.block_tables, head_dim**-0.5)
    want = decode_attention_ref(q.double(), k64, v64, *tables)
    k_scale, v_scale = SCALES
    for splits in (None, 1, 8):
        got = decode_attention(q, cache.k_cache, cache.v_cache, *tables, num_splits=splits,
                               k_scale=k_scale, v_scale=v_scale)
        _check(f"decode splits={splits}", got, want)


@pytest.mark.parametrize("block_size,heads", CASES)
@pytest.mark.parametrize("one_page", ["0", "1"])
def test_fp8_qkv_decode_attention(block_size: int, heads: tuple, one_page: str,
                                  decode_switches) -> None:
    """The one-launch decode (q/k norm + rotary + fp8 store, then attention) against the
    reference's store, then float64 attention over the dequantized cache; with one
    block-table entry a tile or one a position (MINIVLLM_DECODE_ONE_PAGE)."""
    from minivllm.kernels.decode_attention import qkv_decode_attention

    decode_switches(MINIVLLM_DECODE_ONE_PAGE=one_page)
    num_heads, num_kv_heads, head_dim = heads
    k_scale, v_scale = SCALES
    cache, _, _ = _fp8_cache(SEQ_LENS, num_kv_heads, head_dim, block_size)
    d = _decode_step(cache, heads, block_size, 16384, k_scale, v_scale)
    for splits, prefetch in ((None, False), (1, True), (8, True)):
        k_c, v_c = cache.k_cache.clone(), cache.v_cache.clone()
        got = qkv_decode_attention(d.positions, d.qkv, num_heads, d.table, k_c, v_c, d.slots,
                                   cache.seq_lens, cache.block_tables, head_dim**-0.5,
                                   d.norms["q_norm_weight"], d.norms["k_norm_weight"], 1e-6,
                                   num_splits=splits, prefetch=prefetch, k_scale=k_scale,
                                   v_scale=v_scale)
        _check(f"qkv decode splits={splits} prefetch={prefetch}", got, d.want)


SWITCHED = [  # decode switches the loaded launch is also checked under
    {"MINIVLLM_DECODE_ONE_PAGE": "0", "MINIVLLM_DECODE_LOADED_REGS_FP8": "0"},
    {"MINIVLLM_DECODE_FP8_V_WORDS": "1"},
]


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_loaded_decode_launch(kv: str, decode_switches) -> None:
    """A decode launch of several waves (48 sequences x 8 KV heads) takes the loaded tiles
    without the early first tile, and an fp8 cache is read through the PTX upcast to fp16:
    the engine's default launch, the same under the switches in SWITCHED (one block-table
    entry a tile; V as words under a register cap) and a small-grid tiling (prefetch on)
    all match float64 attention over the (dequantized) cache the kernel stored into."""
    from minivllm.kernels.decode_attention import _tile_config, is_loaded, qkv_decode_attention

    num_heads, num_kv_heads, head_dim = HEADS[0]
    block_size = 256
    seq_lens = torch.randint(1, 1100, (48,)).tolist()
    k_scale, v_scale = SCALES if kv == "fp8" else (1.0, 1.0)
    if kv == "fp8":
        cache, _, _ = _fp8_cache(seq_lens, num_kv_heads, head_dim, block_size)
    else:
        cache = paged_kv(seq_lens, num_kv_heads, head_dim, block_size, torch.bfloat16, DEVICE)
    assert is_loaded(len(seq_lens), num_kv_heads, 1, torch.device(DEVICE))
    d = _decode_step(cache, HEADS[0], block_size, 4096, k_scale, v_scale)
    runs = [("default", {}, {})] + [(" ".join(f"{k}={v}" for k, v in env.items()), {}, env)
                                    for env in SWITCHED]
    runs.append(("small-grid tiles", dict(tile_config=_tile_config(torch.bfloat16),
                                          prefetch=True), {}))
    for name, extra, env in runs:
        decode_switches(**env)
        k_c, v_c = cache.k_cache.clone(), cache.v_cache.clone()
        got = qkv_decode_attention(d.positions, d.qkv, num_heads, d.table, k_c, v_c, d.slots,
                                   cache.seq_lens, cache.block_tables, head_dim**-0.5,
                                   d.norms["q_norm_weight"], d.norms["k_norm_weight"], 1e-6,
                                   num_splits=1, k_scale=k_scale, v_scale=v_scale, **extra)
        _check(f"{kv} loaded decode, {name}", got, d.want)


@pytest.mark.parametrize("block_size,heads", CASES)
def test_fp8_prefill_attention(block_size: int, heads: tuple) -> None:
    from minivllm.kernels.prefill_attention import prefill_attention, prefill_attention_ref

    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [1, 17, 300, 1000, 2049]
    q_lens = [1, 17, 100, 1000, 513]  # whole prompts and chunks after a cached prefix
    cache, k64, v64 = _fp8_cache(seq_lens, num_kv_heads, head_dim, block_size)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE).bfloat16()
    args = (cu, cache.seq_lens, cache.block_tables, head_dim**-0.5)
    want = prefill_attention_ref(q.double(), k64, v64, *args)
    k_scale, v_scale = SCALES
    got = prefill_attention(q, cache.k_cache, cache.v_cache, *args, k_scale=k_scale,
                            v_scale=v_scale)
    _check("prefill", got, want)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 151936, (300,), generator=g).tolist()
    return [prefix + torch.randint(0, 151936, (20 + 37 * i,), generator=g).tolist()
            for i in range(n)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_engine_tokens_equal_with_and_without_graphs(dtype: str) -> None:
    """Greedy tokens with fp8 KV are the same replayed from CUDA graphs (decode, prefill
    and mixed steps, prefix hits) as eager."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = _prompts(8, seed=3)
    out = {}
    for eager in (False, True):
        llm = dummy_engine(kv_cache_dtype="fp8", dtype=dtype, enforce_eager=eager, block_size=16,
                      max_num_batched_tokens=512)
        try:
            assert llm.runner.kv_cache.dtype == FP8_KV_DTYPE
            out[eager] = llm.generate(prompts, params)["token_ids"]
            assert llm.stats().prefix_cache_hit_rate > 0
        finally:
            llm.exit()
    assert out[False] == out[True]
    assert len({tuple(t) for t in out[True]}) > 1


def test_fp8_pool_has_about_twice_the_blocks() -> None:
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = dummy_engine(kv_cache_dtype=kv)
        try:
            blocks[kv] = llm.runner.num_blocks
        finally:
            llm.exit()
    print(f"KV blocks at gpu_memory_utilization 0.3: bf16 {blocks['auto']}, fp8 {blocks['fp8']}")
    assert blocks["fp8"] >= 1.9 * blocks["auto"]
