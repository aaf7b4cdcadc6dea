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
   equal to ``Tk`` are taken. The first round reads the whole row in chunks of ``BLOCK``; later ones only
   the (usually small) candidate list, in chunks of ``CAND_BLOCK``. A plateau of equal scores (ReLU
   zeros) ends at once: its min equals its max;
3. one pass in position order writes every position with ``u > Tk`` and the first ``need`` with
   ``u == Tk`` to its rank among the taken (one packed cumsum), so the output is ascending by construction.

Few long rows (decode at small batch) would leave most SMs idle, so there the same algorithm runs split:
one program per ``BLOCK`` positions of a row, four launches (see "split rows" below). ``select_rows``
picks the mode from shapes only (rows < ``SPLIT_MAX_ROWS`` and width >= ``SPLIT_MIN_WIDTH``).

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
#: chunk of the radix rounds after the first, over the (usually few) candidates of the picked bucket
CAND_BLOCK = 256
#: rows below this count and at least this wide are selected by several programs per row (select_rows)
SPLIT_MAX_ROWS = 128
SPLIT_MIN_WIDTH = 4 * BLOCK


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
def _row_length(t, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S,
                ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr):
    """Valid positions of query row ``t``: ``lengths[t]``, or its position in its sequence + 1; in [0, S]."""
    if ROW_LENS:
        n = tl.load(lens_ptr + t)
    else:
        b, qpos = token_sequence(t, cu_q_ptr, seq_lens_ptr, num_seqs, BLOCK_B)
        n = qpos + 1  # positions 0..qpos are causally valid
    return tl.minimum(tl.maximum(n, 0), S)


@triton.jit
def _load_bound(n, ALIGNED: tl.constexpr):
    """``n`` rounded up to a multiple of 4 when the rows allow it (ALIGNED: row width and stride multiples of
    4): load masks then hold over groups of 4, so loads vectorize; lanes in [n, bound) are masked by the
    caller's own ``< n`` tests."""
    if ALIGNED:
        return (n + 3) // 4 * 4
    else:
        return n


@triton.jit
def _bucket_shift(lo, hi, BINS: tl.constexpr):
    """The smallest shift with ``(hi - lo) >> shift < BINS`` (uint32 scalars), as uint32."""
    wide = (hi - lo) >> tl.arange(0, 32).to(tl.uint32) >= BINS
    return tl.sum(wide.to(tl.int32), axis=0).to(tl.uint32)


@triton.jit
def _load_fresh(ptrs, mask):
    """int32 loads of data other programs of this launch wrote (L1 bypassed: .cg), 0 where masked."""
    return tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")


