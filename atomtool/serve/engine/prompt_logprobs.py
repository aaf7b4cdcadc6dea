"""Prompt log-probabilities (vLLM's ``SamplingParams.prompt_logprobs``): the log-softmax of the logits at every
prompt position, computed during prefill for the requests that ask for them.

The logits at position ``j`` predict token ``j + 1``, so a prefill chunk over positions ``[s, s + n)`` gives
the entries of prompt tokens ``s + 1 .. s + n`` (the last prompt position predicts the first generated token,
which the sampler handles). Only the positions of requests that ask are projected through the LM head, in
slices of :data:`ROWS_PER_SLICE` rows (a long prompt's ``[P, vocab]`` float32 logits would not fit at
once); the step's ordinary last-token logits are computed exactly as without them. Entries have the shape of
the sampler's generated-token entries: ``{"token_id": int, "logprob": float, "top": {id: logprob}}`` (raw
model log-probs, ``top`` the ``prompt_logprobs`` most likely tokens, ties broken by lower id), plus ``"rank"``:
the prompt token's 1-based place in the whole vocabulary in that same order (vLLM's ``Logprob.rank``, which
its prompt log-probs always carry, also for a token outside the top ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from atomtool.serve.engine.sampler import exact_topk
from atomtool.serve.engine.scheduler import SchedulerOutput
from atomtool.serve.engine.sequence import Sequence

#: rows of logits materialised at once (float32 [ROWS_PER_SLICE, vocab], plus its log-softmax)
ROWS_PER_SLICE = 256


@dataclass
class PromptLogprobsPlan:
    """Which of a step's token rows get prompt log-probs.

    seqs: the scheduled sequences still computing prompt log-probs this step (scheduler order).
    rows: [N] indices into the step's flattened tokens (``ForwardBatch.input_ids``), sequence by sequence.
    targets: [N] the prompt token each row predicts (the next prompt token). num_top: [N] top-k per row
    (the sequence's ``prompt_logprobs``). counts: rows per sequence of ``seqs``.
    """

    seqs: list[Sequence]
    rows: list[int]
    targets: list[int]
    num_top: list[int]
    counts: list[int]


def plan_prompt_logprobs(sched: SchedulerOutput) -> PromptLogprobsPlan | None:
    """The step's prompt log-prob rows, from the scheduler's decision (before ``num_computed_tokens`` moves).

    Sequence ``b`` computes positions ``[s, s + n)`` (``s = num_computed_tokens``); its rows are positions
    ``j`` in ``[max(s, len(prompt_logprobs) - 1), min(s + n, num_prompt_tokens - 1))``: what is not computed
    yet (a preempted request recomputing its prompt does not redo them). Returns None when no row is needed.
    """
    plan = PromptLogprobsPlan([], [], [], [], [])
    offset = 0
    for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
        if seq.needs_prompt_logprobs:
            s = seq.num_computed_tokens
            lo, hi = max(s, len(seq.prompt_logprobs) - 1), min(s + n, seq.num_prompt_tokens - 1)
            if hi > lo:
                plan.seqs.append(seq)
                plan.counts.append(hi - lo)
                plan.rows += range(offset + lo - s, offset + hi - s)
                plan.targets += seq.token_ids[lo + 1:hi + 1]
                plan.num_top += [seq.params.prompt_logprobs] * (hi - lo)
        offset += n
    return plan if plan.rows else None


@torch.inference_mode()
def compute_prompt_logprobs(hidden: torch.Tensor, plan: PromptLogprobsPlan,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[list[dict]]:
    """The plan's entries from the step's final hidden states.

    Args:
        hidden: [T, hidden_size] the model's output for the step's T tokens (its dtype).
        plan: from :func:`plan_prompt_logprobs` for the same step.
        compute_logits: the model's LM head, hidden [N, hidden_size] -> logits [N, vocab] float32.

    Returns:
        per ``plan.seqs[i]``, ``plan.counts[i]`` entries in position order. One host transfer per slice of
        :data:`ROWS_PER_SLICE` rows.
    """
    device = hidden.device
    flat: list[dict] = []
    for start in range(0, len(plan.rows), ROWS_PER_SLICE):
        stop = min(start + ROWS_PER_SLICE, len(plan.rows))
        rows = torch.tensor(plan.rows[start:stop], dtype=torch.long).to(device)
        targets = torch.tensor(plan.targets[start:stop], dtype=torch.long).to(device)
        lp = torch.log_softmax(compute_logits(hidden.index_select(0, rows)).float(), dim=-1)
        vocab = lp.shape[-1]
        n_top = [min(n, vocab) for n in plan.num_top[start:stop]]
        n_max = max(n_top)
        chosen_lp = lp.gather(1, targets.unsqueeze(1))
        # rank: the tokens before the prompt token in the top-k order (higher log-prob, or equal and lower id)
        ids = torch.arange(lp.shape[-1], device=device)
        before = (lp > chosen_lp) | ((lp == chosen_lp) & (ids < targets.unsqueeze(1)))
        parts = [chosen_lp.squeeze(1).double(), before.sum(dim=1).double() + 1]
        if n_max > 0:
            k = torch.tensor([max(n, 1) for n in n_top], dtype=torch.long).to(device)
            top_vals, top_ids = exact_topk(lp, k, n_max)
            parts += [top_ids.double().flatten(), top_vals.double().flatten()]
        host = torch.cat(parts).tolist()  # token ids < 2**53 are exact in float64
        m = stop - start
        chosen, ranks = host[:m], host[m:2 * m]
        top_ids_h, top_vals_h = host[2 * m:2 * m + m * n_max], host[2 * m + m * n_max:]
        for r in range(m):
            row = slice(r * n_max, r * n_max + n_top[r])
            top = dict(zip((int(i) for i in top_ids_h[row]), top_vals_h[row], strict=True))
            flat.append({"token_id": plan.targets[start + r], "logprob": chosen[r], "top": top,
                         "rank": int(ranks[r])})
    out, i = [], 0
    for c in plan.counts:
        out.append(flat[i:i + c])
        i += c
    return out
