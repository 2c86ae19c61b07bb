"""The `n` choices of one request: child requests of the engine, read as one stream.

Child 0 goes to the engine first and the others once it has its first token: by then its
prompt is prefilled and the prompt's full KV blocks are in the prefix cache, so the
others find them there and compute only the last, partial block (one prefill, however
many choices). With a `seed`, child i samples with `seed + i` (vLLM's derivation): the
choices differ, and the same request gives the same choices again. Leaving the stream
early (the client went away) aborts every child still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..frontend import GenerateRequest, RequestOutput, merge_outputs
from ..frontend.outputs import AsyncOutputs
from ..outputs import TokenLogprob
from .metrics import RequestTimer


def child_request(request: GenerateRequest, index: int, n: int) -> GenerateRequest:
    """Choice `index` of `n`: its own id and seed. Only child 0 asks for the prompt's
    logprobs (they are the same for every choice, and asking for them would keep the
    others from reusing the cached prompt)."""
    if n == 1:
        return request
    params = dataclasses.replace(request.params)
    if params.seed is not None:
        params.seed += index
    if index > 0:
        params.prompt_logprobs = None
    return dataclasses.replace(request, request_id=f"{index}_{request.request_id}",
                               params=params)


@dataclasses.dataclass
class Choice:
    """One child: its request, its metrics timer and what it has produced so far."""

    index: int
    request: GenerateRequest
    timer: RequestTimer
    started: bool = False
    accepted: bool = False
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0


class Choices:
    """Submits the children of one request and reads their outputs as one stream of
    `(choice, output)` pairs, each output merged from what the child gained since its
    previous one. Create it on the event loop that reads it."""

    def __init__(self, client: Any, request: GenerateRequest, n: int,
                 timer: Callable[[], RequestTimer]) -> None:
        self.client = client
        self.choices = [Choice(i, child_request(request, i, n), timer()) for i in range(n)]
        self._by_id = {c.request.request_id: c for c in self.choices}
        self._outputs = AsyncOutputs(asyncio.get_running_loop())
        self._held: list[RequestOutput] = []
        self._rest_submitted = n == 1
        self.num_prompt_tokens = 0
        self.opens_thinking = False  # the engine templated a prompt that opens <think>
        # The prompt's logprobs (child 0 asks for them), for echo.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def _submit(self, choice: Choice) -> None:
        choice.started = True
        choice.timer.begin(time.monotonic())
        self.client.add_request(choice.request, self._outputs.put)

    async def start(self) -> RequestOutput:
        """Submit child 0; return its first output: the acceptance, or a refusal."""
        self._submit(self.choices[0])
        batch = await self._outputs.get_batch()
        first, self._held = batch[0], batch[1:]
        self.opens_thinking = first.opens_thinking
        self._take(self.choices[0], first)
        return first

    def _take(self, choice: Choice, out: RequestOutput) -> None:
        choice.timer.output(out.at, len(out.token_ids))
        if out.accepted:
            choice.accepted = True
        if out.num_prompt_tokens > self.num_prompt_tokens:
            self.num_prompt_tokens = out.num_prompt_tokens
        choice.num_generated_tokens = out.num_generated_tokens
        if out.num_cached_tokens > choice.num_cached_tokens:
            choice.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            choice.finished = True
            choice.finish_reason, choice.error = out.finish_reason, out.error
            if choice.accepted:  # a refused request counts in no request metric
                choice.timer.finish(time.monotonic(), out.finish_reason)

    def _submit_rest(self, first: RequestOutput) -> list[tuple[Choice, RequestOutput]]:
        """Child 0 has its first token (or ended): start the others. If it ended without
        any (aborted, failed), so do they, unstarted."""
        self._rest_submitted = True
        ended = []
        for choice in self.choices[1:]:
            if first.finished and first.finish_reason not in ("stop", "length"):
                out = RequestOutput(choice.request.request_id, finished=True,
                                    finish_reason=first.finish_reason,
                                    error=first.error, num_prompt_tokens=first.num_prompt_tokens,
                                    at=first.at)
                choice.finished = True
                choice.finish_reason, choice.error = out.finish_reason, out.error
                ended.append((choice, out))
            else:
                self._submit(choice)
        return ended

    async def stream(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every child's outputs until all have finished (after `start`)."""
        batch, self._held = self._held, []
        try:
            if len(self.choices) == 1:  # no grouping by child: the common case, per token
                choice = self.choices[0]
                while True:
                    if batch:
                        out = merge_outputs(batch)
                        self._take(choice, out)
                        yield choice, out
                        if choice.finished:
                            return
                    batch = await self._outputs.get_batch()
            while True:
                groups: dict[str, list[RequestOutput]] = {}
                for out in batch:
                    groups.setdefault(out.request_id, []).append(out)
                for request_id, outs in groups.items():
                    choice = self._by_id[request_id]
                    out = merge_outputs(outs)
                    self._take(choice, out)
                    yield choice, out
                    if not self._rest_submitted and (out.token_ids or out.finished):
                        for ended in self._submit_rest(out):
                            yield ended
                if all(c.finished for c in self.choices):
                    return
                batch = await self._outputs.get_batch()
        finally:
            now = time.monotonic()
            for choice in self.choices:
                if choice.started and not choice.finished:
                    self.client.abort(choice.request.request_id)
                    choice.timer.finish(now, "abort")

    @property
    def num_generated_tokens(self) -> int:
        return sum(c.num_generated_tokens for c in self.choices)

    @property
    def ttft(self) -> float | None:
        """The first token's time of the choice that had one first."""
        times = [c.timer.ttft for c in self.choices if c.timer.ttft is not None]
        return min(times) if times else None

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: the prompt counted once, every choice's completion tokens;
        `cached_tokens`, the most prompt tokens a choice found in the prefix cache (with
        n > 1, the later choices find the first one's prompt there)."""
        prompt, completion = self.num_prompt_tokens, self.num_generated_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {
                    "cached_tokens": max(c.num_cached_tokens for c in self.choices)}}
