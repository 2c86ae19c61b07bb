"""Prometheus metrics under vLLM's own names (`vllm:` prefix, label `model_name`), so a
router or dashboard set up for vLLM replicas reads ours unchanged; the few figures vLLM
has no metric for keep a `minivllm:` prefix.

Request-level figures (token counters, TTFT, inter-token latency, end-to-end latency)
are observed by the server as outputs arrive. Engine gauges (running / waiting requests,
KV cache usage, prefix cache) are read from the front end's latest stats snapshot when
Prometheus scrapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# The `_created` series double every counter and histogram for no use of ours.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineCollector(Collector):
    """Gauges and engine-wide counters from the front end, read at scrape time."""

    def __init__(self, frontend: Any, model_name: str) -> None:
        self.frontend = frontend
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        values = [self.model_name]
        stats = self.frontend.stats()
        info = self.frontend.info
        if info is not None:
            g = GaugeMetricFamily("vllm:cache_config_info", "KV cache and engine configuration",
                                  labels=["block_size", "num_gpu_blocks", "device", "dtype",
                                          "world_size", "max_model_len"])
            g.add_metric([str(info.block_size), str(info.num_blocks), info.device, info.dtype,
                          str(info.world_size), str(info.max_len)], 1.0)
            yield g
        if stats is None:
            return
        if getattr(self.frontend, "error", None) is not None:
            # A dead engine runs nothing and holds nothing: its last snapshot is stale.
            stats = dataclasses.replace(stats, num_running=0, num_waiting=0,
                                        num_used_blocks=0, prompt_tokens_per_s=0.0,
                                        generation_tokens_per_s=0.0)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        yield gauge("vllm:num_requests_running", "Requests in the running batch",
                    stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                    stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 means 100 percent)",
                    stats.kv_cache_usage)
        yield gauge("minivllm:num_kv_cache_blocks_used", "KV cache blocks in use",
                    stats.num_used_blocks)
        yield gauge("minivllm:num_kv_cache_blocks", "KV cache blocks in the pool",
                    stats.num_blocks)
        yield gauge("minivllm:prefix_cache_hit_rate",
                    "Share of prompt tokens found in the prefix cache",
                    stats.prefix_cache_hit_rate)
        yield gauge("minivllm:avg_prompt_throughput_toks_per_s",
                    "Prompt tokens per second (1 s window)", stats.prompt_tokens_per_s)
        yield gauge("minivllm:avg_generation_throughput_toks_per_s",
                    "Generated tokens per second (1 s window)", stats.generation_tokens_per_s)
        c = CounterMetricFamily("vllm:num_preemptions", "Preemptions since start",
                                labels=labels)
        c.add_metric(values, stats.num_preemptions)
        yield c
        # As the engine computes them, chunk by chunk: a long prompt's prefill shows in
        # the prompt throughput while it runs, not when its request ends.
        p = CounterMetricFamily("vllm:prompt_tokens", "Prompt tokens computed (prefilled)",
                                labels=labels)
        p.add_metric(values, stats.num_prompt_tokens)
        yield p
        counters = getattr(self.frontend, "prefix_cache_counters", None)
        pc = counters() if counters is not None else None
        if pc is not None:
            q = CounterMetricFamily("vllm:prefix_cache_queries",
                                    "Prompt tokens looked up in the prefix cache", labels=labels)
            q.add_metric(values, pc.queries)
            yield q
            h = CounterMetricFamily("vllm:prefix_cache_hits",
                                    "Prompt tokens found in the prefix cache", labels=labels)
            h.add_metric(values, pc.hits)
            yield h


class ServerMetrics:
    """One registry per server (tests start several in one process)."""

    def __init__(self, frontend: Any, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(frontend, model_name))
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: list[str] = ()) -> Counter:
            return Counter(f"vllm:{name}", doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"vllm:{name}", doc, labels, buckets=buckets,
                             registry=self.registry)

        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.request_success = counter("request_success", "Requests finished, by reason",
                                       ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency",
                             _E2E_BUCKETS)
        self._model = model_name
        # The labelled children, looked up once (labels() per token costs a dict lookup
        # under a lock on the event loop).
        self.generation_tokens_of = self.generation_tokens.labels(model_name)
        self.ttft_of = self.ttft.labels(model_name)
        self.itl_of = self.itl.labels(model_name)

    def request(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's outputs (times from the engine's clock)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.start: float | None = None
        self.last: float | None = None
        self.ttft: float | None = None  # seconds from submission to the first token

    def begin(self, at: float) -> None:
        self.start = at

    def output(self, at: float, num_new_tokens: int) -> None:
        if num_new_tokens <= 0 or self.start is None:
            return
        m = self.m
        m.generation_tokens_of.inc(num_new_tokens)
        if self.last is None:
            self.ttft = max(0.0, at - self.start)
            m.ttft_of.observe(self.ttft)
            num_new_tokens -= 1
        elif num_new_tokens:
            # Several tokens arriving together share the gap evenly.
            gap = max(0.0, at - self.last) / num_new_tokens
            observe = m.itl_of.observe
            for _ in range(num_new_tokens):
                observe(gap)
        self.last = at

    def finish(self, at: float, reason: str | None) -> None:
        if self.start is None:
            return
        model = self.m._model
        self.m.request_success.labels(model, reason or "abort").inc()
        self.m.e2e.labels(model).observe(max(0.0, at - self.start))
        self.start = None
