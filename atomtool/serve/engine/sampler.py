"""Token selection: greedy, temperature, top-k, top-p, per-request seeds, log-probabilities.

Deterministic by construction: ties go to the lowest token id (``argmax`` and stable sorts), and a seeded
request draws from its own ``torch.Generator`` exactly once per token, so its samples do not depend on
which other requests share the batch.
"""

from __future__ import annotations

import torch

from atomtool.serve.engine.sequence import Sequence


def _sorted_desc(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and ids sorted by decreasing value, equal values by increasing id."""
    return torch.sort(x, descending=True, stable=True)


def top_logprobs(logprobs: torch.Tensor, n: int) -> dict[int, float]:
    """The ``n`` most likely tokens of a [V] log-prob vector as ``{id: logprob}`` (ties: lower id first)."""
    if n <= 0:
        return {}
    vals, ids = _sorted_desc(logprobs)
    return dict(zip(ids[:n].tolist(), vals[:n].tolist(), strict=True))


def sample_one(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None) -> int:
    """Pick one token from logits [V] float32 (``temperature == 0``: greedy)."""
    if temperature == 0 or top_k == 1:
        return int(torch.argmax(logits))
    vals, ids = _sorted_desc(logits / temperature)
    if top_k > 0:
        vals, ids = vals[:top_k], ids[:top_k]
    probs = torch.softmax(vals, dim=-1)
    if top_p < 1.0:
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep = int((mass_before < top_p).sum())
        probs, ids = probs[:keep], ids[:keep]
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator, device=logits.device, dtype=torch.float32) * cdf[-1]
    idx = int(torch.searchsorted(cdf, u.reshape(1), right=True).clamp_(max=cdf.shape[0] - 1))
    return int(ids[idx])


class Sampler:
    """Samples the next token of each sequence from its last-token logits."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, dict | None]]:
        """logits: [B, V] float32, row b for ``seqs[b]``. Returns ``(token_id, logprob entry or None)`` each.

        Before ``min_tokens`` outputs, EOS and ``stop_token_ids`` are masked out (vLLM semantics).
        """
        results = []
        for b, seq in enumerate(seqs):
            p = seq.params
            row = logits[b]
            if seq.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
                banned = [t for t in banned if 0 <= t < row.shape[0]]
                if banned:
                    row = row.clone()
                    row[banned] = float("-inf")
            if p.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(device=row.device)
                seq.generator.manual_seed(p.seed)
            token = sample_one(row, p.temperature, p.top_k, p.top_p, seq.generator)
            entry = None
            if p.logprobs is not None:
                lp = torch.log_softmax(logits[b], dim=-1)
                entry = {"token_id": token, "logprob": float(lp[token]), "top": top_logprobs(lp, p.logprobs)}
            results.append((token, entry))
        return results
