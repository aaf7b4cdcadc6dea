"""Grouped-GEMM layout of the MoE (token, slot) pairs in one Triton launch (``moe_align``).

Produces exactly what :func:`atomtool.serve.ops.triton.moe.sort_tokens_by_expert` (the torch reference,
about ten launches: scatter_add, cumsums, a stable argsort, searchsorted, scatter) produces: the pairs
``t * k + j`` grouped by expert in ascending expert id, each expert's run in pair order (stable) and
padded to a multiple of ``block_m`` with ``T * k``, the unused tail padded likewise; ``block_expert`` names
each ``block_m``-row block's expert (``E`` for unused blocks). Expert ids outside ``[0, E)`` (experts not
served here) are dropped. This is the alignment step of vLLM's ``moe_align_block_size`` (MegaBlocks
layout, Gale et al. 2023), written for decode-sized inputs.

One program walks the pairs (no host sync, CUDA-graph capturable): a masked histogram gives the per-expert
counts, a cumsum the padded run starts; block experts and padding are written per expert; then chunks of
``CHUNK`` pairs get their destinations as ``run start + pairs of that expert in earlier chunks`` (a gather
from the running counts) ``+ earlier pairs of that expert in the chunk`` (a CHUNK x CHUNK comparison). The
work grows linearly with the pairs in a single program, so inputs above :data:`MAX_PAIRS` (prefill) use
the torch reference, which gives the same result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import grid_dependency_wait, launch_pdl_args, pow2

#: most (token, slot) pairs laid out by the one-program kernel; larger inputs use the torch reference.
#: H200, CUDA graph (tests/gpu/test_router_gpu.py): 512 pairs 15.7 vs 86 us, 8192 pairs 195 vs 139 us (the
#: kernel's time grows ~linearly, ~24 us per 1000 pairs): the crossover is near 4-5k pairs
MAX_PAIRS = 4096


@triton.jit
def _moe_align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, n_pairs, E, block_m, length, n_blocks,
    BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, HIST: tl.constexpr, FILL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    grid_dependency_wait(USE_PDL)
    ee = tl.arange(0, BLOCK_E)
    e_ok = ee < E
    # 1. pairs per expert
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, n_pairs, HIST):
        offs = c0 + tl.arange(0, HIST)
        x = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=-1)
        valid = (offs < n_pairs) & (x >= 0) & (x < E)
        counts += tl.histogram(tl.where(valid, x, 0).to(tl.int32), BLOCK_E, mask=valid)
    # 2. padded runs [pad_start, pad_end) per expert, in ascending expert id
    padded = tl.where(e_ok, (counts + block_m - 1) // block_m * block_m, 0)
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    total = tl.sum(padded, axis=0)
    # 3. block experts: expert e owns blocks [pad_start/bm, pad_end/bm); blocks from total/bm on get E
    first_block = pad_start // block_m
    n_own = padded // block_m
    for r in range(0, tl.max(n_own, axis=0)):
        tl.store(block_expert_ptr + first_block + r, ee, mask=e_ok & (r < n_own))
    for b0 in range(total // block_m, n_blocks, FILL):
        b = b0 + tl.arange(0, FILL)
        tl.store(block_expert_ptr + b, tl.full([FILL], 0, tl.int32) + E, mask=b < n_blocks)
    # 4. padding rows: the end of each run, then the tail (disjoint from the pair rows written below)
    pad_rows = padded - counts
    for r in range(0, block_m - 1):
        tl.store(sorted_ptr + pad_start + counts + r, tl.full([BLOCK_E], 0, tl.int32) + n_pairs,
                 mask=e_ok & (r < pad_rows))
    for p0 in range(total, length, FILL):
        p = p0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + p, tl.full([FILL], 0, tl.int32) + n_pairs, mask=p < length)
    # 5. pair rows: destination = run start + earlier pairs of the same expert (stable)
    running = pad_start
    ci = tl.arange(0, CHUNK)
    for c0 in range(0, n_pairs, CHUNK):
        offs = c0 + ci
        x = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=-1)
        valid = (offs < n_pairs) & (x >= 0) & (x < E)
        xe = tl.where(valid, x, -1).to(tl.int32)
        before = (xe[:, None] == xe[None, :]) & (ci[None, :] < ci[:, None])
        rank = tl.sum(before.to(tl.int32), axis=1)
        base = tl.gather(running, tl.where(valid, xe, 0), 0)
        tl.store(sorted_ptr + base + rank, offs, mask=valid)
        running += tl.histogram(tl.where(valid, xe, 0), BLOCK_E, mask=valid)


def layout_length(n_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the layout: ``roundup(n_pairs + E * (block_m - 1), block_m)`` (a bound from shapes alone)."""
    return triton.cdiv(n_pairs + num_experts * (block_m - 1), block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-GEMM layout of the (token, slot) pairs; same outputs as ``sort_tokens_by_expert``.

    Args:
        topk_ids: [T, k] int (int32 or int64) expert ids; ids outside ``[0, num_experts)`` are dropped.
        num_experts: E, experts served here; block_m: rows per grouped-GEMM block.
    Returns:
        (sorted_pairs [L] int32: pair index ``t * k + j``, or ``T * k`` for padding; block_expert
        [L // block_m] int32: each row block's expert, ``E`` for unused blocks), L = :func:`layout_length`.
        Inputs above :data:`MAX_PAIRS` pairs go through the torch reference (same result).
    """
    from atomtool.serve.ops.triton.moe import sort_tokens_by_expert

    n_pairs = topk_ids.numel()
    if n_pairs > MAX_PAIRS:
        return sort_tokens_by_expert(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    length = layout_length(n_pairs, num_experts, block_m)
    n_blocks = length // block_m
    sorted_pairs = torch.empty(length, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=topk_ids.device)
    # every histogram input and the bins span at least the program's 128 threads (a smaller input would
    # be held twice by the layout; Triton's histogram lowering assumes no such replication across warps)
    _moe_align_kernel[(1,)](
        flat, sorted_pairs, block_expert, n_pairs, num_experts, block_m, length, n_blocks,
        BLOCK_E=pow2(num_experts, 128), CHUNK=128, HIST=min(pow2(n_pairs, 128), 1024), FILL=1024, num_warps=4,
        **launch_pdl_args(flat.device),
    )
    return sorted_pairs, block_expert

