"""Batched sampling on the logits' device: penalties, min_tokens masking, greedy,
temperature, top-k, top-p, min-p, and the log-probabilities callers ask for.

Order, per row: penalties and the min_tokens mask change the logits; logprobs are read
from softmax(logits / T) (T=1 for greedy rows); then top-k/top-p/min-p cut and a token
is drawn. Everything stays on the device: the only host sync is the caller's
`.tolist()` of the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.dispatch import use_triton
from ..outputs import TokenLogprob


@dataclass
class PenaltyTensors:
    """Per-row penalties and the token statistics they read, on the logits' device."""

    repetition: torch.Tensor  # [num_seqs] float32; 1 = off
    presence: torch.Tensor  # [num_seqs] float32; 0 = off
    frequency: torch.Tensor  # [num_seqs] float32; 0 = off
    seen: torch.Tensor  # [num_seqs, vocab] bool: in the prompt or the completion
    output_counts: torch.Tensor  # [num_seqs, vocab] float32: occurrences in the completion


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
    penalties: PenaltyTensors | None = None
    # (rows, token ids) whose logits are set to -inf: eos and stop ids before min_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    num_logprobs: int = -1  # the most top-N any row asks for; -1 = no row wants logprobs
    # Structured outputs: a [num_seqs, ceil(vocab / 32)] int32 bitmask of the tokens each
    # row may sample (all ones where no grammar constrains the row), and the rows it
    # constrains.
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None

    @classmethod
    def greedy(cls) -> SamplingTensors:
        """Every row greedy: nothing but an argmax is needed."""
        return cls(None, None, None, None, [], False, False, False, True)


@dataclass
class LogprobsTensors:
    """Log-probabilities at some positions, on the device. Column 0 is the token at the
    position (sampled, or the prompt's next token); columns 1.. are the top-k."""

    token_ids: torch.Tensor  # [num_rows, 1 + k] int64
    logprobs: torch.Tensor  # [num_rows, 1 + k] float32
    ranks: torch.Tensor  # [num_rows] int64: rank of column 0's token, 1 = most likely

    def tolist(self, num_top: list[int]) -> list[TokenLogprob]:
        """Row i as a TokenLogprob with its own top-`num_top[i]` (one host sync)."""
        ids = self.token_ids.tolist()
        lps = self.logprobs.tolist()
        ranks = self.ranks.tolist()
        out = []
        for i, n in enumerate(num_top):
            top = dict(zip(ids[i][1 : 1 + n], lps[i][1 : 1 + n], strict=True))
            out.append(TokenLogprob(ids[i][0], lps[i][0], ranks[i], top))
        return out


@dataclass
class SamplerOutput:
    """What the sampler produced for a step, still on the device."""

    token_ids: torch.Tensor  # [num_seqs] int64
    logprobs: LogprobsTensors | None = None  # every row, when some row asked for them


