"""Fused MoE over stacked experts in Triton: token sorting + grouped GEMMs (BF16 or FP8 block weights).

Routed SwiGLU experts (DeepSeek-V3 / Mixtral style): ``y[t] = Σ_j w[t,j] · W2[e] (silu(G[e] x[t]) * U[e] x[t])``
with ``e = topk_ids[t, j]``. The (token, slot) pairs are sorted by expert and each expert's run is padded
to a multiple of BLOCK_M (the grouped-GEMM layout of vLLM's fused_moe, after MegaBlocks, Gale et al. 2023;
``moe_align``, one launch without host sync, CUDA-graph capturable), so one GEMM launch serves all experts: a
program owns BLOCK_M rows of one expert (``MOE_BLOCK_M``, the same for every batch size). At T == 1 (a
decision from shapes alone, so a CUDA graph captured per batch size stays valid) the layout step is skipped:
the top-k experts of one token are distinct, so the aligned layout would put each pair alone in its expert's
block, and the GEMMs' "direct" mode gives program p exactly that tile for pair p (same bits, one launch and
its latency fewer). SiLU-and-mul stays its own launch between the GEMMs: fused into the down GEMM's activation
load (tried, same bits) it made a batch-1 DeepSeek-V3.2 MoE layer 8-14 us slower on an H200 (the activation
tile then goes through registers instead of the pipelined tile loads). Expert ids outside ``[0, E)`` (e.g.
experts owned by another rank) contribute nothing. The k slot outputs of a token are summed in float32
in slot order, so a token's result does not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.torch_ref_mla import check_fused_moe
from atomtool.serve.ops.triton._common import (
    dot_acc,
    dot_dtype,
    grid_dependency_wait,
    launch_pdl_args,
)
from atomtool.serve.ops.triton.activation import silu_and_mul
from atomtool.serve.ops.triton.linear import _fp8_step, act_quant_flags, sum_planes
from atomtool.serve.ops.triton.moe_align import moe_align


@triton.jit
def _moe_load_step(a_rows, b_base, s_rows, kk, k0, K, r_ok, n_ok, bk, FP8: tl.constexpr):
    """The activation rows [BLOCK_M, BLOCK_K], the expert weight tile [BLOCK_N, BLOCK_K] and (FP8) its block
    scales [BLOCK_N] of the K step at k0."""
    k = k0 + kk
    k_ok = k < K
    a = tl.load(a_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    b = tl.load(b_base + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if FP8:
        sc = tl.load(s_rows + k0 // bk, mask=n_ok & (k0 < K), other=0.0)
    else:
        sc = tl.zeros_like(n_ok).to(tl.float32)
    return a, b, sc


@triton.jit
def _moe_step(acc, a, b, sc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
              SWAP_AB: tl.constexpr, FP8: tl.constexpr, ACT_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr):
    """One K step of an expert tile: acc + a @ b^T (transposed under SWAP_AB); FP8 weights go through the FP8
    linear's step (``linear._fp8_step``: widened exactly, or W8A8 under ACT_FP8) with their block scale."""
    if FP8:
        return _fp8_step(acc, a, b, sc, BLOCK_M, BLOCK_N, DOT_DTYPE, SWAP_AB, ACT_FP8, ROUND_SCALE)
    else:
        if SWAP_AB:
            return dot_acc(b, tl.trans(a), acc, DOT_DTYPE)
        else:
            return dot_acc(a, tl.trans(b), acc, DOT_DTYPE)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, s_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr,
    N, K, num_pairs, top_k, E, bn, bk,
    s_am, s_be, s_bn, s_se, s_sn, s_cm,
    A_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    SWAP_AB: tl.constexpr, USE_PDL: tl.constexpr = False, ACT_FP8: tl.constexpr = False,
    ROUND_SCALE: tl.constexpr = False, DIRECT: tl.constexpr = False,
):
    # SWAP_AB: compute the transposed tile B_tile @ A_tile^T ([BLOCK_N, BLOCK_M]) so the (widened) expert
    # weight tile is the dot's first operand (Hopper's wgmma reads it from registers); same tile, same K order.
    # DIRECT: row block p serves pair p alone (expert_ptr: the flat topk_ids, no sorted layout): row 0 is the
    # pair, rows 1.. padding, the tile the aligned layout gives a pair alone in its expert's block. A pair whose
    # expert is not served here writes zeros to its slot-plane row (MUL_WEIGHT) instead of nothing.
    grid_dependency_wait(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    e = tl.load(expert_ptr + pid_m)
    if DIRECT:
        if (e < 0) | (e >= E):  # an expert not served here: its pair adds exactly zero
            if MUL_WEIGHT:
                c_row = (pid_m % top_k) * (num_pairs // top_k) + pid_m // top_k
                tl.store(c_ptr + c_row.to(tl.int64) * s_cm + n, tl.zeros([BLOCK_N], c_ptr.dtype.element_ty),
                         mask=n_ok)
            return
        rr = tl.arange(0, BLOCK_M)
        rows = tl.where(rr == 0, pid_m, num_pairs)
    else:
        if e >= E:  # padding block past the last expert's run
            return
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    r_ok = rows < num_pairs
    if A_PER_TOKEN:
        a_rows = rows // top_k
    else:
        a_rows = rows
    kk = tl.arange(0, BLOCK_K)
    b_base = b_ptr + e.to(tl.int64) * s_be + n[:, None].to(tl.int64) * s_bn
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_rows = a_ptr + a_rows[:, None].to(tl.int64) * s_am
    s_rows = s_ptr + e.to(tl.int64) * s_se + (n // bn).to(tl.int64) * s_sn
    for k0 in range(0, K, BLOCK_K):
        a, b, sc = _moe_load_step(a_rows, b_base, s_rows, kk, k0, K, r_ok, n_ok, bk, FP8)
        acc = _moe_step(acc, a, b, sc, BLOCK_M, BLOCK_N, DOT_DTYPE, SWAP_AB, FP8, ACT_FP8, ROUND_SCALE)
    # the weighted second GEMM writes pair (token t, slot j) to row j * T + t: one [T, H] plane per slot,
    # which sum_planes adds in slot order
    c_rows = (rows % top_k) * (num_pairs // top_k) + rows // top_k if MUL_WEIGHT else rows
    if SWAP_AB:
        if MUL_WEIGHT:
            acc *= tl.load(w_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + c_rows[None, :].to(tl.int64) * s_cm + n[:, None], acc.to(c_ptr.dtype.element_ty),
                 mask=r_ok[None, :] & n_ok[:, None])
    else:
        if MUL_WEIGHT:
            acc *= tl.load(w_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(c_ptr + c_rows[:, None].to(tl.int64) * s_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])


def sort_tokens_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Grouped-GEMM layout of the (token, slot) pairs.

    topk_ids: [T, k] int. Returns (sorted_pairs [L] int32: pair index ``t * k + j``, or ``T * k`` for padding;
    block_expert [L // block_m] int32: the expert of each row block, ``num_experts`` for unused blocks), with
    L = roundup(T*k + E*(block_m - 1), block_m), a bound from shapes alone.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n_pairs = flat.numel()
    E = num_experts
    ids = torch.where((flat >= 0) & (flat < E), flat, E)  # E: a sink for experts not served here
    counts = torch.zeros(E + 1, dtype=torch.long, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(ids, stable=True)
    e_sorted = ids[order]
    rank = torch.arange(n_pairs, device=device) - cnt_start[e_sorted]
    length = triton.cdiv(n_pairs + E * (block_m - 1), block_m) * block_m
    dest = torch.where(e_sorted < E, pad_start.clamp(max=length)[e_sorted.clamp(max=E - 1)] + rank, length)
    sorted_pairs = torch.full((length + 1,), n_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, length, block_m, device=device)
    block_expert = torch.searchsorted(pad_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs[:length], block_expert


@dataclass(frozen=True)
class MoeGemmConfig:
    """Launch configuration of the grouped expert GEMM (16-row tiles), the same for every batch size.

    block_n: output features per program; num_warps / num_stages: Triton launch options; swap_ab: compute
    the transposed tile (see the kernel). The default was the fastest at batch 1 in the H200 sweep (123 us
    per DeepSeek-V3.2 MoE layer, 67% of the copy bandwidth; 150 us without swap_ab) and second at T = 8 (707 us
    vs 658 us for block_n 128 without swap, which is 142 us at T = 1). Tuned on an H200
    at decode sizes with ``python -m benchmarks.kernel_sweep`` (docs/PERFORMANCE.md).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = True


#: the configuration every call uses (the sweep benchmark replaces it to compare candidates)
MOE_GEMM_CONFIG = MoeGemmConfig()
#: the configuration of W8A8 calls (``act_quant``). H200 sweep, one DeepSeek-V3.2 MoE layer
#: (``kernel_sweep --only moe --act-quant dynamic_ue8m0``): T = 1 109.5 us (123.7 us with the weight-only
#: default), T = 8 643 us (627 us)
MOE_GEMM_W8A8_CONFIG = MoeGemmConfig(block_n=128, num_warps=8, num_stages=4)


def _grouped_gemm(a, w, scale, out, sorted_pairs, block_expert, num_pairs, top_k, a_per_token, weights,
                  block_m, block_size, act_quant=None, direct=False):
    """One grouped expert GEMM launch over the aligned layout (``sorted_pairs`` / ``block_expert``), or under
    ``direct`` over the pairs themselves (``block_expert``: the flat topk_ids, ``sorted_pairs`` unused)."""
    E, N, K = w.shape
    fp8 = scale is not None
    bn, bk = block_size if fp8 else (1, 1)
    block_k = 128 if not fp8 else (128 if bk % 128 == 0 else (64 if bk % 64 == 0 else (32 if bk % 32 == 0 else 16)))
    if fp8 and bk % block_k:
        raise ValueError(f"fused_moe: FP8 block size {bk} along K must be a multiple of 16")
    act_fp8, round_scale = act_quant_flags(act_quant, bk, block_k) if fp8 else (False, False)
    cfg = MOE_GEMM_W8A8_CONFIG if act_fp8 else MOE_GEMM_CONFIG
    block_n = cfg.block_n if block_m <= 16 else 128
    s = scale if fp8 else w
    if direct:  # one row block per pair
        n_row_blocks = num_pairs
    else:
        # Row blocks in use come first (experts in order, each run padded to block_m) and number at most
        # cdiv(pairs, block_m) + min(E, pairs) (one partial block per non-empty expert): launching only those
        # spares a batch-1 step ~230 empty programs per n-tile (the layout's length bound assumes E partial
        # blocks)
        n_row_blocks = min(block_expert.shape[0], triton.cdiv(num_pairs, block_m) + min(E, num_pairs))
    grid = (n_row_blocks, triton.cdiv(N, block_n))
    _moe_gemm_kernel[grid](
        a, w, s, out, weights if weights is not None else a, sorted_pairs, block_expert,
        N, K, num_pairs, top_k, E, bn, bk,
        a.stride(0), w.stride(0), w.stride(1), s.stride(0) if fp8 else 0, s.stride(1) if fp8 else 0, out.stride(0),
        A_PER_TOKEN=a_per_token, MUL_WEIGHT=weights is not None, FP8=fp8,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k if fp8 else 64, DOT_DTYPE=dot_dtype(a.dtype),
        SWAP_AB=cfg.swap_ab and block_m <= 16,
        num_warps=cfg.num_warps if block_m <= 16 else 8, num_stages=cfg.num_stages,
        ACT_FP8=act_fp8, ROUND_SCALE=round_scale, DIRECT=direct, **launch_pdl_args(a.device),
    )


#: rows per grouped-GEMM tile, for every batch size. 16 keeps decode cheap (at batch 1 each active expert
#: holds one token; a 64-row tile would do 64x the MMA work), and one tile height for every batch keeps a
#: token's bits independent of its batch (the dot's tile height decides the instruction and its rounding),
#: at some cost to large prefill batches.
MOE_BLOCK_M = 16


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale_inv: torch.Tensor | None = None,
              w2_scale_inv: torch.Tensor | None = None, block_size: tuple[int, int] = (128, 128),
              act_quant: str | None = None, sum_slots: bool = True) -> torch.Tensor:
    """Routed experts; same contract as ``torch_ref_mla.fused_moe``, plus optional FP8 block weights (W8A8
    under ``act_quant``, as in ``linear.fp8_block_linear``).

    x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]; topk_weights: [T, k] float32;
    topk_ids: [T, k] int. FP8: w13/w2 float8_e4m3fn with ``w13_scale_inv`` [E, ceil(2I/bn), ceil(H/bk)] and
    ``w2_scale_inv`` [E, ceil(H/bn), ceil(I/bk)] float32 (DeepSeek-V3 block quantization, ``block_size``
    (bn, bk)). Returns [T, H] in x's dtype. Raises ValueError for shapes that do not fit, one scale given
    without the other, or an FP8 K block W8A8 / the kernel cannot serve.

    Launches: the expert layout (``moe_align``; skipped at T == 1, see the module doc), the gate_up GEMM,
    ``silu_and_mul``, the down GEMM (it writes each slot's weighted output to a float32 plane [k, T, H],
    zero-filled first unless T == 1) and ``sum_planes``, or, ``sum_slots=False``, returns those planes
    [k, T, H] float32 for the next norm to sum (``add_rms_norm``: one launch fewer per MoE layer).
    """
    return _fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, block_size, act_quant,
                      direct=x.shape[0] == 1, sum_slots=sum_slots)


def _fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, block_size, act_quant, *,
               direct: bool, sum_slots: bool = True) -> torch.Tensor:
    """``fused_moe`` with its launch choice explicit (tests compare both bitwise): ``direct``, one row block
    per pair instead of the aligned layout (any T; fused_moe picks it at T == 1)."""
    check_fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv)
    T, H = x.shape
    E, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    if T == 0:
        return (torch.zeros((T, H), dtype=x.dtype, device=x.device) if sum_slots
                else torch.zeros((max(k, 1), T, H), dtype=torch.float32, device=x.device))
    x = x if x.stride(-1) == 1 else x.contiguous()
    n_pairs = T * k
    block_m = MOE_BLOCK_M
    if direct:
        flat_ids = topk_ids.reshape(-1)
        flat_ids = flat_ids if flat_ids.is_contiguous() else flat_ids.contiguous()
        sorted_pairs = block_expert = flat_ids  # each program reads its pair's expert id
    else:
        sorted_pairs, block_expert = moe_align(topk_ids, E, block_m)
    h13 = torch.empty((n_pairs, two_i), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, w13_scale_inv, h13, sorted_pairs, block_expert, n_pairs, k, True, None, block_m,
                  block_size, act_quant, direct)
    act = silu_and_mul(h13)
    # pair p = t * k + j lands in plane j, row t. Aligned: pairs of experts not served here (-1 / other
    # ranks' ids) are in no row block, never written, and must add zero. Direct: every pair has its program,
    # which writes zeros for such an expert, so the planes need no fill (one launch fewer)
    y = (torch.empty if direct else torch.zeros)((k, T, H), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(act, w2, w2_scale_inv, y.view(n_pairs, H), sorted_pairs, block_expert, n_pairs, k, False,
                  weights, block_m, block_size, act_quant, direct)
    return sum_planes(y, torch.empty((T, H), dtype=x.dtype, device=x.device)) if sum_slots else y
