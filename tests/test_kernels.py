"""The Triton kernels on the CPU, under Triton's interpreter, against their references.

Triton reads TRITON_INTERPRET when a kernel module is imported, so each kernel group runs
in its own subprocess (this file run as a script: `python test_kernels.py GROUP`) with the
variable set there; nothing leaks into the other tests of this pytest process. Shapes are
small (the interpreter is slow); fp32 and fp16 only (bf16 `tl.dot` is wrong in the
interpreter; bf16 is checked on the GPU in test_kernels_gpu.py). Wrapper-allocated outputs
are NaN-poisoned (kernels.testing.poisoned_empty), so unwritten elements fail.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import subprocess
import sys

import pytest
import torch
from conftest import run_kernel_checks

from minivllm.kernels.testing import cos_sin_table, qk_norm_weights

HAS_TRITON = importlib.util.find_spec("triton") is not None
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = (torch.float32, torch.float16)
HEADS = ((4, 2), (6, 2), (2, 2))  # (num_heads, num_kv_heads): GQA groups of 2, 3 and 1
HEAD_DIM = 64


def _assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    from minivllm.kernels.testing import rel_err

    err = rel_err(out, ref)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol:g}"


def _fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype):
    """q, k, v as strided views of one fused projection output, as the engine has them."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * HEAD_DIM).to(dtype)
    q, k, v = qkv.split([num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM,
                         num_kv_heads * HEAD_DIM], dim=-1)
    return (qkv, q.view(num_tokens, num_heads, HEAD_DIM),
            k.view(num_tokens, num_kv_heads, HEAD_DIM), v.view(num_tokens, num_kv_heads, HEAD_DIM))


# ----------------------------------------------------------------------------------------
# Checks, run inside the interpreter subprocess.


def _expect_value_errors(cases: list) -> None:
    """Each (call, message): the call raises a ValueError whose text has the message."""
    for fn, message in cases:
        try:
            fn()
        except ValueError as e:
            assert message in str(e), f"expected {message!r} in {e!r}"
        else:
            raise AssertionError(f"no ValueError mentioning {message!r}")


def check_store_kvcache() -> None:
    from minivllm.kernels.store_kvcache import store_kvcache, store_kvcache_ref
    from minivllm.kernels.testing import paged_kv

    for dtype, block_size, key_dtype in [
        (torch.float32, 16, torch.float32),
        (torch.float16, 32, torch.float16),
        (torch.float16, 16, torch.float32),  # the cache's dtype wins
    ]:
        cache = paged_kv([40, 7], 2, HEAD_DIM, block_size, dtype, "cpu", spare_blocks=2)
        num_slots = cache.k_cache.shape[0] * block_size
        _, _, key, value = _fused_qkv(9, 4, 2, key_dtype)
        slots = torch.randperm(num_slots)[:9]
        slots[[2, 5]] = -1
        k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
        store_kvcache_ref(key, value, k_ref, v_ref, slots)
        store_kvcache(key, value, cache.k_cache, cache.v_cache, slots.int())
        # A copy: exact, and slots nobody writes (-1 included) keep their contents.
        assert torch.equal(cache.k_cache, k_ref), f"k_cache {dtype} {block_size}"
        assert torch.equal(cache.v_cache, v_ref), f"v_cache {dtype} {block_size}"


def check_rms_norm() -> None:
    from minivllm.kernels.rms_norm import rms_norm, rms_norm_ref

    for dtype in DTYPES:
        for weight_dtype in (dtype, torch.float32):
            x = torch.randn(7, 300).to(dtype)
            residual = torch.randn(7, 300).to(dtype)
            weight = (1 + 0.1 * torch.randn(300)).to(weight_dtype)
            out, new_res = rms_norm(x, weight, 1e-6, residual)
            ref, ref_res = rms_norm_ref(x, weight, 1e-6, residual)
            _assert_close(f"rms_norm+residual {dtype}", out, ref, TOL[dtype])
            _assert_close(f"new residual {dtype}", new_res, ref_res, TOL[dtype])
            out, none = rms_norm(x, weight, 1e-6)
            assert none is None
            _assert_close(f"rms_norm {dtype}", out, rms_norm_ref(x, weight, 1e-6)[0], TOL[dtype])
        # Per-head q-norm (Qwen3) on a strided view of a fused QKV output.
        _, q, _, _ = _fused_qkv(5, 4, 2, dtype)
        weight = (1 + 0.1 * torch.randn(HEAD_DIM)).to(dtype)
        out, _ = rms_norm(q, weight, 1e-6)
        _assert_close(f"rms_norm per head {dtype}", out, rms_norm_ref(q, weight, 1e-6)[0],
                      TOL[dtype])


def check_rotary() -> None:
    from minivllm.kernels.rotary import rotary, rotary_ref

    cache = cos_sin_table(4096, HEAD_DIM)
    for dtype in DTYPES:
        for num_heads, num_kv_heads in HEADS:
            qkv, q, k, v = _fused_qkv(11, num_heads, num_kv_heads, dtype)
            positions = torch.randint(1, 4096, (11,))
            q_ref, k_ref = rotary_ref(positions, q, k, cache)
            v_before = v.clone()
            q_out, k_out = rotary(positions, q, k, cache)
            assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
            _assert_close(f"rotary q {dtype}", q_out, q_ref, TOL[dtype])
            _assert_close(f"rotary k {dtype}", k_out, k_ref, TOL[dtype])
            assert torch.equal(v, v_before), "rotary wrote outside q and k"


def check_silu_and_mul() -> None:
    from minivllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

    for dtype in DTYPES:
        for inter in (300, 1100):  # masked tail; several column blocks
            x = torch.randn(9, 2 * inter).to(dtype)
            ref = silu_and_mul_ref(x.float())
            _assert_close(f"silu_and_mul {dtype} {inter}", silu_and_mul(x), ref, TOL[dtype])


def check_fill_tokens() -> None:
    from minivllm.kernels.fill_tokens import fill_tokens, fill_tokens_ref

    prev = torch.tensor([101, 102, 103, 104, 105, 106, 107, 108])
    ids = torch.tensor([5, -1, 7, -1, 0])
    fill = torch.tensor([-1, 3, -1, 0, -1])  # rows 1 and 3 take the previous step's tokens
    want = torch.tensor([5, 104, 7, 101, 0])
    assert torch.equal(fill_tokens_ref(ids, fill, prev), want)
    assert torch.equal(fill_tokens(ids, fill, prev), want)
    assert torch.equal(fill_tokens(ids[:1], fill[:1], prev), want[:1])
    g = torch.Generator().manual_seed(0)
    for n in (1, 8, 17):  # padded to 16 / 32 rows
        ids = torch.randint(0, 1000, (n,), generator=g)
        fill = torch.randint(-1, 8, (n,), generator=g)
        assert torch.equal(fill_tokens(ids, fill, prev), fill_tokens_ref(ids, fill, prev))


