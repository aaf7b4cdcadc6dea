"""The split-KV half of MLA decode as a CUDA kernel (``mla_split.cu``, see its header).

Serves :func:`atomtool.serve.ops.triton.mla.mla_attention`'s decode rows in place of the Triton
``_mla_split_kernel`` when :func:`serves` says so: bf16 queries and latent cache with kv_lora_rank 512 and rope
dim 64 (DeepSeek-V3 / V3.2's, Kimi-K2's and GLM-5's MLA), heads a multiple of 32, dense or DSA-sparse, on a CUDA device of
compute capability 8.0 or newer with ``nvcc`` whose blocks may opt into the kernel's shared memory (186 KB at 32
heads per CTA: Hopper and datacenter Blackwell, not A100 or sm_86 / sm_89 / sm_120). It writes the same (max,
sum, unnormalized output) partials, so either merge reads them. Whether it serves depends on the model and the
device only; the heads per CTA follow the batch (:func:`heads_for`) but give a row the same bits, so a row's
result stays batch-invariant. ``ATOMTOOL_CUDA_MLA_SPLIT=0`` keeps the Triton kernel (A/B measurements).
"""

from __future__ import annotations

import ctypes
import math

import torch

from atomtool.serve.ops.cuda.driver import OptionalKernel, device_guard, rows_aligned

R = 512
P = 64
#: query heads per CTA: None picks per launch (:func:`heads_for`); 32 or 64 forces it (A/B runs, tests)
HEADS: int | None = None
KEYS = 64
THREADS = 256


