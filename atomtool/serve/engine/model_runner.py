"""Builds one step's :class:`ForwardBatch` from the scheduler's decision and runs the model on it.

Pure-decode steps replay captured CUDA graphs (:mod:`atomtool.serve.engine.cuda_graphs`) when the device is
CUDA, the op backend is not the torch reference (which reads lengths on the host), and ``enforce_eager`` is
off; everything else runs eagerly.
"""

from __future__ import annotations

import logging

import torch

from atomtool.serve.engine.batch import ForwardBatch
from atomtool.serve.engine.kv_cache import KVCachePool
from atomtool.serve.engine.scheduler import SchedulerOutput
from atomtool.serve.models.base import CausalLM


class ModelRunner:
    """Turns ``SchedulerOutput`` into batch tensors on the model's device and returns last-token logits."""

    def __init__(self, model: CausalLM, kv_pool: KVCachePool, device: torch.device, *,
                 enforce_eager: bool = True, max_num_seqs: int = 256, max_model_len: int = 4096) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.block_size = kv_pool.block_size
        self.graphs = None
        if not enforce_eager and device.type == "cuda":
            self._capture(max_num_seqs, max_model_len)

    def _capture(self, max_num_seqs: int, max_model_len: int) -> None:
        from atomtool.serve.engine.cuda_graphs import DecodeCudaGraphs
        from atomtool.serve.ops import backend_for

        if backend_for(self.device) == "torch":
            return  # the reference ops synchronise with the host: not capturable
        graphs = DecodeCudaGraphs(self._forward_logits, self.device, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, block_size=self.block_size)
        try:
            graphs.capture()
        except Exception:  # capture is an optimisation: serve eagerly rather than not at all
            logging.getLogger(__name__).warning("CUDA graph capture failed; running eagerly", exc_info=True)
            return
        self.graphs = graphs

    def _forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch, self.kv_pool.caches)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        """Concatenate the scheduled chunks: ids, positions, slot mapping, block tables, lengths."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            logits_idx.append(cu[-1] - 1)
        width = max(len(s.block_table) for s in sched.seqs)
        tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in sched.seqs]
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=dev)

        return ForwardBatch(
            input_ids=t(input_ids, torch.int64), positions=t(positions, torch.int64),
            cu_seqlens_q=t(cu, torch.int32), seq_lens=t(seq_lens, torch.int32),
            block_tables=t(tables, torch.int32), slot_mapping=t(slots, torch.int64),
            logits_indices=t(logits_idx, torch.int64), is_decode=all(n == 1 for n in sched.num_new_tokens),
            block_size=bs, seq_lens_cpu=seq_lens, query_lens_cpu=list(sched.num_new_tokens))

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Forward the batch; returns logits [B, vocab] float32 of each sequence's last scheduled token."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self._forward_logits(batch)