def check_sample_rows() -> None:
    from minivllm.kernels.dispatch import num_sms
    from minivllm.kernels.sample import num_splits, sample_rows, sample_rows_ref

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 5000, generator=g)
    logits[0, 100] = logits[0, 4321] = 50.0  # a tie: the first column, as torch's argmax
    logits[3] = float("-inf")  # nothing allowed: column 0, as torch's argmax
    greedy = torch.zeros(5)
    assert torch.equal(sample_rows(logits, greedy, torch.tensor([1])), logits.argmax(-1))
    assert sample_rows(logits.half(), greedy, torch.tensor([1]))[0] == 100
    temps = torch.tensor([0.0, 0.7, 0.0, 1.0, 1.3])
    first = sample_rows(logits, temps, torch.tensor([11]))
    assert torch.equal(first, sample_rows(logits, temps, torch.tensor([11])))  # same seed
    assert first[0] == 100 and first[2] == logits[2].argmax() and first[3] == 0
    # A row's vocabulary split across programs (five a row at 5 rows here, two at 40): the
    # same tokens, a tie across the splits included (row 0's 100 and 4321).
    assert num_splits(5, 5000, num_sms(logits.device)) == (5, 1024)
    assert num_splits(40, 5000, num_sms(logits.device)) == (2, 3072)
    more = torch.cat([logits, torch.randn(35, 5000, generator=g)])
    more_temps = torch.cat([temps, torch.rand(35, generator=g)])
    assert torch.equal(sample_rows(more, more_temps, torch.tensor([11]))[:5], first)
    assert torch.equal(sample_rows(more, more_temps * 0, torch.tensor([1]))[:5],
                       logits.argmax(-1))
    draws = torch.stack([sample_rows(logits, temps, torch.tensor([s]))[1] for s in range(20)])
    assert draws.unique().numel() > 1  # other seeds, other draws
    # Frequencies over 3000 rows of one distribution (one draw each): softmax(logits / T).
    row = torch.tensor([1.0, 2.0, 0.5, -1.0, float("-inf"), 1.5])
    t = 0.8
    tokens = sample_rows(row.repeat(3000, 1), torch.full((3000,), t), torch.tensor([7]))
    freq = torch.bincount(tokens, minlength=6).float() / 3000
    assert freq[4] == 0  # a -inf logit is never drawn
    assert (freq - torch.softmax(row / t, -1)).abs().max() < 0.04, freq
    # A grammar's bitmask: row 0 may take only 7 and 4321, row 1 everything but the
    # columns below 4096, rows 2-4 everything (all ones).
    words = (5000 + 31) // 32
    bitmask = torch.full((5, words), -1, dtype=torch.int32)
    bitmask[0] = 0
    bitmask[0, 0] = 1 << 7
    bitmask[0, 4321 // 32] = 1 << (4321 % 32)
    bitmask[1, : 4096 // 32] = 0
    masked = sample_rows(logits, temps, torch.tensor([11]), bitmask)
    assert masked[0] == 4321  # the larger of the two allowed
    assert torch.equal(masked[2:], first[2:])  # all-ones rows: the same tokens as unmasked
    for s in range(10):
        drawn = sample_rows(logits, temps, torch.tensor([s]), bitmask)
        assert drawn[0] == 4321 and drawn[1] >= 4096
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[0, [7, 4321]] = True
    allowed[1, 4096:] = True
    allowed[2:] = True
    want = logits.masked_fill(~allowed, float("-inf")).argmax(-1)
    assert torch.equal(sample_rows(logits, greedy, torch.tensor([1]), bitmask)[:3], want[:3])
    # The torch version (a kernel set without Triton): the same greedy tokens, masked or not,
    # and masked draws among the allowed tokens only.
    assert torch.equal(sample_rows_ref(logits, greedy, torch.tensor([1])), logits.argmax(-1))
    assert torch.equal(sample_rows_ref(logits, greedy, torch.tensor([1]), bitmask)[:3],
                       want[:3])
    for _ in range(5):
        drawn = sample_rows_ref(logits, temps, torch.tensor([0]), bitmask)
        assert drawn[0] == 4321 and drawn[1] >= 4096
    _expect_value_errors([
        (lambda: sample_rows(logits, torch.zeros(4), torch.tensor([1])), "temperatures has 4"),
        (lambda: sample_rows(logits, greedy, torch.tensor([1, 2])), "seed must hold one"),
        (lambda: sample_rows(logits, greedy, torch.tensor([1]), bitmask[:, :10]),
         "bitmask has shape"),
        (lambda: sample_rows(logits, greedy, torch.tensor([1]), bitmask.long()), "bitmask"),
    ])


def check_sampler_masked_rows() -> None:
    """The sampler's rows under a grammar's bitmask take the fused kernel (here under the
    interpreter) and get the tokens the masked torch path gives: the masked argmax for
    greedy rows, an allowed token for sampled ones; rows wanting logprobs stay on torch."""
    import os

    from minivllm.layers.sampler import Sampler, SamplingTensors, _takes_fused_kernel

    os.environ["MINIVLLM_TRITON"] = "1"  # the Triton path on the CPU (interpreted)
    g = torch.Generator().manual_seed(3)
    vocab, rows = 3000, 4
    logits = torch.randn(rows, vocab, generator=g)
    words = (vocab + 31) // 32
    allowed = torch.rand(rows, vocab, generator=g) < 0.1
    allowed[3] = True  # an unconstrained row: all ones
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (bits.view(rows, words, 32) * weights).sum(-1)
    bitmask = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    want = logits.masked_fill(~allowed, float("-inf")).argmax(-1)

    greedy = SamplingTensors.greedy()
    greedy.token_bitmask, greedy.bitmask_rows = bitmask, [0, 1, 2]
    assert _takes_fused_kernel(logits, greedy)
    sampler = Sampler()
    assert torch.equal(sampler(logits, greedy).token_ids, want)
    fewer = SamplingTensors.greedy()  # the same sampler, a smaller batch next step
    fewer.token_bitmask, fewer.bitmask_rows = bitmask[:2], [0, 1]
    assert torch.equal(sampler(logits[:2], fewer).token_ids, want[:2])
    hot = SamplingTensors(torch.tensor([0.0, 1.0, 0.7, 1.2]), None, None, None,
                          [None] * rows, False, False, False, False,
                          token_bitmask=bitmask, bitmask_rows=[0, 1, 2])
    for _ in range(5):
        tokens = Sampler(torch.Generator().manual_seed(_))(logits, hot).token_ids
        assert tokens[0] == want[0]
        assert all(allowed[r, tokens[r]] for r in range(rows))
    greedy.num_logprobs = 0
    assert not _takes_fused_kernel(logits, greedy)


# Each dtype meets each block size and each GQA group (the interpreter is too slow for the
# full product).
ATTENTION_CASES = [
    (torch.float32, 16, (4, 2)),
    (torch.float32, 32, (6, 2)),
    (torch.float32, 16, (2, 2)),
    (torch.float16, 32, (4, 2)),
    (torch.float16, 16, (6, 2)),
    (torch.float16, 32, (2, 2)),
]

# (seq_len, q_len): a one-token sequence, full prompts, queries after a cached prefix
# (prefix hit / later chunk), one decode-like query, a sequence with no queries this step.
PREFILL_SEQS = [(1, 1), (37, 37), (100, 30), (64, 1), (50, 0), (70, 70)]


def check_prefill_attention() -> None:
    from minivllm.kernels.prefill_attention import prefill_attention, prefill_attention_ref
    from minivllm.kernels.testing import paged_kv, poison_unowned_slots

    seq_lens = [s for s, _ in PREFILL_SEQS]
    cu = torch.tensor([0, *itertools.accumulate(q for _, q in PREFILL_SEQS)], dtype=torch.int32)
    # The last query tiles first: the grid's order does not change a row's result.
    small_tiles = dict(BLOCK_M=16, BLOCK_N=16, DOT_PRECISION="ieee", num_warps=4, num_stages=1,
                       LAST_FIRST=True)
    for dtype, block_size, (num_heads, num_kv_heads) in ATTENTION_CASES:
        cache = paged_kv(seq_lens, num_kv_heads, HEAD_DIM, block_size, dtype, "cpu")
        args = (cache.k_cache, cache.v_cache, cu, cache.seq_lens, cache.block_tables)
        _, q, _, _ = _fused_qkv(int(cu[-1]), num_heads, num_kv_heads, dtype)
        scale = HEAD_DIM**-0.5
        ref = prefill_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:],
                                    scale)
        name = f"prefill {dtype} block {block_size} heads {num_heads}/{num_kv_heads}"
        _assert_close(name, prefill_attention(q, *args, scale), ref, TOL[dtype])
        if block_size == 16:  # several query tiles per sequence
            out = prefill_attention(q, *args, scale, tile_config=small_tiles)
            _assert_close(name + " 16x16 tiles", out, ref, TOL[dtype])
            # K/V tiles through TMA descriptors: whole tiles of a page are loaded, and the
            # slots past a sequence (here NaN) must not reach its output.
            k, v = poison_unowned_slots(cache, seq_lens)
            out = prefill_attention(q, k, v, *args[2:], scale,
                                    tile_config=dict(small_tiles, TMA=True))
            _assert_close(name + " 16x16 tiles, TMA", out, ref, TOL[dtype])


