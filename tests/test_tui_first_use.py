"""minivllm-chat: what a new user tripped on, against the scripted fake engine.

Closing asks first and can be undone; sessions are created at the first message; long
conversations drop their oldest turns; load failures are one line and exit 1; storage
faults keep the app running; ctrl+c stops; 80x24 adapts; unknown commands and keymaps
are reported; copy, PgUp/PgDn, export path, theme across --resume; the engine CLI is free
of the app.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from minivllm.tui.app import create_app
from minivllm.tui.cli import load_keymap
from minivllm.tui.cli import main as chat_main
from minivllm.tui.conversation import Settings
from minivllm.tui.store import latest_session, load_session, session_files
from minivllm.tui.testing import type_and_send, wait_idle, wait_ready, wait_until
from scripted import HeldEngine

from minivllm.server.standin import ScriptedEngine

SIZE = (160, 48)
LONG = " ".join(f"w{i}" for i in range(300))


def make_app(tmp_path: Path, engine: ScriptedEngine | None = None, **kw):
    kw.setdefault("data_root", tmp_path / "data")
    app = create_app(engine or ScriptedEngine(step_delay=0.002), **kw)
    app.seen = []  # every notification, also those whose toast has timed out
    notify = app.notify

    def recording(message, *args, **kwargs):
        app.seen.append(str(message))
        return notify(message, *args, **kwargs)

    app.notify = recording
    return app


def notices(app) -> list[str]:
    return app.seen


@pytest.fixture
def started(tmp_path):
    """`async with started(engine, **options) as (app, pilot)`: the app on the scripted
    engine (data under tmp_path), its chat screen up and the first input focused."""

    @asynccontextmanager
    async def start(engine: ScriptedEngine | None = None, size=SIZE, **kw):
        app = make_app(tmp_path, engine, **kw)
        async with app.run_test(size=size) as pilot:
            await wait_ready(pilot)
            yield app, pilot

    return start


# -- Ctrl+w asks; ctrl+o reopens -------------------------------------------------------------


async def test_close_asks_when_the_pane_holds_a_conversation_and_reopen_brings_it_back(
    started, tmp_path
):
    engine = ScriptedEngine(reply="kept reply", step_delay=0.001)
    async with started(engine, conversations=3) as (app, pilot):
        await type_and_send(pilot, 0, "remember me")
        await wait_idle(pilot)
        app.panes[1].input.text = "a draft"
        app.panes[0].input.focus()
        await pilot.pause()
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: app.screen.id == "confirm")
        await pilot.press("n")  # keep
        await wait_until(pilot, lambda: app.screen is app.chat)
        assert len(app.panes) == 3
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: app.screen.id == "confirm")
        await pilot.press("enter")  # Enter presses the focused button: Keep
        await wait_until(pilot, lambda: app.screen is app.chat)
        assert len(app.panes) == 3
        app.panes[1].input.focus()  # a draft counts too
        await pilot.pause()
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: app.screen.id == "confirm")
        await pilot.press("y")
        await wait_until(pilot, lambda: len(app.panes) == 2)
        app.panes[1].input.focus()  # empty: closes without asking
        await pilot.pause()
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: len(app.panes) == 1)
        app.panes[0].input.focus()
        await pilot.pause()
        await pilot.press("ctrl+w")  # the last pane stays
        await pilot.pause(0.05)
        assert len(app.panes) == 1
        await pilot.press("ctrl+o")  # reopens the newest closed one: the empty pane 3
        await wait_until(pilot, lambda: len(app.panes) == 2)
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: len(app.panes) == 3)
        reopened = app.panes[2]
        assert reopened.conversation.key == 2 and reopened.input.text == "a draft"
        assert app.focused is reopened.input
        await pilot.press("ctrl+q")
    # The reopen is in the session file: --resume has the pane.
    keys = sorted(c.key for c in load_session(latest_session(tmp_path / "data")).conversations)
    assert keys == [1, 2, 3]


async def test_closing_a_streaming_pane_keeps_its_reply_for_reopen(started):
    engine = HeldEngine(reply=LONG, hold_at=20)  # streams 20 tokens, then holds
    async with started(engine) as (app, pilot):
        await type_and_send(pilot, 0, "long one")
        await wait_until(pilot, lambda: app.panes[0].tokens == 20)
        app.panes[0].input.focus()
        await pilot.pause()
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: app.screen.id == "confirm")
        assert "streaming" in str(app.screen.query_one("#confirm-question").render())
        await pilot.press("y")
        await wait_until(pilot, lambda: len(app.panes) == 1)
        assert engine.scheduler.is_finished()  # closing aborted the request
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: len(app.panes) == 2)
        reply = app.panes[1].conversation.messages[-1]
        assert reply.status == "stopped"
        assert reply.content == engine.tokenizer.decode(engine.tokenizer.encode(LONG)[:20])


# -- Session file at the first message ---------------------------------------------------------


async def test_a_run_without_messages_leaves_no_session_and_resume_skips_it(started, tmp_path):
    async with started() as (app, pilot):
        await type_and_send(pilot, 0, "the one that counts")
        await wait_idle(pilot)
        await pilot.press("ctrl+q")
    first = session_files(tmp_path / "data")
    assert len(first) == 1
    async with started() as (app, pilot):
        await pilot.press("ctrl+q")
    assert session_files(tmp_path / "data") == first  # nothing new on disk
    async with started(resume=True) as (app, pilot):
        assert app.panes[0].conversation.messages[0].content == "the one that counts"


def test_sessions_lists_and_resume_id_is_checked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIVLLM_DATA_DIR", str(tmp_path))
    assert chat_main(["--sessions"]) == 0
    assert "no saved sessions" in capsys.readouterr().out
    folder = tmp_path / "sessions"
    folder.mkdir()
    (folder / "20240102-030405-7.jsonl").write_text(
        json.dumps({"type": "user", "pane": 1, "text": "What is a KV cache?"}) + "\n")
    assert chat_main(["--sessions"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("20240102-030405-7  ") and "What is a KV cache?" in out
    assert chat_main(["--fake", "--plain", "--resume", "nope"]) == 1
    assert capsys.readouterr().err == (
        f"minivllm-chat: error: --resume nope: no such session in {folder} "
        "(--sessions lists them)\n")


# -- Context use and dropping the oldest turns -----------------------------------------------


async def test_a_long_conversation_drops_its_oldest_turns_with_a_marker(started, tmp_path):
    engine = ScriptedEngine({"max_model_length": 160}, reply="short reply here", step_delay=0.001)
    settings = Settings(system_prompt="Be kind.", max_tokens=16)
    async with started(engine, settings=settings) as (app, pilot):
        pane = app.panes[0]
        for i in range(12):
            await type_and_send(pilot, 0, f"question number {i} with several words in it")
            await wait_idle(pilot)
            assert pane.conversation.messages[-1].status == "done", pane.conversation.messages
        conv = pane.conversation
        assert conv.dropped > 0 and conv.dropped % 2 == 0  # whole turns
        sent = conv.template_messages()
        assert sent[0] == {"role": "system", "content": "Be kind."}
        assert sent[-1]["content"] == "short reply here"
        assert app.count_prompt_tokens(conv) + 16 <= 160
        [marker] = [e for e in pane.transcript.entries if e.kind == "cut"]
        assert f"{conv.dropped} earlier messages left out" in marker.text
        assert "(160 tokens)" in marker.text
        assert any("earlier messages left out" in line for line in pane.transcript.text_lines())
        assert "ctx " in pane.title_text and " / 160 tok" in pane.title_text
        await pilot.press("ctrl+q")
    # --resume shows the cut where it was.
    loaded = load_session(latest_session(tmp_path / "data"))
    assert loaded.conversations[0].dropped == conv.dropped


async def test_the_context_figure_fits_three_pane_titles_at_80_columns(started):
    engine = ScriptedEngine({"max_model_length": 8192}, reply="a reply", step_delay=0.001)
    async with started(engine, size=(80, 24), conversations=3) as (app, pilot):
        await type_and_send(pilot, 0, "a question " * 150)
        await wait_idle(pilot)
        pane = app.panes[0]
        width = pane.title_bar.content_region.width
        assert 0 < width < 30
        await wait_until(pilot, lambda: pane.title_text.endswith("/8.2k"))
        assert pane.title_text.startswith("#1 idle ") and len(pane.title_text) <= width
        assert pane.context_tokens > 300
        await pilot.resize_terminal(160, 48)  # room again: the full title
        await wait_until(pilot, lambda: "ctx " in pane.title_text)
        assert pane.title_text.endswith(f"ctx {pane.context_tokens:,} / 8,192 tok")


# -- Load failures ------------------------------------------------------------------------------


@pytest.mark.parametrize("args, expected", [
    (["--model", "/nonexistent"],
     "--model='/nonexistent': no such folder or file: /nonexistent"),
    (["-tp", "0"], "--tensor-parallel-size=0: must be an int >= 1"),
    (["--max-model-len", "999999999"],
     "--max-model-len=999999999 is above the model's max_position=8192"),
    (["--device", "cuda"], "--device='cuda': no CUDA GPU is available here"),
    (["--conversations", "0"], "--conversations=0: must be >= 1"),
    (["--temperature", "-1"], "--temperature=-1.0: must be a finite number >= 0"),
])
def test_load_failures_are_one_line_and_exit_1(args, expected, capsys, smollm2_path):
    """Checked before the screen opens (the app and --plain share this path)."""
    import torch

    if args[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code = chat_main(args)
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"minivllm-chat: error: {expected}")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_minivllm_generate_load_failures_are_one_line_and_exit_1(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "minivllm.cli", "generate", "--model", "/nonexistent",
         "--prompt", "hi"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr == ("minivllm: error: --model='/nonexistent': no such folder or file: "
                           "/nonexistent\n")


async def test_a_failure_while_loading_exits_1_with_one_line(tmp_path):
    def factory(on_progress):
        raise ValueError("KV cache too small for max_model_length=8192: 1.00 GiB needed")

    app = create_app(engine_factory=factory, model="m", data_root=tmp_path / "d")
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.load_error is not None)
        await pilot.press("ctrl+q")
    assert app.return_code == 1
    assert app.load_error == ("ValueError: KV cache too small for max_model_length=8192: "
                              "1.00 GiB needed")
    assert not session_files(tmp_path / "d")


# -- Storage faults -------------------------------------------------------------------------------


async def test_unwritable_data_dir_warns_keeps_chatting_and_export_still_works(
    started, tmp_path, monkeypatch
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.chdir(tmp_path)
    engine = ScriptedEngine(reply="still here", step_delay=0.001)
    async with started(engine, data_root=blocker / "data") as (app, pilot):
        await type_and_send(pilot, 0, "hello")
        await wait_idle(pilot)
        await type_and_send(pilot, 0, "again")
        await wait_idle(pilot)
        assert app.storage_error and "Not a directory" in app.storage_error
        assert sum("not being saved" in n for n in notices(app)) == 1
        assert [m.content for m in app.panes[0].conversation.messages] == [
            "hello", "still here", "again", "still here"]
        app.action_export()  # the data dir is out: the current directory instead
        assert app.last_export.parent == tmp_path
        assert "## User\n\nagain" in app.last_export.read_text()
        assert any(str(app.last_export) in n for n in notices(app))


# -- Bad records on --resume -----------------------------------------------------------------------


async def test_resume_skips_bad_records_with_a_notice(started, tmp_path):
    folder = tmp_path / "data" / "sessions"
    folder.mkdir(parents=True)
    recs = [{"type": "pane", "pane": 1, "settings": None},
            {"type": "pane", "pane": 1, "settings": {"temperature": "hot"}},
            {"type": "user", "pane": 1, "text": "survivor"},
            {"type": "end", "pane": 1, "status": "done", "text": "ok"}]
    (folder / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    async with started(resume=True) as (app, pilot):
        assert [m.content for m in app.panes[0].conversation.messages] == ["survivor", "ok"]
        assert app.panes[0].conversation.settings == Settings()
        assert "s.jsonl: skipped 2 record(s) with bad values" in notices(app)


# -- Ctrl+c stops the focused reply ---------------------------------------------------------------


async def test_ctrl_c_stops_the_focused_reply_and_never_quits(started):
    engine = HeldEngine(reply=LONG, hold_at=20)  # both replies hold, streaming, at 20 tokens
    async with started(engine) as (app, pilot):
        await type_and_send(pilot, 0, "go")
        await type_and_send(pilot, 1, "go too")
        await wait_until(pilot, lambda: all(p.tokens == 20 for p in app.panes))
        app.panes[0].input.focus()
        await pilot.pause()
        await pilot.press("ctrl+c")
        await wait_until(pilot, lambda: app.panes[0].state == "stopped")
        assert app.panes[1].state == "streaming"  # only the focused pane stops
        await pilot.press("ctrl+c")  # nothing to stop now: says how to quit
        await wait_until(pilot, lambda: any("ctrl+q quits" in n for n in notices(app)))
        assert app.is_running and app.panes[1].state == "streaming"
        msg = app.panes[0].conversation.messages[-1]
        assert msg.status == "stopped" and msg.content and LONG.startswith(msg.content)
        engine.release()  # the other reply runs to its end
        await wait_idle(pilot)
        assert app.panes[1].conversation.messages[-1].content == LONG


def test_plain_mode_turns_echo_off_while_a_reply_streams():
    import os
    import pty
    import termios

    from minivllm.tui.plain import no_echo

    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "r", closefd=False) as tty:
            before = termios.tcgetattr(slave)[3]
            assert before & termios.ECHO
            with no_echo(tty):
                during = termios.tcgetattr(slave)[3]
                assert not during & termios.ECHO and not during & termios.ECHOCTL
                # A typed-ahead Enter reaches the next prompt as Enter ("send"), not as
                # a line feed (ctrl+j, "newline").
                assert not termios.tcgetattr(slave)[0] & termios.ICRNL
            assert termios.tcgetattr(slave)[3] == before
        with no_echo(None):  # a pipe: nothing to do
            pass
    finally:
        os.close(master)
        os.close(slave)


# -- 80x24 -----------------------------------------------------------------------------------------


async def test_80x24_condenses_stats_shows_quit_and_the_settings_modal_scrolls(started):
    async with started(ScriptedEngine(step_delay=0.001), size=(80, 24)) as (app, pilot):
        panel = app.chat.stats_panel
        await wait_until(pilot, lambda: panel.lines)
        assert panel.compact and len(panel.lines) == 2
        assert all(len(line) <= 76 for line in panel.lines)
        text = "\n".join(panel.lines)
        for word in ("KV [", "Run ", "Wait ", "Preempt ", "Hit ", "Gen ", "Prompt "):
            assert word in text
        footer = app.screen.query_one("Footer")
        await wait_until(pilot, lambda: footer.query("FooterKey"))  # composed after a refresh
        shown = [k.key_display for k in footer.query("FooterKey") if k.region.right <= 80]
        assert "^q" in shown
        await pilot.press("f2")
        await wait_until(pilot, lambda: app.screen.id == "settings")
        box = app.screen.query_one("#settings-box")
        assert box.region.height <= 24 and box.max_scroll_y > 0  # it scrolls
        field = app.screen.query_one("#temperature")
        field.focus()
        field.value = "0.25"
        await pilot.press("enter")  # Enter in a field saves
        await wait_until(pilot, lambda: app.screen is app.chat)
        assert app.panes[0].conversation.settings.temperature == 0.25
    async with started(ScriptedEngine(step_delay=0.001)) as (app, pilot):
        await wait_until(pilot, lambda: app.chat.stats_panel.lines)
        assert not app.chat.stats_panel.compact and len(app.chat.stats_panel.lines) == 3


# -- Unknown commands, /think without a thinking mode, keymaps -----------------------------


async def test_unknown_slash_command_is_reported_not_sent(started):
    engine = ScriptedEngine(reply="r", step_delay=0.001)
    async with started(engine) as (app, pilot):
        await type_and_send(pilot, 0, "/sytem be brief")
        await wait_until(pilot, lambda: any("unknown command /sytem" in n for n in notices(app)))
        pane = app.panes[0]
        assert pane.conversation.messages == [] and pane.input.text == "/sytem be brief"
        await type_and_send(pilot, 0, "/usr/bin/env is a path, not a command")
        await wait_idle(pilot)
        assert pane.conversation.messages[0].content.startswith("/usr/bin/env")


async def test_the_app_takes_every_slash_command_of_the_shared_table(started):
    from minivllm.tui.commands import SLASH_COMMANDS

    engine = ScriptedEngine(reply="r", step_delay=0.001)
    async with started(engine) as (app, pilot):
        pane = app.panes[0]
        await type_and_send(pilot, 0, "/help")
        await wait_until(pilot, lambda: any("/exit" in n for n in notices(app)))
        (help_text,) = [n for n in notices(app) if "/exit" in n]
        assert all(c.usage in help_text and c.help in help_text for c in SLASH_COMMANDS)
        await type_and_send(pilot, 0, "/rep 1.25")
        await wait_until(pilot, lambda: pane.conversation.settings.repetition_penalty == 1.25)
        await type_and_send(pilot, 0, "/rep -1")
        await wait_until(pilot, lambda: any("not set: " in n for n in notices(app)))
        assert pane.conversation.settings.repetition_penalty == 1.25
        await type_and_send(pilot, 0, "/all")  # needs TEXT: kept in the input
        await wait_until(pilot, lambda: any("/all needs TEXT" in n for n in notices(app)))
        assert pane.input.text == "/all"
        pane.input.text = ""
        await type_and_send(pilot, 0, "/stats")
        await wait_until(pilot, lambda: any("stats are in the panel" in n for n in notices(app)))
        await type_and_send(pilot, 0, "hello")
        await wait_idle(pilot)
        await type_and_send(pilot, 0, "/reset")  # /clear's other name, as in plain mode
        await wait_until(pilot, lambda: pane.conversation.messages == [])
        await type_and_send(pilot, 0, "/exit")
        await wait_until(pilot, lambda: not app.is_running)


async def test_think_on_a_model_without_thinking_says_so(started):
    engine = ScriptedEngine(step_delay=0.001)
    engine.tokenizer.chat_template = "{{ messages }}"  # no enable_thinking switch
    async with started(engine) as (app, pilot):
        await type_and_send(pilot, 0, "/no_think")
        await wait_until(pilot, lambda: any("has no thinking mode" in n for n in notices(app)))
        assert app.panes[0].conversation.settings.thinking  # unchanged


def test_keymap_errors_name_the_file(tmp_path):
    from minivllm.tui.app import binding_ids

    known = binding_ids()
    assert {"chat.close_pane", "chat.reopen_pane", "chat.interrupt", "input.send",
            "app.quit"} <= known
    bad_id = tmp_path / "k1.json"
    bad_id.write_text('{"chat.nwe_pane": "f5"}')
    with pytest.raises(ValueError, match=rf"keymap {bad_id}: unknown binding id\(s\) "
                       r"chat.nwe_pane; known: "):
        load_keymap(bad_id, known)
    bad_json = tmp_path / "k2.json"
    bad_json.write_text("{nope")
    with pytest.raises(ValueError, match=rf"keymap {bad_json}: not valid JSON"):
        load_keymap(bad_json, known)
    with pytest.raises(ValueError, match=r"--keymap .*missing.json: No such file"):
        load_keymap(tmp_path / "missing.json", known)
    good = tmp_path / "k3.json"
    good.write_text('{"chat.new_pane": "f5"}')
    assert load_keymap(good, known) == {"chat.new_pane": "f5"}


# -- Copy, PgUp/PgDn, export path, theme across --resume ---------------------------------------


async def test_copy_reply_page_keys_export_path_and_theme_kept(started, tmp_path):
    reply = "<think>\nhmm\n</think>\n\n" + "\n\n".join(f"paragraph {i}" for i in range(60))
    async with started(ScriptedEngine(reply=reply, step_delay=0.0005)) as (app, pilot):
        await type_and_send(pilot, 0, "long answer please")
        await wait_idle(pilot)
        await pilot.press("alt+c")
        await wait_until(pilot, lambda: app.clipboard)
        assert app.clipboard.startswith("paragraph 0") and "hmm" not in app.clipboard
        transcript = app.panes[0].transcript
        await wait_until(pilot, lambda: transcript.max_scroll_y > 0)
        bottom = transcript.scroll_y
        assert bottom == transcript.max_scroll_y
        await pilot.press("pageup")
        await wait_until(pilot, lambda: transcript.scroll_y < bottom)
        await pilot.press("pagedown")
        await wait_until(pilot, lambda: transcript.scroll_y == bottom)
        assert app.focused is app.panes[0].input  # typing goes on
        app.action_export()
        assert app.last_export.parent == tmp_path / "data" / "exports"
        assert any(str(app.last_export) in n for n in notices(app))
        app.theme = "nord"
        await pilot.pause()
        await pilot.press("ctrl+q")
    async with started(resume=True) as (app, pilot):
        assert app.theme == "nord"
        assert [m.content for m in app.panes[0].conversation.messages][0] == "long answer please"


# -- speed: streaming text is plain until the reply ends --------------------------------------


async def test_streaming_reply_is_plain_text_then_markdown_once(started):
    engine = ScriptedEngine(reply="**bold** " + LONG, step_delay=0.003)
    async with started(engine) as (app, pilot):
        await type_and_send(pilot, 0, "go")
        pane = app.panes[0]
        await wait_until(pilot, lambda: pane.tokens > 10)
        [msg] = pane.transcript.replies
        await wait_until(pilot, lambda: "**bold**" in "".join(pane.transcript.text_lines()))
        assert msg.markdown_source is None  # plain text while it streams
        await wait_idle(pilot)
        assert msg.markdown_source.startswith("**bold**")
        shown = "".join(pane.transcript.text_lines())
        assert "bold" in shown and "**bold**" not in shown  # rendered as Markdown


# -- The engine CLI is free of the app ------------------------------------------------------------


def test_engine_cli_does_not_import_the_app():
    code = ("import sys, minivllm.cli, minivllm.bench.workloads\n"
            "bad = [m for m in sys.modules if m.startswith(('minivllm.tui', 'textual'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd="/")
    proc = subprocess.run([sys.executable, "-m", "minivllm.tui.cli", "--bench", "--help"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "minivllm-chat --bench" in proc.stdout
