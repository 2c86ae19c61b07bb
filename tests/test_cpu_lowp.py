"""Weight-only bf16 / int8 weights on the CPU (`cpu_weight_dtype`): the kernel against its
torch reference, the engine with those weights against fp32 weights, the compiled decode
step against the eager one, and the option's errors."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_compiled_step_matches_eager,
    assert_greedy_chat_follows,
    assert_product_matches_reference,
    tiny_engine,
)

from minivllm import EngineConfig, SamplingParams
from minivllm.kernels import cpu_lowp_linear as kernel
from minivllm.layers import cpu_linear

pytestmark = pytest.mark.skipif(
    kernel.unavailable_reason() is not None,
    reason=f"the CPU kernel does not build here: {kernel.unavailable_reason()}",
)

# [out, in] of the linears: SmolLM2-135M (qkv, down), the tiny Qwen3 and Llama
# of conftest.py, and odd sizes (a partial last block, in-features not a multiple of 8, an
# odd number of blocks: one row takes them four at a time, those left one by one).
SHAPES = [
    (960, 576), (576, 1536),
    (256, 64), (64, 128), (512, 64),
    (128, 64),
    (13, 7), (17, 1536), (1, 5), (9, 33), (48, 64), (40, 70), (112, 64),
]


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_equals_reference(fmt, shape):
    n, k = shape
    g = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if n % 2 else None  # odd n: with a bias
    width = kernel.block_width()
    if fmt == "bfloat16":
        packed, scales = kernel.pack_bf16(weight, width), None
    else:
        packed, scales = kernel.quantize_int8(weight, width)
    assert_product_matches_reference(
        lambda x: kernel.lowp_linear(x, packed, scales, bias, n),
        lambda x: kernel.lowp_linear_ref(x, packed, scales, bias, n),
        k,
        g,
    )


def test_packing_round_trips():
    """bf16 packing is the rounded weight; int8 is within half a step of it per channel."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(21, 40, generator=g)
    weight[3] = 0  # an all-zero channel keeps a usable scale
    width = kernel.block_width()
    bf16 = kernel.dequantize(kernel.pack_bf16(weight, width), None, 21)
    assert torch.equal(bf16, weight.to(torch.bfloat16).float())
    q, scales = kernel.quantize_int8(weight, width)
    deq = kernel.dequantize(q, scales, 21)
    assert q.shape == (-(-21 // width), 40, width) and scales.shape == (q.shape[0] * width,)
    assert (deq - weight).abs().le(scales[:21, None] / 2 + 1e-7).all()
    assert torch.equal(deq[3], torch.zeros(40))


def test_bad_option_values_name_the_field():
    with pytest.raises(ValueError, match=r"cpu_weight_dtype='fp16'"):
        EngineConfig(model_name_or_path="x", cpu_weight_dtype="fp16")
    with pytest.raises(ValueError, match=r"cpu_weight_dtype='int8' needs dtype='float32'"):
        cpu_linear.weight_format("int8", torch.device("cpu"), torch.bfloat16)
    # bf16 weights with bf16 compute is the plain bf16 path; CUDA ignores the option.
    assert cpu_linear.weight_format("bfloat16", torch.device("cpu"), torch.bfloat16) is None
    assert cpu_linear.weight_format("int8", torch.device("cuda"), torch.bfloat16) is None
    assert cpu_linear.weight_format("auto", torch.device("cpu"), torch.float32) is None
    assert cpu_linear.weight_format("int8", torch.device("cpu"), torch.float32) == "int8"


def test_cli_names_the_option(capsys):
    from minivllm.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--device", "cpu", "--cpu-weight-dtype", "int4", "--prompt", "x"])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("minivllm: error: --cpu-weight-dtype='int4'") and "\n" not in err


CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_path):
    from minivllm import LLMEngine

    llm = LLMEngine(
        {
            "model_name_or_path": str(smollm2_path),
            "device": "cpu",
            "dtype": "float32",
            "cpu_weight_dtype": "bfloat16",
            "max_model_length": 2048,
            "block_size": 16,
        }
    )
    yield llm
    llm.exit()


def test_smollm2_bf16_weights_follow_fp32(smollm2, smollm2_bf16):
    """Greedy tokens with bf16 weights equal fp32's, or first differ at a token in fp32's
    top-5 there (both runs share the prefix up to it)."""
    assert smollm2_bf16.cpu_weight_format == "bfloat16"
    layer = smollm2_bf16.runner.model.model.layers[0]
    assert layer.mlp.gate_up_proj.weight is None  # the fp32 copy is freed
    assert layer.mlp.gate_up_proj.lowp.packed.dtype == torch.bfloat16
    assert_greedy_chat_follows(smollm2, smollm2_bf16, CHAT, max_tokens=16)


@pytest.mark.slow
def test_compiled_step_equals_eager_with_int8_weights(tiny_llama, monkeypatch):
    """The compiled decode step calls the kernel as one op: it equals the eager step over the
    same int8 weights, and the engine's greedy tokens equal the eager engine's."""
    from torch._dynamo.utils import counters

    from minivllm.engine import cpu_step

    monkeypatch.setenv(cpu_step.STEP_ENV, "compiled")
    monkeypatch.setenv(cpu_step.COMPILE_ENV, "1")
    llm = tiny_engine(tiny_llama, cpu_weight_dtype="int8")
    monkeypatch.setenv(cpu_step.STEP_ENV, "eager")
    eager = tiny_engine(tiny_llama, cpu_weight_dtype="int8")
    try:
        step = llm.runner.cpu_step
        assert step is not None, "inductor could not compile here (see the warning)"
        assert llm.runner.model.model.layers[0].self_attn.qkv_proj.lowp.scales is not None
        assert_compiled_step_matches_eager(step, ((1, 1), (3, 7), (8, 40)), tol=1e-5)
        prompts = [[(7 * i + j) % 512 for j in range(5 + 3 * i)] for i in range(4)]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        assert eager.runner.cpu_step is None
        graphs = counters["stats"]["unique_graphs"]
        assert llm.generate(prompts, params)["token_ids"] == (
            eager.generate(prompts, params)["token_ids"]
        )
        # One sequence alone, then four: the warm-up's graph serves both (no recompile).
        assert llm.generate(prompts[:1], params)["token_ids"] == (
            eager.generate(prompts[:1], params)["token_ids"]
        )
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        llm.exit()
        eager.exit()


def test_header_names_the_weight_format():
    from types import SimpleNamespace

    from minivllm.frontend.engine_frontend import dtype_label

    engine = SimpleNamespace(dtype=torch.float32, cpu_weight_format="int8")
    assert dtype_label(engine) == "float32, int8 weights"
    assert dtype_label(SimpleNamespace(dtype=torch.bfloat16)) == "bfloat16"
    engine = SimpleNamespace(dtype=torch.float32, cpu_weight_format="q4_1/q8_0",
                             cpu_prefill_dtype=torch.bfloat16)
    assert dtype_label(engine) == "float32, q4_1/q8_0 weights, bfloat16 prefill"
