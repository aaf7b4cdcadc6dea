"""Linear layer with DeepSeek-V3 FP8 block-quantized weights, in Triton.

``y = x @ (W_fp8 * scale_inv[n // bn, k // bk])^T + b``: weights stay FP8 in memory (half the bytes of
BF16) and are widened exactly to the activation dtype inside the kernel; each K step of the GEMM stays
inside one 128-wide scale block, so the block scale multiplies the partial product once. Activations are
not quantized, so the result matches the dequantize-then-matmul reference up to float rounding.

Why not ``torch._scaled_mm``: its block-scaled form quantizes activations per 1x128 group, which changes
the numerics against the reference; the GPU tests probe whether the installed torch offers it (see
tests/gpu/test_kernels_gpu.py) so a later performance change can adopt it with a measured error.
Unquantized weights go to ``torch.nn.functional.linear`` (cuBLAS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import dot_acc, dot_dtype


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, M, N, K, bn, bk,
                           s_am, s_wn, s_sn, s_cm,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    s_row = s_ptr + (n // bn).to(tl.int64) * s_sn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        a = tl.load(a_ptr + m[:, None].to(tl.int64) * s_am + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * s_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        sc = tl.load(s_row + k0 // bk, mask=n_ok, other=0.0)
        part = dot_acc(a, tl.trans(w.to(tl.float32)), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_DTYPE)
        acc += part * sc[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + m[:, None].to(tl.int64) * s_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x: [..., K] (bf16/fp16/fp32); weight: [N, K] float8_e4m3fn; weight_scale_inv: [ceil(N/bn), ceil(K/bk)]
    float32; bias: [N] or None. Returns [..., N] in x's dtype. Raises ValueError on mismatched shapes."""
    bn, bk = block_size
    N, K = weight.shape
    if x.shape[-1] != K or tuple(weight_scale_inv.shape) != (triton.cdiv(N, bn), triton.cdiv(K, bk)):
        raise ValueError(f"fp8 linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale "
                         f"{tuple(weight_scale_inv.shape)} and block {block_size} do not fit")
    lead = x.shape[:-1]
    a = x.reshape(-1, K)
    if a.stride(-1) != 1:
        a = a.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    s = weight_scale_inv.float().contiguous()
    M = a.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(*lead, N)
    block_k = 128 if bk % 128 == 0 else (64 if bk % 64 == 0 else (32 if bk % 32 == 0 else 16))
    if bk % block_k:
        raise ValueError(f"fp8 linear: block size {bk} along K must be a multiple of 16")
    # one tile shape whatever M is, so a row's result does not depend on how many rows share the batch
    block_m, block_n = 64, 128
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _fp8_block_gemm_kernel[grid](a, w, s, bias if bias is not None else s, out, M, N, K, bn, bk,
                                 a.stride(0), w.stride(0), s.stride(0), out.stride(0),
                                 HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                 DOT_DTYPE=dot_dtype(x.dtype), num_warps=8,
                                 num_stages=3)
    return out.view(*lead, N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale_inv: torch.Tensor | None = None, block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """``y = x @ W^T + b``; same contract as ``torch_ref.linear`` (FP8 block weights with ``weight_scale_inv``)."""
    if weight_scale_inv is None:
        return F.linear(x, weight, bias)
    return fp8_block_linear(x, weight, weight_scale_inv, bias, tuple(block_size))
