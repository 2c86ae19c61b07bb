"""Scale-out with existing software: two `minivllm serve` replicas behind LiteLLM's Router,
and the Kubernetes manifests in deploy/.

The replicas run the stand-in engine on SmolLM2's folder (the real server, scheduler and
tokenizer; each step costs 20 ms). The router spreads requests over both; one replica is
killed (server and engine, SIGKILL) while requests run on it, and every request still
gets its reply: the router retries the lost ones on the other replica.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import wait_for

from minivllm.server.cli import build_parser
from minivllm.server.launch import descendants, launch_server

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SMOL = "smol"
STAND_IN = ["--stand-in-ms", "0.1", "20", "--max-model-len", "1024", "--max-num-seqs", "8",
            "--served-model-name", SMOL]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture()
def replicas(tmp_path, smollm2_path):
    """Two replicas, started side by side."""
    started: list[tuple[subprocess.Popen, str]] = []
    errors: list[BaseException] = []

    def start(name: str) -> None:
        try:
            started.append(launch_server([str(smollm2_path), *STAND_IN],
                                         tmp_path / f"{name}.log", cwd=tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        yield started
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


def kill_replica(proc: subprocess.Popen) -> None:
    """SIGKILL the server and its engine process: a replica lost, not shut down."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning:pydantic._internal._generate_schema")
def test_the_router_spreads_requests_and_loses_none_when_a_replica_dies(replicas):
    # No network: LiteLLM would fetch its model price list at import.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip(
        "litellm", reason="LiteLLM is not installed (pip install -e '.[litellm]')")
    (a, url_a), (b, url_b) = replicas
    router = litellm.Router(
        model_list=[{"model_name": SMOL,
                     "litellm_params": {"model": f"openai/{SMOL}", "api_base": f"{url}/v1",
                                        "api_key": "unused"}} for url in (url_a, url_b)],
        routing_strategy="simple-shuffle",
        num_retries=3, retry_after=0,  # a failed request goes to a replica again at once
        allowed_fails=0, cooldown_time=120)  # a replica that failed is left out after

    def ask(i: int, max_tokens: int) -> tuple[str, str, int]:
        """(reply, the replica that gave it, how many times the router retried)."""
        r = router.completion(model=SMOL, max_tokens=max_tokens,
                              messages=[{"role": "user", "content": f"Count to {i}."}])
        hidden: dict[str, Any] = r._hidden_params
        retries = int((hidden.get("additional_headers") or {}).get(
            "x-litellm-attempted-retries") or 0)
        return r.choices[0].message.content, hidden["api_base"].removesuffix("/v1"), retries

    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(lambda i: ask(i, 8), range(24)))
    assert all(reply for reply, _, _ in first)
    assert {replica for _, replica, _ in first} == {url_a, url_b}
    assert metric(url_a, "vllm:request_success_total") > 0
    assert metric(url_b, "vllm:request_success_total") > 0

    # Long requests (60 steps of 20 ms); replica b dies while it runs some of them.
    with ThreadPoolExecutor(16) as pool:
        running = [pool.submit(ask, i, 60) for i in range(16)]
        wait_for(lambda: metric(url_b, "vllm:num_requests_running") >= 1, 120,
                 "requests running on replica b")
        kill_replica(b)
        second = [f.result(timeout=300) for f in running]
    assert all(reply for reply, _, _ in second)  # none lost
    retried = [(replica, retries) for _, replica, retries in second if retries]
    assert retried and all(replica == url_a for replica, _ in retried)
    print(f"\n{len(retried)} of {len(second)} requests retried on the replica left")
    # After: every request goes to the replica left.
    after = [ask(i, 4) for i in range(6)]
    assert {replica for _, replica, _ in after} == {url_a}


# -- the Kubernetes manifests ------------------------------------------------------------------


def documents(path: Path) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}


def test_the_deployment_serves_what_its_probes_service_and_pool_expect():
    k8s = documents(DEPLOY / "kubernetes" / "minivllm.yaml")
    deployment, service = k8s["Deployment"], k8s["Service"]
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["command"] == ["minivllm", "serve"]
    args = build_parser().parse_args(container["args"])  # flags `minivllm serve` takes
    [port] = container["ports"]
    assert args.port == port["containerPort"] and args.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == args.port
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]

    monitor = documents(DEPLOY / "kubernetes" / "servicemonitor.yaml")["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"

    gateway = documents(DEPLOY / "gateway" / "inferencepool.yaml")
    pool, route = gateway["InferencePool"], gateway["HTTPRoute"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": args.port}]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] > 0
    [backend] = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
