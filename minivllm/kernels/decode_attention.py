"""Attention of one new query token per sequence over its paged KV cache.

The Triton version is bound by the bytes of K/V it reads, so:
- each program owns one KV head and computes all query heads of its group at once (K/V
  are read once per KV head); the group is padded to 16 rows for `tl.dot`;
- long contexts are split across programs (flash-decoding), so batch 1 at 8k context
  still fills the chip: each split writes its partial (max, sum, unnormalised acc) and
  counts itself done on a per-(sequence, KV head) counter; the last one to finish merges
  the partials and resets the counter. One launch a layer, no separate merge kernel. A
  context that fits one split (or a launch of one split) writes the output directly.
"""

from __future__ import annotations

import torch

from minivllm.kernels.attention_tile import (
    LOG2E,
    attend_kv_tile,
    attend_loaded_tile,
    load_kv_tile,
)
from minivllm.kernels.dispatch import check_paged_attention, check_tensor, num_sms, tl, triton
from minivllm.kernels.pdl import attention_pdl
from minivllm.kernels.qkv_rotary_store import check_qkv_inputs, qkv_rotary_store_ref
from minivllm.kernels.store_kvcache import dequantize_kv, is_fp8, to_kv
from minivllm.kernels.tuning import (
    decode_fp8_v_words,
    decode_late_trigger,
    decode_loaded_regs_fp8,
    decode_loaded_tile,
    decode_max_splits,
    decode_one_page,
    decode_prefetch,
    decode_short_tile,
    decode_tile,
)


def decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    k_scale: float = 1.0,  # an fp8 cache's scales (kernels/store_kvcache.py)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    slots = context_slots(seq_lens, block_tables, k_cache.shape[1])
    return decode_attention_at_slots(q, k_cache, v_cache, slots, seq_lens, scale,
                                     k_scale, v_scale)


def context_slots(
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    block_size: int,
) -> torch.Tensor:  # [num_seqs, max_len] int64: the cache slot of each context position
    positions = torch.arange(int(seq_lens.max()), device=block_tables.device)
    blocks = block_tables[:, positions // block_size].long()
    return blocks * block_size + positions % block_size


def decode_attention_at_slots(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [num_seqs, max_len] from `context_slots` (once per step)
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    k_scale: float = 1.0,  # an fp8 cache's scales: upcast to q's dtype, then scaled
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = slots.shape[1]
    # Each KV head is read once for its whole query group: q is viewed as
    # [num_seqs, num_kv_heads, group, head_dim], K/V are never repeated per query head.
    flat = slots.reshape(-1)
    k = k_cache.flatten(0, 1).index_select(0, flat).view(num_seqs, max_len, num_kv_heads, -1)
    v = v_cache.flatten(0, 1).index_select(0, flat).view(num_seqs, max_len, num_kv_heads, -1)
    if is_fp8(k.dtype):
        k, v = dequantize_kv(k, q.dtype, k_scale), dequantize_kv(v, q.dtype, v_scale)
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).to(k.dtype)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [.., group, max_len]
    if num_seqs > 1:  # one sequence's context is exactly max_len long: nothing to mask
        positions = torch.arange(max_len, device=q.device)
        valid = positions[None, :] < seq_lens[:, None].to(q.device)  # [num_seqs, max_len]
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    o = torch.matmul(probs, v.transpose(1, 2))  # [num_seqs, num_kv_heads, group, head_dim]
    return o.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial write) dominates
MERGE_CHUNK = 32  # splits the merging program reads at once ([32, head_dim] fp32 in registers)
LOADED_PROGRAMS_PER_SM = 2  # past this a launch takes `is_loaded`'s tiles, no prefetch
MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension (sequences)


@triton.jit
def _store_output(out_ptr, seq, heads, dims, row_mask, acc, l_sum, out_stride_s, out_stride_h):
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]  # an empty context gives zeros
    out_offsets = seq.to(tl.int64) * out_stride_s + heads[:, None] * out_stride_h
    tl.store(out_ptr + out_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None])


