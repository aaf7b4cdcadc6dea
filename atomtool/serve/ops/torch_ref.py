"""Plain-torch reference ops: exact, device-agnostic (CPU included), the truth other backends are tested against.

Conventions shared by every backend (helper E's Triton kernels implement exactly these signatures):

- T = tokens of the step (sequences concatenated), B = sequences, H = query heads, Hkv = KV heads,
  D = head dim, N = KV blocks in the pool, bs = block size (tokens per block).
- A paged cache plane is one tensor ``[N, bs, *per_token_shape]``; token ``p`` of a sequence lives in block
  ``block_table[p // bs]`` at offset ``p % bs``; its *slot* is ``block_id * bs + offset``.
- Reductions (norm variance, softmax, rotary angles) run in float32; results come back in the input dtype.
- Ops that write a cache do so in place and return None; every other op returns a new tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim (Zhang & Sennrich 2019; HF ``LlamaRMSNorm``), with an optional fused residual add.

    x: [..., H] any float dtype; weight: [H]. Without ``residual`` returns ``weight * norm(x)`` [..., H] in
    x's dtype (normalised in float32, cast back, then scaled -- HF's order). With ``residual`` ([..., H], same
    dtype) first forms ``s = x + residual`` and returns ``(rms_norm(s), s)``: the normed input of the next
    sub-layer and the new residual stream.
    """
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool = False) -> torch.Tensor:
    """Rotary position embedding (RoFormer, Su et al. 2021) of one rotary slice.

    x: [T, H, R] (R even; pass the rope slice of a head, e.g. ``q[..., nope:]``); cos, sin: [T, R/2] float32
    per-token tables (angles ``position * inv_freq``, already multiplied by the rope attention scaling, see
    :class:`atomtool.serve.layers.rotary.RotaryEmbedding`). ``interleaved=False`` is the NeoX/HF
    ``rotate_half`` convention (pairs ``(i, i + R/2)``); ``interleaved=True`` the GPT-J/original convention
    (pairs ``(2i, 2i + 1)``). Returns [T, H, R] in x's dtype.
    """
    dtype = x.dtype
    xf = x.float()
    c = cos[:, None, :]
    s = sin[:, None, :]
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer 2020): x [..., 2I] = gate ‖ up -> ``silu(gate) * up`` [..., I], x's dtype."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek-V3 FP8 block dequantization: ``W[i, j] = fp8[i, j] * scale_inv[i // bn, j // bk]``.

    weight: [N, K] float8_e4m3fn; scale_inv: [ceil(N/bn), ceil(K/bk)] float32; returns [N, K] in ``dtype``.
    """
    bn, bk = block_size
    n, k = weight.shape
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * scale).to(dtype)


def act_quant_fp8(x: torch.Tensor, group: int, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 activation quantization in 1 x ``group`` groups (DeepSeek-V3's ``act_quant``, the
    input side of its W8A8 ``fp8_gemm``; transformers' fine-grained FP8 kernels do the same).

    x: [T, K] float; returns (q [T, K] float8_e4m3fn, s [T, ceil(K/group)] float32) with
    ``s = max(amax(group), 1e-4) / 448`` (rounded up to a power of two under ``round_scale``, DeepSeek's
    ``scale_fmt: ue8m0``) and ``q = e4m3(x * (1 / s))`` rounded to nearest even, so ``x ~= q * s`` (DeepSeek
    divides, ``x / s``; the reciprocal is what the kernels compute per group, and the two differ only where
    x / s lies within a float32 rounding of an e4m3 rounding midpoint).
    """
    T, K = x.shape
    nb = -(-K // group)
    xf = F.pad(x.float(), (0, nb * group - K)).view(T, nb, group)
    s = xf.abs().amax(-1).clamp(min=1e-4) / 448.0
    if round_scale:
        mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1): a power of two iff mant == 0.5
        s = torch.ldexp(torch.ones_like(s), torch.where(mant == 0.5, exp - 1, exp))
    q = (xf * (1.0 / s)[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(T, nb * group)[:, :K], s


def linear_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                block_size: tuple[int, int], round_scale: bool = False) -> torch.Tensor:
    """W8A8 FP8 block GEMM (DeepSeek-V3's ``fp8_gemm`` after ``act_quant``): x quantized per token in 1 x bk
    groups (:func:`act_quant_fp8`), each K block's e4m3 x e4m3 product (exact in float32) scaled by the two
    scales: ``y = sum_kb (q[:, kb] @ w[:, kb]^T) * s_x[:, kb] * s_w[n // bn, kb]``, in float32.

    x: [T, K]; weight: [N, K] float8_e4m3fn; weight_scale_inv: [ceil(N/bn), ceil(K/bk)] float32.
    Returns [T, N] float32.
    """
    bn, bk = block_size
    N, K = weight.shape
    q, sx = act_quant_fp8(x, bk, round_scale)
    w = weight.float()
    sw = weight_scale_inv.float().repeat_interleave(bn, 0)[:N]
    out = torch.zeros(x.shape[0], N, dtype=torch.float32, device=x.device)
    for kb in range(sx.shape[1]):
        cols = slice(kb * bk, min(K, (kb + 1) * bk))
        out += (q[:, cols].float() @ w[:, cols].T) * (sx[:, kb, None] * sw[None, :, kb])
    return out


#: ``act_quant`` values of the FP8 ops: None (weights dequantized, activations kept) or W8A8 with dynamic
#: per-token scales, plain or rounded to powers of two (``ue8m0``)
ACT_QUANT_MODES = ("dynamic", "dynamic_ue8m0")


def act_quant_round_scale(act_quant: str) -> bool:
    """Whether W8A8 mode ``act_quant`` rounds activation scales to powers of two (``dynamic_ue8m0``).

    Raises:
        ValueError: ``act_quant`` is not one of :data:`ACT_QUANT_MODES`.
    """
    if act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"fp8 act_quant {act_quant!r}: expected None or one of {', '.join(ACT_QUANT_MODES)}")
    return act_quant == "dynamic_ue8m0"


