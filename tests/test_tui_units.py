"""minivllm-chat pure parts: thinking parser, sanitizer, stats rates and formatting,
session file replay. No Textual app here."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from minivllm.tui.conversation import ChatMessage, Conversation, Settings
from minivllm.tui.sanitize import StreamCleaner, clean_text
from minivllm.tui.stats import (
    StatsHistory,
    cache_line,
    kv_line,
    pool_summary,
    queue_line,
    throughput_line,
)
from minivllm.tui.store import (
    SessionStore,
    describe_session,
    find_session,
    latest_session,
    list_sessions,
    load_session,
    new_session_path,
)
from minivllm.tui.thinking import ThinkParser, split_thinking

from minivllm.outputs import EngineStats

# -- thinking ------------------------------------------------------------------------------


def feed_all(chunks: list[str], in_think: bool = False) -> tuple[str, str, list]:
    p = ThinkParser(in_think)
    segs = []
    for c in chunks:
        segs += p.feed(c)
    segs += p.finish()
    think = "".join(t for k, t in segs if k == "think")
    answer = "".join(t for k, t in segs if k == "answer")
    return think, answer, segs


def test_think_tags_split_across_every_boundary():
    text = "<think>\nweigh it up\n</think>\n\nThe answer is 42."
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            think, answer, _ = feed_all([text[:i], text[i:j], text[j:]])
            assert think == "\nweigh it up\n"
            assert answer == "\n\nThe answer is 42."


def test_think_one_character_at_a_time():
    text = "  <think>a<b</thin</think>x</think>y"
    think, answer, segs = feed_all(list(text))
    assert think == "a<b</thin"
    assert answer == "x</think>y"  # after the block, tags are text
    assert [k for k, _ in ThinkParser().feed(text)] == ["think", "answer"]  # merged


def test_no_think_block_when_the_reply_does_not_open_with_it():
    think, answer, _ = feed_all(["Hello <think>", "not thinking</think>"])
    assert think == ""
    assert answer == "Hello <think>not thinking</think>"


def test_stream_ending_inside_a_partial_tag_keeps_the_text():
    assert split_thinking("<thi") == ("", "<thi")
    assert split_thinking("<think>abc</thi") == ("abc</thi", "")


def test_reply_starting_inside_thinking():
    assert split_thinking("reasoning</think>answer", in_think=True) == ("reasoning", "answer")


@given(st.text(alphabet="<>/thinkab \n", max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_think_parser_split_invariance(text: str, cuts: list[int]):
    """However the stream is cut, the result equals parsing it whole."""
    points = sorted({min(c, len(text)) for c in cuts})
    chunks, prev = [], 0
    for p in points:
        chunks.append(text[prev:p])
        prev = p
    chunks.append(text[prev:])
    think, answer, _ = feed_all(chunks)
    assert (think, answer) == split_thinking(text)


def test_history_leaves_thinking_out():
    conv = Conversation(1, Settings(system_prompt="be brief"))
    conv.messages = [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "<think>hmm</think>\n\nHello!"),
        ChatMessage("user", "again"),
        ChatMessage("assistant", "", status="error", error="boom"),
        ChatMessage("user", "third"),
    ]
    assert conv.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "third"},  # "again" failed: that turn is left out
    ]


# -- sanitizing ------------------------------------------------------------------------------


def test_clean_text_strips_terminal_control_sequences():
    evil = (
        "a\x1b[31mred\x1b[0m b\x1b]0;title\x07c \x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ "
        "\x1bPdcs\x1b\\d\x07\x08\x00\r\nnext\rline\x9b2Jz\tok"
    )
    out = clean_text(evil)
    assert out == "ared bc link d\nnextlinez\tok"
    assert not any(ord(ch) < 32 and ch not in "\n\t" for ch in out)
    assert clean_text("[bold]not markup[/bold] ünïcødé 日本 🙂") == (
        "[bold]not markup[/bold] ünïcødé 日本 🙂"
    )


def test_stream_cleaner_holds_sequences_split_across_chunks():
    evil = "a\x1b[2Jb\x1b]0;title\x07c\x1b[31mred\x1b[0m d\x1b"
    for i in range(len(evil) + 1):
        for j in range(i, len(evil) + 1):
            c = StreamCleaner()
            out = c.feed(evil[:i]) + c.feed(evil[i:j]) + c.feed(evil[j:]) + c.finish()
            assert out == "abcred d", (i, j)
    c = StreamCleaner()
    assert c.feed("x\x1bz") == "xz"  # not an open sequence: nothing held
    c.feed("\x1b]" + "y" * 300)  # an endless OSC is not held forever
    assert c.finish() == "" and c.feed("ok") == "ok"


# -- stats ---------------------------------------------------------------------------------


def make_stats(**kw) -> EngineStats:
    base = dict(
        block_size=256, num_blocks=2047, num_used_blocks=612, num_running=3, num_waiting=1,
        num_preemptions=0, prefix_cache_hit_rate=0.375, prompt_tokens_per_s=512.3,
        generation_tokens_per_s=87.1, num_prompt_tokens=0, num_generated_tokens=0,
        num_steps=10, last_step_time_s=0.0123, last_batch_size=4,
    )
    base.update(kw)
    return EngineStats(**base)


def test_stats_lines_use_vllm_words_and_exact_numbers():
    s = make_stats()
    assert kv_line(s, width=10) == "KV cache [███░░░░░░░] 612/2,047 blocks 29.9%"
    assert queue_line(s) == "Running 3 reqs  Waiting 1 reqs  Preemptions 0"
    assert cache_line(s).startswith("Prefix cache hit rate 37.5%  Step 12.3 ms  Batch 4 seqs")
    assert pool_summary(2048, 256, 4096) == (
        "2,048 blocks x 256 = 524,288 tokens, max concurrency 128.0x at 4,096 tokens"
    )


def test_rates_from_counters_1s_window_and_10s_average():
    h = StatsHistory()
    r = h.add(100.0, make_stats(num_prompt_tokens=0, num_generated_tokens=0))
    # One snapshot: nothing to difference, so the engine's own window rates.
    assert (r.prompt_1s, r.gen_1s) == (512.3, 87.1)
    for i in range(1, 11):  # one snapshot a second: 100 prompt and 20 generated tokens each
        r = h.add(100.0 + i, make_stats(num_prompt_tokens=100 * i, num_generated_tokens=20 * i))
    assert r.prompt_1s == 100.0 and r.gen_1s == 20.0
    assert r.prompt_10s == 100.0 and r.gen_10s == 20.0
    r = h.add(111.0, make_stats(num_prompt_tokens=1000, num_generated_tokens=300))
    assert r.prompt_1s == 0.0 and r.gen_1s == 100.0
    assert r.gen_10s == (300 - 20) / 10
    assert throughput_line(r) == (
        "Prompt throughput 0.0 tok/s (10 s avg 90.0)  "
        "Generation throughput 100.0 tok/s (10 s avg 28.0)"
    )
    assert h.spark_data()[-1] == 100.0


def test_sparkline_keeps_the_last_minute():
    h = StatsHistory()
    for i in range(0, 200):
        h.add(float(i), make_stats(num_generated_tokens=i))
    assert len(h.spark_data()) == 61  # t in [139, 199]


# -- session file --------------------------------------------------------------------------


def test_session_replay_statuses_regenerate_clear_close(tmp_path):
    store = SessionStore(new_session_path(tmp_path))
    store.session("m")
    store.pane(1, Settings(temperature=0.0))
    store.pane(2, Settings())
    store.pane(3, Settings())
    store.user(1, "q1")
    store.chunk(1, "par")
    store.flush_partial()
    store.end(1, "done", "partial answer")
    store.user(1, "q2")
    store.end(1, "stopped", "half")
    store.regenerate(1)
    store.end(1, "done", "again")
    store.user(2, "lost")
    store.clear(2)
    store.user(2, "kept")
    store.chunk(2, "stream")
    store.flush_partial()
    store.user(3, "closing")
    store.close_pane(3)
    store.close()
    loaded = load_session(latest_session(tmp_path))
    assert [c.key for c in loaded.conversations] == [1, 2]
    c1, c2 = loaded.conversations
    assert c1.settings.temperature == 0.0
    assert [(m.role, m.content, m.status) for m in c1.messages] == [
        ("user", "q1", "done"), ("assistant", "partial answer", "done"),
        ("user", "q2", "done"), ("assistant", "again", "done"),
    ]
    assert [(m.role, m.content, m.status) for m in c2.messages] == [
        ("user", "kept", "done"), ("assistant", "stream", "interrupted"),
    ]
    assert loaded.interrupted == [2]


def test_replies_ending_together_wait_for_one_disk_sync_but_reach_the_file_at_once(
        tmp_path, monkeypatch):
    syncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd)))
    path = new_session_path(tmp_path)
    store = SessionStore(path)
    for key in (1, 2, 3):
        store.pane(key, Settings())
        store.user(key, f"question {key}")  # what the user typed: on the disk at once
    typed = len(syncs)
    for key in (1, 2, 3):
        store.chunk(key, "streamed")
        store.end(key, "done", f"answer {key}")
    assert len(syncs) == typed  # three replies ended: no sync on the UI thread yet
    # ... yet in the file already (a crash or a kill of the app keeps them).
    assert [m.content for c in load_session(path).conversations for m in c.messages] == [
        "question 1", "answer 1", "question 2", "answer 2", "question 3", "answer 3"]
    store.flush_partial()  # the app's tick, every second: one sync for all three
    assert len(syncs) == typed + 1
    store.flush_partial()  # nothing new: no sync
    assert len(syncs) == typed + 1
    store.close()


def test_torn_last_line_is_skipped_and_appending_starts_a_fresh_line(tmp_path):
    path = new_session_path(tmp_path)
    store = SessionStore(path)
    store.pane(1, Settings())
    store.user(1, "hello")
    store.close()
    with open(path, "a") as f:
        f.write('{"type": "chunk", "pane": 1, "te')  # killed mid-write
    loaded = load_session(path)
    assert loaded.skipped_lines == 1
    assert [m.content for m in loaded.conversations[0].messages] == ["hello", ""]
    assert loaded.conversations[0].messages[-1].status == "interrupted"
    store = SessionStore(path)  # resuming appends after the torn line, on a new line
    store.user(1, "after")
    store.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["text"] == "after"
    messages = load_session(path).conversations[0].messages
    assert [m.content for m in messages] == ["hello", "after", ""]  # no reply yet: interrupted


def test_session_files_are_private(tmp_path):
    path = new_session_path(tmp_path)
    store = SessionStore(path)
    store.user(1, "hi")
    store.close()
    assert path.stat().st_mode & 0o077 == 0
    assert path.parent.stat().st_mode & 0o077 == 0


def test_session_file_is_created_at_the_first_message(tmp_path):
    """A start that never chats leaves no file; --resume then takes the
    newest session with messages."""
    older = SessionStore(new_session_path(tmp_path).with_name("20240101-000000-1.jsonl"))
    older.session("m")
    older.pane(1, Settings())
    older.user(1, "the real conversation")
    older.close()
    empty = SessionStore(new_session_path(tmp_path))
    empty.session("m")
    empty.pane(1, Settings())
    empty.close()
    assert not empty.path.exists() and not empty.created
    assert latest_session(tmp_path) == older.path
    lines = [json.loads(x) for x in older.path.read_text().splitlines()]
    assert [r["type"] for r in lines] == ["session", "pane", "user"]  # held, then written


def test_sessions_listing_and_resume_by_id(tmp_path):
    for i, first in enumerate(["  Hello   there,\nhow are you?", "second " * 30]):
        store = SessionStore(tmp_path / "sessions" / f"2024010{i + 1}-000000-{i}.jsonl")
        store.session("m")
        for key in (1, 2):
            store.pane(key, Settings())
        store.user(1, first)
        store.end(1, "done", "reply")
        store.close()
    sessions = list_sessions(tmp_path)
    assert [s.id for s in sessions] == ["20240102-000000-1", "20240101-000000-0"]
    line = describe_session(sessions[1])
    assert line.startswith("20240101-000000-0  ")
    assert "2 panes  2 msgs  Hello there, how are you?" in line
    assert describe_session(sessions[0]).endswith("…")
    assert find_session("20240101", tmp_path).stem == "20240101-000000-0"
    with pytest.raises(ValueError, match="--resume 2024: matches 2 sessions"):
        find_session("2024", tmp_path)
    with pytest.raises(ValueError, match="--resume nope: no such session"):
        find_session("nope", tmp_path)


def test_records_with_bad_values_are_skipped_with_a_count(tmp_path):
    """Valid JSON, bad values: skipped, the rest loads."""
    path = tmp_path / "s.jsonl"
    recs = [
        {"type": "pane", "pane": 1, "settings": Settings(temperature=0.0).to_dict()},
        {"type": "pane", "pane": 1, "settings": None},
        {"type": "pane", "pane": 1, "settings": {"temperature": "hot"}},
        {"type": "pane", "pane": 1, "settings": {"top_p": 7}},
        {"type": "user", "pane": 1, "text": "kept"},
        {"type": "user", "pane": "one", "text": "bad pane"},
        {"type": "user", "pane": 1, "text": ["not", "text"]},
        {"type": "end", "pane": 1, "status": "exploded", "text": "x"},
        {"type": "end", "pane": 1, "status": "done", "text": "answer"},
        {"type": "mystery", "pane": 1},
        ["not", "an", "object"],
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + "{torn")
    loaded = load_session(path)
    assert (loaded.skipped_lines, loaded.bad_records) == (1, 8)
    conv = loaded.conversations[0]
    assert conv.settings.temperature == 0.0
    assert [(m.content, m.status) for m in conv.messages] == [("kept", "done"),
                                                             ("answer", "done")]
    assert loaded.notice() == ("s.jsonl: skipped 1 unreadable line(s) and 8 record(s) "
                               "with bad values")


def test_unwritable_data_dir_keeps_going_in_memory(tmp_path):
    """The store never raises; it reports once and stops writing. (The
    data dir is under a file: unwritable even for root, who ignores permissions.)"""
    errors = []
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    store = SessionStore(new_session_path(blocker), on_error=errors.append)
    store.pane(1, Settings())
    store.user(1, "hi")  # the first message tries to create the file
    store.chunk(1, "text")
    store.flush_partial()
    store.end(1, "done", "text")
    store.close()
    assert len(errors) == 1 and "Not a directory" in errors[0]
    assert store.error == errors[0]


def test_full_disk_mid_session_keeps_going(tmp_path):
    errors = []
    store = SessionStore(tmp_path / "s.jsonl", on_error=errors.append)
    store.user(1, "hi")

    class Full:
        def write(self, _):
            raise OSError(27, "File too large", str(store.path))

        def flush(self):
            raise OSError(27, "File too large", str(store.path))

        def close(self):
            pass

    store._file = Full()
    store.chunk(1, "streamed")
    store.flush_partial()
    store.end(1, "done", "streamed")
    store.user(1, "again")
    store.close()
    assert errors == [f"File too large ({store.path})"]


def test_context_cut_leaves_out_whole_turns_never_the_system_prompt():
    conv = Conversation(1, Settings(system_prompt="sys"))
    for i in range(3):
        conv.messages += [ChatMessage("user", f"q{i}"), ChatMessage("assistant", f"a{i}")]
    conv.messages.append(ChatMessage("user", "now"))
    assert conv.next_turn_start() == 2
    conv.dropped = conv.next_turn_start()
    assert [m["content"] for m in conv.template_messages()] == ["sys", "q1", "a1", "q2", "a2",
                                                               "now"]
    conv.dropped = 6
    assert conv.next_turn_start() is None  # the newest message is always sent
    assert [m["content"] for m in conv.template_messages()] == ["sys", "now"]


def test_export_markdown():
    conv = Conversation(1, Settings(system_prompt="sys"))
    conv.messages = [ChatMessage("user", "hi"),
                     ChatMessage("assistant", "<think>plan</think>Hello", status="stopped")]
    md = conv.to_markdown("T")
    assert md.startswith("# T\n")
    assert "## System\n\nsys" in md and "## User\n\nhi" in md
    assert "> plan" in md and "Hello" in md and "_[stopped]_" in md


def test_pane_title_condenses_to_fit_keeping_state_and_context():
    from minivllm.tui.widgets.pane import _k, fit_title

    assert [_k(n) for n in (950, 3120, 8192, 9999, 32768, 131072)] == [
        "950", "3.1k", "8.2k", "10k", "33k", "131k"]
    forms = ["#1 idle · ctx 3,120 / 8,192 tok", "#1 idle 3.1k/8.2k"]
    assert fit_title(forms, 0) == forms[0]  # not laid out yet
    assert fit_title(forms, 40) == forms[0]
    assert fit_title(forms, 22) == forms[1]
    assert fit_title(forms, 5) == forms[1]  # nothing fits: the shortest


def test_a_bad_keymap_is_refused_in_plain_mode_too(tmp_path, capsys):
    from minivllm.tui.cli import main

    bad = tmp_path / "keymap.json"
    bad.write_text('{"chat.no_such_binding": "f5"}')
    assert main(["--plain", "--keymap", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"keymap {bad}: unknown binding id(s) chat.no_such_binding" in err[0]


def test_a_pipe_says_the_plain_mode_runs_instead_of_the_app(tmp_path, capsys, monkeypatch):
    import minivllm.tui.plain as plain
    from minivllm.tui.cli import main

    ran = []
    monkeypatch.setattr(plain, "run_plain", lambda **kw: ran.append(kw) or 0)
    # (pytest's stdin is not a terminal)
    assert main(["--fake"]) == 0 and ran
    assert ("stdin or stdout is not a terminal: the plain line mode (--plain) runs instead"
            in capsys.readouterr().err)
    assert main(["--plain", "--fake"]) == 0
    assert "not a terminal" not in capsys.readouterr().err


def test_plain_mode_says_it_could_not_connect_to_a_server():
    import io

    from minivllm.tui.plain import run_plain
    from minivllm.tui.remote import RemoteClient

    from minivllm.server.launch import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    err = io.StringIO()
    code = run_plain(engine_factory=lambda on_progress: RemoteClient(url, connect_timeout=2),
                     stdin=io.StringIO("hi\n"), stdout=io.StringIO(), stderr=err,
                     interactive=False, save=False)
    assert code == 1
    assert f"minivllm-chat: error: could not connect to the server: cannot reach {url}" in (
        err.getvalue())


def test_a_server_s_stats_show_no_step_figures_it_does_not_report():
    from minivllm.tui.remote import parse_metrics
    from minivllm.tui.stats import cache_line
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from minivllm.outputs import EngineStats

    registry = CollectorRegistry()  # what a server's /metrics has: no step figures
    Gauge("minivllm:num_requests_running", "", registry=registry).set(1)
    Gauge("minivllm:num_requests_waiting", "", registry=registry).set(0)
    Counter("minivllm:prompt_tokens", "", registry=registry).inc(12)
    Counter("minivllm:generation_tokens", "", registry=registry).inc(5)
    stats, _ = parse_metrics(generate_latest(registry).decode())
    assert "Step" not in cache_line(stats) and "Tokens 12 in / 5 out" in cache_line(stats)
    local = EngineStats(block_size=16, num_blocks=8, num_used_blocks=1, num_running=1,
                        num_waiting=0, num_preemptions=0, prefix_cache_hit_rate=0.0,
                        prompt_tokens_per_s=0.0, generation_tokens_per_s=0.0,
                        num_prompt_tokens=12, num_generated_tokens=5, num_steps=3,
                        last_step_time_s=0.002, last_batch_size=1)
    assert "Step 2.0 ms  Batch 1 seqs  Steps 3" in cache_line(local)
