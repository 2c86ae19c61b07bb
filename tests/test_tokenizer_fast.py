"""minivllm.tokenizer: tokenizer.json and the chat template without transformers give
transformers' token ids, text and chat prompts; transformers stays the fallback.

The references are transformers' own tokenizers for the same folders: the embedded SmolLM2
and the tiny Qwen3 / Llama checkpoints with small byte-level BPE tokenizers and chat
templates in the style of those families (tools, thinking, dates, BOS handling).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minivllm.loader import load_tokenizer
from minivllm.tokenizer import FastTokenizer, unsupported_reason

REPO_ROOT = Path(__file__).resolve().parents[1]

TEXTS = [
    "hi",
    "What is the capital of France?",
    "  leading spaces, trailing ones  \n\n\ttabs",
    "non-ASCII: héllo wörld 日本語 🎉 — “quotes”",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n",
    "contractions don't , spaced . marks ? here !",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Name a prime number — any."},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Où est Paris ? <b>bold</b> & \"quoted\""},
    ],
]

# Qwen3's structure: tools as JSON, thinking turned off by a template variable, reasoning
# kept for the last turn only, loop controls and a namespace, an error for a bad role.
QWEN_TEMPLATE = textwrap.dedent(
    """\
    {%- if tools %}
    <|im_start|>system
    {%- if messages[0].role == 'system' %}
    {{ messages[0].content }}
    {%- endif %}
    # Tools
    {%- for tool in tools %}
    {{ "\\n" }}{{ tool | tojson }}
    {%- endfor %}<|im_end|>
    {% elif messages[0].role == 'system' %}
    <|im_start|>system
    {{ messages[0].content }}<|im_end|>
    {% endif %}
    {%- set ns = namespace(last_user=-1) %}
    {%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
    {%- endfor %}
    {%- for m in messages %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
    {%- if m.role not in ['user', 'assistant'] %}
    {{- raise_exception('unknown role ' + m.role) }}
    {%- endif %}
    <|im_start|>{{ m.role }}
    {% if m.role == 'assistant' and m.reasoning_content is defined and loop.index0 > ns.last_user %}
    <think>
    {{ m.reasoning_content }}
    </think>

    {% endif %}
    {{- m.content }}<|im_end|>
    {% endfor %}
    {%- if add_generation_prompt %}
    <|im_start|>assistant
    {% if enable_thinking is defined and enable_thinking is false %}
    <think>

    </think>

    {% endif %}
    {%- endif %}"""
)

# Llama 3's structure: the BOS token through the template's variable, a date from
# strftime_now, a system turn always present.
LLAMA_TEMPLATE = textwrap.dedent(
    """\
    {{- bos_token }}
    {%- if messages[0]['role'] == 'system' %}
        {%- set system_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {%- set system_message = "" %}
    {%- endif %}
    {{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
    {{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}
    {{- system_message }}
    {{- "<|eot_id|>" }}
    {%- for message in messages %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
    {%- endif %}"""
)


def _bpe(special: list[str], bos: str | None = None):
    """A byte-level BPE trained on a little English and French, with `special` tokens;
    with `bos`, tokenizer.json's post-processor puts it first (as Llama 3's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    corpus = ["What is the capital of France? Paris is. Où est Paris ? Le voilà."] * 20
    tok.train_from_iterator(corpus, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )  # fmt: skip
    return tok


def _with_tokenizer(checkpoint: Path, dest: Path, tok, template: str, **special) -> Path:
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(checkpoint, dest)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.chat_template = template
    fast.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def qwen_folder(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    return _with_tokenizer(
        tiny_qwen3, tmp_path_factory.mktemp("qwen") / "ckpt", _bpe(special), QWEN_TEMPLATE,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama_folder(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"]
    return _with_tokenizer(
        tiny_llama, tmp_path_factory.mktemp("llama") / "ckpt",
        _bpe(special, bos="<|begin_of_text|>"), LLAMA_TEMPLATE,
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
    )  # fmt: skip


@pytest.fixture(params=["smollm2", "qwen3", "llama"])
def folder(request: pytest.FixtureRequest) -> Path:
    name = {"smollm2": "smollm2_path", "qwen3": "qwen_folder", "llama": "llama_folder"}
    return request.getfixturevalue(name[request.param])


def _pair(folder: Path):
    from transformers import AutoTokenizer

    ours = load_tokenizer(folder)
    assert isinstance(ours, FastTokenizer), unsupported_reason(folder)
    return ours, AutoTokenizer.from_pretrained(folder)


def test_ids_and_text_equal_transformers(folder: Path) -> None:
    ours, ref = _pair(folder)
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )
        for skip in (False, True):
            for clean in (None, False, True):
                kw = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": clean}
                assert ours.decode(ids, **kw) == ref.decode(ids, **kw), (text, kw)
    # The ids the engine and the server read off a tokenizer.
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id)  # fmt: skip
    assert ours.special_tokens_map == ref.special_tokens_map
    assert sorted(ours.all_special_ids) == sorted(ref.all_special_ids)
    assert (len(ours), ours.vocab_size) == (len(ref), ref.vocab_size)
    assert ours.get_vocab() == ref.get_vocab()
    some = list(range(0, len(ref), max(1, len(ref) // 50)))
    assert ours.convert_ids_to_tokens(some) == ref.convert_ids_to_tokens(some)
    assert ours.convert_ids_to_tokens(some, skip_special_tokens=True) == (
        ref.convert_ids_to_tokens(some, skip_special_tokens=True))  # fmt: skip


def test_chat_prompts_equal_transformers(folder: Path) -> None:
    ours, ref = _pair(folder)
    for conversation in CONVERSATIONS:
        for generation_prompt in (False, True):
            kw = {"add_generation_prompt": generation_prompt}
            text = ours.apply_chat_template(conversation, tokenize=False, **kw)
            assert text == ref.apply_chat_template(conversation, tokenize=False, **kw)
            assert ours.apply_chat_template(conversation, return_dict=False, **kw) == (
                ref.apply_chat_template(conversation, return_dict=False, **kw))  # fmt: skip
    batch = ours.apply_chat_template(CONVERSATIONS, tokenize=False)
    assert batch == ref.apply_chat_template(CONVERSATIONS, tokenize=False)


def test_template_variables_tools_and_reasoning_pass_through(qwen_folder: Path) -> None:
    ours, ref = _pair(qwen_folder)
    tool = {"type": "function", "function": {"name": "météo", "description": "a <city>'s",
                                             "parameters": {"type": "object"}}}
    turns = [*CONVERSATIONS[1][:3],
             {"role": "user", "content": "And then?"},
             {"role": "assistant", "content": "Done.", "reasoning_content": "Think.",
              "tool_calls": None}]
    for kw in ({"tools": [tool]}, {"enable_thinking": False, "add_generation_prompt": True},
               {"enable_thinking": True, "add_generation_prompt": True}):
        got = ours.apply_chat_template(turns, tokenize=False, **kw)
        assert got == ref.apply_chat_template(turns, tokenize=False, **kw), kw
    assert '"météo"' in ours.apply_chat_template(turns, tools=[tool], tokenize=False)
    with pytest.raises(Exception, match="unknown role robot") as ours_error:
        ours.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)
    with pytest.raises(type(ours_error.value), match="unknown role robot"):
        ref.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)
    # A template given by the caller, and one that reaches for a private attribute.
    assert ours.apply_chat_template(turns, chat_template="{{ messages | length }}",
                                    tokenize=False) == "5"
    with pytest.raises(Exception, match="unsafe|underscore|private"):
        ours.apply_chat_template(turns, tokenize=False,
                                 chat_template="{{ messages.__class__.__mro__ }}")


def test_other_uses_are_transformers_own(qwen_folder: Path) -> None:
    """A dict of ids (transformers' default for tokenize=True) and an unknown attribute go
    to transformers' tokenizer; the object still pickles (the engine process sends it)."""
    ours, ref = _pair(qwen_folder)
    conversation = CONVERSATIONS[0]
    got = ours.apply_chat_template(conversation, add_generation_prompt=True)
    assert got["input_ids"] == ref.apply_chat_template(conversation,
                                                       add_generation_prompt=True)["input_ids"]
    assert ours(TEXTS[1])["input_ids"] == ref(TEXTS[1])["input_ids"]
    copy = pickle.loads(pickle.dumps(ours))
    assert copy.encode(TEXTS[3]) == ref.encode(TEXTS[3])
    assert copy.apply_chat_template(conversation, tokenize=False) == ref.apply_chat_template(
        conversation, tokenize=False)  # fmt: skip


def test_bos_switches_in_the_config_do_as_in_transformers(
    llama_folder: Path, tmp_path: Path
) -> None:
    """tokenizer_config.json's add_bos_token / add_eos_token beside a tokenizer.json: the
    ids are transformers' (whose generic class keeps tokenizer.json's post-processor)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(llama_folder, folder)
    config_file = folder / "tokenizer_config.json"
    for switches in ({"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}):
        config = json.loads(config_file.read_text())
        config.update(switches)
        config_file.write_text(json.dumps(config))
        ours, ref = _pair(folder)
        for text in TEXTS[:3]:
            assert ours.encode(text) == ref.encode(text), switches


def test_model_specific_tokenizers_stay_with_transformers(qwen_folder: Path,
                                                          tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(qwen_folder, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["split_special_tokens"] = True
    config_file.write_text(json.dumps(config))
    assert unsupported_reason(folder) == "tokenizer_config.json sets split_special_tokens"
    tokenizer = load_tokenizer(folder)
    assert not isinstance(tokenizer, FastTokenizer)
    assert tokenizer.encode("<|im_end|>") != [tokenizer.eos_token_id]  # split, as asked
    (folder / "tokenizer.json").unlink()
    assert unsupported_reason(folder) == "no tokenizer.json"


# -- what a start imports -----------------------------------------------------------------

IMPORTS = textwrap.dedent(
    """
    import sys
    import minivllm
    heavy = ("transformers", "triton", "jinja2")
    assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
    from minivllm.cli import main
    main(sys.argv[1:])
    print("loaded:", sorted(m for m in ("transformers", "triton") if m in sys.modules))
    """
)


def test_cpu_generate_imports_neither_transformers_nor_triton(smollm2_path: Path) -> None:
    """`import minivllm` imports neither; a CPU `generate` of a chat prompt (tokenizer,
    chat template, engine, decode) does not either."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    env.pop("MINIVLLM_TRITON", None)
    args = ["generate", "--model", str(smollm2_path), "--device", "cpu", "--chat",
            "--prompt", "hi", "--max-tokens", "2", "--cpu-prefill-dtype", "float32"]
    proc = subprocess.run([sys.executable, "-c", IMPORTS, *args], capture_output=True,
                          text=True, env=env, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "loaded: []", proc.stdout
