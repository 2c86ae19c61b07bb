"""Greedy output equals Hugging Face transformers' on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import hf_greedy, step_loop, tiny_engine

from minivllm import SamplingParams

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering.",
    "List three prime numbers greater than ten and say which is the largest of them all.",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def test_smollm2_generate_matches_transformers(smollm2, smollm2_hf):
    prompts = [chat_ids(smollm2.tokenizer, p) for p in CHAT_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = smollm2.generate(prompts, params)
    for prompt, got in zip(prompts, out["token_ids"], strict=True):
        assert got == hf_greedy(smollm2_hf, prompt, 32)
    assert "Paris" in out["text"][0]


def test_smollm2_step_loop_matches_generate(smollm2, smollm2_hf):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    texts = [
        smollm2.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in CHAT_PROMPTS
    ]
    got = step_loop(smollm2, texts, params)
    for completion, prompt in zip(got, CHAT_PROMPTS, strict=True):
        assert completion == hf_greedy(smollm2_hf, chat_ids(smollm2.tokenizer, prompt), 32)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_tiny_random_models_match_transformers(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    # Lengths cross the 16-token blocks; the llama3 rope scaling bites past 64 positions.
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 16, 37, 90)]
    llm = tiny_engine(path, block_size=16)
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    finally:
        llm.exit()
    for prompt, got in zip(prompts, out["token_ids"], strict=True):
        ref = hf_greedy(hf, prompt, 40)
        assert got == ref
        assert len(set(ref)) > 3  # the model is not degenerate, so the check means something
