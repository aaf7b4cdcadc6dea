"""Plain-torch reference ops for MLA, the DSA lightning indexer and MoE: exact, CPU-capable, the truth the
Triton kernels (helper E) are tested against. Same conventions as :mod:`atomtool.serve.ops.torch_ref`
(T tokens, B sequences, paged planes ``[N, bs, *shape]``, query j of sequence b at position
``seq_lens[b] - q_len[b] + j``, float32 reductions).

Math: research/dsa.md §5 (MLA absorbed form, indexer, selection, sparse attention) and DeepSeek-V3's
``noaux_tc`` router (HF transformers ``DeepseekV3TopkRouter``, whose float32 computation these mirror).

Registered in the op dispatch (:func:`atomtool.serve.ops.get_op`) under the names ``mla_attention``,
``mla_absorb_q``, ``indexer_topk``, ``grouped_topk``, ``fused_moe``, and the fused per-token prologues ``mla_rope_store`` /
``indexer_rope_store`` and ``add_rms_norm`` (compositions of torch_ref ops, one kernel each on the Triton
backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atomtool.serve.ops import register_op
from atomtool.serve.ops.torch_ref import (
    fp8_matmul,
    gather_cache,
    query_spans,
    rms_norm,
    rotary_embedding,
    store_cache,
)


def mla_attention(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  scale: float, topk_indices: torch.Tensor | None = None,
                  w_uv: torch.Tensor | HeadWeights | None = None) -> torch.Tensor:
    """Multi-head Latent Attention over a paged latent cache, absorbed form (DeepSeek-V2 §2.1; dsa.md §5.1/5.4).

    Every query head attends to one shared latent key/value per token (MQA over the latent):
    ``logit[t,h,s] = scale * (q_nope_absorbed[t,h] · c_kv[s] + q_pe[t,h] · k_pe[s])``,
    ``o_lat[t,h] = Σ_s softmax_s(logit) c_kv[s]`` (rounded to the input dtype). With ``w_uv`` the op also
    un-absorbs: ``out[t,h] = W_UV[h] o_lat[t,h]`` (:func:`mla_output_uv`), which lets a backend fuse that
    product into its final pass; without it the caller does.

    Args:
        q_nope_absorbed: [T, H, R] (R = kv_lora_rank), ``q_nope @ W_UK`` per head.
        q_pe: [T, H, P] (P = qk_rope_head_dim), rotary already applied.
        latent_cache: [N, bs, R + P] paged plane, row = ``[c_kv | k_pe]``; the step's tokens must already be
            stored.
        cu_seqlens_q: [B+1] int32 query offsets; seq_lens: [B] int32 KV length per sequence after the step;
        block_tables: [B, M] int32, -1 padded.
        scale: softmax scale, ``qk_head_dim**-0.5 * mscale**2`` (not (R+P)**-0.5).
        topk_indices: optional [T, K] int32 request-local positions selected by the DSA indexer, -1 padded;
            query t then attends only to those positions (and still only causally). None: dense causal.
        w_uv: optional [H, dv, R] W_UV (kv_b_proj's value rows per head; the model dtype or FP8 as
            :class:`HeadWeights`; last dim contiguous).
    Returns:
        [T, H, R] in q_nope_absorbed's dtype (logits and softmax in float32), or [T, H, dv] with ``w_uv``.
    """
    T, H, R = q_nope_absorbed.shape
    check_mla_w_uv(w_uv, H, R)
    out = q_nope_absorbed.new_empty(T, H, R)
    for b, s, e, L in query_spans(cu_seqlens_q, seq_lens):
        ql = e - s
        lat = gather_cache(latent_cache, block_tables[b], L).float()
        ckv, kpe = lat[:, :R], lat[:, R:]
        scores = (torch.einsum("qhr,kr->qhk", q_nope_absorbed[s:e].float(), ckv)
                  + torch.einsum("qhp,kp->qhk", q_pe[s:e].float(), kpe)) * scale
        qpos = torch.arange(L - ql, L, device=scores.device)[:, None]
        kpos = torch.arange(L, device=scores.device)[None, :]
        invalid = kpos > qpos  # [ql, L]
        if topk_indices is not None:
            idx = topk_indices[s:e].long()
            selected = torch.zeros(ql, L + 1, dtype=torch.bool, device=scores.device)
            # -1 (padding) lands in the extra column L, which is dropped.
            selected.scatter_(1, torch.where(idx < 0, L, idx.clamp(max=L)), True)
            invalid = invalid | ~selected[:, :L]
        scores.masked_fill_(invalid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("qhk,kr->qhr", probs, ckv).to(out.dtype)
    return out if w_uv is None else mla_output_uv(out, head_weight_tensor(w_uv))


@dataclass(frozen=True)
class HeadWeights:
    """One per-head weight of MLA's absorbed form (W_UK or W_UV, DeepSeek-V2 §2.1), as stored: a float
    ``[H, rows, R]`` tensor, or FP8 e4m3 with a float32 scale per row and ``block_k`` latent columns (the
    DeepSeek-V3 FP8 block format's ``weight_scale_inv`` repeated over each block's rows; so any row block size
    works). Kernels read the FP8 bytes and widen them exactly as :meth:`dequantized` does, so the products see
    the same bf16/fp16 values either way (a rounding of ``fp8 * scale`` in float32, the ``dequant_fp8_block``
    formula), from half the bytes.

    weight: [H, rows, R], last dim contiguous (a strided view of kv_b_proj is fine); scale: None or
    [H, rows, ceil(R / block_k)] float32; dtype: the dequantized (model) dtype.
    """

    weight: torch.Tensor
    scale: torch.Tensor | None
    block_k: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantized(self) -> torch.Tensor:
        """[H, rows, R] in ``dtype`` (the weight itself when it is not FP8)."""
        if self.scale is None:
            return self.weight
        s = self.scale.repeat_interleave(self.block_k, -1)[..., : self.weight.shape[-1]]
        return (self.weight.float() * s).to(self.dtype)


def head_weight_tensor(w: torch.Tensor | HeadWeights) -> torch.Tensor:
    """The float [H, rows, R] tensor of a head weight given either way."""
    return w.dequantized() if isinstance(w, HeadWeights) else w


def check_mla_w_uv(w_uv: torch.Tensor | HeadWeights | None, H: int, R: int) -> None:
    """The ``w_uv`` argument of ``mla_attention`` (every backend): None, or [H, dv, R] (a tensor or
    :class:`HeadWeights`) with a contiguous last dim. Raises ValueError naming the shape otherwise."""
    w = w_uv.weight if isinstance(w_uv, HeadWeights) else w_uv
    if w is not None and (w.dim() != 3 or w.shape[0] != H or w.shape[2] != R or w.stride(-1) != 1):
        raise ValueError(f"mla_attention: w_uv {tuple(w.shape)} must be [H={H}, dv, R={R}] with a contiguous "
                         "last dim")


def mla_absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor | HeadWeights) -> torch.Tensor:
    """Absorb W_UK into the no-rope query (DeepSeek-V2 §2.1): ``q_abs[t, h] = q_nope[t, h] @ W_UK[h]``.

    q_nope: [T, H, dn] (any strides; the layer passes a view of q_b_proj's output); w_uk: [H, dn, R]
    (kv_b_proj's key rows per head), a tensor or :class:`HeadWeights`. Returns [T, H, R] in q_nope's dtype.
    Raises ValueError when the shapes do not fit.
    """
    w = head_weight_tensor(w_uk)
    if q_nope.dim() != 3 or w.dim() != 3 or q_nope.shape[1:] != w.shape[:2]:
        raise ValueError(f"mla_absorb_q: q_nope {tuple(q_nope.shape)} does not fit W_UK {tuple(w.shape)} "
                         "([T, H, dn] and [H, dn, R])")
    return torch.einsum("thd,hdr->thr", q_nope, w)


def mla_output_uv(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Un-absorb MLA's latent output per head: ``o[t, h] = W_UV[h] @ o_lat[t, h]`` (DeepSeek-V2 §2.1).

    o_lat: [T, H, R]; w_uv: [H, dv, R] (any strides). Returns [T, H, dv] in o_lat's dtype: one batched GEMM
    (batch = heads) written straight into the [T, H, dv] buffer (the einsum's [H, T, dv] result would need a
    copy to flatten when T > 1).
    """
    T, H, _ = o_lat.shape
    o = torch.empty((T, H, w_uv.shape[1]), dtype=o_lat.dtype, device=o_lat.device)
    torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
    return o


def check_query_rope(q: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
    """Validate :func:`indexer_topk`'s optional query rotary tables (every backend calls this).

    Raises:
        ValueError: only one of cos / sin given, or tables that do not cover q's tokens or fit its head dim.
    """
    if cos is None and sin is None:
        return
    if (cos is None or sin is None or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != q.shape[0]
            or 2 * cos.shape[1] > q.shape[-1]):
        raise ValueError(f"indexer_topk: rotary tables cos {None if cos is None else tuple(cos.shape)} / sin "
                         f"{None if sin is None else tuple(sin.shape)} do not fit q {tuple(q.shape)}")


def index_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The indexer's rope: rotary on the first ``R = 2 * cos.shape[-1]`` dims of every head ("pe first"), the
    rest unchanged. x: [T, Hi, Di] queries (or [T, 1, Di] keys); cos, sin: [T, R/2] float32. Returns x's shape
    and dtype."""
    r = 2 * cos.shape[-1]
    return torch.cat((rotary_embedding(x[..., :r], cos, sin, interleaved), x[..., r:]), dim=-1)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_k_cache: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 topk: int, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                 interleaved: bool = False) -> torch.Tensor:
    """DSA lightning-indexer scores and deterministic top-k selection (DeepSeek-V3.2; dsa.md §5.2-5.3).

    ``I[t,s] = Σ_h weights[t,h] · ReLU(q[t,h] · k[s])`` over the sequence's cached index keys ``k[s]`` with
    ``s <= pos(t)`` (causal). ``weights`` carry every scale (HF: ``weights_proj(x) · Hi^-0.5 · Di^-0.5``;
    ReLU commutes with the positive ``Di^-0.5``).

    Selection: a query with at most ``topk`` valid keys selects all of them (dense). Otherwise the ``topk``
    largest scores; ties go to the lowest position (stable sort), so results are reproducible and batch-
    independent. Each row lists its selected positions in ascending order, then -1 padding.

    Args:
        q: [T, Hi, Di] index queries (rotary applied, or rotated here when cos / sin are given);
        weights: [T, Hi] float32;
        index_k_cache: [N, bs, Di] paged plane holding every cached token's index key (this step's included);
        cu_seqlens_q, seq_lens, block_tables: as in :func:`mla_attention`; topk: K;
        cos, sin: [T, R/2] float32 or None: the query rope of :func:`indexer_rope_store`
        (:func:`index_rope`) applied first, with ``interleaved`` pairing.
    Returns:
        [T, K] int32 request-local positions, -1 padded.
    Raises:
        ValueError: rotary tables that do not fit q (:func:`check_query_rope`).
    """
    check_query_rope(q, cos, sin)
    if cos is not None and cos.shape[-1]:
        q = index_rope(q, cos, sin, interleaved)
    T = q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    for b, s, e, L in query_spans(cu_seqlens_q, seq_lens):
        ql = e - s
        qpos = torch.arange(L - ql, L, device=q.device)
        if L <= topk:  # every row has <= K valid keys: select all causally visible positions
            pos = torch.arange(topk, device=q.device)[None, :].expand(ql, topk)
            out[s:e] = torch.where(pos <= qpos[:, None], pos, -1).to(torch.int32)
            continue
        k = gather_cache(index_k_cache, block_tables[b], L).float()  # [L, Di]
        logits = torch.einsum("qhd,kd->qhk", q[s:e].float(), k)
        scores = torch.einsum("qh,qhk->qk", weights[s:e].float(), F.relu(logits))
        invalid = torch.arange(L, device=q.device)[None, :] > qpos[:, None]
        scores.masked_fill_(invalid, float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
        valid = ~invalid.gather(1, order)
        sel = torch.where(valid, order, L)  # invalid -> sentinel L, sorted last
        sel = torch.sort(sel, dim=-1).values
        out[s:e] = torch.where(sel >= L, -1, sel).to(torch.int32)
    return out


def grouped_topk(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor | None, top_k: int,
                 n_group: int, topk_group: int, norm_topk_prob: bool,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ``noaux_tc`` MoE routing (DeepSeek-V3 report §2.1.2; HF ``DeepseekV3TopkRouter``).

    ``scores = sigmoid(logits)``; the choice uses ``scores + bias``: each of ``n_group`` expert groups is
    rated by the sum of its two best biased scores, the best ``topk_group`` groups stay eligible, and the
    ``top_k`` best eligible experts are chosen (ties -> lowest expert id). Weights are the *unbiased* scores
    of the chosen experts, normalised to sum 1 when ``norm_topk_prob`` (+1e-20, as HF), then multiplied by
    ``routed_scaling_factor``.

    Args:
        router_logits: [T, E] (computed in float32); e_score_correction_bias: [E] float32 or None.
    Returns:
        (weights [T, top_k] float32, ids [T, top_k] int64), experts in descending choice order.
    """
    scores = router_logits.float().sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    T, E = choice.shape
    if n_group > 1 and topk_group < n_group:
        per = E // n_group
        grouped = choice.view(T, n_group, per)
        group_scores = torch.sort(grouped, dim=-1, descending=True).values[..., : min(2, per)].sum(-1)
        keep = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(per, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def check_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, w13_scale_inv: torch.Tensor | None,
                    w2_scale_inv: torch.Tensor | None) -> None:
    """The shapes ``fused_moe`` (every backend) accepts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights
    and topk_ids both [T, k], both scales or neither. Raises ValueError naming what does not fit."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x {tuple(x.shape)} must be [T, H], w13 {tuple(w13.shape)} [E, 2I, H] and "
                         f"w2 {tuple(w2.shape)} [E, H, I]")
    T, H = x.shape
    E, two_i, H1 = w13.shape
    if H1 != H or w2.shape[0] != E or w2.shape[1] != H or w2.shape[2] * 2 != two_i:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"fused_moe: topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} must both be [T={T}, k]")
    if (w13_scale_inv is None) != (w2_scale_inv is None):
        raise ValueError("fused_moe: give both w13_scale_inv and w2_scale_inv, or neither")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale_inv: torch.Tensor | None = None,
              w2_scale_inv: torch.Tensor | None = None, block_size: tuple[int, int] = (128, 128),
              act_quant: str | None = None, sum_slots: bool = True) -> torch.Tensor:
    """Routed SwiGLU experts: ``y[t] = Σ_j w[t,j] · W2[e] (silu(G[e] x[t]) * U[e] x[t])``, ``e = ids[t,j]``.

    x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]; topk_weights: [T, k] float32;
    topk_ids: [T, k] int. FP8 block experts: w13/w2 float8_e4m3fn with ``w13_scale_inv``
    [E, ceil(2I/bn), ceil(H/bk)] and ``w2_scale_inv`` [E, ceil(H/bn), ceil(I/bk)] float32, ``block_size``
    (bn, bk); each hit expert is dequantized (``W = fp8 * scale_inv[i // bn, j // bk]``). Experts are visited
    in ascending id and accumulated in x's dtype (HF ``DeepseekV3Experts`` order). ``act_quant``: W8A8 for
    FP8 experts (``torch_ref.fp8_matmul``). Returns [T, H] in x's dtype; ``sum_slots=False``: float32
    planes [S, T, H] whose in-order sum rounded to x's dtype is that output (here one plane; the Triton op's
    are its per-slot outputs), for :func:`add_rms_norm` to sum. Raises ValueError for shapes that do not fit
    (:func:`check_fused_moe`).
    """
    check_fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv)
    out = torch.zeros_like(x)
    E = w13.shape[0]
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        if e < 0 or e >= E:
            continue
        tok, slot = torch.where(ids == e)
        if w13_scale_inv is not None:
            g, u = fp8_matmul(x[tok], w13[e], w13_scale_inv[e], block_size, act_quant).chunk(2, dim=-1)
            y = fp8_matmul(F.silu(g) * u, w2[e], w2_scale_inv[e], block_size, act_quant)
        else:
            g, u = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, w2[e])
        # weighted in float32, rounded once (HF: bf16 activations * fp32 router weights promote to fp32)
        y = y.float() * topk_weights[tok, slot, None].float()
        out.index_add_(0, tok, y.to(out.dtype))
    return out if sum_slots else out.float().unsqueeze(0)


def mla_rope_store(q_pe: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, latent_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """MLA's per-token work between its projections and attention, as one op: the query rope, and the latent
    cache row ``[RMSNorm(c_kv) | rope(k_pe)]`` written to its slot (DeepSeek-V2 §2.1; HF ``kv_a_layernorm`` +
    ``apply_rotary_pos_emb``).

    Exactly :func:`rotary_embedding` of q_pe, and :func:`store_cache` of the concatenation of
    :func:`rms_norm` of kv's first R dims and :func:`rotary_embedding` of its last P dims (fused so a decode
    step does not launch two rotaries, a norm, a concatenation and a store per layer).

    q_pe: [T, H, P] (the rope slice of the query heads, a view is fine); kv: [T, R + P]
    (``kv_a_proj_with_mqa`` output, a column slice of a wider row is fine); norm_weight: [R]; cos, sin:
    [T, P/2] float32; latent_cache: [N, bs, R + P]; slot_mapping: [T] int64 (``-1``: not stored).
    Returns the rotated q_pe [T, H, P] (a new tensor, q_pe's dtype).
    """
    R = norm_weight.shape[0]
    c_kv = rms_norm(kv[:, :R], norm_weight, eps)
    k_pe = rotary_embedding(kv[:, None, R:], cos, sin, interleaved)[:, 0]
    store_cache(torch.cat((c_kv, k_pe), dim=-1), latent_cache, slot_mapping)
    return rotary_embedding(q_pe, cos, sin, interleaved)


def indexer_rope_store(q: torch.Tensor | None, k_raw: torch.Tensor, w_raw: torch.Tensor, weight_scale: float,
                       ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float, cos: torch.Tensor | None,
                       sin: torch.Tensor | None, interleaved: bool, index_k_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The DSA lightning indexer's per-token work before scoring, as one op (HF ``DeepseekV32Indexer``).

    - keys: ``k = LayerNorm(k_raw)`` (with bias; computed in float32, rounded to k_raw's dtype), rotary on
      its *first* ``R = 2 * cos.shape[-1]`` dims ("pe first"; none when cos is None), stored to the
      ``index_k`` plane with :func:`store_cache`;
    - queries: the same rope on the first R dims of every head, the rest unchanged (:func:`index_rope`;
      q None: no queries, as the engine calls it: it rotates them inside :func:`indexer_topk` instead);
    - head weights: ``float32(w_raw) * weight_scale`` (dsa.md §5.2: float32 before scaling).

    q: [T, Hi, Di] or None; k_raw: [T, Di]; w_raw: [T, Hi] (any float dtype); ln_weight, ln_bias: [Di];
    cos, sin: [T, R/2] float32 or None; index_k_cache: [N, bs, Di]; slot_mapping: [T] int64 (``-1`` skipped).
    Returns (rotated q [T, Hi, Di] in q's dtype or None, weights [T, Hi] float32).
    """
    D = k_raw.shape[-1]
    k = F.layer_norm(k_raw.float(), (D,), ln_weight.float(), ln_bias.float(), eps).to(k_raw.dtype)
    if cos is not None and cos.shape[-1]:
        k = index_rope(k[:, None], cos, sin, interleaved)[:, 0]
        if q is not None:
            q = index_rope(q, cos, sin, interleaved)
    store_cache(k, index_k_cache, slot_mapping)
    return q, w_raw.float() * weight_scale


def check_add_rms_norm(x: torch.Tensor, extra: torch.Tensor | None, weight: torch.Tensor,
                       residual: torch.Tensor) -> None:
    """Raise ValueError unless ``add_rms_norm``'s inputs fit: residual [T, H], extra None or [T, H] of its
    dtype, weight [H], x [T, H] of that dtype or [S >= 1, T, H] float32 planes."""
    planes = x.dim() == 3
    e_shape = residual.shape if extra is None else extra.shape
    if (x.dim() not in (2, 3) or x.shape[-2:] != e_shape or e_shape != residual.shape
            or residual.dim() != 2 or residual.shape[-1] != weight.shape[0] or (planes and x.shape[0] == 0)):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, extra {tuple(e_shape)}, residual "
                         f"{tuple(residual.shape)} and weight {tuple(weight.shape)} do not fit")
    e_dtype = residual.dtype if extra is None else extra.dtype
    if e_dtype != residual.dtype or x.dtype != (torch.float32 if planes else residual.dtype):
        raise ValueError(f"add_rms_norm: dtypes {x.dtype}{' planes' if planes else ''}, {e_dtype}, "
                         f"{residual.dtype} differ (planes are float32)")


def add_rms_norm(x: torch.Tensor, extra: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block's output combination fused into the next RMSNorm's residual add:
    ``s = residual + (x + extra)`` (``x + extra`` rounded to the dtype first, as the unfused model adds
    ``routed + shared`` and then the residual), returns ``(rms_norm(s), s)`` like :func:`rms_norm` with a
    residual. extra, residual: [T, H] same dtype (extra None: nothing added, :func:`rms_norm` with a residual);
    weight: [H]; x: [T, H] of that dtype, or [S, T, H] float32 planes (``fused_moe(..., sum_slots=False)``, a
    split-K ``linear(..., sum_splits=False)``) summed in plane order and rounded to the dtype first.
    Raises ValueError for inputs that do not fit (:func:`check_add_rms_norm`)."""
    check_add_rms_norm(x, extra, weight, residual)
    if x.dim() == 3:
        acc = x[0]
        for plane in x[1:]:
            acc = acc + plane
        x = acc.to(residual.dtype)
    return rms_norm(x if extra is None else x + extra, weight, eps, residual)


for _name, _fn in (("mla_attention", mla_attention), ("mla_absorb_q", mla_absorb_q), ("indexer_topk", indexer_topk), ("grouped_topk", grouped_topk),
                   ("fused_moe", fused_moe), ("mla_rope_store", mla_rope_store),
                   ("indexer_rope_store", indexer_rope_store), ("add_rms_norm", add_rms_norm)):
    register_op(_name, "torch", _fn)
