"""DSA lightning-indexer scoring and deterministic top-k in Triton (DeepSeek-V3.2; research/dsa.md §5.2-5.3).

``I[t,s] = Σ_h weights[t,h] · ReLU(q[t,h] · k[s])`` over the paged index-key cache, for causal ``s``.
The scoring kernel writes, per (token, causally valid position), one int32 *orderable key* of the score
(:func:`atomtool.serve.ops.triton.topk.orderable_key`: unsigned order = float order, -0.0 == +0.0, so
equal scores have equal keys). The radix-select kernel of :mod:`~atomtool.serve.ops.triton.topk` then
picks, per row, the top-K keys among positions ``0..pos(t)``, ties toward the lowest position, exactly
the reference's stable sort (dsa.md §5.6, pitfall 12: ReLU plateaus of exact zeros), and writes them in
ascending position order, -1 padded. Per row chunk: the scoring launch (which also folds each row's key
range into a persistent accumulator, so the selection needs no pass for it), then one selection launch (many
rows) or three (few wide rows, split across programs; short rows still selected whole by one program). No
host sync: all shapes come from tensor shapes (the key width is ``max_blocks * block_size``, the padded
block table's), and the work follows each row's real length, so decode can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.torch_ref_mla import check_query_rope
from atomtool.serve.ops.triton._common import (
    dot_acc,
    dot_dtype,
    grid_dependency_wait,
    launch_pdl_args,
    paged_rows,
    pow2,
    programs_per_row,
    token_sequence,
)
from atomtool.serve.ops.triton.topk import (
    fold_row_range,
    orderable_key,
    resolve_tuning,
    row_range_buffer,
    select_rows,
    use_split,
)

#: bytes of keys + selection scratch one launch may hold (12 per position); longer batches go in row chunks
_KEY_BUDGET = 1 << 30


#: scoring programs per SM of one launch (spread over its rows); None: one program per block of positions
INDEXER_PROGRAMS_PER_SM: int | None = 2


@triton.jit
def _load_query_rope(q_ptr, t64, h, d, h_ok, Di, s_qt, s_qh, cos_ptr, sin_ptr, s_ct, s_st, half,
                     ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Token t's index queries [BLOCK_H, BLOCK_D], with ROPE their first ``2 * half`` dims rotated as
    ``fused_rope.indexer_rope_store`` rotates them (float32, the same two expressions, one rounding to q's
    dtype), so the scores are bitwise those of the rotated queries that op would store."""
    rows = q_ptr + t64 * s_qt + h[:, None].to(tl.int64) * s_qh
    ok = h_ok[:, None] & (d[None, :] < Di)
    q = tl.load(rows + d[None, :], mask=ok, other=0.0)
    if ROPE:
        if INTERLEAVED:  # pairs (2i, 2i + 1)
            i = d // 2
            first = (d % 2) == 0
            partner = tl.where(first, d + 1, d - 1)
        else:  # pairs (i, i + half)
            first = d < half
            i = tl.where(first, d, d - half)
            partner = tl.where(first, d + half, d - half)
        rot = d < 2 * half
        c = tl.load(cos_ptr + t64 * s_ct + i, mask=rot, other=0.0).to(tl.float32)[None, :]
        sn = tl.load(sin_ptr + t64 * s_st + i, mask=rot, other=0.0).to(tl.float32)[None, :]
        x = q.to(tl.float32)
        xp = tl.load(rows + partner[None, :], mask=ok & rot[None, :], other=0.0).to(tl.float32)
        rotated = tl.where(first[None, :], x * c - xp * sn, x * c + xp * sn).to(q.dtype)
        q = tl.where(rot[None, :], rotated, q)
    return q


@triton.jit
def _indexer_keys_kernel(
    q_ptr, w_ptr, k_ptr, key_ptr, rng_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr, cos_ptr, sin_ptr,
    num_seqs, row0, Hi, Di, block_size, S, nprog, half,
    s_qt, s_qh, s_wt, s_kb, s_ks, s_bt, s_key, s_rng, s_ct, s_st,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ROPE: tl.constexpr = False, INTERLEAVED: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    grid_dependency_wait(USE_PDL)
    t = row0 + tl.program_id(0)
    b, qpos = token_sequence(t, cu_q_ptr, seq_lens_ptr, num_seqs, BLOCK_B)
    n = tl.minimum(qpos + 1, S)  # causally valid positions: the selection reads no key past them
    nblocks = tl.cdiv(n, BLOCK_N)
    if tl.program_id(1) >= nblocks:  # every block of this program lies after the query
        return
    t64 = t.to(tl.int64)
    key_row = key_ptr + tl.program_id(0).to(tl.int64) * s_key
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < Hi
    q = _load_query_rope(q_ptr, t64, h, d, h_ok, Di, s_qt, s_qh, cos_ptr, sin_ptr, s_ct, s_st, half, ROPE,
                         INTERLEAVED)
    w = tl.load(w_ptr + t64 * s_wt + h, mask=h_ok, other=0.0).to(tl.float32)
    inv_lo = tl.zeros([BLOCK_N], tl.uint32)  # running max of ~key: ~(min key)
    hi = tl.zeros([BLOCK_N], tl.uint32)
    for nb in range(tl.program_id(1), nblocks, nprog):
        s = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        s_ok = s < n
        row = paged_rows(bt_ptr, b, s_bt, s, s_ok, block_size, s_kb, s_ks)
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=s_ok[:, None] & (d[None, :] < Di), other=0.0)
        logits = dot_acc(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT_DTYPE)
        score = tl.sum(w[:, None] * tl.maximum(logits, 0.0), axis=0)
        keys = orderable_key(score)
        tl.store(key_row + s, keys, mask=s_ok)
        u = keys.to(tl.uint32, bitcast=True)
        inv_lo = tl.maximum(inv_lo, tl.where(s_ok, u ^ 0xFFFFFFFF, 0))
        hi = tl.maximum(hi, tl.where(s_ok, u, 0))
    # the row's key range, so the selection skips a pass over the row (it zeroes the accumulator again)
    fold_row_range(rng_ptr + tl.program_id(0).to(tl.int64) * s_rng, tl.max(inv_lo, axis=0), tl.max(hi, axis=0))


