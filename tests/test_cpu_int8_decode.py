"""Int8 activations for the CPU's q4_1 / q8_0 products (`cpu_decode_dtype`): which settings
take them, the kernel against its reference, and SmolLM2's greedy replies against the fp32
engine's."""

from __future__ import annotations

import pytest
import torch
from conftest import CHAT, assert_greedy_chat_follows

from minivllm import EngineConfig
from minivllm.kernels import cpu_lowp_linear as kernel
from minivllm.layers import cpu_linear

needs_vnni = pytest.mark.skipif(
    kernel.unavailable_reason() is not None or not kernel.int8_activations_available(),
    reason="the CPU kernel does not build here, or the CPU lacks AVX512-VNNI / -VBMI",
)


def test_settings_that_take_int8_activations(monkeypatch):
    monkeypatch.setattr(kernel, "int8_activations_available", lambda: True)
    assert cpu_linear.decode_dtype("auto", "auto", "q4_1/q8_0") == "int8"
    assert cpu_linear.decode_dtype("auto", "float32", "q4_1/q8_0") is None  # exact: asked
    assert cpu_linear.decode_dtype("float32", "auto", "q4_1/q8_0") is None
    assert cpu_linear.decode_dtype("int8", "float32", "q8_0") == "int8"
    assert cpu_linear.decode_dtype("auto", "auto", "bfloat16") is None  # not a group format
    assert cpu_linear.decode_dtype("auto", "auto", None) is None
    with pytest.raises(ValueError, match=r"cpu_decode_dtype='int8' needs q4_1 / q8_0 weights"):
        cpu_linear.decode_dtype("int8", "auto", "int8")
    monkeypatch.setattr(kernel, "int8_activations_available", lambda: False)
    assert cpu_linear.decode_dtype("auto", "auto", "q4_1/q8_0") is None  # no VNNI: fp32
    with pytest.raises(ValueError, match=r"AVX512-VNNI and AVX512-VBMI"):
        cpu_linear.decode_dtype("int8", "auto", "q4_1/q8_0")
    with pytest.raises(ValueError, match=r"cpu_decode_dtype='bf16': must be one of 'auto'"):
        EngineConfig(model_name_or_path="x", cpu_decode_dtype="bf16")


@needs_vnni
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_int8_activation_kernel_matches_its_reference(fmt):
    """Rows 1 to 9 (the 8-row tiles and a remainder), outputs that do not fill the last
    block, a bias, an all-zero group and a constant one: within 1e-5 of the float64
    reference (the int32 group sums are exact; only the fp32 sum over groups differs)."""
    g = torch.Generator().manual_seed(3)
    width = kernel.block_width()
    for n, k in ((96, 64), (100, 160), (576, 576)):
        weight = torch.randn(n, k, generator=g) * 0.1
        if fmt == "q4_1":
            values, scales, mins = kernel.quantize_q4_1(weight, width)
        else:
            (values, scales), mins = kernel.quantize_q8_0(weight, width), None
        bias = torch.randn(n, generator=g)
        for rows in (1, 3, 8, 9):
            x = torch.randn(rows, k, generator=g) * 3
            x[0, :32] = 0.0
            x[-1, 32:64] = 0.5
            for b in (None, bias):
                got = kernel.group_linear(x, values, scales, mins, b, n, True)
                want = kernel.group_linear_i8_ref(x, values, scales, mins, b, n)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # It is not the fp32 kernel: the activations' rounding shows.
        x = torch.randn(4, k, generator=g)
        exact = kernel.group_linear(x, values, scales, mins, None, n)
        assert not torch.equal(exact, kernel.group_linear(x, values, scales, mins, None, n, True))


@needs_vnni
def test_linears_take_int8_activations():
    """`int8_activations` marks the group-format linears; their products run the int8 path
    (equal to the kernel's own), the others keep theirs."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 96, generator=g)
    values, scales, mins = kernel.quantize_q4_1(weight, kernel.block_width())
    model = torch.nn.Module()
    model.a = torch.nn.Linear(96, 64, bias=False)
    model.a.lowp = cpu_linear.LowpWeight(values, scales, 64, mins, "q4_1")
    model.b = torch.nn.Linear(96, 64, bias=False)
    packed = kernel.pack_bf16(weight, kernel.block_width())
    model.b.lowp = cpu_linear.LowpWeight(packed, None, 64)
    assert cpu_linear.int8_activations(model) == 1
    assert model.a.lowp.int8_act and not model.b.lowp.int8_act
    x = torch.randn(5, 96, generator=g)
    assert torch.equal(model.a.lowp.product(x, None),
                       kernel.group_linear(x, values, scales, mins, None, 64, True))


@needs_vnni
def test_smollm2_int8_decode_follows_fp32(smollm2, smollm2_path):
    """SmolLM2 with its Q4_1 / Q8_0 weights and int8 activations (the native decode step
    and the LM head): greedy replies, four at once, equal the fp32 engine's or first
    differ at a token in fp32's top-5 there; the header says so."""
    from minivllm import LLMEngine
    from minivllm.frontend.engine_frontend import dtype_label

    llm = LLMEngine({"model_name_or_path": str(smollm2_path), "device": "cpu",
                     "dtype": "float32", "cpu_weight_dtype": "compact",
                     "cpu_prefill_dtype": "float32", "cpu_decode_dtype": "int8",
                     "max_model_length": 2048, "block_size": 16})
    try:
        assert llm.cpu_decode_dtype == "int8"
        assert dtype_label(llm) == "float32, q4_1/q8_0 weights, int8 decode"
        model = llm.runner.model
        assert model.model.layers[0].mlp.down_proj.lowp.int8_act
        assert model.lm_head.lowp.int8_act
        assert_greedy_chat_follows(smollm2, llm, CHAT, max_tokens=24)
    finally:
        llm.exit()
