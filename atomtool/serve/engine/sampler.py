"""Token selection: logit bias, allowed tokens, penalties, greedy, temperature, min-p, top-k, top-p,
per-request seeds, log-probabilities — batched.

One decode step samples every row of the batch with a handful of batched tensor ops and a single
device->host transfer (issue 7: the former per-row loop sorted the whole vocabulary and synchronised twice
per row).

- Order (vLLM's v1 sampler: allowed-token mask, then its non-argmax-invariant processors min_tokens and
  logit bias, then penalties): logit bias and the allowed-token mask, then the ``min_tokens`` EOS/stop ban
  (a ban and a finite bias commute: ``-inf`` plus a bias stays ``-inf``), then the penalties, then greedy or
  temperature / min-p / top-k / top-p. All of these act on a copy: the raw logits stay for the log-probs.
- ``logit_bias`` (OpenAI) and ``allowed_token_ids`` (vLLM), first, for greedy rows too
  (:func:`apply_logit_bias`, :func:`apply_allowed_token_ids`): one gather + scatter of the biased entries
  over the flattened [R, V] logits, and one boolean keep-mask (``-inf`` outside each asking row's allowed
  ids; EOS is only allowed when listed). Only the rows that ask are written; nothing is built when none asks.
- Penalties (vLLM's ``apply_penalties``, OpenAI's presence/frequency formula), on the (biased, masked)
  logits of the rows that ask for one, before temperature and for greedy rows too (:func:`apply_penalties`): one [R, V] count
  of each row's output tokens (one ``index_add_`` over the flattened rows' ids), then ``repetition_penalty``
  divides the positive and multiplies the non-positive logits of the tokens seen in the prompt or the output
  (a row's prompt ids are kept on the device across steps), and ``frequency_penalty * count +
  presence_penalty * (count > 0)`` is subtracted. Rows without a penalty are not touched (nothing is built
  when no row has one).
- Greedy rows (``temperature == 0`` or ``top_k == 1``): one ``argmax`` over those rows. ``torch.argmax``
  returns the first maximal index, so ties go to the lowest token id.
- Sampled rows: logits / temperature, then min-p (vLLM's order: before top-k/top-p; :func:`apply_min_p`, only
  when a row of the group asks for it), then the candidate set. Rows with neither top-k nor top-p sample
  from the full softmax (no sort). Rows with ``top_k <= MAX_TOPK_CANDIDATES`` take their exact top-k
  candidates (:func:`exact_topk`, ties to the lowest id, like a stable descending sort); other rows with a
  filter pay one stable sort of the vocabulary (batched over those rows). Top-p (nucleus) keeps, in that
  order, each candidate whose preceding mass is below ``top_p`` (the smallest prefix reaching ``top_p``),
  after renormalising over the top-k (and the min-p survivors).
- Drawing, full-softmax and top-k rows: the exponential race, ``argmax(probs / q)`` with
  ``q ~ Exponential(1)`` i.i.d. per token (:func:`exponential_`), which picks token i with probability
  ``probs[i]`` (the trick vLLM's and nano-vllm's samplers use; no cumulative sum, no searchsorted). A seeded
  request draws its noise from its own ``torch.Generator``, [V] by token id (full softmax) or [top_k] by
  candidate position (top-k), so its samples are reproducible and do not depend on which other requests
  share the batch; unseeded rows share one draw from the global generator.
- Drawing, vocabulary-sort rows: these already hold the sorted cumulative mass for top-p, so they invert
  it with one uniform per row (batched ``searchsorted``), a seeded row's uniform from its own generator.
- Log-probabilities: one ``log_softmax`` over the raw logits of the rows that ask (before logit bias, the
  allowed-token and min_tokens masks, penalties, temperature and min-p: vLLM's default ``raw_logprobs``
  ``logprobs_mode``), the sampled token's value and the top ``n``
  (:func:`exact_topk`, ties lower id first).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.engine.structured import apply_token_bitmask, fill_bitmasks
from atomtool.serve.sampling_params import SamplingParams

#: Rows whose top_k is at most this take the ``torch.topk`` candidate path; larger k (or top-p alone)
#: stably sorts the vocabulary, which is cheaper than a very wide top-k.
MAX_TOPK_CANDIDATES = 1024


def _host_list(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small per-row parameter list as a tensor on ``device`` without a stream sync.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronises the stream (it would
    wait for the forward pass, once per call); a pinned copy with ``non_blocking=True`` is queued instead.
    ``values`` must be a Python list: ``torch.tensor(ndarray, pin_memory=True)`` raises on CUDA ("Can't pin
    tensor constructed from numpy"; seen on the H200).
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def exact_topk(x: torch.Tensor, k: torch.Tensor, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-k with deterministic ties: the result of a stable descending sort cut at ``k[r]``.

    ``torch.topk`` does not specify which of several equal values it returns at the cut, so it is only
    used for the k-th largest *value*; membership is then decided by value, ties at the cut going to the
    lowest token ids, and a second ``topk`` over an integer key (id - V for values above the cut, id for
    values equal to it) extracts them in increasing id order, which a stable sort turns into value order.

    Args:
        x: [R, V] float scores (``-inf`` allowed).
        k: [R] int64 on ``x.device``, ``1 <= k[r] <= k_max``.
        k_max: ``max(k)`` as a Python int, ``<= V``.

    Returns:
        ``(values, ids)``, each [R, k_max]: per row sorted by decreasing value, equal values by increasing
        id; positions ``>= k[r]`` hold ``-inf`` values and id 0.
    """
    num_rows, vocab = x.shape
    kth = torch.topk(x, k_max, dim=-1, sorted=True).values.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
    idx = torch.arange(vocab, device=x.device, dtype=torch.int32).expand(num_rows, vocab)
    key = torch.where(x > kth, idx - vocab, torch.where(x == kth, idx, 2 * vocab))
    sel = torch.topk(key, k_max, dim=-1, largest=False, sorted=True).values.long()
    valid = torch.arange(k_max, device=x.device).unsqueeze(0) < k.unsqueeze(1)
    ids = torch.where(valid, torch.where(sel < 0, sel + vocab, sel), 0)
    vals = torch.where(valid, x.gather(1, ids), float("-inf"))
    vals, order = torch.sort(vals, dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


def exponential_(out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill float32 ``out`` in place with Exponential(1) draws from ``generator`` (``None``: global RNG).

    CUDA: ``Tensor.exponential_``, one fused kernel. CPU: ``-log1p(-U)`` with ``U ~ Uniform[0, 1)``, the
    same distribution about four times faster than ``exponential_``'s CPU kernel (measured, torch 2.13).
    """
    if out.device.type == "cuda":
        return out.exponential_(generator=generator)
    return out.uniform_(generator=generator).neg_().log1p_().neg_()


def _race(probs: torch.Tensor, widths: list[int], generators: list[torch.Generator | None]) -> torch.Tensor:
    """Positions [R] drawn from ``probs`` [R, W] (rows need not sum to one) by the exponential race.

    Noise: one Exponential(1) draw over the whole [R, W] from the global generator, then each row r with a
    generator overwrites its first ``widths[r]`` entries from it (one kernel per seeded row). ``widths[r]``
    is a property of the request alone (its vocabulary size or its top_k), never of the batch, so a seeded
    request's draws do not depend on its neighbours. Entries past ``widths[r]`` must have zero probability.
    """
    q = exponential_(torch.empty(probs.shape, device=probs.device, dtype=torch.float32))
    for r, g in enumerate(generators):
        if g is not None:
            exponential_(q[r, :widths[r]], g)
    # q can be 0 in float32; the clamp keeps 0/0 (a masked token) from becoming NaN, which argmax would pick.
    return (probs / q.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def _sample_topk_candidates(vals: torch.Tensor, ids: torch.Tensor, top_k: list[int], top_p: torch.Tensor,
                            generators: list[torch.Generator | None]) -> torch.Tensor:
    """Top-k candidates (vals, ids [R, k_max] from :func:`exact_topk`) -> token ids [R]; top-p [R].

    Softmax over the candidates renormalises over the top-k; top-p keeps the smallest prefix whose
    preceding mass is below ``top_p``; the race runs over candidate positions (a seeded row's noise is
    its own [top_k] draw, in candidate order).
    """
    probs = torch.softmax(vals, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = torch.where(mass_before < top_p.unsqueeze(1), probs, 0.0)
    return ids.gather(1, _race(probs, top_k, generators).unsqueeze(1)).squeeze(1)


def _sample_sorted_vocab(vals: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         generators: list[torch.Generator | None]) -> torch.Tensor:
    """Inverse-CDF draw over a stably sorted vocabulary (vals, ids [R, V]); top_k, top_p [R] -> ids [R].

    The sort path already computes the cumulative mass for top-p, so one uniform per row and a batched
    ``searchsorted`` replace the race's [R, V] noise (measured: the noise was a third of this path on CPU).
    A seeded row draws one scalar from its generator, as the per-row sampler did.
    """
    probs = torch.softmax(vals, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    n_keep = torch.minimum(((cdf - probs) < top_p.unsqueeze(1)).sum(dim=-1), top_k).clamp_(min=1)
    last = (n_keep - 1).unsqueeze(1)
    u = torch.rand(vals.shape[0], device=vals.device, dtype=torch.float32)
    for r, g in enumerate(generators):
        if g is not None:
            u[r:r + 1].uniform_(generator=g)
    target = u.unsqueeze(1) * cdf.gather(1, last)
    pick = torch.minimum(torch.searchsorted(cdf, target, right=True), last)
    return ids.gather(1, pick).squeeze(1)


def apply_logit_bias(logits: torch.Tensor, bias: list[dict[int, float] | None]) -> torch.Tensor:
    """``logits[r, t] + bias[r][t]`` for every entry of each row's bias (OpenAI's ``logit_bias``, vLLM's
    LogitBiasLogitsProcessor); a new tensor.

    One gather and one scatter over the flattened logits at the biased positions (the index goes to the device
    as a Python list, see :func:`_host_list`); ids outside ``[0, V)`` are ignored (the engine refuses them).

    Args:
        logits: [R, V] float32 (not modified). bias: per row ``{token id: bias}`` or None (no bias).

    Returns:
        [R, V] float32; a row without a bias equals its input bit for bit.
    """
    num_rows, vocab = logits.shape
    flat_ids: list[int] = []
    values: list[float] = []
    for r, row in enumerate(bias):
        for t, v in (row or {}).items():
            if 0 <= t < vocab:
                flat_ids.append(r * vocab + t)
                values.append(v)
    x = logits.clone()
    if flat_ids:
        idx = _host_list(flat_ids, logits.device)
        flat = x.view(-1)
        flat[idx] = flat.index_select(0, idx) + _host_list(values, logits.device, logits.dtype)
    return x


def apply_allowed_token_ids(logits: torch.Tensor, allowed: list[torch.Tensor | None]) -> torch.Tensor:
    """Only each row's allowed ids keep their logit, the others become ``-inf`` (vLLM's
    ``allowed_token_ids``); a new tensor.

    Args:
        logits: [R, V] float32 (not modified). allowed: per row an int64 tensor of ids in ``[0, V)`` on
            ``logits.device`` (non-empty), or None (every token allowed).

    Returns:
        [R, V] float32; a row with None equals its input bit for bit.
    """
    num_rows, _ = logits.shape
    rows = [r for r, ids in enumerate(allowed) if ids is not None]
    keep = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
    if rows:
        keep[_host_list(rows, logits.device)] = False
        for r in rows:  # one small kernel per asking row; the id tensors stay on the device across steps
            keep[r].index_fill_(0, allowed[r], True)
    return torch.where(keep, logits, float("-inf"))


def has_penalty(p: SamplingParams) -> bool:
    """Whether a request asks for a repetition, frequency or presence penalty (any non-default value)."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def apply_penalties(logits: torch.Tensor, prompt_ids: list[torch.Tensor | None], output_ids: list[list[int]],
                    repetition: list[float], frequency: list[float], presence: list[float]) -> torch.Tensor:
    """Repetition, frequency and presence penalties of R rows (vLLM's ``apply_penalties``); a new tensor.

    Row r, with ``count[v]`` the occurrences of token v in ``output_ids[r]``:

    - ``repetition[r]`` (1.0: off) on every token seen in ``prompt_ids[r]`` or ``output_ids[r]``: a positive
      logit is divided by it, any other multiplied by it (transformers' RepetitionPenaltyLogitsProcessor
      over the prompt + output ids; CTRL, Keskar et al. 2019). The result is clamped to the finite float32
      range so that a tiny penalty cannot make the softmax NaN (a penalty above the float32 maximum counts as
      that maximum, so a zero logit stays 0); ``-inf`` logits (masked tokens) stay ``-inf``.
    - then ``logit[v] -= frequency[r] * count[v] + presence[r] * (count[v] > 0)`` (OpenAI's documented
      formula; the prompt does not count).

    Args:
        logits: [R, V] float32 raw logits (not modified).
        prompt_ids: per row an int64 tensor of prompt ids on ``logits.device``, all in ``[0, V)``; only read
            for rows whose ``repetition`` is not 1 (None allowed for the others).
        output_ids: per row the ids generated so far (ids outside ``[0, V)`` are ignored).
        repetition: [R] repetition penalties (> 0). frequency, presence: [R] penalties (0.0: off).

    Returns:
        [R, V] float32 penalised logits; a row with no penalty equals its input bit for bit.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    # numpy, not a per-id Python loop: this runs every step over every output so far (a 32k-token output:
    # ~1 ms of host time instead of ~12)
    rows_ids = [np.asarray(ids, dtype=np.int64) for ids in output_ids]
    flat = np.concatenate([np.empty(0, np.int64)] + [a[(a >= 0) & (a < vocab)] + r * vocab
                                                      for r, a in enumerate(rows_ids)])
    counts = torch.zeros(num_rows * vocab, dtype=logits.dtype, device=device)
    if len(flat):  # float counts: sums of ones are exact (< 2**24) in any order, so CUDA's atomics are deterministic
        counts.index_add_(0, _host_list(flat.tolist(), device),
                          torch.ones(len(flat), dtype=logits.dtype, device=device))
    counts = counts.view(num_rows, vocab)
    x = logits
    rep_rows = [r for r in range(num_rows) if repetition[r] != 1.0]
    if rep_rows:
        seen = counts > 0
        ids = [prompt_ids[r] for r in rep_rows]
        lengths = [int(t.numel()) for t in ids]
        if sum(lengths):
            rows = torch.repeat_interleave(_host_list(rep_rows, device), _host_list(lengths, device),
                                           output_size=sum(lengths))
            seen.view(-1)[rows * vocab + torch.cat(ids)] = True
        fmax = torch.finfo(logits.dtype).max
        # a penalty above the float32 maximum (valid: finite as a Python float) would be inf, and 0 * inf NaN
        rep = _host_list([min(r, fmax) for r in repetition], device, logits.dtype).unsqueeze(1)
        penalised = torch.where(x > 0, x / rep, x * rep).clamp_(-fmax, fmax)
        x = torch.where(seen & (x > float("-inf")), penalised, x)
    if any(f != 0.0 for f in frequency):
        x = x - _host_list(list(frequency), device, logits.dtype).unsqueeze(1) * counts
    if any(p != 0.0 for p in presence):
        x = x - _host_list(list(presence), device, logits.dtype).unsqueeze(1) * (counts > 0).to(logits.dtype)
    return x if x is not logits else logits.clone()


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p filtering (Nguyen et al. 2024, "Min P Sampling"; vLLM's MinPLogitsProcessor, transformers'
    MinPLogitsWarper): tokens whose probability under ``softmax(x)`` is below ``min_p`` times the row's
    largest probability become ``-inf``; the most likely token always stays.

    Args:
        x: [R, V] float32 temperature-scaled logits. min_p: [R] float32 on ``x.device``, in [0, 1] (0: off;
            such a row is returned bit for bit).

    Returns:
        [R, V] float32, a new tensor.
    """
    probs = torch.softmax(x, dim=-1)
    keep = probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return torch.where(keep, x, float("-inf"))


