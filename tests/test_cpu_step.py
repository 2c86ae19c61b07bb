"""The compiled CPU decode step (engine/cpu_step.py): it equals the eager step, falls back
to the model's eager forward where it cannot compile, and the lazily zeroed KV pool."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import assert_compiled_step_matches_eager, hf_greedy, tiny_engine

from minivllm import SamplingParams
from minivllm.engine import cpu_step
from minivllm.engine.cpu_step import CPUDecodeStep, decode_layer, lazily_zeroed


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Lengths cross the 16-token blocks; a 1-token prompt gives a one-column context.
    lengths = (1, 16, 37, 90, 5, 23, 61, 2)[:n]
    return [torch.randint(0, 512, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazily_zeroed_pool_reads_zeros_and_keeps_writes(dtype):
    shape = (2, 3, 4, 16, 2, 8)
    pool = lazily_zeroed(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[1, 2, 3].fill_(1.5)
    assert pool[1, 2, 3].eq(1.5).all() and pool.sum().item() == 1.5 * 16 * 2 * 8
    assert lazily_zeroed((0, 4), dtype).shape == (0, 4)


def test_no_compile_where_eager_is_asked_for_or_no_compiler(monkeypatch, tiny_llama):
    monkeypatch.setenv(cpu_step.STEP_ENV, "compiled")
    monkeypatch.setenv(cpu_step.COMPILE_ENV, "0")
    assert cpu_step.compile_unavailable_reason() == "MINIVLLM_CPU_COMPILE=0"
    monkeypatch.setenv(cpu_step.COMPILE_ENV, "1")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert "no C++ compiler" in cpu_step.compile_unavailable_reason()
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        llm = tiny_engine(tiny_llama)  # the engine still runs, on the model's eager forward
    try:
        assert llm.runner.cpu_step is None
        assert cpu_step.cpu_decode_step(llm.runner.model, llm.runner.kv_cache, True) is None
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
        assert len(out["token_ids"][0]) == 3
    finally:
        llm.exit()


def test_failed_compile_falls_back_to_eager_with_a_warning(monkeypatch, tiny_llama):
    monkeypatch.setenv(cpu_step.STEP_ENV, "compiled")
    monkeypatch.setenv(cpu_step.COMPILE_ENV, "1")

    def broken(self):
        raise RuntimeError("inductor: no luck\nsecond line")

    monkeypatch.setattr(CPUDecodeStep, "warm_up", broken)
    with pytest.warns(RuntimeWarning, match="RuntimeError: inductor: no luck"):
        llm = tiny_engine(tiny_llama)
    try:
        assert llm.runner.cpu_step is None
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
        assert len(out["token_ids"][0]) == 3
    finally:
        llm.exit()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # q/k norm; q/k/v biases
def test_eager_decode_step_equals_the_model_step(arch, request, monkeypatch):
    """`decode_layer` run eager, step by step, against the model's own decode (the path
    the parity tests check against transformers): same tokens, same hidden states."""
    path = request.getfixturevalue(f"tiny_{arch}")
    monkeypatch.setenv(cpu_step.STEP_ENV, "eager")
    llm = tiny_engine(path)
    try:
        runner = llm.runner
        step = CPUDecodeStep(runner.model, runner.kv_cache)
        step.layer = decode_layer  # eager: no compiler involved
        hidden = {}
        real_run = step.__call__

        def spy(input_ids, positions, meta):
            hidden["step"] = real_run(input_ids, positions, meta)
            return hidden["step"]

        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = _prompts(4)
        reference = llm.generate(prompts, params)["token_ids"]
        runner.cpu_step = spy
        assert llm.generate(prompts, params)["token_ids"] == reference
        assert hidden["step"].shape == (4, llm.config.model.hidden_size)
    finally:
        llm.exit()


@pytest.fixture(scope="module")
def compiled_llama(tiny_llama):
    """A tiny Llama engine whose decode step is compiled (the one compile of the suite)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(cpu_step.STEP_ENV, "compiled")
    mp.setenv(cpu_step.COMPILE_ENV, "1")
    llm = tiny_engine(tiny_llama)
    mp.undo()
    yield llm
    llm.exit()


@pytest.mark.slow
def test_compiled_step_equals_the_eager_step(compiled_llama):
    step = compiled_llama.runner.cpu_step
    assert step is not None, "inductor could not compile here (see the warning)"
    # The wide weights went column-major for the compiled step; the tensors are the same.
    gate_up = compiled_llama.runner.model.model.layers[0].mlp.gate_up_proj.weight
    assert gate_up.stride() == (1, gate_up.shape[0])
    assert_compiled_step_matches_eager(step, ((1, 1), (1, 40), (3, 7), (8, 70)), tol=1e-5)


@pytest.mark.slow
def test_compiled_engine_matches_transformers(compiled_llama, tiny_llama):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompts = _prompts(8, seed=1)
    out = compiled_llama.generate(
        prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    for prompt, got in zip(prompts, out["token_ids"], strict=True):
        assert got == hf_greedy(hf.eval(), prompt, 40)


@pytest.mark.slow
def test_bf16_model_compiles_its_decode_step_where_the_cpu_has_bf16(tiny_llama, monkeypatch):
    """A bf16 model (dtype auto on AVX-512 BF16 CPUs) gets the compiled step, not the eager
    forward: inductor once failed on the oneDNN-packed weights there. Its hidden states
    equal the eager step's within bf16's rounding. On a CPU without bf16 matmuls (where the
    compiled bf16 step is not verified) the model keeps its eager step, and says why."""
    from minivllm.cpu_features import has_fast_bf16

    monkeypatch.setenv(cpu_step.STEP_ENV, "native")  # unavailable in bf16: the compiled one
    monkeypatch.setenv(cpu_step.COMPILE_ENV, "1")
    if not has_fast_bf16():
        with pytest.warns(RuntimeWarning, match="compiled bf16 step is not verified"):
            llm = tiny_engine(tiny_llama, dtype="bfloat16")
        try:
            assert llm.runner.cpu_step is None
            out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
            assert len(out["token_ids"][0]) == 4
        finally:
            llm.exit()
        return
    llm = tiny_engine(tiny_llama, dtype="bfloat16")
    try:
        step = llm.runner.cpu_step
        assert isinstance(step, CPUDecodeStep)
        assert_compiled_step_matches_eager(step, ((1, 1), (3, 7), (8, 40)), tol=5e-2)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
        assert len(out["token_ids"][0]) == 4
    finally:
        llm.exit()
