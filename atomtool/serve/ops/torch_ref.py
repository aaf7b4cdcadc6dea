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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale_inv: torch.Tensor | None = None,
           block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """``y = x @ W^T + b``. x: [T, K]; weight: [N, K] in x's dtype, or float8_e4m3fn with ``weight_scale_inv``
    [ceil(N/bn), ceil(K/bk)] float32 (FP8 block quantization, dequantized with :func:`dequant_fp8_block`);
    bias: [N] or None. Returns [T, N] in x's dtype."""
    if weight_scale_inv is not None:
        weight = dequant_fp8_block(weight, weight_scale_inv, block_size, x.dtype)
    return F.linear(x, weight, bias)


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
