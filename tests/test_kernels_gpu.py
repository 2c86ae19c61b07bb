"""The Triton kernels on a CUDA GPU at realistic shapes, against their references.

References run in float64 on the upcast inputs (attention) or in the kernel's dtype with
the reference's own rounding steps (elementwise kernels). Wrapper-allocated outputs are
NaN-poisoned, so unwritten elements fail. Skipped without a GPU (conftest.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from minivllm.kernels.testing import DECODE_MODELS as MODELS
from minivllm.kernels.testing import cos_sin_table, projections, qk_norm_weights

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (num_heads, num_kv_heads, head_dim): Qwen3-0.6B, the same at head_dim 64, SmolLM2-135M.
HEADS = [(16, 8, 128), (16, 8, 64), (9, 3, 64)]
DEVICE = "cuda"
ATTENTION_CASES = [
    pytest.param(dtype, block_size, heads,
                 id=f"{str(dtype)[6:]}-block{block_size}-{heads[0]}q{heads[1]}kv{heads[2]}d")
    for dtype, block_size, heads in itertools.product(
        [torch.bfloat16, torch.float32], [16, 256], HEADS
    )
]


@pytest.fixture(autouse=True)
def _poison_and_seed():
    from minivllm.kernels.testing import poisoned_empty

    torch.manual_seed(0)
    with poisoned_empty():
        yield


def _assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    from minivllm.kernels.testing import rel_err

    err = rel_err(out, ref)
    print(f"{name}: rel err {err:.2e}")
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol:g}"


# Ragged contexts from 1 to 8k, around block boundaries (16 and 256).
DECODE_SEQ_LENS = [1, 2, 15, 16, 17, 255, 256, 257, 1000, 1537, 4095, 8192]


@pytest.mark.parametrize("dtype,block_size,heads", ATTENTION_CASES)
def test_decode_attention(dtype: torch.dtype, block_size: int, heads: tuple) -> None:
    from minivllm.kernels.decode_attention import decode_attention, decode_attention_ref
    from minivllm.kernels.testing import paged_kv

    num_heads, num_kv_heads, head_dim = heads
    cache = paged_kv(DECODE_SEQ_LENS, num_kv_heads, head_dim, block_size, dtype, DEVICE)
    args = (cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables)
    q = torch.randn(len(DECODE_SEQ_LENS), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    ref = decode_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:], scale)
    splits = [None, 1, 16] if dtype == torch.bfloat16 else [None]
    for num_splits in splits:
        out = decode_attention(q, *args, scale, num_splits=num_splits)
        name = f"decode {dtype} block {block_size} heads {heads} splits {num_splits}"
        _assert_close(name, out, ref, TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_attention_batch1_long(block_size: int) -> None:
    """Batch 1 at 8k: the case flash-decoding's splits exist for."""
    from minivllm.kernels.decode_attention import decode_attention, decode_attention_ref
    from minivllm.kernels.testing import paged_kv

    cache = paged_kv([8000], 8, 128, block_size, torch.bfloat16, DEVICE)
    args = (cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables)
    q = torch.randn(1, 16, 128, device=DEVICE).to(torch.bfloat16)
    ref = decode_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:], 0.088)
    _assert_close(f"decode batch 1 8k block {block_size}", decode_attention(q, *args, 0.088),
                  ref, TOL[torch.bfloat16])


def test_decode_attention_tile_variants() -> None:
    """Every tile configuration the benchmark sweeps is right, so defaults can move."""
    from minivllm.kernels.decode_attention import decode_attention, decode_attention_ref
    from minivllm.kernels.testing import decode_tile_variants, describe_tiles, paged_kv

    cache = paged_kv(DECODE_SEQ_LENS, 8, 128, 256, torch.bfloat16, DEVICE)
    args = (cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables)
    q = torch.randn(len(DECODE_SEQ_LENS), 16, 128, device=DEVICE).to(torch.bfloat16)
    ref = decode_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:], 0.088)
    for tiles in decode_tile_variants(torch.bfloat16):
        for num_splits in (1, 8):
            out = decode_attention(q, *args, 0.088, num_splits=num_splits, tile_config=tiles)
            _assert_close(f"decode tiles {describe_tiles(tiles)} splits {num_splits}", out, ref,
                          TOL[torch.bfloat16])


