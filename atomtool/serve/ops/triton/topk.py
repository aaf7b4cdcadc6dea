"""Deterministic per-row top-k *position* selection over 32-bit orderable score keys (Triton radix select).

Used by the DSA lightning indexer (DeepSeek-V3.2; research/dsa.md §5.3, §5.6): per query row, pick the
``K`` largest scores among the row's first ``n`` positions (its causally valid ones), ties to the LOWEST
position, and list the picked positions in ASCENDING order; a row with ``n <= K`` picks all ``n``;
unused output slots hold -1.

Keys: a float32 score ``x`` is stored as the int32 bit pattern of the uint32 ``u(x)`` with
``u(x) = bits(x) ^ 0x80000000`` for ``x >= 0`` and ``~bits(x)`` for ``x < 0`` (the classic radix-sort
float mapping), -0.0 first folded to +0.0; unsigned order of ``u`` is then float order, and equal scores
have equal keys. :func:`orderable_keys` (torch) and :func:`orderable_key` (Triton) compute it.

Why our own kernel: ``torch.topk`` (a radix select of ~25 launches per call on CUDA) plus a sort of the
positions cost ~80 us per layer at decode. Here one program per row does, in a single launch:

1. the row's min and max key;
2. an adaptive-range radix select: a ``BINS``-bucket histogram (``tl.histogram``) of
   ``(u - lo) >> shift`` over the current candidates (range ``[lo, hi]``, ``shift`` the smallest with
   ``(hi - lo) >> shift < BINS``), the bucket where the count of larger keys crosses the remaining ``k``,
   and a stream compaction of that bucket's keys into a scratch row (ping-pong halves) together with
   their exact min/max, until ``lo == hi``. That value is the threshold ``Tk``; ``need`` = how many keys
   equal to ``Tk`` are taken. The first step reads the whole row; later ones only the (usually tiny)
   candidate list. A plateau of equal scores (ReLU zeros) ends at once: its min equals its max;
3. one pass in position order writes every position with ``u > Tk`` and the first ``need`` with
   ``u == Tk`` to its rank among the taken (one packed cumsum), so the output is ascending by construction.

No host sync: ``n`` per row comes from device tensors (``cu_seqlens_q``/``seq_lens`` or explicit lengths),
every launch size from tensor shapes, so the selection can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import pow2, token_sequence

#: positions per chunk of a row pass, buckets per histogram, warps per row program (see the bench)
BLOCK = 2048
BINS = 64
NUM_WARPS = 8


def orderable_keys(scores: torch.Tensor) -> torch.Tensor:
    """int32 storage of the order-preserving uint32 keys of float32 ``scores`` (module doc), same shape.

    The torch twin of :func:`orderable_key`, for callers that hold scores rather than keys (tests, bench).
    """
    x = scores.float()
    x = torch.where(x == 0, torch.zeros_like(x), x)  # -0.0 -> +0.0
    bits = x.view(torch.int32)
    return torch.where(bits >= 0, bits ^ torch.iinfo(torch.int32).min, ~bits)


@triton.jit
def orderable_key(score):
    """Triton twin of :func:`orderable_keys`: float32 scores -> int32 storage of the uint32 order keys."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits ^ -2147483648, ~bits)


