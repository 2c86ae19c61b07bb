"""minivllm-chat's speed work (GPU): the engine in a child process
(`minivllm.frontend.EngineProcessClient` with what the app adds: its tokenizer, prefill
progress, a log file; built from `tui/engine_spec.py`), the GIL switch
interval while an in-process engine runs, deferred growth of streaming blocks, and the
bench's GPU-like stand-in and its tokenizer for a model without one. No timings are
asserted: speed is measured by `minivllm-chat --bench` (PERF.md)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time

import pytest
from minivllm.tui.app import SWITCH_INTERVAL, create_app
from minivllm.tui.cli import use_engine_process
from minivllm.tui.engine_spec import EngineSpec, engine_process_client
from minivllm.tui.testing import type_and_send, wait_idle, wait_ready, wait_until
from scripted import HeldEngine

from minivllm.frontend import GenerateRequest
from minivllm.sampling_params import SamplingParams
from minivllm.server.standin import (
    ScriptedEngine,
    WordTokenizer,
    gpu_like_engine,
    gpu_like_reply,
)

SIZE = (160, 48)


class Collector:
    """Outputs per request, from any thread; `wait(rid)` until its last one."""

    def __init__(self) -> None:
        self.outputs: dict[str, list] = {}
        self.done: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def callback(self, rid: str):
        self.outputs[rid] = []
        self.done[rid] = threading.Event()

        def on_output(out) -> None:
            with self.lock:
                self.outputs[rid].append(out)
            if out.finished:
                self.done[rid].set()

        return on_output

    def wait(self, rid: str, timeout: float = 60.0) -> list:
        assert self.done[rid].wait(timeout), f"{rid} did not finish"
        return self.outputs[rid]


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_logs():
    """The engine processes of these tests log to one file named after this process."""
    yield
    log = os.path.join(tempfile.gettempdir(), f"minivllm-chat-engine-{os.getpid()}.log")
    if os.path.exists(log):
        os.remove(log)


@pytest.fixture(scope="module")
def process_client():
    """One engine process (the scripted engine) shared by this module's tests."""
    client = engine_process_client(EngineSpec("fake", {}, {
        "reply": "one two three four five six", "step_delay": 0.002}))
    progress = []
    client.start(lambda stage, fraction: progress.append((stage, fraction)))
    client.progress = progress
    yield client
    client.close()


def test_engine_process_streams_requests_like_the_in_process_front_end(process_client):
    client = process_client
    assert client.info.model == "fake/scripted-model"
    assert client.progress and client.progress[-1][1] == 1.0  # loading screen fed
    # The child's tokenizer came across: the app counts prompt tokens with it.
    assert client.tokenizer.decode(client.tokenizer.encode("hello world")) == "hello world"
    got = Collector()
    params = SamplingParams(temperature=0.0, max_tokens=64)
    for rid in ("a", "b"):
        client.add_request(GenerateRequest(rid, params, messages=[
            {"role": "user", "content": f"hi {rid}"}]), got.callback(rid))
    for rid in ("a", "b"):
        outs = got.wait(rid)
        assert outs[0].accepted and not outs[0].token_ids
        assert "".join(o.text for o in outs) == "one two three four five six"
        assert outs[-1].finish_reason == "stop"
        assert sum(len(o.token_ids) for o in outs) == outs[-1].num_generated_tokens
        assert all(o.at > 0 for o in outs)
    assert client.stats() is not None


def test_engine_process_refuses_bad_input_and_aborts(process_client):
    client = process_client
    got = Collector()
    bad = GenerateRequest("bad", SamplingParams(), prompt="")
    client.add_request(bad, got.callback("bad"))
    (out,) = got.wait("bad")
    assert out.rejected and "prompt" in out.error
    long = GenerateRequest("long", SamplingParams(max_tokens=10_000), prompt="x")
    client.add_request(long, got.callback("long"))
    client.abort("long")
    outs = got.wait("long")
    assert outs[-1].finish_reason in ("abort", "stop")


