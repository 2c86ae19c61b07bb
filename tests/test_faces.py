"""Every face of the engine carries a request the same way, and keeps up with it.

- The same greedy chats through the app with the engine in its process, with the engine in
  a child process, against a real `minivllm serve`, and through the `openai` client: the
  same text and the same usage counts.
- A scripted engine streaming fast into four panes: every token reaches its pane, no pane
  renders more than once a frame, and Esc takes effect within three frames.
- Server-sent events: a client that reads slowly gets the same text and usage as a fast
  one; a client that leaves has its request aborted.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from conftest import serving
from minivllm.tui.app import create_app
from minivllm.tui.conversation import Settings
from minivllm.tui.engine_spec import EngineSpec, engine_process_client
from minivllm.tui.remote import RemoteClient
from minivllm.tui.testing import type_and_send, wait_idle, wait_ready, wait_until

from minivllm.server.standin import gpu_like_engine, gpu_like_reply

SIZE = (160, 48)
QUESTIONS = ["What is the capital of France?", "Name three colours."]
MAX_TOKENS = 20
GREEDY = Settings(temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS, repetition_penalty=1.0)
# One engine configuration for every face: fp32 on the CPU, so greedy replies are exact.
CONFIG = {"device": "cpu", "dtype": "float32", "max_model_length": 1024, "block_size": 16}
SERVER_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "1024",
                "--block-size", "16"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("faces"),
                 [str(smollm2_path), *SERVER_FLAGS, "--served-model-name", "smol"]) as url:
        yield url


async def app_replies(app) -> list[tuple[str, tuple[int, int] | None]]:
    """Each question in its own pane, one after the other: (reply text, usage)."""
    out = []
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, 240)
        for i, question in enumerate(QUESTIONS):
            await type_and_send(pilot, i, question)
            await wait_idle(pilot, 240)
            pane = app.panes[i]
            assert pane.conversation.messages[-1].status in ("done", "length")
            out.append((pane.conversation.messages[-1].content, pane.usage))
        await pilot.press("ctrl+q")
    return out


@pytest.mark.slow
async def test_every_face_gives_the_same_text_and_usage(server, smollm2_path, tmp_path):
    import openai

    from minivllm import LLMEngine

    config = {"model_name_or_path": str(smollm2_path), **CONFIG}
    options = {"conversations": len(QUESTIONS), "settings": GREEDY,
               "data_root": tmp_path / "data", "save_sessions": False}
    engine = LLMEngine(config)
    try:
        in_process = await app_replies(create_app(engine, owns_engine=False, **options))
    finally:
        engine.exit()
    spec = EngineSpec("llm", config)
    engine_process = await app_replies(create_app(
        engine_factory=lambda on_progress: engine_process_client(spec), **options))
    remote = await app_replies(create_app(
        engine_factory=lambda on_progress: RemoteClient(server), **options))

    with openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0) as client:
        direct = []
        for question in QUESTIONS:
            r = client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": question}],
                temperature=0, top_p=1, max_tokens=MAX_TOKENS)
            direct.append((r.choices[0].message.content,
                           (r.usage.prompt_tokens, r.usage.completion_tokens)))

    assert all(text.strip() for text, _ in in_process)
    assert all(usage is not None and usage[0] > 0 and 0 < usage[1] <= MAX_TOKENS
               for _, usage in in_process)
    assert engine_process == in_process
    assert remote == in_process
    assert direct == in_process


async def test_fast_streams_reach_every_pane_once_a_frame_and_esc_is_prompt(tmp_path):
    # ~5,000 tokens/s over four panes: each step holds the GIL 0.2 ms and "computes" 0.6 ms.
    engine = gpu_like_engine(host_ms=0.2, device_ms=0.6)
    users = [f"story {i}" for i in range(4)]
    max_tokens = 400
    # The stand-in's replies, in the order requests reach it, cut at max_tokens.
    tok = engine.tokenizer
    expected = [tok.decode(tok.encode(gpu_like_reply(i))[:max_tokens]) for i in range(4)]
    settings = Settings(temperature=0.0, top_p=1.0, max_tokens=max_tokens)
    app = create_app(engine, conversations=4, settings=settings, save_sessions=False,
                     data_root=tmp_path / "data")
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        panes = app.panes
        for pane, text in zip(panes, users, strict=True):
            await app.send(pane, text)
        await wait_idle(pilot, 120)
        # Every token of every reply reached its pane, in order.
        for pane, reply in zip(panes, expected, strict=True):
            assert pane.tokens == max_tokens and pane.usage[1] == max_tokens
            assert pane.conversation.messages[-1].content == reply
        # A pane shows new text at most once a frame, and frames come at most FRAME_HZ
        # times a second (the timer's period): so at most ~30 renders a second.
        assert all(0 < pane.renders <= app.streams.frames for pane in panes)

        # Esc on one pane while all four stream: the pane shows it is stopping within
        # three frames, then stops with its partial reply kept.
        for pane, text in zip(panes, users, strict=True):
            await app.send(pane, text)
        target = panes[1]
        await wait_until(pilot, lambda: all(p.state == "streaming" for p in panes), 60)
        app.focus_pane(target)
        before = app.streams.frames
        # (pilot.press returns only once every widget's queue is empty: the frames are
        # counted when the pane changed, not when the press returned)
        press = asyncio.ensure_future(pilot.press("escape"))
        await wait_until(pilot, lambda: target.state_detail == "stopping"
                         or target.state == "stopped", 30)
        assert app.streams.frames - before <= 3
        await press
        await wait_until(pilot, lambda: target.state == "stopped", 30)
        assert 0 < target.tokens < max_tokens
        assert target.conversation.messages[-1].status == "stopped"
        await wait_idle(pilot, 120)
        assert all(p.tokens == max_tokens for p in panes if p is not target)
        await pilot.press("ctrl+q")


def _sse_stream(url: str, question: str, pause: float) -> tuple[str, dict, int]:
    """Stream a chat completion, sleeping `pause` s after each chunk read: (text, usage,
    content events)."""
    body = {"model": "smol", "stream": True, "temperature": 0, "max_tokens": MAX_TOKENS,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": question}]}
    text, usage, events = [], None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    text.append(piece)
                    events += 1
            time.sleep(pause)
    return "".join(text), usage, events


@pytest.mark.slow
def test_sse_slow_and_fast_clients_get_the_same_text_and_usage(server):
    fast = _sse_stream(server, QUESTIONS[0], 0.0)
    slow = _sse_stream(server, QUESTIONS[0], 0.05)
    assert fast[0] and fast[0] == slow[0]
    # The second one's prompt is in the prefix cache: only cached_tokens may differ.
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [fast[1][k] for k in counts] == [slow[1][k] for k in counts]
    assert set(fast[1]) == {*counts, "prompt_tokens_details"}
    assert slow[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert fast[1]["completion_tokens"] <= MAX_TOKENS
    assert 0 < fast[2] <= fast[1]["completion_tokens"]  # an event carries >= 1 token


@pytest.mark.slow
def test_sse_client_that_leaves_is_aborted(server):
    def running() -> float:
        text = httpx.get(f"{server}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running"))

    # 900: prompt + completion within the 1024-token context (more is a 400).
    body = {"model": "smol", "stream": True, "max_tokens": 900, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped line iterator closes the response
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break  # tokens are flowing
        # The gauge is the engine's last published stats: at the request's arrival (then
        # waiting) and every stats interval after, so it may trail the first tokens.
        rises = time.monotonic() + 10
        while running() != 1 and time.monotonic() < rises:
            time.sleep(0.05)
        assert running() == 1
        left = time.monotonic()
    deadline = left + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0
    print(f"aborted {time.monotonic() - left:.2f} s after the client left")


@pytest.mark.slow
def test_bench_serve_clients_spread_over_processes_see_every_token(server):
    from minivllm.bench.serve import run_http_processes, workload

    prompts = workload(4, 8, 10000, seed=1)
    wall, traces = run_http_processes(server, prompts, 6, processes=2, model="smol")
    assert len(traces) == 4 and wall > 0
    assert all(t.num_tokens == 6 and t.ttft() >= 0 for t in traces)
