"""Graph buckets and padding, attention backends chosen once, and the warm-up's
linear-memory attention: the CPU-testable half of the host-side step design.

The GPU half (real CUDA graphs, no Triton compilation after start-up) is in
tests/test_gpu_graphs.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_engine

from minivllm import SamplingParams
from minivllm.engine.cuda_graph import (
    capture_metadata,
    pad_prefill_inputs,
    pick_bucket,
    prefill_layout,
    seq_slots,
    token_buckets,
)
from minivllm.kernels import cpu_lowp_linear
from minivllm.layers import attention as attention_module
from minivllm.layers.attention import (
    Attention,
    AttentionMetadata,
    TorchAttentionBackend,
    TritonAttentionBackend,
    attention_metadata,
)
from minivllm.layers.ops import TORCH_KERNELS, cpu_kernels

# -- buckets and padding --------------------------------------------------------------------


def test_token_buckets_cover_the_budget_in_aligned_steps():
    assert token_buckets(8192) == [
        16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192
    ]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 384, 512, 768, 1008]
    assert token_buckets(32768)[-1] == 8192  # larger steps run eagerly
    assert token_buckets(10) == [16]
    for budget in (1, 17, 300, 5000, 40000):
        buckets = token_buckets(budget)
        assert buckets == sorted(set(buckets)) and all(b % 16 == 0 for b in buckets)
        for n in range(1, min(budget, 8192) + 1, 7):
            b = pick_bucket(buckets, n)
            assert b is not None and b >= n
            # Padding wastes at most half a step below 256 tokens, a third above.
            assert b < 2 * n or b == 16 or (n > 256 and b <= 1.5 * n + 16)
    assert pick_bucket([16, 32], 33) is None


def test_pad_prefill_inputs_layout():
    # Two sequences: 3 new tokens after a 2-token cached prefix, and one decode token.
    longs, ints = pad_prefill_inputs(
        input_ids=[5, 6, 7, 9],
        positions=[2, 3, 4, 10],
        slot_mapping=[18, 19, 20, 42],
        cu_seqlens_q=[0, 3, 4],
        seq_lens=[5, 11],
        num_tokens=16,
        num_slots=4,
    )
    pad = [0] * 12
    assert longs == [5, 6, 7, 9] + pad + [2, 3, 4, 10] + pad + [18, 19, 20, 42] + [-1] * 12
    seq_off, cu_off = prefill_layout(16, 4)
    assert (seq_off, cu_off) == (0, 16)
    assert ints[:4] == [5, 11, 0, 0]  # padded slots have no context
    assert ints[cu_off:] == [0, 3, 4, 4, 4]  # ... and no queries
    assert len(ints) == cu_off + 4 + 1
    with pytest.raises(AssertionError):
        pad_prefill_inputs([1] * 17, [0] * 17, [0] * 17, [0, 17], [17], 16, 4)


def test_capture_metadata_stays_within_max_len():
    cu, lens = capture_metadata(8192, 2, 4096)
    assert cu == [0, 4096, 8192] and lens == [4096, 4096]
    cu, lens = capture_metadata(8192, 1, 4096)  # the rest of the tokens stay unowned
    assert cu == [0, 4096] and lens == [4096]
    cu, lens = capture_metadata(16, 16, 4096)
    assert cu == [0, 16] + [16] * 15 and lens == [16] + [0] * 15
    assert seq_slots(16, 256) == 16 and seq_slots(8192, 256) == 256


# -- the graph path, replayed eagerly on the CPU -----------------------------------------------


def test_graph_path_gives_the_eager_tokens(tiny_qwen3):
    """The prefill/mixed and decode graph paths (static buffers, padding to buckets, LM
    head inside), with each graph's body re-run instead of replayed, produce exactly the
    eager engine's greedy tokens, through prefix hits, chunked prefill and mixed steps."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (int(n),), generator=g).tolist()
               for n in (3, 30, 70, 9, 51)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    settings = dict(max_num_batched_tokens=96, max_num_sequences=4, max_model_length=256)
    outputs = []
    for graphs in (False, True):
        llm = tiny_engine(tiny_qwen3, **settings)
        try:
            if graphs:
                llm.runner.capture_cuda_graphs(replay_eagerly=True)
            outputs.append(llm.generate(prompts, params)["token_ids"])
            if graphs:
                runner = llm.runner.graphs
                prefill = sum(g.num_replays for g in runner.prefill_graphs.values())
                decode = sum(g.num_replays for g in runner.graphs.values())
                assert prefill > 0 and decode > 0
                assert llm.stats().prefix_cache_hit_rate > 0
        finally:
            llm.exit()
    assert outputs[0] == outputs[1]


