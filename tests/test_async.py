"""Overlapped (async) scheduling gives exactly the synchronous path's tokens.

Step N+1 is scheduled and launched before step N's tokens are read: decode inputs that
step N is still sampling are placeholders filled on the device, a sequence whose end is
found late gets its extra token discarded, preemption and aborts meet steps in flight.
On the CPU a launch computes at once, but the bookkeeping is the same code as on CUDA.

Two kinds of model: a fake one whose next token is a function of the last input token
and its position (so any wrong placeholder, lost or duplicated token shows, and output
does not depend on how sequences are batched), driven through the real engine with
random aborts and a tiny pool; and real fp32 models (SmolLM2, tiny Qwen3/Llama), sync
vs async on one engine, exact.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_engine

from minivllm import SamplingParams
from minivllm.engine.model_runner import StepHandle
from minivllm.layers.sampler import StepSamples

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def no_leak(llm) -> None:
    assert llm.scheduler.is_finished() and llm._in_flight is None
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants(live=[])


# -- the step loop with a fake model -------------------------------------------------------


class MarkovRunner:
    """Stands in for ModelRunner: the token after input t at position p is a fixed
    function of (t, p). Placeholders are filled from the previous launch, as on CUDA."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.last: list[int] | None = None
        self.num_filled = 0

    def next_token(self, token: int, pos: int) -> int:
        return (token * 7919 + pos * 104729) % (self.vocab - 3) + 3

    def launch(self, b) -> StepHandle:
        ids = list(b.input_ids)
        for row, src in zip(b.fill_rows, b.fill_from, strict=True):
            ids[row] = self.last[src]
        self.num_filled += len(b.fill_rows)
        sampled = []
        for i in range(b.num_seqs):
            last = b.cu_seqlens_q[i + 1] - 1
            assert b.positions[last] == b.seq_lens[i] - 1
            sampled.append(self.next_token(ids[last], b.positions[last]))
        self.last = sampled
        return StepHandle(torch.tensor(sampled))

    def release(self) -> None:
        pass  # no pool or model

    def collect(self, handle: StepHandle) -> StepSamples:
        return StepSamples(handle.tokens.tolist())

    def expected(self, prompt: list[int], params: SamplingParams, eos: set[int]) -> list[int]:
        out: list[int] = []
        token, pos = prompt[-1], len(prompt) - 1
        while len(out) < params.max_tokens:
            token, pos = self.next_token(token, pos), pos + 1
            out.append(token)
            if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
                break
        return out


@pytest.fixture(scope="module")
def markov_engine(tiny_qwen3):
    """A real engine (scheduler, block manager, step loop) over the fake model; a pool
    of 24 blocks of 16 tokens and a 48-token budget: chunking and preemption."""
    llm = tiny_engine(
        tiny_qwen3,
        max_cached_blocks=24,
        max_num_batched_tokens=48,
        max_num_sequences=6,
        max_model_length=200,
        eos=(4, 5),
    )
    llm.runner = MarkovRunner(llm.config.model.vocab_size)
    yield llm
    llm.exit()


def soak(llm, async_scheduling: bool, seed: int):
    """Requests arrive over time (with shared prefixes), some are aborted mid-run;
    returns (completions of the requests never aborted, their expected completions)."""
    rng = random.Random(seed)
    llm.async_scheduling = async_scheduling
    runner: MarkovRunner = llm.runner
    prefix = [rng.randrange(3, 500) for _ in range(40)]
    plan = []
    for i in range(40):
        prompt = (prefix[: rng.choice((0, 17, 40))] if i % 2 else []) + [
            rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))
        ]
        stop_ids = [rng.randrange(3, 500) for _ in range(rng.choice((0, 0, 30)))]
        params = SamplingParams(
            temperature=0,
            max_tokens=rng.randrange(1, 60),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=stop_ids,
        )
        plan.append((rng.randrange(0, 60), prompt, params, rng.random() < 0.2))
    ids, wanted, got, aborted = {}, {}, {}, set()
    step = 0
    while step < 60 or not llm.scheduler.is_finished():
        for i, (when, prompt, params, abort) in enumerate(plan):
            if when == step:
                ids[i] = llm.add_prompt(prompt, params)
                wanted[i] = runner.expected(prompt, params, {4, 5})
            if abort and when + 3 == step:
                llm.abort(ids[i])
                aborted.add(i)
        finished, num_tokens, _ = llm.step()
        assert num_tokens <= llm.config.max_num_batched_tokens
        got.update(dict(finished))
        live = llm.scheduler.running + list(llm.scheduler.waiting)
        llm.block_manager.check_invariants(live=live)
        step += 1
    llm.step()  # nothing left: still fine
    no_leak(llm)
    keep = [i for i in range(len(plan)) if i not in aborted]
    return [got[ids[i]] for i in keep], [wanted[i] for i in keep]


