"""Shared fixtures: tiny random checkpoints, the embedded SmolLM2, engine builders."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Two cores: torch's default of one thread per core already fights the helpers' pytest
# workers; keep each test process to the cores it has.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# CPU engines run their decode step eager in tests (compiling costs seconds per engine);
# tests/test_cpu_step.py compiles on purpose.
os.environ.setdefault("MINIVLLM_CPU_COMPILE", "0")

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def decode_switches() -> Iterator:
    """`decode_switches(NAME="value", ...)`: the decode switches (minivllm/envs.py) as given
    for the kernel launches that follow, in place of those an earlier call set; every one
    is back to the environment's value after the test."""
    from minivllm.kernels import tuning

    patch = pytest.MonkeyPatch()

    def set_switches(**env: str) -> None:
        patch.undo()
        for name, value in env.items():
            patch.setenv(name, value)
        tuning.clear()

    yield set_switches
    set_switches()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from minivllm.loader import resolve_model

    return resolve_model(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """One SmolLM2 engine shared by the test modules (each test leaves it idle)."""
    from minivllm import LLMEngine

    llm = LLMEngine(
        {
            "model_name_or_path": str(smollm2_path),
            "device": "cpu",
            "dtype": "float32",  # the exact-parity path (auto is bf16 on AVX-512 BF16 CPUs)
            "max_model_length": 2048,
            "block_size": 16,
        }
    )
    yield llm
    llm.exit()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' SmolLM2 on the same weights, fp32: the reference."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    return model.eval()


def write_tiny_checkpoint(path: Path, arch: str, std: float = 0.15, **overrides) -> Path:
    """A small random model saved by transformers, with weights large enough that greedy
    decoding does not collapse into one repeated token."""
    import torch
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
    )
    common.update(overrides)
    if arch == "llama":
        common.setdefault(
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        config = transformers.LlamaConfig(tie_word_embeddings=True, **common)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":  # q/k/v biases; tied embeddings as in Qwen2.5-0.5B
        config = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":  # v0.3: no sliding window, rope theta 1e6
        config = transformers.MistralConfig(
            sliding_window=None, rope_theta=1e6, tie_word_embeddings=False, **common
        )
        model_cls = transformers.MistralForCausalLM
    else:
        config = transformers.Qwen3Config(head_dim=32, tie_word_embeddings=False, **common)
        model_cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(1234)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, std)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mistral"), "mistral")


def tiny_engine(path: Path, **kw):
    """An engine over a tiny checkpoint that has no tokenizer (token-id prompts only)."""
    from minivllm import EngineConfig, LLMEngine, ModelConfig

    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")  # the exact-parity path, whatever the CPU
    kw.setdefault("block_size", 16)
    kw.setdefault("max_cached_blocks", 256)
    config = EngineConfig(
        model_name_or_path=str(path),
        model=ModelConfig.from_checkpoint(path),
        model_path=str(path),
        **kw,
    )
    return LLMEngine(config)


def step_loop(llm, prompts, params) -> list[list[int]]:
    """Run prompts through the seed's add_prompt / step loop (checking the token budget
    every step); the completions in prompt order."""
    ids = [llm.add_prompt(p, params) for p in prompts]
    results = {}
    while not llm.scheduler.is_finished():
        finished, num_tokens, _ = llm.step()
        assert num_tokens <= llm.config.max_num_batched_tokens
        results.update(dict(finished))
    return [results[i] for i in ids]


def assert_product_matches_reference(product, reference, k: int, g) -> None:
    """A CPU weight kernel `product(x)` against its torch `reference(x)` for x of 1..8 rows
    (decode), 11 and 70 rows (more than one 8-row group and one 64-row tile), and a strided
    x (a row slice of a wider tensor)."""
    import torch

    for rows in (*range(1, 9), 11, 70):
        x = torch.randn(rows, k, generator=g)
        torch.testing.assert_close(product(x), reference(x), rtol=1e-4, atol=1e-3)
    wide = torch.randn(3, k + 5, generator=g)
    torch.testing.assert_close(product(wide[:, :k]), reference(wide[:, :k]), rtol=1e-4,
                               atol=1e-3)


