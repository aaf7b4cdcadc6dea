"""A paged-KV step driver for an engine model on a CUDA device (tests only).

It plays the scheduler: it keeps each sequence's blocks (taken from a shuffled free list), builds the
:class:`ForwardBatch` tensors on the device (prefill, chunked prefill, decode, mixed), runs the model and
returns per-token float32 logits. Decode steps can be replayed through :class:`DecodeCudaGraphs`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from atomtool.serve.engine.batch import ForwardBatch
from atomtool.serve.engine.cuda_graphs import DecodeCudaGraphs, maybe_capture_decode_graphs


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


class CudaDriver:
    def __init__(self, model, device="cuda", block_size: int = 16, num_blocks: int = 1024, seed: int = 0,
                 max_model_len: int = 512):
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.caches = [
            {p.name: torch.zeros(num_blocks, block_size, *p.shape, dtype=p.dtype, device=self.device)
             for p in planes}
            for planes in model.kv_plane_specs()
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[str, _Seq] = {}
        self.graphs: DecodeCudaGraphs | None = None

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] float32 of each sequence's last token (what the engine samples from)."""
        hidden = self.model(batch, self.caches)
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def enable_graphs(self, max_num_seqs: int, sizes=None) -> None:
        self.graphs = maybe_capture_decode_graphs(self.model, self.caches, self.device, enforce_eager=False,
                                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                                  block_size=self.block_size, sizes=sizes)
        assert self.graphs is not None, "graphs were not captured (torch backend?)"

    def add(self, sid: str, tokens: list[int]) -> None:
        self.seqs[sid] = _Seq(list(tokens))

    def step(self, work: list[tuple[str, int]], use_graphs: bool = True) -> torch.Tensor:
        """One step over ``[(sid, new tokens)]``; returns last-token logits [len(work), vocab] float32."""
        bs = self.block_size
        ids, pos, slots, cu, lens, qlens = [], [], [], [0], [], []
        for sid, n in work:
            seq = self.seqs[sid]
            start, end = seq.computed, seq.computed + n
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
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(cu[1:], dtype=torch.int64, device=dev) - 1,
            is_decode=all(q == 1 for q in qlens), block_size=bs, seq_lens_cpu=lens, query_lens_cpu=qlens)
        with torch.inference_mode():
            if use_graphs and self.graphs is not None and self.graphs.can_run(batch):
                logits = self.graphs.run(batch)
            else:
                logits = self.forward_logits(batch)
        for sid, n in work:
            self.seqs[sid].computed += n
        return logits

    def generate(self, prompts: dict[str, list[int]], max_new: int, chunk: int | None = None):
        """Greedy continuous batching (see tests/mla_driver.py). Returns (tokens, logits lists) per id."""
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
            lg = self.step(work)
            for b, (sid, _) in enumerate(work):
                seq = self.seqs[sid]
                if seq.computed == len(seq.tokens):
                    tok = int(torch.argmax(lg[b]))
                    out[sid].append(tok)
                    logits[sid].append(lg[b].cpu())
                    seq.tokens.append(tok)
        return out, logits
