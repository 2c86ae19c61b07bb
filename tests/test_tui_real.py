"""minivllm-chat on the real engine: SmolLM2-135M-Instruct on CPU (the embedded copy).

Two panes stream at once and each reply equals `LLMEngine.generate` on the same templated
prompt (greedy); a second turn raises the prefix cache hit rate; Esc frees the blocks;
plain mode through a pipe. Slow on CPU, so marked `slow`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from minivllm.tui.app import create_app
from minivllm.tui.cli import CPU_STEP_TOKENS, build_parser, check_config
from minivllm.tui.conversation import Settings
from minivllm.tui.engine_client import render_prompt
from minivllm.tui.testing import type_and_send, wait_idle, wait_ready, wait_until

from minivllm.config import APP_CPU_WEIGHT_DTYPE

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SIZE = (160, 48)
GREEDY = Settings(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def engine():
    try:
        from minivllm import LLMEngine

        # The app's CPU step budget and weights (minivllm-chat sets them on a CPU), with fp32
        # activations: int8 ones (the default on VNNI CPUs) round each row afresh, so a
        # reply can part from `generate`'s when its prefill shared a step differently, and
        # these tests compare the app's replies with `generate`'s token for token.
        eng = LLMEngine({"model_name_or_path": MODEL, "device": "cpu", "block_size": 16,
                         "max_model_length": 1024, "max_num_sequences": 8,
                         "max_num_batched_tokens": CPU_STEP_TOKENS,
                         "cpu_weight_dtype": APP_CPU_WEIGHT_DTYPE,
                         "cpu_decode_dtype": "float32"})
    except Exception as exc:  # noqa: BLE001 - no weights here: nothing to test
        pytest.skip(f"SmolLM2 engine unavailable: {exc}")
    yield eng
    eng.exit()


def make_app(engine, tmp_path, **kw):
    kw.setdefault("settings", GREEDY)
    return create_app(engine, data_root=tmp_path / "data", owns_engine=False,
                      stats_interval=0.1, **kw)


def latest_stats(app):
    return app.history.samples[-1][1]


async def test_two_panes_stream_at_once_and_match_generate(engine, tmp_path):
    from minivllm import SamplingParams

    prompts = ["Write a short poem about the sea.", "Write a short poem about mountains."]
    # Long enough replies that the first still streams when the second starts (24 tokens
    # took ~0.3 s with the native decode step: gone before the second prompt was typed).
    app = make_app(engine, tmp_path, settings=Settings(temperature=0.0, max_tokens=160))
    overlap = False
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, prompts[0])
        await type_and_send(pilot, 1, prompts[1])

        def both_partial() -> bool:
            nonlocal overlap
            a, b = app.panes
            if a.busy and b.busy and a.conversation.messages[-1].content \
                    and b.conversation.messages[-1].content:
                overlap = True
            return overlap or not (a.busy or b.busy)

        await wait_until(pilot, both_partial, 300, "both panes to show partial text")
        await wait_idle(pilot, 300)
        replies = [p.conversation.messages[-1] for p in app.panes]
        histories = [p.conversation.template_messages()[:-1] for p in app.panes]
        assert all("TTFT" in p.title_text for p in app.panes)
    assert overlap, "the two replies did not stream at the same time"
    assert all(r.status in ("done", "length") and r.content for r in replies)
    texts = [render_prompt(engine.tokenizer, h, True) for h in histories]
    # The engine's first 24 greedy tokens of each conversation open each reply (further on,
    # the batch the app's requests shared differs from generate's, and the sums' order with
    # it: long greedy runs may part at a near-tie).
    out = engine.generate(texts, SamplingParams(temperature=0.0, top_p=0.95, max_tokens=24))
    for reply, want in zip(replies, out["text"], strict=True):
        assert want and reply.content.startswith(want), (reply.content, want)


async def test_second_turn_raises_prefix_cache_hit_rate(engine, tmp_path):
    app = make_app(engine, tmp_path, conversations=1)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, "Tell me a fact about the moon, in one sentence please.")
        await wait_idle(pilot, 300)
        app.history.samples.clear()
        await wait_until(pilot, lambda: app.history.samples, 10)
        before = latest_stats(app).prefix_cache_hit_rate
        await type_and_send(pilot, 0, "And one about the sun?")
        await wait_idle(pilot, 300)
        # NOTE: a snapshot taken before the second prompt may still be on its way on a
        # loaded machine: wait for the panel's figure to move, not for any one snapshot.
        await wait_until(pilot, lambda: latest_stats(app).prefix_cache_hit_rate > before, 30,
                         f"the prefix cache hit rate to rise above {before:.3f}")
        assert "Prefix cache hit rate" in app.chat.stats_panel.lines[2]


async def test_esc_frees_the_blocks(engine, tmp_path):
    app = make_app(engine, tmp_path, conversations=1,
                   settings=Settings(temperature=0.0, max_tokens=400))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        pane = app.panes[0]
        await type_and_send(pilot, 0, "Write a long story about a dragon and a knight.")
        await wait_until(pilot, lambda: pane.state == "streaming" and pane._tokens >= 3, 300)
        await wait_until(pilot, lambda: latest_stats(app).num_running == 1
                         and latest_stats(app).num_used_blocks > 0, 60)
        await pilot.press("escape")
        await wait_until(pilot, lambda: pane.state == "stopped", 60)
        assert pane.conversation.messages[-1].content
        await wait_until(pilot, lambda: latest_stats(app).num_running == 0
                         and latest_stats(app).num_used_blocks == 0, 30)
        assert "0/" in app.chat.stats_panel.lines[0] and "Running 0 reqs" in \
            app.chat.stats_panel.lines[0]


def test_plain_mode_through_a_pipe_on_the_real_model(tmp_path, engine):
    env = {**os.environ, "MINIVLLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "minivllm.tui.cli", "--plain", "--device", "cpu",
         "--max-model-len", "512", "--temperature", "0", "--max-tokens", "16"],
        input="What is the capital of France?\n/stats\n", capture_output=True, text=True,
        env=env, timeout=600,
        # As a user runs it: from outside the clone.
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    reply, _, stats = proc.stdout.partition("KV cache [")
    assert "Paris" in reply
    assert "Running 0 reqs" in stats and "Generation throughput" in stats
    assert MODEL in proc.stderr


class PacedPrefill:
    """The engine, except that after each step that leaves a prompt part-computed, its
    thread waits (up to 30 s) until `shown(progress)`: the check then sees every chunk
    boundary however fast or slow the machine is. Everything else is the engine's."""

    def __init__(self, engine, shown) -> None:
        self._engine = engine
        self._shown = shown
        self._seq_ids: list[int] = []
        self.chunks: list[tuple[int, int]] = []  # part-computed progress after a step

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_prompt(self, prompt, params=None):
        seq_id = self._engine.add_prompt(prompt, params)
        self._seq_ids.append(seq_id)
        return seq_id

    def step(self):
        import time

        result = self._engine.step()
        for seq_id in self._seq_ids:
            progress = self._engine.prompt_progress(seq_id)
            if progress is not None and 0 < progress[0] < progress[1]:
                self.chunks.append(progress)
                deadline = time.monotonic() + 30
                while not self._shown(progress) and time.monotonic() < deadline:
                    time.sleep(0.005)
        return result