# Questions the reduced-precision CPU paths answer greedily against the fp32 engine.
CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
        "Explain in two sentences how a bicycle stays upright."]


def assert_greedy_chat_follows(reference, engine, questions: list[str], max_tokens: int) -> None:
    """`engine`'s greedy replies to `questions` (as chat prompts) equal `reference`'s, or
    first differ at a token in the reference's top-5 there (both share the prefix up to it)."""
    from minivllm import SamplingParams

    prompts = [
        reference.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    want = reference.generate(prompts, params)
    got = engine.generate(prompts, params)["token_ids"]
    for w, g, lps in zip(want["token_ids"], got, want["logprobs"], strict=True):
        d = next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), None)
        if d is not None:
            assert g[d] in lps[d].top, (d, g[d], lps[d].top)


def assert_compiled_step_matches_eager(step, cases, tol: float) -> None:
    """A compiled `CPUDecodeStep` against its `decode_layer` run eager, over a pool of
    random K/V (the context matters) and random context slots, for each (num_seqs,
    max_prev) of `cases`: hidden states and new K/V within `tol`. Leaves the pool zeroed."""
    import torch

    from minivllm.engine.cpu_step import decode_layer

    g = torch.Generator().manual_seed(0)
    num_slots = step.kv_cache.shape[2] * step.kv_cache.shape[3]
    with torch.inference_mode():
        step.kv_cache.normal_(generator=g)
        for num_seqs, max_prev in cases:
            ids = torch.randint(0, 512, (num_seqs,), generator=g)
            lens = torch.randint(1, max_prev + 1, (num_seqs,), generator=g) + 1
            lens[0] = max_prev + 1  # the longest sequence sets the width
            prev = torch.randint(0, num_slots, (num_seqs, max_prev), generator=g)
            got = step.forward(ids, lens - 1, prev, lens)
            want = step.forward(ids, lens - 1, prev, lens, layer=decode_layer)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
        step.kv_cache.zero_()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    """Poll `condition` until it returns something true (returned); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> int | None:
    """SIGTERM (if it still runs), then its exit status; killed if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        return None


@contextlib.contextmanager
def serving(tmp: Path, argv: list[str], *, timeout: float = 240.0, stop_timeout: float = 60,
            clean_exit: bool = False) -> Iterator[str]:
    """`minivllm serve <argv>` (its log in `tmp`) for the `with` block: its base URL. Then
    stopped (`stop_process`); `clean_exit`: its exit status must be 0."""
    from minivllm.server.launch import launch_server

    proc, url = launch_server(argv, tmp / "server.log", cwd=tmp, timeout=timeout)
    try:
        yield url
    finally:
        status = stop_process(proc, stop_timeout)
    if clean_exit:
        assert status == 0, f"the server exited with status {status}"


@pytest.fixture()
def client(request, server):
    """An OpenAI client of the test module's `server` fixture (its base URL), with the
    module's `API_KEY` if it has one."""
    import openai

    api_key = getattr(request.module, "API_KEY", "none")
    with openai.OpenAI(base_url=f"{server}/v1", api_key=api_key, max_retries=0) as c:
        yield c


def dummy_engine(**kw):
    """Qwen3-0.6B's config with random weights on the GPU (the GPU tests' engine)."""
    from minivllm import LLMEngine

    config = {
        "model_name_or_path": "Qwen/Qwen3-0.6B",
        "load_format": "dummy",
        "gpu_memory_utilization": 0.3,
        "max_model_length": 4096,
        "max_num_sequences": 64,
        "seed": 0,
        **kw,
    }
    return LLMEngine(config)


def run_kernel_checks(path: str, group: str) -> None:
    """Run `path` as a script for one check group in a fresh process: "compile_sm90"
    compiles for the GPU, any other group runs under Triton's interpreter."""
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    if group == "compile_sm90":
        del env["TRITON_INTERPRET"]
        env["MINIVLLM_TRITON"] = "1"  # Triton loaded even on a CPU build of torch
    proc = subprocess.run([sys.executable, path, group], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{group} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
