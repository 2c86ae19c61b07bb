"""The decode-path switches of kernels/tuning.py keep every token: the greedy decode graphs
(CPU, graph bodies re-run; and CUDA), and on the GPU each kernel switch against the
defaults (fp32: the same tokens as transformers' path; bf16: graph replay == eager).

The CPU test runs everywhere; the others are marked gpu (scripts/gpu_check.sh runs them).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_engine
from test_gpu_engine import prompts, qwen3_06b, run  # noqa: F401 (fixture)

from minivllm import SamplingParams
from minivllm.kernels import tuning

SWITCHES = {
    "gemv_k4096": {"MINIVLLM_GEMV_MAX_K": "4096"},
    "prefetch": {"MINIVLLM_DECODE_PREFETCH": "1"},
    "min_split512": {"MINIVLLM_DECODE_MIN_SPLIT": "512"},
    "greedy_graph": {"MINIVLLM_GRAPH_GREEDY": "1"},
    "late_trigger": {"MINIVLLM_DECODE_LATE_TRIGGER": "4096"},
    "silu_tile": {"MINIVLLM_GEMV_SILU_TILE": "8192"},
    "gemv_wide": {"MINIVLLM_GEMV_WIDE": "1"},
    "short": {"MINIVLLM_DECODE_SHORT": "512"},
    "decode_tile": {"MINIVLLM_DECODE_TILE": "128x8x2", "MINIVLLM_DECODE_SHORT_TILE": "64x8x1"},
}
ALL_ON = {k: v for env in SWITCHES.values() for k, v in env.items()}
# The measured winners are the defaults; this turns them off (the engine before them).
OFF = {"MINIVLLM_GEMV_MAX_K": "2048", "MINIVLLM_DECODE_PREFETCH": "0",
       "MINIVLLM_DECODE_MIN_SPLIT": "0", "MINIVLLM_GRAPH_GREEDY": "0",
       "MINIVLLM_DECODE_SHORT": "0"}


@pytest.fixture
def switches(monkeypatch):
    """Set decode switches for the engines built afterwards (tuning caches what it read)."""

    def apply(env: dict[str, str]) -> None:
        for name in ALL_ON:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        tuning.clear()

    yield apply
    monkeypatch.undo()
    tuning.clear()


def test_greedy_graphs_give_the_eager_tokens(tiny_qwen3, switches):
    """Greedy decode graphs (inputs from host lists in two copies, placeholders filled in
    the graph, argmax in the graph) give the eager engine's tokens with overlapped
    scheduling, also around steps that sample (those take the general path over the same
    graphs) and prefill steps (whose tokens the next greedy step copies in)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (5, 40, 17, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=11)
    params = [greedy, sampled, short, greedy]  # the batch shrinks twice: rows move
    settings = dict(max_num_batched_tokens=64, max_num_sequences=4, max_model_length=256,
                    async_scheduling=True)
    outputs = []
    switches({"MINIVLLM_GRAPH_GREEDY": "1"})
    for graphs in (False, True):
        llm = tiny_engine(tiny_qwen3, **settings)
        try:
            if graphs:
                llm.runner.capture_cuda_graphs(replay_eagerly=True)
                assert llm.runner.graphs.picks
            outputs.append(llm.generate(prompts, params)["token_ids"])
            outputs.append(llm.generate(prompts[2:], greedy)["token_ids"])
            if graphs:
                assert llm.runner.graphs._num_staged > 0, "no step took the greedy graphs"
        finally:
            llm.exit()
    assert outputs[:2] == outputs[2:]



