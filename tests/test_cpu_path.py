"""The CPU path: dtype choice, oneDNN-packed linears, the trimmed ops, bf16 accuracy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm import cpu_features
from minivllm.engine.plan import resolve_dtype
from minivllm.kernels.decode_attention import context_slots, decode_attention_at_slots
from minivllm.kernels.prefill_attention import gather_kv
from minivllm.kernels.rotary import (
    apply_rotary_folded,
    apply_rotary_ref,
    cos_sin_at,
    folded_cos_sin_at,
)
from minivllm.layers import cpu_linear

CPUINFO_SPR = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16\n"
CPUINFO_ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags : x\n"


def test_cpu_flags_parse_first_processor():
    assert cpu_features.parse_cpu_flags(CPUINFO_ZEN3) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert cpu_features.parse_cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert cpu_features.parse_cpu_flags("") == frozenset()


@pytest.mark.parametrize(
    "cpuinfo, capability, expected",
    [
        (CPUINFO_SPR, "AVX512", torch.bfloat16),
        ("flags : avx512f avx512_bf16\n", "AVX512", torch.bfloat16),  # Cooper Lake, Zen 4
        ("flags : amx_bf16 amx_tile\n", "AVX512", torch.bfloat16),
        (CPUINFO_SPR, "AVX2", torch.float32),  # ATEN_CPU_CAPABILITY=avx2: no AVX-512 kernels
        (CPUINFO_ZEN3, "AVX2", torch.float32),
        ("flags : avx512f avx512bw\n", "AVX512", torch.float32),  # AVX-512 without BF16
        ("", "DEFAULT", torch.float32),  # no /proc/cpuinfo (macOS)
    ],
)
def test_default_cpu_dtype(cpuinfo, capability, expected):
    flags = cpu_features.parse_cpu_flags(cpuinfo)
    assert cpu_features.default_cpu_dtype(flags, capability) == expected


def test_resolve_dtype_auto_follows_the_cpu_and_explicit_wins(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(
        cpu_features, "cpu_flags", lambda: cpu_features.parse_cpu_flags(CPUINFO_SPR)
    )
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert resolve_dtype("float32", cpu) == torch.float32  # forced fp32 on a bf16 CPU
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(
        cpu_features, "cpu_flags", lambda: cpu_features.parse_cpu_flags(CPUINFO_ZEN3)
    )
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_f_linear(dtype):
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in [(96, 64), (576, 1536), (1000, 576)]:
        weight = torch.randn(out_f, in_f, generator=g).to(dtype)
        bias = torch.randn(out_f, generator=g).to(dtype)
        packed = cpu_linear.pack_weight(weight)
        for num_tokens in (1, 7, 130):
            x = torch.randn(num_tokens, in_f, generator=g).to(dtype)
            for b in (None, bias):
                ref = F.linear(x.float(), weight.float(), None if b is None else b.float())
                got = cpu_linear.linear(x, weight, b, packed)
                assert got.dtype == dtype and got.shape == ref.shape
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * in_f**0.5)
                if packed is None:  # the fallback is F.linear itself
                    assert torch.equal(got, F.linear(x, weight, b))
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        assert packed is not None  # oneDNN packs fp32 on every x86 CPU torch supports


def test_pack_weight_falls_back_where_it_cannot_pack(monkeypatch):
    assert cpu_linear.pack_weight(torch.randn(4, 4, dtype=torch.float64)) is None
    monkeypatch.setattr(cpu_linear, "_ops_available", lambda: False)
    w = torch.randn(8, 4)
    assert cpu_linear.pack_weight(w) is None
    x = torch.randn(3, 4)
    assert torch.equal(cpu_linear.linear(x, w, None, None), F.linear(x, w))


def test_fp32_engine_keeps_f_linear_and_pack_linears_packs_every_linear(smollm2):
    """fp32 is the exact-parity path: its linears stay on F.linear. pack_linears (used for
    bf16) packs every linear of a model."""
    from minivllm.layers.linear import LinearBase, ReplicatedLinear

    layers = [m for m in smollm2.runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(m.packed is None for m in layers)
    assert smollm2.runner.model.lm_head.packed is None
    model = torch.nn.Sequential(ReplicatedLinear(16, 8, bias=True), ReplicatedLinear(8, 4, False))
    for m in model:
        m.weight.data.normal_()
        if m.bias is not None:
            m.bias.data.normal_()
    cpu_linear.pack_linears(model)
    if torch.backends.mkldnn.is_available():
        assert all(m.packed is not None for m in model)
    x = torch.randn(3, 16)
    ref = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_rotary_is_bit_identical_to_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(64, 32, generator=g)  # [max_position, head_dim]: cos | sin
    positions = torch.tensor([0, 5, 63, 17])
    qkv = torch.randn(4, (4 + 2 * 2) * 32, generator=g).to(dtype)
    q = qkv[:, : 4 * 32].view(4, 4, 32)  # strided views of one buffer, as in the model
    k = qkv[:, 4 * 32 : 6 * 32].view(4, 2, 32)
    ref = apply_rotary_ref(q, k, *cos_sin_at(cache, positions))
    got = apply_rotary_folded(q, k, *folded_cos_sin_at(cache, positions))
    for r, o in zip(ref, got, strict=True):
        assert o.dtype == dtype and torch.equal(r, o)


def test_grouped_decode_attention_equals_per_head_softmax():
    g = torch.Generator().manual_seed(0)
    num_kv_heads, group, head_dim, block_size = 2, 3, 16, 4
    k_cache = torch.randn(12, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(12, block_size, num_kv_heads, head_dim, generator=g)
    seq_lens = torch.tensor([9, 3, 1])
    block_tables = torch.tensor([[5, 2, 7], [0, 0, 0], [11, 0, 0]])
    q = torch.randn(3, num_kv_heads * group, head_dim, generator=g)
    slots = context_slots(seq_lens, block_tables, block_size)
    out = decode_attention_at_slots(q, k_cache, v_cache, slots, seq_lens, 0.25)
    for i, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n)  # [n, num_kv_heads, head_dim]
        v = gather_kv(v_cache, block_tables[i], n)
        for h in range(num_kv_heads * group):
            p = torch.softmax(k[:, h // group] @ q[i, h] * 0.25, dim=0)
            torch.testing.assert_close(out[i, h], p @ v[:, h // group])
    one = decode_attention_at_slots(q[:1], k_cache, v_cache, slots[:1], seq_lens[:1], 0.25)
    torch.testing.assert_close(one, out[:1])  # batch 1 takes the unmasked branch


@pytest.mark.slow
def test_smollm2_bf16_diverges_only_within_transformers_top5(smollm2_path):
    """bf16 greedy differs from transformers' bf16 greedy by rounding: at the first
    position where the tokens differ, ours must be among transformers' 5 most likely."""
    import transformers

    from minivllm import LLMEngine, SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16)
    hf.eval()
    llm = LLMEngine(
        {
            "model_name_or_path": str(smollm2_path),
            "device": "cpu",
            "dtype": "bfloat16",
            "max_model_length": 512,
            "max_cached_blocks": 64,
            "block_size": 16,
        }
    )
    try:
        assert llm.dtype == torch.bfloat16 and llm.runner.kv_cache.dtype == torch.bfloat16
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            for text in ("What is the capital of France?", "Write a haiku about the sea.")
        ]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        ours = llm.generate(prompts, params)["token_ids"]
    finally:
        llm.exit()
    compared = 0
    with torch.inference_mode():
        for prompt, got in zip(prompts, ours, strict=True):
            # Transformers' logits along OUR sequence: each of our tokens is judged in the
            # context we actually produced.
            ids = torch.tensor([prompt + got])
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()  # [16, vocab]
            hf_greedy = logits.argmax(-1).tolist()
            pairs = enumerate(zip(got, hf_greedy, strict=True))
            first = next((i for i, (a, b) in pairs if a != b), None)
            if first is not None:
                top5 = logits[first].topk(5).indices.tolist()
                assert got[first] in top5, f"token {first}: {got[first]} not in {top5}"
            compared += 1
            assert len(set(got)) > 3  # a real answer, not a repeated token
    assert compared == 2