def test_graph_engine_keeps_logprobs_and_prompt_logprobs(tiny_qwen3):
    """A step with prompt logprobs needs hidden rows a prefill graph does not return: it
    runs eagerly; sampled-token logprobs come from the graph's logits. Both equal an
    engine without graphs (fp32)."""
    prompts = [list(range(3, 40)), list(range(50, 61))]
    params = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2,
                       prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3),
    ]
    outs = []
    for graphs in (False, True):
        # A 40-token budget: the second prompt finishes its prefill in a mixed step of
        # its own (no prompt logprobs there: a graph replay).
        llm = tiny_engine(tiny_qwen3, max_num_batched_tokens=40, max_model_length=128)
        try:
            if graphs:
                llm.runner.capture_cuda_graphs(replay_eagerly=True)
            outs.append(llm.generate(prompts, params))
            if graphs:
                prefill = llm.runner.graphs.prefill_graphs.values()
                assert sum(g.num_replays for g in prefill) > 0
        finally:
            llm.exit()
    eager, graphed = outs
    assert eager["token_ids"] == graphed["token_ids"]
    assert graphed["prompt_logprobs"][0] is not None and graphed["prompt_logprobs"][1] is None
    for key in ("logprobs", "prompt_logprobs"):
        for a, b in zip(eager[key], graphed[key], strict=True):
            assert (a is None) == (b is None)
            for x, y in zip(a or [], b or [], strict=True):
                assert (x is None) == (y is None)
                if x is not None:
                    assert (x.token_id, x.rank) == (y.token_id, y.rank)
                    assert abs(x.logprob - y.logprob) < 1e-4
                    assert x.top.keys() == y.top.keys()


# -- backends ------------------------------------------------------------------------------------


def test_backend_and_kernels_are_chosen_once(tiny_llama, monkeypatch):
    llm = tiny_engine(tiny_llama, max_model_length=128)
    try:
        runner = llm.runner
        assert isinstance(runner.attn_backend, TorchAttentionBackend)
        # The CPU set: the references, with C++ norm / SiLU where the CPU extension builds.
        built = cpu_lowp_linear.unavailable_reason() is None
        assert runner.kernels is (cpu_kernels() if built else TORCH_KERNELS)
        assert runner.kernels.name == ("cpu" if built else "torch")
        assert runner.attn_backend.kernels is runner.kernels
        assert all(layer.backend is runner.attn_backend for layer in runner.attention_layers)
        bound = [m for m in runner.model.modules() if hasattr(m, "kernels")]
        assert len(bound) > len(runner.attention_layers)  # norms, activations, rotary
        assert all(m.kernels is runner.kernels for m in bound)

        # After start-up, nothing asks which kernels a device gets.
        def asked(*args, **kwargs):
            raise AssertionError("a step asked for its device's kernels")

        import minivllm.kernels.dispatch as dispatch

        monkeypatch.setattr(dispatch, "use_triton", asked)
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4))
        assert len(out["token_ids"][0]) == 4
    finally:
        llm.exit()