def test_engine_process_death_fails_live_requests_with_a_reason():
    client = engine_process_client(EngineSpec("fake", {}, {"reply": "x " * 500,
                                                           "step_delay": 0.05}))
    client.start()
    try:
        got = Collector()
        client.add_request(GenerateRequest("r", SamplingParams(max_tokens=1000), prompt="hi"),
                           got.callback("r"))
        deadline = time.monotonic() + 30
        while not any(o.token_ids for o in got.outputs["r"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(client.pid, signal.SIGKILL)
        outs = got.wait("r")
        assert outs[-1].finish_reason == "error" and "engine process exited" in outs[-1].error
        assert client.error is not None
        late = Collector()
        client.add_request(GenerateRequest("late", SamplingParams(), prompt="hi"),
                           late.callback("late"))
        assert late.wait("late")[0].rejected
    finally:
        client.close()


def test_engine_process_reports_prefill_progress():
    """A pane's title shows a long prompt's prefill progress: the child sends it with its
    stats (here a scripted engine that holds every request before its first token)."""
    client = engine_process_client(EngineSpec(HeldEngine, {}, {"hold_at": 0}))
    client.start()
    try:
        got = Collector()
        client.add_request(GenerateRequest("p", SamplingParams(), prompt="a long prompt"),
                           got.callback("p"))
        deadline = time.monotonic() + 30
        while client.prompt_progress("p") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        done, total = client.prompt_progress("p")
        assert done == 0 and total > 0
        client.abort("p")
        assert got.wait("p")[-1].finish_reason == "abort"
        assert client.prompt_progress("unknown") is None
    finally:
        client.close()


def test_engine_process_load_failure_raises_the_childs_error():
    client = engine_process_client(EngineSpec("llm", {
        "model_name_or_path": "/nonexistent/model", "device": "cpu"}))
    with pytest.raises((ValueError, FileNotFoundError, RuntimeError), match="nonexistent"):
        client.start()
    client.close()


def test_engine_spec_names_a_bad_kind():
    with pytest.raises(ValueError, match="kind='gpu'"):
        EngineSpec("gpu")


def test_engine_process_choice():
    def args(choice, device="cpu", fake=False, url=None):
        return argparse.Namespace(engine_process=choice, device=device, fake=fake, url=url)

    assert use_engine_process(args("on"))
    assert not use_engine_process(args("off", "cuda"))
    assert use_engine_process(args("auto", "cuda"))
    assert use_engine_process(args("auto", "cpu"))
    assert not use_engine_process(args("auto", "cuda", fake=True))
    assert not use_engine_process(args("on", url="http://x"))  # a server is its own process
    from minivllm.tui.cli import build_parser

    assert build_parser().parse_args([]).engine_process == "auto"


async def test_app_chats_through_an_engine_process(tmp_path):
    client = engine_process_client(EngineSpec("fake", {}, {
        "reply": "**hi** from a child process"}))
    app = create_app(engine_factory=lambda on_progress: client, model="fake",
                     data_root=tmp_path / "d")
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, 180)  # the child imports torch: slow on a busy machine
        await type_and_send(pilot, 0, "hello")
        await wait_until(pilot, lambda: app.panes[0].tokens > 0)
        await wait_idle(pilot)
        [reply] = app.panes[0].transcript.replies
        assert reply.markdown_source == "**hi** from a child process"
        assert app.count_prompt_tokens(app.panes[0].conversation) > 0  # its tokenizer
        await pilot.press("ctrl+q")
    assert client._process.poll() is not None  # the app's close stopped the child


async def test_switch_interval_is_short_while_the_app_runs_and_restored_after():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        app = create_app(ScriptedEngine(), save_sessions=False)
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)
            await pilot.press("ctrl+q")
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


def test_gpu_like_engine_makes_markdown_prose_at_its_timing():
    engine = gpu_like_engine(host_ms=0.0, device_ms=0.0)
    assert isinstance(engine.tokenizer, WordTokenizer)
    reply = gpu_like_reply(3)
    assert "```python" in reply and "\n- **" in reply and reply.startswith("## ")
    ids = engine.tokenizer.encode(reply)
    assert engine.tokenizer.decode(ids) == reply and len(reply) / len(ids) > 3
    engine.pop_deltas()  # streaming on: finished requests wait to be reported
    seq = engine.add_prompt("hi", SamplingParams(max_tokens=5))
    steps = 0
    while not engine.scheduler.is_finished():
        engine.step()
        steps += 1
    (delta,) = [d for d in engine.pop_deltas() if d.seq_id == seq]
    assert steps == 5 and len(delta.token_ids) == 5
    with pytest.raises(ValueError, match="host_ms=-1"):
        gpu_like_engine(host_ms=-1)


