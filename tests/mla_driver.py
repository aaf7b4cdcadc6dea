"""Test helpers for the MLA/DSA models: a minimal paged-KV step driver and the HF transformers oracle.

The driver builds :class:`ForwardBatch` objects by hand (block tables over a shuffled free list, slot
mapping, chunked prefill, shared prefix blocks) so the model is exercised exactly as the engine would,
without depending on the scheduler. The oracle is transformers' own modeling code in float32.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atomtool.serve.engine.batch import ForwardBatch


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


class PagedDriver:
    """Owns a paged KV pool for ``model`` and runs steps over sequences identified by string ids."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 96, seed: int = 0, device="cpu"):
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.caches = [
            {p.name: torch.zeros(num_blocks, block_size, *p.shape, dtype=p.dtype, device=self.device)
             for p in planes}
            for planes in model.kv_plane_specs()
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[str, _Seq] = {}

    def add(self, sid: str, tokens: list[int], share_prefix_of: str | None = None, shared_tokens: int = 0) -> None:
        """Register a sequence. With ``share_prefix_of``, its first ``shared_tokens`` (a multiple of the block
        size) reuse that sequence's blocks, as a prefix-cache hit does: they count as already computed."""
        seq = _Seq(list(tokens))
        if share_prefix_of is not None:
            assert shared_tokens % self.block_size == 0
            seq.blocks = list(self.seqs[share_prefix_of].blocks[: shared_tokens // self.block_size])
            seq.computed = shared_tokens
        self.seqs[sid] = seq

    def release(self, sid: str) -> None:
        """Drop a sequence and return its blocks (tests use it only for unshared sequences)."""
        self.free.extend(self.seqs.pop(sid).blocks)

    def build_batch(self, work: list[tuple[str, int]]) -> ForwardBatch:
        """The :class:`ForwardBatch` of one step over ``work`` = [(sid, number of new tokens)], in batch order,
        on the driver's device; blocks are taken from the free list as the sequences grow."""
        bs = self.block_size
        ids, pos, slots, cu, lens, qlens = [], [], [], [0], [], []
        for sid, n in work:
            seq = self.seqs[sid]
            start, end = seq.computed, seq.computed + n
            assert end <= len(seq.tokens)
            while len(seq.blocks) * bs < end:
                seq.blocks.append(self.free.pop())
            for p in range(start, end):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.blocks[p // bs] * bs + p % bs)
            cu.append(cu[-1] + n)
            lens.append(end)
            qlens.append(n)
        width = max(len(self.seqs[sid].blocks) for sid, _ in work)
        tables = torch.full((len(work), width), -1, dtype=torch.int32)
        for b, (sid, _) in enumerate(work):
            blocks = self.seqs[sid].blocks
            tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(cu[1:], dtype=torch.int64, device=dev) - 1,
            is_decode=all(q == 1 for q in qlens), block_size=bs, seq_lens_cpu=lens, query_lens_cpu=qlens)

    def advance(self, work: list[tuple[str, int]]) -> None:
        """Mark the step's tokens of ``work`` as computed (after the model ran on :meth:`build_batch`)."""
        for sid, n in work:
            self.seqs[sid].computed += n

    def step(self, work: list[tuple[str, int]]) -> list[torch.Tensor]:
        """Run one step: ``work`` = [(sid, number of new tokens)], in batch order. Returns, per item, the
        float32 logits [n, vocab] of every new token."""
        batch = self.build_batch(work)
        with torch.no_grad():
            hidden = self.model(batch, self.caches)
            logits = self.model.compute_logits(hidden)
        self.advance(work)
        cu = batch.cu_seqlens_q.tolist()
        return [logits[cu[b]:cu[b + 1]] for b in range(len(work))]

    def last_logits(self, work: list[tuple[str, int]]) -> list[torch.Tensor]:
        """Run one step and return, per item of ``work``, the float32 logits [vocab] of its last new token."""
        return [lg[-1] for lg in self.step(work)]

    def generate(self, prompts: dict[str, list[int]], max_new: int, chunk: int | None = None
                 ) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
        """Greedy continuous batching: all prompts prefill together (in ``chunk``-token pieces when given,
        a finished prefill decodes while others still prefill), then decode until ``max_new`` tokens each.
        Returns (generated tokens, per-token logits [vocab] that produced them) per sequence id."""
        for sid, p in prompts.items():
            self.add(sid, p)
        out = {sid: [] for sid in prompts}
        logits = {sid: [] for sid in prompts}
        while any(len(out[s]) < max_new for s in prompts):
            work = []
            for sid in prompts:
                seq = self.seqs[sid]
                if len(out[sid]) >= max_new:
                    continue
                todo = len(seq.tokens) - seq.computed
                work.append((sid, todo if chunk is None else min(todo, chunk)))
            for (sid, _), lg in zip(work, self.last_logits(work), strict=True):
                seq = self.seqs[sid]
                if seq.computed == len(seq.tokens):  # prompt (or last token) fully processed -> sample
                    tok = int(torch.argmax(lg))
                    out[sid].append(tok)
                    logits[sid].append(lg)
                    seq.tokens.append(tok)
        return out, logits


def hf_model(path: str | Path):
    """The transformers model of a checkpoint directory, float32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


@contextlib.contextmanager
def stable_tensor_topk():
    """Make ``Tensor.topk`` break ties toward the lowest index (a stable descending sort), as the engine does.

    HF's DSA indexer selects with ``index_scores.topk(...)``, whose tie order torch leaves unspecified; ReLU-sum
    scores have exact 0.0 plateaus (dsa.md §5.6, pitfall 12), so with few indexer heads HF's selection among
    tied keys is arbitrary. Inside this context HF computes the same scores with the deterministic tie rule.
    (The MoE router's ``torch.topk`` function is not affected.)
    """
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (torch's keyword)
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new: int, stable_topk: bool = False) -> tuple[list[int], torch.Tensor]:
    """HF greedy generation of ``max_new`` tokens (no EOS stop) and the teacher-forced float32 logits
    [max_new, vocab] that chose each generated token (one full forward over prompt + generated).
    ``stable_topk``: run HF inside :func:`stable_tensor_topk`."""
    with stable_tensor_topk() if stable_topk else contextlib.nullcontext():
        ids = torch.tensor([prompt])
        gen = model.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        new = gen[0, len(prompt):].tolist()
        full = model(gen[:, :-1]).logits[0].float()
    return new, full[len(prompt) - 1:]
