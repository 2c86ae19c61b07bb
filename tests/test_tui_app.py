"""minivllm-chat against the scripted fake engine: keys, streaming, stop, regenerate,
panes, persistence, errors, stats panel. Every wait polls a condition with a timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from minivllm.tui.app import create_app
from minivllm.tui.conversation import Settings
from minivllm.tui.messages import StatsSnapshot
from minivllm.tui.stats import StatsHistory
from minivllm.tui.store import latest_session, load_session
from minivllm.tui.testing import type_and_send, wait_idle, wait_ready, wait_until
from minivllm.tui.widgets.entries import Reply
from scripted import HeldEngine

from minivllm.outputs import EngineStats
from minivllm.server.standin import ScriptedEngine

SIZE = (160, 48)
LONG = " ".join(f"w{i}" for i in range(300))  # ~900 fake tokens, under max_tokens


def make_app(tmp_path: Path, engine: ScriptedEngine | None = None, **kw):
    engine = engine or ScriptedEngine(step_delay=0.002)
    kw.setdefault("data_root", tmp_path / "data")
    kw.setdefault("export_dir", tmp_path)
    return create_app(engine, **kw)


def replies(pane) -> list[Reply]:
    return pane.transcript.replies


def records(tmp_path: Path) -> list[dict]:
    path = latest_session(tmp_path / "data")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_first_input_focused_enter_sends_and_ctrl_j_inserts_newline(tmp_path):
    app = make_app(tmp_path, ScriptedEngine(reply="Hello **there**.", step_delay=0.002))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("h", "i", "ctrl+j", "y", "o")
        pane = app.panes[0]
        assert pane.input.text == "hi\nyo"
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(pane.conversation.messages) == 2)
        await wait_idle(pilot)
        assert pane.input.text == ""
        user, reply = pane.conversation.messages
        assert (user.role, user.content) == ("user", "hi\nyo")
        assert (reply.content, reply.status) == ("Hello **there**.", "done")
        assert replies(pane)[0].markdown_source == "Hello **there**."
        assert pane.state == "idle"
        assert pane.title_text.startswith("#1 idle · TTFT ")
        assert "tok/s" in pane.title_text


async def test_thinking_goes_to_a_collapsible_expanded_then_collapsed(tmp_path):
    thinking = " ".join(["pondering"] * 150)
    engine = ScriptedEngine(reply=f"<think>\n{thinking}\n</think>\n\nThe answer.", step_delay=0.003)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        pane = app.panes[0]
        await type_and_send(pilot, 0, "think about it")
        await wait_until(pilot, lambda: replies(pane) and replies(pane)[0].has_thinking)
        msg = replies(pane)[0]
        assert msg.thinking_expanded  # expanded while thinking
        await wait_idle(pilot)
        assert msg.has_thinking and not msg.thinking_expanded  # collapsed once answered
        assert msg.thinking_text.strip() == thinking
        assert msg.markdown_source == "The answer."
        assert "<think>" not in msg.markdown_source
        # A click on its title opens the thinking block, another closes it.
        transcript = pane.transcript
        assert "pondering" not in " ".join(transcript.text_lines())
        title = next(i for i, line in enumerate(transcript.text_lines()) if "Thinking" in line)
        await pilot.click(transcript, offset=(3, title - transcript.scroll_y))
        assert msg.thinking_expanded and "pondering" in " ".join(transcript.text_lines())
        title = next(i for i, line in enumerate(transcript.text_lines()) if "Thinking" in line)
        await pilot.click(transcript, offset=(3, title - transcript.scroll_y))
        assert not msg.thinking_expanded
        # Thinking is not put back into the history.
        assert pane.conversation.template_messages()[-1] == {
            "role": "assistant", "content": "The answer."}


async def test_think_and_no_think_switch_the_template_per_pane(tmp_path):
    engine = ScriptedEngine(thinking=True, step_delay=0.001)
    seen: list[str] = []
    real = engine.add_prompt
    engine.add_prompt = lambda prompt, params=None: (seen.append(prompt), real(prompt, params))[1]
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, "/no_think")
        await wait_until(pilot, lambda: not app.panes[0].conversation.settings.thinking)
        assert app.panes[0].input.text == ""
        await type_and_send(pilot, 0, "quick one")
        await type_and_send(pilot, 1, "slow one")
        await wait_until(pilot, lambda: len(seen) == 2)
        await wait_idle(pilot)
        assert seen[0].endswith("<think>\n\n</think>\n\n")  # enable_thinking=False
        assert not seen[1].endswith("</think>\n\n")
        assert not replies(app.panes[0])[0].has_thinking
        assert replies(app.panes[1])[0].has_thinking
        assert "no_think" in str(app.panes[0].border_subtitle)
        await type_and_send(pilot, 0, "/think and now?")  # switches and sends the rest
        await wait_until(pilot, lambda: len(seen) == 3)
        assert app.panes[0].conversation.settings.thinking
        assert seen[2].endswith("and now?<|end|>\n<|assistant|>\n")


async def test_alt_a_and_slash_all_send_to_every_pane_streaming_at_once(tmp_path):
    reply = LONG[:400]
    engine = ScriptedEngine(reply=reply, step_delay=0.002)
    batches = []
    step = engine.step

    def recording_step():
        out = step()
        batches.append(engine.stats().last_batch_size)
        return out

    engine.step = recording_step
    app = make_app(tmp_path, engine, conversations=3)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        app.panes[0].input.text = "everyone"
        await pilot.press("alt+a")  # (the pilot waits here until the UI is quiet)
        await wait_idle(pilot)
        assert max(batches) == 3  # the three requests ran in the same steps
        for p in app.panes:
            assert [m.content for m in p.conversation.messages] == ["everyone", reply]
        assert app.panes[0].input.text == ""
        engine.step_delay = 0.01  # slow enough to watch all three mid-stream
        await type_and_send(pilot, 1, "/all again")
        # All three stream at the same time: each has partial text before any finishes.
        await wait_until(pilot, lambda: all(
            p.busy and len(replies(p)) == 2 and replies(p)[1].answer_text for p in app.panes))
        await wait_idle(pilot)
        assert all(p.conversation.messages[2].content == "again" for p in app.panes)
        assert all(p.conversation.messages[3].content == reply for p in app.panes)


async def test_esc_stops_keeps_partial_reply_and_frees_blocks(tmp_path):
    engine = ScriptedEngine(reply=LONG, step_delay=0.003)
    app = make_app(tmp_path, engine, stats_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        pane = app.panes[0]
        await type_and_send(pilot, 0, "go on")
        await wait_until(pilot, lambda: pane.state == "streaming" and pane._tokens > 20)
        assert app.history.samples[-1][1].num_used_blocks >= 0
        await wait_until(pilot, lambda: app.history.samples[-1][1].num_running == 1)
        await pilot.press("escape")
        await wait_until(pilot, lambda: pane.state == "stopped")
        msg = pane.conversation.messages[-1]
        assert msg.status == "stopped"
        assert 0 < len(msg.content) < len(LONG) and LONG.startswith(msg.content)
        assert replies(pane)[0].status == "stopped"
        await wait_until(pilot, lambda: app.history.samples[-1][1].num_running == 0)
        assert app.history.samples[-1][1].num_used_blocks == 0
        assert "Running 0 reqs" in app.chat.stats_panel.lines[0]
        assert pane.title_text.startswith("#1 stopped")
        end = [r for r in records(tmp_path) if r["type"] == "end"][-1]
        assert (end["status"], end["text"]) == ("stopped", msg.content)


async def test_ctrl_r_regenerates_the_last_reply(tmp_path):
    engine = ScriptedEngine(reply=["first answer", "second answer", "third"], step_delay=0.001)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        pane = app.panes[0]
        await type_and_send(pilot, 0, "question")
        await wait_until(pilot, lambda: pane.conversation.messages[-1].content == "first answer")
        await wait_idle(pilot)
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: pane.conversation.messages[-1].content
                         == "second answer" and not pane.busy)
        assert [m.content for m in pane.conversation.messages] == ["question", "second answer"]
        assert [r.markdown_source for r in replies(pane)] == ["second answer"]
    loaded = load_session(latest_session(tmp_path / "data"))
    assert [m.content for m in loaded.conversations[0].messages] == ["question", "second answer"]


async def test_ctrl_n_ctrl_w_alt_digits_and_ctrl_arrows(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: len(app.panes) == 3)
        assert app.focused is app.panes[2].input
        await pilot.press("alt+1")
        assert app.focused is app.panes[0].input
        await pilot.press("ctrl+left")  # wraps to the last pane
        assert app.focused is app.panes[2].input
        await pilot.press("ctrl+right")
        assert app.focused is app.panes[0].input
        await pilot.press("alt+2")
        assert app.focused is app.panes[1].input
        await type_and_send(pilot, 1, "in the middle pane")
        await wait_idle(pilot)
        app.panes[1].input.focus()
        await pilot.press("ctrl+w")  # it holds a conversation: asks first
        await wait_until(pilot, lambda: app.screen.id == "confirm")
        await pilot.press("y")
        await wait_until(pilot, lambda: len(app.panes) == 2)
        assert [p.number for p in app.panes] == [1, 2]
        assert [p.conversation.key for p in app.panes] == [1, 3]
        assert app.panes[1].title_text.startswith("#2 ")
        await pilot.press("ctrl+w", "ctrl+w")  # empty panes close at once; the last stays
        await wait_until(pilot, lambda: len(app.panes) == 1)
        await pilot.pause(0.05)
        assert len(app.panes) == 1


async def test_the_heap_settles_when_nothing_streams(tmp_path):
    """The collector's full passes run when nothing streams: at start and at the end of a
    turn the survivors are frozen (later passes, mid-stream, skip them)."""
    import gc

    gc.unfreeze()
    app = make_app(tmp_path, conversations=2)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            await wait_until(pilot, lambda: gc.get_freeze_count() > 0)  # start-up objects
            frozen = gc.get_freeze_count()
            await type_and_send(pilot, 0, "hello")
            await wait_idle(pilot)
            await wait_until(pilot, lambda: gc.get_freeze_count() > frozen)  # the turn's
    finally:
        gc.unfreeze()


async def test_keymap_overrides_a_binding_by_id(tmp_path):
    app = make_app(tmp_path, keymap={"chat.new_pane": "f6", "input.send": "ctrl+s"})
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("f6")
        await wait_until(pilot, lambda: len(app.panes) == 3)
        await pilot.press("alt+1", "o", "k", "enter")
        assert app.panes[0].input.text == "ok\n"  # Enter is a plain newline now
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: app.panes[0].conversation.messages)
        assert app.panes[0].conversation.messages[0].content == "ok"


async def test_command_palette_settings_modal_and_export(tmp_path):
    app = make_app(tmp_path, ScriptedEngine(reply="Exported *reply*.", step_delay=0.001))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+p")
        await pilot.press(*"new conversation")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.panes) == 3)
        await pilot.press("alt+1", "f2")
        await wait_until(pilot, lambda: app.screen.id == "settings")
        app.screen.query_one("#system").text = "You are terse."
        app.screen.query_one("#temperature").value = "-1"
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: "temperature" in str(
            app.screen.query_one("#settings-error").render()))
        app.screen.query_one("#temperature").value = "0"
        app.screen.query_one("#max_tokens").value = "32"
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: app.screen is app.chat)
        s = app.panes[0].conversation.settings
        assert (s.system_prompt, s.temperature, s.max_tokens) == ("You are terse.", 0.0, 32)
        assert "T=0 " in str(app.panes[0].border_subtitle)
        await type_and_send(pilot, 0, "hello")
        await wait_idle(pilot)
        app.panes[0].input.focus()
        app.action_export()
        md = app.last_export.read_text()
        assert "## System\n\nYou are terse." in md
        assert "## User\n\nhello" in md and "Exported *reply*." in md


async def test_persistence_quit_and_resume_shows_the_same_messages(tmp_path):
    engine = ScriptedEngine(reply=["one **1**", "two", "three", LONG], step_delay=0.001)
    app = make_app(tmp_path, engine, settings=Settings(system_prompt="sys"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, "first")
        await wait_idle(pilot)
        await type_and_send(pilot, 1, "second")
        await wait_idle(pilot)
        await type_and_send(pilot, 0, "third")
        await wait_idle(pilot)
        before = [[(m.role, m.content, m.status) for m in p.conversation.messages]
                  for p in app.panes]
        await pilot.press("ctrl+q")
    assert before[0][1][1] == "one **1**"
    app2 = make_app(tmp_path, ScriptedEngine(), resume=True)
    async with app2.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        after = [[(m.role, m.content, m.status) for m in p.conversation.messages]
                 for p in app2.panes]
        assert after == before
        assert app2.panes[0].conversation.settings.system_prompt == "sys"
        assert [r.markdown_source for r in replies(app2.panes[0])] == ["one **1**", "three"]
        # The resumed history continues: the next prompt carries the earlier turns.
        await type_and_send(pilot, 1, "more")
        await wait_idle(pilot)
        assert [m.content for m in app2.panes[1].conversation.messages][:2] == [
            "second", "two"]


async def test_quit_mid_reply_keeps_the_partial_text(tmp_path):
    app = make_app(tmp_path, ScriptedEngine(reply=LONG, step_delay=0.003))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, "long please")
        await wait_until(pilot, lambda: app.panes[0]._tokens > 10)
        await pilot.press("ctrl+c")  # never quits, never loses anything
        await pilot.pause(0.05)
        assert app.is_running
        await pilot.press("ctrl+q")
    conv = load_session(latest_session(tmp_path / "data")).conversations[0]
    assert conv.messages[0].content == "long please"
    assert conv.messages[1].status == "stopped" and LONG.startswith(conv.messages[1].content)
    assert len(conv.messages[1].content) > 10


def test_kill_9_mid_stream_then_resume(tmp_path):
    """The app process is killed mid-reply: the sent message is on disk, the partial
    reply (flushed about once a second) is there and marked interrupted."""
    script = textwrap.dedent(f"""
        import asyncio, sys
        from pathlib import Path
        from minivllm.tui.app import create_app
        from minivllm.server.standin import ScriptedEngine
        from minivllm.tui.testing import type_and_send, wait_ready, wait_until

        async def main():
            app = create_app(ScriptedEngine(reply={LONG!r}, step_delay=0.01),
                             data_root=Path({str(tmp_path / "data")!r}))
            async with app.run_test(size=(160, 48)) as pilot:
                await wait_ready(pilot)
                await type_and_send(pilot, 0, "typed before the crash")
                await wait_until(pilot, lambda: app.panes[0]._tokens > 5)
                await pilot.pause(1.5)  # at least one periodic flush of the partial reply
                print("STREAMING", flush=True)
                await pilot.pause(60)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "STREAMING"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    loaded = load_session(latest_session(tmp_path / "data"))
    conv = loaded.conversations[0]
    assert conv.messages[0].content == "typed before the crash"
    assert conv.messages[1].status == "interrupted"
    assert conv.messages[1].content and LONG.startswith(conv.messages[1].content)


