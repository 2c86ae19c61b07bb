"""The server's fast path, without a model: the engine in its own process, merged SSE
chunks, the API key check, and the benchmark's stand-in engine.

The engine process runs the scripted `ScriptedEngine` (one child interpreter per client, a
few seconds each); the HTTP checks drive the app in process through the real `openai`
client over an ASGI transport.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import sys
import threading
import time
import types

import httpx
import pytest

from minivllm import SamplingParams
from minivllm.frontend import EngineClient, EngineInfo, GenerateRequest, RequestOutput
from minivllm.frontend.engine_process import EngineProcessClient
from minivllm.frontend.outputs import stream_outputs
from minivllm.server.api import build_app
from minivllm.server.cli import build_engine
from minivllm.server.standin import ScriptedEngine, stand_in_engine

REPLY = "one two three four five six seven eight nine ten"
GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)


def collect(client: EngineClient, request: GenerateRequest) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [out async for out in client.generate(request)]

    return asyncio.run(run())


class Sink:
    """Outputs of one request handed over from another thread."""

    def __init__(self) -> None:
        self.outs: list[RequestOutput] = []
        self.ended = threading.Event()

    def __call__(self, out: RequestOutput) -> None:
        self.outs.append(out)
        if out.finished:
            self.ended.set()

    def wait_tokens(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while sum(len(o.token_ids) for o in self.outs) < n:
            assert time.monotonic() < deadline, f"no {n} tokens within {timeout} s"
            time.sleep(0.005)


def fake_factory(**kw):
    return functools.partial(ScriptedEngine, {}, reply=REPLY, step_delay=0.002, **kw)


@pytest.fixture(scope="module")
def proc_client():
    stages: list[str] = []
    client = EngineProcessClient(fake_factory())
    client.start(lambda stage, fraction: stages.append(stage))
    assert "sizing the KV cache" in stages  # the child's progress reached us
    yield client
    client.close()
    assert client._process.poll() is not None, "the engine process is gone after close()"


def test_engine_process_streams_like_the_in_process_front_end(proc_client):
    assert isinstance(proc_client, EngineClient)
    assert proc_client.pid not in (None, os.getpid())
    assert proc_client.info is not None and proc_client.info.block_size == 16
    outs = collect(proc_client, GenerateRequest(
        "my-id", SamplingParams(max_tokens=50), messages=[{"role": "user", "content": "hi"}]))
    assert {o.request_id for o in outs} == {"my-id"}
    assert outs[0].accepted and not outs[0].text
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == REPLY
    assert outs[-1].num_generated_tokens == sum(len(o.token_ids) for o in outs) > 0
    assert proc_client.stats() is not None


def test_engine_process_rejects_bad_input_and_duplicate_ids_and_keeps_serving(proc_client):
    bad = collect(proc_client, GenerateRequest("bad", GREEDY, prompt=""))
    assert len(bad) == 1 and bad[0].rejected and "empty" in bad[0].error
    live = Sink()
    proc_client.add_request(GenerateRequest("dup", LONG, prompt="long"), live)
    again = Sink()
    proc_client.add_request(GenerateRequest("dup", GREEDY, prompt="again"), again)
    assert again.ended.wait(10) and "already in use" in again.outs[-1].error
    live.wait_tokens(3)
    proc_client.abort("dup")
    assert live.ended.wait(10) and live.outs[-1].finish_reason == "abort"
    assert collect(proc_client, GenerateRequest("ok", GREEDY, prompt="hi"))[-1].finish_reason


def test_engine_process_death_fails_live_requests_and_refuses_new_ones():
    client = EngineProcessClient(fake_factory())
    client.start()
    try:
        live = Sink()
        client.add_request(GenerateRequest("r", LONG, prompt="long"), live)
        live.wait_tokens(2)
        os.kill(client.pid, signal.SIGKILL)
        assert live.ended.wait(10)
        assert live.outs[-1].finish_reason == "error" and "exited" in live.outs[-1].error
        assert client.error is not None and not client.alive
        late = collect(client, GenerateRequest("late", GREEDY, prompt="hi"))
        assert late[0].rejected and late[0].finish_reason == "error"
    finally:
        client.close()


def test_engine_process_start_failure_raises_the_engines_error():
    args = argparse.Namespace(model="HuggingFaceTB/SmolLM2-135M-Instruct",
                              max_num_sequences=0, stand_in_ms=None)
    client = EngineProcessClient(functools.partial(build_engine, args))
    with pytest.raises(ValueError, match="max_num_sequences"):
        client.start()
    assert client._process.poll() is not None


def test_a_factory_the_child_cannot_import_fails_the_start_with_the_reason(monkeypatch):
    # A factory from a module that exists only in the parent's memory, so that no import
    # path reaches it: the start fails with the import error, not a crash.
    module = types.ModuleType("minivllm_no_such_module")
    exec("def factory(on_progress):\n    raise AssertionError('not reached')\n",
         module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    client = EngineProcessClient(module.factory)
    with pytest.raises(RuntimeError, match="No module named 'minivllm_no_such_module'"):
        client.start()
    assert client._process.poll() is not None


def test_engine_process_sends_tokenizer_and_prompt_progress(smollm2_path):
    """What the app reads besides outputs: a working tokenizer copy, prompt progress."""
    args = argparse.Namespace(model=str(smollm2_path), stand_in_ms=[0.1, 1.0],
                              max_model_length=512, max_num_sequences=4)
    client = EngineProcessClient(functools.partial(build_engine, args), stats_interval=0.02)
    client.start()
    try:
        assert client.tokenizer is not None
        assert client.tokenizer.decode(client.tokenizer.encode("Hello there")) == "Hello there"
        live = Sink()
        prompt = list(range(100, 120))
        client.add_request(GenerateRequest("p", LONG, prompt=prompt), live)
        live.wait_tokens(2)
        deadline = time.monotonic() + 10
        while client.prompt_progress("p") != (20, 20):
            assert time.monotonic() < deadline, client.prompt_progress("p")
            time.sleep(0.01)
        client.abort("p")
        assert live.ended.wait(10) and live.outs[-1].finish_reason == "abort"
        assert client.prompt_progress("unknown") is None
    finally:
        client.close()


def test_engine_process_output_goes_to_log_path(tmp_path):
    """The child prints into the log, not over our terminal. (Its factory here prints
    and returns no engine: the child reports that as its start's failure.)"""
    log = tmp_path / "engine.log"
    client = EngineProcessClient(functools.partial(print, "hello from the engine process",
                                                   flush=True), log_path=log)
    with pytest.raises(TypeError, match="the engine factory returned None, not an engine"):
        client.start()
    assert "hello from the engine process" in log.read_text()


# -- SSE: outputs that queued up go out as one chunk ------------------------------------------


class BurstClient:
    """Hands a request's whole reply over before the event loop reads any of it (as when
    the loop falls behind the engine): the tokens must go out merged, and correct."""

    info = EngineInfo("burst", "cpu", "float32", 1, 16, 64, 2048)
    error = None
    pieces = [("Hel", 11), ("lo", 12), (" wor", 13), ("ld", 14)]

    def add_request(self, request: GenerateRequest, on_output) -> None:
        rid = request.request_id
        on_output(RequestOutput(rid, accepted=True, num_prompt_tokens=5))
        for i, (text, token) in enumerate(self.pieces, 1):
            last = i == len(self.pieces)
            on_output(RequestOutput(rid, text, [token], last, "length" if last else None,
                                    num_prompt_tokens=5, num_generated_tokens=i))

    def abort(self, request_id: str) -> None:
        pass

    def stats(self):
        return None

    def generate(self, request: GenerateRequest):
        return stream_outputs(self, request)


def asgi_openai(app, api_key: str = "k"):
    import openai

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key=api_key, http_client=http,
                              max_retries=0)