@triton.jit
def _load_keys(row_ptr, s, n, ALIGNED: tl.constexpr):
    """Keys ``row[s]`` as uint32, 0 where ``s >= n`` (up to the vectorizing bound, see _load_bound)."""
    return tl.load(row_ptr + s, mask=s < _load_bound(n, ALIGNED), other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _radix_round(src, m, lo, hi, remaining, dst, CH: tl.constexpr, BINS: tl.constexpr, ALIGNED: tl.constexpr):
    """One round of the adaptive-range radix select over the ``m`` candidate keys ``src[:m]`` (all within
    [lo, hi], lo < hi), in chunks of CH: histogram of ``(u - lo) >> shift``, the bucket holding the
    ``remaining``-th largest, its keys compacted to ``dst``. Returns (their min, their max, their count,
    keys still to take among them)."""
    offs = tl.arange(0, CH)
    bins = tl.arange(0, BINS)
    shift = _bucket_shift(lo, hi, BINS)
    hist = tl.zeros([BINS], tl.int32)
    for c in range(0, m, CH):
        u = _load_keys(src, c + offs, m, ALIGNED)
        hist += tl.histogram(((u - lo) >> shift).to(tl.int32), BINS, mask=c + offs < m)
    at_or_above = m - tl.cumsum(hist, axis=0) + hist  # keys in buckets >= d
    pick = tl.sum((at_or_above >= remaining).to(tl.int32), axis=0) - 1  # highest bucket crossing
    remaining -= tl.sum(tl.where(bins == pick, at_or_above - hist, 0), axis=0)
    cnt = tl.zeros([], tl.int32)
    lo_v = tl.full([CH], 0xFFFFFFFF, tl.uint32)
    hi_v = tl.zeros([CH], tl.uint32)
    for c in range(0, m, CH):
        u = _load_keys(src, c + offs, m, ALIGNED)
        sel = (c + offs < m) & (((u - lo) >> shift).to(tl.int32) == pick)
        idx = cnt + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(dst + idx, u.to(tl.int32, bitcast=True), mask=sel)
        cnt += tl.sum(sel.to(tl.int32), axis=0)
        lo_v = tl.minimum(lo_v, tl.where(sel, u, 0xFFFFFFFF))
        hi_v = tl.maximum(hi_v, tl.where(sel, u, 0))
    tl.debug_barrier()  # the compacted candidates are read by other threads next round
    return tl.min(lo_v, axis=0), tl.max(hi_v, axis=0), cnt, remaining


@triton.jit
def _radix_topk_kernel(
    key_ptr, scratch_ptr, out_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr,
    num_seqs, row0, S, K, s_key, s_scr, s_out,
    ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
    CBLOCK: tl.constexpr, ALIGNED: tl.constexpr,
):
    r = tl.program_id(0)  # row of this launch's key block; query row t of the step
    t = row0 + r
    n = _row_length(t, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
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
        u = _load_keys(key_row, c + offs, n, ALIGNED)
        lo_v = tl.minimum(lo_v, tl.where(ok, u, 0xFFFFFFFF))
        hi_v = tl.maximum(hi_v, tl.where(ok, u, 0))
    lo = tl.min(lo_v, axis=0)
    hi = tl.max(hi_v, axis=0)

    # 2. adaptive-range radix select of the K-th largest key: round 1 over the row, then over candidates
    scratch_row = scratch_ptr + r.to(tl.int64) * s_scr
    remaining = K + tl.zeros([], tl.int32)  # keys still to take at or below the current range
    if lo < hi:
        lo, hi, m, remaining = _radix_round(key_row, n, lo, hi, remaining, scratch_row, BLOCK, BINS, ALIGNED)
        src = scratch_row
        it = tl.full([], 1, tl.int32)
        while lo < hi:
            dst = scratch_row + (it % 2).to(tl.int64) * S  # ping-pong halves of the scratch row
            lo, hi, m, remaining = _radix_round(src, m, lo, hi, remaining, dst, CBLOCK, BINS, False)
            src = dst
            it += 1

    # 3. positions above the threshold and the first `need` ties, in position order
    need = remaining
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for c in range(0, n, BLOCK):
        s = c + offs
        ok = s < n
        u = _load_keys(key_row, s, n, ALIGNED)
        gt = ok & (u > lo)
        eq = ok & (u == lo)
        packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)  # BLOCK < 2^15: no carry into the eq half
        counts = tl.cumsum(packed, axis=0)
        c_gt = n_gt + (counts & 0xFFFF)
        c_eq = n_eq + (counts >> 16)
        take = gt | (eq & (c_eq <= need))
        tl.store(out_row + c_gt + tl.minimum(c_eq, need) - 1, s, mask=take)
        total = tl.sum(packed, axis=0)
        n_gt += total & 0xFFFF
        n_eq += total >> 16


# ------------------------------------------------------------------ split rows: several programs per row
#
# Few long rows (decode at batch 1..64) would leave most SMs idle with one program per row, so the same
# selection runs over segments of BLOCK positions, one program each, in four launches that communicate
# through a zero-initialised per-row stats row (atomics): A) key range, B) round-1 histogram, C) compaction
# of the picked bucket's (key, position) pairs; the last program of the row to finish C (an acq_rel
# counter) completes the radix loop on the candidates, stores Tk / need and every segment's offsets;
# E) every segment writes its taken positions. Ties never depend on the order of the atomics: the
# candidates are a set, positions keep the order.

ST_INV_LO: tl.constexpr = tl.constexpr(0)  # max of ~u (uint32) = ~(min key)
ST_HI: tl.constexpr = tl.constexpr(1)  # max key
ST_CNT: tl.constexpr = tl.constexpr(2)  # candidates compacted so far
ST_CINV_LO: tl.constexpr = tl.constexpr(3)  # ~(min candidate key)
ST_CHI: tl.constexpr = tl.constexpr(4)  # max candidate key
ST_DONE: tl.constexpr = tl.constexpr(5)  # programs of C done
ST_TK: tl.constexpr = tl.constexpr(6)  # threshold key
ST_NEED: tl.constexpr = tl.constexpr(7)  # keys equal to the threshold to take
ST_HIST: tl.constexpr = tl.constexpr(8)  # round-1 histogram, BINS entries


@triton.jit
def _split_range_kernel(key_ptr, stats_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, row0, S, K,
                        s_key, s_st, ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
                        ALIGNED: tl.constexpr):
    r = tl.program_id(0)
    s0 = tl.program_id(1) * BLOCK
    n = _row_length(row0 + r, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
    if (n <= K) | (s0 >= n):
        return
    s = s0 + tl.arange(0, BLOCK)
    ok = s < n
    u = _load_keys(key_ptr + r.to(tl.int64) * s_key, s, n, ALIGNED)
    st = (stats_ptr + r.to(tl.int64) * s_st).to(tl.pointer_type(tl.uint32))
    tl.atomic_max(st + ST_INV_LO, tl.max(tl.where(ok, u ^ 0xFFFFFFFF, 0), axis=0))
    tl.atomic_max(st + ST_HI, tl.max(tl.where(ok, u, 0), axis=0))


@triton.jit
def _split_hist_kernel(key_ptr, stats_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, row0, S, K,
                       s_key, s_st,
                       ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
                       ALIGNED: tl.constexpr):
    r = tl.program_id(0)
    s0 = tl.program_id(1) * BLOCK
    n = _row_length(row0 + r, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
    if (n <= K) | (s0 >= n):
        return
    st_row = stats_ptr + r.to(tl.int64) * s_st
    st = st_row.to(tl.pointer_type(tl.uint32))
    lo = tl.load(st + ST_INV_LO) ^ 0xFFFFFFFF
    hi = tl.load(st + ST_HI)
    if lo < hi:
        shift = _bucket_shift(lo, hi, BINS)
        s = s0 + tl.arange(0, BLOCK)
        ok = s < n
        u = _load_keys(key_ptr + r.to(tl.int64) * s_key, s, n, ALIGNED)
        hist = tl.histogram(((u - lo) >> shift).to(tl.int32), BINS, mask=ok)
        tl.atomic_add(st_row + ST_HIST + tl.arange(0, BINS), hist, mask=hist > 0)


@triton.jit
def _split_compact_kernel(key_ptr, stats_ptr, seg_ptr, cand_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr,
                          num_seqs, row0, S, K, P, s_key, s_st, s_seg, s_cand,
                          ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
                          BINS: tl.constexpr, BLOCK_P: tl.constexpr, CBLOCK: tl.constexpr,
                          ALIGNED: tl.constexpr):
    r = tl.program_id(0)
    p = tl.program_id(1)
    s0 = p * BLOCK
    n = _row_length(row0 + r, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
    if (n <= K) | (s0 >= n):
        return
    st_row = stats_ptr + r.to(tl.int64) * s_st
    st = st_row.to(tl.pointer_type(tl.uint32))
    lo = tl.load(st + ST_INV_LO) ^ 0xFFFFFFFF
    hi = tl.load(st + ST_HI)
    if lo < hi:
        offs = tl.arange(0, BLOCK)
        bins = tl.arange(0, BINS)
        shift = _bucket_shift(lo, hi, BINS)
        hist = tl.load(st_row + ST_HIST + bins)
        at_or_above = n - tl.cumsum(hist, axis=0) + hist
        pick = tl.sum((at_or_above >= K).to(tl.int32), axis=0) - 1
        s = s0 + offs
        ok = s < n
        u = _load_keys(key_ptr + r.to(tl.int64) * s_key, s, n, ALIGNED)
        d = ((u - lo) >> shift).to(tl.int32)
        sel = ok & (d == pick)
        seg_row = seg_ptr + r.to(tl.int64) * s_seg
        tl.store(seg_row + p, tl.sum((ok & (d > pick)).to(tl.int32), axis=0))  # round-1 keys above
        cand_row = cand_ptr + r.to(tl.int64) * s_cand
        base = tl.atomic_add(st_row + ST_CNT, tl.sum(sel.to(tl.int32), axis=0))
        idx = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(cand_row + idx, u.to(tl.int32, bitcast=True), mask=sel)
        tl.store(cand_row + S + idx, s, mask=sel)
        tl.atomic_max(st + ST_CINV_LO, tl.max(tl.where(sel, u ^ 0xFFFFFFFF, 0), axis=0))
        tl.atomic_max(st + ST_CHI, tl.max(tl.where(sel, u, 0), axis=0))
        nseg = tl.cdiv(n, BLOCK)
        tl.debug_barrier()  # every thread's candidate stores precede the release below
        if tl.atomic_add(st_row + ST_DONE, 1) == nseg - 1:  # acq_rel: every other segment's stores are seen
            # the last segment done finishes the radix select on the candidates (no compaction: a rescan)
            m = tl.atomic_add(st_row + ST_CNT, 0)
            clo = tl.atomic_max(st + ST_CINV_LO, 0) ^ 0xFFFFFFFF
            chi = tl.atomic_max(st + ST_CHI, 0)
            remaining = K - tl.sum(tl.where(bins == pick, at_or_above - hist, 0), axis=0)
            coffs = tl.arange(0, CBLOCK)
            while clo < chi:
                cshift = _bucket_shift(clo, chi, BINS)
                chist = tl.zeros([BINS], tl.int32)
                for c in range(0, m, CBLOCK):
                    cok = c + coffs < m
                    cu = _load_fresh(cand_row + c + coffs, cok).to(tl.uint32, bitcast=True)
                    inr = cok & (cu >= clo) & (cu <= chi)
                    chist += tl.histogram(((cu - clo) >> cshift).to(tl.int32), BINS, mask=inr)
                cabove = tl.sum(chist, axis=0) - tl.cumsum(chist, axis=0) + chist
                cpick = tl.sum((cabove >= remaining).to(tl.int32), axis=0) - 1
                remaining -= tl.sum(tl.where(bins == cpick, cabove - chist, 0), axis=0)
                nlo_v = tl.full([CBLOCK], 0xFFFFFFFF, tl.uint32)
                nhi_v = tl.zeros([CBLOCK], tl.uint32)
                for c in range(0, m, CBLOCK):
                    cok = c + coffs < m
                    cu = _load_fresh(cand_row + c + coffs, cok).to(tl.uint32, bitcast=True)
                    csel = cok & (cu >= clo) & (cu <= chi) & (((cu - clo) >> cshift).to(tl.int32) == cpick)
                    nlo_v = tl.minimum(nlo_v, tl.where(csel, cu, 0xFFFFFFFF))
                    nhi_v = tl.maximum(nhi_v, tl.where(csel, cu, 0))
                clo = tl.min(nlo_v, axis=0)
                chi = tl.max(nhi_v, axis=0)
            # every segment's first output slot: keys above Tk and ties before it, in earlier segments
            segs = tl.arange(0, BLOCK_P)
            above = tl.zeros([BLOCK_P], tl.int32)
            ties = tl.zeros([BLOCK_P], tl.int32)
            for c in range(0, m, CBLOCK):
                cok = c + coffs < m
                cu = _load_fresh(cand_row + c + coffs, cok).to(tl.uint32, bitcast=True)
                sg = _load_fresh(cand_row + S + c + coffs, cok) // BLOCK
                above += tl.histogram(sg, BLOCK_P, mask=cok & (cu > clo))
                ties += tl.histogram(sg, BLOCK_P, mask=cok & (cu == clo))
            above += _load_fresh(seg_row + segs, segs < nseg)
            tl.store(seg_row + P + segs, tl.cumsum(above, axis=0) - above, mask=segs < P)
            tl.store(seg_row + 2 * P + segs, tl.cumsum(ties, axis=0) - ties, mask=segs < P)
            tl.store(st + ST_TK, clo)
            tl.store(st_row + ST_NEED, remaining)


@triton.jit
def _split_write_kernel(key_ptr, stats_ptr, seg_ptr, out_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr,
                        num_seqs, row0, S, K, P, s_key, s_st, s_seg, s_out,
                        ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
                        ALIGNED: tl.constexpr):
    r = tl.program_id(0)
    p = tl.program_id(1)
    t = row0 + r
    s0 = p * BLOCK
    n = _row_length(t, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
    out_row = out_ptr + t.to(tl.int64) * s_out
    offs = tl.arange(0, BLOCK)
    if n <= K:  # dense row: the programs of the row share the K slots
        for c in range(s0, K, P * BLOCK):
            slot = c + offs
            tl.store(out_row + slot, tl.where(slot < n, slot, -1), mask=slot < K)
        return
    if s0 >= n:
        return
    st_row = stats_ptr + r.to(tl.int64) * s_st
    st = st_row.to(tl.pointer_type(tl.uint32))
    seg_row = seg_ptr + r.to(tl.int64) * s_seg
    lo = tl.load(st + ST_INV_LO) ^ 0xFFFFFFFF
    flat = lo == tl.load(st + ST_HI)  # all keys equal: C did nothing, every key is a tie
    tk = tl.where(flat, lo, tl.load(st + ST_TK))
    need = tl.where(flat, K, tl.load(st_row + ST_NEED))
    n_gt = tl.where(flat, 0, tl.load(seg_row + P + p))
    n_eq = tl.where(flat, s0, tl.load(seg_row + 2 * P + p))
    s = s0 + offs
    ok = s < n
    u = _load_keys(key_ptr + r.to(tl.int64) * s_key, s, n, ALIGNED)
    gt = ok & (u > tk)
    eq = ok & (u == tk)
    counts = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
    c_gt = n_gt + (counts & 0xFFFF)
    c_eq = n_eq + (counts >> 16)
    take = gt | (eq & (c_eq <= need))
    tl.store(out_row + c_gt + tl.minimum(c_eq, need) - 1, s, mask=take)


def _select_split(keys, out, row0, topk, lens, cu_q, seq_lens, row_lens, block_b, block, bins, num_warps):
    R, S = keys.shape
    P = triton.cdiv(S, block)
    dev = keys.device
    stats = torch.zeros((R, 8 + bins), dtype=torch.int32, device=dev)
    seg = torch.empty((R, 3 * P), dtype=torch.int32, device=dev)
    cand = torch.empty((R, 2 * S), dtype=torch.int32, device=dev)
    num_seqs = seq_lens.shape[0]
    rows = (lens, cu_q, seq_lens, num_seqs, row0, S, topk)
    meta = {"ROW_LENS": row_lens, "BLOCK_B": block_b, "BLOCK": block, "num_warps": num_warps,
            "ALIGNED": S % 4 == 0 and keys.stride(0) % 4 == 0}
    _split_range_kernel[(R, P)](keys, stats, *rows, keys.stride(0), stats.stride(0), **meta)
    _split_hist_kernel[(R, P)](keys, stats, *rows, keys.stride(0), stats.stride(0), BINS=bins, **meta)
    _split_compact_kernel[(R, P)](keys, stats, seg, cand, *rows, P, keys.stride(0), stats.stride(0),
                                  seg.stride(0), cand.stride(0), BINS=bins, BLOCK_P=pow2(P, 32),
                                  CBLOCK=min(block, CAND_BLOCK), **meta)
    _split_write_kernel[(R, P)](keys, stats, seg, out, *rows, P, keys.stride(0), stats.stride(0),
                                seg.stride(0), out.stride(0), **meta)


def select_rows(keys: torch.Tensor, out: torch.Tensor, row0: int, topk: int, *,
                lengths: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                seq_lens: torch.Tensor | None = None, split: bool | None = None, block: int | None = None,
                bins: int | None = None, num_warps: int | None = None) -> None:
    """Top-``topk`` positions of key rows ``keys[r]`` into ``out[row0 + r]`` (contract: module doc).

    keys: [R, S] int32 orderable keys (:func:`orderable_key`), last dim contiguous; out: [T, topk] int32,
    every slot of rows ``row0 .. row0+R-1`` is written. A row's valid length ``n`` is ``lengths[row0+r]``
    ([T] int32) when given, else the query position + 1 of step row ``row0 + r`` from ``cu_seqlens_q``
    ([B+1] int32) and ``seq_lens`` ([B] int32); it is clamped to [0, S]. ``split``: one program per
    ``block`` positions of a row (4 launches + a memset) instead of one program per row (1 launch); by
    default when there are fewer than :data:`SPLIT_MAX_ROWS` rows at least :data:`SPLIT_MIN_WIDTH` wide.
    ``block`` (power of two, 16..16384), ``bins`` (power of two, 32..1024) and ``num_warps`` tune speed
    (None: the module's :data:`BLOCK`, :data:`BINS`, :data:`NUM_WARPS`).
    Raises ValueError on non-int32 / strided keys or out-of-range tuning.
    """
    block = BLOCK if block is None else block
    bins = BINS if bins is None else bins
    num_warps = NUM_WARPS if num_warps is None else num_warps
    R, S = keys.shape
    if R == 0 or topk == 0:
        return
    if keys.dtype != torch.int32 or keys.stride(-1) != 1:
        raise ValueError("select_rows: keys must be int32 with a contiguous last dim")
    pow2_ok = block & (block - 1) == 0 and bins & (bins - 1) == 0
    if not (pow2_ok and 16 <= block <= 16384 and 32 <= bins <= 1024):
        raise ValueError(f"select_rows: block {block} and bins {bins} must be powers of two in range")
    row_lens = lengths is not None
    if row_lens:
        cu_seqlens_q = seq_lens = lengths  # unused by the kernels
    else:
        lengths = keys  # unused by the kernels
    block_b = 1 if row_lens else pow2(seq_lens.shape[0])
    if split is None:
        split = R < SPLIT_MAX_ROWS and S >= SPLIT_MIN_WIDTH
    if split:
        _select_split(keys, out, row0, topk, lengths, cu_seqlens_q, seq_lens, row_lens, block_b, block, bins,
                      num_warps)
        return
    scratch = torch.empty((R, 2 * S), dtype=torch.int32, device=keys.device)
    _radix_topk_kernel[(R,)](
        keys, scratch, out, lengths, cu_seqlens_q, seq_lens,
        seq_lens.shape[0], row0, S, topk, keys.stride(0), scratch.stride(0), out.stride(0),
        ROW_LENS=row_lens, BLOCK_B=block_b, BLOCK=block, BINS=bins, CBLOCK=min(block, CAND_BLOCK),
        ALIGNED=S % 4 == 0 and keys.stride(0) % 4 == 0, num_warps=num_warps,
    )


def topk_positions(keys: torch.Tensor, lengths: torch.Tensor, topk: int, **tuning) -> torch.Tensor:
    """Per row, the ``topk`` largest keys among its first ``lengths[t]`` positions, as positions.

    keys: [T, S] int32 orderable keys (:func:`orderable_keys`); lengths: [T] int32 (clamped to [0, S]).
    Returns [T, topk] int32 positions, ascending, -1 padded; ties go to the lowest position. ``tuning``:
    ``split``, ``block``, ``bins``, ``num_warps`` of :func:`select_rows`. Raises ValueError on non-int32 keys.
    """
    out = torch.empty((keys.shape[0], topk), dtype=torch.int32, device=keys.device)
    select_rows(keys, out, 0, topk, lengths=lengths, **tuning)
    return out