@triton.jit
def _merge_head(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    part_base,  # this (sequence, head)'s first partial
    out_offset,
    used,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
):
    """One query head's output from its `used` partials (max, sum, unnormalised acc)."""
    # NOTE: .cg loads read L2, where the other programs' partials are, never a stale L1 line.
    splits = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_m_ptr + part_base + splits, mask=splits < used, other=float("-inf"),
                cache_modifier=".cg")
    l_sum = tl.load(part_l_ptr + part_base + splits, mask=splits < used, other=0.0,
                    cache_modifier=".cg")
    m_max = tl.max(m, axis=0)
    total = tl.sum(tl.exp2(m - m_max) * l_sum, axis=0)
    dims = tl.arange(0, HEAD_DIM)
    out = tl.zeros([HEAD_DIM], tl.float32)
    for first in tl.static_range(0, NUM_SPLITS, MERGE_CHUNK):
        chunk = first + tl.arange(0, MERGE_CHUNK)
        valid = chunk < used
        w = tl.exp2(tl.load(part_m_ptr + part_base + chunk, mask=valid, other=float("-inf"),
                            cache_modifier=".cg") - m_max)  # [MERGE_CHUNK]
        acc = tl.load(part_acc_ptr + (part_base + chunk)[:, None] * HEAD_DIM + dims[None, :],
                      mask=valid[:, None], other=0.0, cache_modifier=".cg")  # [MERGE_CHUNK, D]
        out += tl.sum(acc * w[:, None], axis=0)
    out = out / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + out_offset + dims, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _normed_rotated(src, partner, mask, w_ptr, dims, partner_dims, cos, sin, eps,
                    QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows of q or k ([rows, HEAD_DIM], read from the QKV output) after the per-head
    RMSNorm (optional) and the rotary embedding, rounded as `qkv_rotary_store_ref` rounds.
    `partner` points at each element's rotation partner (d +- HEAD_DIM/2); `sin` carries
    the rotation's sign."""
    x = tl.load(src, mask=mask, other=0.0)
    xr = tl.load(partner, mask=mask, other=0.0)
    act_dtype = x.dtype
    if QK_NORM:
        f = x.to(tl.float32)
        fr = xr.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(f * f, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + dims).to(tl.float32)
        wr = tl.load(w_ptr + partner_dims).to(tl.float32)
        x = ((f * rstd).to(act_dtype).to(tl.float32) * w).to(act_dtype)
        xr = ((fr * rstd).to(act_dtype).to(tl.float32) * wr).to(act_dtype)
    return (x.to(tl.float32) * cos + xr.to(tl.float32) * sin).to(act_dtype)


# NOTE: the block table's row stride is the step's widest table; not specialised on, so
# a new width never compiles a new variant mid-run.
@triton.jit(do_not_specialize=["bt_stride_s"])
def _decode_attention_kernel(
    q_ptr,  # q, or the QKV projection's output (FROM_QKV)
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    counters_ptr,  # [>= num_seqs * NUM_KV_HEADS] int32, zero between launches
    positions_ptr,  # FROM_QKV only, like the four below
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    slot_mapping_ptr,
    q_stride_s,
    q_stride_h,
    out_stride_s,
    out_stride_h,
    bt_stride_s,
    qk_scale,  # softmax scale * log2(e) (* k_scale, fp8): the softmax runs in base 2
    eps,
    k_scale,  # an fp8 cache's scales: the new token's K/V are stored over them (FROM_QKV)
    v_scale,  # and the output is multiplied by v_scale
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    # q/k norm + rotary + KV store in the prologue (kernels/qkv_rotary_store.py's work)
    FROM_QKV: tl.constexpr,
    QK_NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
    PREFETCH: tl.constexpr,  # FROM_QKV only: the first K/V tile is loaded before the wait
    MIN_SPLIT_LEN: tl.constexpr,  # context positions a split takes at least (BLOCK_N's multiple)
    LATE_TRIGGER: tl.constexpr,  # PDL: contexts longer than this launch the next kernel late
    KV_FP8: tl.constexpr,  # the cache is fp8: tiles are upcast to q's dtype, or to fp16
    FP8_AS_F16: tl.constexpr,  # KV_FP8 with 16-bit q: q, K and V in fp16 for the products
    FP8_ASM: tl.constexpr,  # FP8_AS_F16 compiled for a GPU: K/V upcast by PTX (upcast_kv)
    FP8_V_WORDS: tl.constexpr = False,  # FP8_AS_F16: the loop's V tiles by load_v_words
    ONE_PAGE: tl.constexpr = False,  # BLOCK_SIZE a multiple of BLOCK_N: a page a tile
):
    # The grid is (KV heads, sequences, splits): a sequence's heads, whose K/V rows share
    # each position's stretch of the cache, run side by side.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    dims = tl.arange(0, HEAD_DIM)
    # Step inputs no kernel writes: read before the wait.
    seq_len = tl.load(seq_lens_ptr + seq)
    if PDL:
        # The next kernel (the o projection) may launch now and stream its weights, unless
        # the context is long: then its waiting programs would sit beside this kernel's
        # second wave, and it launches once this program's K/V loop is done.
        if LATE_TRIGGER == 0 or seq_len <= LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    if FROM_QKV:
        partner_dims = (dims + HEAD_DIM // 2) % HEAD_DIM
        pos = tl.load(positions_ptr + seq).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + dims % (HEAD_DIM // 2)).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HEAD_DIM // 2 + dims % (HEAD_DIM // 2))
        sin = tl.where(dims < HEAD_DIM // 2, -sin.to(tl.float32), sin.to(tl.float32))
    # Splits divide the actual context (in whole tiles), not the grid's capacity, so a
    # launch sized for the longest context stays balanced for shorter ones. `used` splits
    # hold context; at least one, so an empty context still writes its (zero) output.
    # At least MIN_SPLIT_LEN a split: a short context stays in one program (no partials,
    # no merge on its critical path).
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N,
                           MIN_SPLIT_LEN)
    used = tl.maximum(tl.cdiv(seq_len, tl.maximum(split_len, 1)), 1)
    if split >= used:  # an empty split writes nothing and is not counted
        return
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    block_table = block_tables_ptr + seq.to(tl.int64) * bt_stride_s
    head_offset = kv_head * HEAD_DIM + dims[None, :]  # [1, HEAD_DIM]
    if PREFETCH:
        # This layer's cache is written only by this kernel (the new token, below), so
        # the split's first tile can be loaded before the wait, while the kernels before
        # it finish; the new token's row is spliced in from registers after it.
        offs0 = start + tl.arange(0, BLOCK_N)
        valid0 = offs0 < end
        k0, v0 = load_kv_tile(k_cache_ptr, v_cache_ptr, block_table, offs0, valid0,
                              head_offset, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                              ONE_PAGE=ONE_PAGE, tile_start=start)
    if PDL:
        # q (or QKV), the cache and the counters come from the kernels before.
        tl.extra.cuda.gdc_wait()

    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows  # [GROUP_PAD]
    q_rows = q_ptr + seq.to(tl.int64) * q_stride_s + heads[:, None] * q_stride_h
    if FROM_QKV:
        q = _normed_rotated(q_rows + dims[None, :], q_rows + partner_dims[None, :],
                            row_mask[:, None], q_norm_ptr, dims, partner_dims, cos, sin, eps,
                            QK_NORM, HEAD_DIM)
        if split == used - 1:
            # The split holding the new token (position seq_len - 1) stores its K/V first;
            # padding rows of a graph bucket have no slot (-1).
            k_src = q_ptr + seq.to(tl.int64) * q_stride_s + (NUM_KV_HEADS * GROUP + kv_head) * (
                HEAD_DIM
            )
            k = _normed_rotated(k_src + dims[None, :], k_src + partner_dims[None, :],
                                dims[None, :] < HEAD_DIM, k_norm_ptr, dims, partner_dims, cos,
                                sin, eps, QK_NORM, HEAD_DIM)  # [1, HEAD_DIM]
            v = tl.load(k_src + NUM_KV_HEADS * HEAD_DIM + dims)
            slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
            dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims
            store_mask = (dims * 0 + slot) >= 0
            k = to_kv(k, k_scale, k_cache_ptr, KV_FP8)
            v = to_kv(v, v_scale, v_cache_ptr, KV_FP8)
            tl.store(k_cache_ptr + dst[None, :], k, mask=store_mask[None, :])
            tl.store(v_cache_ptr + dst, v, mask=store_mask)
            # Every thread's stores are visible to the whole program after the barrier:
            # the loop below reads this token back from the cache.
            tl.debug_barrier()
            if PREFETCH:
                new_row = (offs0 == seq_len - 1)[:, None]  # [BLOCK_N, 1]
                k0 = tl.where(new_row, k, k0)
                v0 = tl.where(new_row, v[None, :], v0)
    else:
        q = tl.load(q_rows + dims[None, :], mask=row_mask[:, None], other=0.0)
    if not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)  # [GROUP_PAD, HEAD_DIM]
    elif FP8_AS_F16:
        q = q.to(tl.float16)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    loop_start = start
    if PREFETCH:
        m, l_sum, acc = attend_loaded_tile(q, m, l_sum, acc, k0, v0, valid0[None, :],
                                           qk_scale, DOT_PRECISION, FP8_ASM)
        loop_start = start + BLOCK_N
    for tile_start in range(loop_start, end, BLOCK_N):
        offs = tile_start + tl.arange(0, BLOCK_N)
        valid = offs < end
        m, l_sum, acc = attend_kv_tile(q, m, l_sum, acc, k_cache_ptr, v_cache_ptr, block_table,
                                       offs, valid, valid[None, :], head_offset, qk_scale,
                                       BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, DOT_PRECISION,
                                       FP8_ASM, FP8_V_WORDS, kv_head, ONE_PAGE, tile_start)
    if KV_FP8:
        acc = acc * v_scale  # partials and outputs alike: the merge is linear in acc
    if PDL:
        if LATE_TRIGGER > 0 and seq_len > LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()

    if NUM_SPLITS == 1:
        _store_output(out_ptr, seq, heads, dims, row_mask, acc, l_sum, out_stride_s,
                      out_stride_h)
    elif used == 1:  # a short context in a launch sized for a long one: no merge
        _store_output(out_ptr, seq, heads, dims, row_mask, acc, l_sum, out_stride_s,
                      out_stride_h)
    else:
        # Partials are [num_seqs, num_heads, NUM_SPLITS(, HEAD_DIM)], fp32.
        part = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m, mask=row_mask)
        tl.store(part_l_ptr + part, l_sum, mask=row_mask)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask[:, None]
        )
        # The last of the `used` splits to finish merges them all. The barrier puts every
        # thread's partial stores before the counter's release (one thread does the
        # atomic); its acquire side makes the other programs' partials visible here.
        tl.debug_barrier()
        counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
        finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if finished == used - 1:
            tl.store(counter, 0)  # every split has counted: ready for the next launch
            for r in tl.static_range(GROUP):
                head = kv_head * GROUP + r
                _merge_head(
                    part_m_ptr,
                    part_l_ptr,
                    part_acc_ptr,
                    out_ptr,
                    (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + head) * NUM_SPLITS,
                    seq.to(tl.int64) * out_stride_s + head * out_stride_h,
                    used,
                    HEAD_DIM,
                    NUM_SPLITS,
                    MERGE_CHUNK,
                )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """Splits per (sequence, KV head): double them until there are a few waves of programs
    on the chip, keeping at least MIN_TOKENS_PER_SPLIT context per split. Always a power
    of two, at most MINIVLLM_DECODE_MAX_SPLITS (H200, batch 1, 8 KV heads, a 16-bit cache:
    32 were fastest at 8k, 17.6 us a layer against 18.3-23.1 for 16-256, and at 32k, 41.6
    us against 42.8 for 128; the merge of 128 partials took 4.1 us a layer against 1.4 for
    16). Depends only on host-known sizes, so a CUDA graph can capture it."""
    programs = num_seqs * num_kv_heads
    splits = 1
    while (
        splits < decode_max_splits()
        and programs * splits < 4 * sms
        and max_seq_len >= 2 * splits * MIN_TOKENS_PER_SPLIT
    ):
        splits *= 2
    return splits


