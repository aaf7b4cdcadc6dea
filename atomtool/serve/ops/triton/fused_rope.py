"""Fused rotary ops of the MLA / DSA attention input, in Triton: one launch where the reference composes
several (issue 7: a decode step is bound by the count of tiny kernels).

- ``mla_kv_store``: the latent cache row ``[RMSNorm(c_kv) | rope(k_pe)]`` written straight to its slot
  (was: rms_norm, rotary, cat, store_cache);
- ``indexer_k_store``: the DSA index key ``rope(LayerNorm(k))`` ("pe first") written to its slot (was: casts,
  layer_norm, rotary, cat, store_cache);
- ``rotary_embedding_prefix``: rope of the first R dims of every head, the rest copied (was: rotary + cat).

Each program handles one token (one token x head block for the prefix rope), so a row never depends on
the other rows of the batch. The arithmetic repeats the unfused kernels' (norm.py, rotary.py): float32
math, the norm rounded to the activation dtype before the weight (RMSNorm, HF order) or after the affine
map (LayerNorm, then rope on the rounded values), one rounding per stored value. Same signatures as the
references in :mod:`atomtool.serve.ops.torch_ref_mla`; registered on import (``register_op``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops import register_op
from atomtool.serve.ops.triton._common import pow2
from atomtool.serve.ops.triton.attention import store_cache
from atomtool.serve.ops.triton.norm import rms_norm
from atomtool.serve.ops.triton.rotary import rotary_embedding


@triton.jit
def _pairs(i, half, INTERLEAVED: tl.constexpr):
    """Offsets of the rotary pairs ``i`` within a rotary slice: (2i, 2i+1) or (i, i + half)."""
    if INTERLEAVED:
        return 2 * i, 2 * i + 1
    else:
        return i, i + half


@triton.jit
def _mla_kv_store_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, c_ptr, slot_ptr, R, half, s_kv, s_ct, s_st, s_cs, eps,
                         INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    row = kv_ptr + t * s_kv
    dst = c_ptr + slot * s_cs
    # RMSNorm of c_kv (norm.py's arithmetic)
    offs = tl.arange(0, BLOCK_R)
    m = offs < R
    x = tl.load(row + offs, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / R
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = (x * rstd).to(kv_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(dst + offs, y.to(w_ptr.dtype.element_ty).to(c_ptr.dtype.element_ty), mask=m)
    # rope of k_pe (rotary.py's arithmetic)
    i = tl.arange(0, BLOCK_P)
    pm = i < half
    c = tl.load(cos_ptr + t * s_ct + i, mask=pm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * s_st + i, mask=pm, other=0.0).to(tl.float32)
    i1, i2 = _pairs(i, half, INTERLEAVED)
    x1 = tl.load(row + R + i1, mask=pm, other=0.0).to(tl.float32)
    x2 = tl.load(row + R + i2, mask=pm, other=0.0).to(tl.float32)
    dt = kv_ptr.dtype.element_ty
    tl.store(dst + R + i1, (x1 * c - x2 * s).to(dt).to(c_ptr.dtype.element_ty), mask=pm)
    tl.store(dst + R + i2, (x2 * c + x1 * s).to(dt).to(c_ptr.dtype.element_ty), mask=pm)


def mla_kv_store(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool, latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as ``torch_ref_mla.mla_kv_store``: kv [T, R + P] (last dim contiguous), norm_weight [R],
    cos/sin [T, P/2] float32, latent_cache [N, bs, R + P] contiguous, slot_mapping [T] (-1 skipped).

    Raises:
        ValueError: the widths do not fit the cache, or a non-contiguous cache.
    """
    T, W = kv.shape
    R = norm_weight.shape[0]
    P = W - R
    if latent_cache.shape[-1] != W or P % 2 or cos.shape[-1] != P // 2 or sin.shape[-1] != P // 2:
        raise ValueError(f"mla_kv_store: kv {tuple(kv.shape)}, norm weight [{R}], cos {tuple(cos.shape)} do not "
                         f"fit latent cache {tuple(latent_cache.shape)}")
    if not latent_cache.is_contiguous():
        raise ValueError("mla_kv_store: the cache plane must be contiguous")
    if T == 0:
        return
    if kv.dtype != norm_weight.dtype:  # unusual dtype mix: the unfused kernels (same results)
        c_kv = rms_norm(kv[:, :R], norm_weight, eps)
        k_pe = rotary_embedding(kv[:, None, R:], cos, sin, interleaved)[:, 0]
        store_cache(torch.cat((c_kv, k_pe), dim=-1), latent_cache, slot_mapping)
        return
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block_r = pow2(R)
    _mla_kv_store_kernel[(T,)](kv, norm_weight, cos, sin, latent_cache, slot_mapping, R, P // 2, kv.stride(0),
                               cos.stride(0), sin.stride(0), W, float(eps), INTERLEAVED=bool(interleaved),
                               BLOCK_R=block_r, BLOCK_P=pow2(P // 2), num_warps=4 if block_r <= 2048 else 8)


@triton.jit
def _indexer_k_store_kernel(k_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, c_ptr, slot_ptr, D, half, s_k, s_ct, s_st,
                            s_cs, eps, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    row = k_ptr + t * s_k
    dst = c_ptr + slot * s_cs
    dt = k_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(row + offs, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(m, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = (xc * rstd * w + b).to(dt)
    r = 2 * half
    tl.store(dst + offs, y.to(c_ptr.dtype.element_ty), mask=m & (offs >= r))  # the dims rope leaves alone
    if BLOCK_P > 0:
        i = tl.arange(0, BLOCK_P)
        pm = i < half
        c = tl.load(cos_ptr + t * s_ct + i, mask=pm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * s_st + i, mask=pm, other=0.0).to(tl.float32)
        i1, i2 = _pairs(i, half, INTERLEAVED)
        # the normed values at the pair offsets, recomputed exactly as above (same expression)
        x1 = tl.load(row + i1, mask=pm, other=0.0).to(tl.float32) - mean
        x2 = tl.load(row + i2, mask=pm, other=0.0).to(tl.float32) - mean
        y1 = (x1 * rstd * tl.load(w_ptr + i1, mask=pm, other=0.0).to(tl.float32)
              + tl.load(b_ptr + i1, mask=pm, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        y2 = (x2 * rstd * tl.load(w_ptr + i2, mask=pm, other=0.0).to(tl.float32)
              + tl.load(b_ptr + i2, mask=pm, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(dst + i1, (y1 * c - y2 * s).to(dt).to(c_ptr.dtype.element_ty), mask=pm)
        tl.store(dst + i2, (y2 * c + y1 * s).to(dt).to(c_ptr.dtype.element_ty), mask=pm)


def indexer_k_store(k_raw: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, interleaved: bool,
                    index_k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as ``torch_ref_mla.indexer_k_store``: k_raw [T, Di] (last dim contiguous), weight/bias
    [Di], cos/sin [T, R/2] float32 or None (no rope), index_k_cache [N, bs, Di] contiguous, slot_mapping [T].

    Raises:
        ValueError: the widths do not fit the cache, or a non-contiguous cache.
    """
    T, D = k_raw.shape
    half = 0 if cos is None else cos.shape[-1]
    if index_k_cache.shape[-1] != D or 2 * half > D or (half and sin.shape[-1] != half):
        raise ValueError(f"indexer_k_store: k {tuple(k_raw.shape)} and rotary tables of {half} do not fit "
                         f"index_k cache {tuple(index_k_cache.shape)}")
    if not index_k_cache.is_contiguous():
        raise ValueError("indexer_k_store: the cache plane must be contiguous")
    if T == 0:
        return
    k_raw = k_raw if k_raw.stride(-1) == 1 else k_raw.contiguous()
    if half:
        cos = cos if cos.stride(-1) == 1 else cos.contiguous()
        sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    else:
        cos = sin = weight  # dummy pointers, never read
    _indexer_k_store_kernel[(T,)](k_raw, weight, bias, cos, sin, index_k_cache, slot_mapping, D, half,
                                  k_raw.stride(0), cos.stride(0) if half else 0, sin.stride(0) if half else 0,
                                  D, float(eps), INTERLEAVED=bool(interleaved), BLOCK_D=pow2(D),
                                  BLOCK_P=pow2(half) if half else 0, num_warps=4)


@triton.jit
def _rope_prefix_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, H, D, half, s_xt, s_xh, s_ct, s_st, s_ot, s_oh,
                        INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h[:, None] < H
    xr = x_ptr + t * s_xt + h[:, None].to(tl.int64) * s_xh
    orow = o_ptr + t * s_ot + h[:, None].to(tl.int64) * s_oh
    d = tl.arange(0, BLOCK_D)
    r = 2 * half
    keep = h_ok & (d[None, :] < D) & (d[None, :] >= r)
    tl.store(orow + d[None, :], tl.load(xr + d[None, :], mask=keep, other=0.0), mask=keep)
    i = tl.arange(0, BLOCK_R)
    m = h_ok & (i[None, :] < half)
    c = tl.load(cos_ptr + t * s_ct + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * s_st + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    i1, i2 = _pairs(i, half, INTERLEAVED)
    x1 = tl.load(xr + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xr + i2[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(orow + i1[None, :], (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=m)
    tl.store(orow + i2[None, :], (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=m)


def rotary_embedding_prefix(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            interleaved: bool = False) -> torch.Tensor:
    """Same contract as ``torch_ref_mla.rotary_embedding_prefix``: x [T, H, D] (last dim contiguous),
    cos/sin [T, R/2] float32 with R <= D. Returns a new contiguous [T, H, D] in x's dtype.

    Raises:
        ValueError: R odd-sized or wider than D.
    """
    T, H, D = x.shape
    half = cos.shape[-1]
    if 2 * half > D or sin.shape[-1] != half:
        raise ValueError(f"rotary_embedding_prefix: rotary tables {tuple(cos.shape)} do not fit head dim {D}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    block_h = min(pow2(H), 16)
    _rope_prefix_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, out, H, D, half, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0),
        out.stride(1), INTERLEAVED=bool(interleaved), BLOCK_H=block_h, BLOCK_D=pow2(D), BLOCK_R=pow2(half))
    return out


#: op name -> Triton implementation (signatures identical to the torch reference)
OPS = {"mla_kv_store": mla_kv_store, "indexer_k_store": indexer_k_store,
       "rotary_embedding_prefix": rotary_embedding_prefix}

for _name, _fn in OPS.items():
    register_op(_name, "triton", _fn)
