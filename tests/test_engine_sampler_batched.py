"""The batched Sampler against a per-row reference (issue 7: one batched pass instead of a per-row loop).

The reference here is written independently of atomtool's sampler, the way the sampler used to work row by
row: a stable descending sort of the temperature-scaled logits, cut at top_k, softmax, then the smallest
prefix whose preceding mass is below top_p. Seeded rows are checked token for token: the documented draw of
a seeded request with no filter is one Exponential(1) vector over the vocabulary (by token id) from its own
generator (on CPU ``-log1p(-U)``, U uniform), with a top-k of at most MAX_TOPK_CANDIDATES one over its top-k
candidates in sorted order, and the token is ``argmax(probs / noise)`` (the exponential race); a seeded request that sorts the vocabulary (top-p alone or
a wider top-k) draws one uniform and inverts the sorted CDF, exactly as the per-row sampler did.
"""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.engine.sampler import MAX_TOPK_CANDIDATES, Sampler, exact_topk
from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.sampling_params import SamplingParams

V = MAX_TOPK_CANDIDATES + 976  # wide enough that a large top_k takes the sort path


def ref_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Per-row reference distribution over the vocabulary [V] (old per-row algorithm)."""
    vals, ids = torch.sort(logits / p.temperature, descending=True, stable=True)
    if 0 < p.top_k < logits.shape[0]:
        vals, ids = vals[:p.top_k], ids[:p.top_k]
    probs = torch.softmax(vals, -1)
    if p.top_p < 1.0:
        keep = (torch.cumsum(probs, -1) - probs) < p.top_p
        probs, ids = probs[keep], ids[keep]
    out = torch.zeros_like(logits)
    out[ids] = probs / probs.sum()
    return out


def ref_race(logits: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
    """The race over the (top-k) candidates in stable sorted order, noise from the request's generator."""
    vals, ids = torch.sort(logits / p.temperature, descending=True, stable=True)
    if p.top_k <= 0:  # full softmax: the noise is indexed by token id
        probs = torch.softmax(logits / p.temperature, -1)
        return int(torch.argmax(probs / -torch.log1p(-torch.rand(logits.shape[0], generator=g))))
    vals, ids = vals[:p.top_k], ids[:p.top_k]
    probs = torch.softmax(vals, -1)
    probs = torch.where(torch.cumsum(probs, -1) - probs < p.top_p, probs, 0.0)
    return int(ids[torch.argmax(probs / -torch.log1p(-torch.rand(p.top_k, generator=g)))])