def test_decode_attention_cuda_graph() -> None:
    """Captured once for a padded block table, replayed with other lengths: the launch
    must not depend on seq_lens' values (no host sync, splits fixed by shapes)."""
    from minivllm.kernels.decode_attention import decode_attention, decode_attention_ref
    from minivllm.kernels.testing import paged_kv

    torch.use_deterministic_algorithms(False)  # no NaN-fill kernels inside the capture
    cache = paged_kv([4096] * 4, 8, 128, 16, torch.bfloat16, DEVICE, spare_columns=0)
    q = torch.randn(4, 16, 128, device=DEVICE).to(torch.bfloat16)
    seq_lens = cache.seq_lens.clone()
    args = (cache.k_cache, cache.v_cache, seq_lens, cache.block_tables)
    decode_attention(q, *args, 0.088)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, *args, 0.088)
    for lens in ([1, 4096, 77, 2049], [300, 20, 4000, 1]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.normal_()
        graph.replay()
        ref = decode_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:],
                                   0.088)
        _assert_close(f"decode graph replay {lens}", out, ref, TOL[torch.bfloat16])


# (seq_len, q_len): single tokens, whole prompts, queries after a cached prefix (prefix hit
# or a later chunk of chunked prefill), a chunk at the end of an 8k context.
PREFILL_SEQS = [(1, 1), (17, 17), (300, 300), (1024, 1024), (2048, 1000), (8192, 512),
                (4097, 1), (3000, 0), (4096, 4096)]


@pytest.mark.parametrize("dtype,block_size,heads", ATTENTION_CASES)
def test_prefill_attention(dtype: torch.dtype, block_size: int, heads: tuple) -> None:
    from minivllm.kernels.prefill_attention import prefill_attention, prefill_attention_ref
    from minivllm.kernels.testing import paged_kv

    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [s for s, _ in PREFILL_SEQS]
    cu = torch.tensor([0, *itertools.accumulate(q for _, q in PREFILL_SEQS)],
                      dtype=torch.int32, device=DEVICE)
    cache = paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, DEVICE)
    args = (cache.k_cache, cache.v_cache, cu, cache.seq_lens, cache.block_tables)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    ref = prefill_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:], scale)
    _assert_close(f"prefill {dtype} block {block_size} heads {heads}",
                  prefill_attention(q, *args, scale), ref, TOL[dtype])


def test_prefill_attention_tile_variants() -> None:
    from minivllm.kernels.prefill_attention import prefill_attention, prefill_attention_ref
    from minivllm.kernels.testing import describe_tiles, paged_kv, prefill_tile_variants

    seqs = PREFILL_SEQS[:-1]  # the 4k prompt's float64 reference is the slow part
    cu = torch.tensor([0, *itertools.accumulate(q for _, q in seqs)], dtype=torch.int32,
                      device=DEVICE)
    cache = paged_kv([s for s, _ in seqs], 8, 128, 256, torch.bfloat16, DEVICE)
    args = (cache.k_cache, cache.v_cache, cu, cache.seq_lens, cache.block_tables)
    q = torch.randn(int(cu[-1]), 16, 128, device=DEVICE).to(torch.bfloat16)
    ref = prefill_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:], 0.088)
    for tiles in prefill_tile_variants(torch.bfloat16, 128):
        out = prefill_attention(q, *args, 0.088, tile_config=tiles)
        _assert_close(f"prefill tiles {describe_tiles(tiles)}", out, ref, TOL[torch.bfloat16])


