"""The CPU sampler's top-k / top-p over each row's most likely tokens (`candidate_nucleus`):
the same tokens allowed as the whole-vocabulary cut, the rows whose cut lies past the
candidates sent to it, the draws' frequencies, and seeded rows that do not depend on
their batch."""

from __future__ import annotations

import torch

from minivllm.layers import sampler as S


def _tensors(top_ks, top_ps, seeds=None, temperature=1.0):
    n = len(top_ks)
    ks = torch.tensor(top_ks, dtype=torch.int64)
    ps = torch.tensor(top_ps, dtype=torch.float32)
    return S.SamplingTensors(
        temperatures=torch.full((n,), temperature), top_ks=ks, top_ps=ps, min_ps=None,
        seeds=seeds or [None] * n, needs_top_k=bool((ks > 0).any()),
        needs_top_p=bool((ps < 1).any()), needs_min_p=False, all_greedy=False)


def _allowed(full: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero()[:, 0].tolist()) for row in full]


def test_candidates_cut_as_the_whole_vocabulary():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5000, generator=g) * 4  # peaked: nuclei of tens of tokens
    top_ks = [0, 40, 0, 3000, 7, 0]
    top_ps = [0.9, 1.0, 0.5, 0.9, 0.8, 1.0]
    t = _tensors(top_ks, top_ps)
    vals, idx, fits = S.candidate_nucleus(logits, t.top_ks, t.top_ps, True, True, 1024)
    # Row 3's top-k (3000) and row 5's whole vocabulary (no cut) lie past 1024 candidates.
    assert fits.tolist() == [True, True, True, False, True, False]
    full = S._top_k_top_p(logits, t.top_ks, t.top_ps, True, True)
    want = _allowed(full)
    for row in (0, 1, 2, 4):
        got = {int(i) for v, i in zip(vals[row], idx[row], strict=True) if torch.isfinite(v)}
        assert got == want[row], row
        kept = torch.isfinite(vals[row])
        assert torch.equal(vals[row][kept], full[row][idx[row][kept]])


def test_a_flat_row_takes_the_whole_vocabulary_and_draws_stay_in_the_cut():
    g = torch.Generator().manual_seed(1)
    peaked = torch.randn(5000, generator=g) * 6
    flat = torch.randn(5000, generator=g) * 0.01  # a 0.9 nucleus of ~4,500 tokens
    logits = torch.stack([peaked, flat] * 20)
    t = _tensors([0] * 40, [0.9] * 40)
    _, _, fits = S.candidate_nucleus(logits, t.top_ks, t.top_ps, False, True, 1024)
    assert fits.tolist() == [True, False] * 20
    allowed = _allowed(S._top_k_top_p(logits[:2], None, t.top_ps[:2], False, True))
    tokens = S.Sampler(torch.Generator().manual_seed(2))(logits, t).token_ids.tolist()
    for i, tok in enumerate(tokens):
        assert tok in allowed[i % 2]
    assert len(set(tokens[1::2])) > 10  # the flat rows really drew from thousands


def test_draws_follow_the_nucleus_probabilities():
    """4,000 rows of one 50-token distribution, top-p 0.9: each allowed token's share
    within 0.025 of its renormalised probability, the others never drawn."""
    g = torch.Generator().manual_seed(3)
    row = torch.randn(50, generator=g) * 1.5
    t = _tensors([0] * 4000, [0.9] * 4000)
    tokens = S.Sampler(torch.Generator().manual_seed(4))(row.repeat(4000, 1), t).token_ids
    cut = S._top_k_top_p(row[None], None, t.top_ps[:1], False, True)[0]
    want = torch.softmax(cut, dim=-1)
    got = torch.bincount(tokens, minlength=50).float() / 4000
    assert (got[want == 0] == 0).all()
    assert (got - want).abs().max() < 0.025


def test_seeded_rows_do_not_depend_on_their_batch():
    g = torch.Generator().manual_seed(5)
    mine = torch.randn(5000, generator=g) * 3
    flat = torch.randn(5000, generator=g) * 0.01
    alone = S.Sampler()(mine[None], _tensors([0], [0.9], seeds=[7])).token_ids
    batch = torch.stack([flat, mine, flat])
    t = _tensors([0, 0, 50], [0.95, 0.9, 1.0], seeds=[None, 7, 11])
    beside = S.Sampler()(batch, t).token_ids
    assert beside[1] == alone[0]
