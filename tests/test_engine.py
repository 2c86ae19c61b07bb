"""Engine behaviour on CPU: equivalences, bad inputs, streaming, stop conditions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_engine

from minivllm import EngineConfig, LLMEngine, ModelConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def shared_prefix_prompts(n: int = 6, prefix_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 512, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(0, 512, (5 + 7 * i,), generator=g).tolist() for i in range(n)]


def run(path, prompts, params=GREEDY, **kw):
    llm = tiny_engine(path, **kw)
    try:
        out = llm.generate(prompts, params)
        return out["token_ids"], llm.stats()
    finally:
        llm.exit()


def no_leak(llm: LLMEngine) -> None:
    assert llm.scheduler.is_finished()
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants(live=[])


# -- equivalences (exact for greedy) ------------------------------------------------------


def test_prefix_cache_on_off_identical_and_hits(tiny_qwen3):
    prompts = shared_prefix_prompts()
    on, stats_on = run(tiny_qwen3, prompts, enable_prefix_caching=True, max_num_sequences=2)
    off, stats_off = run(tiny_qwen3, prompts, enable_prefix_caching=False, max_num_sequences=2)
    assert on == off
    assert stats_on.prefix_cache_hit_rate > 0.3
    assert stats_off.prefix_cache_hit_rate == 0


def test_chunked_prefill_identical(tiny_llama):
    prompts = shared_prefix_prompts(prefix_len=70)
    whole, _ = run(tiny_llama, prompts, enable_chunked_prefill=False, max_num_batched_tokens=1024)
    chunked, stats = run(tiny_llama, prompts, max_num_batched_tokens=24)
    assert whole == chunked
    assert stats.num_steps > len(prompts) * GREEDY.max_tokens / 6


def test_preemption_identical(tiny_qwen3):
    prompts = shared_prefix_prompts()
    roomy, _ = run(tiny_qwen3, prompts, max_cached_blocks=256)
    # 9 blocks of 16 tokens cannot hold six ~100-token sequences at once.
    tight, stats = run(tiny_qwen3, prompts, max_cached_blocks=9, max_model_length=128)
    assert roomy == tight
    assert stats.num_preemptions > 0


def test_batch_composition_does_not_change_greedy_output(tiny_llama):
    prompts = shared_prefix_prompts(4)
    together, _ = run(tiny_llama, prompts)
    alone = [run(tiny_llama, [p])[0][0] for p in prompts]
    assert together == alone


# -- the step loop and abort ----------------------------------------------------------------


def test_abort_frees_blocks_and_others_unchanged(tiny_qwen3):
    prompts = shared_prefix_prompts(4)
    expected, _ = run(tiny_qwen3, prompts, enable_prefix_caching=False)
    llm = tiny_engine(tiny_qwen3, enable_prefix_caching=False, max_num_batched_tokens=32)
    ids = [llm.add_prompt(p, GREEDY) for p in prompts]
    victim_waiting, victim_running = llm.add_prompt(prompts[0], GREEDY), None
    llm.abort(victim_waiting)  # aborted while waiting
    results = {}
    for step in range(400):
        finished, _, _ = llm.step()
        results.update(dict(finished))
        if step == 3:
            used = llm.block_manager.num_used_blocks
            victim_running = ids[1]
            llm.abort(victim_running)  # mid-prefill or decode: blocks back at once
            assert llm.block_manager.num_used_blocks < used
            llm.block_manager.check_invariants(live=llm.scheduler.running)
        if llm.scheduler.is_finished():
            break
    assert victim_running not in results
    for i in (0, 2, 3):
        assert results[ids[i]] == expected[i]
    no_leak(llm)
    assert llm.add_prompt([1, 2, 3], GREEDY) not in ids + [victim_waiting]  # ids never reused
    llm.exit()


def test_step_reports_prefill_and_token_counts(tiny_llama):
    llm = tiny_engine(tiny_llama)
    llm.add_prompt(list(range(30)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    first = llm.step()
    assert first == ([], 30, True)
    assert llm.step() == ([], 1, False)
    finished, n, prefill = llm.step()
    assert n == 1 and not prefill and len(finished) == 1 and len(finished[0][1]) == 3
    assert llm.step() == ([], 0, False)
    no_leak(llm)
    llm.exit()


# -- stop conditions ------------------------------------------------------------------------


def test_stop_token_ids_eos_and_length(tiny_llama):
    prompt = list(range(10, 30))
    full, _ = run(
        tiny_llama, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    full = full[0]
    stop_at = full[7]
    first = full.index(stop_at)
    got, _ = run(
        tiny_llama, [prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at])
    )
    assert got[0] == full[: first + 1]
    got, _ = run(tiny_llama, [prompt], SamplingParams(temperature=0, max_tokens=20), eos=[stop_at])
    assert got[0] == full[: first + 1]
    got, _ = run(
        tiny_llama,
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        eos=[stop_at],
    )
    assert got[0] == full
    got, _ = run(tiny_llama, [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert got[0] == full[:5]
    # max_model_length caps prompt + completion, per engine and per request.
    got, _ = run(
        tiny_llama,
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, max_model_length=26),
    )
    assert got[0] == full[:6]
    got, _ = run(
        tiny_llama,
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        max_model_length=24,
    )
    assert got[0] == full[:4]


# -- sampling -------------------------------------------------------------------------------


def test_seeded_sampling_reproducible_across_batches(tiny_qwen3):
    prompts = shared_prefix_prompts(3)
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, ignore_eos=True, seed=123
    )
    a, _ = run(tiny_qwen3, prompts, params)
    b, _ = run(tiny_qwen3, prompts[:1], params)
    c, _ = run(tiny_qwen3, prompts, params, seed=999)
    assert a[0] == b[0] == c[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    d, _ = run(tiny_qwen3, prompts[:1], unseeded, seed=1)
    e, _ = run(tiny_qwen3, prompts[:1], unseeded, seed=2)
    assert d != e  # the engine seed drives unseeded requests


def test_top_k_one_is_greedy(tiny_qwen3):
    prompts = shared_prefix_prompts(2)
    greedy, _ = run(tiny_qwen3, prompts)
    topk1, _ = run(
        tiny_qwen3,
        prompts,
        SamplingParams(temperature=0.8, top_k=1, max_tokens=24, ignore_eos=True),
    )
    assert greedy == topk1


# -- bad inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_model_length": 0}, "max_model_length"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_rejected_then_engine_serves(tiny_llama):
    llm = tiny_engine(tiny_llama, max_model_length=64)
    with pytest.raises(ValueError, match="empty"):
        llm.add_prompt([], GREEDY)
    with pytest.raises(ValueError, match="token id 512"):
        llm.add_prompt([1, 512], GREEDY)
    with pytest.raises(ValueError, match=r"70 tokens.*max_model_length is 64"):
        llm.add_prompt(list(range(70)), GREEDY)
    with pytest.raises(ValueError, match="text prompt needs a tokenizer"):
        llm.add_prompt("hello", GREEDY)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.add_prompt([1, 2], {"temperature": 0})
    params = SamplingParams()
    params.max_tokens = -3  # mutated after construction: still caught at submission
    with pytest.raises(ValueError, match="max_tokens"):
        llm.add_prompt([1, 2], params)
    assert llm.scheduler.is_finished()
    out = llm.generate([[1, 2, 3]], GREEDY)
    assert len(out["token_ids"][0]) == GREEDY.max_tokens
    llm.exit()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"unknown_key": 1}, "unknown config key.*unknown_key"),
        ({"block_size": 48}, "block_size=48"),
        ({"block_size": 512}, "block_size=512"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization=0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"),
        ({"max_model_length": 10**6}, "max_model_length=1000000 is above"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"num_heads": 5}, "num_heads=5 disagrees"),
        ({"world_size": 4}, "num_heads=9 is not divisible by world_size=4"),
    ],
)
def test_bad_config_names_the_key(smollm2_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict({"model_name_or_path": str(smollm2_path), **overrides})


def test_missing_model_and_unknown_architecture(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_name_or_path"):
        EngineConfig.from_dict({"model_name_or_path": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported:.*Qwen3ForCausalLM"):
        ModelConfig.from_hf_config(
            {
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": 8,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
            }
        )


def test_kv_pool_too_small_says_what_fits(tiny_llama):
    with pytest.raises(ValueError, match=r"GiB needed.*largest length that fits is 64"):
        tiny_engine(tiny_llama, max_cached_blocks=4, max_model_length=1000)


def test_dummy_weights_need_no_checkpoint():
    llm = LLMEngine(
        {
            "model_name_or_path": "none",
            "load_format": "dummy",
            "device": "cpu",
            "vocab_size": 256,
            "hidden_size": 32,
            "num_heads": 2,
            "head_dim": 16,
            "num_kv_heads": 1,
            "intermediate_size": 64,
            "num_layers": 1,
            "max_position": 128,
            "block_size": 16,
        }
    )
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out["token_ids"][0]) == 4 and llm.tokenizer is None
    assert llm.config.max_cached_blocks == llm.stats().num_blocks
    llm.exit()
    llm.exit()  # idempotent
    with pytest.raises(RuntimeError, match="exit"):
        llm.add_prompt([1], GREEDY)


def test_exit_frees_the_kv_pool_and_model_a_caller_still_reaches(tiny_qwen3):
    """A caller that still holds the runner (a benchmark's stage timers did) must not keep
    the pool alive past exit(): a second engine in the process sizes its pool from what
    is free, and got a tenth of the first one's blocks on a GPU."""
    import gc
    import weakref

    llm = tiny_engine(tiny_qwen3)
    first = llm.generate([[1, 2, 3]], GREEDY)["token_ids"]
    runner, blocks = llm.runner, llm.runner.num_blocks
    pool, model = weakref.ref(runner.kv_cache), weakref.ref(runner.model)
    layer = runner.attention_layers[0]
    llm.exit()
    gc.collect()
    assert pool() is None and model() is None
    assert layer.k_cache.numel() == 0 and layer.v_cache.numel() == 0
    second = tiny_engine(tiny_qwen3)
    try:
        assert second.runner.num_blocks == blocks
        assert second.generate([[1, 2, 3]], GREEDY)["token_ids"] == first
    finally:
        second.exit()


# -- the package layout -------------------------------------------------------------------


def test_the_clone_root_holds_no_bare_kernels_package():
    """Our kernels are the subpackage minivllm.kernels; the clone's root has no `kernels`
    folder that a bare `import kernels` (Hugging Face's package, which transformers
    probes) could find when a command runs from there."""
    import minivllm.kernels

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.dirname(minivllm.kernels.__file__) == os.path.join(repo, "minivllm", "kernels")
    code = (
        "import importlib.util, os, sys\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "where = (spec.origin or str(spec.submodule_search_locations)) if spec else ''\n"
        f"sys.exit(1 if where.startswith({repo!r} + os.sep + 'kernels') else 0)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=repo).returncode == 0


@pytest.mark.slow
def test_generate_runs_from_the_clone_root():
    """`python -m minivllm.cli generate` from the clone's root (the working folder first on
    sys.path) loads the embedded model and prints a completion."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-m", "minivllm.cli", "generate", "--prompt", "hi", "--max-tokens", "4"],
        cwd=repo, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip(), "no completion printed"
    assert "Traceback" not in run.stderr


def test_row_argmax_takes_the_first_maximum_like_argmax():
    """The sampler's CPU argmax (through `max`) picks what torch.argmax picks, ties (the first
    maximal index), -inf rows from banned tokens and NaN included."""
    from minivllm.layers.sampler import row_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 49152, generator=g)
    x[1, [7, 300, 9000]] = 50.0  # a tie: the first wins
    x[2] = float("-inf")
    x[2, 123] = -1e30
    x[3, 42] = float("nan")
    x[4] = x[4].round()  # many ties at the top
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert row_argmax(x)[1] == 7
