"""Fused per-token prologues of the MLA / DSA attention, in Triton: one launch where the reference composes
several (issue 7: a decode step is bound by the count of tiny kernels).

- ``mla_rope_store``: rope of the query's rope slice, and the latent cache row ``[RMSNorm(c_kv) | rope(k_pe)]``
  written straight to its slot (was: two rotaries, rms_norm, cat, store_cache);
- ``indexer_rope_store``: the DSA index key ``rope(LayerNorm(k))`` ("pe first") written to its slot, the same
  rope on the index queries, and the float32 scaled head weights (was: casts, layer_norm, two rotaries, two
  cats, store_cache, cast, multiply);
- ``qk_rope_store_kv`` (dense GQA models): optional per-head q/k RMSNorm (Qwen3), rope on q and k, K/V
  written to their slots (was: up to two norms, two rotaries and two stores).

Grid ``(T, 1 + head blocks)``: program ``(t, 0)`` does token t's cache row (and head weights), programs
``(t, j > 0)`` one block of its query heads (``qk_rope_store_kv``: query head blocks, then KV head blocks), so a row never depends on the other rows of the batch and a
batch-1 step still spreads over several programs. The arithmetic repeats the unfused kernels' (norm.py,
rotary.py): float32 math, the RMSNorm value rounded to the activation dtype before the weight (HF order),
the LayerNorm value rounded after the affine map (rope then runs on the rounded values), one rounding per
stored value. Same signatures as the references in :mod:`atomtool.serve.ops.torch_ref_mla`; registered on
import (``register_op``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops import register_op
from atomtool.serve.ops.triton._common import grid_dependency_wait, launch_pdl_args, pow2

#: query heads per program of the query-rope part
BLOCK_HEADS = 16


@triton.jit
def _pairs(i, half, INTERLEAVED: tl.constexpr):
    """Offsets of the rotary pairs ``i`` within a rotary slice: (2i, 2i+1) or (i, i + half)."""
    if INTERLEAVED:
        return 2 * i, 2 * i + 1
    else:
        return i, i + half


@triton.jit
def _rope_heads(x_ptr, o_ptr, t, h0, H, D, half, s_xt, s_xh, s_ot, s_oh, cos_ptr, sin_ptr, s_ct, s_st,
                INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Heads ``h0 .. h0 + BLOCK_H`` of token t: o = x with its first ``2 * half`` dims rotated (rotary.py's
    arithmetic) and dims ``2 * half .. D`` copied (none when D == 2 * half; BLOCK_D 0 skips the copy)."""
    h = h0 + tl.arange(0, BLOCK_H)
    h_ok = h[:, None] < H
    xr = x_ptr + t * s_xt + h[:, None].to(tl.int64) * s_xh
    orow = o_ptr + t * s_ot + h[:, None].to(tl.int64) * s_oh
    if BLOCK_D > 0:
        d = tl.arange(0, BLOCK_D)
        keep = h_ok & (d[None, :] < D) & (d[None, :] >= 2 * half)
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


