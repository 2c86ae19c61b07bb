"""`RemoteClient`: a `minivllm serve` (or any OpenAI-compatible server) as an EngineClient.

`minivllm-chat --url http://HOST:PORT` runs the same app against it: each request is a
streaming POST to /v1/chat/completions (chat messages; the server applies the chat
template) or /v1/completions (a prompt); aborting a request closes its HTTP stream,
which aborts it on the server; stats come from the server's /metrics.

All HTTP work runs on one asyncio loop in a background thread, so the public methods are
safe from any thread and never block on the network.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from minivllm.frontend import (
    EngineInfo,
    EngineUnavailable,
    GenerateRequest,
    RequestOutput,
    stream_outputs,
)
from minivllm.frontend.protocol import OutputCallback, ProgressFn
from minivllm.outputs import EngineStats

# Prometheus name (minus its "vllm:" or "minivllm:" prefix) -> EngineStats field
_GAUGES = {
    "num_requests_running": "num_running",
    "num_requests_waiting": "num_waiting",
    "num_kv_cache_blocks_used": "num_used_blocks",
    "num_kv_cache_blocks": "num_blocks",
    "prefix_cache_hit_rate": "prefix_cache_hit_rate",
    "avg_prompt_throughput_toks_per_s": "prompt_tokens_per_s",
    "avg_generation_throughput_toks_per_s": "generation_tokens_per_s",
    "num_preemptions": "num_preemptions",
    "prompt_tokens": "num_prompt_tokens",
    "generation_tokens": "num_generated_tokens",
}


def parse_metrics(text: str) -> tuple[EngineStats | None, dict[str, str]]:
    """The engine stats and the cache_config_info labels in a /metrics page."""
    values: dict[str, float] = {}
    config: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        # vLLM's names under "vllm:"; servers before that named them all "minivllm:".
        name = family.name.removeprefix("vllm:").removeprefix("minivllm:")
        for sample in family.samples:
            if name == "cache_config_info":
                config = dict(sample.labels)
            elif name in _GAUGES and sample.name.removesuffix("_total").endswith(name):
                values[_GAUGES[name]] = values.get(_GAUGES[name], 0.0) + sample.value
    if "num_running" not in values:
        return None, config
    ints = {"num_running", "num_waiting", "num_used_blocks", "num_blocks", "num_preemptions",
            "num_prompt_tokens", "num_generated_tokens"}
    fields = {k: (int(v) if k in ints else float(v)) for k, v in values.items()}
    fields.setdefault("num_blocks", int(config.get("num_gpu_blocks", 0) or 0))
    stats = EngineStats(
        block_size=int(config.get("block_size", 0) or 0),
        num_blocks=fields["num_blocks"],
        num_used_blocks=fields.get("num_used_blocks", 0),
        num_running=fields.get("num_running", 0),
        num_waiting=fields.get("num_waiting", 0),
        num_preemptions=fields.get("num_preemptions", 0),
        prefix_cache_hit_rate=fields.get("prefix_cache_hit_rate", 0.0),
        prompt_tokens_per_s=fields.get("prompt_tokens_per_s", 0.0),
        generation_tokens_per_s=fields.get("generation_tokens_per_s", 0.0),
        num_prompt_tokens=fields.get("num_prompt_tokens", 0),
        num_generated_tokens=fields.get("num_generated_tokens", 0),
    )
    return stats, config


LOADING_POLL_S = 1.0  # how often start() asks a server whose engine is loading


class _Loading(Exception):
    """The server answers, but its engine is still loading."""


def _error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _error_message(response: httpx.Response, body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return str(err.get("message") or err)
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace").strip()
        return f"HTTP {response.status_code}: {text[:300]}"


class RemoteClient:
    """An `EngineClient` over HTTP. `url` is the server's root (http://HOST:PORT, with or
    without /v1); `api_key` is sent as `Authorization: Bearer KEY`."""

    def __init__(self, url: str, api_key: str | None = None, *, model: str | None = None,
                 stats_interval: float = 0.5, connect_timeout: float = 10.0) -> None:
        url = url.rstrip("/")
        self.base_url = url.removesuffix("/v1")
        self.api_key = api_key
        self.model = model
        self._stats_interval = stats_interval
        self._connect_timeout = connect_timeout
        self._info: EngineInfo | None = None
        self._stats: EngineStats | None = None
        self._error: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="minivllm-remote",
                                        daemon=True)
        self._http: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._poller: Future | None = None
        self._closed = False
        # Why the server's stats are not current (None while /metrics answers).
        self.disconnected: str | None = None

    # -- EngineClient ------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo | None:
        return self._info

    @property
    def error(self) -> str | None:
        return self._error

    def start(self, on_progress: ProgressFn | None = None) -> EngineInfo:
        progress = on_progress or (lambda stage, fraction: None)
        progress(f"connecting to {self.base_url}", 0.1)
        self._thread.start()
        try:
            while True:
                try:
                    info = self._call(self._connect(), timeout=self._connect_timeout + 5)
                    break
                except _Loading:  # the server is up, its engine not yet: wait for it
                    progress(f"{self.base_url}: the engine is loading", 0.5)
                    time.sleep(LOADING_POLL_S)
        except Exception:
            self.close()
            raise
        self._info = info
        self._poller = asyncio.run_coroutine_threadsafe(self._poll_stats(), self._loop)
        progress("connected", 1.0)
        return info

    def add_request(self, request: GenerateRequest, on_output: OutputCallback) -> None:
        if self._closed:
            on_output(RequestOutput(request.request_id, finished=True, finish_reason="error",
                                    error="the client is closed", rejected=True))
            return

        def launch() -> None:
            task = self._loop.create_task(self._stream(request, on_output))
            self._tasks[request.request_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(request.request_id, None))

        self._loop.call_soon_threadsafe(launch)

    def abort(self, request_id: str) -> None:
        def cancel() -> None:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()

        if not self._closed:
            self._loop.call_soon_threadsafe(cancel)

    def stats(self) -> EngineStats | None:
        return self._stats

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        return stream_outputs(self, request)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._thread.is_alive():
            return
        try:
            self._call(self._shutdown(), timeout=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- loop thread -------------------------------------------------------------------------

    def _call(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _connect(self) -> EngineInfo:
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers(),
            timeout=httpx.Timeout(self._connect_timeout, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
        )
        try:
            r = await self._http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"cannot reach {self.base_url}: {exc}") from None
        if r.status_code == 503 and _error_code(r) == "engine_loading":
            raise _Loading
        if r.status_code != 200:
            raise EngineUnavailable(f"{self.base_url}/v1/models: {_error_message(r, r.content)}")
        cards = r.json().get("data") or []
        if not cards:
            raise EngineUnavailable(f"{self.base_url}/v1/models lists no model")
        card = next((c for c in cards if c.get("id") == self.model), cards[0])
        self.model = str(card["id"])
        config: dict[str, str] = {}
        try:
            m = await self._http.get("/metrics")
            if m.status_code == 200:
                self._stats, config = parse_metrics(m.text)
        except httpx.HTTPError:
            pass
        return EngineInfo(
            model=f"{self.model} @ {self.base_url}",
            device=config.get("device", "remote"),
            dtype=config.get("dtype", "?"),
            world_size=int(config.get("world_size", 1) or 1),
            block_size=int(config.get("block_size", 0) or 0),
            num_blocks=int(config.get("num_gpu_blocks", 0) or 0),
            max_len=int(card.get("max_model_len") or config.get("max_model_len") or 0),
        )

    async def _poll_stats(self) -> None:
        assert self._http is not None
        while True:
            await asyncio.sleep(self._stats_interval)
            try:
                r = await self._http.get("/metrics")
            except httpx.HTTPError as exc:
                # The server may be restarting; requests report their own errors. The
                # last figures are not shown as if they were current.
                self.disconnected = f"{self.base_url} does not answer: {type(exc).__name__}"
                continue
            stats = parse_metrics(r.text)[0] if r.status_code == 200 else None
            if stats is not None:
                self._stats = stats
                self.disconnected = None
            else:
                self.disconnected = f"{self.base_url}/metrics: HTTP {r.status_code}"

    async def _shutdown(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._poller is not None:
            self._poller.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=2)
        if self._http is not None:
            await self._http.aclose()

    def _body(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        p = request.params
        body: dict[str, Any] = {
            "model": self.model, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
            "min_p": p.min_p, "max_tokens": p.max_tokens, "ignore_eos": p.ignore_eos,
        }
        if p.stop:
            body["stop"] = list(p.stop)
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.seed is not None:
            body["seed"] = p.seed
        if request.messages is not None:
            body["messages"] = request.messages
            if request.chat_template_kwargs:
                body["chat_template_kwargs"] = dict(request.chat_template_kwargs)
            return "/v1/chat/completions", body
        body["prompt"] = request.prompt
        return "/v1/completions", body

    async def _stream(self, request: GenerateRequest, on_output: OutputCallback) -> None:
        rid = request.request_id
        path, body = self._body(request)
        generated = 0
        prompt_tokens = 0
        finish: str | None = None
        accepted = False
        # A server with a reasoning parser sends the thinking apart (`reasoning_content`):
        # it goes back between <think> tags, where the app looks for it.
        in_think = False
        try:
            assert self._http is not None
            async with self._http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    on_output(RequestOutput(rid, finished=True, finish_reason="error",
                                            error=_error_message(r, await r.aread()),
                                            rejected=True, at=time.monotonic()))
                    return
                accepted = True
                on_output(RequestOutput(rid, accepted=True, at=time.monotonic()))
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        raise RuntimeError(err.get("message", str(err)))
                    usage = chunk.get("usage")
                    if usage:
                        prompt_tokens = int(usage.get("prompt_tokens", 0))
                        generated = int(usage.get("completion_tokens", generated))
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta")
                        text = (delta or {}).get("content") if delta is not None \
                            else choice.get("text")
                        thinking = (delta or {}).get("reasoning_content")
                        if thinking or (in_think and text):
                            text, in_think = _rewrapped(thinking, text, in_think)
                        ids = list(choice.get("token_ids") or ())
                        generated += len(ids)
                        if text or ids:
                            on_output(RequestOutput(rid, text or "", ids,
                                                    num_generated_tokens=generated,
                                                    at=time.monotonic()))
                        finish = choice.get("finish_reason") or finish
        except asyncio.CancelledError:
            # Leaving the `async with` closed the stream: the server aborts the request.
            on_output(RequestOutput(rid, finished=True, finish_reason="abort",
                                    num_prompt_tokens=prompt_tokens,
                                    num_generated_tokens=generated, at=time.monotonic()))
            return
        except Exception as exc:  # noqa: BLE001 - the request fails, the client serves on
            message = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeError) \
                else str(exc)
            if isinstance(exc, httpx.HTTPError):
                message = f"{self.base_url}: {type(exc).__name__}: {exc}"
            on_output(RequestOutput(rid, finished=True, finish_reason="error", error=message,
                                    rejected=not accepted, num_prompt_tokens=prompt_tokens,
                                    num_generated_tokens=generated, at=time.monotonic()))
            return
        on_output(RequestOutput(rid, finished=True, finish_reason=finish or "abort",
                                num_prompt_tokens=prompt_tokens, num_generated_tokens=generated,
                                at=time.monotonic()))


def _rewrapped(thinking: str | None, text: str | None, in_think: bool) -> tuple[str, bool]:
    """A delta's thinking and answer as one text with the <think> tags the server took
    out; and whether the text ends inside the block."""
    pieces = []
    if thinking:
        if not in_think:
            pieces.append("<think>")
            in_think = True
        pieces.append(thinking)
    if text:
        if in_think:
            pieces.append("</think>")
            in_think = False
        pieces.append(text)
    return "".join(pieces), in_think
