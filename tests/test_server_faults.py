"""The server under bad input and faults: refused templates, oversized bodies and prompts,
fields that change the output, a taken port, and the engine process dying.

Real `minivllm serve` processes: SmolLM2 on the CPU (fields that change the output), and
the stand-in engine on SmolLM2's folder (real scheduler and tokenizer, no weights) where
only the plumbing matters. The oversized-prompt test runs the app in this process (on a
real socket) so that it can count what reached the tokenizer and the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import stop_process, wait_for

from minivllm.frontend.engine_process import EngineProcessClient
from minivllm.frontend.outputs import stream_outputs
from minivllm.server import cli
from minivllm.server.api import DEFAULT_MAX_REQUEST_BYTES, build_app
from minivllm.server.launch import descendants, launch_server

pytestmark = pytest.mark.slow

MAX_LEN = 512
SMOL = "smol"
# The stand-in engine: ~20 ms a step, so a 400-token stream lasts seconds.
STAND_IN = ["--stand-in-ms", "0.1", "20", "--max-model-len", str(MAX_LEN),
            "--max-num-seqs", "8", "--served-model-name", SMOL]
REAL = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "2048",
        "--block-size", "16", "--num-gpu-blocks-override", "256", "--served-model-name", SMOL]


@contextlib.contextmanager
def serve(tmp: Path, model: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    log = tmp / f"server-{time.monotonic_ns()}.log"
    proc, url = launch_server([str(model), *flags], log, cwd=tmp, timeout=600)
    try:
        yield proc, url, log
    finally:
        stop_process(proc)


def post(url: str, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=timeout)


def error_of(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        prefix = line.split(":", 1)[0]
        if prefix in ("vllm", "minivllm") and "{" in line:
            out.setdefault(line[len(prefix) + 1:line.index("{")],
                           float(line.rsplit(" ", 1)[1]))
    return out


class Stream:
    """One streamed request read on a thread: every SSE event, with its arrival time."""

    def __init__(self, url: str, path: str, body: dict[str, Any]) -> None:
        self.events: list[tuple[float, str]] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(url, path, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, path: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True},
                              timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[6:]))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def payloads(self) -> list[dict[str, Any]]:
        return [json.loads(e) for _, e in self.events if e != "[DONE]"]

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for p in self.payloads() for c in p.get("choices", [])
                if c.get("finish_reason")]

    def join(self, timeout: float = 60) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"


LONG_STREAM = {"model": SMOL, "prompt": "Count with me:", "max_tokens": 400,
               "ignore_eos": True}


# -- a real SmolLM2 server: fields that change the output, plain-words 400s ------------------


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_path):
    with serve(tmp_path_factory.mktemp("smol"), smollm2_path, *REAL) as (proc, url, log):
        yield url, log


def complete(url: str, **fields: Any) -> dict[str, Any]:
    body = {"model": SMOL, "prompt": "The colors are red, blue, red, blue, red, blue,",
            "max_tokens": 24, "temperature": 0, **fields}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def say_yes(url: str, **fields: Any) -> dict[str, Any]:
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Answer with one word: "
                                         "is the sky blue?"}],
            "max_tokens": 40, "temperature": 0, **fields}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 1.8), ("presence_penalty", 2.0), ("frequency_penalty", 2.0)])
def test_penalties_change_the_greedy_text(smol, field, value):
    url, _ = smol
    plain = complete(url)["choices"][0]["text"]
    assert complete(url, **{field: value})["choices"][0]["text"] != plain


def test_min_tokens_holds_the_end_back_and_ignore_eos_runs_to_max_tokens(smol):
    url, _ = smol
    short = say_yes(url)
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 20
    held = say_yes(url, min_tokens=20)
    assert held["usage"]["completion_tokens"] >= 20
    full = say_yes(url, ignore_eos=True)
    assert full["usage"]["completion_tokens"] == 40
    assert full["choices"][0]["finish_reason"] == "length"


def test_seed_makes_sampling_repeatable(smol):
    url, _ = smol
    texts = [complete(url, temperature=1.0, seed=s)["choices"][0]["text"] for s in (7, 7, 8)]
    assert texts[0] == texts[1] != texts[2]


def test_stop_token_ids_end_the_completion_at_that_token(smol, smollm2_path):
    from transformers import AutoTokenizer

    url, _ = smol
    text = complete(url)["choices"][0]["text"]
    ids = AutoTokenizer.from_pretrained(str(smollm2_path)).encode(text)
    stopped = complete(url, stop_token_ids=[ids[5]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] <= 6 < len(ids)


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "logit_bias", {"1000": 50}),
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "n", 0),
    ("/v1/chat/completions", "top_logprobs", 3),
])
def test_fields_the_engine_cannot_honour_are_refused_by_name(smol, path, field, value):
    url, _ = smol
    body: dict[str, Any] = {"model": SMOL, field: value, "max_tokens": 4}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == field and field in error_of(r)["message"]


def test_response_format_text_and_unknown_fields_are_served_with_one_warning(smol):
    url, log = smol
    out = say_yes(url, response_format={"type": "text"}, frobnicate_level=3)
    assert out["choices"][0]["message"]["content"]
    lines = [line for line in log.read_text().splitlines() if "frobnicate_level" in line]
    assert len(lines) == 1 and "ignored" in lines[0]


def test_max_tokens_beyond_the_context_is_refused_in_vllms_words(smol):
    url, _ = smol
    r = post(url, "/v1/chat/completions", {
        "model": SMOL, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1_000_000_000})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
    message = error_of(r)["message"]
    assert message.startswith("This model's maximum context length is 2048 tokens. However, "
                              "you requested 10000000")
    assert "in the messages, 1000000000 in the completion" in message
    long = post(url, "/v1/completions", {"model": SMOL, "prompt": [100] * 3000})
    assert long.status_code == 400 and error_of(long)["param"] == "prompt"
    assert "2048" in error_of(long)["message"] and "3000" in error_of(long)["message"]


@pytest.mark.parametrize("body,param,words", [
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize",
     "set by the server"),
    ({"stop": 5}, "stop", "valid string"),
    ({"messages": None}, "messages", "valid list"),
    ({"model": None}, "model", "valid string"),
])
def test_400s_name_the_field_in_plain_words(smol, body, param, words):
    url, _ = smol
    full = {"model": SMOL, "messages": [{"role": "user", "content": "hi"}], **body}
    r = post(url, "/v1/chat/completions", full)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and words in err["message"]
    for internal in ("got multiple values", "TextEncodeInput", ".str", "None:"):
        assert internal not in err["message"]


def test_a_body_that_is_not_an_object_or_missing_says_so(smol):
    url, _ = smol
    for content in (b"[]", b""):
        r = httpx.post(f"{url}/v1/chat/completions", content=content,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400
        assert "None" not in error_of(r)["message"]
    missing = post(url, "/v1/chat/completions", {"model": SMOL})
    assert error_of(missing)["message"] == "messages: this field is required"


# -- the chat template: a request's own refused unless trusted ------------------------------


def test_a_request_chat_template_is_refused(smol):
    url, _ = smol
    messages = [{"role": "user", "content": "hello world"}]
    for body in ({"chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}},
                 {"chat_template": "{{ messages[0].content }}"}):
        r = post(url, "/v1/chat/completions", {"model": SMOL, "messages": messages, **body})
        assert r.status_code == 400
        err = error_of(r)
        assert err["param"] in ("chat_template_kwargs.chat_template", "chat_template")
        assert "--trust-request-chat-template" in err["message"]
    assert say_yes(url)["usage"]["prompt_tokens"] > 10  # and it keeps serving


@pytest.fixture(scope="module")
def trusting(tmp_path_factory, smollm2_path):
    """A stand-in server that trusts request templates and restarts a dead engine."""
    with serve(tmp_path_factory.mktemp("trusting"), smollm2_path, *STAND_IN,
               "--trust-request-chat-template", "--restart-engine") as (proc, url, log):
        yield proc, url


def test_a_trusted_server_applies_the_request_chat_template(trusting):
    _, url = trusting
    messages = [{"role": "user", "content": "hello world"}]
    body = {"model": SMOL, "messages": messages, "max_tokens": 2}
    default = post(url, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
    own = post(url, "/v1/chat/completions", {
        **body, "chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}})
    assert own.status_code == 200, own.text
    assert own.json()["usage"]["prompt_tokens"] == 2 < default  # "hello world" alone


# -- engine death ----------------------------------------------------------------------------


def engine_pid(server: subprocess.Popen) -> int:
    (pid,) = wait_for(lambda: descendants(server.pid), 30, "the engine process")
    return pid


def reaped(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state not in ("Z", "X")


def test_engine_death_ends_every_request_and_the_server_exits_non_zero(tmp_path,
                                                                       smollm2_path):
    with serve(tmp_path, smollm2_path, *STAND_IN) as (proc, url, log):
        streams = [Stream(url, "/v1/completions", LONG_STREAM) for _ in range(2)]
        streams += [Stream(url, "/v1/chat/completions", {
            "model": SMOL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400, "ignore_eos": True}) for _ in range(2)]
        plain: list[httpx.Response] = []
        plains = [threading.Thread(target=lambda: plain.append(
            post(url, "/v1/completions", LONG_STREAM | {"stream": False})), daemon=True)
            for _ in range(2)]
        for t in plains:
            t.start()
        wait_for(lambda: all(len(s.events) >= 3 for s in streams), 60, "streams under way")
        wait_for(lambda: metrics(url).get("num_requests_running") == 6, 60, "6 running")
        os.kill(engine_pid(proc), signal.SIGKILL)
        for s in streams:
            s.join()
            assert s.status == 200 and s.error is None
            assert s.finish_reasons() == ["error"]
            assert any("error" in p for p in s.payloads())
        for t in plains:
            t.join(60)
        assert sorted(r.status_code for r in plain) == [503, 503]
        assert proc.wait(10) == 1  # a supervisor restarts it
    assert "exiting, the engine stopped" in log.read_text()


def test_restart_engine_serves_the_next_request_after_a_death(trusting):
    proc, url = trusting
    stream = Stream(url, "/v1/completions", LONG_STREAM)
    wait_for(lambda: len(stream.events) >= 3, 60, "a stream under way")
    old = engine_pid(proc)
    os.kill(old, signal.SIGKILL)
    stream.join()
    assert stream.finish_reasons() == ["error"]
    # While the new engine starts: 503, nothing counted as running, new requests refused
    # with an error status (not a 200 that ends without one).
    wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, 10,
             "/health 503")
    assert metrics(url)["num_requests_running"] == 0
    late = Stream(url, "/v1/completions", LONG_STREAM)
    late.join()
    assert late.status == 503
    wait_for(lambda: reaped(old), 10, "the dead engine reaped")
    wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, 120,
             "a new engine")
    r = post(url, "/v1/completions", {"model": SMOL, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert proc.poll() is None


# -- a taken port ----------------------------------------------------------------------------


def test_a_taken_port_fails_at_once_without_loading_the_model(monkeypatch, capsys):
    loads: list[Any] = []
    monkeypatch.setattr(cli, "build_engine", lambda *a, **k: loads.append(a))
    monkeypatch.setattr(EngineProcessClient, "start", lambda *a, **k: loads.append(a))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        for mode in ("--engine-process", "--no-engine-process"):
            assert cli.main(["--port", port, mode]) == 1
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err
    assert loads == []


def test_a_taken_port_ends_serve_with_one_line(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        done = subprocess.run(
            [sys.executable, "-c", "from minivllm.cli import main; main()", "serve",
             "--port", port], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"minivllm serve: cannot listen on 127.0.0.1:{port}: Address already in use"]


# -- an oversized prompt while another client streams ---------------------------------------


class CountingTokenizer:
    """The real tokenizer, counting the calls that tokenize or render a template."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.calls = 0

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._tokenizer.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class CountingClient:
    """An engine client whose `add_request` (the way into the engine) is counted."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.tokenizer = CountingTokenizer(client.tokenizer)
        self.added = 0

    def add_request(self, request: Any, on_output: Any) -> None:
        self.added += 1
        self._client.add_request(request, on_output)

    def generate(self, request: Any) -> Any:
        return stream_outputs(self, request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.fixture()
def counted_server(smollm2_path):
    import uvicorn

    args = argparse.Namespace(model=str(smollm2_path), stand_in_ms=[0.1, 20.0],
                              max_model_length=MAX_LEN, max_num_sequences=4)
    engine = EngineProcessClient(functools.partial(cli.build_engine, args))
    engine.start()
    client = CountingClient(engine)
    app = build_app(client, model_name=SMOL)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the in-process server")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", client
    finally:
        server.should_exit = True
        thread.join(30)
        engine.close()
        sock.close()


def test_a_huge_prompt_is_refused_before_the_tokenizer_and_the_engine(counted_server):
    url, client = counted_server
    stream = Stream(url, "/v1/completions", LONG_STREAM)
    wait_for(lambda: len(stream.events) >= 3, 60, "a stream under way")
    tokenized, added = client.tokenizer.calls, client.added
    huge = "word " * 2_000_000  # 10 MB
    began = time.monotonic()
    too_big = post(url, "/v1/completions", {"model": SMOL, "prompt": huge}, timeout=60)
    refused_at = time.monotonic()
    assert too_big.status_code == 413 and "--max-request-bytes" in error_of(too_big)["message"]
    # Under the body limit but far over the context: refused by its length alone.
    long = post(url, "/v1/chat/completions", {
        "model": SMOL, "messages": [{"role": "user", "content": huge[:7_000_000]}]}, timeout=60)
    assert long.status_code == 400 and error_of(long)["param"] == "messages"
    assert "7,000,000 characters" in error_of(long)["message"]
    assert f"maximum context length is {MAX_LEN} tokens" in error_of(long)["message"]
    # A body without Content-Length is counted as it arrives.
    chunked = httpx.post(f"{url}/v1/completions", timeout=60,
                         content=iter([b"x" * 1024 * 1024] * 9))
    assert chunked.status_code == 413
    assert (client.tokenizer.calls, client.added) == (tokenized, added)
    wait_for(lambda: stream.events[-1][0] > refused_at, 30, "the stream after the refusal")
    times = [began, *(t for t, _ in stream.events if began <= t <= refused_at), refused_at]
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    print(f"\n10 MB prompt refused in {refused_at - began:.3f} s; the stream's largest gap "
          f"meanwhile {gap:.3f} s")
    assert stream.error is None and stream.status == 200
    assert DEFAULT_MAX_REQUEST_BYTES < len(huge)


def test_the_server_freezes_its_start_up_before_it_says_ready():
    # A full collector pass in the API process stalls every stream's chunks: what the start
    # made is frozen before /health turns 200 (`loading` false), so none comes mid-stream.
    import gc

    gc.unfreeze()
    frozen_when_ready: list[int] = []

    def start(*_: Any) -> Any:
        class Client:
            error = None

            def close(self) -> None:
                pass

        frozen_when_ready.append(gc.get_freeze_count())
        return Client()

    class Server:
        should_exit = False

    stop = threading.Event()
    sup = cli._Supervised(start, restart=False)
    stop.set()  # the watch returns at once
    try:
        sup.load_then_watch(Server(), stop)
        assert not sup.loading
        assert frozen_when_ready == [0] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