async def test_resume_marks_the_interrupted_reply(tmp_path):
    data = tmp_path / "data" / "sessions"
    data.mkdir(parents=True)
    lines = [
        {"type": "pane", "pane": 1, "settings": Settings().to_dict()},
        {"type": "user", "pane": 1, "text": "hello"},
        {"type": "chunk", "pane": 1, "text": "partial rep"},
    ]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"type": "chunk", "pa'
    (data / "20240101-000000-1.jsonl").write_text(text)
    app = make_app(tmp_path, resume=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        pane = app.panes[0]
        assert [m.content for m in pane.conversation.messages] == ["hello", "partial rep"]
        assert pane.conversation.messages[1].status == "interrupted"
        assert replies(pane)[0].status == "interrupted"
        assert pane.state == "stopped"
        await type_and_send(pilot, 0, "next")
        await wait_idle(pilot)
    convs = load_session(latest_session(tmp_path / "data")).conversations
    assert [m.status for m in convs[0].messages] == ["done", "interrupted", "done", "done"]


async def test_bad_input_and_step_failure_show_in_their_pane_and_the_app_stays_up(tmp_path):
    engine = ScriptedEngine({"max_model_length": 200}, reply="fine", step_delay=0.001)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, "too many words " * 40)  # over max_model_length
        pane = app.panes[0]
        await wait_until(pilot, lambda: pane.state == "error")
        assert "prompt" in pane.conversation.messages[-1].error
        assert app.panes[1].state == "idle"
        launch = engine.runner.launch

        def fail_once(batch):  # the next step fails on the device
            engine.runner.launch = launch
            raise RuntimeError("injected step failure")

        engine.runner.launch = fail_once
        await type_and_send(pilot, 1, "boom")
        await wait_until(pilot, lambda: app.panes[1].state == "error")
        assert "injected step failure" in app.panes[1].conversation.messages[-1].error
        await type_and_send(pilot, 0, "ok now")  # both panes still work
        await type_and_send(pilot, 1, "ok too")
        await wait_until(pilot, lambda: all(p.conversation.messages[-1].content == "fine"
                                            for p in app.panes))
        await wait_idle(pilot)
        assert [p.state for p in app.panes] == ["idle", "idle"]


