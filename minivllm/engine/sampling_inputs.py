"""The sampler's inputs for one step as tensors on the device: temperatures, top-k / top-p /
min-p, seeds, the penalties' token statistics, the min_tokens ban and a grammar's bitmask,
each built from the batch's lists in one host-to-device copy per dtype (no sync)."""

from __future__ import annotations

import numpy as np
import torch

from ..layers.sampler import PenaltyTensors, SamplingTensors
from .batch import ForwardBatch

_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A list of Python numbers as a CPU tensor. Through numpy's fromiter: 3-4x faster than
    torch.tensor at every length (an 8k prompt's 24,600 step inputs: 1.96 -> 0.42 ms)."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.fromiter(values, dtype=np_dtype, count=len(values)))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list as a tensor on `device`: on CUDA through pinned memory, without a sync."""
    t = host_tensor(values, dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def sampling_tensors(
    b: ForwardBatch, bitmask: torch.Tensor | None, device: torch.device, vocab_size: int
) -> SamplingTensors:
    """The sampler's inputs for batch `b`; `bitmask` (a CPU int32 tensor, one row per
    sequence) holds the allowed tokens of the batch's `bitmask_rows`."""
    if all(t == 0 for t in b.temperatures):
        t = SamplingTensors.greedy()
    else:
        floats = to_device(b.temperatures + b.top_ps + b.min_ps, torch.float32, device)
        temperatures, top_ps, min_ps = floats.split(b.num_seqs)
        t = SamplingTensors(
            temperatures=temperatures,
            top_ks=to_device(b.top_ks, torch.long, device),
            top_ps=top_ps,
            min_ps=min_ps,
            seeds=b.seeds,
            needs_top_k=any(k > 0 for k in b.top_ks),
            needs_top_p=any(p < 1 for p in b.top_ps),
            needs_min_p=any(p > 0 for p in b.min_ps),
            all_greedy=False,
        )
    if b.extras:
        _add_extras(t, b, device, vocab_size)
    if b.bitmask_rows:
        if bitmask is None:
            raise ValueError(f"rows {b.bitmask_rows} sample under a grammar: no bitmask")
        t.token_bitmask, t.bitmask_rows = bitmask, b.bitmask_rows
        if device.type == "cuda":
            # Non-blocking: the mask goes up behind the forward on the same stream. The
            # engine's masks are filled in pinned memory already.
            pinned = bitmask if bitmask.is_pinned() else bitmask.pin_memory()
            t.token_bitmask = pinned.to(device, non_blocking=True)
    return t


def _add_extras(
    t: SamplingTensors, b: ForwardBatch, device: torch.device, vocab_size: int
) -> None:
    """Penalty statistics and the min_tokens mask, built on the device from the
    rows' token lists (host-to-device copies, no sync)."""
    extras = b.extras
    t.num_logprobs = max(x.num_logprobs for x in extras.values())
    banned = [(row, tok) for row, x in extras.items() for tok in x.banned_ids]
    if banned:
        rows, ids = zip(*banned, strict=True)
        t.banned = tuple(to_device([*rows, *ids], torch.long, device).split(len(rows)))
    # Penalties act on the tokens seen so far: with none there is nothing to do.
    if not any(x.prompt_ids or x.output_ids for x in extras.values()):
        return
    n = b.num_seqs
    rows_p = [row for row, x in extras.items() for _ in x.prompt_ids]
    rows_o = [row for row, x in extras.items() for _ in x.output_ids]
    ids_p = [tok for x in extras.values() for tok in x.prompt_ids]
    ids_o = [tok for x in extras.values() for tok in x.output_ids]
    longs = to_device(rows_p + ids_p + rows_o + ids_o, torch.long, device)
    rows_p_t, ids_p_t, rows_o_t, ids_o_t = longs.split([len(rows_p)] * 2 + [len(rows_o)] * 2)
    counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
    counts.index_put_((rows_o_t, ids_o_t), torch.ones_like(ids_o_t, dtype=torch.float32), True)
    seen = counts > 0
    seen[rows_p_t, ids_p_t] = True
    factors = [[1.0] * n, [0.0] * n, [0.0] * n]  # repetition, presence, frequency
    for row, x in extras.items():
        factors[0][row] = x.repetition_penalty
        factors[1][row] = x.presence_penalty
        factors[2][row] = x.frequency_penalty
    floats = to_device(factors[0] + factors[1] + factors[2], torch.float32, device)
    repetition, presence, frequency = floats.split(n)
    t.penalties = PenaltyTensors(repetition, presence, frequency, seen, counts)
