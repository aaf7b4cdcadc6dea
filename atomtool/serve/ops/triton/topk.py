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
positions cost ~80 us per layer at decode. The cost here is mostly latency (dependent rounds, each a pass
or a compaction), not bytes (the keys of a row are L2-resident), so the design minimises dependent steps:

1. the row's min and max key: supplied by the keys' producer (the indexer's scoring kernel folds them into
   a persistent per-row accumulator, :func:`accumulate_row_range`, which the selection zeroes again), or
   computed by the selection itself;
2. an adaptive-range radix select: a histogram (``tl.histogram``) of ``(u - lo) >> shift`` over the live
   keys (range ``[lo, hi]``, ``shift`` the smallest with ``(hi - lo) >> shift < bins``), the bucket where
   the count of larger keys crosses the remaining ``k``, and that bucket's exact min/max as the next range,
   until ``lo == hi``. That value is the threshold ``Tk``; ``need`` = how many keys equal to ``Tk`` are
   taken. A row of at most ``BLOCK`` keys is loaded once and every round runs on registers (live-lane
   masks, no memory traffic). A longer row: round 1 (``BINS`` buckets) reads it in chunks of ``BLOCK``
   and compacts the picked bucket's keys (the candidates) into a scratch row; the later rounds
   (``CAND_BINS`` buckets) run on the candidates held in registers (up to ``CAND_BLOCK`` of them; more fall
   back to chunked rescans). A plateau of equal scores (ReLU zeros) ends at once: its min equals its max;
3. one pass in position order writes every position with ``u > Tk`` and the first ``need`` with
   ``u == Tk`` to its rank among the taken (one packed cumsum), so the output is ascending by construction.