def act_quant_fp8_supported(bk: int) -> bool:
    """Whether the W8A8 kernels serve a weight with K block ``bk``: one kernel K step must be exactly one
    activation group (K steps are at most 128 wide) and e4m3 tensor-core dots need K steps of >= 32."""
    return bk in (32, 64, 128)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               block_size: tuple[int, int], act_quant: str | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` for an FP8 block weight, rounded once to x's dtype: dequantized weight (``act_quant``
    None; ``F.linear`` with the bias, as transformers' dequantized model) or W8A8 (:func:`linear_w8a8`, the
    bias added in float32 before the rounding, as the kernels do). Raises ValueError for an unknown
    ``act_quant``."""
    if act_quant is None:
        return F.linear(x, dequant_fp8_block(weight, weight_scale_inv, block_size, x.dtype), bias)
    y = linear_w8a8(x, weight, weight_scale_inv, block_size, act_quant_round_scale(act_quant))
    return (y if bias is None else y + bias.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale_inv: torch.Tensor | None = None,
           block_size: tuple[int, int] = (128, 128), act_quant: str | None = None,
           sum_splits: bool = True) -> torch.Tensor:
    """``y = x @ W^T + b``. x: [T, K]; weight: [N, K] in x's dtype, or float8_e4m3fn with ``weight_scale_inv``
    [ceil(N/bn), ceil(K/bk)] float32 (FP8 block quantization: dequantized with :func:`dequant_fp8_block`, or
    W8A8 under ``act_quant``, :func:`fp8_matmul`); bias: [N] or None. Returns [T, N] in x's dtype.
    ``sum_splits=False``: the caller also takes float32 split-K planes [S, T, N] whose in-order sum rounded to
    x's dtype is y (``add_rms_norm`` sums them); this reference has no split and returns y itself."""
    if weight_scale_inv is None:
        return F.linear(x, weight, bias)
    return fp8_matmul(x, weight, weight_scale_inv, block_size, act_quant, bias)


def check_router_logits(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Validate :func:`router_logits`' operands (every backend calls this, so the errors are the same).

    Raises:
        ValueError: x or weight not 2-d, or their hidden sizes differ (the message names both shapes).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not form "
                         f"[T, H] @ [E, H]^T")


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MoE gate's logits ``x @ weight^T`` in float32, as HF ``DeepseekV3TopkRouter`` computes them
    (``F.linear(x.float(), weight.float())``; DeepSeek-V3 report §2.1.2).

    x: [T, H] any float dtype; weight: [E, H] any float dtype. Returns [T, E] float32. For bf16/fp16
    operands every product is exact in float32, so a backend can differ from this only in the float32
    summation order.

    Raises:
        ValueError: shapes that do not form [T, H] @ [E, H]^T (:func:`check_router_logits`).
    """
    check_router_logits(x, weight)
    return F.linear(x.float(), weight.float())


def store_cache(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write per-token entries into one paged cache plane, in place.

    x: [T, *shape]; cache: [N, bs, *shape] (same dtype or castable); slot_mapping: [T] int64, a slot per token
    (``-1``: padding token, not written).
    """
    flat = cache.view(-1, *cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat.index_copy_(0, slot_mapping, x.to(cache.dtype))
    else:
        flat.index_copy_(0, slot_mapping[valid], x[valid].to(cache.dtype))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the step's keys and values into the paged K/V planes, in place.

    k: [T, Hkv, D]; v: [T, Hkv, Dv]; k_cache: [N, bs, Hkv, D]; v_cache: [N, bs, Hkv, Dv];
    slot_mapping: [T] int64 (``-1`` skipped).
    """
    store_cache(k, k_cache, slot_mapping)
    store_cache(v, v_cache, slot_mapping)


def qk_rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor | None,
                     k_norm_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """A dense attention layer's per-token work between its qkv projection and attention, as one op: optional
    per-head q/k RMSNorm (Qwen3 ``q_norm`` / ``k_norm``), rope on q and k, and the K/V store.

    Exactly :func:`rms_norm` of q and k over the head dim (when the weights are given, one ``eps``),
    :func:`rotary_embedding` of both (full head dim: R = D), :func:`store_kv` of (k, v); returns the rotated q.
    Fused so a decode step does not launch up to six kernels per layer for it.

    q: [T, H, D]; k: [T, Hkv, D]; v: [T, Hkv, Dv] (views of the fused qkv output are fine); q_norm_weight,
    k_norm_weight: [D] or None; cos, sin: [T, D/2] float32; k_cache: [N, bs, Hkv, D]; v_cache: [N, bs, Hkv,
    Dv]; slot_mapping: [T] int64 (``-1`` skipped). Returns q [T, H, D] (new tensor).
    """
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k = rotary_embedding(q, cos, sin, interleaved), rotary_embedding(k, cos, sin, interleaved)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def gather_cache(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Read the first ``num_tokens`` entries of one sequence from a paged cache plane.

    cache: [N, bs, *shape]; block_table: [M] int32 (the sequence's block ids, ``-1`` padded).
    Returns [num_tokens, *shape] (a copy), in the cache's dtype.
    """
    bs = cache.shape[1]
    nblocks = -(-num_tokens // bs)
    blocks = block_table[:nblocks].long()
    return cache.index_select(0, blocks).reshape(-1, *cache.shape[2:])[:num_tokens]


def query_spans(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor):
    """The sequences of a step that have query tokens: yields ``(b, start, end, kv_len)`` per sequence ``b``
    with ``end > start``, where ``[start, end)`` are its rows of T (from cu_seqlens_q [B+1] int32) and
    ``kv_len = seq_lens[b]`` its KV length after the step; query j sits at position
    ``kv_len - (end - start) + j``."""
    cu = cu_seqlens_q.tolist()
    for b, L in enumerate(seq_lens.tolist()):
        if cu[b + 1] > cu[b]:
            yield b, cu[b], cu[b + 1], L


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal multi-head / grouped-query attention over a paged KV cache (vLLM PagedAttention, Kwon et al. 2023).

    One op covers every case of a step: prefill, prefill on top of a prefix-cached or earlier-chunk context
    (chunked prefill) and decode, mixed in one batch. The step's K/V must already be stored (``store_kv``).

    q: [T, H, D]; k_cache: [N, bs, Hkv, D]; v_cache: [N, bs, Hkv, Dv], H a multiple of Hkv (query head h uses
    KV head ``h // (H // Hkv)``); cu_seqlens_q: [B+1] int32 query offsets into T; seq_lens: [B] int32 KV length
    of each sequence after this step; block_tables: [B, M] int32; scale: softmax scale (usually D**-0.5).
    Query j of sequence b has position ``seq_lens[b] - q_len[b] + j`` and attends to KV positions <= it.
    Scores and softmax in float32. Returns [T, H, Dv] in q's dtype.
    """
    T, H, _ = q.shape
    Hkv = k_cache.shape[2]
    out = q.new_empty(T, H, v_cache.shape[-1])
    for b, s, e, L in query_spans(cu_seqlens_q, seq_lens):
        ql = e - s
        k = gather_cache(k_cache, block_tables[b], L).float()
        v = gather_cache(v_cache, block_tables[b], L).float()
        if H != Hkv:
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale
        qpos = torch.arange(L - ql, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        scores.masked_fill_(kpos > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
