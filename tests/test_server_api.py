"""What routers and vLLM's clients expect of `minivllm serve`: readiness on /health,
vLLM's metric names, and the extra endpoints, headers and usage fields vLLM serves.

One real `minivllm serve` process with the stand-in engine on SmolLM2's folder (the real
scheduler, block manager and tokenizer; no weights) whose load is slowed down, so that
the loading phase can be seen from outside.
"""

from __future__ import annotations

import importlib.metadata
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import serving, wait_for
from minivllm.tui.remote import RemoteClient, parse_metrics

from minivllm.engine.prompts import encode_text
from minivllm.frontend import render_chat_prompt
from minivllm.server.launch import descendants, free_port, launch_server

pytestmark = pytest.mark.slow

SMOL = "smol"
LOAD_S = 15  # the stand-in's load: long enough to be seen loading from outside
STAND_IN = ["--stand-in-ms", "0.1", "20", "--stand-in-load-s", str(LOAD_S),
            "--max-model-len", "1024", "--max-num-seqs", "2", "--block-size", "16",
            "--served-model-name", SMOL]


def answer(url: str, path: str) -> httpx.Response | None:
    try:
        return httpx.get(f"{url}{path}", timeout=5)
    except httpx.HTTPError:
        return None


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    """A stand-in server, returned as soon as its port answers (the engine still loads)."""
    tmp: Path = tmp_path_factory.mktemp("api")
    port = free_port()
    log = tmp / "server.log"
    cmd = [sys.executable, "-c", "from minivllm.cli import main; main()", "serve",
           str(smollm2_path), *STAND_IN, "--port", str(port), "--log-level", "info"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or answer(url, "/health") is not None, 300,
                 "the server answering")
        assert proc.poll() is None, log.read_text()
        yield url, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def ready(url: str) -> None:
    wait_for(lambda: (r := answer(url, "/health")) is not None and r.status_code == 200, 300,
             "/health 200")


