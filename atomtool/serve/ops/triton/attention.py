"""Paged causal attention for dense (GQA/MHA) models in Triton, plus the KV-cache store.

One kernel covers prefill (varlen, with a prefix-cache context), chunked prefill and decode: query token
j of sequence b sits at position ``seq_lens[b] - q_len_b + j`` and attends to cached positions <= its
own (FlashAttention-2 online softmax, Dao 2023, over a vLLM-style paged KV cache, Kwon et al. 2023).

Work split. Sequences with several new tokens (prefill, chunked prefill): program (q-block, kv head)
owns BLOCK_Q query tokens of one sequence times the G query heads that share the kv head, and walks that
sequence's keys in a fixed order (no split-KV). Decode rows (the only new token of their sequence): that
layout gives a batch-1 step only Hkv programs each walking the whole context (Qwen3 at 32k: 36 ms per
step), so they use split-KV (Flash-Decoding, Dao et al. 2023): programs (sequence, kv head, chunk) reduce
at most ``SPLIT_CHUNKS`` chunks of >= ``SPLIT_SPAN_MIN`` keys, cut from the row's own length, to partials
merged in chunk order (split_kv.py). Which path a row takes depends on its own sequence's query length only,
and neither path's arithmetic on the batch, so a row's result does not depend on the rest of the batch. The
grids are sized from tensor shapes only (``T // BLOCK_Q + B`` q-blocks; surplus programs exit), so the
launches need no host sync and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import (
    dot_acc,
    dot_dtype,
    grid_dependency_wait,
    launch_pdl_args,
    online_softmax_step,
    pow2,
)
from atomtool.serve.ops.triton.split_kv import chunk_span, merge_grid, split_kv_merge_kernel


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr,
    num_seqs, G, D, DV, block_size, sm_scale,
    s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ot, s_oh, s_bt,
    BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_B: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    grid_dependency_wait(USE_PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # which sequence owns this q-block: q-blocks of sequence b start at cu_q[b] // BLOCK_Q + b
    offs_b = tl.arange(0, BLOCK_B)
    cu = tl.load(cu_q_ptr + offs_b, mask=offs_b < num_seqs, other=1 << 30)
    starts = cu // BLOCK_Q + offs_b
    b = tl.sum((starts <= pid).to(tl.int32), axis=0) - 1
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    local = pid - (q_start // BLOCK_Q + b)
    if local * BLOCK_Q >= q_len:
        return
    if q_len == 1:  # a sequence's only new token (decode row): the split-KV kernels own it
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    r = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + r // G_PAD
    g = r % G_PAD
    row_ok = (tok < q_len) & (g < G)
    head = kvh * G + g
    qpos = ctx + tok
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_rows = (q_start + tok).to(tl.int64) * s_qt + head.to(tl.int64) * s_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    qk_scale = sm_scale * 1.4426950408889634  # log2(e): softmax through exp2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    dv = tl.arange(0, DV_PAD)
    dv_ok = dv < DV
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    end = tl.minimum(seq_len, ctx + tl.minimum(q_len, (local + 1) * BLOCK_Q))
    for n in range(0, end, BLOCK_N):
        s = n + tl.arange(0, BLOCK_N)
        s_ok = s < end
        blk = tl.load(bt_ptr + b.to(tl.int64) * s_bt + s // block_size, mask=s_ok, other=0).to(tl.int64)
        off = (s % block_size).to(tl.int64)
        kv_mask = s_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (blk * s_kb + off * s_ks + kvh * s_kh)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = dot_acc(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_DTYPE) * qk_scale
        ok = (s[None, :] <= qpos[:, None]) & s_ok[None, :]
        scores = tl.where(ok, scores, float("-inf"))
        p, alpha, m_new, l_i = online_softmax_step(scores, m_i, l_i)
        v = tl.load(v_ptr + (blk * s_vb + off * s_vs + kvh * s_vh)[:, None] + dv[None, :],
                    mask=s_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], DOT_DTYPE)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * s_ot + head.to(tl.int64) * s_oh
    tl.store(o_ptr + o_rows[:, None] + dv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dv_ok[None, :])


#: split-KV for decode rows: at most SPLIT_CHUNKS chunks of at least SPLIT_SPAN_MIN keys per row
#: (``split_kv.chunk_span``): constants, so a row's chunk boundaries depend only on its own length
SPLIT_SPAN_MIN = 256
SPLIT_CHUNKS = 32


@triton.jit
def _paged_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, ws_acc_ptr, ws_ml_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr,
    H, G, D, DV, block_size, sm_scale, n_chunks,
    s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_bt,
    SPAN_MIN: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # program (sequence b, kv head, chunk c): b's decode row, the G query heads of kv head kvh, over cached
    # positions [c * span, (c + 1) * span); writes (max, sum) and the unnormalized output (split_kv layout)
    grid_dependency_wait(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    c = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    if tl.load(cu_q_ptr + b + 1) - q_start != 1:  # not a decode row: the one-program kernel owns it
        return
    n_keys = tl.load(seq_lens_ptr + b)
    span = chunk_span(n_keys, n_chunks, SPAN_MIN)
    start = c * span
    if start >= n_keys:
        return
    end = tl.minimum(n_keys, start + span)

    g = tl.arange(0, G_PAD)
    g_ok = g < G
    head = kvh * G + g
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    dv = tl.arange(0, DV_PAD)
    dv_ok = dv < DV
    q = tl.load(q_ptr + q_start.to(tl.int64) * s_qt + head[:, None].to(tl.int64) * s_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    for n in range(start, end, BLOCK_N):
        s = n + tl.arange(0, BLOCK_N)
        s_ok = s < end
        blk = tl.load(bt_ptr + b.to(tl.int64) * s_bt + s // block_size, mask=s_ok, other=0).to(tl.int64)
        off = (s % block_size).to(tl.int64)
        k = tl.load(k_ptr + (blk * s_kb + off * s_ks + kvh * s_kh)[:, None] + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        scores = dot_acc(q, tl.trans(k), tl.zeros([G_PAD, BLOCK_N], tl.float32), DOT_DTYPE) * qk_scale
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        p, alpha, m_new, l_i = online_softmax_step(scores, m_i, l_i)
        v = tl.load(v_ptr + (blk * s_vb + off * s_vs + kvh * s_vh)[:, None] + dv[None, :],
                    mask=s_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], DOT_DTYPE)
        m_i = m_new
    base = (b.to(tl.int64) * n_chunks + c) * H + head.to(tl.int64)
    tl.store(ws_acc_ptr + base[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None] & dv_ok[None, :])
    tl.store(ws_ml_ptr + base * 2, m_i, mask=g_ok)
    tl.store(ws_ml_ptr + base * 2 + 1, l_i, mask=g_ok)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of new query tokens over a paged KV cache.

    q: [T, H, D]; k_cache: [num_blocks, block_size, Hkv, D]; v_cache: [..., Hkv, Dv] (H % Hkv == 0); cu_seqlens_q: [B+1]
    int32; seq_lens: [B] int32 (cached + new tokens); block_tables: [B, max_blocks] int32; scale: softmax
    scale. Returns [T, H, Dv] in q's dtype. The KV of the new tokens must already be stored (store_kv).
    """
    T, H, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    Dv = v_cache.shape[-1]
    if H % Hkv or Dk != D or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    B = seq_lens.shape[0]
    out = q.new_empty(T, H, Dv)
    if T == 0 or B == 0:
        return out
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_attention: last dims must be contiguous")
    G = H // Hkv
    g_pad = pow2(G)
    dot = dot_dtype(q.dtype)
    block_n = 32 if max(pow2(D), pow2(Dv)) > 128 else 64
    if T > B:  # some sequence has several new tokens (prefill): one program per (q-block, kv head)
        # one tile shape for every batch: a row's arithmetic never depends on the batch mix
        block_q = max(1, 64 // g_pad)
        grid = (T // block_q + B, Hkv)
        _paged_attn_kernel[grid](
            q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
            B, G, D, Dv, block_size, float(scale),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
            block_tables.stride(0),
            BLOCK_Q=block_q, G_PAD=g_pad, BLOCK_N=block_n, D_PAD=pow2(D, 16), DV_PAD=pow2(Dv, 16),
            BLOCK_B=pow2(B), DOT_DTYPE=dot, num_warps=4,
            **launch_pdl_args(q.device),
        )
    # decode rows (all rows when T == B): split-KV + ordered merge (split_kv.py)
    ws_acc = torch.empty((B, SPLIT_CHUNKS, H, Dv), dtype=torch.float32, device=q.device)
    ws_ml = torch.empty((B, SPLIT_CHUNKS, H, 2), dtype=torch.float32, device=q.device)
    _paged_attn_split_kernel[(B, Hkv, SPLIT_CHUNKS)](
        q, k_cache, v_cache, ws_acc, ws_ml, cu_seqlens_q, seq_lens, block_tables,
        H, G, D, Dv, block_size, float(scale), SPLIT_CHUNKS,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        SPAN_MIN=SPLIT_SPAN_MIN, G_PAD=max(g_pad, 16), BLOCK_N=block_n, D_PAD=pow2(D, 16), DV_PAD=pow2(Dv, 16),
        DOT_DTYPE=dot, num_warps=4,
        **launch_pdl_args(q.device),
    )
    grid, merge_h, merge_d = merge_grid(B, H, Dv)
    split_kv_merge_kernel[grid](
        ws_acc, ws_ml, out, cu_seqlens_q, seq_lens, H, Dv, 0, SPLIT_CHUNKS, out.stride(0), out.stride(1),
        SPARSE=False, SPAN_MIN=SPLIT_SPAN_MIN, BLOCK_H=merge_h, BLOCK_D=merge_d, EMPTY_IS_ZERO=True,
        num_warps=4,
        **launch_pdl_args(ws_acc.device),
    )
    return out


@triton.jit
def _store_cache_kernel(x_ptr, c_ptr, slot_ptr, N, s_xt, s_cs, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token (e.g. a CUDA-graph batch padded up to its captured size)
        return
    for c in range(0, N, BLOCK):
        i = c + tl.arange(0, BLOCK)
        m = i < N
        x = tl.load(x_ptr + t.to(tl.int64) * s_xt + i, mask=m)
        tl.store(c_ptr + slot * s_cs + i, x.to(c_ptr.dtype.element_ty), mask=m)


def store_cache(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write per-token entries into one paged cache plane in place; same contract as ``torch_ref.store_cache``.

    x: [T, *shape]; cache: [N, bs, *shape] (contiguous; x is cast to its dtype); slot_mapping: [T] int
    (``block_id * bs + offset``; a negative slot skips the token).
    """
    T = x.shape[0]
    if T == 0:
        return
    if not cache.is_contiguous():
        raise ValueError("store_cache: the cache plane must be contiguous")
    x2 = x.reshape(T, -1)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    N = x2.shape[1]
    per_slot = cache[0, 0].numel()
    if N != per_slot:
        raise ValueError(f"store_cache: token entry {tuple(x.shape[1:])} does not fit cache {tuple(cache.shape)}")
    _store_cache_kernel[(T,)](x2, cache, slot_mapping, N, x2.stride(0), per_slot, BLOCK=min(pow2(N), 2048),
                              **launch_pdl_args(x2.device))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the step's keys and values into the paged K/V planes in place (``torch_ref.store_kv``).

    k: [T, Hkv, D]; v: [T, Hkv, Dv]; k_cache: [N, bs, Hkv, D]; v_cache: [N, bs, Hkv, Dv]; slot_mapping: [T].
    """
    store_cache(k, k_cache, slot_mapping)
    store_cache(v, v_cache, slot_mapping)