DECODE_SEQ_LENS = [1, 37, 100, 0, 64, 129, 17]  # 0: a padded row of a graph bucket


def check_decode_attention() -> None:
    from minivllm.kernels.decode_attention import (
        decode_attention,
        decode_attention_ref,
        decode_counters,
    )
    from minivllm.kernels.testing import paged_kv

    for dtype, block_size, (num_heads, num_kv_heads) in ATTENTION_CASES:
        cache = paged_kv(DECODE_SEQ_LENS, num_kv_heads, HEAD_DIM, block_size, dtype, "cpu")
        args = (cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables)
        # A strided q (a slice of a wider buffer), as the engine's QKV split gives it.
        q = torch.randn(len(DECODE_SEQ_LENS), num_heads, 2 * HEAD_DIM).to(dtype)[..., :HEAD_DIM]
        scale = 1 / math.sqrt(HEAD_DIM)
        ref = decode_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:],
                                   scale)
        ref[DECODE_SEQ_LENS.index(0)] = 0.0  # the kernel's zeros (the reference's NaNs)
        # One set of counters for every call, as an engine's layers share theirs.
        counters = decode_counters(len(DECODE_SEQ_LENS) + 1, num_kv_heads, "cpu")
        for splits in (None, 1, 4, 4):  # chosen, direct write, split + in-kernel merge
            out = decode_attention(q, *args, scale, num_splits=splits, counters=counters)
            name = (f"decode {dtype} block {block_size} heads {num_heads}/{num_kv_heads} "
                    f"splits {splits}")
            _assert_close(name, out, ref, TOL[dtype])
            assert not out[DECODE_SEQ_LENS.index(0)].any(), name + ": empty context not zero"
            assert not counters.any(), name + ": counters not reset for the next launch"
        # Any program may be the last to finish; the merge reads partials in split order.
        again = decode_attention(q, *args, scale, num_splits=4)  # its own zeroed counters
        assert torch.equal(again, out), "the merged output depends on the counters' source"


def check_decode_attention_many_splits() -> None:
    """More used splits than the merging program reads at once (MERGE_CHUNK): 35 of 64."""
    from minivllm.kernels.decode_attention import (
        MERGE_CHUNK,
        decode_attention,
        decode_attention_ref,
        decode_counters,
    )
    from minivllm.kernels.testing import paged_kv

    cache = paged_kv([1100, 40], 2, HEAD_DIM, 32, torch.float32, "cpu")
    args = (cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables)
    q = torch.randn(2, 4, HEAD_DIM)
    ref = decode_attention_ref(q.double(), *(a.double() for a in args[:2]), *args[2:], 0.125)
    counters = decode_counters(2, 2, "cpu")
    assert 64 > MERGE_CHUNK
    out = decode_attention(q, *args, 0.125, num_splits=64, counters=counters)
    _assert_close("decode 64 splits", out, ref, TOL[torch.float32])
    assert not counters.any()


