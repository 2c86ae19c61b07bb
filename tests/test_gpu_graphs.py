"""Prefill/mixed CUDA graphs, kernels compiled at start-up, a 32k step budget: on the GPU.

Qwen3-0.6B's exact config. Skipped without a GPU; run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import dummy_engine
from test_gpu_engine import engine, prompts, qwen3_06b, run  # noqa: F401 (fixture)

from minivllm import SamplingParams
from minivllm.engine.batch import ForwardBatch
from minivllm.engine.compile_watch import TritonCompileWatch

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_prefill_and_mixed_graphs_give_the_eager_tokens_fp32(qwen3_06b):  # noqa: F811
    """fp32 greedy tokens are equal with and without graphs, through prefill-only steps,
    mixed steps (chunked prefill beside decoding sequences) and prefix hits."""
    path, _ = qwen3_06b
    base = prompts(1, seed=7)[0][:200]
    ps = [base + p for p in prompts(6, seed=8)]
    settings = dict(dtype="float32", block_size=16, max_num_batched_tokens=512)
    graphs, stats = run(path, ps, GREEDY, **settings)
    eager, _ = run(path, ps, GREEDY, enforce_eager=True, **settings)
    assert stats.prefix_cache_hit_rate > 0
    assert graphs == eager


def _batch(seqs: list[tuple[int, int]], block_size: int, first_block: int) -> ForwardBatch:
    """(context before this step, new tokens) per sequence; each gets its own blocks."""
    rng = random.Random(0)
    b = ForwardBatch([], [], [], [0], [], [], [], [], [], [], [])
    block = first_block
    for cached, new in seqs:
        end = cached + new
        table = list(range(block, block + (end + block_size - 1) // block_size))
        block = table[-1] + 1
        b.input_ids += [rng.randrange(151936) for _ in range(new)]
        b.positions += list(range(cached, end))
        b.slot_mapping += [table[p // block_size] * block_size + p % block_size
                           for p in range(cached, end)]
        b.cu_seqlens_q.append(b.cu_seqlens_q[-1] + new)
        b.seq_lens.append(end)
        b.block_tables.append(table)
        b.temperatures.append(0.0)
        b.top_ks.append(0)
        b.top_ps.append(1.0)
        b.min_ps.append(0.0)
        b.seeds.append(None)
    return b


@torch.inference_mode()
def test_graph_replay_hidden_states_match_eager_bf16():
    """A prefill step and a mixed step (decoding sequences beside a chunk of a prompt) give
    the eager step's last hidden rows and logits within bf16 rounding."""
    llm = dummy_engine(block_size=16, max_num_batched_tokens=2048)
    try:
        runner = llm.runner
        assert runner.graphs is not None and runner.graphs.prefill_graphs
        # Prefill, then a mixed step over the same cache: sequences 0 and 1 decode one
        # token while sequence 2 prefills a chunk after a cached prefix.
        steps = [
            _batch([(0, 300), (0, 37), (0, 700)], 16, 0),
            _batch([(300, 1), (37, 1), (700, 500)], 16, 0),
        ]
        for b in steps:
            ids, pos, meta = runner.prepare(b)
            assert meta.graph_tokens is not None and meta.graph_tokens >= b.num_tokens
            last_g, logits_g = (t.float().clone() for t in runner._forward(b, ids, pos, meta))
            graphs, runner.graphs = runner.graphs, None
            try:
                ids, pos, meta = runner.prepare(b)
                assert meta.graph_tokens is None
                last_e, logits_e = (t.float() for t in runner._forward(b, ids, pos, meta))
            finally:
                runner.graphs = graphs
            for got, want in ((last_g, last_e), (logits_g, logits_e)):
                assert torch.isfinite(got).all()
                rel = ((got - want).norm() / want.norm()).item()
                assert rel < 5e-2, rel
    finally:
        llm.exit()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_no_triton_compilation_after_start_up(enforce_eager):
    """Every kernel variant compiles while LLMEngine starts: varied prompt lengths, batch
    sizes, mixed steps, prefix hits, sampling and a step larger than the largest graph
    compile nothing afterwards."""
    llm = dummy_engine(
        enforce_eager=enforce_eager,
        block_size=16,
        max_num_batched_tokens=10240,
        max_model_length=12288,
    )
    rng = random.Random(1)
    vocab = llm.config.model.vocab_size
    try:
        with TritonCompileWatch() as watch:
            for n in (1, 2, 3, 15, 16, 17, 100, 255, 257, 1000, 4097, 10000):
                llm.generate([[rng.randrange(vocab) for _ in range(n)]],
                             SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            for batch in (2, 3, 7, 16, 17, 33, 64):
                ps = [[rng.randrange(vocab) for _ in range(rng.randint(5, 600))]
                      for _ in range(batch)]
                params = [SamplingParams(temperature=rng.choice([0, 0.8]), top_k=20,
                                         top_p=0.9, max_tokens=rng.randint(2, 40),
                                         ignore_eos=True) for _ in ps]
                llm.generate(ps, params)
            shared = [rng.randrange(vocab) for _ in range(800)]
            llm.generate([shared + [i] for i in range(5)], GREEDY)  # prefix hits
        assert watch.count == 0, (watch.compiled, watch.new_variants)
    finally:
        llm.exit()


def test_32k_step_budget_starts():
    """The warm-up's attention no longer takes the quadratic path: an engine with a 32k
    step budget starts and runs a 20k-token prompt in one step."""
    llm = dummy_engine(max_num_batched_tokens=32768, max_model_length=40000,
                       gpu_memory_utilization=0.5)
    try:
        out = llm.generate([[i % 1000 for i in range(20000)]],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out["token_ids"][0]) == 4
    finally:
        llm.exit()
