"""`minivllm bench prefill|chat|coldstart` run end to end on a tiny model (CPU, small
settings): every row they promise is printed. Figures come from the GPU run."""

from __future__ import annotations

import shutil

import pytest
from conftest import write_tiny_checkpoint

from minivllm.cli import main

SMALL = ["--device", "cpu", "--max-model-len", "512", "--max-num-batched-tokens", "128",
         "--block-size", "16", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, smollm2_path):
    """The bench builds engines from a model name, which needs tokenizer files."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_bench"), "qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, path / name)
    return str(path)


def test_bench_prefill_and_chat(tiny_with_tokenizer, capsys):
    main(["bench", "prefill", "--model", tiny_with_tokenizer, *SMALL,
          "--prefill-lens", "16", "100", "1024", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "prefill 16 tokens" in out and "prefill 100 tokens" in out
    assert "1024" not in out  # longer than the step budget: left out
    main(["bench", "chat", "--model", tiny_with_tokenizer, *SMALL, "--conversations", "3",
          "--turns", "2", "--system-len", "40", "--user-len", "5", "20", "--reply-len", "2",
          "4", "--lone-cached", "100", "--lone-new", "10", "--repeats", "1"])
    out = capsys.readouterr().out
    for row in ("chat first-turn TTFT median", "chat first-turn TTFT p90",
                "chat follow-up TTFT median", "chat follow-up TTFT p90",
                "chat prefix hit rate", "chat lone follow-up TTFT"):
        assert row in out, row


def test_bench_chat_rejects_bad_ranges(tiny_with_tokenizer, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "chat", "--model", tiny_with_tokenizer, *SMALL, "--user-len", "9", "3"])
    assert e.value.code == 1  # a user error: one line, exit 1
    assert "--user-len" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_coldstart(tiny_with_tokenizer, capsys):
    main(["bench", "coldstart", "--model", tiny_with_tokenizer, *SMALL, "--cold-lens", "20",
          "100", "--cold-decoders", "3", "--cold-arrival", "60"])
    out = capsys.readouterr().out
    assert "cold start-up" in out and "cold slowest step" in out
    assert "cold first step, 3 decoding + 60-token arrival" in out
