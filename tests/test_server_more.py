"""`n` choices, `echo`, reasoning text apart from the answer, and the prompt's wording.

The reasoning tests drive the app in this process with the scripted engine (its replies
hold `<think>` blocks cut into small tokens, and its chat template honours
`enable_thinking`); `n` and `echo` run against a real `minivllm serve` of SmolLM2, whose
seeded sampling, prefix cache and prompt logprobs are the engine's own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest
import uvicorn
from conftest import serving, wait_for
from minivllm.tui.remote import RemoteClient

from minivllm import SamplingParams
from minivllm.frontend import EngineFrontend, GenerateRequest
from minivllm.server.api import build_app
from minivllm.server.standin import ScriptedEngine, ScriptTokenizer

THOUGHT = "The user greets me. I should greet back, briefly."
ANSWER = "Hello! How can I help?"


class _Tokenizer(ScriptTokenizer):
    bos_token_id = None  # read by the server's tokenizing; the scripted one has no BOS


class _OpeningTokenizer(_Tokenizer):
    """A template that opens the thinking block in the prompt, as DeepSeek-R1's does."""

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = False,
                            tokenize: bool = False, **kw: Any) -> Any:
        text = super().apply_chat_template(messages, add_generation_prompt, False, **kw)
        text += "<think>\n"
        return self.encode(text) if tokenize else text


def scripted_app(reply: Any, parser: str | None = "qwen3", tokenizer: type = _Tokenizer,
                 thinking: bool = True):
    # A step every few ms: the stream's chunks hold a token or a few, so the tags are cut
    # across chunks (the scripted tokens are 1-3 characters).
    engine = ScriptedEngine(reply=reply, thinking=thinking, step_delay=0.005)
    engine.tokenizer = tokenizer()
    frontend = EngineFrontend(engine)
    frontend.start()
    return frontend, build_app(frontend, model_name="m", reasoning_parser=parser)


def post_all(app: Any, *requests: tuple[str, dict[str, Any]]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=60) as http:
            return [await http.post(path, json=body) for path, body in requests]

    return asyncio.run(run())


def events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": "m", "max_tokens": 200,
                                    "messages": [{"role": "user", "content": "Hi!"}],
                                    **fields}


def streamed_message(chunks: list[dict[str, Any]], index: int = 0) -> tuple[str, str]:
    """(reasoning, content) joined from one choice's streamed deltas."""
    deltas = [c["choices"][0]["delta"] for c in chunks
              if c["choices"] and c["choices"][0]["index"] == index]
    return ("".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas))


# -- reasoning text apart from the answer ------------------------------------------------------


def test_qwen3_parser_returns_the_thinking_as_reasoning_content():
    frontend, app = scripted_app(f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}")
    try:
        whole, streamed, two = post_all(app, chat(), chat(stream=True), chat(n=2))
    finally:
        frontend.close()
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning_content"] == f"\n{THOUGHT}\n"
    assert message["content"] == f"\n\n{ANSWER}" and "<think>" not in message["content"]
    chunks = events(streamed)
    assert streamed_message(chunks) == (f"\n{THOUGHT}\n", f"\n\n{ANSWER}")
    assert [c["message"]["reasoning_content"] for c in two.json()["choices"]] == [
        f"\n{THOUGHT}\n"] * 2


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_all_content():
    # The scripted engine thinks unless the template closed an empty block in the prompt,
    # which the template does only when `enable_thinking` reached it as False.
    frontend, app = scripted_app(None)
    try:
        off, on = post_all(app, chat(chat_template_kwargs={"enable_thinking": False}),
                           chat(chat_template_kwargs={"enable_thinking": True}))
    finally:
        frontend.close()
    off_message, on_message = off.json()["choices"][0]["message"], on.json()["choices"][0][
        "message"]
    assert off_message["reasoning_content"] is None
    assert off_message["content"].startswith("You said: Hi!")
    assert "The user wrote" in on_message["reasoning_content"]
    assert on_message["content"].strip().startswith("You said: Hi!")


