"""Greedy and temperature sampling of a batch's rows in one pass over the logits.

A row with temperature T > 0 takes argmax(logits / T + g), g ~ Gumbel(0, 1) drawn per
token (the Gumbel-max trick: a draw from softmax(logits / T)); a row with T = 0 takes its
first maximal logit. The torch sampler (layers/sampler.py) does the same in about ten
launches over an fp32 copy of the logits (upcast, divide, draw Exp(1) noise, its log, two
argmaxes); here each row's logits are read once in their own dtype and the noise is made
in registers by Philox (`tl.rand4x`), keyed by a seed drawn once a step on the device.
With a grammar's bitmask (one bit per token, a row per row), a token whose bit is 0 is
never taken: the mask is read beside the logits instead of written into them first.
"""

from __future__ import annotations

import torch

from minivllm.kernels.dispatch import check_tensor, require_triton, tl, triton

BLOCK = 1024  # logits a lane group reads per sub-block; four sub-blocks share one Philox call


@triton.jit
def _fold(best, index, x, cols, mask):
    """Per lane, the larger of the running best and `x` (the earlier column on a tie)."""
    x = tl.where(mask, x, float("-inf"))
    better = x > best
    return tl.where(better, x, best), tl.where(better, cols, index)


@triton.jit
def _gumbel(u):
    """Gumbel(0, 1) from a uniform draw in [0, 1) (Triton's are below 1.0 in fp32, so the
    inner log stays negative; a draw of 0 gives -inf, never taken)."""
    return -tl.log(-tl.log(u))


@triton.jit
def _argmax(best, index, vocab):
    """The row's largest value and its first column from the lanes' running bests."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, index, vocab), axis=0)


@triton.jit
def _load(base, mask_base, cols, vocab, HAS_MASK: tl.constexpr):
    """Logits at `cols` in fp32; -inf past the vocabulary and, with a mask, where the
    column's bit is 0."""
    x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        words = tl.load(mask_base + cols // 32, mask=cols < vocab, other=0)
        x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit(do_not_specialize=["vocab", "row_stride", "mask_stride"])
def _sample_kernel(logits_ptr, temps_ptr, seed_ptr, mask_ptr, out_ptr, vocab, row_stride,
                   mask_stride, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(temps_ptr + row)
    sampled = temp > 0.0
    inv_t = 1.0 / tl.where(sampled, temp, 1.0)
    seed = tl.load(seed_ptr)
    base = logits_ptr + row.to(tl.int64) * row_stride
    mask_base = mask_ptr + row.to(tl.int64) * mask_stride
    lanes = tl.arange(0, BLOCK)
    best_g = tl.full([BLOCK], float("-inf"), tl.float32)
    index_g = tl.zeros([BLOCK], tl.int32)
    best_s = tl.full([BLOCK], float("-inf"), tl.float32)
    index_s = tl.zeros([BLOCK], tl.int32)
    # Each row's draws come from its own stretch of Philox counters: unique per (row, column).
    first_counter = row * tl.cdiv(vocab, 4 * BLOCK) * BLOCK
    for start in range(0, vocab, 4 * BLOCK):
        c0 = start + lanes
        c1 = c0 + BLOCK
        c2 = c1 + BLOCK
        c3 = c2 + BLOCK
        x0 = _load(base, mask_base, c0, vocab, HAS_MASK)
        x1 = _load(base, mask_base, c1, vocab, HAS_MASK)
        x2 = _load(base, mask_base, c2, vocab, HAS_MASK)
        x3 = _load(base, mask_base, c3, vocab, HAS_MASK)
        best_g, index_g = _fold(best_g, index_g, x0, c0, c0 < vocab)
        best_g, index_g = _fold(best_g, index_g, x1, c1, c1 < vocab)
        best_g, index_g = _fold(best_g, index_g, x2, c2, c2 < vocab)
        best_g, index_g = _fold(best_g, index_g, x3, c3, c3 < vocab)
        if sampled:
            u0, u1, u2, u3 = tl.rand4x(seed, first_counter + start // 4 + lanes)
            best_s, index_s = _fold(best_s, index_s, x0 * inv_t + _gumbel(u0), c0,
                                    c0 < vocab)
            best_s, index_s = _fold(best_s, index_s, x1 * inv_t + _gumbel(u1), c1,
                                    c1 < vocab)
            best_s, index_s = _fold(best_s, index_s, x2 * inv_t + _gumbel(u2), c2,
                                    c2 < vocab)
            best_s, index_s = _fold(best_s, index_s, x3 * inv_t + _gumbel(u3), c3,
                                    c3 < vocab)
    token = _argmax(best_g, index_g, vocab)
    if sampled:
        token = _argmax(best_s, index_s, vocab)
    # A row whose logits are all -inf (or NaN) keeps column 0, as torch's argmax does.
    tl.store(out_ptr + row, tl.where(token < vocab, token, 0).to(tl.int64))


def sample_rows(
    logits: torch.Tensor,  # [rows, vocab], any float dtype; unit stride along the vocabulary
    temperatures: torch.Tensor,  # [rows] float32; <= 0: greedy
    seed: torch.Tensor,  # [1] int64 on the logits' device: this step's Philox key
    bitmask: torch.Tensor | None = None,  # [rows, ceil(vocab / 32)] int32: allowed tokens
    *,
    check: bool = True,
) -> torch.Tensor:  # [rows] int64
    """One token per row: its argmax where the temperature is 0, else a draw from
    softmax(logits / T), among the tokens `bitmask` allows (token j of row i: bit j % 32
    of word j // 32). The same seed gives the same tokens."""
    if check:
        require_triton()
        check_tensor("logits", logits, 2)
        check_tensor("temperatures", temperatures, 1, (torch.float32,), device=logits.device)
        check_tensor("seed", seed, 1, (torch.int64,), device=logits.device)
        if temperatures.shape[0] != logits.shape[0]:
            raise ValueError(f"temperatures has {temperatures.shape[0]} rows; logits has "
                             f"{logits.shape[0]}")
        if seed.numel() != 1:
            raise ValueError(f"seed must hold one value, got {seed.numel()}")
        if bitmask is not None:
            words = (logits.shape[1] + 31) // 32
            check_tensor("bitmask", bitmask, 2, (torch.int32,), device=logits.device)
            if bitmask.shape[0] != logits.shape[0] or bitmask.shape[1] < words:
                raise ValueError(f"bitmask has shape {tuple(bitmask.shape)}; logits "
                                 f"{tuple(logits.shape)} need at least ({logits.shape[0]}, "
                                 f"{words})")
            if bitmask.stride(1) != 1:
                raise ValueError("bitmask must have unit stride along its words")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        has_mask = bitmask is not None
        _sample_kernel[(rows,)](logits, temperatures, seed, bitmask if has_mask else logits,
                                out, vocab, logits.stride(0),
                                bitmask.stride(0) if has_mask else 0,
                                BLOCK=BLOCK, HAS_MASK=has_mask, num_warps=8)
    return out