def test_backends_answer_decode_splits_and_variants():
    """What differs by backend is the backend's answer: the torch references take no split
    count and compile nothing; the Triton backend compiles each split count it can ask
    for, at a bucket that takes it, and the short launch where the first bucket splits."""
    torch_backend = TorchAttentionBackend(16)
    assert torch_backend.decode_splits(4, 10) is None and torch_backend.decode_variants() == []
    pytest.importorskip("triton")
    buckets = [1, 2, 4, 8, 16, 32, 48, 64]
    triton_backend = TritonAttentionBackend(
        TORCH_KERNELS, 16, 2, 4096, buckets, 132, torch.device("cpu")
    )
    variants = triton_backend.decode_variants()
    assert {s for _, s in variants} == set(triton_backend.all_decode_splits())
    for n, splits in variants:
        assert n in buckets and (triton_backend.decode_splits(n) == splits or n == buckets[0])
    if triton_backend.short_context and triton_backend.decode_splits(buckets[0]) != 1:
        assert variants[-1] == (buckets[0], 1)


def test_short_launch_over_fp8_skips_the_prefetch():
    """The short launch (one split where the bucket takes more) has its own tiles; over an
    fp8 cache it also leaves its first tile until after the PDL wait. The bucket's launch
    and the 16-bit short launch keep the kernel's default."""
    pytest.importorskip("triton")
    backend = TritonAttentionBackend(TORCH_KERNELS, 16, 2, 4096, [1, 2, 4], 132,
                                     torch.device("cpu"))
    assert backend.short_context and backend.decode_splits(1) > 1
    bf16 = backend.decode_launch(1, 1, torch.bfloat16)
    fp8 = backend.decode_launch(1, 1, torch.bfloat16, kv_fp8=True)
    assert fp8["prefetch"] is False and "prefetch" not in bf16
    assert fp8["tile_config"] == bf16["tile_config"] != backend.decode_kwargs.get("tile_config")
    split = backend.decode_splits(1)
    assert backend.decode_launch(1, split, torch.bfloat16, kv_fp8=True) is backend.decode_kwargs


# -- the warm-up's attention -----------------------------------------------------------------------


def test_warm_up_attention_is_linear_in_tokens(monkeypatch):
    """The no-cache attention of the warm-up never forms a [heads, tokens, tokens] score
    matrix: every attention call it makes stays under the score budget (the old path
    handed SDPA whole sequences, 4 x 2048 x 2048 scores here), and its output is causal
    attention's."""
    monkeypatch.setattr(attention_module, "NO_CACHE_SCORE_BUDGET", 1 << 16)
    sdpa = F.scaled_dot_product_attention
    largest = []

    def spy(q, k, v, *args, **kwargs):
        heads = q.shape[-3] if q.dim() >= 3 else 1
        largest.append(heads * q.shape[-2] * k.shape[-2])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    lens = [2048, 300]
    n = sum(lens)
    heads, kv_heads, dim = 4, 2, 16
    q = torch.randn(n, heads, dim)
    k = torch.randn(n, kv_heads, dim)
    v = torch.randn(n, kv_heads, dim)
    layer = Attention(heads, kv_heads, dim, scale=0.25)  # no KV pool yet: warm-up path
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1),
        cu_seqlens_q=torch.tensor([0, lens[0], n]),
        seq_lens=torch.tensor(lens),
        block_tables=torch.zeros(2, 1, dtype=torch.long),
        is_decode=False,
    )
    with attention_metadata(meta):
        out = layer(q, k, v)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    assert largest and max(largest) <= 1 << 16

    for start, end in ((0, lens[0]), (lens[0], n)):
        expected = sdpa(
            q[start:end].transpose(0, 1)[None],
            k[start:end].repeat_interleave(2, 1).transpose(0, 1)[None],
            v[start:end].repeat_interleave(2, 1).transpose(0, 1)[None],
            is_causal=True,
            scale=0.25,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)