def test_tokenize_templates_messages_with_the_requests_template_kwargs():
    frontend, app = scripted_app(None)
    messages = [{"role": "user", "content": "Hi!"}]
    try:
        on, off, reserved = post_all(
            app, ("/tokenize", {"messages": messages}),
            ("/tokenize", {"messages": messages,
                           "chat_template_kwargs": {"enable_thinking": False}}),
            ("/tokenize", {"messages": messages, "chat_template_kwargs": {"tokenize": True}}))
    finally:
        frontend.close()
    tokenizer = frontend.engine.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             enable_thinking=False)
    assert off.json()["tokens"] == tokenizer.encode(rendered)
    assert off.json()["count"] > on.json()["count"]  # the closed, empty thinking block
    assert reserved.status_code == 400
    assert reserved.json()["error"]["param"] == "chat_template_kwargs.tokenize"


def test_a_block_opened_by_the_template_is_reasoning_up_to_its_close():
    frontend, app = scripted_app(f"{THOUGHT}</think>\n\n{ANSWER}", parser="deepseek_r1",
                                 tokenizer=_OpeningTokenizer)
    try:
        whole, streamed = post_all(app, chat(), chat(stream=True))
    finally:
        frontend.close()
    message = whole.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, f"\n\n{ANSWER}")
    assert streamed_message(events(streamed)) == (THOUGHT, f"\n\n{ANSWER}")


def test_the_apps_remote_client_gets_the_thinking_back_between_its_tags():
    reply = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    frontend, app = scripted_app(reply)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    client = RemoteClient(f"http://127.0.0.1:{sock.getsockname()[1]}")
    try:
        wait_for(lambda: server.started, 30, "the in-process server")
        client.start()

        async def run() -> str:
            request = GenerateRequest("r", SamplingParams(max_tokens=200),
                                      messages=[{"role": "user", "content": "Hi!"}])
            return "".join([out.text async for out in client.generate(request)])

        assert asyncio.run(run()) == reply
    finally:
        client.close()
        server.should_exit = True
        thread.join(30)
        sock.close()
        frontend.close()


def test_without_a_parser_the_thinking_stays_in_the_content():
    reply = f"<think>{THOUGHT}</think>{ANSWER}"
    frontend, app = scripted_app(reply, parser=None)
    try:
        [whole] = post_all(app, chat())
    finally:
        frontend.close()
    message = whole.json()["choices"][0]["message"]
    assert message["content"] == reply and "reasoning_content" not in message


