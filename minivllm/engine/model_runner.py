"""Owns the model, the KV pool and the sampler of one rank; runs one step at a time:
its inputs to the device (or a graph's static inputs), the forward (graph replay, the CPU
decode step or eager), the sampling and the tokens' way back to the host.

Loading the model is model_loading.py's job, sizing and allocating the pool kv_pool.py's,
the sampler's tensors sampling_inputs.py's and the graphs cuda_graph.py's."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from minivllm.kernels.tuning import graph_picks

from ..config import EngineConfig
from ..distributed import broadcast_from_rank0, get_tp_rank, get_tp_size
from ..layers.attention import (
    Attention,
    AttentionMetadata,
    attention_metadata,
    make_backend,
)
from ..layers.cpu_linear import WideRows, wide_rows
from ..layers.ops import bind_kernels, select_kernels, with_prefill_dtype
from ..layers.sampler import LogprobsTensors, Sampler, StepSamples, compute_logprobs
from .batch import ForwardBatch
from .cpu_step import CPUDecodeStep, cpu_decode_step
from .cuda_graph import (
    ALIGN,
    CUDAGraphRunner,
    batch_buckets,
    round_up,
    token_buckets,
)
from .kv_pool import allocate_kv_pool, block_bytes, kv_pool_dtype, size_kv_pool
from .model_loading import Progress, load_model
from .sampling_inputs import sampling_tensors, to_device


@dataclass
class LaunchedForward:
    """A step whose forward is enqueued and whose sampling is not."""

    batch: ForwardBatch
    logits: torch.Tensor | None  # [num_seqs (+ prompt rows), vocab]; None off rank 0


@dataclass
class StepHandle:
    """A launched step. On rank 0: the sampled tokens on the device and, on CUDA, their
    copy on its way to pinned host memory with the event that marks its arrival."""

    tokens: torch.Tensor | None = None  # [num_seqs] int64 on the device; None off rank 0
    host: torch.Tensor | None = None  # [num_seqs] pinned
    ready: torch.cuda.Event | None = None
    # Logprobs the batch asked for, computed on the device at launch.
    logprobs: LogprobsTensors | None = None
    wanted_logprobs: list[int] = field(default_factory=list)  # per row; -1 = none
    prompt_logprobs: LogprobsTensors | None = None
    prompt_num_top: list[int] = field(default_factory=list)
    prompt_lens: dict[int, int] = field(default_factory=dict)  # row -> prompt positions


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        rank: int = 0,
        on_progress: Progress | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.rank = rank
        self.block_size = config.block_size
        self.progress = on_progress or (lambda stage, fraction: None)
        seed = config.seed if config.seed is not None else 0
        torch.manual_seed(seed)

        loaded = load_model(config, device, dtype, seed, self.progress)
        self.model = loaded.model
        self.cpu_weight_format = loaded.cpu_weight_format
        self.cpu_prefill_dtype = loaded.cpu_prefill_dtype
        self.cpu_decode_dtype = loaded.cpu_decode_dtype
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.buckets = batch_buckets(config.max_num_sequences)
        self.max_blocks_per_seq = (config.max_len + self.block_size - 1) // self.block_size
        # NOTE: the kernel set and the attention backend are chosen here, once per engine;
        # every layer is pointed at them (nothing asks for its device per call).
        self.kernels = select_kernels(device)
        if self.cpu_prefill_dtype is not None:
            self.kernels = with_prefill_dtype(self.kernels, self.cpu_prefill_dtype)
        bind_kernels(self.model, self.kernels)
        self.attn_backend = make_backend(
            device,
            self.block_size,
            self.attention_layers[0].num_kv_heads,
            self.max_blocks_per_seq * self.block_size,
            self.buckets,
            self.kernels,
        )
        for layer in self.attention_layers:
            layer.backend = self.attn_backend
        generator = None
        if config.seed is not None:
            generator = torch.Generator(device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        # The picking decode graphs' noise keys, one a step (the sampler's generator is
        # on the device; a graph step's key goes up with its inputs).
        self._pick_seeds = random.Random(seed)
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.graphs: CUDAGraphRunner | None = None
        self.cpu_step: CPUDecodeStep | None = None  # CPU decode without per-op Python
        # The last launched step's sampled tokens, read by the next step's placeholders.
        self.last_sampled: torch.Tensor | None = None
        # Two pinned buffers: step N+1 is launched before step N's tokens are read.
        self._host_tokens: list[torch.Tensor] = []
        if device.type == "cuda":
            n = config.max_num_sequences
            self._host_tokens = [
                torch.empty(n, dtype=torch.long, pin_memory=True) for _ in range(2)
            ]
        self._num_launched = 0

    # -- KV pool -------------------------------------------------------------------------

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's element type: float8 e4m3 (`kv_cache_dtype` fp8) or the model's."""
        return kv_pool_dtype(self.config, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return block_bytes(self.attention_layers, self.block_size, self.kv_dtype)

    def size_kv_pool(self) -> int:
        """How many blocks the pool gets on this rank (kv_pool.py's `size_kv_pool`)."""
        return size_kv_pool(
            self.model, self.config, self.device, self.bytes_per_block, self.progress
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the pool, then compile the kernels and capture the step graphs (or
        build the CPU decode step) over it."""
        self.kv_cache = allocate_kv_pool(
            self.attention_layers,
            num_blocks,
            self.block_size,
            self.kv_dtype,
            self.device,
            self.config.kv_fp8,
        )
        self.num_blocks = num_blocks
        if self.kernels.is_triton:
            self.progress("compiling kernels", 0.7)
            self.compile_kernels()
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self.capture_cuda_graphs()
        if self.device.type == "cpu":
            self.progress("compiling the CPU decode step", 0.8)
            self.cpu_step = cpu_decode_step(self.model, self.kv_cache, self.config.enforce_eager)

    def release(self) -> None:
        """Drop the KV pool, the CUDA graphs and the model. What still references this
        runner afterwards (a caller's wrapper, a reference cycle not yet collected) no
        longer holds their memory, so a later engine in the process can size its pool."""
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.attention_layers = []
        self.kv_cache = None
        self.num_blocks = 0
        self.graphs = None
        self.cpu_step = None
        self.last_sampled = None
        self.model = None

    @torch.inference_mode()
    def compile_kernels(self) -> None:
        """Launch every kernel variant an eager step can ask for, so none compiles later.

        Variants differ only in constexprs fixed per engine (dtype, head sizes, block
        size) and in decode attention's split count (one per batch bucket); the runtime
        integers that vary per step are not specialised on (`do_not_specialize`) and
        `prepare` keeps every input view 16-byte aligned. Graph capture then reuses them.
        """
        batches = [(_dummy_batch([8, 8]), None)]  # prefill: store_kvcache + prefill attention
        # The few-row decode path (CUDA, <= 8 rows): the GEMVs, add + RMSNorm + GEMV and
        # q/k norm + rotary + store; one row and several rows are different variants (the
        # row count itself is not specialised past 1).
        sizes = [1, 2] if self.config.max_num_sequences > 1 else [1]
        batches += [(_dummy_batch([1] * n), None) for n in sizes]
        # The backend's decode variants (its split counts), each at a batch size it takes.
        variants = self.attn_backend.decode_variants()
        batches += [(_dummy_batch([1] * n), splits) for n, splits in variants]
        for b, splits in batches:
            input_ids, positions, meta = self.prepare(b)
            if splits is not None:
                meta.decode_splits = splits
            self._forward(b, input_ids, positions, meta)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture_cuda_graphs(self, replay_eagerly: bool = False) -> None:
        """Capture the step graphs; `replay_eagerly` (CPU tests) records the graphs' bodies
        and re-runs them instead, over the same static buffers and padding."""
        tp = get_tp_size()
        self.graphs = CUDAGraphRunner(
            self.model,
            self.buckets,
            self.max_blocks_per_seq,
            self.attn_backend.decode_splits,
            self.config.model.hidden_size,
            self.device,
            self.dtype,
            self.progress,
            prefill_buckets=token_buckets(self.config.max_num_batched_tokens),
            max_num_sequences=self.config.max_num_sequences,
            block_size=self.block_size,
            max_len=self.config.max_len,
            # The LM head's gather to rank 0 stays outside the graphs.
            vocab_size=self.config.model.vocab_size if tp == 1 else None,
            replay_eagerly=replay_eagerly,
            picks=graph_picks(),
            fill_tokens=self.kernels.fill_tokens,
            sample_rows=self.kernels.sample_rows,
        )

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, b: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's inputs on the device, in a few host-to-device copies (one per dtype,
        plus the block tables for a graph step). A prefill/mixed step that a CUDA graph
        holds goes to the graph runner, which stages it in that graph's static inputs."""
        width = max(len(t) for t in b.block_tables)
        if self.graphs is not None and not b.is_decode and not _wants_prompt_rows(b):
            staged = self.graphs.stage_prefill(b, width)
            if staged is not None:
                return staged
        tables = [x for t in b.block_tables for x in (t + [0] * (width - len(t)))]
        n_tok, n_seq = b.num_tokens, b.num_seqs
        # Each part padded to 16 elements, so every view below starts 16-byte aligned:
        # Triton specialises kernels on pointer alignment (one compiled variant).
        tok_pad = [0] * (round_up(n_tok, ALIGN) - n_tok)
        longs = to_device(
            b.input_ids + tok_pad + b.positions + tok_pad + b.slot_mapping, torch.long,
            self.device,
        )
        # int32 for the kernels; int64 on the CPU, where the references index with it.
        index_dtype = torch.int32 if self.device.type == "cuda" else torch.long
        cu_pad = [0] * (round_up(n_seq + 1, ALIGN) - n_seq - 1)
        lens_pad = [0] * (round_up(n_seq, ALIGN) - n_seq)
        ints = to_device(
            b.cu_seqlens_q + cu_pad + b.seq_lens + lens_pad + tables, index_dtype, self.device
        )
        t = n_tok + len(tok_pad)
        input_ids, positions, slot_mapping = longs[:n_tok], longs[t : t + n_tok], longs[2 * t :]
        s0 = n_seq + 1 + len(cu_pad)
        s1 = s0 + n_seq + len(lens_pad)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=ints[: n_seq + 1],
            seq_lens=ints[s0 : s0 + n_seq],
            block_tables=ints[s1:].view(n_seq, width),
            is_decode=b.is_decode,
        )
        self.attn_backend.finish_metadata(meta, n_seq, max(b.seq_lens) if b.is_decode else None)
        return input_ids, positions, meta

    def run(self, b: ForwardBatch) -> StepSamples | None:
        """Forward one step and wait for it; on rank 0 return one sampled token per
        sequence (and the logprobs the batch asked for)."""
        return self.collect(self.launch(b))

    @torch.inference_mode()
    def launch(self, b: ForwardBatch) -> StepHandle:
        """Enqueue one step (forward and sampling) without waiting for the device.

        On the CPU this computes the step (there is nothing to overlap), but the engine
        drives both devices through the same launch / collect path."""
        handle = self._launch_picking_graph(b)
        if handle is not None:
            return handle
        return self.sample(self.forward(b))

    @torch.inference_mode()
    def forward(self, b: ForwardBatch) -> LaunchedForward:
        """Enqueue a step's forward: its logits (rank 0), not yet sampled. `sample` must
        follow before the next step's forward (a graph's logits buffer is reused)."""
        if b.bitmask_rows and self._picking_graph_takes(b):
            # A decode step with rows under a grammar: the picking graph's fast inputs and
            # its logits buffer; the graph's own pick (every row greedy: no noise drawn)
            # goes unused (`sample` picks under the mask).
            self._replay_picking(b, sample=False)
            return LaunchedForward(b, self.graphs.logits(b.num_seqs))
        input_ids, positions, meta = self.prepare(b)
        if b.fill_rows:
            # After prepare (which may have written the graph's static inputs) and before
            # the forward (which copies them into a decode graph's): same stream, in order.
            self._fill_placeholders(input_ids, b)
        prompt = {row: x for row, x in b.extras.items() if x.prompt_targets}
        if prompt:
            # Prompt logprobs need hidden rows besides each sequence's last one: an eager
            # step (prepare() kept this batch out of the prefill graphs).
            with attention_metadata(meta):
                hidden = self.model(input_ids, positions)  # [num_tokens, hidden]
            last = hidden if b.is_decode else hidden[meta.cu_seqlens_q[1:].long() - 1]
            prompt_rows = [
                b.cu_seqlens_q[row] + j
                for row, x in prompt.items()
                for j in range(len(x.prompt_targets))
            ]
            # Every rank computes these logits: the LM head gathers them.
            rows = to_device(prompt_rows, torch.long, self.device)
            logits = self.model.compute_logits(torch.cat([last, hidden[rows]]))
        else:
            _, logits = self._forward(b, input_ids, positions, meta)
        return LaunchedForward(b, logits)

    @torch.inference_mode()
    def sample(self, f: LaunchedForward, bitmask: torch.Tensor | None = None) -> StepHandle:
        """Enqueue the sampling of a launched forward; `bitmask` (a CPU int32 tensor, one
        row per sequence) holds the allowed tokens of the batch's `bitmask_rows`."""
        b, logits = f.batch, f.logits
        if logits is None:  # not rank 0
            return StepHandle()
        n = b.num_seqs
        # Everything below is enqueued now: a graph's logits buffer is overwritten by the
        # next step's replay, which may be launched before this one is collected.
        out = self.sampler(
            logits[:n], sampling_tensors(b, bitmask, self.device, self.config.model.vocab_size)
        )
        tokens = out.token_ids  # [num_seqs]
        self.last_sampled = tokens
        handle = StepHandle(tokens)
        if out.logprobs is not None:
            handle.wanted_logprobs = [
                b.extras[i].num_logprobs if i in b.extras else -1 for i in range(n)
            ]
            handle.logprobs = out.logprobs
        prompt = {row: x for row, x in b.extras.items() if x.prompt_targets}
        if prompt:
            targets = [tok for x in prompt.values() for tok in x.prompt_targets]
            handle.prompt_num_top = [
                x.num_prompt_logprobs for x in prompt.values() for _ in x.prompt_targets
            ]
            handle.prompt_logprobs = compute_logprobs(
                logits[n:].float(),
                to_device(targets, torch.long, self.device),
                max(handle.prompt_num_top),
            )
            handle.prompt_lens = {row: len(x.prompt_targets) for row, x in prompt.items()}
        self._copy_to_host(handle)
        return handle

    def _copy_to_host(self, handle: StepHandle) -> None:
        """Queue the copy of a step's tokens to pinned memory (CUDA) and mark its arrival."""
        if self._host_tokens:
            tokens = handle.tokens
            host = self._host_tokens[self._num_launched % 2][: tokens.shape[0]]
            self._num_launched += 1
            host.copy_(tokens, non_blocking=True)
            handle.host = host
            handle.ready = torch.cuda.Event()
            handle.ready.record()

    def _launch_picking_graph(self, b: ForwardBatch) -> StepHandle | None:
        """A decode step that a picking decode graph holds (cuda_graph.py's `run_picking`):
        inputs straight from the batch's lists, the tokens picked in the graph, no sampler.
        None: the step takes the general path."""
        if b.bitmask_rows or not self._picking_graph_takes(b):
            return None
        tokens = self.last_sampled = self._replay_picking(b)
        # The view is overwritten by the next replay: on the CPU (no copy queued before
        # it) the handle keeps its own copy.
        handle = StepHandle(tokens if self._host_tokens else tokens.clone())
        self._copy_to_host(handle)
        return handle

    def _picking_graph_takes(self, b: ForwardBatch) -> bool:
        """Whether a picking decode graph holds step `b` (its rows' masks aside): every
        row greedy or at a plain temperature (no top-k / top-p / min-p, no per-request
        seed; penalties, bans and logprobs are in `extras`)."""
        graphs = self.graphs
        return (
            graphs is not None
            and graphs.picks
            and b.is_decode
            and not b.extras
            and all(k <= 0 for k in b.top_ks)
            and all(p >= 1 for p in b.top_ps)
            and all(p <= 0 for p in b.min_ps)
            and all(seed is None for seed in b.seeds)
            and graphs.picking_fits(b.num_seqs, max(len(t) for t in b.block_tables))
        )

    def _replay_picking(self, b: ForwardBatch, sample: bool = True) -> torch.Tensor:
        """Replay the picking decode graph over `b` (`_picking_graph_takes`); its tokens.
        `sample` False: every row's argmax (the caller samples from the logits)."""
        assert self.graphs is not None
        temperatures, seed = None, 0
        if sample and any(t > 0 for t in b.temperatures):
            temperatures, seed = b.temperatures, self._pick_seeds.getrandbits(62)
        return self.graphs.run_picking(b.input_ids, b.positions, b.slot_mapping, b.seq_lens,
                                       b.block_tables, b.fill_rows, b.fill_from,
                                       self.last_sampled, temperatures, seed)

    def collect(self, handle: StepHandle) -> StepSamples | None:
        """Wait for a launched step's tokens (and logprobs); None off rank 0."""
        if handle.tokens is None:
            return None
        if handle.ready is None:
            samples = StepSamples(handle.tokens.tolist())
        else:
            handle.ready.synchronize()
            samples = StepSamples(handle.host.tolist())
        # NOTE: logprobs are read whole (a sync); the engine collects such steps at once.
        if handle.logprobs is not None:
            wanted = handle.wanted_logprobs
            per_row = handle.logprobs.tolist([max(k, 0) for k in wanted])
            samples.logprobs = [
                lp if k >= 0 else None for lp, k in zip(per_row, wanted, strict=True)
            ]
        if handle.prompt_logprobs is not None:
            lps = handle.prompt_logprobs.tolist(handle.prompt_num_top)
            samples.prompt_logprobs = {}
            for row, count in handle.prompt_lens.items():
                samples.prompt_logprobs[row] = lps[:count]
                lps = lps[count:]
        return samples

    def _fill_placeholders(self, input_ids: torch.Tensor, b: ForwardBatch) -> None:
        """Write the previous step's sampled tokens into this step's unknown inputs.

        Rank 0 holds them; the other ranks receive the finished input ids from it."""
        if get_tp_rank() == 0:
            assert self.last_sampled is not None, "a placeholder without a step before it"
            index = to_device(b.fill_rows + b.fill_from, torch.long, self.device)
            rows, src = index.split(len(b.fill_rows))
            input_ids[rows] = self.last_sampled[src]
        broadcast_from_rank0(input_ids)

    @torch.inference_mode()
    def _forward(
        self,
        b: ForwardBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(last hidden row of each sequence, logits on rank 0 / None elsewhere): from a
        graph replay when one holds the step, else eagerly."""
        graphs = self.graphs
        logits = None
        if meta.graph_tokens is not None:
            assert graphs is not None
            last = graphs.replay_prefill(meta.graph_tokens, b.num_seqs)
            logits = graphs.logits(b.num_seqs)
        elif (
            b.is_decode
            and graphs is not None
            and graphs.fits(b.num_seqs, meta.block_tables.shape[1])
        ):
            last = graphs.run(input_ids, positions, meta)
            logits = graphs.logits(b.num_seqs)
        elif b.is_decode and self.cpu_step is not None:
            last = self.cpu_step(input_ids, positions, meta)
        else:
            # bf16 prefill (CPU): the rows of this step's prefill chunks
            rows = WideRows.of(b.cu_seqlens_q) if self.cpu_prefill_dtype is not None else None
            with attention_metadata(meta), wide_rows(rows):
                hidden = self.model(input_ids, positions)  # [num_tokens, hidden]
            last = hidden if b.is_decode else hidden[meta.cu_seqlens_q[1:].long() - 1]
        if logits is None:
            logits = self.model.compute_logits(last)  # tensor parallel: gathered on rank 0
        return last, logits


def _wants_prompt_rows(b: ForwardBatch) -> bool:
    """Whether the step needs hidden rows besides each sequence's last (prompt logprobs)."""
    return any(x.prompt_targets for x in b.extras.values())


def _dummy_batch(query_lens: list[int]) -> ForwardBatch:
    """A batch that writes nothing to the cache (slot -1) and reads block 0 only."""
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    num_tokens, num_seqs = cu[-1], len(query_lens)
    return ForwardBatch(
        input_ids=[0] * num_tokens,
        positions=[p for n in query_lens for p in range(n)],
        slot_mapping=[-1] * num_tokens,
        cu_seqlens_q=cu,
        seq_lens=list(query_lens),
        block_tables=[[0] for _ in query_lens],
        temperatures=[0.0] * num_seqs,
        top_ks=[0] * num_seqs,
        top_ps=[1.0] * num_seqs,
        min_ps=[0.0] * num_seqs,
        seeds=[None] * num_seqs,
    )
