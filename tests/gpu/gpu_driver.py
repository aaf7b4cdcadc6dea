"""A paged-KV step driver for an engine model on a CUDA device (tests only).

The CPU driver of tests/mla_driver.py (:class:`PagedDriver`: per-sequence blocks from a shuffled free list,
:class:`ForwardBatch` tensors for prefill, chunked prefill, decode and mixed steps, greedy continuous
batching) with the pool on the device; a step returns last-token float32 logits and decode steps can be
replayed through :class:`DecodeCudaGraphs`.
"""

from __future__ import annotations

import torch

from atomtool.serve.engine.batch import ForwardBatch
from atomtool.serve.engine.cuda_graphs import DecodeCudaGraphs, maybe_capture_decode_graphs
from tests.mla_driver import PagedDriver


class CudaDriver(PagedDriver):
    def __init__(self, model, device="cuda", block_size: int = 16, num_blocks: int = 1024, seed: int = 0,
                 max_model_len: int = 512):
        super().__init__(model, block_size=block_size, num_blocks=num_blocks, seed=seed, device=device)
        self.max_model_len = max_model_len
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

    def step(self, work: list[tuple[str, int]], use_graphs: bool = True) -> torch.Tensor:
        """One step over ``[(sid, new tokens)]``; returns last-token logits [len(work), vocab] float32."""
        batch = self.build_batch(work)
        with torch.inference_mode():
            if use_graphs and self.graphs is not None and self.graphs.can_run(batch):
                logits = self.graphs.run(batch)
            else:
                logits = self.forward_logits(batch)
        self.advance(work)
        return logits

    def last_logits(self, work: list[tuple[str, int]]) -> list[torch.Tensor]:
        """One step (CUDA graphs where they apply); the last-token logits [vocab] of each item, on the CPU."""
        return [row.cpu() for row in self.step(work)]