async def test_long_prompt_shows_prefill_progress(engine, tmp_path):
    """A long paste is prefilled in chunks of the CPU step budget (so
    other panes get a step every ~0.2 s); its title counts the prompt tokens computed,
    chunk by chunk."""
    import re

    panes = []
    paced = PacedPrefill(engine, lambda p: bool(panes) and panes[0].title_text.startswith(
        f"#1 prefill {p[0]:,} / {p[1]:,}"))
    app = make_app(paced, tmp_path, conversations=1,
                   settings=Settings(temperature=0.0, max_tokens=2))
    seen: set[tuple[int, int]] = set()
    # About 2.5 step budgets of prompt (a sentence is ~7 tokens): two chunks part-way.
    paste = "Summarise this: " + "the cat sat on the mat. " * (CPU_STEP_TOKENS * 5 // 14)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        panes.append(app.panes[0])
        await type_and_send(pilot, 0, paste)
        pane = app.panes[0]

        def progressed() -> bool:
            m = re.match(r"#1 prefill ([\d,]+) / ([\d,]+)", pane.title_text)
            if m:
                seen.add(tuple(int(g.replace(",", "")) for g in m.groups()))
            return not pane.busy

        await wait_until(pilot, progressed, 600, "the long prompt to be answered")
        assert pane.conversation.messages[-1].status in ("done", "length")
    assert len(paced.chunks) >= 2, paced.chunks
    total = paced.chunks[0][1]
    assert total > 2 * CPU_STEP_TOKENS
    done = [d for d, _ in paced.chunks]  # a step computes one budget of the prompt
    assert all(b - a == CPU_STEP_TOKENS for a, b in zip(done, done[1:], strict=False)), done
    assert set(paced.chunks) <= seen  # the title showed every chunk


def test_cpu_step_budget_default(smollm2_path):
    config = check_config(build_parser().parse_args(["--device", "cpu"]))
    assert config["max_num_batched_tokens"] == CPU_STEP_TOKENS
    config = check_config(build_parser().parse_args(
        ["--device", "cpu", "--max-num-batched-tokens", "512"]))
    assert config["max_num_batched_tokens"] == 512