Few long rows (decode at small batch) would leave most SMs idle, so there the same algorithm runs split:
segments of ``SPLIT_BLOCK`` positions spread over several programs per row, three launches (see "split
rows" below), and rows of at most ``SPLIT_SMALL_N`` valid keys are selected whole, in registers, by one
program of the first launch.
``select_rows`` picks the mode from shapes only (rows < ``SPLIT_MAX_ROWS`` and width >=
``SPLIT_MIN_WIDTH``); inside a mode the work follows each row's real length n (CUDA-graph decode pads the
key width to the model's maximum length): no pass reads a position >= n, programs past n exit at once.

On CUDA devices the one-program mode runs as a CUDA kernel instead (:mod:`atomtool.serve.ops.cuda.topk`: one
CTA per row, the same steps with shared-memory histograms and block scans) for rows of up to 8192 keys: the
same bits, as the selection is exact.

No host sync: ``n`` per row comes from device tensors (``cu_seqlens_q``/``seq_lens`` or explicit lengths),
every launch size from tensor shapes, so the selection can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import (
    grid_dependency_wait,
    interpreting,
    launch_pdl_args,
    pow2,
    programs_per_row,
    token_sequence,
)

# Tuning (benchmarks/topk_bench.py --candidates prints the values to set). A histogram round costs each
# thread about (log2(bins) + bins / 32 * 2 * (log2(bins) - 5)) operations per key it holds (Triton's
# ballot-based tl.histogram), plus a fixed latency (barriers, scans); more buckets mean fewer rounds.
#: one program per row: positions per chunk (a row of at most BLOCK is selected in registers from one load),
#: buckets of the first histogram round, warps
BLOCK = 4096
BINS = 256
NUM_WARPS = 16
#: split rows: positions per program (one chunk each), buckets of the first (parallel) round, warps
SPLIT_BLOCK = 1024
SPLIT_BINS = 512
SPLIT_NUM_WARPS = 8
#: buckets of the rounds on register-resident keys (a row's single chunk, or the candidates)
CAND_BINS = 128
#: candidates (keys of the picked round-1 bucket) held in registers for the remaining radix rounds; more
#: go through one more compaction round first (one program per row) or are rescanned CAND_BLOCK at a time
#: every round (the split finisher: slow). Round 1 over [min, max] buckets keys linearly, i.e. values logarithmically: for DeepSeek-like
#: indexer scores (64 weighted ReLU heads) 512 buckets leave ~50-300 candidates at 4k-160k positions; a
#: broad 8-head ReLU sum (the bench's --dist relu) ~900 at 4k, ~1900 at 32k, ~9000 at 160k
CAND_BLOCK = 2048
#: split rows: a row with at most this many valid positions (0: none; else a power of two) is selected whole
#: by one program, in registers, in the first launch; the later launches skip it
SPLIT_SMALL_N = 4096
#: warps of the split rows' first launch when it selects short rows whole (SPLIT_SMALL_N > 0)
SPLIT_SMALL_NUM_WARPS = 16
#: rows below this count and at least this wide are selected by several programs per row (select_rows)
SPLIT_MAX_ROWS = 128
SPLIT_MIN_WIDTH = 8192
#: largest bucket count the split state row has room for
MAX_BINS = 1024


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
def _load_keys(row_ptr, s, n, ALIGNED: tl.constexpr, FRESH: tl.constexpr = False):
    """Keys ``row[s]`` as uint32, 0 where ``s >= n`` (up to the vectorizing bound, see _load_bound); FRESH:
    bypassing L1 (data written during this launch)."""
    mask = s < _load_bound(n, ALIGNED)
    if FRESH:
        u = tl.load(row_ptr + s, mask=mask, other=0, cache_modifier=".cg")
    else:
        u = tl.load(row_ptr + s, mask=mask, other=0)
    return u.to(tl.uint32, bitcast=True)


@triton.jit
def _as_u32(ptr):
    return ptr.to(tl.pointer_type(tl.uint32))


@triton.jit
def _add_max(a0, a1, b0, b1):
    return a0 + b0, tl.maximum(a1, b1)


@triton.jit
def _min_max(a0, a1, b0, b1):
    return tl.minimum(a0, b0), tl.maximum(a1, b1)


@triton.jit
def _pick_bucket(hist, remaining):
    """The highest bucket ``d`` of ``hist`` with at least ``remaining`` keys in buckets >= d, and how many
    keys are still to take inside it (``remaining`` minus the keys of the buckets above). One fused
    reduction (count, max) over the reverse cumulative sum."""
    at_or_above = tl.cumsum(hist, axis=0, reverse=True)  # keys in buckets >= d, non-increasing in d
    crossing = at_or_above >= remaining
    count, above = tl.reduce((crossing.to(tl.int32), tl.where(crossing, 0, at_or_above)), 0, _add_max)
    return count - 1, remaining - above


@triton.jit
def _range_of(sel, u):
    """(min, max) of the uint32 keys ``u`` on lanes ``sel`` (one fused reduction; (0xFFFFFFFF, 0) if none)."""
    return tl.reduce((tl.where(sel, u, 0xFFFFFFFF), tl.where(sel, u, 0)), 0, _min_max)


@triton.jit
def accumulate_row_range(rng_row_ptr, keys, ok):
    """Fold int32 order ``keys`` (lanes ``ok``) into one row of a row-range buffer (:func:`row_range_buffer`):
    two relaxed atomic maxima, ``~min`` and ``max`` of the uint32 keys. For producers of keys (the indexer's
    scoring kernel), so the selection skips its own pass over the row for the key range."""
    u = keys.to(tl.uint32, bitcast=True)
    fold_row_range(rng_row_ptr, tl.max(tl.where(ok, u ^ 0xFFFFFFFF, 0), axis=0), tl.max(tl.where(ok, u, 0), axis=0))


@triton.jit
def fold_row_range(rng_row_ptr, inv_lo, hi):
    """Fold a partial key range into a row of a row-range buffer: ``inv_lo`` = ~(min key) and ``hi`` = max key
    (uint32 scalars; 0 and 0 fold nothing), two relaxed atomic maxima (:func:`accumulate_row_range`)."""
    st = _as_u32(rng_row_ptr)
    tl.atomic_max(st, inv_lo, sem="relaxed")
    tl.atomic_max(st + 1, hi, sem="relaxed")


@triton.jit
def _rounds_in_registers(cu, valid, lo, hi, remaining, BINS: tl.constexpr):
    """Radix rounds over candidate keys held in registers (``cu`` uint32, lanes ``valid``; those within
    [lo, hi] are the live ones): each round histograms ``(u - lo) >> shift`` of the live keys into BINS
    buckets, keeps the bucket holding the ``remaining``-th largest and narrows [lo, hi] to its exact key
    range, until one key is left. Returns (that key Tk, how many keys equal to Tk to take)."""
    while lo < hi:
        shift = _bucket_shift(lo, hi, BINS)
        live = valid & (cu >= lo) & (cu <= hi)
        d = tl.where(live, ((cu - lo) >> shift).to(tl.int32), 0)
        pick, remaining = _pick_bucket(tl.histogram(d, BINS, mask=live), remaining)
        lo, hi = _range_of(live & (d == pick), cu)
    return lo, remaining


@triton.jit
def _rounds_chunked(cand, m, lo, hi, remaining, CH: tl.constexpr, BINS: tl.constexpr):
    """:func:`_rounds_in_registers` for more than CH candidates ``cand[:m]`` (int32 in memory): every round
    rescans them CH at a time (no compaction). The slow path: only when the first round leaves many
    candidates (heavy ties spread over a narrow key range)."""
    offs = tl.arange(0, CH)
    while lo < hi:
        shift = _bucket_shift(lo, hi, BINS)
        hist = tl.zeros([BINS], tl.int32)
        for c in range(0, m, CH):
            ok = c + offs < m
            cu = _load_fresh(cand + c + offs, ok).to(tl.uint32, bitcast=True)
            live = ok & (cu >= lo) & (cu <= hi)
            hist += tl.histogram(tl.where(live, ((cu - lo) >> shift).to(tl.int32), 0), BINS, mask=live)
        pick, remaining = _pick_bucket(hist, remaining)
        lo_v = tl.full([CH], 0xFFFFFFFF, tl.uint32)
        hi_v = tl.zeros([CH], tl.uint32)
        for c in range(0, m, CH):
            ok = c + offs < m
            cu = _load_fresh(cand + c + offs, ok).to(tl.uint32, bitcast=True)
            sel = ok & (cu >= lo) & (cu <= hi) & (((cu - lo) >> shift).to(tl.int32) == pick)
            lo_v = tl.minimum(lo_v, tl.where(sel, cu, 0xFFFFFFFF))
            hi_v = tl.maximum(hi_v, tl.where(sel, cu, 0))
        lo, hi = tl.reduce((lo_v, hi_v), 0, _min_max)
    return lo, remaining


@triton.jit
def _threshold(cand, m, lo, hi, remaining, spare, CH: tl.constexpr, BINS: tl.constexpr):
    """Tk and the ties to take among the ``m`` candidate keys ``cand[:m]`` (all in [lo, hi]): in registers
    when they fit in CH lanes (one load); more first go through one compaction round into ``spare`` (room
    for m keys), then registers, or chunked rescans if still more than CH."""
    if (m > CH) & (lo < hi):
        lo, hi, m, remaining = _radix_round(cand, m, lo, hi, remaining, spare, CH, BINS, False, True)
        cand = spare
    if m <= CH:
        offs = tl.arange(0, CH)
        ok = offs < m
        cu = _load_fresh(cand + offs, ok).to(tl.uint32, bitcast=True)
        tk, need = _rounds_in_registers(cu, ok, lo, hi, remaining, BINS)
    else:
        tk, need = _rounds_chunked(cand, m, lo, hi, remaining, CH, BINS)
    return tk, need


@triton.jit
def _radix_round(src, m, lo, hi, remaining, dst, CH: tl.constexpr, BINS: tl.constexpr, ALIGNED: tl.constexpr,
                 FRESH: tl.constexpr):
    """A round of the adaptive-range radix select over the ``m`` keys ``src[:m]`` (all within [lo, hi],
    lo < hi; FRESH: written during this launch), in chunks of CH: histogram of ``(u - lo) >> shift``, the bucket holding the
    ``remaining``-th largest, its keys compacted to ``dst``. Returns (their min, their max, their count,
    keys still to take among them)."""
    offs = tl.arange(0, CH)
    shift = _bucket_shift(lo, hi, BINS)
    hist = tl.zeros([BINS], tl.int32)
    for c in range(0, m, CH):
        u = _load_keys(src, c + offs, m, ALIGNED, FRESH)
        hist += tl.histogram(((u - lo) >> shift).to(tl.int32), BINS, mask=c + offs < m)
    pick, remaining = _pick_bucket(hist, remaining)
    cnt = tl.zeros([], tl.int32)
    lo_v = tl.full([CH], 0xFFFFFFFF, tl.uint32)
    hi_v = tl.zeros([CH], tl.uint32)
    for c in range(0, m, CH):
        u = _load_keys(src, c + offs, m, ALIGNED, FRESH)
        sel = (c + offs < m) & (((u - lo) >> shift).to(tl.int32) == pick)
        idx = cnt + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(dst + idx, u.to(tl.int32, bitcast=True), mask=sel)
        cnt += tl.sum(sel.to(tl.int32), axis=0)
        lo_v = tl.minimum(lo_v, tl.where(sel, u, 0xFFFFFFFF))
        hi_v = tl.maximum(hi_v, tl.where(sel, u, 0))
    tl.debug_barrier()  # the compacted candidates are read by other threads next
    lo, hi = tl.reduce((lo_v, hi_v), 0, _min_max)
    return lo, hi, cnt, remaining


@triton.jit
def _write_chunk(out_row, s, u, ok, tk, need, n_gt, n_eq):
    """Store the taken positions ``s`` of one chunk (keys ``u``, lanes ``ok``; fewer than 2^15 lanes):
    keys above Tk, and ties while the ties taken so far stay within ``need``, each to its rank among the
    taken (``n_gt`` / ``n_eq``: keys above Tk / ties in earlier chunks). Returns this chunk's (above, ties)."""
    gt = ok & (u > tk)
    eq = ok & (u == tk)
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)  # < 2^15 lanes: no carry into the eq half
    counts = tl.cumsum(packed, axis=0)
    c_gt = n_gt + (counts & 0xFFFF)
    c_eq = n_eq + (counts >> 16)
    take = gt | (eq & (c_eq <= need))
    tl.store(out_row + c_gt + tl.minimum(c_eq, need) - 1, s, mask=take)
    total = tl.sum(packed, axis=0)
    return total & 0xFFFF, total >> 16