@pytest.mark.slow
def test_bench_runs_on_the_gpu_like_stand_in_both_ways(capsys):
    """`minivllm-chat --bench --engine gpu-like --engine-process both`: headless, app and
    app-with-engine-process rounds, and their ratios."""
    from minivllm.bench.chat_app import main as bench_main

    assert bench_main(["--engine", "gpu-like", "--panes", "2", "--max-tokens", "24",
                       "--rounds", "1", "--engine-process", "both"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert sum(line.strip().startswith("headless:") for line in lines) == 2  # 1 app round
    assert sum(line.strip().startswith("app (engine process):") for line in lines) == 1
    assert "app / headless:" in out and "[engine process]" in out
    assert "engine side" in out and "UI thread CPU" in out


def test_bench_rejects_bad_counts(capsys):
    from minivllm.bench.chat_app import main as bench_main

    assert bench_main(["--engine", "gpu-like", "--panes", "0"]) == 1
    assert "--panes=0" in capsys.readouterr().out




def test_bench_round_that_hangs_fails_with_the_stacks(capsys):
    """A round past --round-timeout ends the bench (status 1) saying so, instead of
    hanging a GPU job until its wall-clock limit."""
    from minivllm.bench.chat_app import main as bench_main

    assert bench_main(["--engine", "gpu-like", "--panes", "1", "--max-tokens", "5000",
                       "--device-ms", "5", "--round-timeout", "0.05"]) == 1
    assert "did not finish within" in capsys.readouterr().out


def test_bench_tokenizer_keeps_ids_in_the_vocabulary_and_decodes_every_id():
    """The GPU bench runs a dummy model without tokenizer files through the app."""
    from minivllm.tui.engine_client import render_prompt

    from minivllm.bench.bench_tokenizer import BenchTokenizer

    tok = BenchTokenizer(vocab_size=1000)
    text = render_prompt(tok, [{"role": "user", "content": "Write a story, please!"}], None)
    ids = tok.encode(text)
    assert ids and all(0 <= i < 1000 for i in ids)
    assert tok.decode(list(range(1000)))  # any id the model may sample has text
    assert tok.decode(tok.encode(" the keeper.")) == " the keeper."


def test_bench_prepares_a_model_without_a_tokenizer_in_its_engine_process(tiny_llama):
    """`minivllm-chat --bench --load-format dummy` (the GPU run): the engine process builds
    a model without tokenizer files, and the bench's spec prepares it with `BenchTokenizer`,
    whose text the app then renders."""
    from minivllm.bench.bench_tokenizer import BenchTokenizer
    from minivllm.bench.chat_app import build_parser, engine_spec

    args = build_parser().parse_args([
        "--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32",
        "--cpu-weight-dtype", "float32", "--max-model-len", "256", "--load-format", "dummy"])
    client = engine_process_client(engine_spec(args))
    client.start()
    try:
        assert isinstance(client.tokenizer, BenchTokenizer)
        got = Collector()
        client.add_request(GenerateRequest("b", SamplingParams(max_tokens=4), prompt="hi there"),
                           got.callback("b"))
        outs = got.wait("b")
        assert outs[-1].finish_reason == "length" and "".join(o.text for o in outs)
    finally:
        client.close()


def test_bench_lends_the_engine_process_as_a_client_on_every_python():
    """The bench lends its started engine process to each app round through a wrapper;
    Python >= 3.12 checks protocol members statically (no `__getattr__`), so the wrapper
    must define every `EngineClient` member itself or the app takes it for an engine."""
    import inspect

    from minivllm.bench.chat_app import _Borrowed
    from minivllm.frontend import EngineClient

    members = [n for n in vars(EngineClient) if not n.startswith("_")]
    assert {"start", "add_request", "info"} <= set(members)
    missing = [n for n in members if not hasattr(inspect.getattr_static(_Borrowed, n, None),
                                                 "__get__")]
    assert missing == []