@dataclass
class StepSamples:
    """A step's result on the host (rank 0): one token per sequence, and per sequence
    the logprobs it asked for (None where it did not)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    # Row -> this step's prompt positions' logprobs, for the rows that asked.
    prompt_logprobs: dict[int, list[TokenLogprob]] | None = None


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None
) -> None:
    """Set the logits of the tokens `bitmask` forbids to -inf, in place, in `rows` only
    (None: every row): xgrammar's kernel for the logits' device (C++ on the CPU, Triton on
    CUDA), a batched op outside any captured graph."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """log_softmax(logits) at `token_ids` ([num_rows]) plus the top-k of each row."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab]
    chosen = lp.gather(-1, token_ids[:, None])  # [num_rows, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        ids = torch.cat([token_ids[:, None], top_ids], dim=-1)
        lps = torch.cat([chosen, top_lp], dim=-1)
    else:
        ids, lps = token_ids[:, None], chosen
    return LogprobsTensors(ids, lps, ranks)


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """transformers' repetition penalty on every token seen so far, then OpenAI's
    presence and frequency penalties on the completion's tokens."""
    rep = p.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(p.seen, penalized, logits)
    counts = p.output_counts
    return logits - p.frequency[:, None] * counts - p.presence[:, None] * (counts > 0)


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
        # A greedy step's inputs to the sample kernel (temperatures of 0, a seed of 0):
        # constants, made once per device and sliced, not filled again every step.
        self._greedy: tuple[torch.Tensor, torch.Tensor] | None = None

    def _greedy_inputs(self, rows: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperatures of 0 for `rows` rows and a seed of 0, on `device`."""
        cached = self._greedy
        if cached is None or cached[0].device != device or cached[0].numel() < rows:
            cached = self._greedy = (torch.zeros(max(rows, 256), device=device),
                                     torch.zeros(1, dtype=torch.int64, device=device))
        return cached[0][:rows], cached[1]

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """logits: [num_seqs, vocab] in any float dtype -> token ids [num_seqs] (int64, on
        device), plus their logprobs when `t.num_logprobs >= 0`."""
        if _takes_fused_kernel(logits, t):
            # Greedy and plain temperature rows on CUDA, under a grammar's bitmask or not:
            # one kernel reads the logits once (the steps below make an fp32 copy and pass
            # over it about eight times, the bitmask one more).
            from minivllm.kernels.sample import sample_rows

            if t.all_greedy:  # rows under a grammar, all greedy: no noise to seed
                temperatures, seed = self._greedy_inputs(logits.shape[0], logits.device)
            else:
                temperatures = t.temperatures
                seed = torch.randint(1 << 62, (1,), device=logits.device,
                                     generator=self.generator)
            token_ids = sample_rows(logits, temperatures, seed, t.token_bitmask, check=False)
        else:
            logits = logits.float()
            if t.penalties is not None:
                logits = apply_penalties(logits, t.penalties)
            if t.banned is not None:
                logits = logits.index_put(
                    t.banned, torch.tensor(float("-inf"), device=logits.device))
            if t.token_bitmask is not None:
                # The other rows' masks are all ones: on CUDA the kernel goes over every
                # row, and no list of rows has to be copied up.
                rows = None if logits.is_cuda else t.bitmask_rows
                apply_token_bitmask(logits, t.token_bitmask, rows)
            token_ids = self._sample(logits, t)
        logprobs = None
        if t.num_logprobs >= 0:
            logits = logits.float()
            if not t.all_greedy:
                logits = logits / torch.where(t.temperatures > 0, t.temperatures, 1.0)[:, None]
            logprobs = compute_logprobs(logits, token_ids, t.num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        greedy = row_argmax(logits)
        if t.all_greedy:
            return greedy
        logits = logits.float()
        temps = torch.where(t.temperatures > 0, t.temperatures, 1.0)
        logits = logits / temps[:, None]
        if t.needs_top_k or t.needs_top_p:
            if logits.device.type == "cpu" and not t.needs_min_p:
                return torch.where(t.temperatures > 0, self._sample_candidates(logits, t),
                                   greedy)
            logits = _top_k_top_p(logits, t.top_ks, t.top_ps, t.needs_top_k, t.needs_top_p)
        if not t.needs_min_p:
            return torch.where(t.temperatures > 0, self._draw(logits, t.seeds), greedy)
        probs = torch.softmax(logits, dim=-1)
        floor = t.min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, 0.0, probs)
        # Gumbel-max in its exponential form: argmax(p / q), q ~ Exp(1), samples from p.
        q = _exponential_noise(probs.shape, t.seeds, probs.device, self.generator)
        sampled = row_argmax(probs / q)
        return torch.where(t.temperatures > 0, sampled, greedy)

    def _draw(self, logits: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
        """Gumbel-max in log space: argmax(logits - log q), q ~ Exp(1), samples each row
        from softmax(logits) without computing it (-inf logits are never drawn)."""
        q = _exponential_noise(logits.shape, seeds, logits.device, self.generator)
        return row_argmax(logits - q.log_())

    def _sample_candidates(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Top-k / top-p sampling from each row's CANDIDATES most likely tokens (CPU): the
        same tokens allowed and the same distribution as `_top_k_top_p` over the whole
        vocabulary, wherever the cut falls among them (`candidate_nucleus`); the other
        rows take the whole-vocabulary path. Sorting every row's whole vocabulary and
        drawing noise for all of it was half of a CPU decode step."""
        vals, idx, fits = candidate_nucleus(logits, t.top_ks, t.top_ps, t.needs_top_k,
                                            t.needs_top_p)
        sampled = idx.gather(-1, self._draw(vals, t.seeds)[:, None])[:, 0]
        rest = (~fits).nonzero()[:, 0]
        if rest.numel():  # the cut lies past the candidates: the whole vocabulary
            full = _top_k_top_p(logits[rest], t.top_ks[rest] if t.needs_top_k else None,
                                t.top_ps[rest] if t.needs_top_p else None, t.needs_top_k,
                                t.needs_top_p)
            seeds = [t.seeds[i] for i in rest.tolist()] if t.seeds else []
            sampled[rest] = self._draw(full, seeds)
        return sampled


CANDIDATES = 1024  # tokens a CPU row samples among when its top-k / top-p cut falls inside


def candidate_nucleus(
    logits: torch.Tensor,  # [rows, vocab] fp32, already divided by the temperature
    top_ks: torch.Tensor | None,
    top_ps: torch.Tensor | None,
    use_k: bool,
    use_p: bool,
    candidates: int = CANDIDATES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's `candidates` largest logits (values [rows, C], descending, and their
    token ids), those outside its top-k / top-p cut set to -inf as `_top_k_top_p` sets them
    (up to the rounding of the probabilities at the cut), and `fits` [rows] bool: whether
    the cut falls among the candidates, so that the row's result is `_top_k_top_p`'s: a
    top-k of at most C, or without a top-k, a top-p reached by the candidates' share."""
    vocab = logits.shape[-1]
    c = min(candidates, vocab)
    vals, idx = logits.topk(c, dim=-1)  # sorted, descending
    rows = logits.shape[0]
    k_on = top_ks > 0 if use_k else torch.zeros(rows, dtype=torch.bool, device=logits.device)
    if use_k:
        k = torch.where(k_on, top_ks.clamp(max=vocab), vocab)
        ranks = torch.arange(c, device=logits.device)[None, :]
        vals = vals.masked_fill(ranks >= k[:, None], float("-inf"))
        fits = k_on & (k <= c)
    else:
        fits = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    if use_p:
        # Probabilities over what the top-k left: its k tokens (all candidates where the row
        # fits), or without one, the whole vocabulary.
        total = torch.where(k_on, torch.logsumexp(vals, dim=-1), torch.logsumexp(logits, dim=-1))
        probs = (vals - total[:, None]).exp()
        before = probs.cumsum(dim=-1) - probs
        fits |= ~k_on & (probs.sum(dim=-1) >= top_ps)
        vals = vals.masked_fill(before >= top_ps[:, None], float("-inf"))
    return vals, idx, fits


def _takes_fused_kernel(logits: torch.Tensor, t: SamplingTensors) -> bool:
    """Whether `kernels/sample.py` samples this batch: CUDA, some row at a temperature or
    under a grammar, nothing else that changes the logits or cuts the vocabulary, and no
    per-request seed (a seeded row draws torch's noise from its own generator). With a
    grammar, only where no row wants logprobs: those are computed from the masked
    logits."""
    mask = t.token_bitmask
    return (
        use_triton(logits)  # CUDA (or the CPU under Triton's interpreter, for tests)
        and not (t.all_greedy and mask is None)
        and not (t.needs_top_k or t.needs_top_p or t.needs_min_p)
        and t.penalties is None
        and t.banned is None
        and (mask is None or (t.num_logprobs < 0 and mask.shape[0] == logits.shape[0]
                              and mask.shape[1] * 32 >= logits.shape[1]))
        and all(seed is None for seed in t.seeds)
        and logits.stride(-1) == 1
    )


def row_argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [rows] int64
    """Each row's first maximal index. On the CPU through `max`: torch's CPU argmax is a plain
    reduction, about three times slower than max's vectorized one; both return the first
    maximal index."""
    if x.device.type == "cpu":
        return x.max(dim=-1).indices
    return x.argmax(dim=-1)


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