def sample_rows(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                generators: list[torch.Generator | None], min_p: list[float] | None = None) -> torch.Tensor:
    """Pick one token per row of logits [R, V] float32; returns int64 [R] on ``logits.device`` (no sync).

    Per row: ``temperature`` (0: greedy), ``top_k`` (0, -1 or >= V: off; 1: greedy), ``top_p`` (1.0: off),
    ``generators`` (``None``: the global torch generator), ``min_p`` (0.0 or None: off; after temperature,
    before top-k/top-p, as in vLLM). Ties go to the lowest token id. Penalties are the caller's
    (:func:`apply_penalties` on the logits first).
    """
    num_rows, vocab = logits.shape
    device = logits.device
    out = torch.empty(num_rows, dtype=torch.long, device=device)
    kinds: dict[str, list[int]] = {"greedy": [], "plain": [], "topk": [], "sort": []}
    for r in range(num_rows):
        k = top_k[r] if 0 < top_k[r] < vocab else 0
        if temperature[r] == 0 or k == 1:
            kinds["greedy"].append(r)
        elif k == 0 and top_p[r] >= 1.0:
            kinds["plain"].append(r)
        elif 0 < k <= MAX_TOPK_CANDIDATES:
            kinds["topk"].append(r)
        else:
            kinds["sort"].append(r)
    if len(kinds["greedy"]) == num_rows:
        return logits.argmax(dim=-1)

    def rows_of(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        rows = kinds[kind]
        idx = _host_list(rows, device)
        temps = _host_list([temperature[r] for r in rows], device, torch.float32)
        # a penalised logit may sit at the float32 maximum (apply_penalties clamps there): a temperature below 1
        # would make it inf and the softmax NaN, so it is clamped again (-inf, a masked token, stays -inf)
        x = (logits.index_select(0, idx) / temps.unsqueeze(1)).clamp_(max=torch.finfo(logits.dtype).max)
        if min_p is not None and any(min_p[r] > 0.0 for r in rows):
            x = apply_min_p(x, _host_list([min_p[r] for r in rows], device, torch.float32))
        return idx, x

    def params_of(kind: str) -> tuple[torch.Tensor, list[torch.Generator | None]]:
        rows = kinds[kind]
        p = _host_list([top_p[r] if top_p[r] < 1.0 else float("inf") for r in rows], device, torch.float32)
        return p, [generators[r] for r in rows]

    if kinds["greedy"]:
        idx = _host_list(kinds["greedy"], device)
        out.index_copy_(0, idx, logits.index_select(0, idx).argmax(dim=-1))
    if kinds["plain"]:
        idx, x = rows_of("plain")
        gens = [generators[r] for r in kinds["plain"]]
        out.index_copy_(0, idx, _race(torch.softmax(x, dim=-1), [vocab] * len(gens), gens))
    if kinds["topk"]:
        idx, x = rows_of("topk")
        ks = [top_k[r] for r in kinds["topk"]]
        vals, ids = exact_topk(x, _host_list(ks, device), max(ks))
        p, gens = params_of("topk")
        out.index_copy_(0, idx, _sample_topk_candidates(vals, ids, ks, p, gens))
    if kinds["sort"]:
        idx, x = rows_of("sort")
        vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        ks = _host_list([top_k[r] if 0 < top_k[r] < vocab else vocab for r in kinds["sort"]], device)
        if any(0 < top_k[r] < vocab for r in kinds["sort"]):  # top-p then renormalises over the top-k
            vals = torch.where(torch.arange(vocab, device=device).unsqueeze(0) < ks.unsqueeze(1), vals, float("-inf"))
        p, gens = params_of("sort")
        out.index_copy_(0, idx, _sample_sorted_vocab(vals, ids, ks, p, gens))
    return out


def top_logprobs(logprobs: torch.Tensor, n: int) -> dict[int, float]:
    """The ``n`` most likely tokens of a [V] log-prob vector as ``{id: logprob}`` (ties: lower id first)."""
    n = min(n, logprobs.shape[-1])
    if n <= 0:
        return {}
    vals, ids = exact_topk(logprobs.unsqueeze(0), _host_list([n], logprobs.device), n)
    return dict(zip(ids[0].tolist(), vals[0].tolist(), strict=True))


def sample_one(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None, min_p: float = 0.0) -> int:
    """Pick one token from logits [V] float32 (``temperature == 0``: greedy); a batch of one of
    :func:`sample_rows`, so it draws exactly what the batched sampler draws for that row."""
    return int(sample_rows(logits.unsqueeze(0), [temperature], [top_k], [top_p], [generator], [min_p])[0])


class Sampler:
    """Samples the next token of each sequence from its last-token logits (batched, one host transfer)."""

    def __init__(self) -> None:
        #: a penalised sequence's prompt ids on the device, built once (a prompt can be long; it never changes)
        self._prompt_ids: weakref.WeakKeyDictionary[Sequence, torch.Tensor] = weakref.WeakKeyDictionary()
        #: a sequence's ``allowed_token_ids`` on the device, built once (the list can be vocabulary-sized)
        self._allowed_ids: weakref.WeakKeyDictionary[Sequence, torch.Tensor] = weakref.WeakKeyDictionary()

    def _prompt_tensor(self, seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
        """``seq``'s prompt ids in ``[0, vocab)`` as int64 on ``device`` (cached for the sequence's life)."""
        ids = self._prompt_ids.get(seq)
        if ids is None or ids.device != device:
            t = torch.tensor(seq.prompt_token_ids, dtype=torch.long)
            t = t[(t >= 0) & (t < vocab)]
            ids = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
            self._prompt_ids[seq] = ids
        return ids

    def _allowed_tensor(self, seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
        """``seq``'s ``allowed_token_ids`` in ``[0, vocab)`` as int64 on ``device`` (cached for its life)."""
        ids = self._allowed_ids.get(seq)
        if ids is None or ids.device != device:
            t = torch.tensor([i for i in seq.params.allowed_token_ids if 0 <= i < vocab], dtype=torch.long)
            ids = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
            self._allowed_ids[seq] = ids
        return ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, dict | None]]:
        """logits: [B, V] float32, row b for ``seqs[b]``. Returns ``(token_id, logprob entry or None)`` each.

        First the rows that ask get their ``logit_bias`` added and everything outside their
        ``allowed_token_ids`` masked (:func:`apply_logit_bias`, :func:`apply_allowed_token_ids`), and the rows
        with a grammar (structured outputs, ``seq.grammar``) everything it does not allow; before
        ``min_tokens`` outputs, EOS and ``stop_token_ids`` are masked out (vLLM semantics); then the rows that
        ask for one get their penalties (:func:`apply_penalties`; prompt and output so far from ``seq``), then
        :func:`sample_rows` (min-p included). Log-probs are those of the raw logits (before bias, masking,
        penalties, temperature and min-p): ``{"token_id", "logprob", "top"}``.
        """
        num_rows, vocab = logits.shape
        device = logits.device
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for b, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
                banned_ids = sorted(t for t in banned if 0 <= t < vocab)
                ban_rows += [b] * len(banned_ids)
                ban_cols += banned_ids
            if p.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(device=device)
                seq.generator.manual_seed(p.seed)
        params = [s.params for s in seqs]
        x = logits
        if any(p.logit_bias for p in params):
            x = apply_logit_bias(x, [p.logit_bias for p in params])
        if any(p.allowed_token_ids is not None for p in params):
            x = apply_allowed_token_ids(x, [None if p.allowed_token_ids is None
                                            else self._allowed_tensor(seqs[b], vocab, device)
                                            for b, p in enumerate(params)])
        grammar_rows = [b for b, s in enumerate(seqs) if s.grammar is not None]
        if grammar_rows:  # structured outputs: only tokens that continue a valid output
            x = apply_token_bitmask(x, grammar_rows, fill_bitmasks([seqs[b].grammar for b in grammar_rows]))
        if ban_rows:
            x = x.clone() if x is logits else x  # never write into ``logits``: it stays raw for the log-probs
            x[_host_list(ban_rows, device), _host_list(ban_cols, device)] = float("-inf")
        pen_rows = [b for b, p in enumerate(params) if has_penalty(p)]
        if pen_rows:
            idx = _host_list(pen_rows, device)
            pen = [params[b] for b in pen_rows]
            penalised = apply_penalties(
                x.index_select(0, idx),
                [self._prompt_tensor(seqs[b], vocab, device) if params[b].repetition_penalty != 1.0 else None
                 for b in pen_rows],
                [seqs[b].output_token_ids for b in pen_rows], [p.repetition_penalty for p in pen],
                [p.frequency_penalty for p in pen], [p.presence_penalty for p in pen])
            x = x.index_copy(0, idx, penalised)  # out of place: ``logits`` stays raw for the log-probs
        tokens = sample_rows(x, [p.temperature for p in params], [p.top_k for p in params],
                             [p.top_p for p in params], [s.generator for s in seqs], [p.min_p for p in params])

        # Everything the host needs goes into one float64 tensor (token ids < 2**53 are exact) -> one transfer.
        lp_rows = [b for b, p in enumerate(params) if p.logprobs is not None]
        parts = [tokens.double()]
        n_top = [min(params[b].logprobs, vocab) for b in lp_rows]
        n_max = max(n_top, default=0)
        if lp_rows:
            idx = _host_list(lp_rows, device)
            lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
            parts.append(lp.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1).double())
            if n_max > 0:
                k = _host_list([max(n, 1) for n in n_top], device)
                top_vals, top_ids = exact_topk(lp, k, n_max)
                parts += [top_ids.double().flatten(), top_vals.double().flatten()]
        host = torch.cat(parts).tolist()

        token_list = [int(t) for t in host[:num_rows]]
        entries: list[dict | None] = [None] * num_rows
        off = num_rows
        chosen = host[off:off + len(lp_rows)]
        off += len(lp_rows)
        width = len(lp_rows) * n_max
        top_ids_h, top_vals_h = host[off:off + width], host[off + width:off + 2 * width]
        for j, b in enumerate(lp_rows):
            n = n_top[j]
            row = slice(j * n_max, j * n_max + n)
            top = dict(zip((int(i) for i in top_ids_h[row]), top_vals_h[row], strict=True))
            entries[b] = {"token_id": token_list[b], "logprob": chosen[j], "top": top}
        return list(zip(token_list, entries, strict=True))
