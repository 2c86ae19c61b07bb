"""Steps replayed from CUDA graphs: decode steps by batch-size bucket, prefill and mixed
steps by token-count bucket.

A step of a small model is bound by kernel launches (hundreds per step) and their Python
wrappers, not by the GPU: replaying a captured graph launches them all at once. Graphs
are captured largest bucket first so the smaller ones fit in the memory pool the largest
one made; every graph shares that one pool and reads static input buffers, and a batch
is padded up to its bucket. The LM head runs inside the graph when there is no tensor
parallelism (its gather to rank 0 stays outside).

Padding, prefill/mixed graphs (bucket of T tokens and S = min(T, max_num_sequences)
sequence slots): tokens past the step's own write to slot -1 (nowhere) and belong to no
sequence, so attention leaves their rows alone and row-wise layers keep whatever they
hold to those rows; sequence slots past the step's own have zero queries (cu_seqlens_q
repeats its last value) and a zero context. The LM head reads each slot's last token.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..layers.attention import AttentionMetadata, attention_metadata
from .batch import ForwardBatch
from .sampling_inputs import host_tensor

MAX_GRAPH_TOKENS = 8192  # larger steps are compute-bound: their launches hide behind the GPU
ALIGN = 16  # elements: keeps every input view 16-byte aligned (one Triton variant each)
# Picking decode graphs take whole block-table rows from the host; past this many entries
# (bucket x max blocks) a step is cheaper through the general path's narrower copy.
MAX_PICK_TABLE = 1 << 16


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def batch_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


def token_buckets(max_tokens: int, cap: int = MAX_GRAPH_TOKENS) -> list[int]:
    """Token counts prefill/mixed graphs are captured for: powers of two from 16, with a
    1.5x step between them from 256 on (padding wastes at most a third of a step), up to
    the step budget (rounded up to a multiple of 16) or `cap`."""
    top = round_up(min(max_tokens, cap), ALIGN)
    out, p = [], 16
    while p < top:
        out.append(p)
        if p >= 256 and p * 3 // 2 < top:
            out.append(p * 3 // 2)
        p *= 2
    return out + [top]


def pick_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest bucket that holds n, or None."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def seq_slots(num_tokens: int, max_num_sequences: int) -> int:
    """Sequence slots of a token bucket: a step never has more sequences than tokens."""
    return min(num_tokens, max_num_sequences)


def prefill_layout(num_tokens: int, num_slots: int) -> tuple[int, int]:
    """Offsets in the static int32 buffer: (seq_lens, cu_seqlens_q). The first is at 0."""
    return 0, round_up(num_slots, ALIGN)


def pad_prefill_inputs(
    input_ids: list[int],
    positions: list[int],
    slot_mapping: list[int],
    cu_seqlens_q: list[int],
    seq_lens: list[int],
    num_tokens: int,
    num_slots: int,
) -> tuple[list[int], list[int]]:
    """A step's inputs laid out as a (T = num_tokens, S = num_slots) graph reads them:
    (int64 [input_ids | positions | slot_mapping], each T long;
     int32 [seq_lens (S, then zeros to the cu offset) | cu_seqlens_q (S + 1)])."""
    n, s = len(input_ids), len(seq_lens)
    assert n <= num_tokens and s <= num_slots, (n, num_tokens, s, num_slots)
    pad = num_tokens - n
    longs = input_ids + [0] * pad + positions + [0] * pad + slot_mapping + [-1] * pad
    _, cu_offset = prefill_layout(num_tokens, num_slots)
    ints = seq_lens + [0] * (cu_offset - s) + cu_seqlens_q + [cu_seqlens_q[-1]] * (num_slots - s)
    return longs, ints


def capture_metadata(num_tokens: int, num_slots: int, max_len: int) -> tuple[list[int], list[int]]:
    """(cu_seqlens_q, seq_lens) for capturing a graph: sequences of at most `max_len`
    tokens, each its own whole context; tokens beyond what the slots hold stay unowned."""
    cu, lens = [0], []
    for _ in range(num_slots):
        q = min(max_len, num_tokens - cu[-1])
        cu.append(cu[-1] + q)
        lens.append(q)
    return cu, lens


class GraphOutputs:
    """Static output buffers shared by every graph: the last hidden row of each sequence
    slot, and its logits when the LM head is inside."""

    def __init__(self, max_slots: int, hidden_size: int, vocab: int | None, dtype, device):
        with torch.device(device):
            self.last_hidden = torch.zeros(max_slots, hidden_size, dtype=dtype)
            self.logits = None if vocab is None else torch.zeros(max_slots, vocab, dtype=dtype)

    def write(self, model: nn.Module, last: torch.Tensor) -> None:
        n = last.shape[0]
        self.last_hidden[:n].copy_(last)
        if self.logits is not None:
            self.logits[:n].copy_(model.compute_logits(last))


class EagerReplay:
    """Stands in for a CUDA graph where there is none (CPU tests): replay runs the
    captured body again, so the static buffers, padding and bucket choice are exercised
    exactly as on the GPU."""

    def __init__(self, body: Callable[[], None]) -> None:
        self.body = body
        self.num_replays = 0

    def replay(self) -> None:
        self.num_replays += 1
        self.body()


def pick_layout(max_rows: int) -> int:
    """The picking decode graphs' input layout, one for every bucket: P = the largest
    bucket's rows, aligned; int64 [input_ids | positions | slot_mapping | fill_from, each
    P long | the step's seed, then padding to ALIGN]; int32 [seq_lens (P) | temperatures
    (P, float32 bits) | block tables (P rows of max_blocks)]. Returns P.

    One layout for all buckets keeps each value in its own place: a padding row that the
    host does not write holds an earlier row's id, position or block id, never another
    bucket's slot number read as a position (which indexed past the rotary table)."""
    return round_up(max_rows, ALIGN)


