"""Builds one step's :class:`ForwardBatch` from the scheduler's decision and runs the model on it.

Pure-decode steps replay captured CUDA graphs (:mod:`atomtool.serve.engine.cuda_graphs`) when the device is
CUDA, the op backend is not the torch reference (which reads lengths on the host), and ``enforce_eager`` is
off; everything else runs eagerly.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from atomtool.serve.engine.batch import ForwardBatch
from atomtool.serve.engine.block_table_buffer import BlockTableBuffer
from atomtool.serve.engine.kv_cache import KVCachePool
from atomtool.serve.engine.prompt_logprobs import PromptLogprobsPlan, compute_prompt_logprobs
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
        # persistent per-sequence block-table rows (issue 7: per-step cost proportional to what changed)
        self.block_tables = BlockTableBuffer(max_num_seqs, -(-max_model_len // self.block_size))
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
        """Concatenate the scheduled chunks: ids, positions, slot mapping, block tables, lengths.

        Host cost is O(B + T + block ids appended since the previous step), not O(B x max_blocks): block
        tables live in a persistent :class:`BlockTableBuffer` and the step's ``[B, max_blocks]`` table is one
        row gather; positions and the slot mapping are computed with numpy from per-sequence starts.
        ``sched.seqs`` need only ``token_ids``, ``num_computed_tokens`` and ``block_table``.
        """
        bs = self.block_size
        seqs, num_new = sched.seqs, sched.num_new_tokens
        B = len(seqs)
        rows, width = self.block_tables.sync(seqs)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=B)
        q = np.asarray(num_new, dtype=np.int64).reshape(B)
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        seq_lens = starts + q
        is_decode = all(n == 1 for n in num_new)
        if is_decode:
            input_ids = np.fromiter((s.token_ids[s.num_computed_tokens] for s in seqs), dtype=np.int64,
                                    count=B)
            positions = starts
            seq_of_token = np.arange(B)
        else:
            ids: list[int] = []
            for s, n in zip(seqs, num_new, strict=True):
                ids.extend(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n])
            input_ids = np.array(ids, dtype=np.int64)
            seq_of_token = np.repeat(np.arange(B), q)
            positions = np.arange(int(cu[-1]), dtype=np.int64) + (starts - cu[:-1])[seq_of_token]
        tables = self.block_tables.gather(rows, width)
        block_ids = self.block_tables.table[rows[seq_of_token], positions // bs].astype(np.int64)
        slots = block_ids * bs + positions % bs
        dev = self.device

        def t(x: np.ndarray) -> torch.Tensor:
            x = torch.from_numpy(np.ascontiguousarray(x))
            return x if dev.type == "cpu" else x.to(dev)

        return ForwardBatch(
            input_ids=t(input_ids), positions=t(positions),
            cu_seqlens_q=t(cu.astype(np.int32)), seq_lens=t(seq_lens.astype(np.int32)),
            block_tables=t(tables), slot_mapping=t(slots), logits_indices=t(cu[1:] - 1),
            is_decode=is_decode, block_size=bs, seq_lens_cpu=seq_lens.tolist(), query_lens_cpu=list(num_new))

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Forward the batch; returns logits [B, vocab] float32 of each sequence's last scheduled token."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self._forward_logits(batch)

    @torch.inference_mode()
    def run_with_prompt_logprobs(self, batch: ForwardBatch,
                                 plan: PromptLogprobsPlan) -> tuple[torch.Tensor, list[list[dict]]]:
        """Forward the batch eagerly (never a CUDA graph: it needs hidden states past the last tokens); returns
        the logits of :meth:`run` (computed the same way, from the same rows) and the prompt log-prob entries
        of ``plan`` (:func:`~atomtool.serve.engine.prompt_logprobs.compute_prompt_logprobs`)."""
        hidden = self.model(batch, self.kv_pool.caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return logits, compute_prompt_logprobs(hidden, plan, self.model.compute_logits)