async def test_engine_thread_death_shows_in_every_pane_with_text_kept(tmp_path):
    engine = ScriptedEngine(reply=LONG, step_delay=0.003)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, "streaming when it dies")
        await wait_until(pilot, lambda: app.panes[0]._tokens > 5)

        def broken():
            raise SystemError("engine on fire")

        engine.pop_deltas = broken
        await wait_until(pilot, lambda: app.engine_dead is not None)
        await wait_until(pilot, lambda: all(p.state == "error" for p in app.panes))
        assert "engine on fire" in app.engine_dead
        kept = app.panes[0].conversation.messages[-1]
        assert kept.status == "error" and LONG.startswith(kept.content) and kept.content
        assert all("engine stopped" in p.title_text for p in app.panes)
        await type_and_send(pilot, 1, "anyone?")  # refused, the text stays in the box
        await pilot.pause(0.05)
        assert app.panes[1].input.text == "anyone?"


async def test_model_output_is_plain_text_without_control_sequences(tmp_path):
    evil = "\x1b[2J\x1b]0;pwned\x07[bold red]not markup[/] \x1b[31mred\x1b[0m done"
    app = make_app(tmp_path, ScriptedEngine(reply=evil, step_delay=0.001))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await type_and_send(pilot, 0, "[b]user text[/b]")
        await wait_idle(pilot)
        pane = app.panes[0]
        assert pane.conversation.messages[-1].content == "[bold red]not markup[/] red done"
        assert "\x1b" not in replies(pane)[0].markdown_source
        assert "[b]user text[/b]" in "\n".join(pane.transcript.text_lines())