@pytest.mark.parametrize("seed", [0, 1])
def test_async_step_loop_with_aborts_and_preemption(markov_engine, seed):
    llm = markov_engine
    preemptions = llm.scheduler.num_preemptions
    got_sync, want = soak(llm, False, seed)
    assert got_sync == want
    filled = llm.runner.num_filled
    got_async, want = soak(llm, True, seed)
    assert got_async == want
    assert llm.runner.num_filled > filled  # the async run did use placeholders
    assert llm.scheduler.num_preemptions > preemptions


def test_late_finish_discards_the_extra_token(markov_engine):
    """A sequence ended by eos is already scheduled in the step in flight; that step's
    token for it is dropped, its blocks are freed, and no step for it follows."""
    llm = markov_engine
    llm.async_scheduling = True
    runner: MarkovRunner = llm.runner
    prompt = [7, 8, 9]
    free = runner.expected(prompt, GREEDY, set())
    stop = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[free[4]])
    seq_id = llm.add_prompt(prompt, stop)
    results = {}
    while not llm.scheduler.is_finished():
        results.update(dict(llm.step()[0]))
    assert results[seq_id] == free[: free.index(free[4]) + 1]
    no_leak(llm)


def test_length_is_known_in_advance(markov_engine):
    """max_tokens ends a sequence without a wasted step: 5 tokens, 5 decode rows."""
    llm = markov_engine
    llm.async_scheduling = True
    seq_id = llm.add_prompt([1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
    rows = 0
    results = {}
    while not llm.scheduler.is_finished():
        finished, num_tokens, _ = llm.step()
        rows += num_tokens
        results.update(dict(finished))
    assert rows == 3 + 4  # the prompt, then one decode per token after the first
    assert len(results[seq_id]) == 5
    no_leak(llm)


# -- real models: async equals sync exactly (fp32, CPU) ------------------------------------


def sync_vs_async(llm, prompts, params):
    out = {}
    for mode in (False, True):
        llm.async_scheduling = mode
        out[mode] = llm.generate(prompts, params)
        no_leak(llm)
    return out[False], out[True]


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_llama"])
def test_tiny_models_chunked_prefix_preemption(arch, request):
    path = request.getfixturevalue(arch)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 512, (5 + 9 * i,), generator=g).tolist() for i in range(5)]
    params = [
        SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(5)
    ]
    # 10 blocks of 16 for five sequences of up to ~110 tokens: preemption; a 32-token
    # budget chunks every prompt; the 40-token prefix is shared.
    llm = tiny_engine(path, max_cached_blocks=10, max_num_batched_tokens=32, max_model_length=128)
    try:
        sync, async_ = sync_vs_async(llm, prompts, params)
        stats = llm.stats()
    finally:
        llm.exit()
    assert async_["token_ids"] == sync["token_ids"]
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0


