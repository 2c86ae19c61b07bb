"""`minivllm-chat --plain` with stdin not a terminal: prompts line by line, replies
printed, /stats, /system, /reset; also through a real pipe into the console script."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from minivllm.tui.plain import run_plain
from minivllm.tui.store import latest_session, load_session

from minivllm.server.standin import ScriptedEngine


def test_plain_mode_from_a_fake_stdin(tmp_path):
    engine = ScriptedEngine(reply=["First reply.", "Second \x1b[31mreply\x1b[0m."],
                            step_delay=0.001)
    out, err = io.StringIO(), io.StringIO()
    stdin = io.StringIO("hello\n/stats\n\n/system Be brief.\ntwo \\\nlines\n/reset\n/stats\n")
    code = run_plain(engine=engine, stdin=stdin, stdout=out, stderr=err, interactive=False,
                     data_root=tmp_path)
    assert code == 0
    text = out.getvalue()
    assert text.startswith("First reply.\n\n")
    assert "Second reply.\n\n" in text  # control sequences stripped
    assert "KV cache [" in text and "Running 0 reqs  Waiting 0 reqs" in text
    assert "Generation throughput" in text and "Prefix cache hit rate" in text
    assert "(system prompt set)" in text and "(conversation reset)" in text
    assert "minivllm · fake/scripted-model" in err.getvalue()
    conv = load_session(latest_session(tmp_path)).conversations[0]
    assert conv.messages == []  # /reset is recorded too
    assert conv.settings.system_prompt == "Be brief."


def test_plain_mode_through_a_pipe(tmp_path):
    env = {**os.environ, "MINIVLLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "minivllm.tui.cli", "--fake", "--plain"],
        input="what is up\n/stats\n", capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "You said: what is up" in proc.stdout
    assert "KV cache [" in proc.stdout
    assert "loading weights" in proc.stderr


def test_plain_mode_ctrl_c_stops_the_reply_and_keeps_going(tmp_path):
    import signal

    env = {**os.environ, "MINIVLLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "minivllm.tui.cli", "--fake", "--plain"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
        # An ignored SIGINT is inherited: the Ctrl-C below must reach the child whatever
        # an earlier test's library left the test process ignoring.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        proc.stdin.write("first\n")
        proc.stdin.flush()
        assert proc.stdout.read(7) == "<think>"  # streaming has begun
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("second\n")
        proc.stdin.close()
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    first, _, second = rest.partition("[stopped]")
    assert "You said: second" in second
    conv = load_session(latest_session(tmp_path)).conversations[0]
    assert [m.status for m in conv.messages] == ["done", "stopped", "done", "done"]


def test_plain_mode_takes_every_slash_command_of_the_shared_table(tmp_path):
    from minivllm.tui.commands import SLASH_COMMANDS

    engine = ScriptedEngine(reply="ok", step_delay=0.001)
    lines = ["/help", "/rep 1.3", "/rep", "/rep often", "/all to everyone", "/sytem x",
             "/no_think hi", "/all", "/quit", "never read"]
    out, err = io.StringIO(), io.StringIO()
    code = run_plain(engine=engine, stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out,
                     stderr=err, interactive=False, data_root=tmp_path)
    assert code == 0
    text = out.getvalue()
    for command in SLASH_COMMANDS:  # /help lists the table
        assert command.usage in text and command.help in text
    assert "(repetition penalty set to 1.3)" in text and "(repetition penalty: 1.3)" in text
    assert "(not set: repetition_penalty='often': not a number)" in text
    assert "(unknown command /sytem (/help lists the commands))" in text
    assert "(/all needs TEXT: /all TEXT)" in text
    assert "(thinking off)" in text
    conv = load_session(latest_session(tmp_path)).conversations[0]
    # /all sends to the one conversation; /no_think sends the rest; /quit ends the input.
    assert [m.content for m in conv.messages] == ["to everyone", "ok", "hi", "ok"]
    assert conv.settings.repetition_penalty == 1.3 and not conv.settings.thinking
