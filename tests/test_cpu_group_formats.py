"""llama.cpp's group formats on the CPU (`cpu_weight_dtype` q8_0 / q4_1 / compact): the
kernel against its torch reference, quantization that recovers weights already on the
format's grid, and `compact` keeping a GGUF model's own weights (the embedded SmolLM2:
the same greedy tokens as its fp32 copy)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_product_matches_reference, tiny_engine, write_tiny_checkpoint

from minivllm import SamplingParams
from minivllm.engine.cpu_step import NativeCPUDecodeStep
from minivllm.kernels import cpu_lowp_linear as kernel
from minivllm.layers import cpu_linear

pytestmark = pytest.mark.skipif(
    kernel.unavailable_reason() is not None,
    reason=f"the CPU kernel does not build here: {kernel.unavailable_reason()}",
)

# [out, in]: SmolLM2's qkv and down, a partial last block of outputs, one output.
SHAPES = [(960, 576), (576, 1536), (13, 64), (17, 32), (1, 96)]


def _quantize(fmt: str, weight: torch.Tensor):
    width = kernel.block_width()
    if fmt == "q8_0":
        return (*kernel.quantize_q8_0(weight, width), None)
    return kernel.quantize_q4_1(weight, width)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_group_kernel_equals_reference(fmt, shape):
    n, k = shape
    g = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=g)
    weight[0, :32] = 0.25  # a constant group: scale 0 (q4_1) or one value (q8_0)
    bias = torch.randn(n, generator=g) if n % 2 else None
    values, scales, mins = _quantize(fmt, weight)
    assert_product_matches_reference(
        lambda x: kernel.group_linear(x, values, scales, mins, bias, n),
        lambda x: kernel.group_linear_ref(x, values, scales, mins, bias, n),
        k,
        g,
    )


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_quantization_is_close_and_recovers_its_own_grid(fmt):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=g)
    values, scales, mins = _quantize(fmt, weight)
    deq = kernel.dequantize_group(values, scales, mins, 40)
    step = scales.transpose(1, 2).reshape(-1, 3)[:40].float().repeat_interleave(32, dim=1)
    assert (deq - weight).abs().le(step / 2 + 1e-6).all()  # within half a step
    # A weight that came from this format (a dequantized GGUF) is recovered bit for bit.
    again = _quantize(fmt, deq)
    assert torch.equal(kernel.dequantize_group(*again, 40), deq)


def test_group_formats_need_whole_groups(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "llama", hidden_size=48)
    with pytest.raises(ValueError, match=r"cpu_weight_dtype='q4_1': .*in_features=48 is not a "
                       r"multiple of the group size 32"):
        tiny_engine(path, cpu_weight_dtype="q4_1")
    # compact falls back to bf16 for such a weight
    llm = tiny_engine(path, cpu_weight_dtype="compact")
    try:
        assert llm.cpu_weight_format == "bfloat16"
    finally:
        llm.exit()


def test_option_values():
    from minivllm import EngineConfig

    with pytest.raises(ValueError, match=r"cpu_weight_dtype='q4_0': must be one of .*'q4_1'"):
        EngineConfig(model_name_or_path="x", cpu_weight_dtype="q4_0")
    cpu = torch.device("cpu")
    assert cpu_linear.weight_format("q4_1", cpu, torch.float32) == "q4_1"
    assert cpu_linear.weight_format("compact", cpu, torch.float32) == "compact"
    # compact asks for the best the machine runs: with bf16 compute, the weights stay bf16
    assert cpu_linear.weight_format("compact", cpu, torch.bfloat16) is None
    with pytest.raises(ValueError, match=r"cpu_weight_dtype='q8_0' needs dtype='float32'"):
        cpu_linear.weight_format("q8_0", cpu, torch.bfloat16)


def test_auto_dtype_is_fp32_with_a_weight_format():
    """The weight formats run fp32 activations: dtype auto resolves to fp32 with any of them
    (also on AVX-512 BF16 CPUs, where plain auto is bf16)."""
    from minivllm.cpu_features import default_cpu_dtype
    from minivllm.engine.plan import resolve_dtype

    cpu = torch.device("cpu")
    for fmt in ("compact", "q4_1", "int8", "bfloat16", "float32"):
        assert resolve_dtype("auto", cpu, fmt) == torch.float32
    assert resolve_dtype("auto", cpu, "auto") == default_cpu_dtype()
    assert resolve_dtype("bfloat16", cpu, "compact") == torch.bfloat16  # asked for: kept


@pytest.fixture(scope="module")
def gguf_like_qwen3(tmp_path_factory):
    """A tiny Qwen3 whose linears sit on the Q4_1 grid and whose LM head sits on Q8_0's,
    as a model converted from a llama.cpp Q4_1 file does."""
    import safetensors.torch

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("gguf_like"), "qwen3")
    file = path / "model.safetensors"
    tensors = safetensors.torch.load_file(file)
    for name, t in tensors.items():
        if t.dim() != 2 or "embed_tokens" in name:
            continue
        fmt = "q8_0" if name == "lm_head.weight" else "q4_1"
        q = _quantize(fmt, t.float())
        tensors[name] = kernel.dequantize_group(*q, t.shape[0]).to(t.dtype)
    safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_compact_keeps_a_gguf_models_own_weights(gguf_like_qwen3):
    """compact takes q4_1 for the layers and q8_0 for the head, exactly: the greedy tokens
    equal the fp32 weights' (only the order of the sums differs)."""
    llm = tiny_engine(gguf_like_qwen3, cpu_weight_dtype="compact")
    fp32 = tiny_engine(gguf_like_qwen3)
    try:
        assert llm.cpu_weight_format == "q4_1/q8_0"
        assert isinstance(llm.runner.cpu_step, NativeCPUDecodeStep)
        model = llm.runner.model
        assert model.model.layers[0].mlp.gate_up_proj.lowp.fmt == "q4_1"
        assert model.lm_head.lowp.fmt == "q8_0"
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 9, 33, 70)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        assert llm.generate(prompts, params)["token_ids"] == (
            fp32.generate(prompts, params)["token_ids"]
        )
    finally:
        llm.exit()
        fp32.exit()


@pytest.mark.slow
def test_smollm2_compact_is_its_gguf_and_decodes_like_fp32(smollm2, smollm2_path):
    """The embedded SmolLM2 comes from a Q4_1 GGUF: compact (the apps' default) holds it in
    Q4_1 / Q8_0, and its greedy chat replies equal the fp32 engine's."""
    from minivllm import LLMEngine

    llm = LLMEngine({"model_name_or_path": str(smollm2_path), "device": "cpu",
                     "dtype": "float32", "cpu_weight_dtype": "compact",
                     "max_model_length": 2048, "block_size": 16})
    try:
        assert llm.cpu_weight_format == "q4_1/q8_0"
        prompts = [
            smollm2.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in ("What is the capital of France?", "Write a haiku about the sea.",
                      "Why is the sky blue?", "List three prime numbers.")
        ]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        assert llm.generate(prompts, params)["token_ids"] == (
            smollm2.generate(prompts, params)["token_ids"]
        )
    finally:
        llm.exit()