def check_decode_attention_one_page() -> None:
    """One block-table entry a K/V tile where a page holds whole tiles (ONE_PAGE): the bits
    of one entry a position, with the first tile prefetched too; asked for where tiles are
    longer than a page, the launch keeps one a position (else a tile's second page would be
    read from its first)."""
    from minivllm.kernels import decode_attention as module
    from minivllm.kernels.testing import paged_kv

    launched = []  # ONE_PAGE of each launch, as the kernel got it
    kernel = module._decode_attention_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["ONE_PAGE"])
                return kernel[grid](*args, **kwargs)
            return launch

    module._decode_attention_kernel = Spy()
    try:
        for dtype, block_size, (num_heads, num_kv_heads) in ATTENTION_CASES[2:4]:
            cache = paged_kv(DECODE_SEQ_LENS, num_kv_heads, HEAD_DIM, block_size, dtype, "cpu")
            args = (cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables)
            q = torch.randn(len(DECODE_SEQ_LENS), num_heads, HEAD_DIM).to(dtype)
            ref = module.decode_attention_ref(q.double(), *(a.double() for a in args[:2]),
                                              *args[2:], 0.125)
            ref[DECODE_SEQ_LENS.index(0)] = 0.0
            base = module._tile_config(dtype)
            name = f"decode one page {dtype} block {block_size}"
            for splits in (1, 4):
                launched.clear()
                per_position, one_page = (
                    module.decode_attention(q, *args, 0.125, num_splits=splits,
                                            tile_config=dict(base, BLOCK_N=16, ONE_PAGE=on))
                    for on in (False, True))
                assert launched == [False, True], f"{name}: launched with {launched}"
                assert torch.equal(one_page, per_position), f"{name} splits {splits}"
                _assert_close(f"{name} splits {splits}", one_page, ref, TOL[dtype])
                launched.clear()
                longer = module.decode_attention(q, *args, 0.125, num_splits=splits,
                                                 tile_config=dict(base, BLOCK_N=2 * block_size,
                                                                  ONE_PAGE=True))
                assert launched == [False], f"{name}: tiles of two pages took ONE_PAGE"
                _assert_close(f"{name} splits {splits}, two pages a tile", longer, ref,
                              TOL[dtype])
            # The first tile loaded before the wait (qkv_decode_attention's prefetch).
            cos_sin = cos_sin_table(4096, HEAD_DIM)
            qkv, _, _, _ = _fused_qkv(len(DECODE_SEQ_LENS), num_heads, num_kv_heads, dtype)
            positions = (cache.seq_lens.long() - 1).clamp(min=0)
            pages = cache.block_tables[torch.arange(len(DECODE_SEQ_LENS)),
                                       positions // block_size]
            slots = pages.long() * block_size + positions % block_size
            slots[DECODE_SEQ_LENS.index(0)] = -1
            outs = []
            for on in (False, True):
                k, v = cache.k_cache.clone(), cache.v_cache.clone()
                outs.append(module.qkv_decode_attention(
                    positions, qkv, num_heads, cos_sin, k, v, slots, cache.seq_lens,
                    cache.block_tables, 0.125, num_splits=4, prefetch=True,
                    tile_config=dict(base, BLOCK_N=16, ONE_PAGE=on)))
            real = torch.tensor(DECODE_SEQ_LENS) > 0  # a padding row's output is not used
            assert torch.equal(outs[0][real], outs[1][real]), f"{name}: prefetched first tile"
    finally:
        module._decode_attention_kernel = kernel


def check_wrapper_errors() -> None:
    from minivllm.kernels.decode_attention import decode_attention
    from minivllm.kernels.prefill_attention import prefill_attention
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.store_kvcache import store_kvcache
    from minivllm.kernels.testing import paged_kv

    cache = paged_kv([20], 2, HEAD_DIM, 16, torch.float32, "cpu")
    kv = (cache.k_cache, cache.v_cache)
    q = torch.randn(1, 4, HEAD_DIM)
    cases = [
        (lambda: decode_attention(q[..., :32], *kv, cache.seq_lens, cache.block_tables, 1.0),
         "head_dim"),
        (lambda: decode_attention(torch.randn(1, 3, HEAD_DIM), *kv, cache.seq_lens,
                                  cache.block_tables, 1.0), "multiple of num_kv_heads"),
        (lambda: decode_attention(q, *kv, cache.seq_lens.float(), cache.block_tables, 1.0),
         "seq_lens has dtype"),
        (lambda: decode_attention(q, *kv, cache.seq_lens, cache.block_tables, 1.0,
                                  num_splits=3), "power of two"),
        (lambda: decode_attention(q, cache.k_cache, cache.v_cache[:, :, :1], cache.seq_lens,
                                  cache.block_tables, 1.0), "must match"),
        (lambda: decode_attention(q.transpose(1, 2), *kv, cache.seq_lens, cache.block_tables,
                                  1.0), "contiguous in its last dimension"),
        (lambda: decode_attention(q, *kv, cache.seq_lens, cache.block_tables, 1.0,
                                  num_splits=2, counters=torch.zeros(2)), "counters has dtype"),
        (lambda: decode_attention(q, *kv, cache.seq_lens, cache.block_tables, 1.0, num_splits=2,
                                  counters=torch.zeros(1, dtype=torch.int32), check=False),
         "counters has 1 elements"),
        (lambda: prefill_attention(q[0], *kv, torch.tensor([0, 1]), cache.seq_lens,
                                   cache.block_tables, 1.0), "dimensions"),
        (lambda: prefill_attention(q, *kv, torch.tensor([0]), cache.seq_lens,
                                   cache.block_tables, 1.0), "num_seqs + 1"),
        (lambda: store_kvcache(q, q, *kv, torch.tensor([0])), "to match the cache"),
        (lambda: rms_norm(torch.randn(3, 8), torch.ones(9), 1e-6), "weight has 9"),
    ]
    small = paged_kv([5], 1, HEAD_DIM, 8, torch.float32, "cpu")  # block size 8: unsupported
    cases.append((lambda: decode_attention(q[:, :1], small.k_cache, small.v_cache,
                                           small.seq_lens, small.block_tables, 1.0),
                  "block_size must be"))
    _expect_value_errors(cases)


def check_gemv() -> None:
    from minivllm.kernels.gemv import (
        default_config,
        gemv,
        gemv_ref,
        rms_norm_gemv,
        rms_norm_gemv_ref,
    )

    tiles = [
        None,  # the default for the shape
        dict(BLOCK_N=4, BLOCK_K=32, USE_DOT=False, DOT_PRECISION="ieee", num_warps=4,
             num_stages=1),  # several K tiles, masked N and K tails
        dict(BLOCK_N=16, BLOCK_K=32, USE_DOT=True, DOT_PRECISION="ieee", num_warps=4,
             num_stages=1),  # tensor-core path
    ]
    for dtype in DTYPES:
        for m, n, k in ((1, 40, 72), (3, 34, 100), (8, 64, 64)):
            x = torch.randn(m, k).to(dtype)
            w = (torch.randn(n, k) / k**0.5).to(dtype)
            b = torch.randn(n).to(dtype)
            residual = torch.randn(m, k).to(dtype)
            norm_w = (1 + 0.1 * torch.randn(k)).to(dtype)
            for config in tiles:
                if config is not None:
                    precision = default_config(m, n, k, dtype)["DOT_PRECISION"]
                    config = dict(config, DOT_PRECISION=precision)
                name = f"gemv {dtype} {m}x{n}x{k} {config}"
                ref = gemv_ref(x.float(), w.float(), b.float())
                _assert_close(name, gemv(x, w, b, config=config), ref, TOL[dtype])
                _assert_close(name + " no bias", gemv(x, w, config=config),
                              gemv_ref(x.float(), w.float()), TOL[dtype])
                combos = ((residual, False), (None, False), (residual, True))
                for res, silu in combos if config is None else combos[2:]:
                    got, got_res = rms_norm_gemv(x, res, norm_w, 1e-6, w, b, silu_mul=silu,
                                                 config=config)
                    want, want_res = rms_norm_gemv_ref(x, res, norm_w, 1e-6, w, b, silu_mul=silu)
                    tag = f"{name} norm residual={res is not None} silu={silu}"
                    _assert_close(tag, got, want, TOL[dtype])
                    assert torch.equal(got_res, want_res), tag + ": new residual"
                    if res is None:
                        assert got_res is x


def check_fused_wrapper_errors() -> None:
    from minivllm.kernels.gemv import gemv, rms_norm_gemv
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store
    from minivllm.kernels.testing import paged_kv

    w = torch.randn(6, 8)
    cache = paged_kv([20], 2, HEAD_DIM, 16, torch.float32, "cpu")
    qkv = torch.randn(3, 8 * HEAD_DIM)
    pos = torch.arange(3)
    cos_sin = cos_sin_table(64, HEAD_DIM)
    kv = (cache.k_cache, cache.v_cache)
    cases = [
        (lambda: gemv(torch.randn(9, 8), w), "1 to 8 rows"),
        (lambda: gemv(torch.randn(2, 7), w), "does not take x"),
        (lambda: gemv(torch.randn(2, 8), w.half()), "weight has dtype"),
        (lambda: gemv(torch.randn(2, 8), w, torch.randn(5)), "bias has 5"),
        (lambda: rms_norm_gemv(torch.randn(2, 8), None, torch.ones(7), 1e-6, w), "norm_weight"),
        (lambda: rms_norm_gemv(torch.randn(2, 8), None, torch.ones(8), 1e-6, w[:5],
                               silu_mul=True), "even number"),
        (lambda: qkv_rotary_store(pos, qkv, 5, cos_sin, *kv, pos), "qkv has"),
        (lambda: qkv_rotary_store(pos[:2], qkv, 4, cos_sin, *kv, pos), "one entry per token"),
        (lambda: qkv_rotary_store(pos, qkv, 4, cos_sin, *kv, pos, torch.ones(HEAD_DIM)),
         "come together"),
    ]
    _expect_value_errors(cases)


def check_qkv_rotary_store() -> None:
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store, qkv_rotary_store_ref
    from minivllm.kernels.testing import paged_kv

    cos_sin = cos_sin_table(4096, HEAD_DIM)
    for dtype, (num_heads, num_kv_heads), qk_norm in [
        (torch.float32, (4, 2), True),
        (torch.float16, (6, 2), True),
        (torch.float16, (2, 2), False),
        (torch.float32, (6, 2), False),
    ]:
        cache = paged_kv([40, 7], num_kv_heads, HEAD_DIM, 16, dtype, "cpu", spare_blocks=2)
        num_slots = cache.k_cache.shape[0] * 16
        qkv, _, _, _ = _fused_qkv(9, num_heads, num_kv_heads, dtype)
        positions = torch.randint(0, 4096, (9,))
        slots = torch.randperm(num_slots)[:9]
        slots[[1, 6]] = -1
        weights = qk_norm_weights(HEAD_DIM, dtype) if qk_norm else {}
        k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
        q_ref = qkv_rotary_store_ref(positions, qkv, num_heads, cos_sin, k_ref, v_ref, slots,
                                     **weights)
        # The 9 tokens in one program's tile (its tail masked), then in three of 4 tokens.
        for block_tokens in (None, 4):
            k_cache, v_cache = cache.k_cache.clone(), cache.v_cache.clone()
            q = qkv_rotary_store(positions, qkv, num_heads, cos_sin, k_cache, v_cache,
                                 slots.int(), **weights, block_tokens=block_tokens)
            name = (f"qkv_rotary_store {dtype} {num_heads}/{num_kv_heads} norm={qk_norm} "
                    f"block_tokens={block_tokens}")
            _assert_close(name + " q", q, q_ref, TOL[dtype])
            _assert_close(name + " k_cache", k_cache, k_ref, TOL[dtype])
            assert torch.equal(v_cache, v_ref), name + " v_cache (a copy)"
            # Slots nobody writes (-1 included) keep their contents.
            written = torch.zeros(num_slots, dtype=torch.bool)
            written[slots[slots >= 0]] = True
            untouched = ~written.view(k_cache.shape[:2])
            assert torch.equal(k_cache[untouched], k_ref[untouched]), name


def check_qkv_decode_attention() -> None:
    """q/k norm + rotary + KV store in the decode attention kernel's prologue: the output
    and the cache as the two references in turn (a padding row with slot -1 stores
    nothing), the same within tolerance as the two Triton launches it replaces."""
    from minivllm.kernels.decode_attention import (
        decode_attention,
        decode_counters,
        qkv_decode_attention,
        qkv_decode_attention_ref,
    )
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store
    from minivllm.kernels.testing import paged_kv

    cos_sin = cos_sin_table(4096, HEAD_DIM)
    seq_lens = [1, 37, 129, 64, 1]  # the last: a graph bucket's padding row (slot -1)
    for dtype, block_size, (num_heads, num_kv_heads), qk_norm in [
        (torch.float32, 16, (4, 2), True),
        (torch.float32, 32, (6, 2), False),
        (torch.float16, 16, (2, 2), True),
        (torch.float16, 32, (6, 2), True),
    ]:
        cache = paged_kv(seq_lens, num_kv_heads, HEAD_DIM, block_size, dtype, "cpu")
        qkv, _, _, _ = _fused_qkv(len(seq_lens), num_heads, num_kv_heads, dtype)
        positions = cache.seq_lens.long() - 1
        blocks = cache.block_tables[torch.arange(len(seq_lens)), positions // block_size]
        slots = blocks.long() * block_size + positions % block_size
        slots[-1] = -1
        weights = qk_norm_weights(HEAD_DIM, dtype) if qk_norm else {}
        step = (cache.seq_lens, cache.block_tables, 0.125)
        k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
        ref = qkv_decode_attention_ref(positions, qkv, num_heads, cos_sin, k_ref, v_ref, slots,
                                       *step, **weights)
        counters = decode_counters(len(seq_lens), num_kv_heads, "cpu")
        name = f"qkv_decode_attention {dtype} {num_heads}/{num_kv_heads} norm={qk_norm}"
        for splits in (None, 1, 4):
            k_out, v_out = cache.k_cache.clone(), cache.v_cache.clone()
            out = qkv_decode_attention(positions, qkv, num_heads, cos_sin, k_out, v_out,
                                       slots, *step, **weights, num_splits=splits,
                                       counters=counters, prefetch=False)
            _assert_close(f"{name} splits {splits}", out, ref, TOL[dtype])
            _assert_close(f"{name} splits {splits} k_cache", k_out, k_ref, TOL[dtype])
            assert torch.equal(v_out, v_ref), f"{name}: v_cache (a copy)"
            assert not counters.any()
            # The first tile loaded before the (PDL) wait, the new token spliced in from
            # registers (in the first tile with 4 splits, in a later one with 1): the
            # same bits, the same cache.
            k_pre, v_pre = cache.k_cache.clone(), cache.v_cache.clone()
            pre = qkv_decode_attention(positions, qkv, num_heads, cos_sin, k_pre, v_pre,
                                       slots, *step, **weights, num_splits=splits,
                                       counters=counters, prefetch=True)
            real = slice(0, len(seq_lens) - 1)  # the padding row's output is not used
            assert torch.equal(pre[real], out[real]), f"{name} splits {splits}: prefetch"
            assert torch.equal(k_pre, k_out) and torch.equal(v_pre, v_out), name
            assert not counters.any()
        # Splits of at least 64 positions: 37 and 64 in one program (direct write), 129 in
        # three; with and without the prefetched first tile (which puts the padding row's
        # unstored token in its output: not compared).
        for prefetch in (False, True):
            k_min, v_min = cache.k_cache.clone(), cache.v_cache.clone()
            got = qkv_decode_attention(positions, qkv, num_heads, cos_sin, k_min, v_min, slots,
                                       *step, **weights, num_splits=4, counters=counters,
                                       prefetch=prefetch, min_split_len=64)
            _assert_close(f"{name} min split 64 prefetch={prefetch}", got[real], ref[real],
                          TOL[dtype])
            assert torch.equal(v_min, v_ref) and not counters.any()
        # The engine's short launch (DECODE_SHORT): every context fits in one split of
        # min_split_len, so one split gives the bits of the bucket's 4.
        for prefetch in (False, True):
            outs = []
            for splits in (4, 1):
                k_s, v_s = cache.k_cache.clone(), cache.v_cache.clone()
                outs.append(qkv_decode_attention(
                    positions, qkv, num_heads, cos_sin, k_s, v_s, slots, *step, **weights,
                    num_splits=splits, counters=counters, prefetch=prefetch,
                    min_split_len=max(seq_lens)))
                assert torch.equal(k_s, k_out) and torch.equal(v_s, v_out), name
            assert torch.equal(outs[0], outs[1]), f"{name}: one split vs 4, prefetch={prefetch}"
        k_two, v_two = cache.k_cache.clone(), cache.v_cache.clone()
        q = qkv_rotary_store(positions, qkv, num_heads, cos_sin, k_two, v_two, slots, **weights)
        two = decode_attention(q, k_two, v_two, *step, num_splits=4)
        _assert_close(f"{name}: one launch against two", out, two, TOL[dtype])


def check_compile_sm90() -> None:
    from minivllm.kernels.decode_attention import _decode_attention_kernel
    from minivllm.kernels.gemv import _gemv_kernel
    from minivllm.kernels.prefill_attention import _prefill_kernel
    from minivllm.kernels.qkv_rotary_store import _qkv_rotary_store_kernel
    from minivllm.kernels.sample import BLOCK, _pick_kernel, _sample_kernel
    from minivllm.kernels.testing import compile_sm90

    bf16 = {name: "*bf16" for name in _gemv_kernel.arg_names if name.endswith("_ptr")}
    flags = dict(NORM=True, HAS_RESIDUAL=True, HAS_BIAS=True, SILU_MUL=True,
                 DOT_PRECISION="tf32")
    compile_sm90(_gemv_kernel, {**bf16, "eps": "fp32"},
                  dict(flags, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, USE_DOT=False, ONE_TILE=True,
                       PDL=True))
    compile_sm90(_gemv_kernel, {**bf16, "eps": "fp32"},
                  dict(flags, BLOCK_M=16, BLOCK_N=16, BLOCK_K=512, USE_DOT=True, ONE_TILE=False,
                       PDL=True),
                  num_stages=3)
    sig = {name: "*bf16" for name in _qkv_rotary_store_kernel.arg_names if name.endswith("_ptr")}
    sig.update(positions_ptr="*i64", slot_mapping_ptr="*i64", cos_sin_ptr="*fp32", eps="fp32",
               k_scale="fp32", v_scale="fp32")
    compile_sm90(_qkv_rotary_store_kernel, sig,
                  dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, BLOCK_T=16,
                       QK_NORM=True, PDL=True, KV_FP8=False), 2)
    sig = {name: "*fp32" for name in _decode_attention_kernel.arg_names if name.endswith("_ptr")}
    sig.update(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16",
               block_tables_ptr="*i32", seq_lens_ptr="*i32", counters_ptr="*i32",
               positions_ptr="*i64", slot_mapping_ptr="*i64", q_norm_ptr="*bf16",
               k_norm_ptr="*bf16", qk_scale="fp32", eps="fp32", k_scale="fp32",
               v_scale="fp32")
    # Direct write; split + merge in one chunk; in four; with q/k norm + rotary + store.
    # The last three: the first K/V tile loaded before the PDL wait; in the last, one
    # block-table entry a tile.
    for splits, from_qkv, prefetch, one_page in (
            (1, False, False, False), (32, False, False, False), (128, False, False, False),
            (32, True, False, False), (32, True, True, False), (1, True, True, False),
            (32, True, True, True)):
        compile_sm90(_decode_attention_kernel, sig,
                      dict(GROUP=2, GROUP_PAD=16, NUM_KV_HEADS=8, HEAD_DIM=128,
                           BLOCK_SIZE=256, BLOCK_N=128, NUM_SPLITS=splits,
                           MERGE_CHUNK=min(splits, 32), FROM_QKV=from_qkv, QK_NORM=from_qkv,
                           DOT_PRECISION="tf32", PDL=True, PREFETCH=prefetch,
                           MIN_SPLIT_LEN=512 if prefetch else 128,
                           LATE_TRIGGER=4096 if prefetch else 0, KV_FP8=False,
                           FP8_AS_F16=False, FP8_ASM=False, ONE_PAGE=one_page), 4, 2)
    # Prefill: pointer loads and TMA descriptors, in the grid's order and last tiles first.
    sig = {name: "*bf16" for name in _prefill_kernel.arg_names if name.endswith("_ptr")}
    sig.update(cu_seqlens_ptr="*i32", seq_lens_ptr="*i32", block_tables_ptr="*i32",
               qk_scale="fp32", v_scale="fp32")
    tiles = dict(GROUP=2, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_M=128,
                 BLOCK_N=64, DOT_PRECISION="tf32", KV_FP8=False)
    compile_sm90(_prefill_kernel, sig, dict(tiles, k_desc=None, v_desc=None, TMA=False,
                                             LAST_FIRST=False), 4, 3)
    desc = "tensordesc<bf16[64, 128]>"
    compile_sm90(_prefill_kernel, dict(sig, k_desc=desc, v_desc=desc),
                  dict(tiles, TMA=True, LAST_FIRST=True), 4, 3)
    for has_mask in (False, True):
        compile_sm90(_sample_kernel, dict(logits_ptr="*bf16", temps_ptr="*fp32",
                                           seed_ptr="*i64", mask_ptr="*i32", best_ptr="*fp32",
                                           index_ptr="*i32"),
                      dict(BLOCK=BLOCK, HAS_MASK=has_mask), num_warps=8)
    compile_sm90(_pick_kernel, dict(best_ptr="*fp32", index_ptr="*i32", out_ptr="*i64"),
                  dict(SPLITS_PAD=64), num_warps=1)


# Subprocess groups: each start costs seconds (torch + triton imports), so the cheap
# kernels share one.
CHECKS = {
    "elementwise": [check_store_kvcache, check_rms_norm, check_rotary, check_silu_and_mul,
                    check_fill_tokens, check_wrapper_errors, check_sample_rows,
                    check_sampler_masked_rows],
    "prefill_attention": [check_prefill_attention],
    "decode_attention": [check_decode_attention, check_decode_attention_many_splits,
                         check_decode_attention_one_page],
    "fused_decode": [check_gemv, check_qkv_rotary_store, check_fused_wrapper_errors],
    "qkv_decode_attention": [check_qkv_decode_attention],
    "compile_sm90": [check_compile_sm90],  # no interpreter: a real compile for sm_90
}


# ----------------------------------------------------------------------------------------
# The tests pytest collects.


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("group", list(CHECKS))
def test_triton_kernel_interpreted(group: str) -> None:
    run_kernel_checks(__file__, group)


def test_use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    from minivllm.kernels import dispatch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MINIVLLM_TRITON", raising=False)
    assert not dispatch.use_triton("cpu")
    assert not dispatch.use_triton(torch.zeros(1))
    assert dispatch.use_triton(torch.device("cuda", 0)) == dispatch.HAS_TRITON
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dispatch.use_triton("cpu"), "the interpreter alone must not switch kernels"
    monkeypatch.setenv("MINIVLLM_TRITON", "1")
    assert dispatch.use_triton("cpu") == dispatch.HAS_TRITON
    monkeypatch.setattr(dispatch, "HAS_TRITON", False)
    assert not dispatch.use_triton("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_gemv_choice_is_per_row_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch padded to its CUDA-graph bucket and the same batch run eagerly must take the
    same kernel, so the GEMV-or-cuBLAS choice depends on the bucket (1, 2, 4, 8) only."""
    from minivllm.kernels import gemv

    monkeypatch.setattr(gemv, "HAS_TRITON", True)  # loaded only with a GPU build of torch
    monkeypatch.setattr(gemv, "MEASURED_WINS", {(4, 64, 32): True, (8, 64, 32): False})
    gemv._gemv_wins.cache_clear()
    try:
        assert gemv.gemv_wins(3, 64, 32, torch.bfloat16) and gemv.gemv_wins(4, 64, 32,
                                                                            torch.float16)
        assert not gemv.gemv_wins(5, 64, 32, torch.bfloat16)
        assert not gemv.gemv_wins(8, 64, 32, torch.bfloat16)
        assert not gemv.gemv_wins(9, 64, 32, torch.bfloat16), "more rows than a GEMV takes"
        assert not gemv.gemv_wins(1, 64, 32, torch.float32), "fp32 stays on cuBLAS"
        assert gemv.gemv_wins(1, 7, 5, torch.bfloat16) == gemv._wins_by_default(1)
    finally:
        gemv._gemv_wins.cache_clear()


def test_decode_launch_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode launch of more than two programs an SM (four SMs stand in for a GPU on the
    CPU) takes the loaded tiles, per KV dtype; the tiles come from the environment, and a
    bad value is an error naming the variable."""
    from minivllm.kernels import tuning
    from minivllm.kernels.decode_attention import _tile_config, is_loaded, short_tile_config

    cpu = torch.device("cpu")
    assert not is_loaded(1, 8, 1, cpu)  # 8 programs on 4 "SMs": two an SM
    assert is_loaded(2, 8, 1, cpu) and is_loaded(1, 8, 2, cpu)
    tuning.clear()
    try:
        small = _tile_config(torch.bfloat16)
        assert (small["BLOCK_N"], small["num_warps"], small["num_stages"]) == (128, 4, 2)
        assert _tile_config(torch.bfloat16, loaded=True)["BLOCK_N"] == 64
        assert _tile_config(torch.bfloat16, loaded=True, kv_fp8=True)["BLOCK_N"] == 128
        assert _tile_config(torch.float32, loaded=True)["DOT_PRECISION"] == "ieee"
        monkeypatch.setenv("MINIVLLM_DECODE_LOADED_TILE_FP8", "32x4x2")
        tuning.clear()
        assert _tile_config(torch.bfloat16, loaded=True, kv_fp8=True)["BLOCK_N"] == 32
        assert _tile_config(torch.bfloat16, loaded=True, kv_fp8=True)["maxnreg"] == 128
        # fp8 V as words in launches neither loaded nor the engine's short one
        assert tuning.decode_fp8_v_words(loaded=False)
        assert not tuning.decode_fp8_v_words(loaded=True)
        assert not short_tile_config(torch.bfloat16)["FP8_V_WORDS"]
        monkeypatch.setenv("MINIVLLM_DECODE_LOADED_REGS_FP8", "0")
        monkeypatch.setenv("MINIVLLM_DECODE_FP8_V_WORDS", "1")
        tuning.clear()
        assert "maxnreg" not in _tile_config(torch.bfloat16, loaded=True, kv_fp8=True)
        assert tuning.decode_fp8_v_words(loaded=True)
        assert short_tile_config(torch.bfloat16)["FP8_V_WORDS"]
        monkeypatch.setenv("MINIVLLM_DECODE_LOADED_REGS_FP8", "96")
        tuning.clear()
        assert _tile_config(torch.bfloat16, loaded=True, kv_fp8=True)["maxnreg"] == 96
        assert "maxnreg" not in _tile_config(torch.bfloat16, loaded=True)
        assert "maxnreg" not in _tile_config(torch.bfloat16, kv_fp8=True)
        monkeypatch.setenv("MINIVLLM_DECODE_LOADED_TILE", "48x4x2")
        tuning.clear()
        with pytest.raises(ValueError,
                           match="MINIVLLM_DECODE_LOADED_TILE=.48x4x2.: must be one of"):
            _tile_config(torch.bfloat16, loaded=True)
    finally:
        monkeypatch.delenv("MINIVLLM_DECODE_LOADED_TILE_FP8", raising=False)
        monkeypatch.delenv("MINIVLLM_DECODE_LOADED_REGS_FP8", raising=False)
        monkeypatch.delenv("MINIVLLM_DECODE_FP8_V_WORDS", raising=False)
        monkeypatch.delenv("MINIVLLM_DECODE_LOADED_TILE", raising=False)
        tuning.clear()


def test_decode_split_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch-1 launch at a long context takes MINIVLLM_DECODE_MAX_SPLITS splits (32 by
    default); a large batch or a short context stays under it alike."""
    from minivllm.kernels import tuning
    from minivllm.kernels.decode_attention import choose_num_splits

    tuning.clear()
    try:
        assert choose_num_splits(1, 8, 33280, 132) == 32
        assert choose_num_splits(1, 8, 2048, 132) == 8  # >= 256 positions a split
        assert choose_num_splits(64, 8, 33280, 132) == 2  # enough programs already
        monkeypatch.setenv("MINIVLLM_DECODE_MAX_SPLITS", "64")
        tuning.clear()
        assert choose_num_splits(1, 8, 33280, 132) == 64
        assert choose_num_splits(1, 8, 2048, 132) == 8
        monkeypatch.setenv("MINIVLLM_DECODE_MAX_SPLITS", "48")
        tuning.clear()
        with pytest.raises(ValueError, match="MINIVLLM_DECODE_MAX_SPLITS=.48.: must be one of"):
            choose_num_splits(1, 8, 33280, 132)
    finally:
        monkeypatch.delenv("MINIVLLM_DECODE_MAX_SPLITS", raising=False)
        tuning.clear()


def test_prefill_tiles_by_step_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill step of at most MINIVLLM_PREFILL_SMALL tokens takes the small query tiles
    (more programs for a short prompt); a longer one, or any with the switch at 0, the
    large ones. A CUDA graph's bucket is such a step: its token count picks alike."""
    from minivllm.kernels import tuning
    from minivllm.kernels.prefill_attention import _tile_config

    tuning.clear()
    try:
        rows = {n: _tile_config(torch.bfloat16, 128, n)["BLOCK_M"] for n in (1, 2048, 2049)}
        assert rows == {1: 64, 2048: 64, 2049: 128}
        assert _tile_config(torch.bfloat16, 128)["BLOCK_M"] == 128  # no size: the large
        assert _tile_config(torch.float32, 128, 16)["DOT_PRECISION"] == "ieee"
        monkeypatch.setenv("MINIVLLM_PREFILL_SMALL", "0")
        tuning.clear()
        assert _tile_config(torch.bfloat16, 128, 16)["BLOCK_M"] == 128
    finally:
        monkeypatch.delenv("MINIVLLM_PREFILL_SMALL", raising=False)
        tuning.clear()


def test_kernel_modules_import_without_triton() -> None:
    # sys.modules[name] = None makes `import name` raise ImportError: Triton "uninstalled".
    code = """
import sys
sys.modules["triton"] = None
sys.modules["triton.language"] = None
import torch
from minivllm.kernels import dispatch
from minivllm.kernels.decode_attention import decode_attention, decode_attention_ref
from minivllm.kernels import prefill_attention, rms_norm, rotary, silu_and_mul, store_kvcache
from minivllm.kernels.testing import paged_kv
assert not dispatch.HAS_TRITON and not dispatch.use_triton("cuda")
c = paged_kv([5, 9], 1, 64, 16, torch.float32, "cpu")
q = torch.randn(2, 2, 64)
args = (q, c.k_cache, c.v_cache, c.seq_lens, c.block_tables, 0.1)
assert decode_attention_ref(*args).isfinite().all()
try:
    decode_attention(*args)
except RuntimeError as e:
    assert "Triton" in str(e), e
else:
    raise AssertionError("the Triton wrapper ran without Triton")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]


if __name__ == "__main__":
    from minivllm.kernels.testing import poisoned_empty

    torch.manual_seed(0)
    with poisoned_empty():
        for check in CHECKS[sys.argv[1]]:
            check()
            print(f"{check.__name__}: ok")
