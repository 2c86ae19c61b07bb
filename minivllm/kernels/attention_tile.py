"""The inner step decode and prefill attention share: one KV tile gathered through the
block table, folded into a running (online) softmax. Device code only (no kernel here)."""

from __future__ import annotations

from minivllm.kernels.dispatch import tl, triton

LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: scale * log2(e), exp2


@triton.jit
def upcast_kv(x, dtype: tl.constexpr, FP8_ASM: tl.constexpr):
    """A loaded K/V tile in the compute `dtype`. FP8_ASM (an e4m3 tile, fp16 compute): one
    `cvt.rn.f16x2.e4m3x2` per two values, in the registers the load filled. Triton's own
    upcast is converted in the products' operand layout, after the tile went through shared
    memory: H100, decode attention at 256 x 512, 145.3 us to fp16 that way against 119.7
    with this (scripts/decode_attn_sweep.py); to bf16 (one more conversion a value) slower
    still."""
    if FP8_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True,
            pack=4)
    return x.to(dtype)


@triton.jit
def attend_kv_tile(
    q,  # [ROWS, HEAD_DIM] in the compute dtype (the cache's; q's own or fp16 for fp8)
    m,  # [ROWS] running max (base 2)
    l_sum,  # [ROWS] running sum of exp2(s - m)
    acc,  # [ROWS, HEAD_DIM] fp32, unnormalised
    k_cache_ptr,
    v_cache_ptr,
    block_table,  # this sequence's row of the block table
    offs,  # [BLOCK_N] context positions of the tile
    valid,  # [BLOCK_N] positions that exist (loads are masked with it)
    visible,  # [ROWS, BLOCK_N] which key each row may see
    head_offset,  # [1, HEAD_DIM]: kv_head * HEAD_DIM + dims
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_ASM: tl.constexpr = False,
):
    kv_offsets = kv_tile_offsets(block_table, offs, valid, head_offset, BLOCK_SIZE,
                                 NUM_KV_HEADS, HEAD_DIM)
    # An fp8 cache is upcast to the compute dtype here (a no-op otherwise); its scales are
    # the caller's: k's folded into qk_scale, v's applied to the output.
    k = upcast_kv(tl.load(k_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0), q.dtype,
                  FP8_ASM)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))  # [ROWS, BLOCK_N]
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    v = upcast_kv(tl.load(v_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0), q.dtype,
                  FP8_ASM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_sum, acc


@triton.jit
def kv_tile_offsets(
    block_table,  # this sequence's row of the block table
    offs,  # [BLOCK_N] context positions of the tile
    valid,  # [BLOCK_N] positions that exist (MASKED: the page loads are masked with it)
    head_offset,  # [1, HEAD_DIM]: kv_head * HEAD_DIM + dims
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """[BLOCK_N, HEAD_DIM] element offsets of a K/V tile in the cache, through the block
    table. MASKED=False: every position exists (`valid` is not read)."""
    if MASKED:
        page = tl.load(block_table + offs // BLOCK_SIZE, mask=valid, other=0)
    else:
        page = tl.load(block_table + offs // BLOCK_SIZE)
    # NOTE: int64: a layer's pool can exceed 2**31 elements.
    slot = page.to(tl.int64) * BLOCK_SIZE + offs % BLOCK_SIZE  # [BLOCK_N]
    return slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + head_offset


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table,
    offs,  # [BLOCK_N] context positions of the tile
    valid,  # [BLOCK_N]
    head_offset,  # [1, HEAD_DIM]
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """One K/V tile gathered through the block table (loads issued together, so a caller
    can start them early and use them later); the same loads `attend_kv_tile` makes.
    MASKED=False: every position exists, the loads have no predicates."""
    kv_offsets = kv_tile_offsets(block_table, offs, valid, head_offset, BLOCK_SIZE,
                                 NUM_KV_HEADS, HEAD_DIM, MASKED)
    if MASKED:
        k = tl.load(k_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
    else:
        k = tl.load(k_cache_ptr + kv_offsets)
        v = tl.load(v_cache_ptr + kv_offsets)
    return k, v


@triton.jit
def attend_loaded_tile(q, m, l_sum, acc, k, v, visible, qk_scale,
                       DOT_PRECISION: tl.constexpr, FP8_ASM: tl.constexpr = False,
                       MASKED: tl.constexpr = True):
    """`attend_kv_tile`'s online-softmax step over a tile already in registers (same
    arithmetic, so both give the same bits). MASKED=False: every row sees every key of
    the tile (`visible` is not read)."""
    k = upcast_kv(k, q.dtype, FP8_ASM)
    v = upcast_kv(v, q.dtype, FP8_ASM)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))  # [ROWS, BLOCK_N]
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_sum, acc