@triton.jit
def _radix_topk_kernel(
    key_ptr, scratch_ptr, out_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr,
    num_seqs, row0, S, K, s_key, s_scr, s_out,
    ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
):
    r = tl.program_id(0)  # row of this launch's key block; query row t of the step
    t = row0 + r
    if ROW_LENS:
        n = tl.load(lens_ptr + t)
    else:
        b, qpos = token_sequence(t, cu_q_ptr, seq_lens_ptr, num_seqs, BLOCK_B)
        n = qpos + 1  # positions 0..qpos are causally valid
    n = tl.minimum(tl.maximum(n, 0), S)
    key_row = key_ptr + r.to(tl.int64) * s_key
    out_row = out_ptr + t.to(tl.int64) * s_out
    offs = tl.arange(0, BLOCK)

    if n <= K:  # dense row: every valid position, then -1
        for c in range(0, K, BLOCK):
            slot = c + offs
            tl.store(out_row + slot, tl.where(slot < n, slot, -1), mask=slot < K)
        return

    # 1. the row's key range
    lo_v = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
    hi_v = tl.zeros([BLOCK], tl.uint32)
    for c in range(0, n, BLOCK):
        ok = c + offs < n
        u = tl.load(key_row + c + offs, mask=ok, other=0).to(tl.uint32, bitcast=True)
        lo_v = tl.minimum(lo_v, tl.where(ok, u, 0xFFFFFFFF))
        hi_v = tl.maximum(hi_v, u)
    lo = tl.min(lo_v, axis=0)
    hi = tl.max(hi_v, axis=0)

    # 2. adaptive-range radix select of the K-th largest key
    bins = tl.arange(0, BINS)
    shifts = tl.arange(0, 32).to(tl.uint32)
    scratch_row = scratch_ptr + r.to(tl.int64) * s_scr
    remaining = K + tl.zeros([], tl.int32)  # keys still to take at or below the current range
    m = n  # candidates: every key of the range (all of the row at first)
    src = key_row
    it = tl.zeros([], tl.int32)
    while lo < hi:
        shift = tl.sum(((hi - lo) >> shifts >= BINS).to(tl.int32), axis=0).to(tl.uint32)
        hist = tl.zeros([BINS], tl.int32)
        for c in range(0, m, BLOCK):
            ok = c + offs < m
            u = tl.load(src + c + offs, mask=ok, other=0).to(tl.uint32, bitcast=True)
            hist += tl.histogram(((u - lo) >> shift).to(tl.int32), BINS, mask=ok)
        at_or_above = m - tl.cumsum(hist, axis=0) + hist  # keys in buckets >= d
        pick = tl.sum((at_or_above >= remaining).to(tl.int32), axis=0) - 1  # highest bucket crossing
        remaining -= tl.sum(tl.where(bins == pick, at_or_above - hist, 0), axis=0)
        dst = scratch_row + (it % 2).to(tl.int64) * S
        cnt = tl.zeros([], tl.int32)
        nlo_v = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
        nhi_v = tl.zeros([BLOCK], tl.uint32)
        for c in range(0, m, BLOCK):
            ok = c + offs < m
            u = tl.load(src + c + offs, mask=ok, other=0).to(tl.uint32, bitcast=True)
            sel = ok & (((u - lo) >> shift).to(tl.int32) == pick)
            idx = cnt + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(dst + idx, u.to(tl.int32, bitcast=True), mask=sel)
            cnt += tl.sum(sel.to(tl.int32), axis=0)
            nlo_v = tl.minimum(nlo_v, tl.where(sel, u, 0xFFFFFFFF))
            nhi_v = tl.maximum(nhi_v, tl.where(sel, u, 0))
        tl.debug_barrier()  # the compacted candidates are read by other threads next round
        lo = tl.min(nlo_v, axis=0)
        hi = tl.max(nhi_v, axis=0)
        m = cnt
        src = dst
        it += 1

    # 3. positions above the threshold and the first `need` ties, in position order
    need = remaining
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for c in range(0, n, BLOCK):
        s = c + offs
        ok = s < n
        u = tl.load(key_row + s, mask=ok, other=0).to(tl.uint32, bitcast=True)
        gt = ok & (u > lo)
        eq = ok & (u == lo)
        counts = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)  # BLOCK < 2^15: no carry
        c_gt = n_gt + (counts & 0xFFFF)
        c_eq = n_eq + (counts >> 16)
        take = gt | (eq & (c_eq <= need))
        tl.store(out_row + c_gt + tl.minimum(c_eq, need) - 1, s, mask=take)
        n_gt += tl.sum(gt.to(tl.int32), axis=0)
        n_eq += tl.sum(eq.to(tl.int32), axis=0)


def select_rows(keys: torch.Tensor, out: torch.Tensor, row0: int, topk: int, *,
                lengths: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                seq_lens: torch.Tensor | None = None, block: int = BLOCK, bins: int = BINS,
                num_warps: int = NUM_WARPS) -> None:
    """Top-``topk`` positions of key rows ``keys[r]`` into ``out[row0 + r]`` (contract: module doc).

    keys: [R, S] int32 orderable keys (:func:`orderable_key`), last dim contiguous; out: [T, topk] int32,
    every slot of rows ``row0 .. row0+R-1`` is written. A row's valid length ``n`` is ``lengths[row0+r]``
    ([T] int32) when given, else the query position + 1 of step row ``row0 + r`` from ``cu_seqlens_q``
    ([B+1] int32) and ``seq_lens`` ([B] int32); it is clamped to [0, S]. ``block`` (power of two, at most
    16384), ``bins`` (power of two, 32..1024) and ``num_warps`` only tune speed.
    """
    R, S = keys.shape
    if R == 0:
        return
    if keys.dtype != torch.int32 or keys.stride(-1) != 1:
        raise ValueError("select_rows: keys must be int32 with a contiguous last dim")
    if not (block & (block - 1) == 0 and 16 <= block <= 16384 and bins & (bins - 1) == 0 and 32 <= bins <= 1024):
        raise ValueError(f"select_rows: block {block} and bins {bins} must be powers of two in range")
    scratch = torch.empty((R, 2 * S), dtype=torch.int32, device=keys.device)
    row_lens = lengths is not None
    if row_lens:
        cu_seqlens_q = seq_lens = lengths  # unused by the kernel
    num_seqs = seq_lens.shape[0]
    _radix_topk_kernel[(R,)](
        keys, scratch, out, lengths if row_lens else keys, cu_seqlens_q, seq_lens,
        num_seqs, row0, S, topk, keys.stride(0), scratch.stride(0), out.stride(0),
        ROW_LENS=row_lens, BLOCK_B=1 if row_lens else pow2(num_seqs), BLOCK=block, BINS=bins,
        num_warps=num_warps,
    )


def topk_positions(keys: torch.Tensor, lengths: torch.Tensor, topk: int, **tuning) -> torch.Tensor:
    """Per row, the ``topk`` largest keys among its first ``lengths[t]`` positions, as positions.

    keys: [T, S] int32 orderable keys (:func:`orderable_keys`); lengths: [T] int32 (clamped to [0, S]).
    Returns [T, topk] int32 positions, ascending, -1 padded; ties go to the lowest position. ``tuning``:
    ``block``, ``bins``, ``num_warps`` of :func:`select_rows`. Raises ValueError on non-int32 keys.
    """
    out = torch.empty((keys.shape[0], topk), dtype=torch.int32, device=keys.device)
    select_rows(keys, out, 0, topk, lengths=lengths, **tuning)
    return out