def test_an_unknown_reasoning_parser_is_a_one_line_error(tmp_path):
    done = subprocess.run([sys.executable, "-c", "from minivllm.cli import main; main()",
                           "serve", "--reasoning-parser", "nope", "--port", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--reasoning-parser: invalid choice: 'nope'" in done.stderr
    assert "qwen3" in done.stderr


# -- bad values, refused by name --------------------------------------------------------------


@pytest.mark.parametrize("path,fields,param,shown", [
    ("/v1/completions", {"prompt": [1.5]}, "prompt", "1.5"),
    ("/v1/completions", {"prompt": [7, "x"]}, "prompt", "'x'"),
    ("/v1/completions", {"prompt": 3}, "prompt", "3"),
    ("/v1/completions", {"n": 0}, "n", "n=0"),
    ("/v1/completions", {"n": 65}, "n", "n=65"),
    ("/v1/completions", {"n": 2, "best_of": 3}, "best_of", "best_of=3"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of", "best_of=2"),
    ("/v1/chat/completions", {"echo": True}, "echo", "/v1/completions"),
])
def test_bad_fields_are_a_400_naming_the_field_and_the_value(path, fields, param, shown):
    frontend, app = scripted_app("ok")
    body = {"model": "m", "max_tokens": 4, **fields}
    if path == "/v1/completions":
        body.setdefault("prompt", "Hi")
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    try:
        refused, still = post_all(app, (path, body), ("/v1/completions", {
            "model": "m", "prompt": "Hi", "max_tokens": 2}))
    finally:
        frontend.close()
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and shown in error["message"], error
    assert still.status_code == 200  # the server serves on


# -- n and echo on a real SmolLM2 server --------------------------------------------------------


SMOL = "smol"
FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "2048", "--block-size",
         "16", "--num-gpu-blocks-override", "256", "--served-model-name", SMOL,
         "--reasoning-parser", "qwen3"]
# Several 16-token blocks, found in no other request of this module but the n tests'.
PROMPT = "Here is a list of animals: " + ", ".join(
    f"{a} number {i}" for i, a in enumerate(["cat", "dog", "owl", "fox", "elk", "bee"] * 3)
) + ". Now begin a story about one of them, in your own words:"


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("server_more"), [str(smollm2_path), *FLAGS],
                 timeout=600) as url:
        yield url


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def metric_labelled(url: str, name: str, label: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name}{{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def complete(url: str, **fields: Any) -> httpx.Response:
    body = {"model": SMOL, "prompt": PROMPT, "max_tokens": 8, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def count_tokens(url: str, text: str) -> int:
    return httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60).json()["count"]


SAMPLED = dict(n=3, temperature=1.0, seed=1234, ignore_eos=True)


@pytest.mark.slow
def test_n_choices_share_one_prefill_differ_and_repeat_with_a_seed(smol):
    num_prompt = count_tokens(smol, PROMPT)
    hits, prefilled = (metric(smol, "vllm:prefix_cache_hits_total"),
                       metric(smol, "vllm:prompt_tokens_total"))
    r = complete(smol, **SAMPLED)
    assert r.status_code == 200, r.text
    body = r.json()
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3 and all(texts), texts
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    usage = body["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # The prompt counted once, every choice's tokens; the later choices found the first
    # one's full prompt blocks in the prefix cache, and computed only the last, partial one.
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        num_prompt, 24, num_prompt + 24)
    assert cached == num_prompt // 16 * 16 - (16 if num_prompt % 16 == 0 else 0) > 0
    assert metric(smol, "vllm:prefix_cache_hits_total") - hits == 2 * cached
    assert metric(smol, "vllm:prompt_tokens_total") - prefilled == 3 * num_prompt - 2 * cached

    # The same request, the same choices; choice i is what a single request seeded
    # seed + i samples.
    again = complete(smol, **SAMPLED).json()
    assert [c["text"] for c in again["choices"]] == texts
    single = complete(smol, temperature=1.0, seed=1234 + 2, ignore_eos=True).json()
    assert single["choices"][0]["text"] == texts[2]

    # Streamed: each index's chunks join into the same text, each ends with its reason.
    streamed = httpx.post(f"{smol}/v1/completions", timeout=300, json={
        "model": SMOL, "prompt": PROMPT, "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}, **SAMPLED})
    chunks = events(streamed)
    joined = {i: "".join(c["choices"][0]["text"] for c in chunks
                         if c["choices"] and c["choices"][0]["index"] == i) for i in range(3)}
    assert [joined[i] for i in range(3)] == texts
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"])
                for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    assert chunks[-1]["choices"] == []
    assert (chunks[-1]["usage"]["prompt_tokens"], chunks[-1]["usage"]["completion_tokens"]) == (
        num_prompt, 24)


@pytest.mark.slow
def test_n_on_chat_streamed_and_whole_with_reasoning_parser_on_a_plain_model(smol):
    fields = {"model": SMOL, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 5,
              "messages": [{"role": "user", "content": "Name a fruit."}]}
    whole = httpx.post(f"{smol}/v1/chat/completions", json=fields, timeout=300).json()
    messages = [c["message"] for c in whole["choices"]]
    # SmolLM2 does not think: the parser leaves its whole reply as content.
    assert all(m["content"] and m["reasoning_content"] is None for m in messages)
    assert 2 <= whole["usage"]["completion_tokens"] <= 12
    streamed = httpx.post(f"{smol}/v1/chat/completions", timeout=300,
                          json={**fields, "stream": True})
    chunks = events(streamed)
    roles = [c["choices"][0]["index"] for c in chunks
             if c["choices"][0]["delta"].get("role") == "assistant"]
    assert roles == [0, 1]
    assert [streamed_message(chunks, i)[1] for i in range(2)] == [m["content"]
                                                                  for m in messages]


@pytest.mark.slow
def test_a_client_gone_mid_stream_aborts_every_choice(smol):
    body = {"model": SMOL, "prompt": "Tell me a long story.", "max_tokens": 1000,
            "ignore_eos": True, "stream": True, "n": 3, "temperature": 1.0}
    seen: set[int] = set()
    aborted = metric_labelled(smol, "vllm:request_success_total", 'finished_reason="abort"')
    with httpx.stream("POST", f"{smol}/v1/completions", json=body, timeout=300) as s:
        # Held, so that leaving the loop does not close the response (closing the line
        # iterator closes the connection): the client is still there until the `with` ends.
        lines = s.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                seen.update(c["index"] for c in chunk["choices"])
            if len(seen) == 3:
                break
        # Running, or waiting again after a preemption: not finished when the client goes.
        wait_for(lambda: metric(smol, "vllm:num_requests_running")
                 + metric(smol, "vllm:num_requests_waiting") == 3, 120,
                 "the three choices in the engine")
    wait_for(lambda: metric(smol, "vllm:num_requests_running") == 0
             and metric(smol, "minivllm:num_kv_cache_blocks_used") == 0, 60,
             "every choice aborted and its blocks freed")
    assert metric_labelled(smol, "vllm:request_success_total",
                           'finished_reason="abort"') == aborted + 3


@pytest.mark.slow
def test_echo_puts_the_prompt_first_with_its_logprobs(smol):
    prompt = "The capital of France is"
    plain = complete(smol, prompt=prompt, temperature=0, max_tokens=5, logprobs=2).json()
    echoed = complete(smol, prompt=prompt, temperature=0, max_tokens=5, logprobs=2,
                      echo=True).json()
    generated = plain["choices"][0]
    choice = echoed["choices"][0]
    assert choice["text"] == prompt + generated["text"]
    lps = choice["logprobs"]
    num_prompt = echoed["usage"]["prompt_tokens"]
    assert len(lps["tokens"]) == num_prompt + 5
    assert "".join(lps["tokens"][:num_prompt]) == prompt
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(v <= 0 for v in lps["token_logprobs"][1:num_prompt])
    assert all(len(top) >= 2 for top in lps["top_logprobs"][1:num_prompt])
    gen = generated["logprobs"]
    assert lps["tokens"][num_prompt:] == gen["tokens"]
    assert [round(v, 3) for v in lps["token_logprobs"][num_prompt:]] == [
        round(v, 3) for v in gen["token_logprobs"]]
    offsets = lps["text_offset"]
    assert offsets[0] == 0 and offsets[num_prompt] == len(prompt)
    # Token ids echo as their text; streamed, the prompt comes with each choice's first text.
    ids = httpx.post(f"{smol}/tokenize", json={"prompt": prompt}, timeout=60).json()["tokens"]
    by_ids = complete(smol, prompt=ids, temperature=0, max_tokens=5, echo=True).json()
    assert by_ids["choices"][0]["text"] == choice["text"]
    streamed = httpx.post(f"{smol}/v1/completions", timeout=300, json={
        "model": SMOL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True,
        "stream": True, "n": 2, "logprobs": 2})
    chunks = events(streamed)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["text"].startswith(prompt)
        assert "".join(c["text"] for c in mine) == choice["text"]
        # Each choice's chunks carry its own logprobs, the prompt's first (from choice 0's
        # request: the others reuse its cached prompt and ask for none).
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == lps["tokens"]
        values = [v for c in mine if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert [v if v is None else round(v, 3) for v in values] == [
            v if v is None else round(v, 3) for v in lps["token_logprobs"]]


@pytest.mark.slow
def test_concurrent_n_requests_keep_their_choices_apart(smol):
    results: list[dict[str, Any]] = []

    def one(seed: int) -> None:
        results.append(complete(smol, prompt=f"Count from {seed}:", n=2, max_tokens=4,
                                temperature=1.0, seed=seed, ignore_eos=True).json())

    threads = [threading.Thread(target=one, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == 3
    for body in results:
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"]["completion_tokens"] == 8
