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
def load_v_words(
    v_cache_ptr,  # an fp8 cache
    slot,  # [BLOCK_N] int64: the tile's cache slots (`kv_tile_slots`)
    valid,  # [BLOCK_N]
    kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8_ASM: tl.constexpr,
):
    """An fp8 V tile as [BLOCK_N, HEAD_DIM] fp16, loaded as 32-bit words (four values a
    word along the head dimension) and upcast in the layout the words arrived in. The
    products want V with positions along each thread's registers: loaded as bytes, Triton
    gathers that layout from shared memory a byte at a time; upcast first, the layout
    change moves 16-bit values instead."""
    words_ptr = v_cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    offsets = (slot[:, None] * (NUM_KV_HEADS * HEAD_DIM // 4) + kv_head * (HEAD_DIM // 4)
               + tl.arange(0, HEAD_DIM // 4)[None, :])
    words = tl.load(words_ptr + offsets, mask=valid[:, None], other=0)  # [BLOCK_N, D / 4]
    if FP8_ASM:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:  # the interpreter: the same values through Triton's own conversion
        v0 = _fp8_byte(words, 0)
        v1 = _fp8_byte(words, 8)
        v2 = _fp8_byte(words, 16)
        v3 = _fp8_byte(words, 24)
    # join adds a last dimension: [BLOCK_N, D / 4, 2 (i), 2 (o)] holds byte 2 i + o of word
    # j, which is dimension 4 j + 2 i + o after the reshape.
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), [slot.shape[0], HEAD_DIM])


@triton.jit
def _fp8_byte(words, shift: tl.constexpr):
    byte = ((words >> shift) & 0xFF).to(tl.uint8)
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)


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
    V_WORDS: tl.constexpr = False,  # an fp8 cache's V through `load_v_words`
    kv_head=0,  # V_WORDS only
    ONE_PAGE: tl.constexpr = False,  # the tile lies in one page (`kv_tile_slots`)
    tile_start=0,  # ONE_PAGE only: offs[0]
):
    slot = kv_tile_slots(block_table, offs, valid, BLOCK_SIZE, True, ONE_PAGE, tile_start)
    kv_offsets = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + head_offset
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
    if V_WORDS:
        v = load_v_words(v_cache_ptr, slot, valid, kv_head, NUM_KV_HEADS, HEAD_DIM, FP8_ASM)
    else:
        v = upcast_kv(tl.load(v_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0),
                      q.dtype, FP8_ASM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_sum, acc


@triton.jit
def kv_tile_slots(
    block_table,  # this sequence's row of the block table
    offs,  # [BLOCK_N] context positions of the tile
    valid,  # [BLOCK_N] positions that exist (MASKED: the page loads are masked with it)
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr = True,
    ONE_PAGE: tl.constexpr = False,  # the tile lies in one page (see below)
    tile_start=0,  # ONE_PAGE: offs[0], a multiple of BLOCK_N
):
    """[BLOCK_N] cache slots of a tile's positions, through the block table. MASKED=False:
    every position exists (`valid` is not read). ONE_PAGE: the tile starts at a multiple of
    its length and a page holds whole tiles (BLOCK_SIZE a multiple of BLOCK_N), so one
    block-table entry serves the tile and the slots are consecutive: one load a tile instead
    of one a position, and offsets the compiler knows to be contiguous."""
    # NOTE: int64: a layer's pool can exceed 2**31 elements.
    if ONE_PAGE:
        page = tl.load(block_table + tile_start // BLOCK_SIZE)
        return (page.to(tl.int64) * BLOCK_SIZE + tile_start % BLOCK_SIZE
                + tl.arange(0, offs.shape[0]))
    if MASKED:
        page = tl.load(block_table + offs // BLOCK_SIZE, mask=valid, other=0)
    else:
        page = tl.load(block_table + offs // BLOCK_SIZE)
    return page.to(tl.int64) * BLOCK_SIZE + offs % BLOCK_SIZE


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
    ONE_PAGE: tl.constexpr = False,
    tile_start=0,
):
    """[BLOCK_N, HEAD_DIM] element offsets of a K/V tile in the cache, through the block
    table. MASKED=False: every position exists (`valid` is not read); ONE_PAGE and
    tile_start: `kv_tile_slots`'."""
    slot = kv_tile_slots(block_table, offs, valid, BLOCK_SIZE, MASKED, ONE_PAGE, tile_start)
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
    ONE_PAGE: tl.constexpr = False,
    tile_start=0,
):
    """One K/V tile gathered through the block table (loads issued together, so a caller
    can start them early and use them later); the same loads `attend_kv_tile` makes.
    MASKED=False: every position exists, the loads have no predicates; ONE_PAGE and
    tile_start: `kv_tile_slots`'."""
    kv_offsets = kv_tile_offsets(block_table, offs, valid, head_offset, BLOCK_SIZE,
                                 NUM_KV_HEADS, HEAD_DIM, MASKED, ONE_PAGE, tile_start)
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