def test_sampled_steps_pick_their_tokens_in_the_graphs(tiny_qwen3, switches):
    """Decode steps whose rows sample at a plain temperature (no top-k / top-p, no
    per-request seed) replay the picking graphs too, their draws made in the graph: the
    greedy rows beside them keep the eager engine's tokens, the sampled rows draw tokens
    of the vocabulary that differ from the greedy ones, and a per-request seed or top-p
    still takes the general path."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (6, 30, 11, 19)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hot = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    settings = dict(max_num_batched_tokens=64, max_num_sequences=4, max_model_length=256,
                    async_scheduling=True)
    switches({"MINIVLLM_GRAPH_GREEDY": "1"})
    eager = tiny_engine(tiny_qwen3, **settings)
    try:
        want = eager.generate(prompts, greedy)["token_ids"]
    finally:
        eager.exit()
    llm = tiny_engine(tiny_qwen3, **settings)
    try:
        llm.runner.capture_cuda_graphs(replay_eagerly=True)
        graphs = llm.runner.graphs
        picked: list[list[float] | None] = []
        run_picking = graphs.run_picking

        def spy(*args):
            picked.append(args[8])  # the step's temperatures (None: all greedy)
            return run_picking(*args)

        graphs.run_picking = spy
        got = llm.generate(prompts, [greedy, hot, greedy, hot])["token_ids"]
        assert [got[0], got[2]] == [want[0], want[2]]
        vocab = llm.config.model.vocab_size
        assert all(0 <= t < vocab for t in got[1] + got[3])
        assert got[1] != want[1] and got[3] != want[3]
        assert [1.5, 1.5] in [t[1::2] for t in picked if t is not None]
        picked.clear()
        llm.generate(prompts[:2], [SamplingParams(temperature=1.5, max_tokens=4, seed=3),
                                   SamplingParams(temperature=1.5, max_tokens=4, top_p=0.9)])
        assert picked == [], picked  # both rows sample outside the graphs
    finally:
        llm.exit()

def check_decode_inputs(llm, checked: list[int]) -> None:
    """Make every decode replay of `llm`'s (eagerly replayed) graphs first check that its
    static inputs are in range, padding rows included; `checked` gets each bucket checked."""
    runner = llm.runner.graphs
    num_slots = llm.runner.num_blocks * runner.block_size

    def out_of(t: torch.Tensor, low: int, high: int) -> list[int]:
        return t[(t < low) | (t >= high)].tolist()

    def checking(bucket: int, body):
        def replay() -> None:
            ids, positions, fill, meta = runner._decode_views(bucket)
            bad = {
                "positions": out_of(positions, 0, runner.max_len),
                "ids": out_of(runner.fill_tokens(ids, fill, runner.tokens), 0,
                              llm.config.model.vocab_size),
                "blocks": out_of(meta.block_tables[:, 0], 0, llm.runner.num_blocks),
                "slots": out_of(meta.slot_mapping, -1, num_slots),
            }
            assert not any(bad.values()), (bucket, bad)
            checked.append(bucket)
            body()

        return replay

    for bucket, graph in runner.graphs.items():
        graph.body = checking(bucket, graph.body)


def test_decode_graph_inputs_stay_in_range_across_buckets(tiny_qwen3, switches):
    """Every decode replay reads positions inside the rotary table, token ids inside the
    vocabulary, slots and block ids inside the KV pool, also in padding rows the host did
    not write: a greedy step of 30 rows (bucket 32) before a sampled step of 34 (bucket
    48) once left the earlier step's slot numbers in the padding rows' positions (the
    GPU's out-of-bounds fault with greedy graphs). Tokens equal the eager engine's."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 30, (34,), generator=g)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, seed=2)
    settings = dict(max_num_batched_tokens=2048, max_num_sequences=64, max_model_length=256,
                    max_cached_blocks=1024, async_scheduling=True)
    switches({"MINIVLLM_GRAPH_GREEDY": "1"})
    outputs, checked = [], []
    for graphs in (False, True):
        llm = tiny_engine(tiny_qwen3, **settings)
        try:
            if graphs:
                llm.runner.capture_cuda_graphs(replay_eagerly=True)
                check_decode_inputs(llm, checked)
            outputs.append(llm.generate(prompts[:30], greedy)["token_ids"])
            outputs.append(llm.generate(prompts, [greedy, sampled] * 17)["token_ids"])
        finally:
            llm.exit()
    assert 48 in checked and outputs[:2] == outputs[2:]

# -- on the GPU --------------------------------------------------------------------------------


def _dummy_tokens(env: dict[str, str], switches, short_graphs: list | None = None,
                  **kw) -> list[list[int]]:
    from minivllm import LLMEngine

    switches(env)
    config = {
        "model_name_or_path": "Qwen/Qwen3-0.6B",
        "load_format": "dummy",
        "gpu_memory_utilization": 0.2,
        "max_model_length": 6144,
        "max_num_sequences": 8,
        "seed": 0,
        **kw,
    }
    llm = LLMEngine(config)
    try:
        g = torch.Generator().manual_seed(1)
        # Contexts of 40 to 5k: one split or several (min_split, prefetch), past the late
        # trigger's 4096.
        ps = [torch.randint(0, 151936, (int(n),), generator=g).tolist()
              for n in (5000, 40, 700, 1900, 5)]
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        one = llm.generate(ps[:1], greedy)["token_ids"]  # batch 1
        short = llm.generate([ps[1], ps[4]], greedy)["token_ids"]  # contexts <= 512
        if short_graphs is not None and llm.runner.graphs is not None:
            short_graphs.extend(llm.runner.graphs.short_graphs)
        return one + short + llm.generate(ps, greedy)["token_ids"]  # batch 5 (bucket 8)
    finally:
        llm.exit()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["defaults", "all"])
