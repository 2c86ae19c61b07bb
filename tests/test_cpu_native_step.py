"""The native CPU decode step (engine/cpu_step.py's NativeCPUDecodeStep over
kernels/cpu_decode_step.cpp): it equals the eager step layer for layer with every weight
format, the engine with it decodes what transformers decodes, it is the default, and it
refuses what it cannot run with a clear reason."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from conftest import hf_greedy, tiny_engine

from minivllm import SamplingParams
from minivllm.engine import cpu_step
from minivllm.engine.cpu_step import CPUDecodeStep, NativeCPUDecodeStep, decode_layer
from minivllm.kernels import cpu_lowp_linear
from minivllm.kernels.decode_attention import context_slots

pytestmark = pytest.mark.skipif(
    cpu_lowp_linear.unavailable_reason() is not None,
    reason=f"the CPU extension does not build here: {cpu_lowp_linear.unavailable_reason()}",
)


@pytest.mark.parametrize("weights", ["auto", "bfloat16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])  # plain; q/k norm; biases
def test_native_step_equals_the_eager_step(arch, weights, request, monkeypatch):
    """Over a pool of random K/V and scattered blocks: the same hidden states as the eager
    `decode_layer` step, and each layer's new K/V stored at the sequence's next slot."""
    monkeypatch.setenv(cpu_step.STEP_ENV, "eager")
    llm = tiny_engine(request.getfixturevalue(f"tiny_{arch}"), cpu_weight_dtype=weights)
    try:
        runner = llm.runner
        native = NativeCPUDecodeStep(runner.model, runner.kv_cache)
        eager = CPUDecodeStep(runner.model, runner.kv_cache)
        g = torch.Generator().manual_seed(0)
        block_size, num_blocks = runner.block_size, runner.kv_cache.shape[2]
        pool = runner.kv_cache.flatten(2, 3)  # [2, layers, slots, kv_heads, head_dim]
        with torch.inference_mode():
            runner.kv_cache.normal_(generator=g)
            # One token of context (the new one), one sequence over 3 blocks, a mixed batch.
            for num_seqs, longest in ((1, 1), (1, 40), (3, 7), (8, 70)):
                lens = torch.randint(1, longest + 1, (num_seqs,), generator=g)
                lens[0] = longest
                width = -(-longest // block_size)
                tables = torch.randperm(num_blocks, generator=g)[: num_seqs * width]
                tables = tables.view(num_seqs, width).int()
                ids = torch.randint(0, 512, (num_seqs,), generator=g)
                slots = context_slots(lens, tables, block_size)
                prev = slots[:, :-1] if longest > 1 else slots.new_zeros(num_seqs, 1)
                want, new_k, new_v = eager.forward(
                    ids, lens - 1, prev.contiguous(), lens, layer=decode_layer
                )
                got = native.forward(ids, lens - 1, tables, lens)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                new_slots = slots[torch.arange(num_seqs), lens - 1]
                torch.testing.assert_close(pool[0][:, new_slots], new_k, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(pool[1][:, new_slots], new_v, rtol=1e-5, atol=1e-5)
            runner.kv_cache.zero_()
    finally:
        llm.exit()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_native_engine_matches_transformers(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    llm = tiny_engine(path)  # the default step
    try:
        assert isinstance(llm.runner.cpu_step, NativeCPUDecodeStep)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 17, 40, 5)]
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        for prompt, got in zip(prompts, out["token_ids"], strict=True):
            assert got == hf_greedy(hf.eval(), prompt, 24)
    finally:
        llm.exit()


def test_native_step_with_int8_weights_equals_the_eager_engine(tiny_qwen3, monkeypatch):
    """Greedy tokens of the default (native) engine and the eager engine over the same int8
    weights: the step reads the weights as the eager products do."""
    llm = tiny_engine(tiny_qwen3, cpu_weight_dtype="int8")
    monkeypatch.setenv(cpu_step.STEP_ENV, "eager")
    eager = tiny_engine(tiny_qwen3, cpu_weight_dtype="int8")
    try:
        assert isinstance(llm.runner.cpu_step, NativeCPUDecodeStep)
        assert eager.runner.cpu_step is None
        prompts = [[(5 * i + j) % 512 for j in range(3 + 11 * i)] for i in range(5)]
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        assert llm.generate(prompts, params)["token_ids"] == (
            eager.generate(prompts, params)["token_ids"]
        )
    finally:
        llm.exit()
        eager.exit()


def test_bf16_model_takes_another_step_and_says_why(tiny_llama, monkeypatch):
    monkeypatch.setenv(cpu_step.COMPILE_ENV, "0")
    with pytest.warns(RuntimeWarning, match="no native step: it runs fp32 activations"):
        llm = tiny_engine(tiny_llama, dtype="bfloat16")
    try:
        assert llm.runner.cpu_step is None  # no compiler allowed here: the eager forward
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
        assert len(out["token_ids"][0]) == 3
    finally:
        llm.exit()


def test_unknown_step_kind_names_the_variable_and_the_value(tiny_llama, monkeypatch):
    monkeypatch.setenv(cpu_step.STEP_ENV, "fast")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_STEP='fast': must be one of native"):
        tiny_engine(tiny_llama)


def test_a_block_outside_the_pool_is_refused_before_anything_is_written(tiny_llama):
    llm = tiny_engine(tiny_llama)
    try:
        step = llm.runner.cpu_step
        assert isinstance(step, NativeCPUDecodeStep)
        before = step.kv_cache.clone()
        tables = torch.tensor([[0, 10**6]], dtype=torch.int32)
        lens = torch.tensor([20])
        with pytest.raises(RuntimeError, match="block 1000000 is outside the pool"):
            step.forward(torch.tensor([3]), lens - 1, tables, lens)
        assert torch.equal(step.kv_cache, before)
    finally:
        llm.exit()


def test_cpu_rows_ops_equal_the_references():
    """The CPU kernel set's norm and SiLU (kernels/cpu_ops.py) against the torch
    references, with and without a residual, over 1, many and 3-D rows; other dtypes fall
    back to the references."""
    from minivllm.kernels.cpu_ops import rms_norm_cpu, silu_and_mul_cpu
    from minivllm.kernels.rms_norm import rms_norm_ref
    from minivllm.kernels.silu_and_mul import silu_and_mul_ref

    g = torch.Generator().manual_seed(0)
    for shape in ((1, 576), (513, 576), (7, 3, 64)):
        x = torch.randn(*shape, generator=g) * 3
        weight, residual = torch.randn(shape[-1], generator=g), torch.randn(*shape, generator=g)
        for res in (None, residual):
            got, got_res = rms_norm_cpu(x, weight, 1e-5, res)
            want, want_res = rms_norm_ref(x, weight, 1e-5, res)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert (got_res is None) == (want_res is None)
            if res is not None:
                torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    for shape in ((1, 3072), (513, 3072), (4, 2, 10)):
        x = torch.randn(*shape, generator=g) * 4
        torch.testing.assert_close(silu_and_mul_cpu(x), silu_and_mul_ref(x), rtol=1e-5, atol=1e-5)
    # exp's clamped range: very negative gates give -0 like torch, large ones pass through
    gates = torch.tensor([[-200.0, -90.0, -50.0, 0.0, 30.0, 90.0, 200.0, 1.0]])
    x = torch.cat([gates, torch.ones_like(gates)], dim=1)
    torch.testing.assert_close(silu_and_mul_cpu(x), silu_and_mul_ref(x), rtol=1e-6, atol=1e-30)
    # bf16 rows: computed in fp32, rounded once to nearest even (the reference rounds twice).
    half = (torch.randn(513, 3072, generator=g) * 4).to(torch.bfloat16)
    got = silu_and_mul_cpu(half)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, silu_and_mul_ref(half.float()).to(torch.bfloat16))
    torch.testing.assert_close(got, silu_and_mul_ref(half), rtol=1e-2, atol=1e-2)
    nan = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]]).to(torch.bfloat16)  # gates, ups
    got = silu_and_mul_cpu(nan)
    assert got[0, 0].isnan() and got[0, 1] == torch.tensor(3 / (1 + math.exp(-1))).bfloat16()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_cpu_qkv_rotary_store_equals_the_reference(qk_norm):
    """The CPU kernel set's q/k norm + rotary + K/V store (`qkv_rotary_store_cpu`, one C++
    pass over a prefill's rows) against the torch reference: q, and the caches it writes
    (a slot of -1 stores nothing), the reference's bits without q/k norm (a greedy near-tie
    must not go another way than on the torch path); a bf16 input takes the reference; bad
    positions and slots are errors that name them."""
    from minivllm.kernels.cpu_ops import qkv_rotary_store_cpu
    from minivllm.kernels.qkv_rotary_store import qkv_rotary_store_ref
    from minivllm.kernels.testing import cos_sin_table, paged_kv, qk_norm_weights

    g = torch.Generator().manual_seed(0)
    table = cos_sin_table(2048, 64)
    norms = qk_norm_weights(64, torch.float32) if qk_norm else {}
    weights = (norms.get("q_norm_weight"), norms.get("k_norm_weight"), 1e-6)
    for num_heads, num_kv_heads, tokens in ((9, 3, 137), (4, 4, 1)):
        cache = paged_kv([40, 90], num_kv_heads, 64, 16, torch.float32, "cpu")
        qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * 64, generator=g) * 2
        positions = torch.randint(0, 2048, (tokens,), generator=g)
        slots = torch.randperm(cache.k_cache.shape[0] * 16, generator=g)[:tokens]
        slots[tokens // 2] = -1
        k_want, v_want = cache.k_cache.clone(), cache.v_cache.clone()
        want = qkv_rotary_store_ref(positions, qkv, num_heads, table, k_want, v_want, slots,
                                    *weights)
        k_got, v_got = cache.k_cache.clone(), cache.v_cache.clone()
        got = qkv_rotary_store_cpu(positions, qkv, num_heads, table, k_got, v_got, slots,
                                   *weights)
        exact = 0 if not qk_norm else 1e-5  # the norm's C++ sums round differently
        torch.testing.assert_close(got, want, rtol=exact, atol=exact)
        torch.testing.assert_close(k_got, k_want, rtol=exact, atol=exact)
        assert torch.equal(v_got, v_want)
    # bf16 rows take the reference: the same bits.
    half = paged_kv([40, 90], 3, 64, 16, torch.bfloat16, "cpu")
    qkv = torch.randn(5, 15 * 64, generator=g).bfloat16()
    args = (torch.arange(5), qkv, 9, table.bfloat16())
    slots = torch.arange(5) + 16
    k_ref, v_ref = half.k_cache.clone(), half.v_cache.clone()
    want = qkv_rotary_store_ref(*args, k_ref, v_ref, slots)
    got = qkv_rotary_store_cpu(*args, half.k_cache, half.v_cache, slots)
    assert torch.equal(got, want) and torch.equal(half.k_cache, k_ref)
    cache = paged_kv([40], 3, 64, 16, torch.float32, "cpu")
    qkv = torch.randn(2, 15 * 64, generator=g)
    with pytest.raises(RuntimeError, match="position 5000 is past the rotary cache"):
        qkv_rotary_store_cpu(torch.tensor([0, 5000]), qkv, 9, table, cache.k_cache,
                             cache.v_cache, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="slot 100000 is outside the pool"):
        qkv_rotary_store_cpu(torch.tensor([0, 1]), qkv, 9, table, cache.k_cache,
                             cache.v_cache, torch.tensor([0, 100000]))


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # vector paths (AVX-512 / AVX2); plain
@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (16, 4)])  # groups of 3, 1 and 4
def test_native_decode_attention_equals_the_reference(head_dim, heads):
    """The native step's attention (`minivllm_cpu::paged_decode_attention`: K and V rows
    prefetched ahead, each read once for its query group) against the torch reference,
    over scattered blocks and contexts from 1 position to several blocks."""
    from minivllm.kernels.decode_attention import decode_attention_ref
    from minivllm.kernels.testing import paged_kv

    num_heads, num_kv_heads = heads
    # Many sequences; one long one; a long and a short one.
    for seq_lens in ([1, 7, 9, 130, 300], [1000], [700, 5]):
        cache = paged_kv(seq_lens, num_kv_heads, head_dim, 16, torch.float32, "cpu")
        q = torch.randn(len(seq_lens), num_heads, head_dim) * 2
        args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens)
        got = torch.ops.minivllm_cpu.paged_decode_attention(*args, head_dim**-0.5)
        want = decode_attention_ref(q, cache.k_cache, cache.v_cache, cache.seq_lens,
                                    cache.block_tables, head_dim**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bad = cache.block_tables.clone()
    bad[0, 2] = 10**6
    with pytest.raises(RuntimeError, match="block 1000000 is outside the pool"):
        torch.ops.minivllm_cpu.paged_decode_attention(q, cache.k_cache, cache.v_cache, bad,
                                                      cache.seq_lens, 0.1)


def test_cpu_engine_takes_the_cpu_kernel_set(tiny_llama):
    llm = tiny_engine(tiny_llama)
    try:
        assert llm.runner.kernels.name == "cpu"
        norm = llm.runner.model.model.layers[0].input_layernorm
        assert norm.kernels is llm.runner.kernels
    finally:
        llm.exit()
