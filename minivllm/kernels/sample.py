"""Greedy and temperature sampling of a batch's rows in one pass over the logits.

A row with temperature T > 0 takes argmax(logits / T + g), g ~ Gumbel(0, 1) drawn per
token (the Gumbel-max trick: a draw from softmax(logits / T)); a row with T = 0 takes its
first maximal logit. The torch sampler (layers/sampler.py) does the same in about ten
launches over an fp32 copy of the logits (upcast, divide, draw Exp(1) noise, its log, two
argmaxes); here each row's logits are read once in their own dtype and the noise is made
in registers by Philox (`tl.rand4x`), keyed by one seed a step (drawn on the device by the
sampler; staged with a decode graph's inputs when the graph picks the tokens).
With a grammar's bitmask (one bit per token, a row per row), a token whose bit is 0 is
never taken: the mask is read beside the logits instead of written into them first.

A row's vocabulary is split across programs (`num_splits`: enough programs to fill the
chip at any batch), each writing its stretch's best greedy and sampled columns; a second,
small launch picks each row's best of them. The draws are keyed by (row, column) alone, so
the tokens do not depend on the split.
"""

from __future__ import annotations

import torch

from minivllm.kernels.dispatch import check_tensor, num_sms, require_triton, tl, triton

BLOCK = 256  # logits a lane group reads per sub-block; four sub-blocks share one Philox call
NUM_WARPS = 8
PROGRAMS_PER_SM = 16  # split rows until the launch has this many programs a multiprocessor
# H100, a 151,936-token vocabulary in bf16, the launch timed in CUDA-graph replays: at 190
# rows 101.8 us sampled and 28.2 us greedy (torch's argmax: 47.9), against 162.5 / 86.9
# with 1,024 logits a sub-block and 8 programs a multiprocessor, and 237.5 / 136.4 with one
# program a row. Of 32 settings (sub-blocks of 256-2,048, 4 or 8 warps, 4-32 programs a
# multiprocessor): the fastest at 32 and 190 sampled rows, within 3% of it at 1-256 rows
# (within 0.6 us greedy at 1-32 rows, 5% at 104-256).


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
    """The first column of the largest of the lanes' running bests."""
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


@triton.jit(do_not_specialize=["vocab", "row_stride", "mask_stride", "chunk"])
def _sample_kernel(logits_ptr, temps_ptr, seed_ptr, mask_ptr, best_ptr, index_ptr, vocab,
                   row_stride, mask_stride, chunk, BLOCK: tl.constexpr,
                   HAS_MASK: tl.constexpr):
    """One row's columns [split * chunk, (split + 1) * chunk): its largest logit and, for a
    sampled row, its largest logit / T + Gumbel noise, with their first columns."""
    row = tl.program_id(0)
    split = tl.program_id(1)
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
    first = split * chunk
    for start in range(first, tl.minimum(first + chunk, vocab), 4 * BLOCK):
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
    if sampled:
        best_g, index_g = best_s, index_s  # a sampled row's token is its noisy argmax
    out = row * tl.num_programs(1) + split
    tl.store(best_ptr + out, tl.max(best_g, axis=0))
    tl.store(index_ptr + out, _argmax(best_g, index_g, vocab))


# NOTE: `splits` changes with the batch: not specialised on, one compiled variant a model.
@triton.jit(do_not_specialize=["vocab", "splits"])
def _pick_kernel(best_ptr, index_ptr, out_ptr, vocab, splits, SPLITS_PAD: tl.constexpr):
    """A row's token: the best of its splits' bests (the earliest split on a tie, so the
    row's first maximal column)."""
    row = tl.program_id(0)
    split = tl.arange(0, SPLITS_PAD)
    valid = split < splits
    best = tl.load(best_ptr + row * splits + split, mask=valid, other=float("-inf"))
    index = tl.load(index_ptr + row * splits + split, mask=valid, other=vocab)
    token = _argmax(best, index, vocab)
    # A row whose logits are all -inf (or NaN) keeps column 0, as torch's argmax does.
    tl.store(out_ptr + row, tl.where(token < vocab, token, 0).to(tl.int64))


def num_splits(rows: int, vocab: int, sms: int) -> tuple[int, int]:
    """(splits a row, columns a split: a whole number of loop steps) so that the launch has
    about PROGRAMS_PER_SM programs a multiprocessor, or a loop step a program."""
    step = 4 * BLOCK  # columns a program reads per loop step (one Philox call per lane)
    steps = triton.cdiv(vocab, step)
    wanted = min(steps, max(1, triton.cdiv(PROGRAMS_PER_SM * sms, rows)))
    chunk = triton.cdiv(steps, wanted) * step
    return triton.cdiv(vocab, chunk), chunk


def sample_rows(
    logits: torch.Tensor,  # [rows, vocab], any float dtype; unit stride along the vocabulary
    temperatures: torch.Tensor,  # [rows] float32; <= 0: greedy
    seed: torch.Tensor,  # [1] int64 on the logits' device: this step's Philox key
    bitmask: torch.Tensor | None = None,  # [rows, ceil(vocab / 32)] int32: allowed tokens
    *,
    out: torch.Tensor | None = None,  # [rows] int64: where the tokens go (a graph's buffer)
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
        if out is not None:
            check_tensor("out", out, 1, (torch.int64,), device=logits.device)
            if out.shape[0] != logits.shape[0]:
                raise ValueError(f"out has {out.shape[0]} rows; logits has {logits.shape[0]}")
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        has_mask = bitmask is not None
        splits, chunk = num_splits(rows, vocab, num_sms(logits.device))
        best = torch.empty(rows * splits, dtype=torch.float32, device=logits.device)
        index = torch.empty(rows * splits, dtype=torch.int32, device=logits.device)
        _sample_kernel[(rows, splits)](logits, temperatures, seed,
                                       bitmask if has_mask else logits, best, index, vocab,
                                       logits.stride(0), bitmask.stride(0) if has_mask else 0,
                                       chunk, BLOCK=BLOCK, HAS_MASK=has_mask,
                                       num_warps=NUM_WARPS)
        _pick_kernel[(rows,)](best, index, out, vocab, splits,
                              SPLITS_PAD=triton.next_power_of_2(triton.cdiv(vocab, 4 * BLOCK)),
                              num_warps=1)
    return out


def sample_rows_ref(
    logits: torch.Tensor,  # [rows, vocab]
    temperatures: torch.Tensor,  # [rows] float32; <= 0: greedy
    seed: torch.Tensor,  # [1] int64: unused, the noise is torch's (see below)
    bitmask: torch.Tensor | None = None,  # [rows, ceil(vocab / 32)] int32: allowed tokens
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [rows] int64
    """`sample_rows` in torch ops: the same greedy tokens and the same distribution, with
    the noise drawn from torch's default generator (inside a CUDA graph, a fresh draw each
    replay) rather than keyed by `seed`."""
    x = logits.float()
    if bitmask is not None:
        cols = torch.arange(x.shape[1], device=x.device)
        bits = (bitmask[:, cols // 32] >> (cols % 32)) & 1
        x = x.masked_fill(bits == 0, float("-inf"))
    tokens = x.argmax(-1)
    sampled = temperatures > 0
    t = torch.where(sampled, temperatures, 1.0)[:, None]
    u = torch.rand(x.shape, device=x.device).clamp_(min=torch.finfo(torch.float32).tiny)
    tokens = torch.where(sampled, (x / t - (-u.log()).log()).argmax(-1), tokens)
    if out is None:
        return tokens
    return out.copy_(tokens)