FROZEN = EngineStats(
    block_size=256, num_blocks=2047, num_used_blocks=612, num_running=3, num_waiting=1,
    num_preemptions=2, prefix_cache_hit_rate=0.375, prompt_tokens_per_s=512.3,
    generation_tokens_per_s=87.1, num_prompt_tokens=12345, num_generated_tokens=6789,
    num_steps=4321, last_step_time_s=0.0123, last_batch_size=4,
)


async def test_stats_panel_shows_exactly_what_stats_gives(tmp_path):
    engine = ScriptedEngine()
    engine.stats = lambda: FROZEN
    app = make_app(tmp_path, engine, stats_interval=3600)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        panel = app.chat.stats_panel
        await wait_until(pilot, lambda: panel.lines)
        assert panel.lines == [
            "KV cache [██████░░░░░░░░░░░░░░] 612/2,047 blocks 29.9%   "
            "Running 3 reqs  Waiting 1 reqs  Preemptions 2",
            # One snapshot so far: the engine's own window rates.
            "Prompt throughput 512.3 tok/s (10 s avg 512.3)  "
            "Generation throughput 87.1 tok/s (10 s avg 87.1)",
            "Prefix cache hit rate 37.5%  Step 12.3 ms  Batch 4 seqs  Steps 4,321  "
            "Tokens 12,345 in / 6,789 out",
        ]
        rendered = str(panel.text.render())
        assert "612/2,047 blocks 29.9%" in rendered and "Preemptions 2" in rendered
        # Rates are computed from the counters: two snapshots a second apart.
        app.history = StatsHistory()
        t0 = time.monotonic()
        app.post_message(StatsSnapshot(FROZEN, t0))
        # (one at a time: a newer snapshot replaces a queued one, by design)
        await wait_until(pilot, lambda: len(app.history.samples) == 1)
        later = EngineStats(**{**FROZEN.__dict__, "num_prompt_tokens": 12345 + 400,
                               "num_generated_tokens": 6789 + 90})
        app.post_message(StatsSnapshot(later, t0 + 1.0))
        await wait_until(pilot, lambda: "400.0 tok/s" in panel.lines[1])
        assert panel.lines[1] == (
            "Prompt throughput 400.0 tok/s (10 s avg 400.0)  "
            "Generation throughput 90.0 tok/s (10 s avg 90.0)"
        )
        await wait_until(pilot, lambda: panel.spark.data[-1] == 90.0)  # redrawn within 1 s