@triton.jit
def _select_tile(key_row, out_row, n, lo, hi, K, TILE: tl.constexpr, CBINS: tl.constexpr,
                 ALIGNED: tl.constexpr):
    """The whole selection of a row of ``n <= TILE`` keys (all within [lo, hi]) in registers: one load,
    the radix rounds on the live lanes, one store of the taken positions."""
    s = tl.arange(0, TILE)
    ok = s < n
    u = _load_keys(key_row, s, n, ALIGNED)
    tk, need = _rounds_in_registers(u, ok, lo, hi, K + tl.zeros([], tl.int32), CBINS)
    _write_chunk(out_row, s, u, ok, tk, need, 0, 0)


@triton.jit
def _radix_topk_kernel(
    key_ptr, scratch_ptr, rng_ptr, out_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr,
    num_seqs, row0, S, K, s_key, s_scr, s_rng, s_out,
    ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
    CBLOCK: tl.constexpr, CBINS: tl.constexpr, ALIGNED: tl.constexpr, RANGE_GIVEN: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    grid_dependency_wait(USE_PDL)
    r = tl.program_id(0)  # row of this launch's key block; query row t of the step
    t = row0 + r
    n = _row_length(t, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
    key_row = key_ptr + r.to(tl.int64) * s_key
    out_row = out_ptr + t.to(tl.int64) * s_out
    offs = tl.arange(0, BLOCK)

    if RANGE_GIVEN:  # the producer's key range; this program is its only reader: reset it for the next
        rng = _as_u32(rng_ptr + r.to(tl.int64) * s_rng)
        lo_given = tl.load(rng) ^ 0xFFFFFFFF
        hi_given = tl.load(rng + 1)
        tl.debug_barrier()  # every thread has read the range before any thread zeroes it
        tl.store(rng + tl.arange(0, 2), tl.zeros([2], tl.uint32))

    if n <= K:  # dense row: every valid position, then -1
        for c in range(0, K, BLOCK):
            slot = c + offs
            tl.store(out_row + slot, tl.where(slot < n, slot, -1), mask=slot < K)
        return

    if n <= BLOCK:  # the row fits one chunk: everything in registers, the keys loaded once
        ok = offs < n
        u = _load_keys(key_row, offs, n, ALIGNED)
        if RANGE_GIVEN:
            lo = lo_given
            hi = hi_given
        else:
            lo, hi = _range_of(ok, u)
        tk, need = _rounds_in_registers(u, ok, lo, hi, K + tl.zeros([], tl.int32), CBINS)
        _write_chunk(out_row, offs, u, ok, tk, need, 0, 0)
        return

    # 1. the row's key range
    if RANGE_GIVEN:
        lo = lo_given
        hi = hi_given
    else:
        lo_v = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
        hi_v = tl.zeros([BLOCK], tl.uint32)
        for c in range(0, n, BLOCK):
            ok = c + offs < n
            u = _load_keys(key_row, c + offs, n, ALIGNED)
            lo_v = tl.minimum(lo_v, tl.where(ok, u, 0xFFFFFFFF))
            hi_v = tl.maximum(hi_v, tl.where(ok, u, 0))
        lo, hi = tl.reduce((lo_v, hi_v), 0, _min_max)

    # 2. adaptive-range radix select of the K-th largest key: round 1 over the row, then over candidates
    remaining = K + tl.zeros([], tl.int32)  # keys still to take at or below the current range
    if lo < hi:
        scratch_row = scratch_ptr + r.to(tl.int64) * s_scr
        lo, hi, m, remaining = _radix_round(key_row, n, lo, hi, remaining, scratch_row, BLOCK, BINS, ALIGNED,
                                            False)
        lo, remaining = _threshold(scratch_row, m, lo, hi, remaining, scratch_row + S, CBLOCK, CBINS)

    # 3. positions above the threshold and the first `need` ties, in position order
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for c in range(0, n, BLOCK):
        s = c + offs
        u = _load_keys(key_row, s, n, ALIGNED)
        gt, eq = _write_chunk(out_row, s, u, s < n, lo, remaining, n_gt, n_eq)
        n_gt += gt
        n_eq += eq


# ------------------------------------------------------------------ split rows: several programs per row
#
# Few long rows (decode at batch 1..64) would leave most SMs idle with one program per row, so the same
# selection runs over segments of SPLIT_BLOCK positions: NP programs per row (about two waves of the GPU
# over all rows, SPLIT_PROGRAMS_PER_SM), program p taking segments p, p + NP, ... below the row's length n.
# The grid comes from shapes only (CUDA graphs); a program with no segment below n returns at once, so the
# cost follows n, not the key width S. Launches: [range: only when no producer supplied the key range],
# B) round-1 histogram (one atomic add per program; a row of at most SPLIT_SMALL_N keys is instead
# selected whole by its first program, in registers, and skipped by C and E), C) compaction of the picked
# bucket's (key, position) pairs; the last program of the row to finish C (an acq_rel counter) completes
# the radix select on the candidates (in registers when they fit) and stores Tk / need and every
# segment's first output slot; E) every segment writes its taken positions, and program 0 of the row
# zeroes the row's accumulators (range, histogram, counters) for the next call: the state is persistent
# and self-cleaning, so no memset launch. Ties never depend on the order of the atomics: the candidates
# are a set, positions keep the order.

ST_CNT: tl.constexpr = tl.constexpr(0)  # candidates compacted so far
ST_CINV_LO: tl.constexpr = tl.constexpr(1)  # ~(min candidate key)
ST_CHI: tl.constexpr = tl.constexpr(2)  # max candidate key
ST_DONE: tl.constexpr = tl.constexpr(3)  # programs of C done
ST_TK: tl.constexpr = tl.constexpr(4)  # threshold key (written by C's last program, not reset)
ST_NEED: tl.constexpr = tl.constexpr(5)  # keys equal to the threshold to take
ST_FLAT: tl.constexpr = tl.constexpr(6)  # 1: every key of the row is equal
ST_HIST: tl.constexpr = tl.constexpr(16)  # round-1 histogram, BINS entries
_ST_WIDTH = 16


@triton.jit
def _split_range_kernel(key_ptr, rng_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, row0, S, NP,
                        s_key, s_rng, ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
                        ALIGNED: tl.constexpr, USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    r = tl.program_id(0)
    n = _row_length(row0 + r, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
    if tl.program_id(1) * BLOCK >= n:
        return
    key_row = key_ptr + r.to(tl.int64) * s_key
    inv_lo = tl.zeros([BLOCK], tl.uint32)
    hi = tl.zeros([BLOCK], tl.uint32)
    for seg in range(tl.program_id(1), tl.cdiv(n, BLOCK), NP):
        s = seg * BLOCK + tl.arange(0, BLOCK)
        u = _load_keys(key_row, s, n, ALIGNED)
        inv_lo = tl.maximum(inv_lo, tl.where(s < n, u ^ 0xFFFFFFFF, 0))
        hi = tl.maximum(hi, tl.where(s < n, u, 0))
    fold_row_range(rng_ptr + r.to(tl.int64) * s_rng, tl.max(inv_lo, axis=0), tl.max(hi, axis=0))


@triton.jit
def _split_hist_kernel(key_ptr, rng_ptr, st_ptr, out_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, row0,
                       S, K, NP, s_key, s_rng, s_st, s_out,
                       ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
                       ALIGNED: tl.constexpr, SMALL: tl.constexpr, CBINS: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    r = tl.program_id(0)
    n = _row_length(row0 + r, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
    if (n <= K) | (tl.program_id(1) * BLOCK >= n):
        return
    rng = _as_u32(rng_ptr + r.to(tl.int64) * s_rng)
    lo = tl.load(rng) ^ 0xFFFFFFFF
    hi = tl.load(rng + 1)
    key_row = key_ptr + r.to(tl.int64) * s_key
    if SMALL > 0:  # a short row: selected whole by its first program, in registers; C and E skip it
        if n <= SMALL:
            if tl.program_id(1) == 0:
                _select_tile(key_row, out_ptr + (row0 + r).to(tl.int64) * s_out, n, lo, hi, K, SMALL, CBINS,
                             ALIGNED)
            return
    if lo < hi:
        shift = _bucket_shift(lo, hi, BINS)
        hist = tl.zeros([BINS], tl.int32)
        for seg in range(tl.program_id(1), tl.cdiv(n, BLOCK), NP):
            s = seg * BLOCK + tl.arange(0, BLOCK)
            ok = s < n
            u = _load_keys(key_row, s, n, ALIGNED)
            hist += tl.histogram(tl.where(ok, ((u - lo) >> shift).to(tl.int32), 0), BINS, mask=ok)
        tl.atomic_add(st_ptr + r.to(tl.int64) * s_st + ST_HIST + tl.arange(0, BINS), hist, mask=hist > 0,
                      sem="relaxed")


@triton.jit
def _split_compact_kernel(key_ptr, rng_ptr, st_ptr, seg_ptr, cand_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr,
                          num_seqs, row0, S, K, P, NP, s_key, s_rng, s_st, s_seg, s_cand,
                          ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
                          BINS: tl.constexpr, BLOCK_P: tl.constexpr, CBLOCK: tl.constexpr,
                          ALIGNED: tl.constexpr, SMALL: tl.constexpr, CBINS: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    r = tl.program_id(0)
    n = _row_length(row0 + r, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
    if (n <= K) | (tl.program_id(1) * BLOCK >= n) | (n <= SMALL):  # dense rows: E; short rows: done in B
        return
    rng = _as_u32(rng_ptr + r.to(tl.int64) * s_rng)
    lo = tl.load(rng) ^ 0xFFFFFFFF
    hi = tl.load(rng + 1)
    st_row = st_ptr + r.to(tl.int64) * s_st
    st = _as_u32(st_row)
    seg_row = seg_ptr + r.to(tl.int64) * s_seg
    cand_row = cand_ptr + r.to(tl.int64) * s_cand
    key_row = key_ptr + r.to(tl.int64) * s_key
    nseg = tl.cdiv(n, BLOCK)
    pick, remaining = _pick_bucket(tl.load(st_row + ST_HIST + tl.arange(0, BINS)), K)
    if lo < hi:
        shift = _bucket_shift(lo, hi, BINS)
        inv_lo_v = tl.zeros([BLOCK], tl.uint32)
        hi_v = tl.zeros([BLOCK], tl.uint32)
        for seg in range(tl.program_id(1), nseg, NP):
            s = seg * BLOCK + tl.arange(0, BLOCK)
            ok = s < n
            u = _load_keys(key_row, s, n, ALIGNED)
            d = ((u - lo) >> shift).to(tl.int32)
            sel = ok & (d == pick)
            tl.store(seg_row + seg, tl.sum((ok & (d > pick)).to(tl.int32), axis=0))  # round-1 keys above
            base = tl.atomic_add(st_row + ST_CNT, tl.sum(sel.to(tl.int32), axis=0), sem="relaxed")
            idx = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(cand_row + idx, u.to(tl.int32, bitcast=True), mask=sel)
            tl.store(cand_row + S + idx, s, mask=sel)
            inv_lo_v = tl.maximum(inv_lo_v, tl.where(sel, u ^ 0xFFFFFFFF, 0))
            hi_v = tl.maximum(hi_v, tl.where(sel, u, 0))
        fold_row_range(st + ST_CINV_LO, tl.max(inv_lo_v, axis=0), tl.max(hi_v, axis=0))  # ST_CHI follows
    tl.debug_barrier()  # every thread's candidate stores precede the release below
    # acq_rel: the last program of the row (of min(NP, nseg) with segments) sees every other one's stores
    if tl.atomic_add(st_row + ST_DONE, 1) == tl.minimum(NP, nseg) - 1:
        if lo < hi:
            # plain L2 reads, ordered after the acquire above (independent: issued together)
            m = tl.load(st_row + ST_CNT, cache_modifier=".cg")
            clo = tl.load(st + ST_CINV_LO, cache_modifier=".cg") ^ 0xFFFFFFFF
            chi = tl.load(st + ST_CHI, cache_modifier=".cg")
            segs = tl.arange(0, BLOCK_P)
            if m <= CBLOCK:  # the usual case: every candidate in registers, one load
                coffs = tl.arange(0, CBLOCK)
                cok = coffs < m
                cu = _load_fresh(cand_row + coffs, cok).to(tl.uint32, bitcast=True)
                sg = _load_fresh(cand_row + S + coffs, cok) // BLOCK
                tk, need = _rounds_in_registers(cu, cok, clo, chi, remaining, CBINS)
                above = tl.histogram(sg, BLOCK_P, mask=cok & (cu > tk))
                ties = tl.histogram(sg, BLOCK_P, mask=cok & (cu == tk))
            else:
                tk, need = _rounds_chunked(cand_row, m, clo, chi, remaining, CBLOCK, CBINS)
                coffs = tl.arange(0, CBLOCK)
                above = tl.zeros([BLOCK_P], tl.int32)
                ties = tl.zeros([BLOCK_P], tl.int32)
                for c in range(0, m, CBLOCK):
                    cok = c + coffs < m
                    cu = _load_fresh(cand_row + c + coffs, cok).to(tl.uint32, bitcast=True)
                    sg = _load_fresh(cand_row + S + c + coffs, cok) // BLOCK
                    above += tl.histogram(sg, BLOCK_P, mask=cok & (cu > tk))
                    ties += tl.histogram(sg, BLOCK_P, mask=cok & (cu == tk))
            # every segment's first output slot: keys above Tk and ties before it, in earlier segments
            above += _load_fresh(seg_row + segs, segs < nseg)
            tl.store(seg_row + P + segs, tl.cumsum(above, axis=0) - above, mask=segs < P)
            tl.store(seg_row + 2 * P + segs, tl.cumsum(ties, axis=0) - ties, mask=segs < P)
            tl.store(st + ST_TK, tk)
            tl.store(st_row + ST_NEED, need)
            tl.store(st_row + ST_FLAT, 0)
        else:  # every key equal: all ties, the first K positions
            tl.store(st + ST_TK, lo)
            tl.store(st_row + ST_NEED, K)
            tl.store(st_row + ST_FLAT, 1)


@triton.jit
def _split_write_kernel(key_ptr, rng_ptr, st_ptr, seg_ptr, out_ptr, lens_ptr, cu_q_ptr, seq_lens_ptr,
                        num_seqs, row0, S, K, P, NP, s_key, s_rng, s_st, s_seg, s_out,
                        ROW_LENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
                        BINS: tl.constexpr, ALIGNED: tl.constexpr, SMALL: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    r = tl.program_id(0)
    p = tl.program_id(1)
    t = row0 + r
    n = _row_length(t, lens_ptr, cu_q_ptr, seq_lens_ptr, num_seqs, S, ROW_LENS, BLOCK_B)
    st_row = st_ptr + r.to(tl.int64) * s_st
    if p == 0:  # the accumulators of this row are read by no later launch: zero them for the next call
        tl.store(rng_ptr + r.to(tl.int64) * s_rng + tl.arange(0, 2), tl.zeros([2], tl.int32))
        tl.store(st_row + tl.arange(0, 4), tl.zeros([4], tl.int32))  # ST_CNT .. ST_DONE
        tl.store(st_row + ST_HIST + tl.arange(0, BINS), tl.zeros([BINS], tl.int32))
    out_row = out_ptr + t.to(tl.int64) * s_out
    offs = tl.arange(0, BLOCK)
    if n <= K:  # dense row: the programs of the row share the K slots
        for c in range(p * BLOCK, K, NP * BLOCK):
            slot = c + offs
            tl.store(out_row + slot, tl.where(slot < n, slot, -1), mask=slot < K)
        return
    if (p * BLOCK >= n) | (n <= SMALL):  # short rows were written in B
        return
    st = _as_u32(st_row)
    seg_row = seg_ptr + r.to(tl.int64) * s_seg
    key_row = key_ptr + r.to(tl.int64) * s_key
    flat = tl.load(st_row + ST_FLAT) != 0
    tk = tl.load(st + ST_TK)
    need = tl.load(st_row + ST_NEED)
    for seg in range(p, tl.cdiv(n, BLOCK), NP):
        s0 = seg * BLOCK
        n_gt = tl.where(flat, 0, tl.load(seg_row + P + seg))
        n_eq = tl.where(flat, s0, tl.load(seg_row + 2 * P + seg))
        s = s0 + offs
        u = _load_keys(key_row, s, n, ALIGNED)
        _write_chunk(out_row, s, u, s < n, tk, need, n_gt, n_eq)


# ------------------------------------------------------------------ host side

# Persistent zeroed scratch (per name and device): every kernel that accumulates into it is followed, in
# the same call, by a kernel that zeroes what was touched, so it is zero between calls and needs no memset
# launch. Buffers are never freed once handed out (a captured CUDA graph keeps their addresses); a buffer
# first needed while a CUDA graph is being captured is allocated per call inside the capture (the graph
# replays its memset) and not cached, because eager code would see it unzeroed.
_ZEROED: dict[tuple[str, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _zeroed(name: str, rows: int, width: int, device: torch.device) -> torch.Tensor:
    key = (name, str(device))
    buf = _ZEROED.get(key)
    if buf is not None and buf.shape[0] >= rows and buf.shape[1] == width:
        return buf[:rows]
    fresh = torch.zeros((max(rows, 256), width), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh[:rows]
    if buf is not None:
        _RETIRED.append(buf)
    _ZEROED[key] = fresh
    return fresh[:rows]


def row_range_buffer(rows: int, device: torch.device | str) -> torch.Tensor:
    """[rows, 2] int32 per-row key range accumulator, zero on return (persistent, self-cleaning scratch).

    A producer of keys folds each row's range into it with :func:`accumulate_row_range`; passing it to
    :func:`select_rows` as ``row_range`` skips the selection's own range pass, and the selection zeroes it
    again. Every row handed to a producer must then go through ``select_rows`` in the same stream.
    """
    return _zeroed("range", rows, 2, torch.device(device))


def use_split(rows: int, width: int) -> bool:
    """Whether :func:`select_rows` selects ``rows`` key rows of ``width`` positions in split mode by default:
    fewer than :data:`SPLIT_MAX_ROWS` rows at least :data:`SPLIT_MIN_WIDTH` wide (shapes only)."""
    return rows < SPLIT_MAX_ROWS and width >= SPLIT_MIN_WIDTH


def resolve_tuning(split: bool, block: int | None = None, bins: int | None = None, num_warps: int | None = None,
                   small_n: int | None = None, cand_bins: int | None = None,
                   small_warps: int | None = None) -> dict[str, int]:
    """The tuning of a selection mode: given values, else the mode's module defaults. Returns a dict with
    block, bins, num_warps, small_n (0 outside split mode), cand_bins, small_warps.
    Raises ValueError when block (power of two, 16..16384), bins or cand_bins (powers of two,
    32..MAX_BINS) or small_n (0 or a power of two, 16..16384) is out of range."""
    t = {"block": (SPLIT_BLOCK if split else BLOCK) if block is None else block,
         "bins": (SPLIT_BINS if split else BINS) if bins is None else bins,
         "num_warps": (SPLIT_NUM_WARPS if split else NUM_WARPS) if num_warps is None else num_warps,
         "small_n": (SPLIT_SMALL_N if split else 0) if small_n is None else small_n,
         "cand_bins": CAND_BINS if cand_bins is None else cand_bins,
         "small_warps": SPLIT_SMALL_NUM_WARPS if small_warps is None else small_warps}

    def pow2_in(x, lo, hi):
        return x & (x - 1) == 0 and lo <= x <= hi

    if not (pow2_in(t["block"], 16, 16384) and pow2_in(t["bins"], 32, MAX_BINS)
            and pow2_in(t["cand_bins"], 32, MAX_BINS)):
        raise ValueError(f"select_rows: block {t['block']}, bins {t['bins']} and cand_bins {t['cand_bins']} "
                         "must be powers of two in range")
    if not (t["small_n"] == 0 or pow2_in(t["small_n"], 16, 16384)):
        raise ValueError(f"select_rows: small_n {t['small_n']} must be 0 or a power of two in 16..16384")
    return t


#: split rows: programs per SM of one launch, spread over its rows (None: one program per segment). Each
#: program loops over the segments p, p + NP, ... of its row below the row's length, so a key width far
#: above the real lengths (CUDA-graph decode) costs about one wave of exiting programs, not S / SPLIT_BLOCK
#: per row
SPLIT_PROGRAMS_PER_SM: int | None = 2


def _select_split(keys, out, row0, topk, rows, rng, range_given, row_lens, block_b, t):
    R, S = keys.shape
    block = t["block"]
    P = triton.cdiv(S, block)
    NP = programs_per_row(R, P, keys.device, SPLIT_PROGRAMS_PER_SM)  # ~SPLIT_PROGRAMS_PER_SM waves
    dev = keys.device
    st = _zeroed("split", R, _ST_WIDTH + MAX_BINS, dev)
    seg = torch.empty((R, 3 * P), dtype=torch.int32, device=dev)
    cand = torch.empty((R, 2 * S), dtype=torch.int32, device=dev)
    meta = {"ROW_LENS": row_lens, "BLOCK_B": block_b, "BLOCK": block, "num_warps": t["num_warps"],
            "ALIGNED": S % 4 == 0 and keys.stride(0) % 4 == 0}
    lens, cu_q, seq_lens, num_seqs = rows
    if not range_given:
        _split_range_kernel[(R, NP)](keys, rng, lens, cu_q, seq_lens, num_seqs, row0, S, NP, keys.stride(0),
                                     rng.stride(0), **meta, **launch_pdl_args(keys.device))
    args = (*rows, row0, S, topk)
    meta.update(SMALL=t["small_n"], BINS=t["bins"])
    hist_meta = dict(meta, num_warps=t["small_warps"]) if t["small_n"] else meta
    _split_hist_kernel[(R, NP)](keys, rng, st, out, *args, NP, keys.stride(0), rng.stride(0), st.stride(0),
                                out.stride(0), CBINS=t["cand_bins"], **hist_meta,
                                **launch_pdl_args(keys.device))
    _split_compact_kernel[(R, NP)](keys, rng, st, seg, cand, *args, P, NP, keys.stride(0), rng.stride(0),
                                   st.stride(0), seg.stride(0), cand.stride(0), BLOCK_P=pow2(P, 32),
                                   CBLOCK=CAND_BLOCK, CBINS=t["cand_bins"], **meta,
                                   **launch_pdl_args(keys.device))
    _split_write_kernel[(R, NP)](keys, rng, st, seg, out, *args, P, NP, keys.stride(0), rng.stride(0),
                                 st.stride(0), seg.stride(0), out.stride(0), **meta,
                                 **launch_pdl_args(keys.device))


def select_rows(keys: torch.Tensor, out: torch.Tensor, row0: int, topk: int, *,
                lengths: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                seq_lens: torch.Tensor | None = None, split: bool | None = None,
                row_range: torch.Tensor | None = None, cuda: bool | None = None, **tuning) -> None:
    """Top-``topk`` positions of key rows ``keys[r]`` into ``out[row0 + r]`` (contract: module doc).

    keys: [R, S] int32 orderable keys (:func:`orderable_key`), last dim contiguous; out: [T, topk] int32,
    every slot of rows ``row0 .. row0+R-1`` is written. A row's valid length ``n`` is ``lengths[row0+r]``
    ([T] int32) when given, else the query position + 1 of step row ``row0 + r`` from ``cu_seqlens_q``
    ([B+1] int32) and ``seq_lens`` ([B] int32); it is clamped to [0, S]; no pass reads a position >= n.
    ``split``: one program per ``block`` positions of a row (3 launches; 4 without ``row_range``) instead
    of one program per row (1 launch); default :func:`use_split`. ``row_range``: [R, 2] int32 rows of
    :func:`row_range_buffer` into which the keys' producer folded each row's first n keys
    (:func:`accumulate_row_range`); zeroed again here. ``tuning`` (speed only; None or absent: the mode's
    module defaults, see :func:`resolve_tuning`): ``block`` (positions per chunk / per program), ``bins``
    (buckets of the first round), ``num_warps``, ``cand_bins`` (buckets of the register rounds), and in
    split mode ``small_n`` (rows with at most this many valid positions are selected whole by one program,
    in registers, in the first launch; 0: none) and ``small_warps`` (that launch's warps). ``cuda``: in
    one-program mode, whether the CUDA kernel (:mod:`atomtool.serve.ops.cuda.topk`, one CTA per row, rows up to
    its MAX_WIDTH keys) serves instead of the Triton one; None: when it is available (same bits either way:
    the selection is exact); True where it is not available raises RuntimeError.
    Raises ValueError on non-int32 / strided keys or out-of-range tuning; TypeError on unknown tuning.
    """
    R, S = keys.shape
    if split is None:
        split = use_split(R, S)
    t = resolve_tuning(split, **tuning)
    if R == 0 or topk == 0:
        if row_range is not None:
            row_range.zero_()  # nothing consumes it: keep the buffer's zero-between-calls contract
        return
    if keys.dtype != torch.int32 or keys.stride(-1) != 1:
        raise ValueError("select_rows: keys must be int32 with a contiguous last dim")
    row_lens = lengths is not None
    if row_lens:
        cu_seqlens_q = seq_lens = lengths  # unused by the kernels
    else:
        lengths = keys  # unused by the kernels
    block_b = 1 if row_lens else pow2(seq_lens.shape[0])
    range_given = row_range is not None
    rng = row_range if range_given else row_range_buffer(R, keys.device)
    rows = (lengths, cu_seqlens_q, seq_lens, seq_lens.shape[0])
    if split:
        _select_split(keys, out, row0, topk, rows, rng, range_given, row_lens, block_b, t)
        return
    if cuda is not False and _cuda_serves(keys, rows, row_lens, cuda):
        from atomtool.serve.ops.cuda.topk import select_rows_cuda

        select_rows_cuda(keys, out, row0, topk, rng, range_given, *rows[:3], row_lens,
                         pdl=bool(launch_pdl_args(keys.device)))
        return
    scratch = torch.empty((R, 2 * S), dtype=torch.int32, device=keys.device)  # candidates, then fewer
    _radix_topk_kernel[(R,)](
        keys, scratch, rng, out, *rows, row0, S, topk, keys.stride(0), scratch.stride(0), rng.stride(0),
        out.stride(0), ROW_LENS=row_lens, BLOCK_B=block_b, BLOCK=t["block"], BINS=t["bins"],
        CBLOCK=CAND_BLOCK, CBINS=t["cand_bins"], ALIGNED=S % 4 == 0 and keys.stride(0) % 4 == 0,
        RANGE_GIVEN=range_given, num_warps=t["num_warps"],
        **launch_pdl_args(keys.device),
    )


def _cuda_serves(keys: torch.Tensor, rows: tuple, row_lens: bool, cuda: bool | None) -> bool:
    """Whether the one-program selection of ``keys`` goes to the CUDA kernel (``cuda``: select_rows' argument;
    True raises RuntimeError where it cannot)."""
    ok = keys.is_cuda and not interpreting()
    lens, cu_q, seq_lens, _ = rows
    ok = ok and all(x.dtype == torch.int32 and x.is_contiguous() for x in ((lens,) if row_lens else (cu_q, seq_lens)))
    if ok:
        from atomtool.serve.ops.cuda.topk import available

        ok = available(keys.device, keys.shape[1])
    if cuda and not ok:
        raise RuntimeError("select_rows: the CUDA top-k kernel cannot serve these keys (needs a CUDA device of "
                           "compute capability >= 8.0 with nvcc, int32 row lengths, rows of at most 8192 keys, "
                           "ATOMTOOL_CUDA_TOPK not 0)")
    return ok


def topk_positions(keys: torch.Tensor, lengths: torch.Tensor, topk: int, **tuning) -> torch.Tensor:
    """Per row, the ``topk`` largest keys among its first ``lengths[t]`` positions, as positions.

    keys: [T, S] int32 orderable keys (:func:`orderable_keys`); lengths: [T] int32 (clamped to [0, S]).
    Returns [T, topk] int32 positions, ascending, -1 padded; ties go to the lowest position. ``tuning``:
    ``split`` and the tuning of :func:`select_rows`. Raises ValueError on non-int32 keys.
    """
    out = torch.empty((keys.shape[0], topk), dtype=torch.int32, device=keys.device)
    select_rows(keys, out, 0, topk, lengths=lengths, **tuning)
    return out
