"""A request's outputs on their way to the consumer: `AsyncOutputs` (the queue an output
callback fills from any thread and one asyncio loop reads), `OutputStream` (the async
iterator a face reads, `EngineClient.generate`) and `merge_outputs` (outputs that queued
up, read as one)."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from .protocol import GenerateRequest, RequestOutput


class _LoopWaker:
    """Wakes the `AsyncOutputs` of one event loop that got outputs from another thread,
    with one `call_soon_threadsafe` for all of them: the engine thread hands out a step's
    outputs for N requests with one wake-up of the loop (each one writes to the loop's
    self-pipe, a system call), not N."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[AsyncOutputs] = []
        self._scheduled = False

    def wake(self, target: AsyncOutputs) -> None:
        with self._lock:
            self._pending.append(target)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass

    def _run(self) -> None:
        with self._lock:
            targets, self._pending = self._pending, []
            self._scheduled = False
        for target in targets:
            target._wake()


_WAKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = (
    weakref.WeakKeyDictionary())


def _waker(loop: asyncio.AbstractEventLoop) -> _LoopWaker:
    waker = _WAKERS.get(loop)
    if waker is None:
        waker = _WAKERS[loop] = _LoopWaker(loop)
    return waker


class AsyncOutputs:
    """A request's outputs handed from any thread to one asyncio loop.

    `put` is thread-safe and wakes the loop at most once per read: after one wake-up,
    later outputs only queue until the consumer takes them, so a consumer that reads at
    its own pace (the chat app reads once a frame) gets everything since its last read
    in one piece and costs the loop one wake-up per read, not one per engine step.
    Create it on the loop's thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._waker = _waker(loop)
        self._items: deque[RequestOutput] = deque()
        self._lock = threading.Lock()
        self._event = asyncio.Event()
        self._wake_pending = False
        self._finished = False
        self._on_end: Callable[[], None] | None = None

    def put(self, output: RequestOutput) -> None:
        with self._lock:
            self._items.append(output)
            self._finished = self._finished or output.finished
            # The last output always wakes the loop: a consumer reading at its own pace
            # learns at once that the request ended (`on_end`).
            if self._wake_pending and not output.finished:
                return
            self._wake_pending = True
        self._waker.wake(self)

    def on_end(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the loop as the last output arrives (at once if it has)."""
        if self._finished:
            callback()
        else:
            self._on_end = callback

    def _wake(self) -> None:
        self._event.set()
        if self._finished and self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end()

    async def get_batch(self) -> list[RequestOutput]:
        while True:
            with self._lock:
                if self._items:
                    batch = list(self._items)
                    self._items.clear()
                    self._wake_pending = False  # the next put wakes the loop again
                    return batch
                self._event.clear()
            await self._event.wait()


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one (text and tokens joined, last state)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return RequestOutput(
        request_id=last.request_id,
        text="".join(o.text for o in outputs),
        token_ids=[t for o in outputs for t in o.token_ids],
        finished=last.finished,
        finish_reason=last.finish_reason,
        error=last.error,
        num_prompt_tokens=last.num_prompt_tokens,
        num_generated_tokens=last.num_generated_tokens,
        accepted=any(o.accepted for o in outputs),
        rejected=last.rejected,
        opens_thinking=any(o.opens_thinking for o in outputs),
        at=last.at,
        first_at=outputs[0].since,
        num_cached_tokens=max(o.num_cached_tokens for o in outputs),
        logprobs=(None if all(o.logprobs is None for o in outputs)
                  else [p for o in outputs for p in o.logprobs or ()]),
        prompt_logprobs=next((o.prompt_logprobs for o in outputs
                              if o.prompt_logprobs is not None), None),
    )


def stream_outputs(client: Any, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
    """`EngineClient.generate` for any client with `add_request`/`abort`: the request is
    queued at once (call it on the event loop that reads the stream); its outputs come as
    they are read (the acceptance alone, then merged batches); leaving the loop early
    aborts the request."""
    outputs = AsyncOutputs(asyncio.get_running_loop())
    client.add_request(request, outputs.put)
    return OutputStream(_read_outputs(client, request, outputs), outputs)


class OutputStream:
    """A request's stream of outputs (an async iterator, closed with `aclose`), which also
    tells a consumer reading at its own pace when the request has ended: `on_end(callback)`
    calls `callback` on the loop as the last output arrives, before it is read."""

    def __init__(self, outputs: AsyncIterator[RequestOutput], queue: AsyncOutputs) -> None:
        self._outputs = outputs
        self._queue = queue

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        await self._outputs.aclose()

    def on_end(self, callback: Callable[[], None]) -> None:
        self._queue.on_end(callback)


async def _read_outputs(client: Any, request: GenerateRequest, outputs: AsyncOutputs
                        ) -> AsyncIterator[RequestOutput]:
    finished = False
    try:
        while not finished:
            batch = await outputs.get_batch()
            finished = batch[-1].finished
            if batch[0].accepted and len(batch) > 1 and not batch[0].finished:
                yield batch[0]
                batch = batch[1:]
            yield merge_outputs(batch)
    finally:
        if not finished:
            client.abort(request.request_id)