@pytest.mark.parametrize("stage", ["loading weights", "sizing KV cache"])
async def test_loading_screen_then_chat(tmp_path, stage):
    import threading

    seen = threading.Event()

    def factory(on_progress):
        for i, name in enumerate(("loading weights", "sizing KV cache")):
            on_progress(name, (i + 1) / 3)
            if name == stage:
                seen.wait(30)  # the load goes on once the screen has shown this stage
        return ScriptedEngine(on_progress=on_progress)

    app = create_app(engine_factory=factory, model="fake/model", data_root=tmp_path / "d")
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.loading is not None
                         and stage in str(app.loading.stage.render()))
        seen.set()
        await wait_ready(pilot)
        assert app.info.model == "fake/scripted-model"


async def test_load_failure_is_shown_and_the_app_stays_up(tmp_path):
    def factory(on_progress):
        on_progress("loading weights", 0.3)
        raise FileNotFoundError("model_name_or_path='nope': no config.json in nope")

    app = create_app(engine_factory=factory, model="nope", data_root=tmp_path / "d")
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine_dead is not None)
        await wait_until(pilot, lambda: "no config.json" in str(app.loading.error.render()))
        assert app.is_running
        await pilot.press("ctrl+q")
    assert not app.is_running


def test_streamed_text_wraps_as_the_whole_text_does_and_keeps_every_character():
    """Wrapping a reply as it streams (only its last line again each time) gives the lines
    of wrapping the whole text at once, and drops nothing but spaces at line breaks."""
    import random

    from minivllm.tui.widgets.entries import GrowingText, wrap
    from rich.style import Style

    rng = random.Random(0)
    words = ["a", "lighthouse", "keeper", "\n", "\n\n", "supercalifragilisticexpialidocious",
             "-", " ", "**bold**", "  ", "日本語のテキスト", "é"]
    for width in (9, 23, 40):
        text, grown = "", GrowingText()
        for _ in range(300):
            piece = rng.choice(words) + rng.choice([" ", ""])
            text += piece
            grown.add(piece)
            got = [s.text for s in grown.lines(width, Style())]
            whole = GrowingText()
            whole.add(text)
            want = [s.text for s in whole.lines(width, Style())]
            assert got == want, (width, text)
        for paragraph in text.split("\n"):
            lines = wrap(paragraph, width - 2)
            assert "".join(line for _, line in lines).replace(" ", "") == \
                paragraph.replace(" ", "")
            assert all(paragraph[at:].startswith(line) for at, line in lines)


MARKDOWN_REPLY = (
    "# Plan\n\nFirst a paragraph\nwith a kept line break.\n\n- one\n- two\n\n- three, "
    "same list\n\n  its second paragraph\n\n```python\nx = 1\n\n\ny = 2\n```\n\n"
    "1. first\n\n2. second\n\n    indented code\n\n> a quote\n\n| a | b |\n|---|---|\n"
    "| 1 | 2 |\n\nThe **end**."
)