def is_loaded(num_seqs: int, num_kv_heads: int, num_splits: int, device: torch.device) -> bool:
    """A launch of more than LOADED_PROGRAMS_PER_SM programs an SM: several waves, so the
    programs resident on an SM at once (registers and shared memory per program) hide
    the memory latency, not an early first tile (PREFETCH, which holds a K/V tile in
    registers through the prologue). Host-known sizes only: graph-capturable."""
    return num_seqs * num_kv_heads * num_splits > LOADED_PROGRAMS_PER_SM * num_sms(device)


def _tile_config(dtype: torch.dtype, loaded: bool = False, kv_fp8: bool = False) -> dict:
    if dtype == torch.float32:  # exact fp32 dots; small tiles to keep registers in check
        return dict(BLOCK_N=32, DOT_PRECISION="ieee", num_warps=4, num_stages=1)
    # H200, batch 256 x ~1.5k, block 256: N128 4.10 TB/s, N64 4.02, N32 3.80 (w4 s2, with
    # the first tile prefetched). Loaded launches: PERF.md's H100 figures.
    # MINIVLLM_DECODE_TILE / MINIVLLM_DECODE_LOADED_TILE(_FP8) pick others for A/B runs.
    block_n, warps, stages = decode_loaded_tile(kv_fp8) if loaded else decode_tile()
    config = dict(BLOCK_N=block_n, DOT_PRECISION="tf32", num_warps=warps, num_stages=stages)
    if loaded and kv_fp8 and decode_loaded_regs_fp8():
        config["maxnreg"] = decode_loaded_regs_fp8()
    return config


