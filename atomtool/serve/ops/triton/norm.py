"""Fused RMSNorm (+ residual add) in Triton.

Follows the Llama/DeepSeek RMSNorm (Zhang & Sennrich 2019, HF ``LlamaRMSNorm``):
y = weight * (x / sqrt(mean(x^2) + eps)), normalised in float32, rounded to the input dtype, then scaled
(HF's order; the result dtype is the promotion of x's and weight's, as in torch). With ``residual`` the add is fused:
``new_residual = x + residual`` (rounded to the input dtype, as the model adds in its own dtype) and
``out = rmsnorm(new_residual)``. One program normalises one row, so a row's result never depends on the
other rows of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import grid_dependency_wait, launch_pdl_args, pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, stride_x, stride_r, stride_o,
                     stride_ro, eps, HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # HF order: normalise in float32, round to the input dtype, then scale by the weight
    y = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim.

    x: [T, H] (float32/bf16/fp16, last dim contiguous); weight: [H]; eps: float; residual: optional [T, H].
    Returns out [T, H] (dtype: promotion of x's and weight's), or (out, new_residual) when residual is given.
    """
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: hidden size {x.shape[-1]} != weight size {weight.shape[0]}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T, H = x2.shape
    out = torch.empty((T, H), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block = pow2(H)
    warps = 4 if block <= 2048 else 8
    if residual is None:
        if T:
            _rms_norm_kernel[(T,)](x2, x2, weight, out, out, H, x2.stride(0), 0, out.stride(0), 0, eps,
                                   HAS_RES=False, BLOCK_H=block, num_warps=warps,
                                   **launch_pdl_args(x2.device))
        return out.view(shape)
    r2 = residual.reshape(-1, shape[-1])
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    new_res = torch.empty((T, H), dtype=residual.dtype, device=x.device)
    if T:
        _rms_norm_kernel[(T,)](x2, r2, weight, out, new_res, H, x2.stride(0), r2.stride(0), out.stride(0),
                               new_res.stride(0), eps, HAS_RES=True, BLOCK_H=block, num_warps=warps,
                               **launch_pdl_args(x2.device))
    return out.view(shape), new_res.view(residual.shape)