def test_markdown_blocks_cut_only_where_the_rest_cannot_change_them():
    from minivllm.tui.markdown import split_blocks

    blocks, rest = split_blocks(MARKDOWN_REPLY)
    assert rest == len(MARKDOWN_REPLY)
    assert blocks[:3] == ["# Plan", "First a paragraph\nwith a kept line break.",
                          "- one\n- two"]
    # An item's next paragraph, a fenced code block with blank lines in it, indented code
    # after a list item: each stays in one block with what it belongs to.
    assert "- three, same list\n\n  its second paragraph" in blocks
    assert "```python\nx = 1\n\n\ny = 2\n```" in blocks
    assert "2. second\n\n    indented code" in blocks
    assert blocks[-1] == "The **end**."
    assert "\n\n".join(blocks) == MARKDOWN_REPLY
    # While the text grows, a cut waits for the whole line after it: "  " may become an
    # indented line that continues the block.
    assert split_blocks("para\n\n  ", final=False) == ([], 0)
    assert split_blocks("para\n\nnext", final=False) == ([], 0)
    assert split_blocks("para\n\nnext\n", final=False) == (["para"], 6)
    assert split_blocks("```\na\n\nb\n", final=False) == ([], 0)  # an open fence
    # An indented line continues a list item or indented code, nothing else.
    assert split_blocks("para\n\n next") == (["para", " next"], 11)
    assert split_blocks("    a = 1\n\n    b = 2")[0] == ["    a = 1\n\n    b = 2"]
    assert split_blocks("<div>\n\n<p>x</p>")[0] == ["<div>\n\n<p>x</p>"]


def test_a_streamed_reply_ends_drawn_as_the_same_reply_loaded_from_a_session():
    """Markdown is drawn a block at a time while a reply streams: however the text came
    in, the finished reply's lines are those of the same text shown from a saved session,
    and while streaming every complete block is already Markdown."""
    import io
    import random

    from minivllm.tui.widgets.entries import Look, Reply
    from rich.console import Console
    from rich.style import Style

    console = Console(width=80, file=io.StringIO(), color_system="truecolor")
    look = Look(console, Style(), Style(), Style(), Style(), Style())
    want = [s.text for s in Reply(MARKDOWN_REPLY, status="done").lines(look, 36)]
    assert "# Plan" not in "".join(want) and "Plan" in want[0]  # a heading, drawn
    assert any(line.strip() == "2 second" for line in want)  # its own number
    rng = random.Random(1)
    for _ in range(5):
        reply, at = Reply(), 0
        while at < len(MARKDOWN_REPLY):
            step = rng.randint(1, 9)
            reply.append(MARKDOWN_REPLY[at:at + step])
            at += step
            streaming = [s.text for s in reply.lines(look, 36)]
        assert "# Plan" not in streaming[0]  # the heading block was drawn as it streamed
        reply.finish("done")
        assert [s.text for s in reply.lines(look, 36)] == want


_PLAIN_WORDS = st.text(alphabet=st.sampled_from(
    "abcdefghijklmnopqrstuvwxyzABCXYZ0123456789,.;:'\"?!()%$/@^{}-"), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_PLAIN_WORDS, min_size=1, max_size=30), min_size=1, max_size=3),
       st.sampled_from([9, 18, 23, 40, 77]))
def test_a_plain_paragraph_is_drawn_cell_for_cell_as_markdown_draws_it(lines, width):
    """A block drawn as plain text skips the Markdown pass: what it draws must be
    exactly what rich's Markdown draws (each cell's character and style)."""
    import io

    from minivllm.tui.widgets.entries import markdown, plain_lines, render_lines
    from rich.console import Console
    from rich.style import Style

    block = "\n".join(" ".join(words) for words in lines)
    plain = plain_lines(block, width)
    if plain is None:  # a line that reads as a list item, a word wider than a line
        return
    console = Console(width=80, file=io.StringIO(), color_system="truecolor")

    def cells(strips):
        return [[(char, segment.style or Style()) for segment in strip for char in segment.text]
                for strip in strips]

    assert cells(plain) == cells(render_lines(console, markdown(block), width))


@pytest.mark.parametrize("block", [
    "```python\nfor wave in sea:\n\tprint(wave)  # a tab\n```",
    "```\nno language\n```",
    "```no-such-language extra words\nplain text\n```",
    "    indented code\n    second line",
    "Some text:\n\n```rust\nfn main() {}\n```\n\nand more.",
])
def test_code_blocks_are_drawn_as_rich_draws_them(block):
    """The app's code blocks reuse one lexer per language: what they draw must be rich's
    own Markdown, cell for cell (and so is the highlighting)."""
    import io

    from minivllm.tui.markdown import keep_line_breaks
    from minivllm.tui.widgets.entries import markdown, render_lines
    from rich.console import Console
    from rich.markdown import Markdown

    console = Console(width=80, file=io.StringIO(), color_system="truecolor")
    stock = Markdown(block, hyperlinks=False)
    keep_line_breaks(stock.parsed)
    for width in (20, 60):
        ours = render_lines(console, markdown(block), width)
        theirs = render_lines(console, stock, width)
        assert [list(strip) for strip in ours] == [list(strip) for strip in theirs]


