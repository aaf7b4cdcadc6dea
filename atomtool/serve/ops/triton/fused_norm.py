"""RMSNorm with a two-term residual add, in Triton (``add_rms_norm``): the MoE block's ``routed + shared``
combination folded into the next layer norm's fused residual add (issue 7: one kernel instead of an add
kernel plus the norm).

``s = residual + round(x + extra)``, ``out = rmsnorm(s)`` with norm.py's arithmetic (float32, normalised
value rounded to the dtype, then scaled). One program per row: a row never depends on the batch. Same
signature as ``torch_ref_mla.add_rms_norm``; registered on import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops import register_op
from atomtool.serve.ops.triton._common import grid_dependency_wait, launch_pdl_args, pow2


@triton.jit
def _add_rms_norm_kernel(x_ptr, e_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, s_x, s_e, s_r, s_o, s_ro, eps,
                         BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    dt = res_out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    e = tl.load(e_ptr + row * s_e + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * s_r + offs, mask=m, other=0.0).to(tl.float32)
    a = (x + e).to(dt).to(tl.float32)  # the unfused model's ``routed + shared``, rounded
    s = (a + r).to(dt)
    tl.store(res_out_ptr + row * s_ro + offs, s, mask=m)
    h = s.to(tl.float32)
    var = tl.sum(h * h, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = (h * rstd).to(dt).to(tl.float32) * w
    tl.store(out_ptr + row * s_o + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, extra: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x, extra, residual: [T, H] of one dtype (last dim contiguous); weight: [H]. Returns (out [T, H] in the
    promotion of x's and weight's dtypes, new residual [T, H] in residual's dtype).

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    if not (x.shape == extra.shape == residual.shape) or x.shape[-1] != weight.shape[0] or x.dim() != 2:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, extra {tuple(extra.shape)}, residual "
                         f"{tuple(residual.shape)} and weight {tuple(weight.shape)} do not fit")
    if not (x.dtype == extra.dtype == residual.dtype):
        raise ValueError(f"add_rms_norm: dtypes {x.dtype}, {extra.dtype}, {residual.dtype} differ")
    x, extra, residual = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, extra, residual))
    T, H = x.shape
    out = torch.empty((T, H), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_res = torch.empty((T, H), dtype=residual.dtype, device=x.device)
    if T:
        block = pow2(H)
        _add_rms_norm_kernel[(T,)](x, extra, residual, weight, out, new_res, H, x.stride(0), extra.stride(0),
                                   residual.stride(0), out.stride(0), new_res.stride(0), float(eps),
                                   BLOCK_H=block, num_warps=4 if block <= 2048 else 8,
                                   **launch_pdl_args(x.device))
    return out, new_res


register_op("add_rms_norm", "triton", add_rms_norm)