def heads_for(B: int, H: int, n_chunks: int, device: torch.device) -> int:
    """Query heads per CTA for a launch of B rows: 32 when those CTAs fit one wave of the device's SMs, else 64
    (H permitting). At batch 1 a CTA's time is mostly its bytes through one SM (query, key rows, partials), so
    twice the CTAs with half the query and partials each finish sooner; with more rows than SMs the CTAs run in
    waves and the fixed per-CTA latency is better paid half as often (docs/PERFORMANCE.md, session 15). Both
    give a row the same bits (the kernel adds its sums per 16-key group in key order, never per warp), so the
    choice may follow the batch."""
    if HEADS is not None:
        return HEADS if H % HEADS == 0 else 32
    if H % 64 or B * (H // 32) * n_chunks <= _sm_count(device):
        return 32
    return 64 if KERNEL.ready(device, defines(64), shared_bytes(64)) else 32


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def shared_bytes(heads: int) -> int:
    """Dynamic shared memory of a CTA: query (heads x 576 bf16) + two key stages (64 x 576 bf16), probabilities
    (heads x 72 bf16), row maxima / sums of the score warps, rescale factors, key offsets."""
    key_groups = 8 // (heads // 16)
    return (heads + 2 * KEYS) * (R + P) * 2 + heads * (KEYS + 8) * 2 + (key_groups + 1) * heads * 4 + 2 * KEYS * 8


#: the kernel, per device
KERNEL = OptionalKernel("mla_split.cu", "mla_split", "MLA split-KV", "ATOMTOOL_CUDA_MLA_SPLIT")


def serves(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
           block_tables: torch.Tensor, topk_indices: torch.Tensor | None) -> bool:
    """Whether the CUDA kernel computes these decode rows' split-KV partials: q_nope_absorbed [T, H, 512] and
    q_pe [T, H, 64] bf16, latent_cache [N, bs, 576] bf16, all with 16-byte aligned rows, H a multiple of 32,
    block_tables and topk_indices int32 with a contiguous last dim, a CUDA device (sm_80+, not ROCm) whose
    per-block shared memory holds the 32-heads kernel's, the kernel built (a failure warns once and keeps the
    Triton kernel), ``ATOMTOOL_CUDA_MLA_SPLIT`` not ``0``."""
    device = q_nope_absorbed.device
    if (not KERNEL.enabled(device) or q_nope_absorbed.shape[-1] != R or q_pe.shape[-1] != P
            or q_nope_absorbed.shape[1] % 32 or latent_cache.shape[-1] != R + P
            or any(t.dtype != torch.bfloat16 or not rows_aligned(t) for t in (q_nope_absorbed, q_pe, latent_cache))
            or any(t is not None and (t.dtype != torch.int32 or t.stride(-1) != 1)
                   for t in (block_tables, topk_indices))):
        return False
    return KERNEL.ready(device, defines(32), shared_bytes(32))


def defines(heads: int) -> tuple[tuple[str, int], ...]:
    """The kernel's -D defines: heads per CTA."""
    return (("HEADS", heads),)


def launch_args(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                ws_acc: torch.Tensor, ws_ml: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor, topk_indices: torch.Tensor | None, scale: float, span_min: int,
                pdl: bool, heads: int) -> tuple[tuple[int, int, int], list]:
    """(grid, kernel arguments) of one launch of the ``heads``-per-CTA kernel (other arguments as
    :func:`mla_split_cuda` takes them)."""
    B, n_chunks, H, _ = ws_acc.shape
    sparse = topk_indices is not None
    tk = topk_indices if sparse else block_tables  # unread when dense
    K = topk_indices.shape[1] if sparse else 0
    args = [ctypes.c_void_p(q_nope_absorbed.data_ptr()), ctypes.c_void_p(q_pe.data_ptr()),
            ctypes.c_void_p(latent_cache.data_ptr()), ctypes.c_void_p(ws_acc.data_ptr()),
            ctypes.c_void_p(ws_ml.data_ptr()), ctypes.c_void_p(cu_seqlens_q.data_ptr()),
            ctypes.c_void_p(seq_lens.data_ptr()), ctypes.c_void_p(block_tables.data_ptr()),
            ctypes.c_void_p(tk.data_ptr()), ctypes.c_int(H), ctypes.c_int(K), ctypes.c_int(latent_cache.shape[1]),
            ctypes.c_float(scale * math.log2(math.e)), ctypes.c_int(n_chunks),
            ctypes.c_longlong(q_nope_absorbed.stride(0)), ctypes.c_longlong(q_nope_absorbed.stride(1)),
            ctypes.c_longlong(q_pe.stride(0)), ctypes.c_longlong(q_pe.stride(1)),
            ctypes.c_longlong(latent_cache.stride(0)), ctypes.c_longlong(latent_cache.stride(1)),
            ctypes.c_longlong(block_tables.stride(0)), ctypes.c_longlong(tk.stride(0)), ctypes.c_int(int(sparse)),
            ctypes.c_int(span_min), ctypes.c_int(int(pdl))]
    return (H // heads, B, n_chunks), args


def mla_split_cuda(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                   ws_acc: torch.Tensor, ws_ml: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                   block_tables: torch.Tensor, topk_indices: torch.Tensor | None, scale: float, span_min: int,
                   pdl: bool) -> None:
    """Fill ws_acc [B, n_chunks, H, 512] / ws_ml [B, n_chunks, H, 2] (float32, contiguous) with the split-KV
    partials of every decode row (inputs as :func:`serves` accepts them; cu_seqlens_q [B+1] / seq_lens [B]
    int32 contiguous; scale: the softmax scale; span_min: the smallest chunk span; pdl: programmatic dependent
    launch). A chunk past a row's keys is left unwritten, as the merge never reads it. Raises CudaDriverError
    when the launch fails."""
    B, n_chunks, H, _ = ws_acc.shape
    heads = heads_for(B, H, n_chunks, ws_acc.device)
    grid, args = launch_args(q_nope_absorbed, q_pe, latent_cache, ws_acc, ws_ml, cu_seqlens_q, seq_lens,
                             block_tables, topk_indices, scale, span_min, pdl, heads)
    with device_guard(ws_acc.device):
        KERNEL.get(ws_acc.device, defines(heads)).launch(grid, (THREADS, 1, 1), shared_bytes(heads), args, pdl=pdl)