def indexer_keys(q: torch.Tensor, weights: torch.Tensor, index_k_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor, row0: int, rows: int,
                 rng: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                 interleaved: bool = False) -> torch.Tensor:
    """The scoring launch alone: int32 orderable keys [rows, S] of step rows ``row0 .. row0+rows-1`` (S = the
    block table's width x block size; only each row's first n positions are written) and each row's key
    range folded into ``rng`` ([rows, 2] rows of ``row_range_buffer``, which the caller must hand to
    ``select_rows`` or zero). Inputs as :func:`indexer_topk` (contiguous last dims; cos / sin [T, R/2]
    contiguous or None)."""
    T, Hi, Di = q.shape
    B = seq_lens.shape[0]
    block_size = index_k_cache.shape[1]
    S = block_tables.shape[1] * block_size
    block_n = 64
    keys = torch.empty((rows, S), dtype=torch.int32, device=q.device)
    # scoring programs per row: about one wave over all rows, each looping over its row's blocks below the
    # row's length, so a key width far above the real context costs one wave of exiting programs
    nprog = programs_per_row(rows, triton.cdiv(S, block_n), q.device, INDEXER_PROGRAMS_PER_SM)
    half = 0 if cos is None else cos.shape[-1]
    tab_c, tab_s = (cos, sin) if half else (weights, weights)  # dummy pointers when there is no rope
    _indexer_keys_kernel[(rows, nprog)](
        q, weights, index_k_cache, keys, rng, cu_seqlens_q, seq_lens, block_tables, tab_c, tab_s,
        B, row0, Hi, Di, block_size, S, nprog, half,
        q.stride(0), q.stride(1), weights.stride(0), index_k_cache.stride(0), index_k_cache.stride(1),
        block_tables.stride(0), keys.stride(0), rng.stride(0), tab_c.stride(0), tab_s.stride(0),
        BLOCK_H=pow2(Hi, 16), BLOCK_D=pow2(Di, 16), BLOCK_N=block_n, BLOCK_B=pow2(B),
        DOT_DTYPE=dot_dtype(q.dtype), ROPE=half > 0, INTERLEAVED=bool(interleaved), num_warps=4,
        **launch_pdl_args(q.device),
    )
    return keys


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_k_cache: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 topk: int, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                 interleaved: bool = False, **tuning) -> torch.Tensor:
    """Indexer scores + deterministic top-k; same contract as ``torch_ref_mla.indexer_topk``.

    q: [T, Hi, Di]; weights: [T, Hi] float32 (all scales folded in); index_k_cache: [N, bs, Di];
    cu_seqlens_q: [B+1] int32; seq_lens: [B] int32; block_tables: [B, M] int32; topk: K; cos / sin:
    [T, R/2] rotary tables or None (q given unrotated: the scoring kernel rotates its first R dims per head as
    it loads them, bitwise as ``indexer_rope_store`` would: the engine's path, which saves that op's work on
    the indexer branch before sparse attention).
    ``tuning``: ``split`` and the tuning of :func:`~atomtool.serve.ops.triton.topk.select_rows`
    (benchmarks; default: the module's choice).
    Returns [T, K] int32 request-local positions in ascending order, -1 padded.
    Raises ValueError when q or index_k_cache has a strided last dim or the tuning is out of range.
    """
    check_query_rope(q, cos, sin)
    T = q.shape[0]
    B = seq_lens.shape[0]
    if T == 0 or B == 0 or topk == 0:
        return torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    if q.stride(-1) != 1 or index_k_cache.stride(-1) != 1:
        raise ValueError("indexer_topk: q and index_k_cache need a contiguous last dim")
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((T, topk), dtype=torch.int32, device=q.device)  # the selection writes every slot
    S = block_tables.shape[1] * index_k_cache.shape[1]  # widest possible context of this batch
    rows_per_chunk = max(1, _KEY_BUDGET // (12 * S))
    split = tuning.get("split")
    # errors before any key range is accumulated (the range buffer must be consumed once filled)
    resolve_tuning(use_split(min(T, rows_per_chunk), S) if split is None else split,
                   **{k: v for k, v in tuning.items() if k not in ("split", "cuda")})
    for row0 in range(0, T, rows_per_chunk):
        rows = min(rows_per_chunk, T - row0)
        rng = row_range_buffer(rows, q.device)
        keys = indexer_keys(q, weights, index_k_cache, cu_seqlens_q, seq_lens, block_tables, row0, rows, rng,
                            cos, sin, interleaved)
        select_rows(keys, out, row0, topk, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, row_range=rng, **tuning)
    return out
