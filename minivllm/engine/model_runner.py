"""Owns the model, the KV pool and the sampler of one rank; runs one step at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.kernels.decode_attention import context_slots

from ..config import EngineConfig
from ..distributed import broadcast_from_rank0, get_tp_rank
from ..layers.attention import Attention, AttentionMetadata, attention_metadata
from ..layers.ops import uses_triton
from ..layers.sampler import Sampler, SamplingTensors
from ..models import build_model
from ..models.weights import init_dummy_weights, load_weights
from .batch import ForwardBatch
from .cuda_graph import CUDAGraphRunner, batch_buckets

CPU_KV_BUDGET_BYTES = 2 << 30  # the CPU pool's default size, when max_cached_blocks is unset

Progress = Callable[[str, float], None]


@dataclass
class StepHandle:
    """A launched step. On rank 0: the sampled tokens on the device and, on CUDA, their
    copy on its way to pinned host memory with the event that marks its arrival."""

    tokens: torch.Tensor | None = None  # [num_seqs] int64 on the device; None off rank 0
    host: torch.Tensor | None = None  # [num_seqs] pinned
    ready: torch.cuda.Event | None = None


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

        self.progress("building the model", 0.0)
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = build_model(config.model)
        finally:
            torch.set_default_dtype(old_dtype)
        if config.load_format == "dummy" or config.model_path is None:
            self.progress("random weights", 0.2)
            init_dummy_weights(self.model, seed)
        else:
            self.progress("loading weights", 0.2)
            load_weights(self.model, config.model_path)
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        generator = None
        if config.seed is not None:
            generator = torch.Generator(device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.graphs: CUDAGraphRunner | None = None
        self.buckets = batch_buckets(config.max_num_sequences)
        self.max_blocks_per_seq = (config.max_len + self.block_size - 1) // self.block_size
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
    def bytes_per_block(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * layer.num_kv_heads * layer.head_dim
        return per_token * self.block_size * self.dtype.itemsize

    def size_kv_pool(self) -> int:
        """How many blocks the pool gets on this rank."""
        if self.device.type != "cuda":
            if self.config.max_cached_blocks is not None:
                return self.config.max_cached_blocks
            return max(1, CPU_KV_BUDGET_BYTES // self.bytes_per_block)
        return self._size_kv_pool_cuda()

    def _size_kv_pool_cuda(self) -> int:
        """Warm up with the largest batch, then give the KV pool its share of what is free.

        `gpu_memory_utilization` is the share of the memory still free after the weights
        and the warm-up's peak activations that the pool takes (the seed's semantics).
        """
        self.progress("warming up", 0.4)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.warm_up()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        available = (free - (peak - current)) * self.config.gpu_memory_utilization
        return max(0, int(available) // self.bytes_per_block)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One forward pass over `max_num_batch_tokens` tokens without a cache."""
        num_tokens = self.config.warmup_tokens
        max_len = self.config.max_len
        num_seqs = min(self.config.max_num_sequences, max(1, num_tokens // max(1, max_len)))
        lens = [num_tokens // num_seqs] * num_seqs
        ids = torch.zeros(sum(lens), dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        cu = torch.tensor([0] + lens, device=self.device).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.full_like(ids, -1),
            cu_seqlens_q=cu,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32, device=self.device),
            is_decode=False,
        )
        with attention_metadata(meta):
            hidden = self.model(ids, positions)
        self.model.compute_logits(hidden[cu[1:].long() - 1])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        layer = self.attention_layers[0]
        shape = (
            2,
            len(self.attention_layers),
            num_blocks,
            self.block_size,
            layer.num_kv_heads,
            layer.head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]
        self.num_blocks = num_blocks
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self.capture_cuda_graphs()

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        self.graphs = CUDAGraphRunner(
            self.model,
            self.buckets,
            self.max_blocks_per_seq,
            self.decode_splits,
            self.config.model.hidden_size,
            self.device,
            self.dtype,
            self.progress,
        )

    def decode_splits(self, num_seqs: int) -> int | None:
        """Decode attention's split count for a batch: a function of its bucket only."""
        if self.device.type != "cuda":
            return None
        from minivllm.kernels.decode_attention import choose_num_splits
        from minivllm.kernels.dispatch import num_sms

        bucket = next((b for b in self.buckets if b >= num_seqs), num_seqs)
        max_seq_len = self.max_blocks_per_seq * self.block_size
        num_kv_heads = self.attention_layers[0].num_kv_heads
        return choose_num_splits(bucket, num_kv_heads, max_seq_len, num_sms(self.device))

    # -- one step ------------------------------------------------------------------------

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare(self, b: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's inputs on the device, in two host-to-device copies (one per dtype)."""
        width = max(len(t) for t in b.block_tables)
        tables = [x for t in b.block_tables for x in (t + [0] * (width - len(t)))]
        n_tok, n_seq = b.num_tokens, b.num_seqs
        longs = self._to_device(b.input_ids + b.positions + b.slot_mapping, torch.long)
        # int32 for the kernels; int64 on the CPU, where the references index with it.
        index_dtype = torch.int32 if self.device.type == "cuda" else torch.long
        ints = self._to_device(b.cu_seqlens_q + b.seq_lens + tables, index_dtype)
        input_ids, positions, slot_mapping = longs.split([n_tok, n_tok, n_tok])
        cu_seqlens_q, seq_lens, block_tables = ints.split([n_seq + 1, n_seq, n_seq * width])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens,
            block_tables=block_tables.view(n_seq, width),
            is_decode=b.is_decode,
            decode_splits=self.decode_splits(n_seq) if b.is_decode else None,
        )
        if b.is_decode and not uses_triton(self.device):
            meta.context_slots = context_slots(meta.seq_lens, meta.block_tables, self.block_size)
        return input_ids, positions, meta

    def sampling_tensors(self, b: ForwardBatch) -> SamplingTensors:
        if all(t == 0 for t in b.temperatures):
            return SamplingTensors.greedy()
        floats = self._to_device(b.temperatures + b.top_ps + b.min_ps, torch.float32)
        temperatures, top_ps, min_ps = floats.split(b.num_seqs)
        return SamplingTensors(
            temperatures=temperatures,
            top_ks=self._to_device(b.top_ks, torch.long),
            top_ps=top_ps,
            min_ps=min_ps,
            seeds=b.seeds,
            needs_top_k=any(k > 0 for k in b.top_ks),
            needs_top_p=any(p < 1 for p in b.top_ps),
            needs_min_p=any(p > 0 for p in b.min_ps),
            all_greedy=False,
        )

    def run(self, b: ForwardBatch) -> list[int] | None:
        """Forward one step and wait for it; on rank 0 return one sampled token per
        sequence."""
        return self.collect(self.launch(b))

    @torch.inference_mode()
    def launch(self, b: ForwardBatch) -> StepHandle:
        """Enqueue one step (forward and sampling) without waiting for the device.

        On the CPU this computes the step (there is nothing to overlap), but the engine
        drives both devices through the same launch / collect path."""
        input_ids, positions, meta = self.prepare(b)
        if b.fill_rows:
            self._fill_placeholders(input_ids, b)
        width = meta.block_tables.shape[1]
        if b.is_decode and self.graphs is not None and self.graphs.fits(b.num_seqs, width):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            with attention_metadata(meta):
                hidden = self.model(input_ids, positions)  # [num_tokens, hidden]
        last = hidden if b.is_decode else hidden[meta.cu_seqlens_q[1:].long() - 1]
        logits = self.model.compute_logits(last)
        if logits is None:  # not rank 0
            return StepHandle()
        tokens = self.sampler(logits.float(), self.sampling_tensors(b))  # [num_seqs]
        self.last_sampled = tokens
        if not self._host_tokens:
            return StepHandle(tokens)
        host = self._host_tokens[self._num_launched % 2][: b.num_seqs]
        self._num_launched += 1
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return StepHandle(tokens, host, ready)

    def collect(self, handle: StepHandle) -> list[int] | None:
        """Wait for a launched step's tokens; None off rank 0."""
        if handle.tokens is None:
            return None
        if handle.ready is None:
            return handle.tokens.tolist()
        handle.ready.synchronize()
        return handle.host.tolist()

    def _fill_placeholders(self, input_ids: torch.Tensor, b: ForwardBatch) -> None:
        """Write the previous step's sampled tokens into this step's unknown inputs.

        Rank 0 holds them; the other ranks receive the finished input ids from it."""
        if get_tp_rank() == 0:
            assert self.last_sampled is not None, "a placeholder without a step before it"
            index = self._to_device(b.fill_rows + b.fill_from, torch.long)
            rows, src = index.split(len(b.fill_rows))
            input_ids[rows] = self.last_sampled[src]
        broadcast_from_rank0(input_ids)
