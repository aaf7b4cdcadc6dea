"""DSA lightning-indexer scoring and deterministic top-k in Triton (DeepSeek-V3.2; research/dsa.md §5.2-5.3).

``I[t,s] = Σ_h weights[t,h] · ReLU(q[t,h] · k[s])`` over the paged index-key cache, for causal ``s``.
The scoring kernel writes, per (token, position), one int64 *sort key* ``(orderable(I) << 32) | (2^31-1-s)``
(invalid positions: INT64_MIN). Keys are unique per row, so ``torch.topk`` on them is deterministic
and breaks score ties toward the lowest position, exactly the reference's stable sort (dsa.md §5.6,
pitfall 12: ReLU plateaus of exact zeros). The selected positions are then listed in ascending order, -1
padded. All shapes come from tensor shapes (the key width is ``max_blocks * block_size``), so there is no
host sync and decode can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import dot_acc, dot_dtype, paged_rows, pow2, token_sequence

_INT64_MIN = -(2**63)
_POS_MAX = 2**31 - 1
#: bytes of sort keys one launch may hold; longer batches are scored in row chunks
_KEY_BUDGET = 1 << 30
#: the key of an invalid (non-causal / padding) position, below every real key
INVALID_KEY: tl.constexpr = tl.constexpr(_INT64_MIN)


@triton.jit
def _indexer_keys_kernel(
    q_ptr, w_ptr, k_ptr, key_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr,
    num_seqs, row0, Hi, Di, block_size, S,
    s_qt, s_qh, s_wt, s_kb, s_ks, s_bt, s_key,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    t = row0 + tl.program_id(0)
    nb = tl.program_id(1)
    b, qpos = token_sequence(t, cu_q_ptr, seq_lens_ptr, num_seqs, BLOCK_B)

    s = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    s_ok = s <= qpos
    t64 = t.to(tl.int64)
    key_row = key_ptr + tl.program_id(0).to(tl.int64) * s_key
    if nb * BLOCK_N > qpos:  # the whole block lies after the query: only invalid keys
        tl.store(key_row + s, tl.full([BLOCK_N], INVALID_KEY, tl.int64), mask=s < S)
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < Hi
    q = tl.load(q_ptr + t64 * s_qt + h[:, None].to(tl.int64) * s_qh + d[None, :],
                mask=h_ok[:, None] & (d[None, :] < Di), other=0.0)
    w = tl.load(w_ptr + t64 * s_wt + h, mask=h_ok, other=0.0).to(tl.float32)
    row = paged_rows(bt_ptr, b, s_bt, s, s_ok, block_size, s_kb, s_ks)
    k = tl.load(k_ptr + row[:, None] + d[None, :], mask=s_ok[:, None] & (d[None, :] < Di), other=0.0)
    logits = dot_acc(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT_DTYPE)
    score = tl.sum(w[:, None] * tl.maximum(logits, 0.0), axis=0)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: ties must compare equal as integers
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    key = (ordered << 32) | (2147483647 - s).to(tl.int64)
    key = tl.where(s_ok, key, tl.full([BLOCK_N], INVALID_KEY, tl.int64))
    tl.store(key_row + s, key, mask=s < S)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_k_cache: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 topk: int) -> torch.Tensor:
    """Indexer scores + deterministic top-k; same contract as ``torch_ref_mla.indexer_topk``.

    q: [T, Hi, Di]; weights: [T, Hi] float32 (all scales folded in); index_k_cache: [N, bs, Di];
    cu_seqlens_q: [B+1] int32; seq_lens: [B] int32; block_tables: [B, M] int32; topk: K.
    Returns [T, K] int32 request-local positions in ascending order, -1 padded.
    """
    T, Hi, Di = q.shape
    B = seq_lens.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    if T == 0 or B == 0:
        return out
    if q.stride(-1) != 1 or index_k_cache.stride(-1) != 1:
        raise ValueError("indexer_topk: q and index_k_cache need a contiguous last dim")
    block_size = index_k_cache.shape[1]
    S = block_tables.shape[1] * block_size  # widest possible context of this batch
    block_n = 64
    rows_per_chunk = max(1, _KEY_BUDGET // (8 * S))
    k_sel = min(topk, S)
    for row0 in range(0, T, rows_per_chunk):
        rows = min(rows_per_chunk, T - row0)
        keys = torch.empty((rows, S), dtype=torch.int64, device=q.device)
        _indexer_keys_kernel[(rows, triton.cdiv(S, block_n))](
            q, weights, index_k_cache, keys, cu_seqlens_q, seq_lens, block_tables,
            B, row0, Hi, Di, block_size, S,
            q.stride(0), q.stride(1), weights.stride(0), index_k_cache.stride(0), index_k_cache.stride(1),
            block_tables.stride(0), keys.stride(0),
            BLOCK_H=pow2(Hi, 16), BLOCK_D=pow2(Di, 16), BLOCK_N=block_n, BLOCK_B=pow2(B),
            DOT_DTYPE=dot_dtype(q.dtype), num_warps=4,
        )
        top = keys if k_sel == S else torch.topk(keys, k_sel, dim=1, sorted=False).values
        pos = _POS_MAX - (top & 0xFFFFFFFF)
        pos = torch.where(top == _INT64_MIN, _POS_MAX, pos)
        pos = torch.sort(pos, dim=1).values
        width = min(k_sel, topk)
        out[row0:row0 + rows, :width] = torch.where(pos == _POS_MAX, -1, pos)[:, :width].to(torch.int32)
    return out
