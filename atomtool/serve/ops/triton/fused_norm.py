"""RMSNorm with a two-term residual add, in Triton (``add_rms_norm``): the MoE block's ``routed + shared``
combination folded into the next layer norm's fused residual add (issue 7: one kernel instead of an add
kernel plus the norm).

``s = residual + round(x + extra)``, ``out = rmsnorm(s)`` (x: a tensor, or float32 planes summed here) with norm.py's arithmetic (float32, normalised
value rounded to the dtype, then scaled). One program per row: a row never depends on the batch. Same
signature as ``torch_ref_mla.add_rms_norm``; registered on import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops import register_op
from atomtool.serve.ops.torch_ref_mla import check_add_rms_norm
from atomtool.serve.ops.triton._common import grid_dependency_wait, launch_pdl_args, pow2


@triton.jit
def _add_rms_norm_kernel(x_ptr, e_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, s_x, s_xp, s_e, s_r, s_o, s_ro, eps,
                         BLOCK_H: tl.constexpr, N_PLANES: tl.constexpr, HAS_EXTRA: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    dt = res_out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    # float32 planes (N_PLANES > 0): summed in plane order and rounded, as ``sum_planes`` stores the routed
    # experts' output (the loop unrolls: every plane's load in flight at once)
    for p in tl.static_range(1, N_PLANES):
        x += tl.load(x_ptr + p * s_xp + row * s_x + offs, mask=m, other=0.0)
    if N_PLANES > 0:
        x = x.to(dt).to(tl.float32)
    r = tl.load(res_ptr + row * s_r + offs, mask=m, other=0.0).to(tl.float32)
    a = x  # x is in the dtype's values here
    if HAS_EXTRA:
        e = tl.load(e_ptr + row * s_e + offs, mask=m, other=0.0).to(tl.float32)
        a = (x + e).to(dt).to(tl.float32)  # the unfused model's ``routed + shared``, rounded
    s = (a + r).to(dt)
    tl.store(res_out_ptr + row * s_ro + offs, s, mask=m)
    h = s.to(tl.float32)
    var = tl.sum(h * h, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = (h * rstd).to(dt).to(tl.float32) * w
    tl.store(out_ptr + row * s_o + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, extra: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """extra, residual: [T, H] of one dtype (last dim contiguous; extra None: none); x: [T, H] of that dtype,
    or [S, T, H] float32 planes (the routed experts' per-slot outputs, ``fused_moe(..., sum_slots=False)``, or
    a split-K projection's, ``linear(..., sum_splits=False)``) summed in plane order and rounded first, in this
    kernel: ``sum_planes``' bits without its launch; weight: [H]. Returns
    (out [T, H] in the promotion of the dtype and weight's dtype, new residual [T, H] in residual's dtype).

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    check_add_rms_norm(x, extra, weight, residual)
    planes = x.dim() == 3
    has_extra = extra is not None
    x, extra, residual = (t if t.stride(-1) == 1 else t.contiguous()
                          for t in (x, extra if has_extra else residual, residual))
    T, H = residual.shape
    out = torch.empty((T, H), dtype=torch.promote_types(residual.dtype, weight.dtype), device=x.device)
    new_res = torch.empty((T, H), dtype=residual.dtype, device=x.device)
    if T:
        block = pow2(H)
        _add_rms_norm_kernel[(T,)](x, extra, residual, weight, out, new_res, H, x.stride(-2),
                                   x.stride(0) if planes else 0, extra.stride(0), residual.stride(0),
                                   out.stride(0), new_res.stride(0), float(eps), BLOCK_H=block,
                                   N_PLANES=x.shape[0] if planes else 0, HAS_EXTRA=has_extra,
                                   num_warps=4 if block <= 2048 else 8,
                                   **launch_pdl_args(x.device))
    return out, new_res


register_op("add_rms_norm", "triton", add_rms_norm)
