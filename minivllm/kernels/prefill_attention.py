"""Causal attention for variable-length query chunks over the paged KV cache.

A sequence's queries may start after tokens already cached (a prefix-cache hit or an
earlier prefill chunk) and attend to them. This step's K/V must already be stored.

The Triton version is flash attention over the paged cache: one program per (query head,
tile of BLOCK_M queries of one sequence), online softmax over BLOCK_N-token KV tiles
gathered through the block table, fp32 accumulation. Programs find their sequence by a
binary search over cu_seqlens_q, so the grid needs no host sync. The tiles before a query
tile's diagonal skip the causal mask. On Hopper and later, K/V tiles load through TMA
descriptors of the layer's cache seen as a [slots, heads x head_dim] table (a tile lies in
one page when BLOCK_N divides the block size); elsewhere, pointer loads. The grid's last
query tiles, whose rows see the most keys, start first. Tiles, loads and order are
`kernels/tuning.py`'s prefill switches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.kernels.attention_tile import LOG2E, attend_loaded_tile, load_kv_tile
from minivllm.kernels.dispatch import (
    INDEX_DTYPES,
    INTERPRETING,
    check_paged_attention,
    check_tensor,
    tl,
    triton,
)
from minivllm.kernels.store_kvcache import dequantize_kv, is_fp8
from minivllm.kernels.tuning import prefill_tile


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """The first `seq_len` positions only: the rest of the last block is never read (on the
    CPU its pages may not be mapped yet, and reading them faults each one in: short prompts
    in large blocks spent a fifth of their prefill there)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    if seq_len == num_blocks * block_size:
        return cache[blocks].flatten(0, 1)
    pos = torch.arange(seq_len, device=cache.device)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    return cache.flatten(0, 1).index_select(0, slots)


def prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    compute_dtype: torch.dtype | None = None,
    k_scale: float = 1.0,  # an fp8 cache's scales (kernels/store_kvcache.py)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`compute_dtype`: the dtype of the sequences with more than one query (prefill
    chunks); one query (a decode row in a prefill's step) and the default take the cache's
    (q's for an fp8 cache, which is upcast)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    cache_dtype = q.dtype if is_fp8(k_cache.dtype) else k_cache.dtype
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        dtype = compute_dtype if compute_dtype is not None and q_len > 1 else cache_dtype
        # [seq_len, num_kv_heads, head_dim]
        k = dequantize_kv(gather_kv(k_cache, block_tables[i], seq_len), dtype, k_scale)
        v = dequantize_kv(gather_kv(v_cache, block_tables[i], seq_len), dtype, v_scale)
        # Query j sits at position seq_len - q_len + j and sees keys 0..that position; with
        # no cached prefix that is SDPA's own causal mask, whose fused kernel skips the
        # masked half (less time than with the mask as a tensor).
        mask = None
        if q_len < seq_len:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        # NOTE: 4-D (a batch of one): on CPU, 3-D inputs take SDPA's unfused math path,
        # several times slower at 512 tokens than the fused kernel 4-D inputs get.
        o = F.scaled_dot_product_attention(
            q[None, q_start:q_end].transpose(1, 2).to(dtype),  # [1, heads, q_len, head_dim]
            k[None].transpose(1, 2),
            v[None].transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[q_start:q_end] = o[0].transpose(0, 1).to(out.dtype)
    return out




@triton.jit
def _attend_prefill_tile(
    q,  # [BLOCK_M, HEAD_DIM] in the compute dtype
    m,  # [BLOCK_M] running max (base 2)
    l_sum,  # [BLOCK_M] running sum of exp2(s - m)
    acc,  # [BLOCK_M, HEAD_DIM] fp32, unnormalised
    k_cache_ptr,
    v_cache_ptr,
    k_desc,  # TMA descriptors of the layer's cache as [slots, NUM_KV_HEADS * HEAD_DIM]
    v_desc,
    block_table,  # this sequence's row of the block table
    kv_start,  # the tile's first context position (a multiple of BLOCK_N)
    kv_end,  # positions from here on are not read (masked tiles only)
    q_pos,  # [BLOCK_M] the rows' positions
    kv_head,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,  # the tile holds keys some row must not see, or past kv_end
    TMA: tl.constexpr,  # load through k_desc / v_desc (the tile lies in one page)
):
    """One KV tile folded into the rows' online softmax. Tiles before the diagonal (every
    row sees every key) skip the mask."""
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    valid = offs_n < kv_end
    if TMA:
        page = tl.load(block_table + kv_start // BLOCK_SIZE).to(tl.int32)
        row = page * BLOCK_SIZE + kv_start % BLOCK_SIZE
        k = k_desc.load([row, kv_head * HEAD_DIM])
        v = v_desc.load([row, kv_head * HEAD_DIM])
    else:  # unmasked tiles: every position of the tile exists
        head_offset = kv_head * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_table, offs_n, valid, head_offset,
                            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, MASKED)
    if TMA and MASKED:  # the page's slots past the sequence hold another one's values
        v = tl.where(valid[:, None], v.to(q.dtype), 0.0)
    visible = (offs_n[None, :] <= q_pos[:, None]) & valid[None, :]  # [BLOCK_M, BLOCK_N]
    # An fp8 cache is upcast to q's dtype there; its scales are the caller's.
    return attend_loaded_tile(q, m, l_sum, acc, k, v, visible, qk_scale, DOT_PRECISION,
                              MASKED=MASKED)


@triton.jit
def _find_seq(cu_seqlens_ptr, num_seqs, tile, BLOCK_M: tl.constexpr):
    # Sequence i owns the query tiles [cu[i] // BLOCK_M + i, cu[i + 1] // BLOCK_M + i + 1):
    # at least cdiv(q_len_i, BLOCK_M) of them, and num_tokens // BLOCK_M + num_seqs in all.
    # Find the last i whose first tile is <= tile.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# NOTE: the block table's row stride and the sequence count change every step; not
# specialised on, so a new batch shape never compiles a new variant mid-run.
@triton.jit(do_not_specialize=["bt_stride_s", "num_seqs"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,  # TMA only: the cache as [slots, NUM_KV_HEADS * HEAD_DIM] (else None)
    v_desc,
    out_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    bt_stride_s,
    num_seqs,
    qk_scale,  # softmax scale * log2(e) (* k_scale, fp8): the softmax runs in base 2
    v_scale,  # fp8 only: the output's factor
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache is fp8: q keeps its dtype, tiles are upcast to it
    TMA: tl.constexpr,  # K/V tiles through k_desc / v_desc (BLOCK_N divides BLOCK_SIZE)
    LAST_FIRST: tl.constexpr,  # the grid's last query tiles (the longest rows) start first
):
    # Heads vary fastest across the grid so a KV group's heads run together and share
    # their K/V tiles through L2.
    head = tl.program_id(0)
    tile = tl.program_id(1)
    if LAST_FIRST:
        tile = tl.num_programs(1) - 1 - tile
    seq = _find_seq(cu_seqlens_ptr, num_seqs, tile, BLOCK_M)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    local_tile = tile - (q_start // BLOCK_M + seq)
    if local_tile * BLOCK_M >= q_len:  # spare program of the grid's upper bound
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP

    offs_m = local_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < q_len
    q_pos = seq_len - q_len + offs_m  # [BLOCK_M] positions in the context
    dims = tl.arange(0, HEAD_DIM)
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * q_stride_t + head * q_stride_h + dims[None, :],
        mask=m_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]
    if not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * bt_stride_s
    # Causal: nothing past this tile's last query. The tiles before the first row's own
    # position are seen whole by every row (no mask); the rest hold the diagonal. Every
    # row sees key 0, so the first tile makes each row's max finite and later fully masked
    # tiles add exp2(-inf) = 0.
    first_pos = seq_len - q_len + local_tile * BLOCK_M
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for kv_start in range(0, full_end, BLOCK_N):
        m, l_sum, acc = _attend_prefill_tile(
            q, m, l_sum, acc, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_table,
            kv_start, kv_end, q_pos, kv_head, qk_scale, BLOCK_SIZE, NUM_KV_HEADS,
            HEAD_DIM, BLOCK_N, DOT_PRECISION, False, TMA)
    for kv_start in range(full_end, kv_end, BLOCK_N):
        m, l_sum, acc = _attend_prefill_tile(
            q, m, l_sum, acc, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_table,
            kv_start, kv_end, q_pos, kv_head, qk_scale, BLOCK_SIZE, NUM_KV_HEADS,
            HEAD_DIM, BLOCK_N, DOT_PRECISION, True, TMA)

    out = acc / l_sum[:, None]
    if KV_FP8:
        out = out * v_scale
    tl.store(out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


def _tile_config(dtype: torch.dtype, head_dim: int, num_tokens: int = 0) -> dict:
    flags = dict(TMA=False, LAST_FIRST=False)
    if dtype == torch.float32:  # exact fp32 dots; small tiles to keep registers in check
        return dict(flags, BLOCK_M=32, BLOCK_N=32, DOT_PRECISION="ieee", num_warps=4,
                    num_stages=1)
    if head_dim > 128:
        return dict(flags, BLOCK_M=64, BLOCK_N=32, DOT_PRECISION="tf32", num_warps=4,
                    num_stages=2)
    # A step of few tokens takes smaller query tiles (more programs): kernels/tuning.py.
    return dict(prefill_tile(num_tokens), DOT_PRECISION="tf32")


def _kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> tuple:
    """TMA descriptors of a layer's K and V as [slots, NUM_KV_HEADS * HEAD_DIM] tables of
    [block_n, head_dim] tiles; (None, None) where TMA cannot serve: a GPU older than Hopper
    (compute capability 9.0), the CPU outside Triton's interpreter (which reads them, for
    tests), or tiles that would straddle two pages."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size % block_n:
        return None, None
    if k_cache.device.type == "cuda":
        if torch.cuda.get_device_capability(k_cache.device)[0] < 9:
            return None, None
    elif not INTERPRETING:
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    shape = [num_blocks * block_size, num_kv_heads * head_dim]
    strides = [num_kv_heads * head_dim, 1]
    return tuple(TensorDescriptor(cache, shape, strides, [block_n, head_dim])
                 for cache in (k_cache, v_cache))


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    *,
    k_scale: float = 1.0,  # an fp8 cache's scales (kernels/store_kvcache.py)
    v_scale: float = 1.0,
    tile_config: dict | None = None,
    check: bool = True,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton version of `prefill_attention_ref`; no host sync. The caller guarantees
    cu_seqlens_q[-1] <= num_tokens (rows past it, CUDA graph padding, are left unwritten)
    and q_len <= seq_len for every sequence (values on the device are not checked).
    `tile_config` overrides the tiles (tests, benchmarks); `check=False` skips the input
    checks (an engine checks each kernel's first launch)."""
    device = k_cache.device
    if check:
        check_paged_attention(k_cache, v_cache, seq_lens, block_tables, q=q)
        check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES, device=device)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens, num_heads, _ = q.shape
    num_seqs = seq_lens.shape[0]
    if check:
        if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
            raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} needs num_seqs + 1 "
                             f"entries and block_tables {tuple(block_tables.shape)} one row "
                             f"per sequence; seq_lens has {num_seqs}")
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    fp8 = is_fp8(k_cache.dtype)
    compute_dtype = q.dtype if fp8 else k_cache.dtype
    if tile_config is None:  # a CUDA graph's bucket has its own token count: captured alike
        tile_config = _tile_config(compute_dtype, head_dim, num_tokens)
    config = dict(tile_config)
    k_desc = v_desc = None
    if config.pop("TMA", False):
        k_desc, v_desc = _kv_descriptors(k_cache, v_cache, config["BLOCK_N"])
    num_tiles = num_tokens // config["BLOCK_M"] + num_seqs
    _prefill_kernel[(num_heads, num_tiles)](
        q,
        k_cache,
        v_cache,
        k_desc,
        v_desc,
        out,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        num_seqs,
        scale * LOG2E * (k_scale if fp8 else 1.0),
        v_scale,
        GROUP=num_heads // num_kv_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        KV_FP8=fp8,
        TMA=k_desc is not None,
        **{"LAST_FIRST": False, **config},
    )
    return out
