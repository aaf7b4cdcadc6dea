"""Split-KV decode helpers shared by the MLA and paged-attention kernels: chunk spans and the ordered merge.

Flash-Decoding (Dao, Haziza, Massa, Sizov 2023): a decode row's keys are cut into chunks reduced by separate
programs to partials (running max ``m`` in log2 units, sum ``l`` of ``2^(s - m)``, unnormalized output
``acc``), then merged. Here the cut depends only on the row's own key count and constants (never on the
batch), and the merge walks the chunks in index order, so a row's result is deterministic and batch-invariant.

Workspace layout (float32): ``acc [B, n_chunks, H, D]`` and ``ml [B, n_chunks, H, 2]`` = (m, l); row b is the
single query token of sequence b.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import grid_dependency_wait

#: chunk spans are multiples of this many keys (a multiple of every kernel's BLOCK_N)
SPAN_ALIGN: tl.constexpr = tl.constexpr(64)


@triton.jit
def chunk_span(n_keys, n_chunks, SPAN_MIN: tl.constexpr):
    """Keys per chunk for a row with ``n_keys`` keys and at most ``n_chunks`` chunks: the smallest multiple
    of SPAN_ALIGN covering n_keys in n_chunks chunks, at least SPAN_MIN. Depends on the row only."""
    per = (n_keys + n_chunks - 1) // n_chunks
    per = (per + SPAN_ALIGN - 1) // SPAN_ALIGN * SPAN_ALIGN
    return tl.maximum(per, SPAN_MIN)


@triton.jit
def split_kv_merge_kernel(
    ws_acc_ptr, ws_ml_ptr, o_ptr, cu_q_ptr, seq_lens_ptr, H, D, K, n_chunks, s_ot, s_oh,
    SPARSE: tl.constexpr, SPAN_MIN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    EMPTY_IS_ZERO: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Program (sequence b, head block, feature block): if b has exactly one new token, merge its chunks in
    chunk order (global max first, then ``sum_c 2^(m_c - M) (l_c, acc_c)``) and write
    ``out[t, h, d0:d0 + BLOCK_D]``. Every output element is computed alone in the same order whatever the
    grid, so the head/feature blocking never changes a bit. Key count: K (sparse: the top-k width) or
    ``seq_lens[b]``. A row without keys gets 0 (EMPTY_IS_ZERO) or NaN."""
    grid_dependency_wait(USE_PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    db = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    if tl.load(cu_q_ptr + b + 1) - q_start != 1:
        return
    if SPARSE:
        n_keys = K
    else:
        n_keys = tl.load(seq_lens_ptr + b)
    span = chunk_span(n_keys, n_chunks, SPAN_MIN)
    n_row = (n_keys + span - 1) // span
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    row0 = b.to(tl.int64) * n_chunks * H + h.to(tl.int64)
    m_all = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for c in range(0, n_row):
        m_all = tl.maximum(m_all, tl.load(ws_ml_ptr + (row0 + c * H) * 2, mask=h_ok, other=float("-inf")))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for c in range(0, n_row):
        rc = row0 + c * H
        wgt = tl.exp2(tl.load(ws_ml_ptr + rc * 2, mask=h_ok, other=float("-inf")) - m_safe)
        l_all += wgt * tl.load(ws_ml_ptr + rc * 2 + 1, mask=h_ok, other=0.0)
        acc += wgt[:, None] * tl.load(ws_acc_ptr + rc[:, None] * D + d[None, :],
                                      mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if EMPTY_IS_ZERO:
        l_all = tl.where(l_all == 0.0, 1.0, l_all)
    out = acc / l_all[:, None]
    tl.store(o_ptr + q_start.to(tl.int64) * s_ot + h[:, None].to(tl.int64) * s_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


def merge_grid(B: int, H: int, D: int) -> tuple[tuple[int, int, int], int, int]:
    """(grid, BLOCK_H, BLOCK_D) of :func:`split_kv_merge_kernel` for B rows, H heads, D features.

    Small blocks (8 heads x 128 features) so a batch-1 decode step still gets tens of programs (MLA: 128
    heads x 512 latent features = 64 programs) and the fp32 accumulator stays in registers.
    """
    block_h = min(triton.next_power_of_2(max(H, 1)), 8)
    block_d = min(triton.next_power_of_2(max(D, 16)), 128)
    return (B, triton.cdiv(H, block_h), triton.cdiv(D, block_d)), block_h, block_d
