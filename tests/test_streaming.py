"""Streaming: deltas add up to the final text; multi-byte characters are never split."""

from __future__ import annotations

import pytest

from minivllm import LLMEngine, SamplingParams
from minivllm.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is plain English.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 🚀🔥 and a family 👨‍👩‍👧 and flags 🇫🇷🇯🇵!",
    "Mixed: naïve café — 漢字 🙂 end",
]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_token_by_token(smollm2, text):
    tok = smollm2.tokenizer
    prompt = tok.encode("Say it:")
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert sum(1 for p in pieces if p == "") > 0 or text.isascii()  # bytes were held back


def _metaspace_tokenizer():
    """A Llama-2 style tokenizer (BPE with byte fallback, a leading "▁" for spaces that
    the decoder strips at the start), trained here: a token's leading space depends on
    what came before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(["Hello, world! This is plain English. Say it: naive cafe"] * 20,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("which", ["smollm2", "metaspace"])
def test_detokenizer_stream_matches_window_decodes(smollm2, which):
    """A fast tokenizer's pieces come from tokenizers' DecodeStream; they add up to the
    text the two window decodes give (the path of tokenizers without a fast backend),
    token by token and in chunks, with an end-of-sequence token and with a character cut
    in half at the end (flush emits its bytes as U+FFFD, as the window decode does)."""
    tok = smollm2.tokenizer if which == "smollm2" else _metaspace_tokenizer()
    for text in [*TEXTS, " a leading space", "\n\nnew lines\n  indented"]:
        ids = tok.encode(text, add_special_tokens=False)
        for prompt_text, chunk, seq in (("Say it:", 1, ids), ("x", 3, ids + [tok.eos_token_id]),
                                        ("こんにちは", 2, ids[:-1])):
            prompt = tok.encode(prompt_text)
            fast, slow = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
            assert fast._stream is not None
            slow._stream = None  # the window decodes
            for i in range(0, len(seq), chunk):
                fast.push(seq[i : i + chunk])
                slow.push(seq[i : i + chunk])
            fast.flush()
            slow.flush()
            assert fast.text == slow.text, (which, text, prompt_text, chunk)


def chat(llm: LLMEngine, text: str) -> str:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def stream(llm: LLMEngine, prompts: list[str], params: SamplingParams):
    ids = [llm.add_prompt(p, params) for p in prompts]
    texts = {i: [] for i in ids}
    tokens = {i: [] for i in ids}
    reasons = {}
    while len(reasons) < len(ids):
        llm.step()
        for d in llm.pop_deltas():
            assert "\ufffd" not in d.text
            texts[d.seq_id].append(d.text)
            tokens[d.seq_id].extend(d.token_ids)
            if d.finished:
                reasons[d.seq_id] = d.finish_reason
    return ids, texts, tokens, reasons


def test_deltas_add_up_to_generate_text(smollm2):
    prompts = [
        chat(smollm2, "Translate 'good morning' into Japanese and Chinese."),
        chat(smollm2, "Reply with three emoji that describe the ocean."),
        chat(smollm2, "Count from one to five in words."),
    ]
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = smollm2.generate(prompts, params)
    ids, texts, tokens, reasons = stream(smollm2, prompts, params)
    for k, seq_id in enumerate(ids):
        assert "".join(texts[seq_id]) == expected["text"][k]
        assert tokens[seq_id] == expected["token_ids"][k]
        assert len(texts[seq_id]) > 3  # it really streamed in pieces
        assert reasons[seq_id] in ("stop", "length")
    assert not smollm2.pop_deltas()  # finished sequences are reported once
    assert smollm2.block_manager.num_free_blocks == smollm2.block_manager.num_blocks


def test_stop_string_cuts_exactly(smollm2):
    prompt = chat(smollm2, "Count from one to ten in words, separated by commas.")
    base = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=60))["text"][0]
    # A stop string that spans token boundaries: the middle of the reply.
    start = len(base) // 3
    stop = base[start : start + 5]
    assert len(stop) == 5 and stop.strip()
    cut = base[: base.index(stop)]
    params = SamplingParams(temperature=0, max_tokens=60, stop=[stop, "never-appears"])
    assert smollm2.generate([prompt], params)["text"][0] == cut
    ids, texts, _, reasons = stream(smollm2, [prompt], params)
    assert "".join(texts[ids[0]]) == cut
    assert reasons[ids[0]] == "stop"


def test_abort_reports_a_final_delta(smollm2):
    seq_id = smollm2.add_prompt(
        chat(smollm2, "Tell me a long story."), SamplingParams(temperature=0, max_tokens=200)
    )
    for _ in range(3):
        smollm2.step()
    smollm2.abort(seq_id)
    deltas = [d for d in smollm2.pop_deltas() if d.seq_id == seq_id]
    assert deltas and deltas[-1].finished and deltas[-1].finish_reason == "abort"
    stats = smollm2.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == 0
