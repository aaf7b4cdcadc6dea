"""DeepSeek-V3 ``noaux_tc`` MoE routing (``grouped_topk``) in one Triton launch.

Same contract as :func:`atomtool.serve.ops.torch_ref_mla.grouped_topk` (DeepSeek-V3 report §2.1.2, HF
``DeepseekV3TopkRouter``): ``scores = sigmoid(logits)``, choice ``= scores + bias``; each of ``n_group``
groups is rated by the sum of its two best choice values, the ``topk_group`` best groups stay eligible (ties
-> lowest group index, as the reference's stable sort), the ``top_k`` best experts are chosen with the other
groups' experts at ``-inf`` (ties -> lowest expert id), and the weights are the unbiased scores of the
chosen experts, normalised (+1e-20) and scaled by ``routed_scaling_factor``.

The torch path costs about ten launches per MoE layer (a float radix sort among them); here one program
owns one token: its E logits sit in registers as an ``[n_group, E / n_group]`` tile, the group ranking and
the expert choice are iterative arg-max passes (max, then the lowest index reaching it), so no sort and
no host sync (CUDA-graph capturable).

Bits: the sigmoid is ``1 / (1 + exp(-x))`` with the IEEE division and the libdevice ``exp`` (what torch's
CUDA kernel computes), so the scores, and hence the choice, equal the reference's. The normalising sum adds
the k weights in the order of torch's CUDA row reduction for k <= 32 (adjacent pairs, then pairs of pairs;
for k not a power of two the elements past the largest power of two p <= k are first added to those p
places before), so on CUDA the weights are expected to match bitwise; elsewhere (CPU reference,
interpreter) they agree to float32 rounding of that sum. NaN logits give unspecified choices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from atomtool.serve.ops.triton._common import interpreting, pow2


@triton.jit
def _pair_sums(v, HALF: tl.constexpr):
    """[2 * HALF] -> [HALF]: ``v[2i] + v[2i + 1]``."""
    return tl.sum(tl.reshape(v, [HALF, 2]), axis=1)


@triton.jit
def _pairwise_tree(v, N: tl.constexpr):
    """Sum of ``v`` [N] (N a power of two <= 32) as a warp's shuffle-down reduction adds it: adjacent pairs,
    then adjacent pairs of those, and so on."""
    if N >= 32:
        v = _pair_sums(v, 16)
    if N >= 16:
        v = _pair_sums(v, 8)
    if N >= 8:
        v = _pair_sums(v, 4)
    if N >= 4:
        v = _pair_sums(v, 2)
    if N >= 2:
        v = _pair_sums(v, 1)
    return tl.sum(v, axis=0)


@triton.jit
def _row_sum(v, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Sum of ``v[:K]`` (``v`` [BLOCK_K], zeros past K) in the order of torch's CUDA inner-dim reduction
    of a K-wide row (K <= 32): fold the tail onto the largest power of two, then a pairwise tree."""
    if BLOCK_K != K:  # K not a power of two: thread i of the reduction first adds v[i] and v[i + BLOCK_K/2]
        return _pairwise_tree(tl.sum(tl.reshape(v, [2, BLOCK_K // 2]), axis=0), BLOCK_K // 2)
    else:
        return _pairwise_tree(v, BLOCK_K)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, n_group, per, s_lt, s_w, s_id, scale,
    TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, EXACT_EXP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    p = tl.arange(0, BLOCK_P)
    ok = (g[:, None] < n_group) & (p[None, :] < per)
    e = g[:, None] * per + p[None, :]  # expert id of each lane (meaningful where ok)
    x = tl.load(logits_ptr + t * s_lt + e, mask=ok, other=0.0).to(tl.float32)
    if EXACT_EXP:
        ex = libdevice.exp(-x)
    else:  # Triton's interpreter has no libdevice; NumPy's exp there
        ex = tl.exp(-x)
    one = tl.full([BLOCK_G, BLOCK_P], 1.0, tl.float32)
    s = tl.math.div_rn(one, one + ex)
    c = s
    if HAS_BIAS:
        c = s + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    ninf = float("-inf")
    big = 1 << 30
    c = tl.where(ok, c, ninf)
    if GROUPED:
        # group score: sum of the two best choice values of the group (one occurrence removed, so a tie
        # at the top counts twice, as in the reference's sorted values[:2])
        m1 = tl.max(c, axis=1)
        i1 = tl.min(tl.where(c == m1[:, None], p[None, :], big), axis=1)
        m2 = tl.max(tl.where(p[None, :] == i1[:, None], ninf, c), axis=1)
        gs = tl.where(per >= 2, m1 + m2, m1)
        g_avail = g < n_group
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            mg = tl.max(tl.where(g_avail, gs, ninf), axis=0)
            ig = tl.min(tl.where(g_avail & (gs == mg), g, big), axis=0)
            keep = keep | (g == ig)
            g_avail = g_avail & (g != ig)
        c = tl.where(keep[:, None], c, ninf)
    avail = ok
    kk = tl.arange(0, BLOCK_K)
    wv = tl.zeros([BLOCK_K], tl.float32)
    iv = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):
        cm = tl.where(avail, c, ninf)
        m = tl.max(tl.max(cm, axis=1), axis=0)
        hit = avail & (cm == m)
        idx = tl.min(tl.min(tl.where(hit, e, big), axis=1), axis=0)
        sel = ok & (e == idx)
        w = tl.max(tl.max(tl.where(sel, s, ninf), axis=1), axis=0)
        wv = tl.where(kk == j, w, wv)
        iv = tl.where(kk == j, idx.to(tl.int64), iv)
        avail = avail & (e != idx)
    if NORM:
        den = _row_sum(wv, TOP_K, BLOCK_K) + 1e-20
        wv = tl.math.div_rn(wv, tl.full([BLOCK_K], 0.0, tl.float32) + den)
    wv = wv * scale
    km = kk < TOP_K
    tl.store(w_ptr + t * s_w + kk, wv, mask=km)
    tl.store(ids_ptr + t * s_id + kk, iv, mask=km)


def grouped_topk(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor | None, top_k: int,
                 n_group: int, topk_group: int, norm_topk_prob: bool,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ``noaux_tc`` routing; the contract of ``torch_ref_mla.grouped_topk`` (see module doc).

    Args:
        router_logits: [T, E] float (read as float32; last dim contiguous or not).
        e_score_correction_bias: [E] or None.
        top_k: experts per token (at most 32 with ``norm_topk_prob``); the reference returns
            ``min(top_k, E)`` columns and so does this.
        n_group, topk_group: expert groups and eligible groups (no group stage when ``n_group <= 1`` or
            ``topk_group >= n_group``, as the reference).
    Returns:
        (weights [T, k] float32, ids [T, k] int64), experts in descending choice order.
    Raises:
        ValueError: E not divisible by ``n_group`` (grouped), or ``top_k`` above 32 with ``norm_topk_prob``.
    """
    T, E = router_logits.shape
    k = min(int(top_k), E)
    grouped = n_group > 1 and topk_group < n_group
    if grouped and E % n_group:
        raise ValueError(f"grouped_topk: {E} experts do not split into n_group={n_group} groups")
    if norm_topk_prob and k > 32:
        raise ValueError(f"grouped_topk: top_k={k} > 32 is not supported with norm_topk_prob")
    dev = router_logits.device
    weights = torch.empty((T, k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, k), dtype=torch.int64, device=dev)
    if T == 0 or k == 0:
        return weights, ids
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    n_g, per = (n_group, E // n_group) if grouped else (1, E)
    bias = e_score_correction_bias
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    block_g, block_p = pow2(n_g), pow2(per)
    _grouped_topk_kernel[(T,)](
        router_logits, bias if bias is not None else router_logits, weights, ids, n_g, per,
        router_logits.stride(0), weights.stride(0), ids.stride(0), float(routed_scaling_factor),
        TOPK_GROUP=int(topk_group) if grouped else 0, TOP_K=k, GROUPED=grouped, HAS_BIAS=bias is not None,
        NORM=bool(norm_topk_prob), EXACT_EXP=not interpreting(),
        BLOCK_G=block_g, BLOCK_P=block_p, BLOCK_K=pow2(k),
        num_warps=max(1, min(4, block_g * block_p // 256)),
    )
    return weights, ids
