"""Owns the model, the KV pool and the sampler of one rank; runs one step at a time."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.kernels.decode_attention import context_slots

from ..config import EngineConfig
from ..layers.attention import Attention, AttentionMetadata, attention_metadata
from ..layers.cpu_linear import pack_linears
from ..layers.ops import uses_triton
from ..layers.sampler import (
    PenaltyTensors,
    Sampler,
    SamplingTensors,
    StepSamples,
    compute_logprobs,
)
from ..models import build_model
from ..models.weights import init_dummy_weights, load_weights
from .batch import ForwardBatch
from .cpu_step import CPUDecodeStep, cpu_decode_step, lazily_zeroed
from .cuda_graph import CUDAGraphRunner, batch_buckets

CPU_KV_BUDGET_BYTES = 2 << 30  # the CPU pool's default size, when max_cached_blocks is unset

Progress = Callable[[str, float], None]


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
        # NOTE: fp32 stays unpacked: it is the exact-parity path checked against
        # transformers (oneDNN's packed sums differ from F.linear by ~1e-6, enough to move
        # logprobs past 1e-4); bf16 is where packing pays (PERF.md's CPU facts).
        if device.type == "cpu" and dtype != torch.float32:
            pack_linears(self.model)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        generator = None
        if config.seed is not None:
            generator = torch.Generator(device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.graphs: CUDAGraphRunner | None = None
        self.cpu_step: CPUDecodeStep | None = None  # CPU decode without per-op Python
        self.buckets = batch_buckets(config.max_num_sequences)
        self.max_blocks_per_seq = (config.max_len + self.block_size - 1) // self.block_size

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
        if self.device.type == "cpu":
            self.kv_cache = lazily_zeroed(shape, self.dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]
        self.num_blocks = num_blocks
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self.capture_cuda_graphs()
        if self.device.type == "cpu":
            self.progress("compiling the CPU decode step", 0.8)
            self.cpu_step = cpu_decode_step(self.model, self.kv_cache, self.config.enforce_eager)

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
            t = SamplingTensors.greedy()
        else:
            floats = self._to_device(b.temperatures + b.top_ps + b.min_ps, torch.float32)
            temperatures, top_ps, min_ps = floats.split(b.num_seqs)
            t = SamplingTensors(
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
        if b.extras:
            self._add_extras(t, b)
        return t

    def _add_extras(self, t: SamplingTensors, b: ForwardBatch) -> None:
        """Penalty statistics and the min_tokens mask, built on the device from the
        rows' token lists (host-to-device copies, no sync)."""
        extras = b.extras
        t.num_logprobs = max(x.num_logprobs for x in extras.values())
        banned = [(row, tok) for row, x in extras.items() for tok in x.banned_ids]
        if banned:
            rows, ids = zip(*banned, strict=True)
            t.banned = tuple(self._to_device([*rows, *ids], torch.long).split(len(rows)))
        # Penalties act on the tokens seen so far: with none there is nothing to do.
        if not any(x.prompt_ids or x.output_ids for x in extras.values()):
            return
        n, vocab = b.num_seqs, self.config.model.vocab_size
        rows_p = [row for row, x in extras.items() for _ in x.prompt_ids]
        rows_o = [row for row, x in extras.items() for _ in x.output_ids]
        ids_p = [tok for x in extras.values() for tok in x.prompt_ids]
        ids_o = [tok for x in extras.values() for tok in x.output_ids]
        longs = self._to_device(rows_p + ids_p + rows_o + ids_o, torch.long)
        rows_p_t, ids_p_t, rows_o_t, ids_o_t = longs.split([len(rows_p)] * 2 + [len(rows_o)] * 2)
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=self.device)
        counts.index_put_((rows_o_t, ids_o_t), torch.ones_like(ids_o_t, dtype=torch.float32), True)
        seen = counts > 0
        seen[rows_p_t, ids_p_t] = True
        factors = [[1.0] * n, [0.0] * n, [0.0] * n]  # repetition, presence, frequency
        for row, x in extras.items():
            factors[0][row] = x.repetition_penalty
            factors[1][row] = x.presence_penalty
            factors[2][row] = x.frequency_penalty
        floats = self._to_device(factors[0] + factors[1] + factors[2], torch.float32)
        repetition, presence, frequency = floats.split(n)
        t.penalties = PenaltyTensors(repetition, presence, frequency, seen, counts)

    @torch.inference_mode()
    def run(self, b: ForwardBatch) -> StepSamples | None:
        """Forward one step; on rank 0 return one sampled token per sequence (and the
        logprobs the batch asked for)."""
        input_ids, positions, meta = self.prepare(b)
        width = meta.block_tables.shape[1]
        if b.is_decode and self.graphs is not None and self.graphs.fits(b.num_seqs, width):
            hidden = self.graphs.run(input_ids, positions, meta)
        elif b.is_decode and self.cpu_step is not None:
            hidden = self.cpu_step(input_ids, positions, meta)
        else:
            with attention_metadata(meta):
                hidden = self.model(input_ids, positions)  # [num_tokens, hidden]
        last = hidden if b.is_decode else hidden[meta.cu_seqlens_q[1:].long() - 1]
        prompt = {row: x for row, x in b.extras.items() if x.prompt_targets}
        prompt_rows = [
            b.cu_seqlens_q[row] + j
            for row, x in prompt.items()
            for j in range(len(x.prompt_targets))
        ]
        if prompt_rows:  # every rank computes these logits: the LM head gathers them
            rows = self._to_device(prompt_rows, torch.long)
            last = torch.cat([last, hidden[rows]])
        logits = self.model.compute_logits(last)
        if logits is None:  # not rank 0
            return None
        n = b.num_seqs
        out = self.sampler(logits[:n].float(), self.sampling_tensors(b))
        samples = StepSamples(out.token_ids.tolist())
        if out.logprobs is not None:
            wanted = [b.extras[i].num_logprobs if i in b.extras else -1 for i in range(n)]
            per_row = out.logprobs.tolist([max(k, 0) for k in wanted])
            samples.logprobs = [
                lp if k >= 0 else None for lp, k in zip(per_row, wanted, strict=True)
            ]
        if prompt_rows:
            targets = [tok for x in prompt.values() for tok in x.prompt_targets]
            num_top = [x.num_prompt_logprobs for x in prompt.values() for _ in x.prompt_targets]
            lps = compute_logprobs(
                logits[n:].float(), self._to_device(targets, torch.long), max(num_top)
            ).tolist(num_top)
            samples.prompt_logprobs = {}
            for row, x in prompt.items():
                samples.prompt_logprobs[row] = lps[: len(x.prompt_targets)]
                lps = lps[len(x.prompt_targets) :]
        return samples
