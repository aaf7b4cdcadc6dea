"""The split-KV merge + W_UV product of MLA decode as a CUDA kernel (``mla_merge_uv.cu``, see its header).

Serves :func:`atomtool.serve.ops.triton.mla.mla_attention`'s decode rows in place of the Triton
``_mla_merge_uv_kernel`` when :func:`serves` says so: bf16 models with kv_lora_rank 512 and v_head_dim 128
(DeepSeek-V3 / V3.2's MLA), W_UV FP8 (128-wide scale blocks or any multiple of 16) or bf16, on a CUDA device of
compute capability 8.0 or newer with ``nvcc`` whose blocks may opt into its 146 KB of shared memory (not
sm_86 / sm_89 / sm_120). The choice depends on the model only, never on the batch, so a
row's bits stay batch-invariant. ``ATOMTOOL_CUDA_MLA_MERGE=0`` keeps the Triton kernel (A/B measurements).
"""

from __future__ import annotations

import ctypes

import torch

from atomtool.serve.ops.cuda.driver import OptionalKernel, device_guard, rows_aligned

R = 512
DV = 128
ROWS = 16
THREADS = 256
SHARED_BYTES = (DV + ROWS) * (R + 8) * 2


#: the kernel, per device and chunk count
KERNEL = OptionalKernel("mla_merge_uv.cu", "mla_merge_uv", "MLA merge", "ATOMTOOL_CUDA_MLA_MERGE")


def serves(out_dtype: torch.dtype, weight: torch.Tensor, scale: torch.Tensor | None, block_k: int, n_chunks: int,
           device: torch.device) -> bool:
    """Whether the CUDA kernel merges these decode rows: ``out_dtype`` bf16, ``weight`` W_UV [H, 128, 512] (e4m3
    with ``scale`` [H, 128, ceil(512 / block_k)] float32, ``block_k`` a multiple of 16, or bf16 without scale),
    16-byte aligned rows, at most 32 chunks, a CUDA device (sm_80+, not ROCm) and the kernel built (a failure
    warns once and keeps the Triton kernel), ``ATOMTOOL_CUDA_MLA_MERGE`` not ``0``."""
    if (not KERNEL.enabled(device) or out_dtype != torch.bfloat16 or weight.dim() != 3
            or tuple(weight.shape[1:]) != (DV, R) or not 1 <= n_chunks <= 32):
        return False
    if scale is not None:
        if (weight.dtype != torch.float8_e4m3fn or block_k % 16 or scale.dtype != torch.float32
                or scale.stride(-1) != 1 or not rows_aligned(weight)):
            return False
    elif weight.dtype != torch.bfloat16 or not rows_aligned(weight):
        return False
    return KERNEL.ready(device, (("N_CHUNKS", n_chunks),), SHARED_BYTES)


def mla_merge_uv_cuda(ws_acc: torch.Tensor, ws_ml: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                      block_k: int, out: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, K: int,
                      sparse: bool, span_min: int, pdl: bool) -> None:
    """Write ``out[q_start(b), h, :]`` for every decode row b (inputs as :func:`serves` accepts them, checked
    there): ws_acc [B, n_chunks, H, 512] / ws_ml [B, n_chunks, H, 2] float32 contiguous split-KV partials; out
    [T, H, 128] bf16 with a contiguous last dim; cu_seqlens_q [B+1] / seq_lens [B] int32; K: top-k width
    (sparse); span_min: the split's minimum chunk span; pdl: programmatic dependent launch.
    Raises CudaDriverError when the launch fails."""
    B, n_chunks, H, _ = ws_acc.shape
    kern = KERNEL.get(ws_acc.device, (("N_CHUNKS", n_chunks),))
    sc = scale if scale is not None else ws_ml  # unread without a scale
    args = [ctypes.c_void_p(ws_acc.data_ptr()), ctypes.c_void_p(ws_ml.data_ptr()), ctypes.c_void_p(weight.data_ptr()),
            ctypes.c_void_p(sc.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(cu_seqlens_q.data_ptr()),
            ctypes.c_void_p(seq_lens.data_ptr()), ctypes.c_int(B), ctypes.c_int(H), ctypes.c_int(K),
            ctypes.c_int(block_k), ctypes.c_longlong(weight.stride(0)), ctypes.c_longlong(weight.stride(1)),
            ctypes.c_longlong(sc.stride(0) if scale is not None else 0),
            ctypes.c_longlong(sc.stride(1) if scale is not None else 0), ctypes.c_longlong(out.stride(0)),
            ctypes.c_longlong(out.stride(1)), ctypes.c_int(int(sparse)), ctypes.c_int(span_min),
            ctypes.c_int(int(scale is not None)), ctypes.c_int(int(pdl))]
    with device_guard(ws_acc.device):
        kern.launch((-(-B // ROWS), H, 1), (THREADS, 1, 1), SHARED_BYTES, args, pdl=pdl)