def test_penalties_min_tokens_and_logprobs_equal_sync(tiny_qwen3):
    """Penalties and min_tokens read a sequence's tokens on the host, so a step holding
    such a request is read before the next is scheduled (its newest token is never a
    placeholder); plain requests beside it keep overlapping. Tokens and logprobs equal
    the synchronous path's."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (12, 25, 7, 40)]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, presence_penalty=1.5,
                       frequency_penalty=0.7, min_tokens=10, logprobs=2),
        SamplingParams(temperature=0, max_tokens=36, ignore_eos=True, prompt_logprobs=1),
    ]
    llm = tiny_engine(tiny_qwen3, max_num_batched_tokens=48, max_model_length=128, eos=(4, 5))
    try:
        sync, async_ = sync_vs_async(llm, prompts, params)
        # Alone, the penalised request overlaps nothing but still equals sync.
        alone_sync, alone_async = sync_vs_async(llm, prompts[:1], params[:1])
    finally:
        llm.exit()
    assert async_["token_ids"] == sync["token_ids"]
    assert alone_async["token_ids"] == alone_sync["token_ids"] == [sync["token_ids"][0]]
    for key in ("logprobs", "prompt_logprobs"):
        for a, b in zip(sync[key], async_[key], strict=True):
            assert (a is None) == (b is None)
            for x, y in zip(a or [], b or [], strict=True):
                # Batches differ between the modes (fp32 sums in another order): 1e-4.
                assert (x is None) == (y is None)
                if x is not None:
                    assert (x.token_id, x.rank, x.top.keys()) == (y.token_id, y.rank, y.top.keys())
                    assert abs(x.logprob - y.logprob) < 1e-4


def stream(llm, prompts, params) -> list[tuple[list[int], str, str]]:
    """(tokens, text, finish reason) of each prompt, from pop_deltas."""
    ids = [llm.add_prompt(p, q) for p, q in zip(prompts, params, strict=True)]
    got = {i: ([], "", None) for i in ids}
    while not llm.scheduler.is_finished():
        llm.step()
        for d in llm.pop_deltas():
            tokens, text, _ = got[d.seq_id]
            got[d.seq_id] = (tokens + d.token_ids, text + d.text, d.finish_reason)
    for d in llm.pop_deltas():  # the last step's news
        tokens, text, _ = got[d.seq_id]
        got[d.seq_id] = (tokens + d.token_ids, text + d.text, d.finish_reason)
    return [got[i] for i in ids]


@pytest.mark.slow
def test_smollm2_eos_stop_strings_and_streaming(smollm2):
    """Real weights, a chat template shared by all prompts (prefix hits), eos and a stop
    string found one step late under async, streamed: same tokens, text and reasons."""
    tok = smollm2.tokenizer
    questions = ["What is the capital of France?", "Name three colours.", "Say hi."]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=16, stop=["e"]),
        SamplingParams(temperature=0, max_tokens=16),
    ]
    out = {}
    try:
        for mode in (False, True):
            smollm2.async_scheduling = mode
            out[mode] = stream(smollm2, prompts, params)
            no_leak(smollm2)
    finally:
        smollm2.async_scheduling = False
    assert out[True] == out[False]
    assert "Paris" in out[False][0][1]
    assert [r for _, _, r in out[False]] == ["stop", "stop", "length"]  # eos, "e", 16


def test_abort_mid_run_with_a_step_in_flight(tiny_llama):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 30, 17)]
    llm = tiny_engine(tiny_llama)
    try:
        want = llm.generate(prompts, GREEDY)["token_ids"]
        llm.async_scheduling = True
        ids = [llm.add_prompt(p, GREEDY) for p in prompts]
        results = {}
        for _ in range(4):
            results.update(dict(llm.step()[0]))
        assert llm._in_flight is not None
        llm.abort(ids[1])  # its row in the step in flight is dropped when read
        while not llm.scheduler.is_finished():
            results.update(dict(llm.step()[0]))
        no_leak(llm)
    finally:
        llm.exit()
    assert ids[1] not in results
    assert [results[ids[0]], results[ids[2]]] == [want[0], want[2]]


def test_config_switch():
    from minivllm import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling='yes'"):
        EngineConfig(model_name_or_path="x", async_scheduling="yes")


# -- GPU: async equals sync with CUDA graphs (fp32) -----------------------------------------


@pytest.mark.gpu
def test_gpu_async_equals_sync(tiny_qwen3):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in range(5, 300, 37)]
    params = [
        SamplingParams(temperature=0, max_tokens=5 + 7 * i, ignore_eos=i % 2 == 0)
        for i in range(len(prompts))
    ]
    # Requests the engine reads synchronously (penalties, logprobs) beside overlapped ones.
    params[1] = SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.5)
    params[2] = SamplingParams(temperature=0, max_tokens=20, logprobs=2, prompt_logprobs=1)
    llm = tiny_engine(
        tiny_qwen3,
        device="cuda",
        dtype="float32",
        max_num_batched_tokens=128,
        max_model_length=512,
        gpu_memory_utilization=0.05,
        eos=(3,),
    )
    try:
        assert llm.async_scheduling  # the CUDA default
        sync, async_ = sync_vs_async(llm, prompts, params)
    finally:
        llm.exit()
    assert async_["token_ids"] == sync["token_ids"]