def test_queued_tokens_go_out_as_one_valid_chunk_with_usage_and_finish_reason():
    app = build_app(BurstClient(), model_name="burst")

    async def run():
        client = asgi_openai(app)
        chat = await client.chat.completions.create(
            model="burst", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True})
        chat_chunks = [c async for c in chat]
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        body = {"model": "burst", "prompt": "hi", "stream": True, "return_token_ids": True}
        raw = (await http.post("/v1/completions", json=body)).text
        return chat_chunks, raw

    chat_chunks, raw = asyncio.run(run())
    content = [c.choices[0].delta.content for c in chat_chunks
               if c.choices and c.choices[0].delta.content]
    assert content == ["Hello world"]  # four tokens, one chunk
    finishes = [c.choices[0].finish_reason for c in chat_chunks
                if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chat_chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 4, 9)
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert choices[0]["text"] == "Hello world" and choices[0]["token_ids"] == [11, 12, 13, 14]
    assert choices[-1]["finish_reason"] == "length" and choices[-1]["token_ids"] == []


def test_api_key_is_checked_on_v1_routes_only():
    app = build_app(BurstClient(), model_name="burst", api_key="secret")

    async def run():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        body = {"model": "burst", "prompt": "hi"}
        wrong = await http.post("/v1/completions", json=body,
                                headers={"Authorization": "Bearer nope"})
        missing = await http.get("/v1/models")
        right = await http.post("/v1/completions", json=body,
                                headers={"Authorization": "Bearer secret"})
        health = await http.get("/health")
        return wrong, missing, right, health

    wrong, missing, right, health = asyncio.run(run())
    assert wrong.status_code == missing.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert right.status_code == 200 and right.json()["choices"][0]["text"] == "Hello world"
    assert health.status_code == 200


