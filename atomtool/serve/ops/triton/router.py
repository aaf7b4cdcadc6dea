"""DeepSeek-V3 ``noaux_tc`` MoE routing (``grouped_topk``) in one Triton launch.

Same contract as :func:`atomtool.serve.ops.torch_ref_mla.grouped_topk` (DeepSeek-V3 report §2.1.2, HF
``DeepseekV3TopkRouter``): ``scores = sigmoid(logits)``, choice ``= scores + bias``; each of ``n_group``
groups is rated by the sum of its two best choice values, the ``topk_group`` best groups stay eligible (ties
-> lowest group index, as the reference's stable sort), the ``top_k`` best experts are chosen with the other
groups' experts at ``-inf`` (ties -> lowest expert id), and the weights are the unbiased scores of the
chosen experts, normalised (+1e-20) and scaled by ``routed_scaling_factor``.

The torch path costs about ten launches per MoE layer (a float radix sort among them); here one program
owns one token (one warp): its E logits sit in registers as an ``[n_group, E / n_group]`` tile, each lane
packed into one int64 (an order-preserving integer key of its choice value, then the complement of its
expert id), so each step of the group ranking and of the expert choice is a single max reduction that
also breaks ties towards the lowest id. No sort, no host sync (CUDA-graph capturable). ``n_group`` and
``E / n_group`` are compile-time constants (one compilation per model config): Triton then knows each group
is contiguous, aligned memory, loads it in vectors and keeps most of a group's reduction inside a thread.

Bits: the sigmoid is ``1 / (1 + exp(-x))`` with the IEEE division and the libdevice ``exp`` (what torch's
CUDA kernel computes), so the scores, and hence the choice, equal the reference's (the chosen experts' scores
are recomputed from their logits for the weights, the same bits). The normalising sum adds
the k weights in the order of torch's CUDA row reduction for k <= 32 (repeatedly folding the upper half
onto the lower half, see _row_sum), so on CUDA the weights are expected to match bitwise (tests/gpu records
it); elsewhere (CPU reference, ROCm's reduction order, the interpreter) they agree to float32 rounding of
that sum. NaN logits give unspecified choices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from atomtool.serve.ops.triton._common import grid_dependency_wait, interpreting, launch_pdl_args, pow2


@triton.jit
def _fold(v, HALF: tl.constexpr):
    """[2 * HALF] -> [HALF]: ``v[i] + v[i + HALF]``."""
    return tl.sum(tl.reshape(v, [2, HALF]), axis=0)


@triton.jit
def _row_sum(v, BLOCK_K: tl.constexpr):
    """Sum of ``v`` [BLOCK_K] (a power of two <= 32; zeros past the k weights) in the order in which torch's
    CUDA reduction (ATen Reduce.cuh, torch >= 2.9) sums a k-wide contiguous row: thread i of the
    ``p = last_pow2(k)`` threads adds v[i] and v[i + p], then a shuffle-down tree with decreasing offsets adds
    lane i + p/2 to lane i, and so on. Both steps are "fold the upper half onto the lower half"."""
    if BLOCK_K >= 32:
        v = _fold(v, 16)
    if BLOCK_K >= 16:
        v = _fold(v, 8)
    if BLOCK_K >= 8:
        v = _fold(v, 4)
    if BLOCK_K >= 4:
        v = _fold(v, 2)
    if BLOCK_K >= 2:
        v = _fold(v, 1)
    return tl.sum(v, axis=0)


#: order keys (see _order_key) of "no lane" (below every float) and of -inf
_KEY_NONE = tl.constexpr(-2147483647)
_KEY_NINF = tl.constexpr(-2139095041)  # 0xFF800000 ^ 0x7FFFFFFF


@triton.jit
def _order_key(c):
    """float32 -> int32 key with the float order (IEEE bits, magnitude bits flipped for negatives); ``+ 0.0``
    first so -0 and +0, which compare equal, get one key."""
    bits = (c + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(key):
    """The float32 of an order key (inverse of _order_key)."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _packed(key, lane):
    """int64 ``key << 32 | (2^31 - 1 - lane)``: one max finds the best key and, among equal keys, the lowest
    lane (the reference's stable descending sort)."""
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - lane).to(tl.int64)


