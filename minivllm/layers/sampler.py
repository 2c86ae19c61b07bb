"""Batched sampling on the logits' device: greedy, temperature, top-k, top-p, min-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """Per-row sampling settings, already on the logits' device."""

    temperatures: torch.Tensor | None  # [num_seqs] float32; 0 = greedy
    top_ks: torch.Tensor | None  # [num_seqs] int64; <= 0 = off
    top_ps: torch.Tensor | None  # [num_seqs] float32; 1 = off
    min_ps: torch.Tensor | None  # [num_seqs] float32; 0 = off
    seeds: list[int | None]  # per-row seed, combined with the row's step for reproducibility
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    all_greedy: bool

    @classmethod
    def greedy(cls) -> SamplingTensors:
        """Every row greedy: nothing but an argmax is needed."""
        return cls(None, None, None, None, [], False, False, False, True)


def _exponential_noise(
    shape: tuple[int, int],
    seeds: list[int | None],
    device: torch.device,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Exp(1) noise; rows with a seed draw from their own generator, so a seeded
    request gives the same tokens whatever else is in the batch."""
    q = torch.empty(shape, device=device).exponential_(generator=generator)
    for row, seed in enumerate(seeds):
        if seed is not None:
            g = torch.Generator(device=device)
            g.manual_seed(seed)
            q[row].exponential_(generator=g)
    return q


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """logits: [num_seqs, vocab] -> token ids [num_seqs] (int64, on device)."""
        greedy = logits.argmax(dim=-1)
        if t.all_greedy:
            return greedy
        logits = logits.float()
        temps = torch.where(t.temperatures > 0, t.temperatures, 1.0)
        logits = logits / temps[:, None]
        if t.needs_top_k or t.needs_top_p:
            logits = _top_k_top_p(logits, t.top_ks, t.top_ps, t.needs_top_k, t.needs_top_p)
        if not t.needs_min_p:
            # Gumbel-max in log space: argmax(logits / T - log q), q ~ Exp(1), samples
            # from softmax(logits / T) without computing it.
            q = _exponential_noise(logits.shape, t.seeds, logits.device, self.generator)
            sampled = (logits - q.log_()).argmax(dim=-1)
            return torch.where(t.temperatures > 0, sampled, greedy)
        probs = torch.softmax(logits, dim=-1)
        if t.needs_min_p:
            floor = t.min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < floor, 0.0, probs)
        # Gumbel-max in its exponential form: argmax(p / q), q ~ Exp(1), samples from p.
        q = _exponential_noise(probs.shape, t.seeds, probs.device, self.generator)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(t.temperatures > 0, sampled, greedy)


def _top_k_top_p(logits, top_ks, top_ps, use_k: bool, use_p: bool) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if use_k:
        k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), vocab)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    if use_p:
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before >= top_ps[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