@triton.jit
def _mla_rope_store_kernel(q_ptr, qo_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, c_ptr, slot_ptr, H, R, half,
                           s_qt, s_qh, s_ot, s_oh, s_kv, s_ct, s_st, s_cs, eps, INTERLEAVED: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    if j > 0:
        _rope_heads(q_ptr, qo_ptr, t, (j - 1) * BLOCK_H, H, 2 * half, half, s_qt, s_qh, s_ot, s_oh, cos_ptr,
                    sin_ptr, s_ct, s_st, INTERLEAVED, BLOCK_H, 0, BLOCK_P)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # -1: padding token, nothing stored
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


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def mla_rope_store(q_pe: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, latent_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """Same contract as ``torch_ref_mla.mla_rope_store``: q_pe [T, H, P] and kv [T, R + P] (last dims
    contiguous or copied so), norm_weight [R], cos/sin [T, P/2] float32, latent_cache [N, bs, R + P]
    contiguous, slot_mapping [T] (-1 skipped). Returns the rotated q_pe, a new contiguous [T, H, P].

    Raises:
        ValueError: widths that do not fit the cache or the tables, or a non-contiguous cache.
    """
    T, W = kv.shape
    H, P = q_pe.shape[1], q_pe.shape[2]
    R = norm_weight.shape[0]
    if (latent_cache.shape[-1] != W or W != R + P or P % 2 or q_pe.shape[0] != T
            or cos.shape[-1] != P // 2 or sin.shape[-1] != P // 2):
        raise ValueError(f"mla_rope_store: q_pe {tuple(q_pe.shape)}, kv {tuple(kv.shape)}, norm weight [{R}], "
                         f"cos {tuple(cos.shape)} do not fit latent cache {tuple(latent_cache.shape)}")
    if not latent_cache.is_contiguous():
        raise ValueError("mla_rope_store: the cache plane must be contiguous")
    out = torch.empty((T, H, P), dtype=q_pe.dtype, device=q_pe.device)
    if T == 0:
        return out
    if kv.dtype != norm_weight.dtype:  # an unusual dtype mix: keep the promotion rules of the reference
        from atomtool.serve.ops.triton.attention import store_cache
        from atomtool.serve.ops.triton.norm import rms_norm
        from atomtool.serve.ops.triton.rotary import rotary_embedding

        c_kv = rms_norm(kv[:, :R], norm_weight, eps)
        k_pe = rotary_embedding(kv[:, None, R:], cos, sin, interleaved)[:, 0]
        store_cache(torch.cat((c_kv, k_pe), dim=-1), latent_cache, slot_mapping)
        return rotary_embedding(q_pe, cos, sin, interleaved)
    q_pe, kv, cos, sin = (_row_major(t) for t in (q_pe, kv, cos, sin))
    block_r = pow2(R)
    block_h = min(pow2(H), BLOCK_HEADS)
    _mla_rope_store_kernel[(T, 1 + triton.cdiv(H, block_h))](
        q_pe, out, kv, norm_weight, cos, sin, latent_cache, slot_mapping, H, R, P // 2, q_pe.stride(0),
        q_pe.stride(1), out.stride(0), out.stride(1), kv.stride(0), cos.stride(0), sin.stride(0), W, float(eps),
        INTERLEAVED=bool(interleaved), BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=pow2(P // 2),
        num_warps=4 if block_r <= 2048 else 8, **launch_pdl_args(q_pe.device))
    return out


@triton.jit
def _indexer_rope_store_kernel(q_ptr, qo_ptr, k_ptr, wr_ptr, wo_ptr, lw_ptr, lb_ptr, cos_ptr, sin_ptr, c_ptr,
                               slot_ptr, H, D, half, s_qt, s_qh, s_ot, s_oh, s_k, s_wr, s_wo, s_ct, s_st, s_cs,
                               scale, eps, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_HW: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_QD: tl.constexpr,
                               BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    if j > 0:
        if BLOCK_P > 0:
            _rope_heads(q_ptr, qo_ptr, t, (j - 1) * BLOCK_H, H, D, half, s_qt, s_qh, s_ot, s_oh, cos_ptr,
                        sin_ptr, s_ct, s_st, INTERLEAVED, BLOCK_H, BLOCK_QD, BLOCK_P)
    else:
        # head weights: float32(w_raw) * scale
        hw = tl.arange(0, BLOCK_HW)
        wv = tl.load(wr_ptr + t * s_wr + hw, mask=hw < H, other=0.0).to(tl.float32)
        tl.store(wo_ptr + t * s_wo + hw, wv * scale, mask=hw < H)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            row = k_ptr + t * s_k
            dst = c_ptr + slot * s_cs
            dt = k_ptr.dtype.element_ty
            offs = tl.arange(0, BLOCK_D)
            m = offs < D
            x = tl.load(row + offs, mask=m, other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=0) / D
            xc = tl.where(m, x - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)
            w = tl.load(lw_ptr + offs, mask=m, other=0.0).to(tl.float32)
            b = tl.load(lb_ptr + offs, mask=m, other=0.0).to(tl.float32)
            y = (xc * rstd * w + b).to(dt)
            tl.store(dst + offs, y.to(c_ptr.dtype.element_ty), mask=m & (offs >= 2 * half))  # rope-free dims
            if BLOCK_P > 0:
                i = tl.arange(0, BLOCK_P)
                pm = i < half
                c = tl.load(cos_ptr + t * s_ct + i, mask=pm, other=0.0).to(tl.float32)
                s = tl.load(sin_ptr + t * s_st + i, mask=pm, other=0.0).to(tl.float32)
                i1, i2 = _pairs(i, half, INTERLEAVED)
                # the normed values at the pair offsets, recomputed with the expression above
                x1 = tl.load(row + i1, mask=pm, other=0.0).to(tl.float32) - mean
                x2 = tl.load(row + i2, mask=pm, other=0.0).to(tl.float32) - mean
                y1 = (x1 * rstd * tl.load(lw_ptr + i1, mask=pm, other=0.0).to(tl.float32)
                      + tl.load(lb_ptr + i1, mask=pm, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
                y2 = (x2 * rstd * tl.load(lw_ptr + i2, mask=pm, other=0.0).to(tl.float32)
                      + tl.load(lb_ptr + i2, mask=pm, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
                tl.store(dst + i1, (y1 * c - y2 * s).to(dt).to(c_ptr.dtype.element_ty), mask=pm)
                tl.store(dst + i2, (y2 * c + y1 * s).to(dt).to(c_ptr.dtype.element_ty), mask=pm)


def indexer_rope_store(q: torch.Tensor | None, k_raw: torch.Tensor, w_raw: torch.Tensor, weight_scale: float,
                       ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float, cos: torch.Tensor | None,
                       sin: torch.Tensor | None, interleaved: bool, index_k_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Same contract as ``torch_ref_mla.indexer_rope_store``: q [T, Hi, Di] or None (keys and head weights
    only: one program per token), k_raw [T, Di], w_raw [T, Hi]
    (last dims contiguous or copied so), ln_weight/ln_bias [Di], cos/sin [T, R/2] float32 or None (no rope:
    q is returned as given), index_k_cache [N, bs, Di] contiguous, slot_mapping [T] (-1 skipped).
    Returns (rotated q, a new contiguous [T, Hi, Di], or None; weights [T, Hi] float32).

    Raises:
        ValueError: widths that do not fit the cache or the tables, or a non-contiguous cache.
    """
    T, D = k_raw.shape
    H = w_raw.shape[-1]
    half = 0 if cos is None else cos.shape[-1]
    if (index_k_cache.shape[-1] != D or 2 * half > D or (half and sin.shape[-1] != half)
            or (q is not None and tuple(q.shape) != (T, H, D)) or tuple(w_raw.shape) != (T, H)):
        raise ValueError(f"indexer_rope_store: q {None if q is None else tuple(q.shape)}, k {tuple(k_raw.shape)}, head weights "
                         f"{tuple(w_raw.shape)} and rotary tables of {half} do not fit index_k cache "
                         f"{tuple(index_k_cache.shape)}")
    if not index_k_cache.is_contiguous():
        raise ValueError("indexer_rope_store: the cache plane must be contiguous")
    weights = torch.empty((T, H), dtype=torch.float32, device=k_raw.device)
    if T == 0:
        return q, weights
    k_raw, w_raw = _row_major(k_raw), _row_major(w_raw)
    q_in = k_raw.view(T, 1, D) if q is None else _row_major(q)  # dummy pointer without queries, never read
    if half:
        cos, sin = _row_major(cos), _row_major(sin)
        q_out = q_in if q is None else torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    else:
        cos = sin = ln_weight  # dummy pointers, never read
        q_out = q_in
    block_h = min(pow2(H), BLOCK_HEADS)
    q_blocks = triton.cdiv(H, block_h) if half and q is not None else 0
    _indexer_rope_store_kernel[(T, 1 + q_blocks)](
        q_in, q_out, k_raw, w_raw, weights, ln_weight, ln_bias, cos, sin, index_k_cache, slot_mapping, H, D, half,
        q_in.stride(0), q_in.stride(1), q_out.stride(0), q_out.stride(1), k_raw.stride(0), w_raw.stride(0),
        weights.stride(0), cos.stride(0) if half else 0, sin.stride(0) if half else 0, D, float(weight_scale),
        float(eps), INTERLEAVED=bool(interleaved), BLOCK_H=block_h, BLOCK_HW=pow2(H),
        BLOCK_D=pow2(D), BLOCK_QD=pow2(D) if 2 * half < D else 0, BLOCK_P=pow2(half) if half else 0,
        num_warps=4, **launch_pdl_args(k_raw.device))
    return (None if q is None else q_out), weights


@triton.jit
def _norm_rope_heads(src, s_h, dst, d_h, w_ptr, h0, nh, D, half, cos_row, sin_row, eps,
                     HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Heads ``h0 .. h0 + BLOCK_H`` (of ``nh``) of one token: optional RMSNorm over the head dim (norm.py's
    arithmetic, rounded to the dtype at the same points), then rope over the whole head (rotary.py's)."""
    h = h0 + tl.arange(0, BLOCK_H)
    hm = h[:, None] < nh
    rows = src + h[:, None].to(tl.int64) * s_h
    orows = dst + h[:, None].to(tl.int64) * d_h
    dt = src.dtype.element_ty
    i = tl.arange(0, BLOCK_R)
    m = hm & (i[None, :] < half)
    c = tl.load(cos_row + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_row + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    i1, i2 = _pairs(i, half, INTERLEAVED)
    x1 = tl.load(rows + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(rows + i2[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        d = tl.arange(0, BLOCK_D)
        x = tl.load(rows + d[None, :], mask=hm & (d[None, :] < D), other=0.0).to(tl.float32)
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
        w1 = tl.load(w_ptr + i1, mask=i < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + i2, mask=i < half, other=0.0).to(tl.float32)[None, :]
        nt = w_ptr.dtype.element_ty  # rms_norm's output dtype (x's and weight's are the same here)
        x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(nt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(nt).to(tl.float32)
    tl.store(orows + i1[None, :], (x1 * c - x2 * s).to(dt).to(dst.dtype.element_ty), mask=m)
    tl.store(orows + i2[None, :], (x2 * c + x1 * s).to(dt).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _qk_rope_store_kv_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                             slot_ptr, H, Hkv, D, Dv, half, nqb, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
                             s_ct, s_st, s_kcs, s_kch, s_vcs, s_vch, eps, HAS_NORM: tl.constexpr,
                             INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr = False):
    grid_dependency_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cos_row = cos_ptr + t * s_ct
    sin_row = sin_ptr + t * s_st
    if j < nqb:  # a block of query heads
        _norm_rope_heads(q_ptr + t * s_qt, s_qh, qo_ptr + t * s_ot, s_oh, qw_ptr, j * BLOCK_H, H, D, half,
                         cos_row, sin_row, eps, HAS_NORM, INTERLEAVED, BLOCK_H, BLOCK_D, BLOCK_R)
    else:  # a block of KV heads: k normed + rotated, v as is, into the token's slot
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            h0 = (j - nqb) * BLOCK_H
            _norm_rope_heads(k_ptr + t * s_kt, s_kh, kc_ptr + slot * s_kcs, s_kch, kw_ptr, h0, Hkv, D, half,
                             cos_row, sin_row, eps, HAS_NORM, INTERLEAVED, BLOCK_H, BLOCK_D, BLOCK_R)
            h = h0 + tl.arange(0, BLOCK_H)
            dv = tl.arange(0, BLOCK_DV)
            vm = (h[:, None] < Hkv) & (dv[None, :] < Dv)
            val = tl.load(v_ptr + t * s_vt + h[:, None].to(tl.int64) * s_vh + dv[None, :], mask=vm)
            tl.store(vc_ptr + slot * s_vcs + h[:, None].to(tl.int64) * s_vch + dv[None, :],
                     val.to(vc_ptr.dtype.element_ty), mask=vm)


def qk_rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor | None,
                     k_norm_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """Same contract as ``torch_ref.qk_rope_store_kv``: q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv] (last dims
    contiguous or copied so), norm weights [D] or None, cos/sin [T, D/2] float32, k_cache [N, bs, Hkv, D] and
    v_cache [N, bs, Hkv, Dv] contiguous, slot_mapping [T] (-1 skipped). Returns the rotated q, a new
    contiguous [T, H, D].

    Raises:
        ValueError: shapes that do not fit (rope over a part of the head is not supported), or a
            non-contiguous cache.
    """
    T, H, D = q.shape
    Hkv, Dv = v.shape[1], v.shape[2]
    half = cos.shape[-1]
    if (2 * half != D or sin.shape[-1] != half or tuple(k.shape) != (T, Hkv, D) or v.shape[0] != T
            or tuple(k_cache.shape[2:]) != (Hkv, D) or tuple(v_cache.shape[2:]) != (Hkv, Dv)
            or (q_norm_weight is None) != (k_norm_weight is None)):
        raise ValueError(f"qk_rope_store_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, rotary "
                         f"tables {tuple(cos.shape)} do not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} (or only one q/k norm weight)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("qk_rope_store_kv: the cache planes must be contiguous")
    has_norm = q_norm_weight is not None
    if has_norm and q.dtype != q_norm_weight.dtype:  # an unusual dtype mix: the reference's promotion rules
        from atomtool.serve.ops.triton.attention import store_kv
        from atomtool.serve.ops.triton.norm import rms_norm
        from atomtool.serve.ops.triton.rotary import rotary_embedding

        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
        q, k = rotary_embedding(q, cos, sin, interleaved), rotary_embedding(k, cos, sin, interleaved)
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    q, k, v, cos, sin = (_row_major(t) for t in (q, k, v, cos, sin))
    block_h = min(pow2(max(H, Hkv)), BLOCK_HEADS)
    nqb = triton.cdiv(H, block_h)
    w = q_norm_weight if has_norm else cos  # dummy pointers when there is no norm
    _qk_rope_store_kv_kernel[(T, nqb + triton.cdiv(Hkv, block_h))](
        q, k, v, out, k_cache, v_cache, w, k_norm_weight if has_norm else cos, cos, sin, slot_mapping,
        H, Hkv, D, Dv, half, nqb, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), cos.stride(0), sin.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), float(eps), HAS_NORM=has_norm, INTERLEAVED=bool(interleaved),
        BLOCK_H=block_h, BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv), BLOCK_R=pow2(half), **launch_pdl_args(q.device))
    return out


#: op name -> Triton implementation (signatures identical to the torch reference)
OPS = {"mla_rope_store": mla_rope_store, "indexer_rope_store": indexer_rope_store,
       "qk_rope_store_kv": qk_rope_store_kv}

for _name, _fn in OPS.items():
    register_op(_name, "triton", _fn)
