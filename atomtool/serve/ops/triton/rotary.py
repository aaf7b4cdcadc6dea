"""Rotary position embedding (RoFormer, Su et al. 2021) of one rotary slice, in Triton.

``interleaved=False``: NeoX/HF rotate-half pairs ``(i, i + R/2)``; ``interleaved=True``: GPT-J pairs
``(2i, 2i + 1)`` (DeepSeek/GLM MLA rope, GLM indexer). Angles come in as per-token cos/sin tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import grid_dependency_wait, launch_pdl_args, pow2


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, H, half, s_xt, s_xh, s_ct, s_st, s_ot, s_oh,
                   INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                   USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_R)
    m = (h[:, None] < H) & (i[None, :] < half)
    c = tl.load(cos_ptr + t * s_ct + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * s_st + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    if INTERLEAVED:
        i1 = 2 * i
        i2 = 2 * i + 1
    else:
        i1 = i
        i2 = i + half
    xr = x_ptr + t * s_xt + h[:, None].to(tl.int64) * s_xh
    x1 = tl.load(xr + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xr + i2[None, :], mask=m, other=0.0).to(tl.float32)
    orow = o_ptr + t * s_ot + h[:, None].to(tl.int64) * s_oh
    tl.store(orow + i1[None, :], (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=m)
    tl.store(orow + i2[None, :], (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=m)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool = False) -> torch.Tensor:
    """Rotate one rotary slice; same contract as ``torch_ref.rotary_embedding``.

    x: [T, H, R] (R even, last dim contiguous; a slice of a wider head is fine); cos, sin: [T, R/2] float32.
    Returns a new [T, H, R] tensor in x's dtype.
    """
    T, H, R = x.shape
    if R % 2 or cos.shape[-1] != R // 2 or sin.shape[-1] != R // 2:
        raise ValueError(f"rotary_embedding: rotary dim {R} does not match cos/sin {tuple(cos.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((T, H, R), dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    block_h = min(pow2(H), 16)
    _rotary_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, out, H, R // 2, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1), INTERLEAVED=bool(interleaved), BLOCK_H=block_h, BLOCK_R=pow2(R // 2),
        **launch_pdl_args(x.device))
    return out
