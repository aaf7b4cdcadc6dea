"""SiLU-and-mul (SwiGLU gate, Shazeer 2020) in Triton: out = silu(x[:, :I]) * x[:, I:].

The gate half comes first, as in fused ``gate_up_proj`` weights (gate ‖ up). Computed in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import grid_dependency_wait, launch_pdl_args


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate ‖ up) -> [T, I] in x's dtype. Raises ValueError for an odd last dim."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} is odd")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T, inter = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    BLOCK = 1024
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(inter, BLOCK))](x2, out, inter, x2.stride(0), out.stride(0), BLOCK=BLOCK,
                                                             **launch_pdl_args(x2.device))
    return out.view(*shape[:-1], inter)