def short_tile_config(dtype: torch.dtype) -> dict | None:
    """Tiles of the engine's short launch (MINIVLLM_DECODE_SHORT: one program per KV head
    over a context of at most 256 positions by default); None keeps the default (fp32).
    H200, batch 1, fused kernel alone: N128 w8 s2 took 6.4 us a layer at 128 positions and
    14.1 at 512 against 7.3 and 15.3 with the default N128 w4 s2 (2026-12-04). Over an fp8
    cache it loads V as bytes unless MINIVLLM_DECODE_FP8_V_WORDS=1: on an H100 at batch 1
    and 128 positions, 1,217 tok/s so against 1,116 with V as words (2026-12-08)."""
    if dtype == torch.float32:
        return None
    block_n, warps, stages = decode_short_tile()
    return dict(_tile_config(dtype), BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                FP8_V_WORDS=decode_fp8_v_words(loaded=False, short=True))


def decode_counters(num_seqs: int, num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """The split-completion counters `decode_attention` needs for up to `num_seqs` sequences:
    zeros, and zero again after every launch (the merging program resets its own). An
    engine allocates them once, outside any CUDA graph, and passes them to every call."""
    return torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=device)


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    counters: torch.Tensor | None = None,  # from `decode_counters`
    tile_config: dict | None = None,
    min_split_len: int | None = None,
    k_scale: float = 1.0,  # an fp8 cache's scales (kernels/store_kvcache.py)
    v_scale: float = 1.0,
    check: bool = True,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Triton version of `decode_attention_ref`: one launch, no host sync.

    The split count comes from the batch size and `max_seq_len` (default: the block
    table's capacity, block_tables.shape[1] * block_size), never from `seq_lens`' values,
    so the launch is graph-capturable. `num_splits` (a power of two) and `tile_config`
    override the choices (tests, benchmarks); so does `min_split_len` (context positions a
    split takes at least; default one tile; an engine passes MINIVLLM_DECODE_MIN_SPLIT,
    kernels/tuning.py); `check=False` skips the input checks (an
    engine checks each kernel's first launch). Without `counters` each call allocates
    zeroed ones (one memset launch more).
    """
    if check:
        check_paged_attention(k_cache, v_cache, seq_lens, block_tables, q=q)
        _check_decode_rows(q.shape[0], seq_lens, block_tables, counters)
    return _launch(q, q.shape[1], q.stride(0), q.stride(1), k_cache, v_cache, seq_lens,
                   block_tables, scale, max_seq_len, num_splits, counters, tile_config,
                   min_split_len=min_split_len, kv_scales=(k_scale, v_scale))


def qkv_decode_attention_ref(
    positions: torch.Tensor,  # [num_seqs]
    qkv: torch.Tensor,  # [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim]
    num_heads: int,
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in the first half, sin after
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_seqs]; -1 skips the token's store
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """A decode step's attention from the QKV projection's output: q/k norm + rotary +
    KV store (`qkv_rotary_store_ref`), then `decode_attention_ref`."""
    q = qkv_rotary_store_ref(positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache,
                             slot_mapping, q_norm_weight, k_norm_weight, eps, k_scale, v_scale)
    return decode_attention_ref(q, k_cache, v_cache, seq_lens, block_tables, scale,
                                k_scale, v_scale)


def qkv_decode_attention(
    positions: torch.Tensor,  # [num_seqs]
    qkv: torch.Tensor,  # [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim]
    num_heads: int,
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim], contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_seqs]; -1 skips the token's store
    seq_lens: torch.Tensor,  # [num_seqs], this token included
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    counters: torch.Tensor | None = None,
    tile_config: dict | None = None,
    prefetch: bool | None = None,
    min_split_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    check: bool = True,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Triton version of `qkv_decode_attention_ref` in one launch (one token per
    sequence): `qkv_rotary_store`'s work in the attention kernel's prologue. Every split
    program normalises and rotates its q heads; the one holding the new token stores its
    K/V first. Arguments as `qkv_rotary_store` and `decode_attention`; `prefetch` loads each
    split's first K/V tile before the PDL wait (same result, bit for bit); default:
    MINIVLLM_DECODE_PREFETCH (kernels/tuning.py) on launches that are not `is_loaded`."""
    if check:
        check_qkv_inputs(positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache,
                         slot_mapping, q_norm_weight, k_norm_weight)
        check_paged_attention(k_cache, v_cache, seq_lens, block_tables, num_heads=num_heads)
        _check_decode_rows(qkv.shape[0], seq_lens, block_tables, counters)
    return _launch(qkv, num_heads, qkv.stride(0), k_cache.shape[3], k_cache, v_cache, seq_lens,
                   block_tables, scale, max_seq_len, num_splits, counters, tile_config,
                   qkv=(positions, cos_sin_cache, q_norm_weight, k_norm_weight, slot_mapping,
                        eps),
                   prefetch=prefetch,
                   min_split_len=min_split_len, kv_scales=(k_scale, v_scale))


def _check_decode_rows(num_seqs: int, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       counters: torch.Tensor | None) -> None:
    if seq_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} and block_tables "
            f"{tuple(block_tables.shape)} must have one row per sequence "
            f"({num_seqs})"
        )
    if counters is not None:
        check_tensor("counters", counters, 1, (torch.int32,), device=seq_lens.device)