def test_only_text_that_markdown_leaves_alone_is_a_plain_paragraph():
    from minivllm.tui.markdown import is_plain_paragraph

    plain = ["Hello there, world!", "It's 42 (yes).\nNext line: done?", "e-mail me at a@b.c"]
    marked = ["- item", "+ item", "1. one", "10) x", "3.14 is pi", "a  b", " lead", "trail ",
              "**bold**", "a_b", "x = 1", "see [x](y)", "a|b", "~~s~~", "# h", "a & b",
              "a\\b", "`code`", "<b>", "> quote", "ok\n\nnext", "tab\there", "caf\u00e9"]
    assert all(is_plain_paragraph(text) for text in plain)
    assert not any(is_plain_paragraph(text) for text in marked)


def test_a_plain_paragraph_keeps_its_streamed_lines_when_it_completes():
    """Once a plain paragraph is complete its lines equal the streamed ones: the pane does
    not repaint them."""
    import io

    from minivllm.tui.widgets.entries import Look, Reply
    from rich.console import Console
    from rich.style import Style

    console = Console(width=80, file=io.StringIO(), color_system="truecolor")
    look = Look(console, Style(), Style(), Style(), Style(), Style())
    reply = Reply()
    reply.append("The keeper lit the lamp at dusk, as every night, and waited.\n\nThen")
    streamed = reply.lines(look, 24)
    reply.append(" the storm came.\n")  # the first paragraph is now a complete block
    now = reply.lines(look, 24)
    assert reply._blocks == ["The keeper lit the lamp at dusk, as every night, and waited."]
    count = len(streamed) - 2  # its lines, before the blank line and "Then"
    assert now[:count] == streamed[:count]


async def test_a_reply_ends_in_its_pane_without_waiting_for_a_frame(tmp_path, monkeypatch):
    """A stream is read once a frame, but its last output wakes it at once (`on_end`):
    with frames 5 s apart, a short reply's pane is idle long before the next frame."""
    import minivllm.tui.app as app_module

    monkeypatch.setattr(app_module, "FRAME_HZ", 0.2)
    app = make_app(tmp_path, ScriptedEngine(reply="one two three four five", step_delay=0.002))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        frames = app.streams.frames
        pane = app.panes[0]
        await app.send(pane, "hi")
        await wait_idle(pilot, timeout=4.0)
        assert app.streams.frames == frames  # no frame came between
        assert replies(pane)[-1].answer_text == "one two three four five"


async def test_a_reply_the_engine_stops_is_an_error_not_a_stop(tmp_path):
    # A server shutting down (or an engine closing) ends a reply with "abort" that nobody
    # in the app asked for: the pane says so instead of showing it as the user's stop.
    engine = HeldEngine(hold_at=3)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        pane = app.panes[0]
        await type_and_send(pilot, 0, "hello")
        await wait_until(pilot, lambda: pane.tokens >= 3)
        app.client.abort(str(pane.request_id))  # not Esc
        await wait_until(pilot, lambda: pane.state == "error")
        reply = pane.conversation.messages[-1]
        assert reply.status == "error" and "the engine stopped this reply" in reply.error
        assert reply.content  # the partial reply stays
        # Esc is still a stop.
        await type_and_send(pilot, 0, "again")
        await wait_until(pilot, lambda: pane.tokens >= 3)
        await app.action_stop()
        await wait_until(pilot, lambda: pane.state == "stopped")
        assert pane.conversation.messages[-1].status == "stopped"


async def test_a_long_streaming_reply_repaints_only_its_new_lines(tmp_path):
    # Lines a reply has finished are kept (the same strips) while it streams on, and the
    # view follows the end in jumps: the last line is always on screen.
    paragraphs = [f"Paragraph {i}: " + "word " * 40 for i in range(30)]
    long = "\n".join(paragraphs)
    engine = ScriptedEngine(reply=long, step_delay=0.001)
    app = make_app(tmp_path, engine, settings=Settings(max_tokens=4096))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        pane = app.panes[0]
        transcript = pane.transcript
        await type_and_send(pilot, 0, "go")
        await wait_until(pilot, lambda: transcript.line_count > 2 * transcript.view_height, 60)
        early = list(transcript._lines[:transcript.view_height])
        kept, seen_end = [], []
        while pane.busy and replies(pane)[0].streaming:
            lines, top = transcript._lines, transcript.scroll_y
            kept.append(all(a is b for a, b in zip(early, lines, strict=False)))
            seen_end.append(top <= len(lines) <= top + transcript.view_height)
            await pilot.pause(0.02)
        assert kept and all(kept) and all(seen_end)
        await wait_idle(pilot, 60)
        assert replies(pane)[0].markdown_source == long.strip()
        assert transcript.scroll_y == transcript.max_scroll_y  # the end, no blank lines


