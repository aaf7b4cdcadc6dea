"""A persistent host copy of the running sequences' block tables, updated incrementally.

Building a step's padded ``[B, max_blocks]`` block table from Python lists costs O(B x max_blocks) every
step (64 sequences at 32k context with 16-token blocks: 131k ids; ~15 ms of host time per decode step
on the H200 host, issue 7). Block tables only grow between replacements (``BlockManager`` appends in
``allocate`` / ``match_prefix`` and installs a fresh list in ``free_seq``), so each sequence gets a row
of a persistent int32 numpy array; a step copies in only the block ids appended since the sequence's
previous step (a whole row only after a replacement: preemption, abort, re-admission), and the step's
table is one row gather. This is the same structure as vLLM v1's ``BlockTable`` (persistent per-request rows).

Invariant relied on: a sequence's ``block_table`` list is never modified in place except by appending;
anything else must assign a new list (as ``BlockManager.free_seq`` does).
"""

from __future__ import annotations

import numpy as np


class _Row:
    __slots__ = ("seq", "table", "n", "row", "last_step")

    def __init__(self, seq: object, row: int) -> None:
        self.seq = seq  # strong reference: keeps id(seq) from being reused while the row exists
        self.table: list[int] | None = None  # the block_table list object last copied
        self.n = 0  # how many of its ids are in the buffer row
        self.row = row
        self.last_step = 0


class BlockTableBuffer:
    """Per-sequence rows of block ids, int32, -1 beyond each sequence's table.

    Args:
        num_rows: initial rows (grows by doubling when a step schedules more sequences than free rows).
        max_blocks: initial width in blocks, e.g. ``ceil(max_model_len / block_size)`` (grows on demand).
        idle_steps: a row whose sequence was not scheduled for this many steps is released (finished and
            aborted sequences are never announced to the model runner; this bounds what the rows keep alive).

    Use: ``rows, width = buf.sync(seqs)`` once per step, then ``buf.gather(rows, width)`` for the step's
    ``[B, width]`` table and ``buf.table`` / ``rows`` for per-token lookups (slot mapping).
    """

    def __init__(self, num_rows: int, max_blocks: int, *, idle_steps: int = 32) -> None:
        self.table = np.full((max(1, num_rows), max(1, max_blocks)), -1, dtype=np.int32)
        self._rows: dict[int, _Row] = {}
        self._free = list(range(self.table.shape[0] - 1, -1, -1))
        self._step = 0
        self.idle_steps = idle_steps

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def _release(self, r: _Row) -> None:
        self.table[r.row, :r.n] = -1
        del self._rows[id(r.seq)]
        self._free.append(r.row)

    def _new_row(self, live: set[int]) -> int:
        if not self._free:  # release rows of sequences not in this step, else grow
            for r in [r for k, r in self._rows.items() if k not in live]:
                self._release(r)
        if not self._free:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.full_like(self.table, -1)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _widen(self, width: int) -> None:
        extra = max(width, 2 * self.table.shape[1]) - self.table.shape[1]
        pad = np.full((self.table.shape[0], extra), -1, dtype=np.int32)
        self.table = np.concatenate([self.table, pad], axis=1)

    def sync(self, seqs: list) -> tuple[np.ndarray, int]:
        """Bring the rows of ``seqs`` (objects with a ``block_table`` list) up to date.

        Returns (rows [B] int64 row index of each sequence, width = the longest table). Cost: O(B) plus the
        block ids appended since each sequence's previous sync (whole tables only after a replacement).
        """
        self._step += 1
        step = self._step
        live = {id(s) for s in seqs}
        if step % self.idle_steps == 0:
            stale = step - self.idle_steps
            for r in [r for k, r in self._rows.items() if r.last_step < stale and k not in live]:
                self._release(r)
        rows = np.empty(len(seqs), dtype=np.int64)
        width = 0
        get = self._rows.get
        for i, seq in enumerate(seqs):
            tbl = seq.block_table
            n = len(tbl)
            r = get(id(seq))
            if r is None:
                r = _Row(seq, self._new_row(live))
                self._rows[id(seq)] = r
            if n > self.table.shape[1]:
                self._widen(n)
            if r.table is not tbl or n < r.n:  # a new list (freed / preempted / re-admitted): rewrite the row
                if n:
                    self.table[r.row, :n] = tbl
                if r.n > n:
                    self.table[r.row, n:r.n] = -1
                r.table = tbl
            elif n > r.n:  # appended blocks only
                self.table[r.row, r.n:n] = tbl[r.n:]
            r.n = n
            r.last_step = step
            rows[i] = r.row
            if n > width:
                width = n
        return rows, width

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """The step's block tables: a new [len(rows), width] int32 array, -1 padded."""
        return self.table[rows, :width]
