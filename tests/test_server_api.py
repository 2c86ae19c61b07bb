"""What routers and vLLM's clients expect of `minivllm serve`: readiness on /health,
vLLM's metric names, and the extra endpoints, headers and usage fields vLLM serves.

One real `minivllm serve` process with the stand-in engine on SmolLM2's folder (the real
scheduler, block manager and tokenizer; no weights) whose load is slowed down, so that
the loading phase can be seen from outside.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from minivllm.tui.remote import parse_metrics

from minivllm.server.launch import free_port

pytestmark = pytest.mark.slow

SMOL = "smol"
LOAD_S = 15  # the stand-in's load: long enough to be seen loading from outside
STAND_IN = ["--stand-in-ms", "0.1", "20", "--stand-in-load-s", str(LOAD_S),
            "--max-model-len", "1024", "--max-num-seqs", "2", "--block-size", "16",
            "--served-model-name", SMOL]


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


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
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    ready(url)
    assert complete(url).status_code == 200


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