def test_switch_graph_equals_eager_bf16(name, switches):
    """bf16, random Qwen3-0.6B: with the defaults and with every switch on, the graph
    replays give the eager steps' tokens bit for bit (the eager path runs the same kernels;
    each kernel switch alone is checked against its reference in test_kernels_gpu.py)."""
    env = ALL_ON if name == "all" else {}
    graphed = _dummy_tokens(env, switches)
    eager = _dummy_tokens(env, switches, enforce_eager=True)
    assert graphed == eager


@pytest.mark.gpu
def test_short_launch_gives_the_same_tokens(switches):
    """bf16, graphs: steps whose contexts fit in one split replay the one-split graphs
    (DECODE_SHORT) and give the tokens of the bucket's launch bit for bit when the short
    launch keeps the bucket's tiles and its contexts fit one of the bucket's splits (its
    own tiles reduce in another order: their kernel
    is checked against the reference in test_kernels_gpu.py, their graphs against eager
    steps in test_switch_graph_equals_eager_bf16)."""
    short_graphs: list[int] = []
    same = {"MINIVLLM_DECODE_MIN_SPLIT": "512", "MINIVLLM_DECODE_SHORT_TILE": "128x4x2"}
    short = _dummy_tokens({**same, "MINIVLLM_DECODE_SHORT": "512"}, switches, short_graphs)
    full = _dummy_tokens({**same, "MINIVLLM_DECODE_SHORT": "0"}, switches)
    assert short_graphs and short == full


@pytest.mark.gpu
def test_switches_keep_fp32_tokens(qwen3_06b, switches):  # noqa: F811
    """fp32 (the path test_gpu_engine.py checks against transformers token for token):
    all switches on give the greedy tokens of all of them off, graphs and eager."""
    path, _ = qwen3_06b
    ps = prompts(3, seed=4)
    switches(OFF)
    base, _ = run(path, ps, dtype="float32")
    switches(ALL_ON)
    graphed, _ = run(path, ps, dtype="float32")
    eager, _ = run(path, ps, dtype="float32", enforce_eager=True)
    assert graphed == base and eager == base


@pytest.mark.gpu
def test_sampled_rows_drawn_in_the_graphs(switches):
    """bf16, random Qwen3-0.6B, graphs: rows at a plain temperature are drawn by the
    sampling kernel inside the decode graphs. Two engines with the same seed draw the same
    tokens; greedy rows beside them keep the all-greedy run's tokens; the draws at T = 1.5
    are not the greedy tokens. No prefix caching: the all-greedy run's prefills have the
    first run's shapes (a shorter prefill after a prefix hit rounds otherwise in bf16,
    and random weights' top logits are close enough for that to change a greedy token)."""
    from minivllm import LLMEngine

    switches({"MINIVLLM_GRAPH_GREEDY": "1"})
    g = torch.Generator().manual_seed(2)
    ps = [torch.randint(0, 151936, (int(n),), generator=g).tolist() for n in (300, 40, 900, 7)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    hot = SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLMEngine({"model_name_or_path": "Qwen/Qwen3-0.6B", "load_format": "dummy",
                         "gpu_memory_utilization": 0.2, "max_model_length": 2048,
                         "max_num_sequences": 8, "seed": 0, "enable_prefix_caching": False})
        try:
            picked = []
            run_picking = llm.runner.graphs.run_picking

            def spy(*args, run_picking=run_picking, picked=picked):
                picked.append(args[8])
                return run_picking(*args)

            llm.runner.graphs.run_picking = spy
            runs.append(llm.generate(ps, [greedy, hot, greedy, hot])["token_ids"])
            assert any(t is not None for t in picked)
            if len(runs) == 1:
                runs.append(llm.generate(ps, greedy)["token_ids"])
        finally:
            llm.exit()
    mixed, all_greedy, again = runs
    assert mixed == again
    assert [mixed[0], mixed[2]] == [all_greedy[0], all_greedy[2]]
    assert mixed[1] != all_greedy[1] and mixed[3] != all_greedy[3]