async def test_a_block_drawn_again_repaints_only_the_lines_that_look_different(tmp_path):
    """A reply's block drawn again once it completes (as Markdown where it streamed as
    plain text): the lines that look the same, in other segments or with no style
    against the null style, keep their strips and are not repainted; a heading that
    changed above them repaints its own row only."""
    from minivllm.tui.widgets.entries import Entry
    from rich.segment import Segment
    from rich.style import Style
    from textual.strip import Strip

    class Lines(Entry):
        def __init__(self, strips: list[Strip]) -> None:
            self.strips = strips

        def lines(self, look, width):
            return self.strips

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        transcript = app.panes[0].transcript
        width, null = transcript._width, Style()

        def line(text: str, style: Style | None = null, split: bool = False) -> Strip:
            pieces = [text[:3], text[3:]] if split else [text]
            return Strip([*(Segment(p, style) for p in pieces),
                          Segment(" " * (width - len(text)))], width)

        entry = Lines([line("## Plan"), line(""), line("first line"), line("second line")])
        transcript.add(entry)
        before = list(transcript._lines)
        painted: list[object] = []
        real = transcript.refresh

        def spy(*regions, **kwargs):
            painted.append([(r.y, r.height) for r in regions] or "all")
            return real(*regions, **kwargs)

        transcript.refresh = spy
        entry.strips = [line("Plan", Style(bold=True)), line(""),
                        line("first line", split=True), line("second line", None)]
        transcript.changed(entry)
        row = transcript._starts[-1] - transcript.scroll_y
        assert painted == [[(row, 1)]]
        assert transcript._lines[-3:] == before[-3:]
        assert all(a is b for a, b in zip(transcript._lines[-3:], before[-3:], strict=True))
        assert transcript._lines[-4].text.startswith("Plan")


def test_a_streamed_line_is_the_same_strip_before_and_after_its_last_space():
    """A wrapped line's trailing spaces are padding: the line does not change when the
    space after its last word arrives, nor when the next word wraps below it."""
    from minivllm.tui.widgets.entries import GrowingText
    from rich.style import Style

    grown = GrowingText()
    seen = []
    for piece in ["tower", " stone", " ", "lighthouse"]:
        grown.add(piece)
        seen.append(grown.lines(16, Style())[0])
    assert seen[1] == seen[2] == seen[3] and seen[3].text.startswith(" tower stone ")
    # Where trailing spaces show (a background), they stay in the line's own style.
    grown = GrowingText("tower stone lighthouse")
    shaded = Style(bgcolor="blue")
    assert any(seg.text == "tower stone " and seg.style == shaded
               for seg in grown.lines(16, shaded)[0])


async def test_resumed_and_reopened_panes_show_their_context(tmp_path):
    data = tmp_path / "data" / "sessions"
    data.mkdir(parents=True)
    lines = [
        {"type": "pane", "pane": 1, "settings": Settings().to_dict()},
        {"type": "user", "pane": 1, "text": "hello there"},
        {"type": "end", "pane": 1, "status": "done", "text": "general kenobi"},
    ]
    (data / "20240101-000000-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    app = make_app(tmp_path, resume=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        pane = app.panes[0]
        await wait_until(pilot, lambda: "ctx" in pane.title_text)
        assert pane.context_tokens > 0 and pane.max_len == 4096
        # After a reply the figure is the engine's own count: prompt + reply tokens.
        await type_and_send(pilot, 0, "again")
        await wait_idle(pilot)
        prompt, completion = pane.usage
        assert pane.context_tokens == prompt + completion


async def test_the_input_hint_names_the_keymap_s_send_key(tmp_path):
    app = make_app(tmp_path, keymap={"input.send": "ctrl+s"})
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert app.panes[0].input.placeholder == "Message (ctrl+s sends, ctrl+j newline)"
        await app.action_new_pane()
        await wait_until(pilot, lambda: len(app.panes) == 3)
        assert app.panes[-1].input.placeholder.startswith("Message (ctrl+s sends")


async def test_the_panel_says_when_the_server_stops_answering(tmp_path):
    app = make_app(tmp_path, stats_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        panel = app.chat.stats_panel
        await wait_until(pilot, lambda: panel.lines and "KV cache" in panel.lines[0])
        # What RemoteClient sets when the server's /metrics stops answering.
        app.client.disconnected = "http://127.0.0.1:1 does not answer: ConnectError"
        await wait_until(pilot, lambda: panel.lines[0].startswith("Disconnected: "))
        assert "disconnected" in str(panel.border_title)
        app.client.disconnected = None
        await type_and_send(pilot, 0, "hello")  # new figures come
        await wait_until(pilot, lambda: "KV cache" in panel.lines[0], 30)
        assert not panel.border_title