class _Staging:
    """Pinned host copies of the picking graphs' inputs. Two of them, used in turn: the
    host fills one while the copy out of the other may still be queued on the stream."""

    def __init__(self, rows: int, longs: int, ints: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.longs = torch.zeros(longs, dtype=torch.long, pin_memory=pin)
        self.ints = torch.zeros(ints, dtype=torch.int32, pin_memory=pin)
        self.longs_np = self.longs.numpy()
        self.ints_np = self.ints.numpy()
        self.temps_np = self.ints_np[rows : 2 * rows].view(np.float32)
        self.copied: torch.cuda.Event | None = None  # recorded after its copies were queued


class CUDAGraphRunner:
    """Decode graphs (one per batch-size bucket) and prefill/mixed graphs (one per token
    bucket), all in one memory pool.

    `picks` (the LM head inside, kernels/tuning.py's MINIVLLM_GRAPH_GREEDY): the decode
    graphs also fill the inputs the host does not know yet from the previous step's tokens
    (`fill_tokens`, their first launch) and end by picking each row's token from their
    logits into `tokens` (`sample_rows`: greedy rows their argmax, the others a draw at
    their temperature). A decode step whose rows ask for nothing else (no top-k / top-p /
    min-p, penalties, logprobs or per-request seed) is then two host-to-device copies, one
    replay and the copy of its tokens back (`run_picking`); other decode steps replay the
    same graphs through `run` and sample from the logits outside."""

    def __init__(
        self,
        model: nn.Module,
        buckets: list[int],
        max_blocks_per_seq: int,
        decode_splits: Callable[..., int | None],
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        on_progress: Callable[[str, float], None] | None = None,
        *,
        prefill_buckets: list[int] | None = None,
        max_num_sequences: int | None = None,
        block_size: int = 16,
        max_len: int | None = None,
        vocab_size: int | None = None,
        replay_eagerly: bool = False,
        picks: bool = False,
        fill_tokens: Callable | None = None,
        sample_rows: Callable | None = None,
    ) -> None:
        self.model = model
        self.buckets = buckets
        self.max_blocks_per_seq = max_blocks_per_seq
        self.decode_splits = decode_splits
        self.device = device
        self.prefill_buckets = prefill_buckets or []
        self.max_num_sequences = max_num_sequences or buckets[-1]
        self.block_size = block_size
        self.replay_eagerly = replay_eagerly
        self.picks = picks and vocab_size is not None
        self.fill_tokens = fill_tokens
        self.sample_rows = sample_rows
        # Longest sequence a capture may use (its positions must exist in the rope table).
        self.max_len = max_len or max_blocks_per_seq * block_size
        progress = on_progress or (lambda stage, fraction: None)

        n = buckets[-1]
        max_slots = max([n] + [self.slots(t) for t in self.prefill_buckets])
        self.outputs = GraphOutputs(max_slots, hidden_size, vocab_size, dtype, device)
        with torch.device(device):
            # Decode inputs.
            self.input_ids = torch.zeros(n, dtype=torch.long)
            self.positions = torch.zeros(n, dtype=torch.long)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.long)
            self.seq_lens = torch.ones(n, dtype=torch.int32)
            self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
            self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32)
            if self.picks:
                # One buffer per dtype (`pick_layout`): one copy each a step.
                p = self.pick_rows = pick_layout(n)
                self.pick_longs = torch.zeros(4 * p + ALIGN, dtype=torch.long)
                self.pick_longs[2 * p : 4 * p].fill_(-1)  # no slot, no fill
                self.pick_ints = torch.zeros(2 * p + n * max_blocks_per_seq, dtype=torch.int32)
                self.pick_ints[:p].fill_(1)  # one token of context; temperature 0: greedy
                self.tokens = torch.zeros(n, dtype=torch.long)  # the last picking step's
            # Prefill/mixed inputs, laid out as `pad_prefill_inputs` writes them.
            t_max = self.prefill_buckets[-1] if self.prefill_buckets else 0
            s_max = self.slots(t_max) if t_max else 0
            self.prefill_longs = torch.zeros(3 * t_max, dtype=torch.long)
            self.prefill_ints = torch.zeros(prefill_layout(t_max, s_max)[1] + s_max + 1,
                                            dtype=torch.int32)
            self.prefill_tables = torch.zeros(s_max, max_blocks_per_seq, dtype=torch.int32)
        if self.picks:
            self._staging = [
                _Staging(p, 4 * p + ALIGN, 2 * p + n * max_blocks_per_seq, device)
                for _ in range(2)
            ]
            self._num_staged = 0

        self.graphs: dict[int, torch.cuda.CUDAGraph | EagerReplay] = {}
        # Buckets whose split count is above one also get a graph with one split (the short
        # launch, its own tiles), for steps whose contexts are all short
        # (`decode_splits(bucket, 1)`: kernels/tuning.py's DECODE_SHORT).
        self.short_graphs: dict[int, torch.cuda.CUDAGraph | EagerReplay] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph | EagerReplay] = {}
        self.pool = None
        total = len(self.buckets) + len(self.prefill_buckets)
        done = 0
        for t in reversed(self.prefill_buckets):
            progress(f"capturing CUDA graphs ({done + 1}/{total})", 0.8 + 0.2 * done / total)
            self.prefill_graphs[t] = self._capture_prefill(t)
            done += 1
        for bs in reversed(self.buckets):
            progress(f"capturing CUDA graphs ({done + 1}/{total})", 0.8 + 0.2 * done / total)
            self.graphs[bs] = self._capture_decode(bs)
            if self.decode_splits(bs, 1) != self.decode_splits(bs):
                self.short_graphs[bs] = self._capture_decode(bs, self.decode_splits(bs, 1))
            done += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def slots(self, num_tokens: int) -> int:
        return seq_slots(num_tokens, self.max_num_sequences)

    def _capture(self, body: Callable[[], None]) -> torch.cuda.CUDAGraph | EagerReplay:
        if self.replay_eagerly:
            return EagerReplay(body)
        body()  # eager warm-up: compiles kernels, settles lazy state outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    # -- decode ----------------------------------------------------------------------------

    def _decode_views(
        self, bs: int, splits: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, AttentionMetadata]:
        """The static inputs of decode bucket `bs`: (input_ids, positions, fill_from or
        None, metadata); `splits`: decode attention's split count, if not the bucket's."""
        if self.picks:
            p, mb = self.pick_rows, self.max_blocks_per_seq
            longs, ints = self.pick_longs, self.pick_ints
            ids, positions, fill = longs[:bs], longs[p : p + bs], longs[3 * p : 3 * p + bs]
            slot_mapping, seq_lens = longs[2 * p : 2 * p + bs], ints[:bs]
            block_tables = ints[2 * p : 2 * p + bs * mb].view(bs, mb)
        else:
            ids, positions, fill = self.input_ids[:bs], self.positions[:bs], None
            slot_mapping, seq_lens = self.slot_mapping[:bs], self.seq_lens[:bs]
            block_tables = self.block_tables[:bs]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=seq_lens,
            block_tables=block_tables,
            is_decode=True,
            decode_splits=self.decode_splits(bs) if splits is None else splits,
        )
        return ids, positions, fill, meta

    def _capture_decode(self, bs: int, splits: int | None = None
                        ) -> torch.cuda.CUDAGraph | EagerReplay:
        def body() -> None:
            # Fresh views each call, as in `_capture_prefill`'s body.
            ids, positions, fill, meta = self._decode_views(bs, splits)
            input_ids = ids
            if fill is not None:
                input_ids = self.fill_tokens(ids, fill, self.tokens)
            with attention_metadata(meta):
                hidden = self.model(input_ids, positions)
            self.outputs.write(self.model, hidden)
            if self.picks:
                # Each row's token (greedy, or a draw at its temperature), in-graph.
                p = self.pick_rows
                temperatures = self.pick_ints[p : p + bs].view(torch.float32)
                seed = self.pick_longs[4 * p : 4 * p + 1]
                self.sample_rows(self.outputs.logits[:bs], temperatures, seed,
                                 out=self.tokens[:bs])

        return self._capture(body)

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.buckets[-1] and width <= self.max_blocks_per_seq

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_seqs, hidden]
        """Replay a decode step; the last hidden rows (and `logits(num_seqs)`) are ready."""
        bs = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= bs)
        ids, pos, fill, static = self._decode_views(bucket)
        ids[:bs] = input_ids
        pos[:bs] = positions
        static.slot_mapping[:bs] = meta.slot_mapping
        static.seq_lens[:bs] = meta.seq_lens
        width = meta.block_tables.shape[1]
        static.block_tables[:bs, :width] = meta.block_tables
        if bucket > bs:  # padding rows write nowhere and attend to one token of block 0
            static.slot_mapping[bs:bucket] = -1
            static.seq_lens[bs:bucket] = 1
        if fill is not None:
            fill.fill_(-1)  # the inputs are complete
        self._decode_graph(bucket, meta.decode_splits).replay()
        return self.outputs.last_hidden[:bs]

    def _decode_graph(self, bucket: int, splits: int | None
                      ) -> torch.cuda.CUDAGraph | EagerReplay:
        """The bucket's decode graph for a step of `splits` (see `short_graphs`)."""
        if splits == 1 and bucket in self.short_graphs:
            return self.short_graphs[bucket]
        return self.graphs[bucket]

    def picking_fits(self, num_seqs: int, width: int) -> bool:
        """Whether `run_picking` takes a decode step of this size."""
        if not self.picks or not self.fits(num_seqs, width):
            return False
        bucket = next(b for b in self.buckets if b >= num_seqs)
        return bucket * self.max_blocks_per_seq <= MAX_PICK_TABLE

    def run_picking(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        fill_rows: list[int],
        fill_from: list[int],
        prev_tokens: torch.Tensor | None,
        temperatures: list[float] | None = None,
        seed: int = 0,
    ) -> torch.Tensor:  # [num_seqs] int64, on the device
        """Replay a decode step from host lists: its inputs in two copies; `prev_tokens`
        (the previous step's sampled tokens) feed the rows in `fill_rows`. Each row's token
        is its argmax where its temperature is 0 (None: every row's), else a draw at its
        temperature keyed by `seed`. Returns the step's tokens (a view of `tokens`, valid
        until the next replay)."""
        bs = len(input_ids)
        bucket = next(b for b in self.buckets if b >= bs)
        p, mb = self.pick_rows, self.max_blocks_per_seq
        stage = self._staging[self._num_staged % 2]
        self._num_staged += 1
        if stage.copied is not None:
            stage.copied.synchronize()  # its previous copies left long ago (two steps back)
        longs, ints = stage.longs_np, stage.ints_np
        longs[:bs] = input_ids
        longs[bs:p] = 0
        longs[p : p + bs] = positions
        longs[p + bs : 2 * p] = 0
        longs[2 * p : 2 * p + bs] = slot_mapping
        longs[2 * p + bs : 4 * p] = -1  # padding rows: no slot; every row: no fill ...
        for row, src in zip(fill_rows, fill_from, strict=True):
            longs[3 * p + row] = src  # ... but these
        longs[4 * p] = seed
        ints[:bs] = seq_lens
        ints[bs:p] = 1  # padding rows attend to one token of their (stale) first block
        stage.temps_np[:] = 0.0  # greedy, padding rows included (no noise drawn for them)
        if temperatures is not None:
            stage.temps_np[:bs] = temperatures
        for i, table in enumerate(block_tables):
            ints[2 * p + i * mb : 2 * p + i * mb + len(table)] = table
        # NOTE: whole rows (columns past a table are stale and never read); the padding
        # rows' tables are not copied (stale on the device: valid block ids or zeros).
        self.pick_longs.copy_(stage.longs, non_blocking=True)
        self.pick_ints[: 2 * p + bs * mb].copy_(stage.ints[: 2 * p + bs * mb], non_blocking=True)
        if self.device.type == "cuda":
            stage.copied = torch.cuda.Event()
            stage.copied.record()
        if fill_rows:
            assert prev_tokens is not None, "a placeholder without a step before it"
            if prev_tokens.data_ptr() != self.tokens.data_ptr():
                # The step before was not a picking replay (a prefill, a sampled step).
                self.tokens[: prev_tokens.shape[0]].copy_(prev_tokens)
        self._decode_graph(bucket, self.decode_splits(bs, max(seq_lens))).replay()
        return self.tokens[:bs]

    # -- prefill and mixed -----------------------------------------------------------------

    def prefill_bucket(self, num_tokens: int) -> int | None:
        """The token bucket of a prefill/mixed step, or None (run it eagerly)."""
        return pick_bucket(self.prefill_buckets, num_tokens)

    def stage_prefill(
        self, b: ForwardBatch, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None:
        """Write a prefill/mixed step into the static inputs of the graph whose token bucket
        holds it, padded to that bucket: (input_ids, positions, metadata) as
        `prefill_views` gives them, `graph_tokens` set to the bucket. None: no graph holds
        the step (it runs eagerly). `width`: the step's widest block table."""
        bucket = self.prefill_bucket(b.num_tokens)
        if bucket is None:
            return None
        n_seq = b.num_seqs
        longs, ints = pad_prefill_inputs(
            b.input_ids,
            b.positions,
            b.slot_mapping,
            b.cu_seqlens_q,
            b.seq_lens,
            bucket,
            self.slots(bucket),
        )
        tables = [x for t in b.block_tables for x in (t + [0] * (width - len(t)))]
        self.prefill_longs[: len(longs)].copy_(self._pinned(longs, torch.long), True)
        self.prefill_ints[: len(ints)].copy_(self._pinned(ints, torch.int32), True)
        # Rows past the step's sequences, and columns past its widest table, keep stale
        # values that nothing reads (no queries there; no context that far).
        dst = self.prefill_tables[:n_seq, :width]
        dst.copy_(self._pinned(tables, torch.int32).view(n_seq, width), True)
        input_ids, positions, meta = self.prefill_views(bucket)
        meta.graph_tokens = bucket
        return input_ids, positions, meta

    def _pinned(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        t = host_tensor(values, dtype)
        return t.pin_memory() if self.device.type == "cuda" else t

    def prefill_views(
        self, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The static inputs of bucket `num_tokens`: (input_ids, positions, metadata)."""
        t, s = num_tokens, self.slots(num_tokens)
        longs = self.prefill_longs
        seq_off, cu_off = prefill_layout(t, s)
        meta = AttentionMetadata(
            slot_mapping=longs[2 * t : 3 * t],
            cu_seqlens_q=self.prefill_ints[cu_off : cu_off + s + 1],
            seq_lens=self.prefill_ints[seq_off : seq_off + s],
            block_tables=self.prefill_tables[:s],
            is_decode=False,
        )
        return longs[:t], longs[t : 2 * t], meta

    def _capture_prefill(self, t: int) -> torch.cuda.CUDAGraph | EagerReplay:
        s = self.slots(t)
        _, positions, _ = self.prefill_views(t)
        cu, lens = capture_metadata(t, s, self.max_len)
        longs, ints = pad_prefill_inputs([0] * t, [0] * t, [-1] * t, cu, lens, t, s)
        self.prefill_longs[: len(longs)].copy_(torch.tensor(longs))
        self.prefill_ints[: len(ints)].copy_(torch.tensor(ints, dtype=torch.int32))
        spans = [torch.arange(n) for n in lens] + [torch.zeros(t - cu[-1], dtype=torch.long)]
        positions.copy_(torch.cat(spans))

        def body() -> None:
            # Fresh views each call: an eager replay must not look like the same step to
            # layers that memoise per positions tensor (the CPU rotary table lookup).
            input_ids, positions, meta = self.prefill_views(t)
            with attention_metadata(meta):
                hidden = self.model(input_ids, positions)  # [t, hidden]
            last = hidden.index_select(0, (meta.cu_seqlens_q[1:] - 1).long())  # [s, hidden]
            self.outputs.write(self.model, last)

        return self._capture(body)

    def replay_prefill(self, num_tokens: int, num_seqs: int) -> torch.Tensor:
        """Replay the graph of bucket `num_tokens` over inputs `prefill_views` already
        holds; returns the last hidden row of each of the step's `num_seqs` sequences."""
        self.prefill_graphs[num_tokens].replay()
        return self.outputs.last_hidden[:num_seqs]

    def logits(self, num_seqs: int) -> torch.Tensor | None:
        """The replayed step's logits, when the LM head is inside the graphs."""
        return None if self.outputs.logits is None else self.outputs.logits[:num_seqs]
