"""A weight-only model's prefill on oneDNN-packed copies on the CPU (`cpu_prefill_dtype`:
bf16 where the CPU multiplies bf16, fp32 elsewhere): which settings take it, the wide
products and attention against their references, and SmolLM2's greedy replies against
the fp32 engine's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import CHAT, assert_greedy_chat_follows

from minivllm import EngineConfig
from minivllm.cpu_features import has_fast_bf16
from minivllm.kernels import cpu_lowp_linear as kernel
from minivllm.layers import cpu_linear


def _packs_bf16() -> bool:
    return cpu_linear.pack_weight(torch.zeros(16, 32, dtype=torch.bfloat16)) is not None


needs_bf16_packing = pytest.mark.skipif(
    kernel.unavailable_reason() is not None or not _packs_bf16(),
    reason="oneDNN does not multiply bf16 on this CPU (or the CPU kernel does not build)",
)


def test_settings_that_take_the_bf16_prefill():
    bf16 = torch.bfloat16
    copies = bf16 if has_fast_bf16() else torch.float32
    assert cpu_linear.prefill_dtype("auto", "auto", "q4_1/q8_0") == copies
    assert cpu_linear.prefill_dtype("auto", "float32", "q4_1/q8_0") is None  # exact: asked
    assert cpu_linear.prefill_dtype("float32", "auto", "q4_1/q8_0") is None
    assert cpu_linear.prefill_dtype("bfloat16", "float32", "int8") == bf16
    assert cpu_linear.prefill_dtype("bfloat16", "auto", None) is None  # no weight format
    with pytest.raises(ValueError, match=r"cpu_prefill_dtype='fp16': must be one of 'auto'"):
        EngineConfig(model_name_or_path="x", cpu_prefill_dtype="fp16")


def test_wide_rows_are_the_prefill_chunks():
    assert cpu_linear.WideRows.of([0, 5, 9]) == cpu_linear.WideRows(every=True)
    assert cpu_linear.WideRows.of([0, 1, 2, 3]) is None  # decode only
    assert cpu_linear.WideRows.of([0]) is None
    # a decode row, a 4-token chunk, an empty sequence, a decode row, a 3-token chunk
    rows = cpu_linear.WideRows.of([0, 1, 5, 5, 6, 9])
    assert not rows.every
    assert rows.wide.tolist() == [1, 2, 3, 4, 6, 7, 8]
    assert rows.narrow.tolist() == [0, 5]


def _q4_1_linear(g: torch.Generator, bias: bool):
    """A random 96 x 64 linear in q4_1 (the kernel's weight), its dequantized fp32 weight,
    and its bias (or None), drawn from `g`."""
    n, k = 96, 64
    weight = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    values, scales, mins = kernel.quantize_q4_1(weight, kernel.block_width())
    plain = cpu_linear.LowpWeight(values, scales, n, mins, "q4_1")
    return plain, kernel.dequantize_group(values, scales, mins, n), b


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_rows_run_in_bf16_and_decode_rows_stay_exact(bias):
    g = torch.Generator().manual_seed(1)
    plain, deq, b = _q4_1_linear(g, bias)
    k = deq.shape[1]
    lowp = plain._replace(wide=cpu_linear.pack_weight(deq.to(torch.bfloat16)))
    x = torch.randn(40, k, generator=g)
    exact = plain.product(x, b)
    assert torch.equal(lowp.product(x, b), exact)  # outside a prefill step: the kernel
    with cpu_linear.wide_rows(cpu_linear.WideRows(every=True)):
        got = lowp.product(x, b)
    bf16_ref = F.linear(x.bfloat16().float(), deq.bfloat16().float(), b)
    torch.testing.assert_close(got, bf16_ref, rtol=1e-2, atol=1e-2)
    assert not torch.equal(got, exact)  # bf16 rounding shows: the copy is what ran
    # A step of two decode rows (0 and 39) and a 38-token prefill chunk between them.
    with cpu_linear.wide_rows(cpu_linear.WideRows.of([0, 1, 39, 40])):
        mixed = lowp.product(x, b)
    assert torch.equal(mixed[[0, 39]], plain.product(x[[0, 39]], b))
    torch.testing.assert_close(mixed[1:39], got[1:39], rtol=0, atol=0)


@needs_bf16_packing
def test_the_gate_up_product_keeps_bf16_for_the_silu():
    """`wide_keeps_dtype` (the MLP's gate_up): a prefill's product stays bf16, the CPU set's
    SiLU takes the bf16 rows and the down product the bf16 result: the same bits as
    widening to fp32 and back; a step with decode rows, or a bias, still gives fp32."""
    from minivllm.kernels.cpu_ops import silu_and_mul_cpu

    def q4_1(n: int, k: int) -> cpu_linear.LowpWeight:
        weight = torch.randn(n, k, generator=g) * 0.1
        values, scales, mins = kernel.quantize_q4_1(weight, kernel.block_width())
        wide = cpu_linear.pack_weight(
            kernel.dequantize_group(values, scales, mins, n).to(torch.bfloat16))
        return cpu_linear.LowpWeight(values, scales, n, mins, "q4_1", wide=wide)

    g = torch.Generator().manual_seed(2)
    gate_up, down = q4_1(128, 64), q4_1(64, 64)
    keeps = gate_up._replace(wide_keeps_dtype=True)
    x = torch.randn(40, 64, generator=g)
    with cpu_linear.wide_rows(cpu_linear.WideRows(every=True)):
        widened = gate_up.product(x, None)
        kept = keeps.product(x, None)
        assert widened.dtype == torch.float32 and kept.dtype == torch.bfloat16
        assert torch.equal(kept.float(), widened)
        assert torch.equal(down.product(silu_and_mul_cpu(kept), None),
                           down.product(silu_and_mul_cpu(widened), None))
        assert keeps.product(x, torch.zeros(128)).dtype == torch.float32
    with cpu_linear.wide_rows(cpu_linear.WideRows.of([0, 1, 39, 40])):
        assert keeps.product(x, None).dtype == torch.float32


def test_fp32_copies_without_fast_bf16(monkeypatch):
    from minivllm import cpu_features

    monkeypatch.setattr(cpu_features, "has_fast_bf16", lambda *args: False)
    assert cpu_linear.prefill_dtype("auto", "auto", "q4_1/q8_0") == torch.float32
    assert cpu_linear.prefill_dtype("auto", "float32", "q4_1/q8_0") is None  # exact: asked


@pytest.mark.skipif(kernel.unavailable_reason() is not None, reason="no CPU kernel here")
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_rows_on_an_fp32_copy(bias):
    """The fp32 copy's products are the dequantized weight's fp32 products (another
    summation order than the kernel's); decode rows stay on the kernel, bit for bit."""
    g = torch.Generator().manual_seed(3)
    plain, deq, b = _q4_1_linear(g, bias)
    k = deq.shape[1]
    wide = cpu_linear.pack_weight(deq)
    if wide is None:
        pytest.skip("oneDNN does not pack fp32 weights here")
    lowp = plain._replace(wide=wide)
    x = torch.randn(40, k, generator=g)
    with cpu_linear.wide_rows(cpu_linear.WideRows.of([0, 1, 39, 40])):
        mixed = lowp.product(x, b)
    assert torch.equal(mixed[[0, 39]], plain.product(x[[0, 39]], b))
    torch.testing.assert_close(mixed[1:39], F.linear(x[1:39], deq, b), rtol=1e-5, atol=1e-5)


def _naive_attention(q, k, v, scale):
    """Causal attention of q (the last q_len positions) over k / v, in float64."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_prefill_attention_with_and_without_a_cached_prefix(compute_dtype):
    """A whole prompt (SDPA's own causal mask) and queries after a cached prefix (a mask
    tensor), in the cache's fp32 and in bf16, against a float64 reference; a one-query
    sequence (a decode row beside a prefill) keeps fp32 either way."""
    from minivllm.kernels.prefill_attention import prefill_attention_ref
    from minivllm.kernels.testing import paged_kv

    seqs = [(40, 40), (70, 25), (1, 1)]  # (seq_len, q_len)
    cache = paged_kv([s for s, _ in seqs], 2, 64, 16, torch.float32, "cpu")
    cu = torch.tensor([0, 40, 65, 66], dtype=torch.int32)
    q = torch.randn(66, 6, 64, generator=torch.Generator().manual_seed(2))
    scale = 64**-0.5
    out = prefill_attention_ref(q, cache.k_cache, cache.v_cache, cu, cache.seq_lens,
                                cache.block_tables, scale, compute_dtype=compute_dtype)
    for i, (seq_len, q_len) in enumerate(seqs):
        tol = 1e-5 if compute_dtype is None or q_len == 1 else 3e-2
        blocks = cache.block_tables[i][: (seq_len + 15) // 16].long()
        k = cache.k_cache[blocks].flatten(0, 1)[:seq_len]
        v = cache.v_cache[blocks].flatten(0, 1)[:seq_len]
        want = _naive_attention(q[cu[i] : cu[i + 1]], k, v, scale)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].double(), want, rtol=tol, atol=tol)


@needs_bf16_packing
def test_smollm2_bf16_prefill_follows_fp32(smollm2, smollm2_path):
    """SmolLM2 with its Q4_1 weights and a bf16 prefill: greedy replies equal the fp32
    engine's, or first differ at a token in fp32's top-5 there; the header says so."""
    from minivllm import LLMEngine
    from minivllm.frontend.engine_frontend import dtype_label

    llm = LLMEngine({"model_name_or_path": str(smollm2_path), "device": "cpu",
                     "dtype": "float32", "cpu_weight_dtype": "compact",
                     "cpu_prefill_dtype": "bfloat16", "max_model_length": 2048,
                     "block_size": 16})
    try:
        assert llm.cpu_prefill_dtype == torch.bfloat16
        assert dtype_label(llm) == "float32, q4_1/q8_0 weights, bfloat16 prefill"
        model = llm.runner.model
        assert model.model.layers[0].mlp.down_proj.lowp.wide is not None
        assert model.lm_head.lowp.wide is None  # one row a sequence: the q8_0 kernel
        assert_greedy_chat_follows(smollm2, llm, CHAT, max_tokens=24)
    finally:
        llm.exit()


def test_smollm2_fp32_copies_follow_the_kernel(smollm2, smollm2_path, monkeypatch):
    """Where bf16 is slow (AVX2), `auto` gives a weight-only model fp32 copies for its
    prefill: greedy replies equal the fp32 engine's (or first differ at a token in its
    top-5); the header says so; decode rows and the LM head stay on the kernel."""
    from minivllm import LLMEngine, cpu_features
    from minivllm.frontend.engine_frontend import dtype_label

    monkeypatch.setattr(cpu_features, "has_fast_bf16", lambda *args: False)
    llm = LLMEngine({"model_name_or_path": str(smollm2_path), "device": "cpu",
                     "cpu_weight_dtype": "compact", "cpu_decode_dtype": "float32",
                     "max_model_length": 2048, "block_size": 16})
    try:
        assert llm.cpu_prefill_dtype == torch.float32
        assert dtype_label(llm) == "float32, q4_1/q8_0 weights, float32 prefill"
        model = llm.runner.model
        assert model.model.layers[0].mlp.down_proj.lowp.wide.dtype == torch.float32
        assert model.lm_head.lowp.wide is None
        assert_greedy_chat_follows(smollm2, llm, CHAT, max_tokens=24)
    finally:
        llm.exit()