@triton.jit
def _sigmoid(x, EXACT_EXP: tl.constexpr):
    """``1 / (1 + exp(-x))`` in float32 with an IEEE division, as torch's CUDA sigmoid kernel."""
    if EXACT_EXP:
        ex = libdevice.exp(-x)
    else:  # Triton's interpreter has no libdevice; NumPy's exp there
        ex = tl.exp(-x)
    one = tl.full(x.shape, 1.0, tl.float32)
    return tl.math.div_rn(one, one + ex)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, s_lt, s_w, s_id, scale,
    N_GROUP: tl.constexpr, PER: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, EXACT_EXP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    grid_dependency_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    # lanes as a [BLOCK_G, BLOCK_P] tile, a group per row; with N_GROUP and PER compile-time constants Triton
    # sees each row as contiguous, aligned memory and gives a thread several neighbours of a row (vector
    # loads), so the per-group reductions are mostly in-thread
    gi = tl.arange(0, BLOCK_G)[:, None]
    pi = tl.arange(0, BLOCK_P)[None, :]
    ok = (gi < N_GROUP) & (pi < PER)
    e = gi * PER + pi  # expert id of each lane (meaningful where ok)
    x = tl.load(logits_ptr + t * s_lt + e, mask=ok, other=0.0).to(tl.float32)
    c = _sigmoid(x, EXACT_EXP)
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    # every lane as one int64 (choice order key, then lowest expert id); padding lanes below everything
    key = tl.where(ok, _order_key(c), _KEY_NONE)
    k64 = _packed(key, e)
    none64 = _packed(tl.full([BLOCK_G, BLOCK_P], _KEY_NONE, tl.int32), tl.full([BLOCK_G, BLOCK_P], 0x7FFFFFFF,
                                                                                tl.int32))
    if GROUPED:
        # group score: the sum of the group's two best choices (the best lane removed once, so a tie at the
        # top counts twice, as the reference's sorted values[:2])
        top1 = tl.max(k64, axis=1)
        top2 = tl.max(tl.where(k64 == top1[:, None], none64, k64), axis=1)
        m1 = _key_value((top1 >> 32).to(tl.int32))
        if PER >= 2:
            gs = m1 + _key_value((top2 >> 32).to(tl.int32))
        else:
            gs = m1
        g = tl.arange(0, BLOCK_G)
        g_none = _packed(tl.full([BLOCK_G], _KEY_NONE, tl.int32), g)
        gk = tl.where(g < N_GROUP, _packed(_order_key(gs), g), g_none)
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gk, axis=0)
            keep = keep | (gk == best)
            gk = tl.where(gk == best, g_none, gk)
        # experts of dropped groups: choice -inf (still selectable, by id, when top_k exceeds the kept ones)
        k64 = tl.where(keep[:, None] | ~ok, k64, _packed(tl.full([BLOCK_G, BLOCK_P], _KEY_NINF, tl.int32), e))
    kk = tl.arange(0, BLOCK_K)
    iv = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.max(k64, axis=1), axis=0)
        iv = tl.where(kk == j, 0x7FFFFFFF - (best & 0x7FFFFFFF).to(tl.int32), iv)
        k64 = tl.where(k64 == best, none64, k64)
    km = kk < TOP_K
    # the chosen experts' unbiased scores, recomputed from their logits (the same bits as above)
    wv = _sigmoid(tl.load(logits_ptr + t * s_lt + iv, mask=km, other=0.0).to(tl.float32), EXACT_EXP)
    wv = tl.where(km, wv, 0.0)
    if NORM:
        den = _row_sum(wv, BLOCK_K) + 1e-20
        wv = tl.math.div_rn(wv, tl.full([BLOCK_K], 0.0, tl.float32) + den)
    wv = wv * scale
    tl.store(w_ptr + t * s_w + kk, wv, mask=km)
    tl.store(ids_ptr + t * s_id + kk, iv.to(tl.int64), mask=km)


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
        router_logits, bias if bias is not None else router_logits, weights, ids,
        router_logits.stride(0), weights.stride(0), ids.stride(0), float(routed_scaling_factor),
        N_GROUP=n_g, PER=per, TOPK_GROUP=int(topk_group) if grouped else 0, TOP_K=k, GROUPED=grouped,
        HAS_BIAS=bias is not None, NORM=bool(norm_topk_prob), EXACT_EXP=not interpreting(),
        BLOCK_G=block_g, BLOCK_P=block_p, BLOCK_K=pow2(k),
        num_warps=max(1, min(4, block_g * block_p // 2048)),  # one warp: reductions without shared memory
        **launch_pdl_args(router_logits.device),
    )
    return weights, ids