def _launch(
    q: torch.Tensor,  # q, or the QKV output when `qkv` is given
    num_heads: int,
    q_stride_s: int,
    q_stride_h: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int | None,
    num_splits: int | None,
    counters: torch.Tensor | None,
    tile_config: dict | None,
    qkv: tuple | None = None,  # (positions, cos_sin, q_norm_w, k_norm_w, slot_mapping, eps)
    prefetch: bool | None = False,  # with `qkv` only; None: the default unless `is_loaded`
    min_split_len: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's (k_scale, v_scale)
) -> torch.Tensor:
    device = k_cache.device
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs = q.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=device)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(device))
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    fp8 = is_fp8(k_cache.dtype)
    loaded = is_loaded(num_seqs, num_kv_heads, num_splits, device)
    if tile_config is None:
        compute_dtype = q.dtype if fp8 else k_cache.dtype  # an fp8 cache is upcast to q's
        tile_config = _tile_config(compute_dtype, loaded, fp8)
    f16 = fp8 and q.dtype in (torch.float16, torch.bfloat16)
    # The interpreter (CPU tensors) cannot run inline PTX; Triton's own upcast there gives
    # the same fp16 values.
    config = {"FP8_AS_F16": f16, "FP8_ASM": f16 and device.type == "cuda",
              "FP8_V_WORDS": decode_fp8_v_words(loaded), "ONE_PAGE": decode_one_page(),
              **tile_config}
    if not fp8:
        config.update(FP8_AS_F16=False, FP8_ASM=False)
    if not config["FP8_AS_F16"]:
        config["FP8_V_WORDS"] = False  # its tiles are fp16: q must be 16-bit
    # Splits and tiles start at multiples of BLOCK_N: where a page holds whole tiles, each
    # tile lies in one page.
    config["ONE_PAGE"] = config["ONE_PAGE"] and block_size % config["BLOCK_N"] == 0
    if prefetch is None:
        prefetch = decode_prefetch() and not loaded
    block_n = config["BLOCK_N"]
    if min_split_len is None:
        min_split_len = block_n
    pdl = attention_pdl(device)
    launch = {"launch_pdl": True} if pdl else {}

    if num_splits == 1:
        part_m = part_l = part_acc = counters = out  # unused: the kernel writes `out` directly
    else:
        if counters is None:
            counters = decode_counters(num_seqs, num_kv_heads, device)
        elif counters.numel() < num_seqs * num_kv_heads:  # always checked: atomics past it
            raise ValueError(f"counters has {counters.numel()} elements; {num_seqs} sequences "
                             f"x {num_kv_heads} KV heads need {num_seqs * num_kv_heads}")
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=device
        )
    if qkv is None:  # the five pointers are unused
        positions = cos_sin = q_norm_w = k_norm_w = slot_mapping = out
        eps = 0.0
    else:
        positions, cos_sin, q_norm_w, k_norm_w, slot_mapping, eps = qkv
        qk_norm = q_norm_w is not None
        if not qk_norm:
            q_norm_w = k_norm_w = out
    if num_seqs > MAX_GRID_Y:
        raise ValueError(f"decode attention takes at most {MAX_GRID_Y} sequences a launch, "
                         f"got {num_seqs}")
    _decode_attention_kernel[(num_kv_heads, num_seqs, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        counters,
        positions,
        cos_sin,
        q_norm_w,
        k_norm_w,
        slot_mapping,
        q_stride_s,
        q_stride_h,
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        scale * LOG2E * (kv_scales[0] if fp8 else 1.0),
        eps,
        kv_scales[0],
        kv_scales[1],
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        MERGE_CHUNK=min(num_splits, MERGE_CHUNK),
        FROM_QKV=qkv is not None,
        QK_NORM=qkv is not None and qk_norm,
        PDL=pdl,
        PREFETCH=prefetch and qkv is not None,
        MIN_SPLIT_LEN=triton.cdiv(max(min_split_len, 1), block_n) * block_n,
        LATE_TRIGGER=decode_late_trigger(),
        KV_FP8=fp8,
        **config,
        **launch,
    )
    return out