# -- the benchmark's stand-in engine -----------------------------------------------------------


def test_stand_in_engine_generates_every_token_and_frees_everything():
    llm = stand_in_engine({"model_name_or_path": "Qwen/Qwen3-0.6B", "load_format": "dummy",
                           "max_model_length": 512, "max_num_sequences": 4},
                          host_ms=0.1, device_ms=1.0)
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        ids = [llm.add_prompt(list(range(100, 100 + n)), params) for n in (5, 40, 70)]
        got = {i: 0 for i in ids}
        while not llm.scheduler.is_finished():
            llm.step()
            for d in llm.pop_deltas():
                got[d.seq_id] += len(d.token_ids)
        assert got == {i: 20 for i in ids}
        assert llm.async_scheduling  # steps overlap, as on the GPU
        assert llm.stats().num_used_blocks == 0
    finally:
        llm.exit()


def test_the_engine_steps_on_while_the_parent_reads_nothing():
    # The engine process never waits on the pipe: while the parent reads nothing (its
    # reader thread held in a callback here; a busy event loop in a server), the engine
    # goes on stepping, and once the parent reads again every token is there.
    client = EngineProcessClient(functools.partial(ScriptedEngine, {}, reply=REPLY))
    client.start()
    gate = threading.Event()
    sinks = [Sink() for _ in range(8)]

    def held(sink: Sink):
        def on_output(out: RequestOutput) -> None:
            gate.wait()  # the reader thread waits here: nothing more is read from the pipe
            sink(out)
        return on_output

    params = SamplingParams(max_tokens=1500, ignore_eos=True)
    try:
        for i, sink in enumerate(sinks):  # ~1 MB of outputs: more than the pipe holds
            client.add_request(GenerateRequest(f"r{i}", params, prompt="hi"), held(sink))
        time.sleep(4.0)
        released = time.monotonic()
        gate.set()
        for sink in sinks:
            assert sink.ended.wait(60)
        assert [sum(len(o.token_ids) for o in s.outs) for s in sinks] == [1500] * 8
        # Every request's last token was made while the parent was reading nothing.
        assert max(s.outs[-1].at for s in sinks) < released
    finally:
        gate.set()
        client.close()
