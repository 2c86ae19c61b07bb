"""`minivllm serve` as a real process on 127.0.0.1, driven by the real `openai` client.

One server (SmolLM2 on CPU, an API key) is shared by the module; the SIGTERM test starts
its own (tensor-parallel, tiny model). Greedy replies are compared with the in-process
`LLMEngine.generate` on the same templated prompt.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from minivllm import SamplingParams
from minivllm.server.launch import descendants, launch_server

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MAX_LEN = 2048
# fp32: the tests compare with the in-process fp32 engine (`auto` is bf16 on AVX-512 BF16 CPUs).
SERVER_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_LEN),
                "--block-size", "16", "--num-gpu-blocks-override", "256", "--max-num-seqs", "16"]


def start_server(tmp: Path, model: str, *flags: str) -> tuple[subprocess.Popen, str]:
    # NOTE: cwd is a temporary folder, so `-c` does not put the repo root on sys.path.
    return launch_server([model, *flags], tmp / f"server-{time.monotonic_ns()}.log", cwd=tmp)


def stop_server(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    proc, url = start_server(tmp_path_factory.mktemp("server"), str(smollm2_path),
                             *SERVER_FLAGS, "--api-key", API_KEY, "--served-model-name", "smol")
    yield url
    assert stop_server(proc) == 0


_HTTP = httpx.Client(timeout=30)  # one client: building one per call costs ~0.1-0.7 s here


def metrics(url: str) -> dict[str, float]:
    """The first sample of each /metrics family, by name without the prefix."""
    out = {}
    for line in _HTTP.get(f"{url}/metrics").text.splitlines():
        prefix = line.split(":", 1)[0]
        if prefix in ("vllm", "minivllm") and "{" in line:
            name = line[len(prefix) + 1:line.index("{")]
            out.setdefault(name, float(line.rsplit(" ", 1)[1]))
    return out


def wait_idle_server(url: str, timeout: float) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["num_requests_running"], m["num_requests_waiting"],
                m["num_kv_cache_blocks_used"]) == (0, 0, 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {m}")
        time.sleep(0.02)


def templated(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def test_chat_and_completions_match_generate(client, smollm2, server):
    question = "What is the capital of France? Answer in one sentence."
    messages = [{"role": "user", "content": question}]
    greedy = dict(model="smol", messages=messages, temperature=0, max_tokens=24)
    full = client.chat.completions.create(**greedy)
    chunks = list(client.chat.completions.create(
        **greedy, stream=True, stream_options={"include_usage": True}))
    prompt = templated(smollm2, question)
    expected = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    text, ids = expected["text"][0], expected["token_ids"][0]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed == text and text
    assert full.choices[0].message.role == "assistant"
    reason = "length" if len(ids) == 24 else "stop"
    assert full.choices[0].finish_reason == reason
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    prompt_len = len(smollm2.tokenizer.encode(prompt))
    usage = (prompt_len, len(ids), prompt_len + len(ids))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens,
            full.usage.total_tokens) == usage
    last = chunks[-1]  # include_usage: a last chunk with no choices carries the usage
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens,
                                   last.usage.total_tokens) == usage

    plain = "The three primary colours are"
    want = smollm2.generate([plain], SamplingParams(temperature=0, max_tokens=12))
    comp = client.completions.create(model="smol", prompt=plain, temperature=0, max_tokens=12)
    parts = client.completions.create(model="smol", prompt=plain, temperature=0, max_tokens=12,
                                      stream=True)
    assert comp.choices[0].text == "".join(p.choices[0].text for p in parts) == want["text"][0]
    assert comp.usage.completion_tokens == len(want["token_ids"][0])
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol"]
    wait_idle_server(server, 5)


def test_concurrent_streams_equal_solo_replies(server, smollm2):
    import openai

    topics = ["cats", "the sea", "Paris", "rain", "chess", "bread", "the moon", "music",
              "trains", "winter", "bees", "coffee", "rivers", "clocks", "snow", "books"]
    questions = [f"Say one sentence about {t}." for t in topics]
    n_tokens = 6
    solo = [smollm2.generate([templated(smollm2, q)],
                             SamplingParams(temperature=0, max_tokens=n_tokens))["text"][0]
            for q in questions]
    running: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            running.append(metrics(server)["num_requests_running"])
            time.sleep(0.05)

    async def one(c: openai.AsyncOpenAI, q: str) -> str:
        stream = await c.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": q}], temperature=0,
            max_tokens=n_tokens, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY,
                                      max_retries=0) as c:
            return await asyncio.gather(*(one(c, q) for q in questions))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        replies = asyncio.run(all_at_once())
    finally:
        done.set()
        watcher.join()
    assert replies == solo
    assert max(running) >= 8, running  # they ran together ...
    m = wait_idle_server(server, 5)  # ... and all left, with every block back
    assert m["num_kv_cache_blocks_used"] == 0


def test_client_closing_the_stream_aborts_the_request(client, server):
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Tell me a very long story."}],
        temperature=0, max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for _chunk in stream:
        got += 1
        if got == 4:
            break
    assert metrics(server)["num_requests_running"] == 1
    stream.close()
    closed = time.monotonic()
    # The server notices the disconnect, aborts the request and frees its blocks.
    wait_idle_server(server, 1.0)
    assert time.monotonic() - closed <= 1.0
    assert metrics(server)["request_success_total"] >= 1


BAD = [
    # (body, status, the field the error must name)
    ({"model": "smol"}, 400, "messages"),
    ({"model": "smol", "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
     400, "temperature"),
    ({"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     400, "max_tokens"),
    ({"model": "smol", "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"model": "smol", "messages": [{"role": "user", "content": "hi " * 100_000}]},
     400, "messages"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server}/v1/chat/completions"
    for body, status, field in BAD:
        r = _HTTP.post(url, json=body, headers=auth, timeout=60)
        assert r.status_code == status, (body.keys(), r.text)
        error = r.json()["error"]
        assert error["param"] == field and error["message"] and error["type"], error
    long = _HTTP.post(url, json=BAD[4][0], headers=auth, timeout=60).json()["error"]["message"]
    assert str(MAX_LEN) in long  # says the limit
    r = _HTTP.post(url, content=b'{"model": "smol", "messages": [', headers={
        **auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        r = _HTTP.post(url, json=BAD[1][0], headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = _HTTP.post(f"{server}/v1/completions", json={"model": "smol", "prompt": "x",
                                                      "top_p": 0}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"

    import openai

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    ok = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hi."}], temperature=0,
        max_tokens=4)
    assert ok.choices[0].message.content
    wait_idle_server(server, 5)


async def test_app_against_the_server_streams_and_esc_aborts(server, tmp_path):
    from minivllm.tui.app import create_app
    from minivllm.tui.conversation import Settings
    from minivllm.tui.remote import RemoteClient
    from minivllm.tui.testing import type_and_send, wait_ready, wait_until

    app = create_app(engine_factory=lambda progress: RemoteClient(server, API_KEY),
                     model=server, data_root=tmp_path / "data", stats_interval=0.1,
                     settings=Settings(temperature=0.0, max_tokens=600))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_ready(pilot, 60)
        assert app.info is not None and app.info.block_size == 16
        await type_and_send(pilot, 0, "Write a long story about a dragon.")
        pane = app.panes[0]
        await wait_until(pilot, lambda: len(pane.conversation.messages[-1].content) > 20,
                         120, "the reply to stream into the pane")
        await wait_until(pilot, lambda: app.history.samples
                         and app.history.samples[-1][1].num_running == 1, 10,
                         "the stats panel to show the running request")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not pane.busy, 10, "the pane to stop")
        reply = pane.conversation.messages[-1]
        assert reply.status == "stopped" and reply.content
        await asyncio.to_thread(wait_idle_server, server, 5)


def test_sigterm_while_streaming_exits_cleanly(tmp_path, tiny_llama, smollm2_path):
    """Tensor-parallel (2 ranks on CPU) so there is a worker process to leave behind; a
    tiny random model (SmolLM2's heads do not split in two) with SmolLM2's tokenizer."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_llama, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2_path) / name, model / name)
    proc, url = start_server(tmp_path, str(model), "--device", "cpu",
                             "--tensor-parallel-size", "2", "--block-size", "16",
                             "--num-gpu-blocks-override", "64", "--max-model-len", "512")
    # The engine process (a child) and its tensor-parallel worker (a grandchild).
    workers = descendants(proc.pid)
    assert len(workers) >= 2, f"engine process and worker expected, found {workers}"
    body = {"model": str(model), "prompt": [1, 2, 3, 4], "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if len(lines) == 3:
                proc.send_signal(signal.SIGTERM)
    assert stop_server(proc) == 0
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"abort"' in lines[-2]
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"worker {pid} left"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