def ref_inverse_cdf(logits: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
    """The per-row sampler's draw: sorted CDF of the kept tokens, one uniform from the request's generator."""
    vals, ids = torch.sort(logits / p.temperature, descending=True, stable=True)
    if 0 < p.top_k < logits.shape[0]:
        vals, ids = vals[:p.top_k], ids[:p.top_k]
    probs = torch.softmax(vals, -1)
    if p.top_p < 1.0:
        keep = int(((torch.cumsum(probs, -1) - probs) < p.top_p).sum())
        probs, ids = probs[:keep], ids[:keep]
    cdf = torch.cumsum(probs, -1)
    u = torch.rand((), generator=g, dtype=torch.float32) * cdf[-1]
    return int(ids[int(torch.searchsorted(cdf, u.reshape(1), right=True).clamp_(max=cdf.shape[0] - 1))])


def ref_top(lp: torch.Tensor, n: int) -> dict[int, float]:
    vals, ids = torch.sort(lp, descending=True, stable=True)
    return dict(zip(ids[:n].tolist(), vals[:n].tolist(), strict=True))


def seq(params: SamplingParams, eos=frozenset()) -> Sequence:
    return Sequence(f"r{id(params)}", [1, 2, 3], params.validate(), eos_token_ids=eos)


def sp(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=32, **kw)


def tied_logits(rows: int, seed: int) -> torch.Tensor:
    """Random logits on a coarse grid, so that many values tie (also at the top-k cut)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-40, 40, (rows, V), generator=g).float() / 8


def test_exact_topk_equals_stable_sort_with_ties():
    x = tied_logits(6, 0)
    x[2, 100:] = float("-inf")  # fewer finite values than k
    k = torch.tensor([1, 7, 300, 40, 513, 2])
    vals, ids = exact_topk(x, k, 513)
    ref_vals, ref_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    for r in range(6):
        n = int(k[r])
        assert ids[r, :n].tolist() == ref_ids[r, :n].tolist()
        assert torch.equal(vals[r, :n], ref_vals[r, :n])
        assert torch.isneginf(vals[r, n:]).all()


def test_batched_equals_per_row_reference():
    logits = tied_logits(12, 1)
    logits[0, [7, 9]] = 10.0  # greedy tie -> 7
    logits[1, [30, 31]] = 10.0  # top_k == 1 is greedy, tie -> 30
    logits[8, 42] = 50.0  # greedy row whose argmax is a banned stop token before min_tokens
    rows = [
        sp(temperature=0.0),
        sp(temperature=0.8, top_k=1),
        sp(temperature=1.0, seed=1),  # seeded, full softmax
        sp(temperature=0.7, top_k=5, seed=2),  # seeded, top-k candidates with ties at the cut
        sp(temperature=1.3, top_p=0.8, seed=3, logprobs=4),  # seeded, top-p alone: vocabulary sort
        sp(temperature=0.9, top_k=50, top_p=0.5, seed=4, logprobs=0),  # seeded top-k + top-p
        sp(temperature=1.0, top_k=MAX_TOPK_CANDIDATES + 200, seed=5),  # wide top-k: sort path
        sp(temperature=1.0, top_k=8),  # unseeded top-k
        sp(temperature=0.0, min_tokens=2, stop_token_ids=[42], logprobs=3),
        sp(temperature=1.0),  # unseeded, full softmax
        sp(temperature=2.0, top_p=0.3),  # unseeded top-p
        sp(temperature=0.5, top_k=-1, top_p=0.99, seed=6, logprobs=20),
    ]
    seqs = [seq(p) for p in rows]
    for s in seqs:  # the generators the sampler would create, cloned so the reference can replay the draw
        if s.params.seed is not None:
            s.generator = torch.Generator().manual_seed(s.params.seed)
    replay = {b: torch.Generator().set_state(s.generator.get_state()) for b, s in enumerate(seqs) if s.generator}

    out = Sampler()(logits, seqs)

    tokens = [t for t, _ in out]
    assert tokens[0] == 7 and tokens[1] == 30
    masked = logits[8].clone()
    masked[42] = float("-inf")
    assert tokens[8] == int(torch.argmax(masked)) != 42
    for b, p in enumerate(rows):
        if p.temperature == 0 or p.top_k == 1:
            continue
        probs = ref_probs(logits[b], p)
        assert probs[tokens[b]] > 0, f"row {b} sampled outside its top-k/top-p support"
        sorts_vocab = p.top_k > MAX_TOPK_CANDIDATES or (p.top_k <= 0 and p.top_p < 1.0)
        if b in replay and sorts_vocab:
            assert tokens[b] == ref_inverse_cdf(logits[b], p, replay[b]), f"row {b}"
        elif b in replay:
            assert tokens[b] == ref_race(logits[b], p, replay[b]), f"row {b}"
    for b, ((token, entry), p) in enumerate(zip(out, rows, strict=True)):
        if p.logprobs is None:
            assert entry is None
            continue
        lp = torch.log_softmax(logits[b], -1)
        assert entry["token_id"] == token
        assert entry["logprob"] == pytest.approx(float(lp[token]), abs=1e-6)
        assert list(entry["top"]) == list(ref_top(lp, p.logprobs))  # same ids, same (tie) order
        assert list(entry["top"].values()) == pytest.approx(list(ref_top(lp, p.logprobs).values()), abs=1e-6)


@pytest.mark.parametrize("kw", [dict(top_k=3, top_p=0.9), dict(top_p=0.7), dict(top_k=2), dict()])
def test_batched_draws_follow_the_filtered_distribution(kw):
    logits = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5])
    p = sp(temperature=0.8, **kw)
    n = 6000
    torch.manual_seed(0)
    out = Sampler()(logits.expand(n, -1).contiguous(), [seq(p) for _ in range(n)])
    freq = torch.bincount(torch.tensor([t for t, _ in out]), minlength=6).float() / n
    torch.testing.assert_close(freq, ref_probs(logits, p), atol=0.025, rtol=0)


def test_seeded_row_is_batch_invariant():
    g = torch.Generator().manual_seed(9)
    params = [sp(temperature=1.0, top_p=0.9, seed=77), sp(temperature=0.6, top_k=20, seed=78),
              sp(temperature=1.0, seed=79)]
    others = [sp(temperature=0.0), sp(temperature=1.0), sp(temperature=1.0, top_k=3, seed=1),
              sp(temperature=1.2, top_p=0.5, logprobs=2)]
    steps = [torch.randn(1 + len(others), V, generator=g) for _ in range(6)]
    for p in params:
        alone, batched = seq(p), seq(p)
        other_seqs = [seq(o) for o in others]
        for logits in steps:
            (a, _), = Sampler()(logits[:1], [alone])
            mixed = torch.cat([logits[1:3], logits[:1], logits[3:]])  # the row sits at index 2 here
            res = Sampler()(mixed, other_seqs[:2] + [batched] + other_seqs[2:])
            assert res[2][0] == a
            alone.append_token(a)
            batched.append_token(a)
        assert alone.output_token_ids != [alone.output_token_ids[0]] * len(steps)  # it did sample