def test_prefill_attention_tma_reads_only_the_sequence() -> None:
    """TMA loads whole tiles of a page: slots past a sequence's end (another sequence's
    values, here NaN) must not reach its output."""
    from minivllm.kernels.prefill_attention import (
        _tile_config,
        prefill_attention,
        prefill_attention_ref,
    )
    from minivllm.kernels.testing import paged_kv, poison_unowned_slots

    seqs = [(17, 17), (300, 300), (2048, 1000), (70, 1)]
    cu = torch.tensor([0, *itertools.accumulate(q for _, q in seqs)], dtype=torch.int32,
                      device=DEVICE)
    cache = paged_kv([s for s, _ in seqs], 8, 128, 256, torch.bfloat16, DEVICE)
    k_cache, v_cache = poison_unowned_slots(cache, [s for s, _ in seqs])
    args = (k_cache, v_cache, cu, cache.seq_lens, cache.block_tables)
    q = torch.randn(int(cu[-1]), 16, 128, device=DEVICE).to(torch.bfloat16)
    ref = prefill_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:], 0.088)
    for block_m, warps in ((64, 4), (128, 8)):
        tiles = dict(_tile_config(torch.bfloat16, 128), BLOCK_M=block_m, BLOCK_N=64,
                     num_warps=warps, num_stages=3, TMA=True)
        out = prefill_attention(q, *args, 0.088, tile_config=tiles)
        _assert_close(f"prefill TMA M{block_m}", out, ref, TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kvcache(dtype: torch.dtype) -> None:
    from minivllm.kernels.store_kvcache import store_kvcache, store_kvcache_ref
    from minivllm.kernels.testing import paged_kv

    cache = paged_kv([4096], 8, 128, 256, dtype, DEVICE, spare_blocks=8)
    num_slots = cache.k_cache.shape[0] * 256
    qkv = torch.randn(3000, (16 + 16) * 128, device=DEVICE).to(dtype)
    key = qkv[:, 16 * 128 : 24 * 128].view(3000, 8, 128)  # strided views, as from QKV
    value = qkv[:, 24 * 128 :].view(3000, 8, 128)
    slots = torch.randperm(num_slots, device=DEVICE)[:3000]
    slots[::7] = -1
    k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    store_kvcache(key, value, cache.k_cache, cache.v_cache, slots)
    assert torch.equal(cache.k_cache, k_ref) and torch.equal(cache.v_cache, v_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm(dtype: torch.dtype) -> None:
    from minivllm.kernels.rms_norm import rms_norm, rms_norm_ref

    x = torch.randn(4096, 1024, device=DEVICE).to(dtype)
    residual = torch.randn(4096, 1024, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(1024, device=DEVICE)).to(dtype)
    out, new_res = rms_norm(x, weight, 1e-6, residual)
    ref, ref_res = rms_norm_ref(x, weight, 1e-6, residual)
    _assert_close(f"rms_norm+residual {dtype}", out, ref, TOL[dtype])
    _assert_close(f"rms_norm new residual {dtype}", new_res, ref_res, TOL[dtype])
    # Qwen3's per-head q norm on a strided view of the QKV output.
    qkv = torch.randn(4096, 32 * 128, device=DEVICE).to(dtype)
    q = qkv[:, : 16 * 128].view(4096, 16, 128)
    head_weight = (1 + 0.1 * torch.randn(128, device=DEVICE)).to(dtype)
    _assert_close(f"rms_norm per head {dtype}", rms_norm(q, head_weight, 1e-6)[0],
                  rms_norm_ref(q, head_weight, 1e-6)[0], TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", HEADS)
def test_rotary(dtype: torch.dtype, heads: tuple) -> None:
    from minivllm.kernels.rotary import rotary, rotary_ref

    num_heads, num_kv_heads, head_dim = heads
    cos_sin = cos_sin_table(40960, head_dim, DEVICE)
    qkv = torch.randn(2048, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(2048, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(2048, num_kv_heads, head_dim)
    positions = torch.randint(0, 40960, (2048,), device=DEVICE)
    q_ref, k_ref = rotary_ref(positions, q, k, cos_sin)
    q_out, k_out = rotary(positions, q, k, cos_sin)
    _assert_close(f"rotary q {dtype} {heads}", q_out, q_ref, TOL[dtype])
    _assert_close(f"rotary k {dtype} {heads}", k_out, k_ref, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    from minivllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

    x = torch.randn(4096, 2 * 3072, device=DEVICE).to(dtype)
    _assert_close(f"silu_and_mul {dtype}", silu_and_mul(x), silu_and_mul_ref(x), TOL[dtype])


# -- fused decode-path kernels ------------------------------------------------------------

# (name, hidden, heads, kv_heads, head_dim, intermediate, vocab)
@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_gemv(model) -> None:
    """bf16 against an fp32 product of the same bf16 inputs; bound 1e-2 relative (bf16
    output rounding is ~3e-3). Rows 1, 2, 4, 8; default tiles and both inner paths."""
    from minivllm.kernels.gemv import (
        _default_config,
        default_config,
        gemv,
        rms_norm_gemv,
        rms_norm_gemv_ref,
    )

    _, hidden, heads, kv_heads, head_dim, inter, vocab = model
    for name, n, k in projections(hidden, heads, kv_heads, head_dim, inter, vocab):
        w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(torch.bfloat16)
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
            ref = torch.nn.functional.linear(x.float(), w.float())
            configs = [None]
            if m in (1, 8) and name != "lm_head":
                base = default_config(m, n, k, torch.bfloat16)
                configs.append(dict(base, USE_DOT=not base["USE_DOT"], BLOCK_N=16, BLOCK_K=128,
                                    num_warps=4))
            if m == 1 and name != "lm_head":
                # MINIVLLM_GEMV_MAX_K=4096's tiles (Qwen3's down: one tile of K = 3072).
                configs.append(_default_config(1, n, k, torch.bfloat16, 132, False, 4096))
            for config in configs:
                _assert_close(f"gemv {name} {m}x{n}x{k} {config}", gemv(x, w, config=config),
                              ref, TOL[torch.bfloat16])
        if name in ("qkv", "gate_up"):
            for m in (1, 4):
                x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
                residual = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
                norm_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(torch.bfloat16)
                silu = name == "gate_up"
                got, got_res = rms_norm_gemv(x, residual, norm_w, 1e-6, w, silu_mul=silu)
                want, want_res = rms_norm_gemv_ref(x.float(), residual.float(), norm_w.float(),
                                                   1e-6, w.float(), silu_mul=silu)
                _assert_close(f"rms_norm_gemv {name} {m} silu={silu}", got, want,
                              TOL[torch.bfloat16])
                _assert_close(f"rms_norm_gemv {name} residual", got_res, want_res, 1e-2)
                if m == 1:  # several K tiles: the two-pass norm path
                    cfg = dict(default_config(1, n // (2 if silu else 1), k, torch.bfloat16,
                                              silu_mul=silu), BLOCK_K=128)
                    got2, _ = rms_norm_gemv(x, residual, norm_w, 1e-6, w, silu_mul=silu,
                                            config=cfg)
                    _assert_close(f"rms_norm_gemv {name} K tiles of 128", got2, want,
                                  TOL[torch.bfloat16])
                    # MINIVLLM_GEMV_SILU_TILE=8192 / MINIVLLM_GEMV_MAX_K=4096's tiles.
                    cfg = _default_config(1, n // (2 if silu else 1), k, torch.bfloat16, 132,
                                          silu, 4096, 8192)
                    got3, _ = rms_norm_gemv(x, residual, norm_w, 1e-6, w, silu_mul=silu,
                                            config=cfg)
                    _assert_close(f"rms_norm_gemv {name} {cfg}", got3, want,
                                  TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_qkv_rotary_store(dtype: torch.dtype, model) -> None:
    """Against the unfused references at the same dtype (bound 1e-2 bf16, 1e-4 fp32);
    positions up to 32k, padding tokens (slot -1) write nothing."""
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store, qkv_rotary_store_ref
    from minivllm.kernels.testing import paged_kv

    _, _, heads, kv_heads, head_dim, _, _ = model
    cos_sin = cos_sin_table(40960, head_dim, DEVICE)
    cache = paged_kv([4096], kv_heads, head_dim, 256, dtype, DEVICE, spare_blocks=8)
    num_slots = cache.k_cache.shape[0] * 256
    tokens = 1000
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    positions = torch.randint(0, 40960, (tokens,), device=DEVICE)
    slots = torch.randperm(num_slots, device=DEVICE)[:tokens]
    slots[::9] = -1
    for qk_norm in (True, False):
        weights = qk_norm_weights(head_dim, dtype, DEVICE) if qk_norm else {}
        k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
        q_ref = qkv_rotary_store_ref(positions, qkv, heads, cos_sin, k_ref, v_ref, slots,
                                     **weights)
        q = qkv_rotary_store(positions, qkv, heads, cos_sin, cache.k_cache, cache.v_cache,
                             slots, **weights)
        name = f"qkv_rotary_store {dtype} {model[0]} norm={qk_norm}"
        _assert_close(name + " q", q, q_ref, TOL[dtype])
        _assert_close(name + " k_cache", cache.k_cache, k_ref, TOL[dtype])
        assert torch.equal(cache.v_cache, v_ref), name + " v_cache"


@pytest.mark.parametrize("num_splits", [None, 32, 64, 128])
def test_decode_attention_batch1_32k(num_splits) -> None:
    """Batch 1 from 1 to 32k context in a launch sized for 32k (the engine's graph at
    max_model_length 32k): short contexts leave most splits empty; bound 1e-2 (bf16)."""
    from minivllm.kernels.decode_attention import decode_attention, decode_attention_ref
    from minivllm.kernels.testing import paged_kv

    for context in (1, 100, 3000, 32768):
        cache = paged_kv([context], 8, 128, 256, torch.bfloat16, DEVICE,
                         spare_columns=(32768 - context) // 256 + 1)
        args = (cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables)
        q = torch.randn(1, 16, 128, device=DEVICE).to(torch.bfloat16)
        ref = decode_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:],
                                   0.088)
        out = decode_attention(q, *args, 0.088, num_splits=num_splits)
        _assert_close(f"decode batch 1 ctx {context} splits {num_splits}", out, ref,
                      TOL[torch.bfloat16])


def test_gemv_pdl_chain_in_graph() -> None:
    """Programmatic dependent launch: each GEMV reads the previous one's output right after
    its gdc_wait. A chain like a layer's (o -> add + norm + gate_up + SiLU -> down ->
    add + norm + qkv) run with PDL, eagerly and replayed from a CUDA graph with new inputs,
    must equal the same chain without PDL bit for bit (a missing wait reads stale data)."""
    from minivllm.kernels.gemv import default_config, gemv, rms_norm_gemv

    torch.use_deterministic_algorithms(False)  # no NaN-fill kernels inside the capture
    hidden, inter, qkv_out = 1024, 3072, 4096
    w_o = (torch.randn(hidden, 2048, device=DEVICE) / 45).to(torch.bfloat16)
    w_gu = (torch.randn(2 * inter, hidden, device=DEVICE) / 32).to(torch.bfloat16)
    w_down = (torch.randn(hidden, inter, device=DEVICE) / 55).to(torch.bfloat16)
    w_qkv = (torch.randn(qkv_out, hidden, device=DEVICE) / 32).to(torch.bfloat16)
    norm_w = torch.ones(hidden, device=DEVICE, dtype=torch.bfloat16)
    attn = torch.randn(1, 2048, device=DEVICE).to(torch.bfloat16)
    residual = torch.randn(1, hidden, device=DEVICE).to(torch.bfloat16)

    def chain(pdl: bool):
        def cfg(n, k, silu=False):
            return dict(default_config(1, n, k, torch.bfloat16, silu_mul=silu), PDL=pdl)

        o = gemv(attn, w_o, config=cfg(hidden, 2048))
        act, res = rms_norm_gemv(o, residual, norm_w, 1e-6, w_gu, silu_mul=True,
                                 config=cfg(inter, hidden, True))
        down = gemv(act, w_down, config=cfg(hidden, inter))
        return rms_norm_gemv(down, res, norm_w, 1e-6, w_qkv, config=cfg(qkv_out, hidden))

    for pdl in (False, True):
        chain(pdl)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = chain(True)
    for _ in range(3):
        attn.normal_()
        residual.normal_()
        graph.replay()
        plain = chain(False)
        eager_pdl = chain(True)
        for got in (out_graph, eager_pdl):
            assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


@pytest.mark.parametrize("one_launch", [False, True], ids=["two-launches", "one-launch"])
def test_attention_path_pdl_in_graph(monkeypatch: pytest.MonkeyPatch, one_launch: bool) -> None:
    """MINIVLLM_PDL=all: q/k norm + rotary + KV store -> decode attention (16 splits merged
    in the kernel) -> o GEMV, each launched with PDL, replayed from a CUDA graph, equals the
    chain without PDL bit for bit (each kernel reads what the one before wrote). One launch:
    the store and the attention in `qkv_decode_attention`."""
    from minivllm.kernels import pdl
    from minivllm.kernels.decode_attention import decode_attention, qkv_decode_attention
    from minivllm.kernels.gemv import gemv
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store
    from minivllm.kernels.testing import paged_kv

    torch.use_deterministic_algorithms(False)  # no NaN-fill kernels inside the capture
    heads, kv_heads, head_dim = 16, 8, 128
    cache = paged_kv([3000], kv_heads, head_dim, 256, torch.bfloat16, DEVICE, spare_columns=4)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(torch.bfloat16)
    positions = torch.tensor([2999], device=DEVICE)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    slots[0] = cache.block_tables[0, 2999 // 256].long() * 256 + 2999 % 256
    cos_sin = cos_sin_table(4096, head_dim, DEVICE)
    norm_w = torch.ones(head_dim, device=DEVICE, dtype=torch.bfloat16)
    w_o = (torch.randn(1024, heads * head_dim, device=DEVICE) / 45).to(torch.bfloat16)

    def chain():
        step = (cache.seq_lens, cache.block_tables, 0.088)
        if one_launch:
            o = qkv_decode_attention(positions, qkv, heads, cos_sin, cache.k_cache,
                                     cache.v_cache, slots, *step, norm_w, norm_w, num_splits=16)
        else:
            q = qkv_rotary_store(positions, qkv, heads, cos_sin, cache.k_cache, cache.v_cache,
                                 slots, norm_w, norm_w)
            o = decode_attention(q, cache.k_cache, cache.v_cache, *step, num_splits=16)
        return gemv(o.flatten(1), w_o)

    def run_with(setting: str, graphed: bool) -> torch.Tensor:
        monkeypatch.setenv("MINIVLLM_PDL", setting)
        pdl._pdl_level.cache_clear()
        chain()  # compile outside the capture
        if not graphed:
            return chain().clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        graph.replay()
        return out.clone()

    try:
        for _ in range(2):
            qkv.normal_()
            want = run_with("0", graphed=False)
            assert torch.equal(run_with("all", graphed=True), want)
            assert torch.equal(run_with("all", graphed=False), want)
    finally:
        pdl._pdl_level.cache_clear()


def test_decode_attention_merge_in_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split kernel merges its own partials: the last program of each (sequence, KV
    head) to finish, found with a counter it zeroes again. Four launches in a chain (each
    one's q is the one before's output, as layers follow each other) share one counter
    buffer; captured in a CUDA graph and replayed with new contexts, they equal the same
    chain run eagerly bit for bit, with PDL (MINIVLLM_PDL=all) and without it, and the
    counters are zero after every replay. Bound against the float64 reference: 1e-2."""
    from minivllm.kernels import pdl
    from minivllm.kernels.decode_attention import (
        decode_attention,
        decode_attention_ref,
        decode_counters,
    )
    from minivllm.kernels.testing import paged_kv

    torch.use_deterministic_algorithms(False)  # no NaN-fill kernels inside the capture
    cache = paged_kv([8192] * 4, 8, 128, 256, torch.bfloat16, DEVICE, spare_columns=0)
    seq_lens = cache.seq_lens.clone()
    kv = (cache.k_cache, cache.v_cache, seq_lens, cache.block_tables)
    q = torch.randn(4, 16, 128, device=DEVICE).to(torch.bfloat16)
    counters = decode_counters(4, 8, DEVICE)

    def chain() -> list[torch.Tensor]:
        outs = [q]
        for _ in range(4):
            outs.append(decode_attention(outs[-1], *kv, 0.088, num_splits=32,
                                         counters=counters))
        return outs[1:]

    def run_with(setting: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        monkeypatch.setenv("MINIVLLM_PDL", setting)
        pdl._pdl_level.cache_clear()
        eager = [o.clone() for o in chain()]  # also compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain()
        graph.replay()
        assert not counters.any(), f"PDL={setting}: counters not reset after the replay"
        return eager, [o.clone() for o in outs]

    try:
        for lens in ([8192, 1, 3000, 8192], [300, 20, 8000, 257], [5000, 6000, 7000, 8191]):
            seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
            q.normal_()
            plain_eager, plain_graph = run_with("0")
            pdl_eager, pdl_graph = run_with("all")
            for i, want in enumerate(plain_eager):
                for name, got in (("graph", plain_graph[i]), ("PDL eager", pdl_eager[i]),
                                  ("PDL graph", pdl_graph[i])):
                    assert torch.equal(got, want), f"{lens} launch {i}: {name} != eager"
            ref = decode_attention_ref(q.double(), *(a.double() for a in kv[:2]), *kv[2:],
                                       0.088)
            _assert_close(f"decode merge in graph {lens}", plain_eager[0], ref,
                          TOL[torch.bfloat16])
    finally:
        pdl._pdl_level.cache_clear()


@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_qkv_decode_attention(model) -> None:
    """q/k norm + rotary + KV store in the decode attention kernel's prologue (bf16, with
    and without q/k norm, ragged contexts 1 to 8k and a padding row with slot -1): the
    real rows' output against the float64 reference of the two steps (bound 1e-2), the stored k
    against `qkv_rotary_store_ref` (1e-2) and v exact; and against the two launches it
    replaces (qkv_rotary_store + decode_attention, 1e-2)."""
    from minivllm.kernels.decode_attention import (
        decode_attention,
        decode_attention_ref,
        qkv_decode_attention,
    )
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store, qkv_rotary_store_ref
    from minivllm.kernels.testing import paged_kv

    _, _, heads, kv_heads, head_dim, _, _ = model
    dtype = torch.bfloat16
    lens = [1, 2, 255, 256, 257, 1000, 4095, 8192, 1]  # the last: padding (slot -1)
    cos_sin = cos_sin_table(8192, head_dim, DEVICE)
    cache = paged_kv(lens, kv_heads, head_dim, 256, dtype, DEVICE)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    positions = cache.seq_lens.long() - 1
    rows = torch.arange(len(lens), device=DEVICE)
    slots = cache.block_tables[rows, positions // 256].long() * 256 + positions % 256
    slots[-1] = -1
    step = (cache.seq_lens, cache.block_tables, head_dim**-0.5)
    for qk_norm in (True, False):
        norms = qk_norm_weights(head_dim, dtype, DEVICE) if qk_norm else {}
        k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
        q_ref = qkv_rotary_store_ref(positions, qkv, heads, cos_sin, k_ref, v_ref, slots, **norms)
        ref = decode_attention_ref(q_ref.double(), k_ref.double(), v_ref.double(), *step)
        k_two, v_two = cache.k_cache.clone(), cache.v_cache.clone()
        q = qkv_rotary_store(positions, qkv, heads, cos_sin, k_two, v_two, slots, **norms)
        two = decode_attention(q, k_two, v_two, *step, num_splits=16)
        for num_splits in (None, 1, 16):
            k_out, v_out = cache.k_cache.clone(), cache.v_cache.clone()
            out = qkv_decode_attention(positions, qkv, heads, cos_sin, k_out, v_out, slots,
                                       *step, **norms, num_splits=num_splits)
            name = f"qkv_decode_attention {model[0]} norm={qk_norm} splits {num_splits}"
            # The padding row's output is read by no sequence: with the K/V prefetch (on by
            # default) it attends over its own new token, which its slot -1 never stored.
            _assert_close(name, out[:-1], ref[:-1], TOL[dtype])
            _assert_close(name + " against two launches", out[:-1], two[:-1], TOL[dtype])
            _assert_close(name + " k_cache", k_out, k_ref, TOL[dtype])
            assert torch.equal(v_out, v_ref), name + " v_cache"


@pytest.mark.parametrize("one_page", ["0", "1"])
def test_qkv_decode_attention_batch1_32k(one_page: str, decode_switches) -> None:
    """Batch 1 from 1 to 32k context in a launch sized for 32k, the new token stored by the
    last used split and read back by it: against the references, bound 1e-2 (bf16); with
    one block-table entry a tile or one a position (MINIVLLM_DECODE_ONE_PAGE)."""
    from minivllm.kernels.decode_attention import qkv_decode_attention, qkv_decode_attention_ref
    from minivllm.kernels.testing import paged_kv

    decode_switches(MINIVLLM_DECODE_ONE_PAGE=one_page)

    heads, kv_heads, head_dim = 16, 8, 128
    cos_sin = cos_sin_table(32768, head_dim, DEVICE)
    norm_w = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)).to(torch.bfloat16)
    for context in (1, 100, 3000, 32768):
        cache = paged_kv([context], kv_heads, head_dim, 256, torch.bfloat16, DEVICE,
                         spare_columns=(32768 - context) // 256 + 1)
        qkv = torch.randn(1, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(torch.bfloat16)
        positions = torch.tensor([context - 1], device=DEVICE)
        slots = cache.block_tables[0, (context - 1) // 256].long().view(1) * 256 + (
            (context - 1) % 256
        )
        step = (cache.seq_lens, cache.block_tables, 0.088)
        k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
        ref = qkv_decode_attention_ref(positions, qkv.double(), heads, cos_sin.double(),
                                       k_ref.double(), v_ref.double(), slots, *step,
                                       norm_w.double(), norm_w.double())
        out = qkv_decode_attention(positions, qkv, heads, cos_sin, cache.k_cache, cache.v_cache,
                                   slots, *step, norm_w, norm_w)
        _assert_close(f"qkv_decode_attention batch 1 ctx {context}", out, ref,
                      TOL[torch.bfloat16])


@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_qkv_decode_attention_prefetch_and_min_split(model) -> None:
    """kernels/tuning.py's attention switches, bf16, contexts 1 to 8k (+ batch 1 at 32k):
    the first K/V tile loaded before the wait gives the same cache bits as without it and
    the same output to within bf16's rounding (torch's default tolerances for bf16; three
    tile shapes: MINIVLLM_DECODE_TILE's); splits of at least 512 positions agree with the
    float64 reference (1e-2).

    NOTE: not the same output bits: the prefetched tile's step is compiled apart from the
    loop's, and the compiler may fuse a multiply-add in one and not the other (an H100
    with Triton 3.6, Qwen3-0.6B's heads: up to 4.9e-4 apart, on launches of several
    splits or of 128-position tiles; the interpreted check in test_kernels.py compares
    bits)."""
    from minivllm.kernels.decode_attention import (
        _tile_config,
        decode_counters,
        qkv_decode_attention,
        qkv_decode_attention_ref,
    )
    from minivllm.kernels.testing import describe_tiles, paged_kv

    _, _, heads, kv_heads, head_dim, _, _ = model
    dtype = torch.bfloat16
    for lens in ([1, 2, 127, 128, 129, 255, 257, 511, 513, 1000, 4095, 8192, 1], [32768]):
        n = len(lens)
        real = slice(0, n - 1) if n > 1 else slice(0, 1)  # the last of a batch: padding
        cos_sin = cos_sin_table(max(lens), head_dim, DEVICE)
        cache = paged_kv(lens, kv_heads, head_dim, 256, dtype, DEVICE)
        qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
        positions = cache.seq_lens.long() - 1
        rows = torch.arange(n, device=DEVICE)
        slots = cache.block_tables[rows, positions // 256].long() * 256 + positions % 256
        if n > 1:
            slots[-1] = -1
        step = (cache.seq_lens, cache.block_tables, head_dim**-0.5)
        norms = qk_norm_weights(head_dim, dtype, DEVICE)
        k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
        ref = qkv_decode_attention_ref(positions, qkv.double(), heads, cos_sin.double(),
                                       k_ref.double(), v_ref.double(), slots, *step,
                                       **{k: w.double() for k, w in norms.items()})
        counters = decode_counters(n, kv_heads, DEVICE)
        for num_splits, min_split in ((None, None), (32, 512), (1, None)):
            for tiles in (None, dict(_tile_config(dtype), num_warps=8),
                          dict(_tile_config(dtype), BLOCK_N=64, num_warps=8, num_stages=1)):
                outs = []
                for prefetch in (False, True):
                    k_out, v_out = cache.k_cache.clone(), cache.v_cache.clone()
                    out = qkv_decode_attention(positions, qkv, heads, cos_sin, k_out, v_out,
                                               slots, *step, **norms, num_splits=num_splits,
                                               counters=counters, prefetch=prefetch,
                                               min_split_len=min_split, tile_config=tiles)
                    name = (f"{model[0]} ctx {max(lens)} splits {num_splits} min {min_split} "
                            f"tiles {tiles and describe_tiles(tiles)} prefetch {prefetch}")
                    _assert_close(name, out[real], ref[real], TOL[dtype])
                    outs.append((out[real], k_out, v_out))
                    assert not counters.any()
                (out, k_out, v_out), (pre, k_pre, v_pre) = outs
                assert torch.equal(k_pre, k_out) and torch.equal(v_pre, v_out), name
                torch.testing.assert_close(pre, out, msg=name)


def test_fill_tokens() -> None:
    from minivllm.kernels.fill_tokens import fill_tokens, fill_tokens_ref

    prev = torch.randint(0, 151936, (256,), device=DEVICE)
    for n in (1, 2, 8, 16, 256):
        ids = torch.randint(0, 151936, (n,), device=DEVICE)
        fill = torch.randint(-1, 256, (n,), device=DEVICE)
        assert torch.equal(fill_tokens(ids, fill, prev), fill_tokens_ref(ids, fill, prev))


def test_sample_rows() -> None:
    """Greedy rows are torch's argmax of the bf16 logits; sampled rows follow softmax(x / T)
    wherever in a 151,936-token vocabulary the likely tokens lie."""
    from minivllm.kernels.sample import sample_rows

    vocab = 151936
    logits = torch.randn(256, vocab, device=DEVICE).to(torch.bfloat16) * 4
    greedy = torch.zeros(256, device=DEVICE)
    seed = torch.tensor([5], device=DEVICE)
    assert torch.equal(sample_rows(logits, greedy, seed), logits.float().argmax(-1))
    # Eight likely tokens spread over the vocabulary (other blocks, other loop steps), the
    # rest 30 nats below: the draws' frequencies are the eight's softmax at T = 0.7.
    cols = torch.tensor([3, 1500, 4097, 20000, 65536, 100003, 151000, 151935], device=DEVICE)
    x = torch.linspace(-1.0, 1.0, 8, device=DEVICE).to(torch.bfloat16).float()
    rows = 20000
    big = torch.full((rows, vocab), -30.0, device=DEVICE, dtype=torch.bfloat16)
    big[:, cols] = x.to(torch.bfloat16)
    temps = torch.full((rows,), 0.7, device=DEVICE)
    tokens = sample_rows(big, temps, seed)
    assert torch.isin(tokens, cols).all()
    freq = (tokens[:, None] == cols[None, :]).float().mean(0)
    assert (freq - torch.softmax(x / 0.7, -1)).abs().max() < 0.012, freq
    assert not torch.equal(tokens, sample_rows(big, temps, seed + 1))
    # Under a bitmask allowing only the last four of the eight: the draws follow their
    # softmax; greedy rows take the masked argmax.
    words = (vocab + 31) // 32

    def allow(mask: torch.Tensor, col: int) -> None:  # bit 31 is the int32's sign
        bit = 1 << (col % 32)
        mask[:, col // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit

    bitmask = torch.zeros((rows, words), dtype=torch.int32, device=DEVICE)
    for c in cols[4:].tolist():
        allow(bitmask, c)
    tokens = sample_rows(big, temps, seed, bitmask)
    freq = (tokens[:, None] == cols[None, 4:]).float().mean(0)
    assert (freq - torch.softmax(x[4:] / 0.7, -1)).abs().max() < 0.012, freq
    allowed = torch.full((256, vocab), float("-inf"), device=DEVICE)
    allowed[:, cols[:6]] = 0.0
    small = torch.zeros((256, words), dtype=torch.int32, device=DEVICE)
    for c in cols[:6].tolist():
        allow(small, c)
    assert torch.equal(sample_rows(logits, greedy, seed, small),
                       (logits.float() + allowed).argmax(-1))
