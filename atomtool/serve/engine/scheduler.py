"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Every step, each scheduled sequence gets ``min(tokens it has not computed, budget left)`` tokens, so prefill
chunks and decodes mix in one batch (vLLM v1 / Sarathi-style chunked prefill). Running sequences go first,
in arrival order; then waiting ones (FCFS) while the budget, ``max_num_seqs`` and free KV blocks allow. When a
running sequence needs a block and none is free, the most recently arrived running sequence is preempted:
its blocks are freed and it returns to the front of the queue to be recomputed later (its prefix blocks
usually come back as prefix-cache hits).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atomtool.serve.engine.block_manager import BlockManager
from atomtool.serve.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """The step's work: ``seqs[i]`` computes ``num_new_tokens[i]`` tokens from ``num_computed_tokens`` on."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Decides which sequences run each step; owns the waiting queue and the running list."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its KV blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating their KV blocks."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.bm.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, n):
                self.bm.free_seq(seq)  # give back prefix hits; retry in a later step
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.num_preemptions == 0:  # first admission: prompt tokens served from the prefix cache
                seq.num_cached_tokens = seq.num_computed_tokens
            self.bm.prefix_hits += seq.num_computed_tokens
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out