def vllm_metrics(url: str) -> dict[str, tuple[dict[str, str], float]]:
    """The `vllm:` samples of /metrics: name -> (labels, value) of its first sample."""
    out: dict[str, tuple[dict[str, str], float]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:") and "{" in line:
            name, rest = line[5:].split("{", 1)
            labels_text, value = rest.rsplit("} ", 1)
            labels = dict(item.split("=", 1) for item in labels_text.split(",") if item)
            out.setdefault(name, ({k: v.strip('"') for k, v in labels.items()},
                                  float(value)))
    return out


def complete(url: str, headers: dict[str, str] | None = None, **fields: Any) -> httpx.Response:
    body = {"model": SMOL, "prompt": "Count with me:", "max_tokens": 8, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


# -- ready for routers ---------------------------------------------------------------------


def test_health_is_503_while_the_engine_loads_then_200(server):
    url, _ = server
    r = answer(url, "/health")
    assert r is not None and r.status_code == 503, "the server was ready before a check"
    assert r.json()["error"]["code"] == "engine_loading"
    refused = complete(url)  # a request while loading: 503, not a hang
    assert refused.status_code == 503 and "loading" in refused.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 503
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    # The app's client, started now, waits for the engine instead of failing.
    app_client = RemoteClient(url)
    stages: list[str] = []
    try:
        info = app_client.start(lambda stage, fraction: stages.append(stage))
        assert info.block_size == 16 and info.max_len == 1024
        assert any("loading" in stage for stage in stages)
    finally:
        app_client.close()
    ready(url)
    assert complete(url).status_code == 200


def test_a_model_that_fails_to_load_ends_serve_with_its_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", "from minivllm.cli import main; main()", "serve",
         str(tmp_path / "no-model"), "--port", "0"], capture_output=True, text=True,
        timeout=300, cwd=tmp_path)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("minivllm serve: ") and "no-model" in last
    assert "Traceback" not in done.stderr


def test_sigterm_while_loading_stops_the_load_and_exits_0(tmp_path, smollm2_path):
    port = free_port()
    with open(tmp_path / "server.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from minivllm.cli import main; main()", "serve",
             str(smollm2_path), "--stand-in-ms", "0.1", "20", "--stand-in-load-s", "600",
             "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: (r := answer(url, "/health")) is not None and r.status_code == 503,
                 300, "/health 503")
        wait_for(lambda: descendants(proc.pid), 60, "the engine process")
        engine = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, (tmp_path / "server.log").read_text()
        assert not [p for p in engine if Path(f"/proc/{p}").exists()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_vllm_gauges_rise_under_load_and_fall_back_to_zero(server):
    url, _ = server
    ready(url)
    m = vllm_metrics(url)
    labels, _ = m["cache_config_info"]
    assert labels["block_size"] == "16" and int(labels["num_gpu_blocks"]) > 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert m[name][0]["model_name"] == SMOL
    # 4 long requests on 2 sequence slots: 2 run and 2 wait.
    done: list[int] = []
    threads = [threading.Thread(target=lambda: done.append(complete(
        url, max_tokens=150, ignore_eos=True).status_code)) for _ in range(4)]
    for t in threads:
        t.start()
    peak = {"num_requests_running": 0.0, "num_requests_waiting": 0.0,
            "kv_cache_usage_perc": 0.0}

    def all_rose() -> bool:
        m = vllm_metrics(url)
        for name in peak:
            peak[name] = max(peak[name], m[name][1])
        return min(peak.values()) > 0

    wait_for(all_rose, 120, f"every gauge rising (peaks {peak})")
    assert peak["num_requests_running"] <= 2
    for t in threads:
        t.join(120)
    assert done == [200] * 4
    wait_for(lambda: all(vllm_metrics(url)[name][1] == 0 for name in peak), 30,
             "every gauge back to 0")
    m = vllm_metrics(url)
    assert m["request_success_total"][1] >= 4 and m["generation_tokens_total"][1] >= 600


def test_the_apps_client_reads_vllm_names_and_the_older_minivllm_ones(server):
    url, _ = server
    ready(url)
    stats, config = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    assert stats is not None and stats.block_size == 16 and stats.num_blocks > 0
    assert config["max_model_len"] == "1024"
    older = ('minivllm:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0\n'
             'minivllm:num_requests_running{model_name="m"} 3.0\n'
             'minivllm:num_requests_waiting{model_name="m"} 2.0\n'
             'minivllm:num_kv_cache_blocks_used{model_name="m"} 5.0\n')
    stats, _ = parse_metrics(older)
    assert stats is not None
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks,
            stats.num_blocks) == (3, 2, 5, 64)


# -- vLLM's extra endpoints, headers and usage fields --------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def test_tokenize_detokenize_and_version_in_vllms_shapes(server, tokenizer):
    url, _ = server
    ready(url)
    text = "The quick brown fox jumps over the lazy dog."
    r = httpx.post(f"{url}/tokenize", json={"model": SMOL, "prompt": text,
                                            "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    ids = encode_text(tokenizer, text)
    assert out == {"count": len(ids), "max_model_len": 1024, "tokens": ids,
                   "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30).json()
    templated = render_chat_prompt(tokenizer, messages)
    assert chat["tokens"] == encode_text(tokenizer, templated) and chat["token_strs"] is None
    back = httpx.post(f"{url}/detokenize", json={"model": SMOL, "tokens": ids}, timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(ids)}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert str(10**9) in bad.json()["error"]["message"]
    both = httpx.post(f"{url}/tokenize", json={"prompt": text, "messages": messages},
                      timeout=30)
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    other = httpx.post(f"{url}/tokenize", json={"model": "gpt-4", "prompt": text}, timeout=30)
    assert other.status_code == 404
    version = httpx.get(f"{url}/version", timeout=30).json()
    assert version == {"version": importlib.metadata.version("minivllm")}


def test_x_request_id_names_the_request_is_echoed_and_logged(server):
    url, log = server
    ready(url)
    r = complete(url, headers={"X-Request-Id": "router-7"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "router-7"
    assert r.json()["id"] == "cmpl-router-7"
    usage = r.json()["usage"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                      headers={"X-Request-Id": "router-8"},
                      json={"model": SMOL, "stream": True, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "Hi"}]}) as s:
        assert s.headers["x-request-id"] == "router-8"
        ids = {json.loads(line[6:])["id"] for line in s.iter_lines()
               if line.startswith("data: {")}
    assert ids == {"chatcmpl-router-8"}
    refused = complete(url, headers={"X-Request-Id": "router-9"}, max_tokens=-1)
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "router-9"
    assert "x-request-id" not in complete(url).headers  # none asked: none sent

    def line_of(request_id: str) -> str | None:
        return next((line for line in log.read_text().splitlines()
                     if f"id={request_id} " in line), None)

    line = wait_for(lambda: line_of("cmpl-router-7"), 30, "the access-log line")
    assert '"POST /v1/completions" 200' in line
    assert (f"prompt_tokens={usage['prompt_tokens']} "
            f"completion_tokens={usage['completion_tokens']} ttft=") in line
    assert "ttft=-" not in line and "duration=" in line
    stream_line = wait_for(lambda: line_of("chatcmpl-router-8"), 30, "the stream's line")
    assert "completion_tokens=4 " in stream_line
    assert '" 400 id=cmpl-router-9 ' in wait_for(lambda: line_of("cmpl-router-9"), 30,
                                                  "the refused request's line")


def stream_chunks(url: str, **fields: Any) -> list[dict[str, Any]]:
    body = {"model": SMOL, "prompt": "Count with me:", "max_tokens": 12, "stream": True,
            **fields}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as s:
        assert s.status_code == 200
        return [json.loads(line[6:]) for line in s.iter_lines()
                if line.startswith("data: {")]


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(server):
    url, _ = server
    ready(url)
    chunks = stream_chunks(url, stream_options={"include_usage": True,
                                                "continuous_usage_stats": True})
    *with_choices, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert all(c["choices"] for c in with_choices)
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 1
    for c in with_choices:
        u = c["usage"]
        assert u["prompt_tokens"] == final["usage"]["prompt_tokens"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    plain = stream_chunks(url, stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]


def test_cached_tokens_count_the_prompts_prefix_cache_hits(server):
    url, _ = server
    ready(url)
    # A prompt of several 16-token blocks, unlike any other test's.
    prompt = " ".join(f"item{i} is number {i};" for i in range(40))

    def hits() -> float:
        return vllm_metrics(url)["prefix_cache_hits_total"][1]

    before = hits()
    first = complete(url, prompt=prompt, max_tokens=4).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = complete(url, prompt=prompt, max_tokens=4).json()["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= cached < second["prompt_tokens"] and cached % 16 == 0
    wait_for(lambda: hits() == before + cached, 30, "/metrics counting the same hits")
    streamed = stream_chunks(url, prompt=prompt, max_tokens=4,
                             stream_options={"include_usage": True})[-1]["usage"]
    assert streamed["prompt_tokens_details"] == {"cached_tokens": cached}


# -- logprobs: a real SmolLM2 server against the engine in this process ----------------------


REAL = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "2048", "--block-size",
        "16", "--num-gpu-blocks-override", "256", "--served-model-name", SMOL]


@pytest.fixture(scope="module")
def real(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("real"), [str(smollm2_path), *REAL], timeout=600,
                 stop_timeout=30) as url:
        yield url


def test_logprobs_over_http_equal_the_engines(real, smollm2, tokenizer):
    from minivllm import SamplingParams

    prompt = "The capital of France is"
    messages = [{"role": "user", "content": "Name a color."}]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    [text_lps] = smollm2.generate([prompt], params)["logprobs"]
    [chat_lps] = smollm2.generate([render_chat_prompt(tokenizer, messages)],
                                  params)["logprobs"]

    def close(a: float, b: float) -> bool:
        return abs(a - b) < 1e-3

    r = httpx.post(f"{real}/v1/completions", timeout=120, json={
        "model": SMOL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got = choice["logprobs"]
    assert got["tokens"] == [tokenizer.decode([p.token_id]) for p in text_lps]
    assert "".join(got["tokens"]) == choice["text"]
    assert all(close(a, p.logprob) for a, p in zip(got["token_logprobs"], text_lps,
                                                     strict=True))
    for top, p in zip(got["top_logprobs"], text_lps, strict=True):
        want = {tokenizer.decode([t]): v for t, v in p.top.items()}
        assert len(top) == 3 and top.keys() == want.keys()
        assert all(close(top[k], want[k]) for k in top)
    offsets = got["text_offset"]
    assert offsets[0] == 0 and offsets[1:] == [
        offsets[i] + len(t) for i, t in enumerate(got["tokens"][:-1])]

    body = {"model": SMOL, "messages": messages, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    r = httpx.post(f"{real}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.decode([p.token_id]) for p in chat_lps]
    for c, p in zip(content, chat_lps, strict=True):
        assert close(c["logprob"], p.logprob) and bytes(c["bytes"]) == c["token"].encode()
        assert [t["token"] for t in c["top_logprobs"]] == [
            tokenizer.decode([t]) for t in p.top]
        assert all(close(t["logprob"], v) for t, v in zip(c["top_logprobs"], p.top.values(),
                                                          strict=True))
    # Streamed, each chunk carries its own tokens' entries: together the same list.
    with httpx.stream("POST", f"{real}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    streamed = [c for ch in chunks for choice in ch["choices"]
                for c in ((choice.get("logprobs") or {}).get("content") or [])]
    assert [(c["token"], round(c["logprob"], 3)) for c in streamed] == [
        (c["token"], round(c["logprob"], 3)) for c in content]
    plain = httpx.post(f"{real}/v1/chat/completions", timeout=120,
                       json={**body, "logprobs": False, "top_logprobs": None})
    assert plain.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "logprobs", 21),
    ("/v1/completions", "logprobs", "3"),
    ("/v1/chat/completions", "logprobs", 2),
    ("/v1/chat/completions", "top_logprobs", -1),
])
def test_bad_logprobs_values_are_refused_by_name(server, path, field, value):
    url, _ = server
    ready(url)
    body: dict[str, Any] = {"model": SMOL, "max_tokens": 4, field: value}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
        body.setdefault("logprobs", True)
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and repr(value) in r.json()["error"]["message"]


def test_prompt_tokens_are_counted_as_they_are_prefilled(tmp_path, smollm2_path):
    # A long prompt prefilled 32 tokens a step (20 ms each): the prompt-token counter that
    # the app's panel (and a dashboard) reads moves while the prefill runs, not at the end.
    flags = ["--stand-in-ms", "0.1", "20", "--max-model-len", "1024", "--block-size", "16",
             "--max-num-batched-tokens", "32", "--served-model-name", SMOL]
    proc, url = launch_server([str(smollm2_path), *flags], tmp_path / "server.log",
                              cwd=tmp_path)
    try:
        prompt = list(range(1000, 1800))  # 800 token ids
        first_token = threading.Event()

        def stream() -> None:
            body = {"model": SMOL, "prompt": prompt, "max_tokens": 4, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"text":""' not in line:
                        first_token.set()

        counted = lambda: vllm_metrics(url).get("prompt_tokens_total", ({}, 0.0))[1]  # noqa: E731
        before = counted()
        thread = threading.Thread(target=stream)
        thread.start()
        seen = []
        while not first_token.is_set() and thread.is_alive():
            seen.append(counted() - before)
        thread.join(120)
        assert any(0 < n < len(prompt) for n in seen), seen  # part of the prompt, counted
        assert counted() - before == len(prompt)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
