"""MLA attention (absorbed form) over the paged latent cache, dense-causal or DSA-sparse, in Triton.

Follows DeepSeek-V2 §2.1 (absorbed MLA) and DeepSeek-V3.2's sparse attention (research/dsa.md §5.1, §5.4):
every query head attends to the one shared latent row ``[c_kv | k_pe]`` of each token,
``logit = scale * (q_nope_absorbed · c_kv + q_pe · k_pe)`` and ``out = Σ softmax(logit) c_kv`` (times W_UV
per head when the caller passes ``w_uv``). With ``topk_indices`` a query attends only to the positions its
indexer selected (-1 = padding), still causally.

Work split. Query rows of a sequence with more than one new token (prefill, chunked prefill): one
program per (query token, block of heads) walks that token's keys (all causal positions, or its top-k list)
in a fixed order with an online softmax (no split-KV, dsa.md §5.6). Decode rows (the only new token of
their sequence): that layout gives a batch-1 step H / BLOCK_H programs, each walking 2048 keys serially,
so decode rows use split-KV (Flash-Decoding, Dao et al. 2023): programs (sequence, block of heads, chunk)
each reduce a chunk of the row's key list (``SPLIT_CHUNK_SPARSE`` top-k entries; dense: at most
``SPLIT_CHUNKS_DENSE`` chunks of >= ``SPLIT_SPAN_DENSE`` positions) to (max, sum, unnormalized output)
partials (on CUDA devices, for bf16 models with kv_lora_rank 512, rope 64 and heads a multiple of 32, by the
CUDA kernel of :mod:`atomtool.serve.ops.cuda.mla_split`), and a second kernel merges the row's chunks in chunk order: ``split_kv_merge_kernel`` (split_kv.py)
for the latent output, or with ``w_uv`` :func:`_mla_merge_uv_kernel`, which also multiplies each merged head
row by W_UV (multi-token rows: ``torch_ref_mla.mla_output_uv``; on CUDA devices, for bf16 models with
kv_lora_rank 512 and v_head_dim 128, the CUDA kernel of :mod:`atomtool.serve.ops.cuda.mla_merge_uv` instead,
whichever the batch). The chunk boundaries
depend only on the row's own key count, and which path a row takes only on its own sequence's query
length, so a row's result is deterministic and does not depend on the rest of the batch. Grids sized from
shapes only: CUDA-graph capturable. Workspace: B x chunks x H x (R + 2) float32 per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.torch_ref_mla import HeadWeights, check_mla_w_uv, head_weight_tensor, mla_output_uv
from atomtool.serve.ops.triton._common import (
    dot_acc,
    dot_dtype,
    grid_dependency_wait,
    interpreting,
    launch_pdl_args,
    online_softmax_step,
    paged_rows,
    pow2,
    token_sequence,
)
from atomtool.serve.ops.triton.split_kv import chunk_span, merge_grid, split_kv_merge_kernel


@triton.jit
def _load_query(qn_ptr, qp_ptr, t64, h, h_ok, r, r_ok, p, p_ok, s_qnt, s_qnh, s_qpt, s_qph):
    """Query row t64's absorbed no-rope part [BLOCK_H, R_PAD] and rope part [BLOCK_H, P_PAD] for heads h."""
    qn = tl.load(qn_ptr + t64 * s_qnt + h[:, None].to(tl.int64) * s_qnh + r[None, :],
                 mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    qp = tl.load(qp_ptr + t64 * s_qpt + h[:, None].to(tl.int64) * s_qph + p[None, :],
                 mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    return qn, qp


@triton.jit
def _attend_keys(lat_ptr, row, s_ok, qn, qp, r, r_ok, p, p_ok, R, qk_scale, m_i, l_i, acc,
                 BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One block of keys (latent rows ``row`` [BLOCK_N], valid where ``s_ok``) folded into the online softmax
    (m_i, l_i, acc): scores = (q_nope . c + q_pe . k_pe) * scale over the latent c = [.., :R] and rope key
    [.., R:R+P], then acc += softmax weights @ c (the latent is also the value in absorbed MLA)."""
    c = tl.load(lat_ptr + row[:, None] + r[None, :], mask=s_ok[:, None] & r_ok[None, :], other=0.0)
    pe = tl.load(lat_ptr + row[:, None] + R + p[None, :], mask=s_ok[:, None] & p_ok[None, :], other=0.0)
    scores = dot_acc(qn, tl.trans(c), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT_DTYPE)
    scores = dot_acc(qp, tl.trans(pe), scores, DOT_DTYPE) * qk_scale
    scores = tl.where(s_ok[None, :], scores, float("-inf"))
    prob, alpha, m_new, l_i = online_softmax_step(scores, m_i, l_i)
    acc = dot_acc(prob.to(c.dtype), c, acc * alpha[:, None], DOT_DTYPE)
    return m_new, l_i, acc


@triton.jit
def _mla_kernel(
    qn_ptr, qp_ptr, lat_ptr, o_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr, topk_ptr,
    num_seqs, H, R, P, K, block_size, sm_scale,
    s_qnt, s_qnh, s_qpt, s_qph, s_lb, s_ls, s_ot, s_oh, s_bt, s_tk,
    SPARSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
    P_PAD: tl.constexpr, BLOCK_B: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    grid_dependency_wait(USE_PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    b, qpos = token_sequence(t, cu_q_ptr, seq_lens_ptr, num_seqs, BLOCK_B)
    if tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b) == 1:  # decode row: the split-KV kernels own it
        return

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    r = tl.arange(0, R_PAD)
    r_ok = r < R
    p = tl.arange(0, P_PAD)
    p_ok = p < P
    t64 = t.to(tl.int64)
    qn, qp = _load_query(qn_ptr, qp_ptr, t64, h, h_ok, r, r_ok, p, p_ok, s_qnt, s_qnh, s_qpt, s_qph)

    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    if SPARSE:
        n_keys = K
    else:
        n_keys = qpos + 1
    for n in range(0, n_keys, BLOCK_N):
        j = n + tl.arange(0, BLOCK_N)
        if SPARSE:
            s = tl.load(topk_ptr + t64 * s_tk + j, mask=j < K, other=-1)
            s_ok = (j < K) & (s >= 0) & (s <= qpos)
            s = tl.where(s_ok, s, 0)
        else:
            s = j
            s_ok = j <= qpos
        row = paged_rows(bt_ptr, b, s_bt, s, s_ok, block_size, s_lb, s_ls)
        m_i, l_i, acc = _attend_keys(lat_ptr, row, s_ok, qn, qp, r, r_ok, p, p_ok, R, qk_scale, m_i, l_i, acc,
                                     BLOCK_H, BLOCK_N, DOT_DTYPE)
    out = acc / l_i[:, None]  # a token with no selected key gets NaN, like the reference's softmax
    tl.store(o_ptr + t64 * s_ot + h[:, None].to(tl.int64) * s_oh + r[None, :], out.to(o_ptr.dtype.element_ty),
             mask=h_ok[:, None] & r_ok[None, :])


#: split-KV for decode rows: sparse rows cut their top-k list into chunks of 128 entries; dense rows cut their
#: causal positions into at most SPLIT_CHUNKS_DENSE chunks of at least SPLIT_SPAN_DENSE keys
#: (``split_kv.chunk_span``). Constants, so a row's chunk boundaries never depend on the batch.
SPLIT_CHUNK_SPARSE = 128
SPLIT_SPAN_DENSE = 256
SPLIT_CHUNKS_DENSE = 32


@dataclass(frozen=True)
class MlaDecodeConfig:
    """Launch options of the split-KV decode kernel for wide bf16/fp16 latents (kv_lora_rank >= 256, e.g.
    DeepSeek's 512); float32 inputs use 16 x 32 tiles (the H200's 227 KB of shared memory).

    block_h: query heads per program; block_n: keys per inner step; num_warps / num_stages: Triton options.
    None of them changes a row's chunking, so a row's bits do not depend on them beyond the dot's tile shape,
    which is fixed for every batch. Tuned with ``python -m benchmarks.kernel_sweep --only mla`` on an H200
    (128 heads, top-k 2048 of 4096, split + merge kernel, before the W_UV fusion): this default 28.3 us at batch
    1 and 62.8 us at batch 8; the former (16, 32, 4 warps) 26.4 / 108.0 us; the batch-1 best (16, 64, 8 warps)
    22.2 / 125.0 us. Session 6 (split + fused merge + W_UV): this default 30.9 / 70.4 / 467 us at batch 1 / 8 /
    64, the batch-1 best (16, 64, 8 warps, 128-key chunks) 25.2 us but slower than 97 us at batch 8.
    """

    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


#: the configuration every call uses (the sweep benchmark replaces it to compare candidates)
MLA_DECODE_CONFIG = MlaDecodeConfig()


@triton.jit
def _mla_split_kernel(
    qn_ptr, qp_ptr, lat_ptr, ws_acc_ptr, ws_ml_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr, topk_ptr,
    H, R, P, K, block_size, sm_scale, n_chunks,
    s_qnt, s_qnh, s_qpt, s_qph, s_lb, s_ls, s_bt, s_tk,
    SPARSE: tl.constexpr, SPAN_MIN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr, P_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # program (sequence b, head block, chunk c): the decode row of b over keys [c * span, (c + 1) * span) of
    # its key list. Writes ws_acc[b, c, h, :R] (unnormalized), ws_ml[b, c, h, 0 / 1] = (max, sum), log2 units.
    grid_dependency_wait(USE_PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    c = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    if tl.load(cu_q_ptr + b + 1) - q_start != 1:  # not a decode row: the one-program kernel owns it
        return
    t64 = q_start.to(tl.int64)
    qpos = tl.load(seq_lens_ptr + b) - 1
    if SPARSE:
        n_keys = K
    else:
        n_keys = qpos + 1
    span = chunk_span(n_keys, n_chunks, SPAN_MIN)
    start = c * span
    if start >= n_keys:  # past this row's last chunk: the merge never reads it
        return
    end = tl.minimum(n_keys, start + span)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    r = tl.arange(0, R_PAD)
    r_ok = r < R
    p = tl.arange(0, P_PAD)
    p_ok = p < P
    qn, qp = _load_query(qn_ptr, qp_ptr, t64, h, h_ok, r, r_ok, p, p_ok, s_qnt, s_qnh, s_qpt, s_qph)
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    for n in range(start, end, BLOCK_N):
        j = n + tl.arange(0, BLOCK_N)
        j_ok = j < end
        if SPARSE:
            s = tl.load(topk_ptr + t64 * s_tk + j, mask=j_ok, other=-1)
            s_ok = j_ok & (s >= 0) & (s <= qpos)
            s = tl.where(s_ok, s, 0)
        else:
            s = j
            s_ok = j_ok
        row = paged_rows(bt_ptr, b, s_bt, s, s_ok, block_size, s_lb, s_ls)
        m_i, l_i, acc = _attend_keys(lat_ptr, row, s_ok, qn, qp, r, r_ok, p, p_ok, R, qk_scale, m_i, l_i, acc,
                                     BLOCK_H, BLOCK_N, DOT_DTYPE)
    base = (b.to(tl.int64) * n_chunks + c) * H + h.to(tl.int64)
    tl.store(ws_acc_ptr + base[:, None] * R + r[None, :], acc, mask=h_ok[:, None] & r_ok[None, :])
    tl.store(ws_ml_ptr + base * 2, m_i, mask=h_ok)
    tl.store(ws_ml_ptr + base * 2 + 1, l_i, mask=h_ok)


#: rows per program of the fused merge + W_UV kernel and of the W_UK absorb (the dot's tile height: one value for
#: every batch, so a row's bits never depend on its batch) and latent features per step of their W products
MERGE_UV_BLOCK_M = 16
MERGE_UV_BLOCK_R = 128
#: latent blocks of a head's W_UV / W_UK the kernels load before their PDL wait (held in registers while the
#: previous kernel runs; DeepSeek's 512-wide latent is 4 blocks of 128); further blocks load after the wait
PRELOAD_R_BLOCKS: tl.constexpr = tl.constexpr(4)
#: row blocks of MERGE_UV_BLOCK_M rows one absorb program walks (its W_UK stays in registers across them)
ABSORB_ROW_BLOCKS = 16


@triton.jit
def _head_tile(w_ptr, s_ptr, h, rows, rows_ok, rb, R, s_wh, s_wr, s_sh, s_sr, bk,
               BLOCK_R: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Head h's weight rows ``rows`` x latent columns [rb * BLOCK_R, + BLOCK_R), as stored (FP8 or the model
    dtype; zero outside), and the rows' scales of that column block ([rows], FP8 only; the block lies within
    one scale block: BLOCK_R divides bk). Immutable data: may be loaded before the PDL wait."""
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.load(w_ptr + h.to(tl.int64) * s_wh + rows[:, None] * s_wr + r[None, :],
                mask=rows_ok[:, None] & (r < R)[None, :], other=0.0)
    if HAS_SCALE:
        sc = tl.load(s_ptr + h.to(tl.int64) * s_sh + rows * s_sr + (rb * BLOCK_R) // bk, mask=rows_ok, other=0.0)
    else:
        sc = tl.zeros_like(rows).to(tl.float32)
    return w, sc


@triton.jit
def _widen(w, sc, OUT: tl.constexpr, HAS_SCALE: tl.constexpr):
    """A :func:`_head_tile` tile in the model dtype: ``fp8 * scale`` rounded once from float32 (the
    ``dequant_fp8_block`` formula, so the same values as the dequantized weight), or the tile itself."""
    if HAS_SCALE:
        w = (w.to(tl.float32) * sc[:, None]).to(OUT)
    return w


@triton.jit
def _merge_uv_block(out, w, sc, rb, ws_acc_ptr, ws_ml_ptr, row0, n_row, m_safe, l_all, dec, H, R,
                    N_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    OUT: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Latent block rb of the merge (chunk partials in chunk order, rounded to the model dtype as the unfused
    merge stores o_lat) times that block of W_UV, accumulated into ``out`` [BLOCK_M, DV_PAD]."""
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for c in tl.static_range(N_CHUNKS):
        rc = row0 + c * H
        ok = c < n_row
        wgt = tl.exp2(tl.load(ws_ml_ptr + rc * 2, mask=ok, other=float("-inf")) - m_safe)
        acc += wgt[:, None] * tl.load(ws_acc_ptr + rc[:, None] * R + r[None, :], mask=ok[:, None] & r_ok[None, :],
                                      other=0.0)
    o_lat = tl.where(dec[:, None], acc / l_all[:, None], 0.0).to(OUT)
    return dot_acc(o_lat, tl.trans(_widen(w, sc, OUT, HAS_SCALE)), out, DOT_DTYPE)


@triton.jit
def _mla_merge_uv_kernel(
    ws_acc_ptr, ws_ml_ptr, w_ptr, s_ptr, o_ptr, cu_q_ptr, seq_lens_ptr, B, H, R, DV, K, bk,
    s_wh, s_wv, s_sh, s_sv, s_ot, s_oh,
    SPARSE: tl.constexpr, SPAN_MIN: tl.constexpr, N_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, N_RB: tl.constexpr, DV_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # program (block of BLOCK_M sequences, head h): the split-KV merge of split_kv_merge_kernel for each decode
    # row (same per-element formula and chunk order, so o_lat has the same bits), rounded to the output dtype
    # as the unfused path stores it, then o[row, h] = W_UV[h] @ o_lat[row, h] accumulated over BLOCK_R steps.
    # The chunk loops are unrolled (N_CHUNKS is a compile-time constant), so a step's chunk loads are all in
    # flight at once: a rolled loop waits one memory round trip per chunk, which made this kernel slower than
    # the two it replaces at batch 1. num_stages=1: pipelining the R loop would stage every unrolled chunk
    # load in shared memory (332 KB for 16 chunks, over the H200's 227 KB; sm90 SASS: no spills at 1).
    # W_UV is immutable: the head's first PRELOAD_R_BLOCKS latent blocks are loaded into registers before the
    # PDL wait, while the split kernel runs (latency-bound, the memory mostly idle), so after the wait only
    # the chunk partials are fetched (an L2 prefetch hint instead left ~10 us of W_UV reads after the wait).
    h = tl.program_id(1)
    v = tl.arange(0, DV_PAD)
    v_ok = v < DV
    OUT: tl.constexpr = o_ptr.dtype.element_ty
    w0, s0 = _head_tile(w_ptr, s_ptr, h, v, v_ok, 0, R, s_wh, s_wv, s_sh, s_sv, bk, BLOCK_R, HAS_SCALE)
    if N_RB > 1:
        w1, s1 = _head_tile(w_ptr, s_ptr, h, v, v_ok, 1, R, s_wh, s_wv, s_sh, s_sv, bk, BLOCK_R, HAS_SCALE)
    else:
        w1, s1 = w0, s0
    if N_RB > 2:
        w2, s2 = _head_tile(w_ptr, s_ptr, h, v, v_ok, 2, R, s_wh, s_wv, s_sh, s_sv, bk, BLOCK_R, HAS_SCALE)
    else:
        w2, s2 = w0, s0
    if N_RB > 3:
        w3, s3 = _head_tile(w_ptr, s_ptr, h, v, v_ok, 3, R, s_wh, s_wv, s_sh, s_sv, bk, BLOCK_R, HAS_SCALE)
    else:
        w3, s3 = w0, s0
    grid_dependency_wait(USE_PDL)
    b = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    b_ok = b < B
    q_start = tl.load(cu_q_ptr + b, mask=b_ok, other=0)
    dec = b_ok & (tl.load(cu_q_ptr + b + 1, mask=b_ok, other=0) - q_start == 1)
    if SPARSE:
        n_keys = tl.zeros([BLOCK_M], tl.int32) + K
    else:
        n_keys = tl.load(seq_lens_ptr + b, mask=dec, other=0)
    span = chunk_span(n_keys, N_CHUNKS, SPAN_MIN)
    n_row = tl.where(dec, (n_keys + span - 1) // span, 0)
    row0 = b.to(tl.int64) * N_CHUNKS * H + h
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for c in tl.static_range(N_CHUNKS):
        m_all = tl.maximum(m_all, tl.load(ws_ml_ptr + (row0 + c * H) * 2, mask=c < n_row, other=float("-inf")))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    for c in tl.static_range(N_CHUNKS):
        rc = row0 + c * H
        wgt = tl.exp2(tl.load(ws_ml_ptr + rc * 2, mask=c < n_row, other=float("-inf")) - m_safe)
        l_all += wgt * tl.load(ws_ml_ptr + rc * 2 + 1, mask=c < n_row, other=0.0)
    l_all = tl.where(dec, l_all, 1.0)
    out = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    out = _merge_uv_block(out, w0, s0, 0, ws_acc_ptr, ws_ml_ptr, row0, n_row, m_safe, l_all, dec, H, R,
                          N_CHUNKS, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)
    if N_RB > 1:
        out = _merge_uv_block(out, w1, s1, 1, ws_acc_ptr, ws_ml_ptr, row0, n_row, m_safe, l_all, dec, H, R,
                              N_CHUNKS, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)
    if N_RB > 2:
        out = _merge_uv_block(out, w2, s2, 2, ws_acc_ptr, ws_ml_ptr, row0, n_row, m_safe, l_all, dec, H, R,
                              N_CHUNKS, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)
    if N_RB > 3:
        out = _merge_uv_block(out, w3, s3, 3, ws_acc_ptr, ws_ml_ptr, row0, n_row, m_safe, l_all, dec, H, R,
                              N_CHUNKS, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)
    for rb in range(PRELOAD_R_BLOCKS, N_RB):
        w, sc = _head_tile(w_ptr, s_ptr, h, v, v_ok, rb, R, s_wh, s_wv, s_sh, s_sv, bk, BLOCK_R, HAS_SCALE)
        out = _merge_uv_block(out, w, sc, rb, ws_acc_ptr, ws_ml_ptr, row0, n_row, m_safe, l_all, dec, H, R,
                              N_CHUNKS, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)
    tl.store(o_ptr + q_start[:, None].to(tl.int64) * s_ot + h * s_oh + v[None, :], out.to(OUT),
             mask=dec[:, None] & v_ok[None, :])


@triton.jit
def _mla_absorb_kernel(
    q_ptr, w_ptr, s_ptr, o_ptr, T, DN, R, bk, s_qt, s_qh, s_wh, s_wd, s_sh, s_sd, s_ot, s_oh,
    BLOCK_M: tl.constexpr, DN_PAD: tl.constexpr, BLOCK_R: tl.constexpr, N_RB: tl.constexpr,
    ROW_BLOCKS: tl.constexpr, DOT_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # program (ROW_BLOCKS blocks of BLOCK_M tokens, head h): q_abs[t, h] = q_nope[t, h] @ W_UK[h], one dot
    # [BLOCK_M, DN] x [DN, BLOCK_R] per latent block (fixed tiles and order whatever T is: batch-invariant).
    # W_UK[h]'s first PRELOAD_R_BLOCKS blocks are loaded before the PDL wait (immutable), as in the merge.
    h = tl.program_id(1)
    d = tl.arange(0, DN_PAD)
    d_ok = d < DN
    OUT: tl.constexpr = o_ptr.dtype.element_ty
    w0, s0 = _head_tile(w_ptr, s_ptr, h, d, d_ok, 0, R, s_wh, s_wd, s_sh, s_sd, bk, BLOCK_R, HAS_SCALE)
    if N_RB > 1:
        w1, s1 = _head_tile(w_ptr, s_ptr, h, d, d_ok, 1, R, s_wh, s_wd, s_sh, s_sd, bk, BLOCK_R, HAS_SCALE)
    else:
        w1, s1 = w0, s0
    if N_RB > 2:
        w2, s2 = _head_tile(w_ptr, s_ptr, h, d, d_ok, 2, R, s_wh, s_wd, s_sh, s_sd, bk, BLOCK_R, HAS_SCALE)
    else:
        w2, s2 = w0, s0
    if N_RB > 3:
        w3, s3 = _head_tile(w_ptr, s_ptr, h, d, d_ok, 3, R, s_wh, s_wd, s_sh, s_sd, bk, BLOCK_R, HAS_SCALE)
    else:
        w3, s3 = w0, s0
    grid_dependency_wait(USE_PDL)
    t0 = tl.program_id(0) * ROW_BLOCKS * BLOCK_M
    for i in range(0, tl.minimum(ROW_BLOCKS, (T - t0 + BLOCK_M - 1) // BLOCK_M)):
        t = t0 + i * BLOCK_M + tl.arange(0, BLOCK_M)
        t_ok = t < T
        t64 = t.to(tl.int64)
        q = tl.load(q_ptr + t64[:, None] * s_qt + h * s_qh + d[None, :], mask=t_ok[:, None] & d_ok[None, :],
                    other=0.0)
        o_row = o_ptr + t64[:, None] * s_ot + h * s_oh
        _absorb_block(q, w0, s0, 0, o_row, t_ok, R, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)
        if N_RB > 1:
            _absorb_block(q, w1, s1, 1, o_row, t_ok, R, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)
        if N_RB > 2:
            _absorb_block(q, w2, s2, 2, o_row, t_ok, R, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)
        if N_RB > 3:
            _absorb_block(q, w3, s3, 3, o_row, t_ok, R, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)
        for rb in range(PRELOAD_R_BLOCKS, N_RB):
            w, sc = _head_tile(w_ptr, s_ptr, h, d, d_ok, rb, R, s_wh, s_wd, s_sh, s_sd, bk, BLOCK_R, HAS_SCALE)
            _absorb_block(q, w, sc, rb, o_row, t_ok, R, BLOCK_M, BLOCK_R, DOT_DTYPE, OUT, HAS_SCALE)


@triton.jit
def _absorb_block(q, w, sc, rb, o_row, t_ok, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, OUT: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Latent block rb of q @ W_UK[h] stored at ``o_row`` (row pointers [BLOCK_M, 1])."""
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    o = dot_acc(q, _widen(w, sc, OUT, HAS_SCALE), tl.zeros([BLOCK_M, BLOCK_R], tl.float32), DOT_DTYPE)
    tl.store(o_row + r[None, :], o.to(OUT), mask=t_ok[:, None] & (r < R)[None, :])


def _head_weight_args(w: torch.Tensor | HeadWeights, R: int) -> tuple:
    """(weight, scale pointer, block_k, scale strides (head, row), BLOCK_R, N_RB, HAS_SCALE) for the kernels'
    :func:`_head_tile`. An FP8 weight whose scale blocks are not a whole number of 16-wide latent steps is
    widened on the host (:meth:`HeadWeights.dequantized`) and passed as a float weight."""
    block_r = min(MERGE_UV_BLOCK_R, pow2(R, 16))
    if isinstance(w, HeadWeights):
        bk = w.block_k
        if w.scale is not None and bk % 16 == 0:
            block_r = min(block_r, bk & -bk)  # a power of two dividing bk: each block within one scale block
            sc = w.scale
            return w.weight, sc, bk, sc.stride(0), sc.stride(1), block_r, triton.cdiv(R, block_r), True
        w = w.dequantized()
    return w, w, 1, 0, 0, block_r, triton.cdiv(R, block_r), False


def _cuda_ready(out: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """The checks both CUDA decode kernels share: a CUDA tensor, not the Triton interpreter, int32 contiguous
    sequence metadata."""
    return (out.is_cuda and not interpreting()
            and all(x.dtype == torch.int32 and x.is_contiguous() for x in (cu_seqlens_q, seq_lens)))


def _cuda_split(q_nope_absorbed, q_pe, latent_cache, ws_acc, ws_ml, cu_seqlens_q, seq_lens, block_tables,
                topk_indices, scale, span_min) -> bool:
    """Split-KV partials of the decode rows by the CUDA kernel (:mod:`atomtool.serve.ops.cuda.mla_split`) when
    it serves this model (dtypes and shapes, never the batch); False when the Triton kernel is to run."""
    if not _cuda_ready(ws_acc, cu_seqlens_q, seq_lens) or seq_lens.shape[0] > 65535:  # (the grid's y: sequences)
        return False
    from atomtool.serve.ops.cuda import mla_split as cs

    if not cs.serves(q_nope_absorbed, q_pe, latent_cache, block_tables, topk_indices):
        return False
    cs.mla_split_cuda(q_nope_absorbed, q_pe, latent_cache, ws_acc, ws_ml, cu_seqlens_q, seq_lens, block_tables,
                      topk_indices, float(scale), span_min, pdl=bool(launch_pdl_args(ws_acc.device)))
    return True


def _cuda_merge(w_uv, out, n_chunks, sparse, K, span_min, ws_acc, ws_ml, cu_seqlens_q, seq_lens) -> bool:
    """Merge + W_UV of the decode rows by the CUDA kernel (:mod:`atomtool.serve.ops.cuda.mla_merge_uv`) when it
    serves this model (its dtype and shapes, never the batch: a row's bits stay batch-invariant); False when
    the Triton kernel is to run."""
    if not _cuda_ready(out, cu_seqlens_q, seq_lens) or out.stride(-1) != 1:
        return False
    from atomtool.serve.ops.cuda import mla_merge_uv as cm

    if isinstance(w_uv, HeadWeights):
        weight, scale, bk = w_uv.weight, w_uv.scale, w_uv.block_k
    else:
        weight, scale, bk = w_uv, None, 1
    if not cm.serves(out.dtype, weight, scale, bk, n_chunks, out.device):
        return False
    cm.mla_merge_uv_cuda(ws_acc, ws_ml, weight, scale, bk, out, cu_seqlens_q, seq_lens, K, sparse, span_min,
                         pdl=bool(launch_pdl_args(out.device)))
    return True


def mla_absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor | HeadWeights) -> torch.Tensor:
    """``q_abs[t, h] = q_nope[t, h] @ W_UK[h]``; same contract as ``torch_ref_mla.mla_absorb_q``.

    q_nope: [T, H, dn] with a contiguous last dim (a view of q_b_proj's output); w_uk: [H, dn, R] (tensor or
    :class:`HeadWeights`, FP8 read as stored and widened in the kernel). Returns [T, H, R] in q_nope's dtype.
    One program per (block of up to 256 tokens, head), W_UK[h] loaded before the PDL wait. Raises ValueError
    when the shapes do not fit.
    """
    wt = w_uk.weight if isinstance(w_uk, HeadWeights) else w_uk
    if q_nope.dim() != 3 or wt.dim() != 3 or q_nope.shape[1:] != wt.shape[:2]:
        raise ValueError(f"mla_absorb_q: q_nope {tuple(q_nope.shape)} does not fit W_UK {tuple(wt.shape)} "
                         "([T, H, dn] and [H, dn, R])")
    T, H, DN = q_nope.shape
    R = wt.shape[2]
    out = q_nope.new_empty(T, H, R)
    if T == 0:
        return out
    if q_nope.stride(-1) != 1:
        q_nope = q_nope.contiguous()
    w, sc, bk, s_sh, s_sd, block_r, n_rb, has_scale = _head_weight_args(w_uk, R)
    if w.stride(-1) != 1:
        w = w.contiguous()
    rows = MERGE_UV_BLOCK_M * ABSORB_ROW_BLOCKS
    _mla_absorb_kernel[(triton.cdiv(T, rows), H)](
        q_nope, w, sc, out, T, DN, R, bk, q_nope.stride(0), q_nope.stride(1), w.stride(0), w.stride(1),
        s_sh, s_sd, out.stride(0), out.stride(1),
        BLOCK_M=MERGE_UV_BLOCK_M, DN_PAD=pow2(DN, 16), BLOCK_R=block_r, N_RB=n_rb, ROW_BLOCKS=ABSORB_ROW_BLOCKS,
        DOT_DTYPE=dot_dtype(q_nope.dtype), HAS_SCALE=has_scale, num_warps=8, num_stages=1,
        **launch_pdl_args(q_nope.device),
    )
    return out


def mla_attention(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  scale: float, topk_indices: torch.Tensor | None = None,
                  w_uv: torch.Tensor | HeadWeights | None = None) -> torch.Tensor:
    """Absorbed-form MLA attention; same contract as ``torch_ref_mla.mla_attention``.

    q_nope_absorbed: [T, H, R]; q_pe: [T, H, P]; latent_cache: [N, bs, R + P] (row = c_kv ‖ k_pe, stored
    before the call); cu_seqlens_q: [B+1] int32; seq_lens: [B] int32; block_tables: [B, M] int32; scale:
    softmax scale; topk_indices: optional [T, K] int32 request-local positions, -1 padded (DSA sparse);
    w_uv: optional [H, dv, R] W_UV, last dim contiguous. Returns [T, H, R] in q_nope_absorbed's dtype, or
    [T, H, dv] with ``w_uv``: decode rows then get the W_UV product inside the split-KV merge (one kernel,
    :func:`_mla_merge_uv_kernel`: at batch 1 the merge and cuBLAS's batched GEMV were ~15 us of latency per
    layer); rows of a multi-token query go through ``torch_ref_mla.mla_output_uv``. A decode row takes the
    fused path in every batch, so its bits do not depend on what else the batch holds.
    Raises ValueError for inputs whose shapes do not fit.
    """
    T, H, R = q_nope_absorbed.shape
    P = q_pe.shape[-1]
    if latent_cache.shape[-1] != R + P or q_pe.shape[:2] != (T, H):
        raise ValueError(f"mla_attention: q {tuple(q_nope_absorbed.shape)} / q_pe {tuple(q_pe.shape)} do not fit "
                         f"latent cache {tuple(latent_cache.shape)}")
    B = seq_lens.shape[0]
    check_mla_w_uv(w_uv, H, R)
    lat_out = torch.empty_like(q_nope_absorbed)
    if T == 0 or B == 0:
        return lat_out if w_uv is None else q_nope_absorbed.new_empty(T, H, w_uv.shape[1])
    for name, ten in (("q_nope_absorbed", q_nope_absorbed), ("q_pe", q_pe), ("latent_cache", latent_cache)):
        if ten.stride(-1) != 1:
            raise ValueError(f"mla_attention: {name} must have a contiguous last dim")
    sparse = topk_indices is not None
    if sparse and topk_indices.stride(-1) != 1:
        topk_indices = topk_indices.contiguous()
    r_pad = pow2(R, 16)
    p_pad = pow2(P, 16)
    dot = dot_dtype(q_nope_absorbed.dtype)
    K = topk_indices.shape[1] if sparse else 0
    tk = topk_indices if sparse else block_tables  # dummy pointer when dense
    if T > B:  # some sequence has several new tokens (prefill): one program per (token, head block)
        block_h = min(pow2(H, 16), 32 if r_pad >= 256 else 64)
        block_n = 32 if r_pad >= 256 else 64
        grid = (T, triton.cdiv(H, block_h))
        _mla_kernel[grid](
            q_nope_absorbed, q_pe, latent_cache, lat_out, cu_seqlens_q, seq_lens, block_tables, tk,
            B, H, R, P, K, latent_cache.shape[1], float(scale),
            q_nope_absorbed.stride(0), q_nope_absorbed.stride(1), q_pe.stride(0), q_pe.stride(1),
            latent_cache.stride(0), latent_cache.stride(1), lat_out.stride(0), lat_out.stride(1), block_tables.stride(0),
            tk.stride(0),
            SPARSE=sparse, BLOCK_H=block_h, BLOCK_N=block_n, R_PAD=r_pad, P_PAD=p_pad, BLOCK_B=pow2(B),
            DOT_DTYPE=dot, num_warps=8 if r_pad >= 256 else 4, num_stages=2,
            **launch_pdl_args(q_nope_absorbed.device),
        )
    # decode rows (all rows when T == B): split-KV over chunks cut from the row's own key count, then the
    # ordered merge. Chunk count: from the top-k width (sparse) or a constant (dense), never from the batch.
    span_min = SPLIT_CHUNK_SPARSE if sparse else SPLIT_SPAN_DENSE
    n_chunks = max(1, triton.cdiv(K, SPLIT_CHUNK_SPARSE)) if sparse else SPLIT_CHUNKS_DENSE
    ws_acc = torch.empty((B, n_chunks, H, R), dtype=torch.float32, device=lat_out.device)
    ws_ml = torch.empty((B, n_chunks, H, 2), dtype=torch.float32, device=lat_out.device)
    if r_pad < 256:
        cfg = MlaDecodeConfig(block_h=32, block_n=64, num_warps=4)
    elif q_nope_absorbed.element_size() > 2:  # float32: the bf16-tuned 64 x 64 tiles need 311 KB of shared memory
        cfg = MlaDecodeConfig(block_h=16, block_n=32, num_warps=4)
    else:
        cfg = MLA_DECODE_CONFIG
    block_h = min(pow2(H, 16), cfg.block_h)
    if not _cuda_split(q_nope_absorbed, q_pe, latent_cache, ws_acc, ws_ml, cu_seqlens_q, seq_lens, block_tables,
                       topk_indices, scale, span_min):
        _mla_split_kernel[(B, triton.cdiv(H, block_h), n_chunks)](
            q_nope_absorbed, q_pe, latent_cache, ws_acc, ws_ml, cu_seqlens_q, seq_lens, block_tables, tk,
            H, R, P, K, latent_cache.shape[1], float(scale), n_chunks,
            q_nope_absorbed.stride(0), q_nope_absorbed.stride(1), q_pe.stride(0), q_pe.stride(1),
            latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0), tk.stride(0),
            SPARSE=sparse, SPAN_MIN=span_min, BLOCK_H=block_h, BLOCK_N=cfg.block_n, R_PAD=r_pad,
            P_PAD=p_pad, DOT_DTYPE=dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch_pdl_args(q_nope_absorbed.device),
        )
    if w_uv is None:
        grid, merge_h, merge_d = merge_grid(B, H, R)
        split_kv_merge_kernel[grid](
            ws_acc, ws_ml, lat_out, cu_seqlens_q, seq_lens, H, R, K, n_chunks, lat_out.stride(0), lat_out.stride(1),
            SPARSE=sparse, SPAN_MIN=span_min, BLOCK_H=merge_h, BLOCK_D=merge_d, EMPTY_IS_ZERO=False, num_warps=4,
            **launch_pdl_args(ws_acc.device),
        )
        return lat_out
    DV = w_uv.shape[1]
    # multi-token rows (prefill) were written to lat_out above: un-absorb them by the reference's GEMM (its
    # decode rows are garbage there and overwritten below); a decode-only step skips it
    out = mla_output_uv(lat_out, head_weight_tensor(w_uv)) if T > B else q_nope_absorbed.new_empty(T, H, DV)
    if _cuda_merge(w_uv, out, n_chunks, sparse, K, span_min, ws_acc, ws_ml, cu_seqlens_q, seq_lens):
        return out
    w, sc, bk, s_sh, s_sv, block_r, n_rb, has_scale = _head_weight_args(w_uv, R)
    _mla_merge_uv_kernel[(triton.cdiv(B, MERGE_UV_BLOCK_M), H)](
        ws_acc, ws_ml, w, sc, out, cu_seqlens_q, seq_lens, B, H, R, DV, K, bk,
        w.stride(0), w.stride(1), s_sh, s_sv, out.stride(0), out.stride(1),
        SPARSE=sparse, SPAN_MIN=span_min, N_CHUNKS=n_chunks, BLOCK_M=MERGE_UV_BLOCK_M, BLOCK_R=block_r, N_RB=n_rb,
        DV_PAD=pow2(DV, 16), DOT_DTYPE=dot, HAS_SCALE=has_scale, num_warps=8, num_stages=1,
        **launch_pdl_args(ws_acc.device),
    )
    return out
