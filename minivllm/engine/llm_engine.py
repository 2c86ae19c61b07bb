"""LLMEngine: the public entry point. Requests in, tokens and text out."""

from __future__ import annotations

import atexit
import functools
import gc
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as SeqLike
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..config import EngineConfig
from ..layers.cpu_linear import weight_format
from ..layers.sampler import StepSamples
from ..outputs import Delta, EngineStats
from ..sampling_params import SamplingParams
from . import offline
from .batch import ForwardBatch, build_forward_batch
from .block_manager import BlockManager
from .model_runner import ModelRunner, StepHandle
from .output_processor import OutputProcessor
from .plan import check_pool_fits, default_plan, resolve_device, resolve_dtype
from .prompts import checked_params, max_len_for, prompt_token_ids
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence
from .step_stats import StepStats
from .structured_steps import GrammarRequests, MaskedForward
from .worker import (
    AllocateKVCache,
    Command,
    LoadModel,
    SizeKVPool,
    StepInput,
    WorkerGroup,
    tp_device,
)

T = TypeVar("T")


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    """Run under the engine's lock: another thread may abort or add a request while
    this one steps, and the scheduler's lists must not change under a step."""

    @functools.wraps(method)
    def wrapper(self: LLMEngine, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class EngineDeadError(RuntimeError):
    """The engine hit an error it cannot recover from and refuses new work."""


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not been read yet."""

    out: SchedulerOutput
    handle: StepHandle | MaskedForward


class LLMEngine:
    """Continuous-batching inference over a paged KV cache.

    The seed's API: `generate()`, or `add_prompt()` + `step()` until
    `scheduler.is_finished()`, then `exit()`. For streaming: `pop_deltas()` returns what
    every sequence gained since the previous call (the first call switches streaming
    on: from then on finished sequences are kept until a call reports them).
    """

    def __init__(
        self,
        config: EngineConfig | dict[str, Any],
        *,
        on_progress: Callable[[str, float], None] | None = None,
    ) -> None:
        self._closed = True
        self._lock = threading.RLock()
        progress = on_progress or (lambda stage, fraction: None)
        progress("reading the configuration", 0.0)
        if isinstance(config, dict):
            config = EngineConfig.from_dict(config)
        elif not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected a dict or EngineConfig, got {type(config).__name__}")
        self.device = resolve_device(config.device)
        config = default_plan(config, self.device)
        self.dtype = resolve_dtype(config.dtype, self.device, config.cpu_weight_dtype)
        # "bfloat16" / "int8" where the CPU's linears take a weight-only format, else None.
        self.cpu_weight_format = weight_format(config.cpu_weight_dtype, self.device, self.dtype)
        self.cpu_prefill_dtype: torch.dtype | None = None
        self.cpu_decode_dtype: str | None = None
        if config.world_size > 1:
            self.device = tp_device(self.device, config.world_size)  # rank 0's; checks GPUs

        self.tokenizer = None
        tokenizer_path = config.model_path
        if config.load_format == "dummy" and os.path.isdir(config.model_name_or_path):
            tokenizer_path = config.model_name_or_path  # random weights, the folder's tokenizer
        if tokenizer_path is not None and _has_tokenizer(tokenizer_path):
            from ..loader import load_tokenizer

            progress("loading the tokenizer", 0.05)
            self.tokenizer = load_tokenizer(tokenizer_path)

        self.workers: WorkerGroup | None = None  # tensor-parallel ranks 1..N-1
        try:
            if config.world_size > 1:
                progress("starting the tensor-parallel workers", 0.05)
                self.workers = WorkerGroup(config, self.device, self.dtype)
            self.runner, _ = self._on_all_ranks(
                LoadModel(),
                lambda: ModelRunner(config, self.device, self.dtype, on_progress=progress),
            )
            self.cpu_weight_format = self.runner.cpu_weight_format  # None if it did not build
            # torch.bfloat16 where a prefill's products and attention run in bf16, else None
            self.cpu_prefill_dtype = self.runner.cpu_prefill_dtype
            # "int8" where the weight-only products take int8 activations, else None
            self.cpu_decode_dtype = self.runner.cpu_decode_dtype
            progress("sizing the KV cache", 0.4)
            mine, theirs = self._on_all_ranks(SizeKVPool(), self.runner.size_kv_pool)
            num_blocks = min([mine, *theirs])  # every rank holds every block
            check_pool_fits(config, num_blocks, self.runner.bytes_per_block)
            self._on_all_ranks(
                AllocateKVCache(num_blocks), lambda: self.runner.allocate_kv_cache(num_blocks)
            )
        except BaseException:  # Ctrl-C or an error while loading: leave no worker behind
            if self.workers is not None:
                self.workers.close()
            raise
        self.config = EngineConfig(**{**config.__dict__, "max_cached_blocks": num_blocks})

        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_sequences,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
        )
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self._next_seq_id = 0
        self._seqs: dict[int, Sequence] = {}  # unfinished, or finished and not yet reported
        self._collecting: set[int] = set()  # ids that generate() will read when finished
        self.output_processor = OutputProcessor(self.tokenizer)
        self._streaming = False
        self._step_stats = StepStats()
        self._dead: str | None = None
        # Overlapped scheduling: step N+1 is scheduled and launched before step N's
        # tokens are read, so the host's work hides behind the device's.
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.device.type == "cuda"
        )
        self._in_flight: _InFlight | None = None
        # Requests whose step's masks failed: they end when that step is read.
        self._mask_failing: list[Sequence] = []
        # Structured outputs: the backend is built at the first constrained request.
        self._grammars = GrammarRequests(
            self.tokenizer, self.config.model.vocab_size, sorted(self.eos_token_ids),
            pinned=self.device.type == "cuda",
        )
        self._closed = False
        atexit.register(self.exit)
        progress("ready", 1.0)

    # -- requests ------------------------------------------------------------------------

    @_locked
    def add_prompt(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
    ) -> int:
        """Queue a request; returns its sequence id. Bad input raises ValueError/TypeError."""
        self._check_alive()
        params = checked_params(sampling_params)
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.config.model.vocab_size)
        max_len = max_len_for(len(token_ids), params, self.config)
        seq = Sequence(self._next_seq_id, token_ids, params, max_len)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: needs the model's tokenizer; this "
                                 "model has none")
            self._grammars.add(seq)
        self._next_seq_id += 1
        self.output_processor.add(seq)
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    @_locked
    def prepare_structured_outputs(self) -> bool:
        """Start building the grammar backend's view of the vocabulary (xgrammar's
        tokenizer info: 1-2 s on a CPU) on its thread, so that the first constrained
        request does not wait for it (the server calls this once the engine is loaded).
        Returns at once; False where there is nothing to prepare (no tokenizer, or
        xgrammar not installed: the first constrained request then says so)."""
        return self._grammars.prepare()

    def num_prompt_tokens(self, seq_id: int) -> int:
        """The prompt length of a request not yet reported as finished (0 if unknown)."""
        seq = self._seqs.get(seq_id)
        return seq.num_prompt_tokens if seq is not None else 0

    @_locked
    def abort(self, seq_id: int) -> None:
        """Stop a request now; its blocks are freed at once. Unknown or ended ids are ignored."""
        seq = self._seqs.get(seq_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self._forget_if_unstreamed(seq)

    # -- stepping ------------------------------------------------------------------------

    @_locked
    def step(self) -> tuple[list[tuple[int, list[int]]], int, bool]:
        """Run one scheduler step.

        Returns (finished, num_tokens, is_prefill): the sequences that finished this step
        as (seq_id, completion token ids), the tokens computed, and whether the step did
        prefill work.

        With `async_scheduling` the step scheduled and launched here runs on the device
        while the previous one's tokens are read and applied; `finished` then reports
        what the previous step ended. The greedy tokens are the same either way.
        """
        self._check_alive()
        start = time.perf_counter()
        failed = self._poll_grammars() if self._grammars.compiling else []
        in_flight = self._in_flight
        out = self.scheduler.schedule(masked_in_flight=in_flight is not None
                                      and isinstance(in_flight.handle, MaskedForward))
        launched = None
        if not out.is_empty:
            if self._in_flight is not None:
                # Its sampling goes before this step's forward (which reads its tokens).
                self._sample_if_masked(self._in_flight, [out])
            launched = _InFlight(out, self._guarded([out], self._launch, out))
        finished = failed
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            finished += self._apply(previous, start)
        if launched is not None:
            masked = launched.handle
            if isinstance(masked, MaskedForward) and masked.mask is None:
                # The grammars now hold the previous step's tokens: the mask thread fills
                # this step's mask while the device runs its forward.
                masked.mask = self._grammars.fill_bitmask(out, masked.rows)
            # A step with penalties, min_tokens or logprobs is read at once: those read
            # the sequence's tokens on the host (the newest must not be in flight) and
            # its logprobs are copied back whole.
            if not self.async_scheduling or _needs_sync(out):
                self._in_flight = None
                finished += self._apply(launched, start)
        if self._in_flight is not None and self.scheduler.is_finished():
            # Everything ended (or was aborted) while the last step ran: nothing will
            # read it; wait for it so an idle engine leaves no work on the device.
            last, self._in_flight = self._in_flight, None
            self._apply(last, start)
        if launched is None:
            if (self._grammars.compiling and self._in_flight is None
                    and not self.scheduler.running):
                # Nothing to run until a grammar is ready: wait for one, not spin.
                self._grammars.wait(timeout=0.01)
            return finished, 0, False
        return finished, out.num_tokens, out.is_prefill

    def _poll_grammars(self) -> list[tuple[int, list[int]]]:
        """Matchers for the sequences whose grammar compiled; those whose grammar failed
        end with an error (returned as finished)."""
        failed = []
        for seq in self._grammars.poll():
            self.scheduler.finish(seq, "error")
            failed.append((seq.seq_id, seq.completion_token_ids))
            self._forget_if_unstreamed(seq)
        return failed

    def _apply(self, step: _InFlight, start: float) -> list[tuple[int, list[int]]]:
        """Read a launched step's tokens and apply them; returns the sequences it ended."""
        out = step.out
        pending = [out] if self._in_flight is None else [out, self._in_flight.out]
        self._sample_if_masked(step, pending)
        sampled = self._guarded(pending, self._collect, step.handle)
        # Before their tokens would be kept.
        finished = self._end_mask_failures() if self._mask_failing else []
        prompt_tokens = sum(s.num_tokens for s in out.scheduled if s.is_prefill)
        _record_logprobs(out, sampled)
        grown = self.scheduler.update_from_output(out, sampled.token_ids)
        now = time.perf_counter()
        for seq in grown:
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.grammar is not None and not seq.grammar.accept_token(seq.last_token):
                # Cannot happen with the mask applied; a matcher out of step fails loudly.
                seq.error = f"structured_outputs: the grammar rejected token {seq.last_token}"
                self.scheduler.finish(seq, "error")
            elif (seq.grammar is not None and seq.last_token in self.eos_token_ids
                  and seq.grammar.is_terminated()):
                # It took its end token (the grammars end on the eos ids): nothing may
                # follow, whatever ignore_eos or min_tokens ask.
                self.scheduler.finish(seq, "stop")
            reason = None if seq.is_finished else self._finish_reason(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            if seq.is_finished:
                finished.append((seq.seq_id, seq.completion_token_ids))
                self._forget_if_unstreamed(seq)
        self._step_stats.record(start, now, prompt_tokens, len(grown), len(out.scheduled))
        return finished

    def _guarded(self, outs: list[SchedulerOutput], fn: Callable[..., T], *args: Any) -> T:
        """Run a launch or collect; if it fails, end every sequence of the steps involved
        (and, with tensor parallelism, the engine: the ranks are out of step)."""
        try:
            return fn(*args)
        except BaseException as e:
            if self.workers is not None:
                self._dead = f"the tensor-parallel group failed: {type(e).__name__}: {e}"
                self.workers.close()
            if self._in_flight is not None and self._in_flight.out in outs:
                self._in_flight = None
            if not isinstance(e, Exception):
                raise
            seqs = [item.seq for o in outs for item in o.scheduled]
            for seq in seqs:
                if not seq.is_finished:
                    seq.error = f"{type(e).__name__}: {e}"
                    self.scheduler.finish(seq, "error")
            raise RuntimeError(
                f"engine step failed ({type(e).__name__}: {e}); the "
                f"{len({id(s) for s in seqs})} sequences in it were ended"
            ) from e

    def _on_all_ranks(self, command: Command, local: Callable[[], T]) -> tuple[T, list[Any]]:
        """Run `local` here (rank 0) while every tensor-parallel worker runs `command`;
        returns local's result and the workers' values."""
        if self.workers is None:
            return local(), []
        return self.workers.run(command, local)

    def _launch(self, out: SchedulerOutput) -> StepHandle | MaskedForward:
        """Launch a step: forward and sampling, or where rows sample under a grammar, the
        forward only (the engine samples it once their bitmask is filled)."""
        batch = build_forward_batch(out, self.config.block_size, self.eos_token_ids)
        rows = self._grammars.rows(out)
        mask = None
        if rows:
            batch.bitmask_rows = rows
            if all(out.scheduled[i].fill_from is None for i in rows):
                # Their matchers hold every token sampled (none is in flight): the mask
                # thread fills it while the forward runs.
                mask = self._grammars.fill_bitmask(out, rows)
        local: Callable[[], Any] = functools.partial(
            self.runner.forward if rows else self.runner.launch, batch)
        if self.workers is None:
            self.scheduler.finished_ids.clear()  # only tensor-parallel workers need them
            launched = local()
        else:
            launched = self.workers.run_nowait(self._step_input(out, batch), local)
        return MaskedForward(launched, rows, mask) if rows else launched

    def _sample_if_masked(self, step: _InFlight, outs: list[SchedulerOutput]) -> None:
        """Launch a masked step's sampling (waiting for its mask) if it is still due."""
        masked = step.handle
        if not isinstance(masked, MaskedForward):
            return
        assert masked.mask is not None
        try:
            bitmask = masked.mask.result()
        except Exception as e:  # noqa: BLE001 - the grammar's requests fail, the rest go on
            bitmask = self._fail_masked_rows(step.out, masked.rows, e)
        step.handle = self._guarded([step.out, *outs], self.runner.sample, masked.forward,
                                    bitmask)

    def _fail_masked_rows(self, out: SchedulerOutput, rows: list[int],
                          error: Exception) -> torch.Tensor:
        """The grammar backend failed on a step's masks: the requests of `rows` end with
        the error when the step is read (their tokens from it dropped; a step already
        scheduled may hold them); returns a bitmask that lets the step sample every row,
        the others as they would have."""
        for i in rows:
            seq = out.scheduled[i].seq
            if not seq.is_finished:
                seq.error = f"structured_outputs: {type(error).__name__}: {error}"
                self._mask_failing.append(seq)
        assert self._grammars.compiler is not None  # it filled the masks that failed
        return self._grammars.compiler.all_ones(len(out.scheduled))

    def _end_mask_failures(self) -> list[tuple[int, list[int]]]:
        """End the requests whose masks failed; returns them as `_apply` reports ends."""
        ended = []
        for seq in self._mask_failing:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
                ended.append((seq.seq_id, seq.completion_token_ids))
                self._forget_if_unstreamed(seq)
        self._mask_failing.clear()
        return ended

    def _step_input(self, out: SchedulerOutput, batch: ForwardBatch) -> StepInput:
        """What the workers need for this step beyond what they hold already."""
        tables = []
        for item in out.scheduled:
            seq = item.seq
            keep = seq.num_synced_blocks
            if keep < len(seq.block_table):
                tables.append((seq.seq_id, keep, seq.block_table[keep:]))
                seq.num_synced_blocks = len(seq.block_table)
        finished, self.scheduler.finished_ids = self.scheduler.finished_ids, []
        return StepInput(
            seq_ids=[item.seq.seq_id for item in out.scheduled],
            starts=[item.start for item in out.scheduled],
            num_tokens=[item.num_tokens for item in out.scheduled],
            input_ids=batch.input_ids,
            fill_rows=batch.fill_rows,
            tables=tables,
            finished=finished,
            prompt_rows={
                row: len(x.prompt_targets) for row, x in batch.extras.items() if x.prompt_targets
            },
        )

    def _collect(self, handle: StepHandle) -> StepSamples:
        return self.runner.collect(handle)

    def _finish_reason(self, seq: Sequence) -> str | None:
        token = seq.last_token
        params = seq.params
        if seq.num_completion_tokens < params.min_tokens:  # eos and stop ids were masked
            return "length" if seq.num_tokens >= seq.max_len else None
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self.output_processor.hit_stop_string(seq):
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= seq.max_len:
            return "length"
        return None

    def _forget_if_unstreamed(self, seq: Sequence) -> None:
        if not self._streaming and seq.seq_id not in self._collecting:
            self._forget(seq.seq_id)

    def _forget(self, seq_id: int) -> Sequence | None:
        self.output_processor.remove(seq_id)
        return self._seqs.pop(seq_id, None)

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the engine was shut down with exit()")
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # -- streaming -----------------------------------------------------------------------

    @_locked
    def pop_deltas(self) -> list[Delta]:
        """What each sequence gained since the last call; finished ones are then dropped."""
        self._streaming = True
        deltas = []
        for seq in list(self._seqs.values()):
            if seq.seq_id in self._collecting:
                continue  # generate() reads these itself
            delta = self.output_processor.delta(seq)
            if delta is None:
                continue
            deltas.append(delta)
            if seq.is_finished:
                self._forget(seq.seq_id)
        return deltas

    # -- batch API -----------------------------------------------------------------------

    def generate(
        self,
        prompts: SeqLike[str] | SeqLike[list[int]],
        sampling_params: SamplingParams | SeqLike[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> dict[str, list]:
        """Run prompts to completion; returns {"text": [...], "token_ids": [...]} in order."""
        return offline.generate(self, prompts, sampling_params, use_tqdm)

    def chat(
        self,
        messages: SeqLike[dict[str, Any]] | SeqLike[SeqLike[dict[str, Any]]],
        sampling_params: SamplingParams | SeqLike[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        enable_thinking: bool | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, list]:
        """Generate replies to one conversation (a list of {"role", "content"} messages)
        or to a list of them, through the tokenizer's chat template; returns what
        `generate` returns. `enable_thinking` (Qwen3's templates) and
        `chat_template_kwargs` are passed to the template."""
        prompts = offline.chat_prompts(
            self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, enable_thinking=enable_thinking,
            chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- introspection -------------------------------------------------------------------

    def prompt_progress(self, seq_id: int) -> tuple[int, int] | None:
        """(prompt tokens computed so far, prompt tokens) of a live request, or None.

        For a progress display during a long (chunked) prefill; a prefix-cache hit counts
        as computed. Reads two ints, so another thread may call it while steps run.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        n = seq.num_prompt_tokens
        return min(seq.num_computed_tokens, n), n

    def stats(self) -> EngineStats:
        return self._step_stats.snapshot(self.block_manager, self.scheduler)

    def exit(self) -> None:
        """Release the engine. Safe to call twice; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.exit)
        for seq in list(self._seqs.values()):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._in_flight = None
        self._grammars.close()
        if self.workers is not None:
            self.workers.close()
        self.runner.release()  # the model, the KV pool and the CUDA graphs
        self.runner = None
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


def _needs_sync(out: SchedulerOutput) -> bool:
    """Whether a step must be read before the next one is scheduled (see `step`). (A
    sequence under a grammar need not: the next step's forward runs while its token is
    read, and only that step's sampling waits for the mask.)"""
    return any(item.seq.params.needs_extras for item in out.scheduled)


def _record_logprobs(out: SchedulerOutput, sampled: StepSamples) -> None:
    """Keep the logprobs of the tokens this step adds (called before the scheduler
    appends them) and of the prompt positions it computed (by position: a preempted
    sequence computes them again)."""
    for i, item in enumerate(out.scheduled):
        seq = item.seq
        if seq.is_finished:  # aborted while its step ran
            continue
        if sampled.prompt_logprobs and i in sampled.prompt_logprobs:
            first = item.start + 1
            chunk = sampled.prompt_logprobs[i]
            seq.prompt_logprobs[first : first + len(chunk)] = chunk
        if sampled.logprobs is not None and item.samples and seq.logprobs is not None:
            seq.logprobs.append(sampled.logprobs[i])


def _has_tokenizer(path: str) -> bool:
    """A checkpoint without tokenizer files still serves token-id prompts."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return any(os.path.exists(os.path.join(path, n)) for n in names)
