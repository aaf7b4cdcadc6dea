"""Sampler step time: the former per-row loop against the batched ``Sampler`` (issue 7).

The per-row reference below is the sampler as it was before the batched rewrite (kept here only, not in the
package): per row a stable sort of the whole vocabulary, cumsum + searchsorted, and two device->host syncs
(``int(token)`` and, with logprobs, ``.tolist()``). The batched sampler is ``atomtool.serve.engine.sampler``.

Both sample the same [batch, vocab] float32 logits (default [256, 152064], Qwen's vocabulary) for the same
request mix; reported per mix: median wall ms of each (device synchronised, host work included) and the
ratio old / new.

Mixes: ``greedy`` (all temperature 0), ``mixed`` (a quarter each: greedy; temperature 0.7 + top_p 0.95
seeded; top_k 50 + temperature 0.8; temperature 1.0; every 8th row asks for 5 logprobs), ``top_p`` (all rows
temperature 1.0 + top_p 0.95: the batched path must sort the vocabulary too).

Run: ``python -m benchmarks.sampler_bench [--batch 256] [--vocab 152064] [--mix all|greedy|mixed|top_p]
[--iters N] [--threads N] [--smoke]`` (cuda when available, else cpu; ``--smoke``: cpu, [16, 4096]).
"""

from __future__ import annotations

import argparse

import torch

from atomtool.serve.engine.sampler import Sampler
from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.sampling_params import SamplingParams
from benchmarks import common as C

# --------------------------------------------------------------------------- per-row reference (old sampler)


def _ref_sample_one(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    generator: torch.Generator | None) -> int:
    if temperature == 0 or top_k == 1:
        return int(torch.argmax(logits))
    vals, ids = torch.sort(logits / temperature, descending=True, stable=True)
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


def ref_sampler(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, dict | None]]:
    """The former ``Sampler.__call__``: one row at a time."""
    results = []
    for b, seq in enumerate(seqs):
        p = seq.params
        row = logits[b]
        if seq.num_output_tokens < p.min_tokens:
            banned = [t for t in set(p.stop_token_ids) | set(seq.eos_token_ids) if 0 <= t < row.shape[0]]
            if banned:
                row = row.clone()
                row[banned] = float("-inf")
        if p.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(device=row.device)
            seq.generator.manual_seed(p.seed)
        token = _ref_sample_one(row, p.temperature, p.top_k, p.top_p, seq.generator)
        entry = None
        if p.logprobs is not None:
            lp = torch.log_softmax(logits[b], dim=-1)
            vals, ids = torch.sort(lp, descending=True, stable=True)
            top = dict(zip(ids[:p.logprobs].tolist(), vals[:p.logprobs].tolist(), strict=True))
            entry = {"token_id": token, "logprob": float(lp[token]), "top": top}
        results.append((token, entry))
    return results


# --------------------------------------------------------------------------- request mixes


def mix_params(mix: str, batch: int) -> list[SamplingParams]:
    """Per-row sampling parameters of one of the mixes in the module docstring."""
    if mix == "greedy":
        return [SamplingParams(temperature=0.0) for _ in range(batch)]
    if mix == "top_p":
        return [SamplingParams(temperature=1.0, top_p=0.95) for _ in range(batch)]
    out = []
    for i in range(batch):
        lp = 5 if i % 8 == 0 else None
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(temperature=0.0, logprobs=lp))
        elif kind == 1:
            out.append(SamplingParams(temperature=0.7, top_p=0.95, seed=i, logprobs=lp))
        elif kind == 2:
            out.append(SamplingParams(temperature=0.8, top_k=50, logprobs=lp))
        else:
            out.append(SamplingParams(temperature=1.0, logprobs=lp))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--mix", default="all", choices=["all", "greedy", "mixed", "top_p"])
    ap.add_argument("--iters", type=int, default=None, help="timed calls each (default: 3 on cpu, 10 on cuda)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = C.pick_device(args.smoke)
    batch, vocab = (16, 4096) if args.smoke else (args.batch, args.vocab)
    iters = args.iters or (10 if device.type == "cuda" else 3)
    env = C.env_info(device)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    sampler = Sampler()
    rows = []
    for mix in (["greedy", "mixed", "top_p"] if args.mix == "all" else [args.mix]):
        params = mix_params(mix, batch)

        def seqs(params=params):
            return [Sequence(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]

        ref_seqs, new_seqs = seqs(), seqs()
        with torch.inference_mode():
            if mix == "greedy":  # same tokens, or the timing compares different work
                assert [t for t, _ in ref_sampler(logits, ref_seqs)] == [t for t, _ in sampler(logits, new_seqs)]
            old = C.time_fn(lambda s=ref_seqs: ref_sampler(logits, s), device, warmup=1, iters=iters)
            new = C.time_fn(lambda s=new_seqs: sampler(logits, s), device, warmup=2, iters=iters)
        row = {"mix": mix, "batch": batch, "vocab": vocab, "device": device.type, "threads": torch.get_num_threads(),
               "per_row_ms": old["median_s"] * 1e3, "batched_ms": new["median_s"] * 1e3,
               "ratio": old["median_s"] / new["median_s"]}
        rows.append(row)
        C.record("sampler", **row, env=env)
    C.print_table(f"sampler step, per-row loop vs batched ({device.type}, {env.get('gpu') or 'cpu'})", rows,
                  ["mix", "batch", "vocab", "per_row_ms", "batched_ms", "ratio"])


if __name__ == "__main__":
    main()
