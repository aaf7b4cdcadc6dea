"""Triton kernels vs the torch reference ops, on CPU under Triton's interpreter (TRITON_INTERPRET=1).

Small sizes with odd shapes, page boundaries, GQA groups that are not powers of two and context lengths
around ``index_topk``. Float32 checks are tight (only summation order differs); one bf16 check per op uses
a loose tolerance, because the interpreter rounds bf16 stores by truncation. The same kernels run compiled
in bf16 on a GPU in tests/gpu/test_kernels_gpu.py.
"""

from __future__ import annotations

import sys

# Triton decides at import time whether @triton.jit means "interpret" (its own tl.sum & co. included), so
# the variable must be set before triton is first imported. When another test module of the same session
# imported triton earlier, these tests rerun in a fresh interpreter (test_suite_in_a_fresh_process).
from tests.triton_interp import harness, setup_interpreter  # noqa: E402  (imports neither torch nor triton)

_TRITON_PREIMPORTED = setup_interpreter()

import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install 'atomtool[serve]')")

from atomtool.serve import ops as dispatch  # noqa: E402
from atomtool.serve.ops import torch_ref, torch_ref_mla  # noqa: E402
from tests.kernel_inputs import assert_close_as as _close  # noqa: E402
from tests.kernel_inputs import cu_seqlens as _cu  # noqa: E402
from tests.kernel_inputs import random_block_tables as _paged  # noqa: E402

if not _TRITON_PREIMPORTED:
    import atomtool.serve.ops.triton as tri  # noqa: E402


_interpreted_only, test_suite_in_a_fresh_process = harness(__file__, _TRITON_PREIMPORTED)


# ---------------------------------------------------------------- registration and signatures

def test_every_triton_op_has_the_reference_signature_and_is_registered():
    refs = {**{n: getattr(torch_ref, n) for n in dir(torch_ref)},
            **{n: getattr(torch_ref_mla, n) for n in ("mla_attention", "mla_absorb_q", "indexer_topk", "fused_moe",
                                                     "grouped_topk")}}
    for name, fn in tri.OPS.items():
        ref_params = list(inspect.signature(refs[name]).parameters)
        ours = list(inspect.signature(fn).parameters)
        assert ours[:len(ref_params)] == ref_params, name
        extra = inspect.signature(fn).parameters
        optional = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)  # e.g. **tuning
        assert all(extra[p].default is not inspect.Parameter.empty or extra[p].kind in optional
                   for p in ours[len(ref_params):]), name
        assert dispatch._REGISTRY[(name, "triton")] is fn
    # CPU devices always get the torch reference, even when triton is forced
    dispatch.set_backend("triton")
    try:
        assert dispatch.get_op("rms_norm", "cpu") is torch_ref.rms_norm
    finally:
        dispatch.set_backend(None)


# ---------------------------------------------------------------- RMSNorm, SiLU-and-mul, rotary

@pytest.mark.parametrize("T,H", [(7, 33), (1, 128), (3, 1000)])
def test_rms_norm_fp32(T, H):
    x, w, r = torch.randn(T, H), torch.randn(H), torch.randn(T, H)
    _close(tri.rms_norm(x, w, 1e-6), torch_ref.rms_norm(x, w, 1e-6), 1e-5, 1e-5)
    out, res = tri.rms_norm(x, w, 1e-5, residual=r)
    ref_out, ref_res = torch_ref.rms_norm(x, w, 1e-5, residual=r)
    _close(out, ref_out, 1e-5, 1e-5)
    _close(res, ref_res, 0.0)


def test_rms_norm_bf16_and_empty():
    x, w, r = torch.randn(5, 96).bfloat16(), torch.randn(96).bfloat16(), torch.randn(5, 96).bfloat16()
    out, res = tri.rms_norm(x, w, 1e-6, r)
    ref_out, ref_res = torch_ref.rms_norm(x, w, 1e-6, r)
    _close(out, ref_out, 0.1, 0.03)
    _close(res, ref_res, 0.05, 0.02)
    assert tri.rms_norm(torch.randn(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    with pytest.raises(ValueError, match="hidden size 8 != weight size 9"):
        tri.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-6)


def test_silu_and_mul():
    x = torch.randn(5, 2 * 37)
    _close(tri.silu_and_mul(x), torch_ref.silu_and_mul(x), 1e-6, 1e-5)
    xb = torch.randn(3, 2 * 1100).bfloat16()  # I > one 1024-wide program
    _close(tri.silu_and_mul(xb), torch_ref.silu_and_mul(xb), 0.05, 0.02)
    with pytest.raises(ValueError, match="odd"):
        tri.silu_and_mul(torch.randn(2, 5))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_on_a_head_slice(interleaved):
    T, H, nope, R = 6, 19, 5, 12  # 19 heads: more than one 16-head program; rope slice after 5 nope dims
    q = torch.randn(T, H, nope + R)
    ang = torch.rand(T, R // 2) * 50
    cos, sin = ang.cos(), ang.sin()
    _close(tri.rotary_embedding(q[..., nope:], cos, sin, interleaved),
           torch_ref.rotary_embedding(q[..., nope:], cos, sin, interleaved), 1e-6, 1e-6)
    qb = q.bfloat16()
    _close(tri.rotary_embedding(qb[..., :R], cos, sin, interleaved),
           torch_ref.rotary_embedding(qb[..., :R], cos, sin, interleaved), 0.05, 0.02)
    with pytest.raises(ValueError, match="rotary dim 12"):
        tri.rotary_embedding(q[..., :R], cos[:, :5], sin[:, :5])


# ---------------------------------------------------------------- KV store and paged attention

def test_store_kv_and_store_cache_skip_padding_slots():
    nb, bs, Hkv, D, Dv = 5, 4, 2, 6, 3
    k, v = torch.randn(7, Hkv, D), torch.randn(7, Hkv, Dv)
    slots = torch.tensor([0, 3, 4, 19, -1, 9, -1])
    caches = [torch.zeros(nb, bs, Hkv, D), torch.zeros(nb, bs, Hkv, Dv)]
    ref_caches = [c.clone() for c in caches]
    tri.store_kv(k, v, *caches, slots)
    torch_ref.store_kv(k, v, *ref_caches, slots)
    for c, r in zip(caches, ref_caches, strict=True):
        _close(c, r, 0.0)
    lat = torch.zeros(nb, bs, 11, dtype=torch.bfloat16)  # x is cast to the plane's dtype
    ref_lat = lat.clone()
    x = torch.randn(7, 11)
    tri.store_cache(x, lat, slots)
    torch_ref.store_cache(x, ref_lat, slots)
    _close(lat, ref_lat, 0.02, 0.01)
    with pytest.raises(ValueError, match="does not fit cache"):
        tri.store_cache(torch.randn(7, 10), lat, slots)


ATTN_CASES = [
    # (q_lens, seq_lens, H, Hkv, D, Dv, block_size): prefill + prefix context + decode mixed
    ([5, 1, 17], [9, 1, 40], 4, 2, 24, 24, 16),
    ([1, 1, 1, 1], [16, 17, 15, 33], 6, 2, 32, 32, 16),  # decode at page boundaries, G = 3
    ([70], [70], 2, 2, 40, 40, 8),  # long prefill, many pages, D not a power of two
    ([3, 8], [20, 8], 8, 1, 16, 24, 4),  # MQA, chunked prefill (3 new of 20), Dv != D
]


@pytest.mark.parametrize("case", ATTN_CASES)
def test_paged_attention_fp32(case):
    q_lens, seq_lens, H, Hkv, D, Dv, bs = case
    g = torch.Generator().manual_seed(1)
    nb, bt = _paged(seq_lens, bs, gen=g)
    q = torch.randn(sum(q_lens), H, D, generator=g)
    kc, vc = torch.randn(nb, bs, Hkv, D, generator=g), torch.randn(nb, bs, Hkv, Dv, generator=g)
    args = (q, kc, vc, _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32), bt, D ** -0.5)
    _close(tri.paged_attention(*args), torch_ref.paged_attention(*args), 2e-5, 1e-5)


def test_paged_attention_split_kv_decode_and_batch_invariance():
    """Decode rows take the split-KV path: contexts at and across the 256-key minimum span, one long enough
    for longer chunks (> SPLIT_CHUNKS x 256 keys), GQA group 3; a decode row gives the same bits alone, in a
    decode batch and beside a prefill chunk."""
    from atomtool.serve.ops.triton.attention import SPLIT_CHUNKS, SPLIT_SPAN_MIN

    sm = SPLIT_SPAN_MIN
    seq_lens = [1, sm, sm + 1, 2 * sm + 5, SPLIT_CHUNKS * sm + 200]
    H, Hkv, D, Dv, bs = 6, 2, 16, 8, 16
    g = torch.Generator().manual_seed(21)
    nb, bt = _paged(seq_lens, bs, gen=g)
    q = torch.randn(len(seq_lens), H, D, generator=g)
    kc, vc = torch.randn(nb, bs, Hkv, D, generator=g), torch.randn(nb, bs, Hkv, Dv, generator=g)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    args = (q, kc, vc, _cu([1] * len(seq_lens)), sl, bt, D ** -0.5)
    full = tri.paged_attention(*args)
    _close(full, torch_ref.paged_attention(*args), 2e-5, 1e-5)
    for b in (0, 2, 4):
        alone = tri.paged_attention(q[b:b + 1], kc, vc, _cu([1]), sl[b:b + 1], bt[b:b + 1], D ** -0.5)
        assert torch.equal(alone, full[b:b + 1])
    pre_q = 7  # a prefill chunk of sequence 3 beside sequence 4's decode row
    mq = torch.cat([torch.randn(pre_q, H, D, generator=g), q[4:5]])
    margs = (mq, kc, vc, _cu([pre_q, 1]), sl[3:5], bt[3:5], D ** -0.5)
    mixed = tri.paged_attention(*margs)
    _close(mixed, torch_ref.paged_attention(*margs), 2e-5, 1e-5)
    assert torch.equal(mixed[pre_q:], full[4:5])


def test_paged_attention_bf16_and_shape_error():
    q_lens, seq_lens, H, Hkv, D, bs = [4, 1], [21, 7], 4, 2, 32, 8
    nb, bt = _paged(seq_lens, bs)
    q = torch.randn(sum(q_lens), H, D).bfloat16()
    kc, vc = torch.randn(nb, bs, Hkv, D).bfloat16(), torch.randn(nb, bs, Hkv, D).bfloat16()
    args = (q, kc, vc, _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32), bt, D ** -0.5)
    _close(tri.paged_attention(*args), torch_ref.paged_attention(*args), 0.05, 0.02)
    with pytest.raises(ValueError, match="does not fit caches"):
        tri.paged_attention(torch.randn(5, 3, D), kc, vc, *args[3:])


# ---------------------------------------------------------------- MLA (dense and DSA-sparse)

def _mla_inputs(q_lens, seq_lens, H, R, P, bs, dtype=torch.float32, seed=2):
    g = torch.Generator().manual_seed(seed)
    nb, bt = _paged(seq_lens, bs, gen=g)
    T = sum(q_lens)
    lat = torch.randn(nb, bs, R + P, generator=g).to(dtype)
    qn, qp = torch.randn(T, H, R, generator=g).to(dtype), torch.randn(T, H, P, generator=g).to(dtype)
    return qn, qp, lat, _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32), bt


def _random_topk(q_lens, seq_lens, K, n_sel, seed=3):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for ql, L in zip(q_lens, seq_lens, strict=True):
        for j in range(ql):
            pos = L - ql + j
            sel = torch.randperm(pos + 1, generator=g)[:min(n_sel, pos + 1)]
            rows.append(torch.cat([sel, torch.full((K - len(sel),), -1)])[torch.randperm(K, generator=g)])
    return torch.stack(rows).int()


@pytest.mark.parametrize("case", [([5, 1, 17], [9, 1, 40], 4, 24, 8, 16), ([1, 1, 1], [16, 17, 33], 19, 32, 16, 16)])
def test_mla_attention_dense_and_sparse_fp32(case):
    q_lens, seq_lens, H, R, P, bs = case
    args = _mla_inputs(q_lens, seq_lens, H, R, P, bs)
    _close(tri.mla_attention(*args, 0.3), torch_ref_mla.mla_attention(*args, 0.3), 2e-5, 1e-5)
    topk = _random_topk(q_lens, seq_lens, K=70, n_sel=37)  # K > one 32/64-key block, -1 interleaved
    _close(tri.mla_attention(*args, 0.3, topk), torch_ref_mla.mla_attention(*args, 0.3, topk), 2e-5, 1e-5)


def test_mla_split_kv_decode_across_chunks_and_batch_invariance():
    """Decode rows take the split-KV path: contexts crossing several dense chunks (>= 256 keys) and exactly
    at chunk boundaries, and one long enough for chunks over the minimum span; top-k lists crossing several
    sparse chunks (128) with whole chunks of -1 padding; a decode row gives the same bits alone, in a decode
    batch and beside a prefill chunk."""
    from atomtool.serve.ops.triton.mla import SPLIT_CHUNK_SPARSE, SPLIT_CHUNKS_DENSE, SPLIT_SPAN_DENSE

    cd, cs = SPLIT_SPAN_DENSE, SPLIT_CHUNK_SPARSE
    # the last context needs chunks longer than the minimum span (more than SPLIT_CHUNKS_DENSE x cd keys)
    seq_lens = [1, cd, cd + 1, 2 * cd + 77, SPLIT_CHUNKS_DENSE * cd + 300]
    q_lens = [1] * len(seq_lens)
    H, R, P, bs = 3, 16, 8, 16
    args = _mla_inputs(q_lens, seq_lens, H, R, P, bs, seed=12)
    qn, qp, lat, cu, sl, bt = args
    dense = tri.mla_attention(*args, 0.25)
    _close(dense, torch_ref_mla.mla_attention(*args, 0.25), 2e-5, 1e-5)
    K = 2 * cs + 5  # three sparse chunks
    topk = _random_topk(q_lens, seq_lens, K=K, n_sel=cs + 3, seed=13)
    topk[2, cs:2 * cs] = -1  # one whole chunk of padding
    topk[3] = torch.cat([topk[3][topk[3] >= 0], topk[3][topk[3] < 0]])  # selections first, padding after
    sparse = tri.mla_attention(*args, 0.25, topk)
    _close(sparse, torch_ref_mla.mla_attention(*args, 0.25, topk), 2e-5, 1e-5)
    # a decode row alone, and beside a prefill chunk (which takes the one-program path)
    b = 3
    alone_args = (qn[b:b + 1], qp[b:b + 1], lat, _cu([1]), sl[b:b + 1], bt[b:b + 1])
    assert torch.equal(tri.mla_attention(*alone_args, 0.25), dense[b:b + 1])
    assert torch.equal(tri.mla_attention(*alone_args, 0.25, topk[b:b + 1]), sparse[b:b + 1])
    g = torch.Generator().manual_seed(14)
    pre_q = 5
    mix_qn = torch.cat([torch.randn(pre_q, H, R, generator=g), qn[b:b + 1]])
    mix_qp = torch.cat([torch.randn(pre_q, H, P, generator=g), qp[b:b + 1]])
    mix_sl = torch.tensor([seq_lens[2], seq_lens[b]], dtype=torch.int32)  # prefill chunk over sequence 2's pages
    mix_bt = torch.stack([bt[2], bt[b]])
    mix_args = (mix_qn, mix_qp, lat, _cu([pre_q, 1]), mix_sl, mix_bt)
    mixed = tri.mla_attention(*mix_args, 0.25)
    _close(mixed, torch_ref_mla.mla_attention(*mix_args, 0.25), 2e-5, 1e-5)
    assert torch.equal(mixed[pre_q:], dense[b:b + 1])
    mix_topk = torch.cat([_random_topk([pre_q], [seq_lens[2]], K=K, n_sel=40, seed=15), topk[b:b + 1]])
    mixed_sparse = tri.mla_attention(*mix_args, 0.25, mix_topk)
    _close(mixed_sparse, torch_ref_mla.mla_attention(*mix_args, 0.25, mix_topk), 2e-5, 1e-5)
    assert torch.equal(mixed_sparse[pre_q:], sparse[b:b + 1])


def test_mla_attention_bf16_and_shape_error():
    q_lens, seq_lens = [3, 1], [30, 9]
    args = _mla_inputs(q_lens, seq_lens, 8, 64, 16, 8, dtype=torch.bfloat16)
    topk = _random_topk(q_lens, seq_lens, K=16, n_sel=12)
    for tk in (None, topk):
        _close(tri.mla_attention(*args, 0.2, tk), torch_ref_mla.mla_attention(*args, 0.2, tk), 0.05, 0.02)
    with pytest.raises(ValueError, match="do not fit latent cache"):
        tri.mla_attention(args[0], args[1][..., :3], *args[2:], 0.2)


def test_mla_attention_with_w_uv_fuses_the_merge_and_keeps_batch_invariance():
    """With ``w_uv`` the op returns W_UV o_lat: decode rows from the fused merge + W_UV kernel (more rows than
    one 16-row program, several dense and sparse chunks, odd head / latent / value sizes), multi-token rows
    through the reference GEMM; equal to the reference and to the unfused op + GEMM in float32, and a decode
    row's bits equal alone, in a decode batch and beside a prefill chunk."""
    from atomtool.serve.ops.triton.mla import MERGE_UV_BLOCK_M, SPLIT_CHUNK_SPARSE, SPLIT_SPAN_DENSE

    H, R, P, dv, nope, bs = 5, 24, 8, 20, 12, 16
    seq_lens = [1, 7, SPLIT_SPAN_DENSE + 3, 2 * SPLIT_SPAN_DENSE + 1] + [3 + 5 * i for i in range(MERGE_UV_BLOCK_M)]
    q_lens = [1] * len(seq_lens)
    args = _mla_inputs(q_lens, seq_lens, H, R, P, bs, seed=21)
    qn, qp, lat, cu, sl, bt = args
    g = torch.Generator().manual_seed(22)
    w_kvb = torch.randn(H, nope + dv, R, generator=g) / R ** 0.5
    w_uv = w_kvb[:, nope:]  # the layer's strided view
    topk = _random_topk(q_lens, seq_lens, K=SPLIT_CHUNK_SPARSE + 9, n_sel=SPLIT_CHUNK_SPARSE + 2, seed=23)
    outs = {}
    for name, tk in (("dense", None), ("sparse", topk)):
        fused = tri.mla_attention(*args, 0.3, tk, w_uv=w_uv)
        assert fused.shape == (len(seq_lens), H, dv)
        _close(fused, torch_ref_mla.mla_attention(*args, 0.3, tk, w_uv=w_uv), 2e-5, 1e-5)
        _close(fused, torch_ref_mla.mla_output_uv(tri.mla_attention(*args, 0.3, tk), w_uv), 2e-5, 1e-5)
        outs[name] = fused
    b = 3
    alone = (qn[b:b + 1], qp[b:b + 1], lat, _cu([1]), sl[b:b + 1], bt[b:b + 1])
    assert torch.equal(tri.mla_attention(*alone, 0.3, w_uv=w_uv), outs["dense"][b:b + 1])
    assert torch.equal(tri.mla_attention(*alone, 0.3, topk[b:b + 1], w_uv=w_uv), outs["sparse"][b:b + 1])
    pre_q = 4
    mix_args = (torch.cat([torch.randn(pre_q, H, R, generator=g), qn[b:b + 1]]),
                torch.cat([torch.randn(pre_q, H, P, generator=g), qp[b:b + 1]]), lat, _cu([pre_q, 1]),
                torch.tensor([seq_lens[2], seq_lens[b]], dtype=torch.int32), torch.stack([bt[2], bt[b]]))
    mixed = tri.mla_attention(*mix_args, 0.3, w_uv=w_uv)
    _close(mixed, torch_ref_mla.mla_attention(*mix_args, 0.3, w_uv=w_uv), 2e-5, 1e-5)
    assert torch.equal(mixed[pre_q:], outs["dense"][b:b + 1])
    with pytest.raises(ValueError, match=r"w_uv \(5, 20, 23\) must be \[H=5, dv, R=24\]"):
        tri.mla_attention(*args, 0.3, w_uv=w_kvb[:, nope:, :23])


def _fp8_kv_b(H, dn, dv, R, bn, bk, seed):
    """An FP8 block kv_b_proj [H * (dn + dv), R] as the layer views it: (W_UK, W_UV) as HeadWeights and the
    dequantized float [H, dn + dv, R] (``dequant_fp8_block``)."""
    g = torch.Generator().manual_seed(seed)
    n = H * (dn + dv)
    w8 = (torch.randn(n, R, generator=g) * 3).to(torch.float8_e4m3fn)
    sc = (torch.rand(-(-n // bn), -(-R // bk), generator=g) + 0.5) / R ** 0.5
    dq = torch_ref.dequant_fp8_block(w8, sc, (bn, bk), torch.float32).view(H, dn + dv, R)
    rows = sc.repeat_interleave(bn, 0)[:n].view(H, dn + dv, -1)
    w = w8.view(H, dn + dv, R)
    uk = torch_ref_mla.HeadWeights(w[:, :dn], rows[:, :dn], bk, torch.float32)
    uv = torch_ref_mla.HeadWeights(w[:, dn:], rows[:, dn:], bk, torch.float32)
    return uk, uv, dq


@pytest.mark.parametrize("R,bn,bk", [(96, 16, 16), (64, 8, 32), (40, 24, 128)])
def test_mla_absorb_q_widens_fp8_head_weights_like_the_dequantized_weight(R, bn, bk):
    """``mla_absorb_q`` (q_nope @ W_UK per head) with FP8 W_UK read as stored: bitwise the result of the
    dequantized float weight (the kernel widens fp8 * scale exactly as ``dequant_fp8_block``), close to the
    reference einsum, a token's row the same alone and among 300 (two programs of 256 rows), with latent
    blocks preloaded (up to 4) and loaded after the wait (R 96 in 16-wide blocks: 6)."""
    H, dn, dv = 3, 20, 12
    uk, _, dq = _fp8_kv_b(H, dn, dv, R, bn, bk, seed=31)
    assert torch.equal(uk.dequantized(), dq[:, :dn])
    g = torch.Generator().manual_seed(32)
    q = torch.randn(300, H, dn + 7, generator=g)[..., :dn]  # a strided view, as the layer's q_b output
    fp8 = tri.mla_absorb_q(q, uk)
    assert fp8.shape == (300, H, R)
    assert torch.equal(fp8, tri.mla_absorb_q(q, dq[:, :dn]))
    _close(fp8, torch_ref_mla.mla_absorb_q(q, uk), 2e-5, 1e-5)
    assert torch.equal(tri.mla_absorb_q(q[270:271], uk), fp8[270:271])
    assert tri.mla_absorb_q(q[:0], uk).shape == (0, H, R)
    for backend in (tri.mla_absorb_q, torch_ref_mla.mla_absorb_q):
        with pytest.raises(ValueError, match=r"mla_absorb_q: q_nope \(300, 3, 19\) does not fit W_UK"):
            backend(q[..., :19], uk)


@pytest.mark.parametrize("R,bk", [(96, 16), (48, 32)])
def test_mla_attention_with_fp8_w_uv_matches_the_reference_and_stays_batch_invariant(R, bk):
    """The fused merge + W_UV with W_UV as FP8 HeadWeights (widened in the kernel, some latent blocks
    preloaded before the PDL wait and some after): equal to the reference on the dequantized weight, to the
    float-weight kernel within float32 rounding, and a decode row's bits the same alone and in the batch."""
    from atomtool.serve.ops.triton.mla import SPLIT_CHUNK_SPARSE

    H, P, dn, dv, bs = 3, 8, 12, 20, 16
    seq_lens = [1, 9, 2 * SPLIT_CHUNK_SPARSE + 5, 40]
    q_lens = [1] * len(seq_lens)
    args = _mla_inputs(q_lens, seq_lens, H, R, P, bs, seed=33)
    _, uv, dq = _fp8_kv_b(H, dn, dv, R, 8, bk, seed=34)
    topk = _random_topk(q_lens, seq_lens, K=SPLIT_CHUNK_SPARSE + 9, n_sel=SPLIT_CHUNK_SPARSE + 2, seed=35)
    for tk in (None, topk):
        fused = tri.mla_attention(*args, 0.3, tk, w_uv=uv)
        _close(fused, torch_ref_mla.mla_attention(*args, 0.3, tk, w_uv=dq[:, dn:]), 2e-5, 1e-5)
        _close(fused, tri.mla_attention(*args, 0.3, tk, w_uv=dq[:, dn:]), 2e-5, 1e-5)
        b = 2
        alone = (args[0][b:b + 1], args[1][b:b + 1], args[2], _cu([1]), args[4][b:b + 1], args[5][b:b + 1])
        assert torch.equal(tri.mla_attention(*alone, 0.3, None if tk is None else tk[b:b + 1], w_uv=uv),
                           fused[b:b + 1])


# ---------------------------------------------------------------- DSA indexer top-k

def _indexer_inputs(q_lens, seq_lens, Hi, Di, bs, seed=4, mb_extra=0):
    """Small-integer inputs: every score is exact in float32, so ties (many, incl. ReLU zeros) are real ties
    and selections must match the reference exactly, tie-breaking included."""
    g = torch.Generator().manual_seed(seed)
    nb, bt = _paged(seq_lens, bs, gen=g)
    if mb_extra:
        bt = torch.cat([bt, torch.full((bt.shape[0], mb_extra), -1, dtype=torch.int32)], dim=1)
    T = sum(q_lens)
    q = torch.randint(-2, 3, (T, Hi, Di), generator=g).float()
    kc = torch.randint(-2, 3, (nb, bs, Di), generator=g).float()
    w = torch.randint(-2, 3, (T, Hi), generator=g).float()
    return q, w, kc, _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32), bt


@pytest.mark.parametrize("case", [
    # (q_lens, seq_lens, Hi, Di, block_size, topk): lengths K-1, K, K+1 and far above K
    ([1, 1, 1], [15, 16, 17], 4, 24, 8, 16),
    ([17, 1, 5], [17, 40, 70], 3, 32, 16, 16),  # full prefill crossing K, decode, chunked prefill
    ([9], [130], 2, 16, 8, 64),  # contexts over 2 key blocks of 64
])
def test_indexer_topk_matches_reference_exactly(case):
    q_lens, seq_lens, Hi, Di, bs, K = case
    args = _indexer_inputs(q_lens, seq_lens, Hi, Di, bs)
    out, ref = tri.indexer_topk(*args, K), torch_ref_mla.indexer_topk(*args, K)
    assert out.dtype == torch.int32 and out.shape == ref.shape
    assert torch.equal(out, ref)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rope", [8, 24])  # part of the head, all of it
def test_indexer_topk_rotates_unrotated_queries_as_the_rope_store_would(interleaved, rope):
    """The decode path hands the scoring unrotated queries and the rotary tables (the rope inside the scoring
    kernel saves indexer_rope_store's launch): the keys must be bitwise those of the queries that op rotates,
    and the selection the reference's, for both pairings."""
    from atomtool.serve.ops.triton import fused_rope
    from atomtool.serve.ops.triton.indexer import indexer_keys
    from atomtool.serve.ops.triton.topk import row_range_buffer

    q_lens, seq_lens, Hi, Di, bs, K = [3, 1], [40, 70], 3, 24, 8, 16
    q, w, kc, cu, sl, bt = _indexer_inputs(q_lens, seq_lens, Hi, Di, bs, seed=9)
    q = q + 0.25 * torch.randn(q.shape, generator=torch.Generator().manual_seed(1))  # not small integers
    T = q.shape[0]
    ang = torch.rand(T, rope // 2, generator=torch.Generator().manual_seed(2)) * 40
    cos, sin = ang.cos(), ang.sin()
    q_rot = torch_ref_mla.index_rope(q, cos, sin, interleaved)
    k_raw, w_raw = torch.randn(T, Di), torch.randn(T, Hi)  # the rope store's own inputs (keys: unused here)
    q_store, _ = fused_rope.indexer_rope_store(q, k_raw, w_raw, 1.0, torch.ones(Di), torch.zeros(Di), 1e-6, cos,
                                               sin, interleaved, torch.zeros(2, 4, Di), torch.full((T,), -1))
    _close(q_store, q_rot, 1e-6, 1e-6)
    keys = {}
    for name, qq, tabs in (("stored", q_store, (None, None)), ("fused", q, (cos, sin))):
        rng = row_range_buffer(T, q.device)
        keys[name] = indexer_keys(qq, w, kc, cu, sl, bt, 0, T, rng, *tabs, interleaved)
        rng.zero_()
    n = [40 - 2, 40 - 1, 40, 70]  # each row's causal positions: only those keys are written
    for t in range(T):
        assert torch.equal(keys["fused"][t, :n[t]], keys["stored"][t, :n[t]])
    out = tri.indexer_topk(q, w, kc, cu, sl, bt, K, cos, sin, interleaved)
    assert torch.equal(out, tri.indexer_topk(q_store, w, kc, cu, sl, bt, K))
    assert torch.equal(torch_ref_mla.indexer_topk(q, w, kc, cu, sl, bt, K, cos, sin, interleaved),
                       torch_ref_mla.indexer_topk(q_rot, w, kc, cu, sl, bt, K))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_indexer_topk_rotary_tables_that_do_not_fit(impl):
    fn = tri.indexer_topk if impl == "triton" else torch_ref_mla.indexer_topk
    q, w, kc, cu, sl, bt = _indexer_inputs([1], [30], 2, 16, 8)
    cos = torch.ones(1, 4)
    for bad_cos, bad_sin in ((cos, None), (torch.ones(2, 4), torch.ones(2, 4)), (torch.ones(1, 9), torch.ones(1, 9))):
        with pytest.raises(ValueError, match=r"indexer_topk: rotary tables cos .* do not fit q \(1, 2, 16\)"):
            fn(q, w, kc, cu, sl, bt, 8, bad_cos, bad_sin)


def test_indexer_topk_when_topk_exceeds_the_block_table_width():
    args = _indexer_inputs([2, 1], [6, 3], 2, 16, 4)  # block tables 3 wide: 12 positions < K = 20
    out, ref = tri.indexer_topk(*args, 20), torch_ref_mla.indexer_topk(*args, 20)
    assert torch.equal(out, ref)


def test_indexer_topk_bf16_selects_a_top_set():
    """bf16 scores are rounded differently; the chosen set must still be a valid top-K of the exact scores."""
    g = torch.Generator().manual_seed(5)
    q_lens, seq_lens, Hi, Di, bs, K = [4], [50], 4, 32, 16, 8
    nb, bt = _paged(seq_lens, bs, gen=g)
    q, kc = torch.randn(4, Hi, Di, generator=g).bfloat16(), torch.randn(nb, bs, Di, generator=g).bfloat16()
    w = torch.rand(4, Hi, generator=g)
    args = (q, w, kc, _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32), bt)
    out = tri.indexer_topk(*args, K)
    k_all = kc[bt[0, :4].long()].reshape(-1, Di)[:50].float()
    scores = torch.einsum("th,ths->ts", w, torch.relu(torch.einsum("thd,sd->ths", q.float(), k_all)))
    for t in range(4):
        pos = 50 - 4 + t
        kth = scores[t, :pos + 1].sort(descending=True).values[K - 1]
        assert (out[t] >= 0).all() and len(set(out[t].tolist())) == K and (out[t] <= pos).all()
        assert (scores[t, out[t].long()] >= kth - 0.05 * kth.abs() - 1e-3).all()


# ---------------------------------------------------------------- FP8 block linear

@pytest.mark.parametrize("M,N,K,block", [(5, 70, 96, (32, 32)), (17, 33, 48, (16, 16)), (3, 130, 200, (128, 128))])
def test_fp8_block_linear(M, N, K, block):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(M, K, generator=g)
    w = (torch.randn(N, K, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.5
    b = torch.randn(N, generator=g)
    _close(tri.linear(x, w, b, s, block), torch_ref.linear(x, w, b, s, block), 1e-4, 1e-5)
    _close(tri.linear(x, w, None, s, block), torch_ref.linear(x, w, None, s, block), 1e-4, 1e-5)
    xb = x.bfloat16()
    _close(tri.linear(xb, w, None, s, block), torch_ref.linear(xb, w, None, s, block), 0.3, 0.02)


@pytest.mark.parametrize("N,K,block", [(70, 200, (16, 16)), (130, 256, (128, 128)), (1100, 96, (32, 32))])
def test_fp8_block_linear_small_m_split_k(N, K, block, monkeypatch):
    """Every M takes the split-K path: K cut into several splits (13, 2 and 1 here), fp32 partials summed in
    split order; every row equals the dequantized reference, and is bitwise the same alone as in a batch of
    any size (also one cut into several SPLIT_ROWS launches)."""

    from atomtool.serve.ops.triton.linear import split_k_plan

    tri_linear = sys.modules["atomtool.serve.ops.triton.linear"]  # the package re-exports a function `linear`

    g = torch.Generator().manual_seed(16)
    x = torch.randn(16, K, generator=g)
    w = (torch.randn(N, K, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.5
    b = torch.randn(N, generator=g)
    n_splits, k_chunk = split_k_plan(N, K, 64, min(block[1], 128))
    assert (n_splits - 1) * k_chunk < K <= n_splits * k_chunk and k_chunk % min(block[1], 128) == 0
    full = tri.linear(x, w, b, s, block)
    _close(full, torch_ref.linear(x, w, b, s, block), 1e-4, 1e-5)
    for M in (1, 2, 7, 16):
        part = tri.linear(x[:M], w, None, s, block)
        _close(part, torch_ref.linear(x[:M], w, None, s, block), 1e-4, 1e-5)
        assert torch.equal(tri.linear(x[M - 1:M], w, b, s, block)[0], full[M - 1])  # batch-invariant row
    big_x = torch.cat([x, torch.randn(21, K, generator=g)])  # 37 rows: several 16-row tiles
    monkeypatch.setattr(tri_linear, "SPLIT_ROWS", 16)           # and several workspace chunks
    big = tri.linear(big_x, w, b, s, block)
    _close(big, torch_ref.linear(big_x, w, b, s, block), 1e-4, 1e-5)
    assert torch.equal(big[:16], full) and torch.equal(tri.linear(big_x[36:], w, b, s, block)[0], big[36])
    xb, bb = x[:3].bfloat16(), b.bfloat16()
    _close(tri.linear(xb, w, bb, s, block), torch_ref.linear(xb, w, bb, s, block), 0.3, 0.02)


def test_fp8_linear_split_planes_summed_by_the_next_norm(monkeypatch):
    """``sum_splits=False``: a split-K FP8 linear returns its float32 planes [S, M, N] (here 13), which
    ``add_rms_norm`` without an extra sums into the bits of ``rms_norm(linear(x), residual)``; with a bias,
    one split, rows beyond one workspace chunk or a 3-d x it returns the summed output (the reference always
    does); the RMSNorm layer routes planes to that op."""
    from atomtool.serve.layers.norm import RMSNorm
    from atomtool.serve.ops.triton import fused_norm
    from atomtool.serve.ops.triton.norm import rms_norm

    tri_linear = sys.modules["atomtool.serve.ops.triton.linear"]
    g = torch.Generator().manual_seed(17)
    N, K, block = 70, 200, (16, 16)
    x = torch.randn(5, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // 16), -(-K // 16), generator=g) + 0.5
    r = torch.randn(5, N, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(N, generator=g)).bfloat16()
    planes = tri.linear(x, w, None, s, block, None, False)
    assert planes.shape == (13, 5, N) and planes.dtype == torch.float32
    summed = tri.linear(x, w, None, s, block)
    want = rms_norm(summed, nw, 1e-6, r)
    for got in (fused_norm.add_rms_norm(planes, None, nw, 1e-6, r), fused_norm.add_rms_norm(summed, None, nw, 1e-6, r)):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(torch_ref.linear(x, w, None, s, block, None, False), torch_ref.linear(x, w, None, s, block))
    bias = torch.randn(N, generator=g).bfloat16()
    assert tri.linear(x, w, bias, s, block, None, False).shape == (5, N)
    assert tri.linear(x.view(5, 1, K), w, None, s, block, None, False).shape == (5, 1, N)
    monkeypatch.setattr(tri_linear, "SPLIT_ROWS", 4)
    assert torch.equal(tri.linear(x, w, None, s, block, None, False), summed)
    norm = RMSNorm(N, 1e-6, torch.bfloat16, "cpu")
    norm.weight.data.copy_(nw)
    norm._add_op = fused_norm.add_rms_norm
    assert all(torch.equal(a, b) for a, b in zip(norm(planes, r), want, strict=True))


def test_act_quant_fp8_reference_follows_deepseek_act_quant():
    """The reference quantizer against DeepSeek-V3's act_quant written out by hand: per token and 128-wide
    group, s = amax / 448 (floor 1e-4), q = e4m3(x / s); ue8m0 rounds s up to a power of two."""
    g = torch.Generator().manual_seed(31)
    x = torch.randn(3, 200, generator=g) * torch.tensor([1.0, 1e-7, 30.0])[:, None]
    x[0, 128:] = 0.0  # an all-zero group: scale 1e-4 / 448, q = 0
    q, s = torch_ref.act_quant_fp8(x, 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 200) and s.shape == (3, 2)
    for t in range(3):
        for gi, cols in enumerate((slice(0, 128), slice(128, 200))):
            grp = x[t, cols]
            want_s = torch.clamp(grp.abs().max(), min=1e-4) / 448
            assert s[t, gi] == want_s
            assert torch.equal(q[t, cols].float(), (grp * (1 / want_s)).to(torch.float8_e4m3fn).float())
            assert q[t, cols].float().abs().max() <= 448
    assert torch.all(q[0, 128:].float() == 0)
    _, s_pow2 = torch_ref.act_quant_fp8(x, 128, round_scale=True)
    assert torch.equal(torch.log2(s_pow2), torch.ceil(torch.log2(s)))
    assert torch.all(s_pow2 >= s) and torch.all(s_pow2 < 2 * s)
    # W8A8 error is that of e4m3 (3 mantissa bits) on both sides, not more
    w = torch.randn(40, 200, generator=g).to(torch.float8_e4m3fn)
    sw = torch.rand(1, 2, generator=g) + 0.5
    xr = torch.randn(5, 200, generator=g)
    exact = torch_ref.linear(xr, w, None, sw, (128, 128))
    w8a8 = torch_ref.linear(xr, w, None, sw, (128, 128), "dynamic")
    assert (w8a8 - exact).norm() / exact.norm() < 0.05
    with pytest.raises(ValueError, match="act_quant"):
        torch_ref.linear(xr, w, None, sw, (128, 128), "static")


@pytest.mark.parametrize("mode", ["dynamic", "dynamic_ue8m0"])
@pytest.mark.parametrize("M,N,K,block", [(5, 70, 96, (32, 32)), (3, 130, 200, (128, 128)), (17, 1100, 256, (64, 64)),
                                         (4, 200, 128, (128, 128)), (5, 70, 32, (32, 32))])  # last two: no split
def test_fp8_block_linear_w8a8(mode, M, N, K, block):
    """W8A8 (activations quantized per token and K block inside the kernel, e4m3 x e4m3 dots) equals the
    W8A8 reference (same quantized activations, float32 sums) with and without split-K and bias, and every
    row is the same bits alone as in the batch."""
    from atomtool.serve.ops.triton.linear import FP8_LINEAR_W8A8_CONFIG, split_k_plan

    cfg = FP8_LINEAR_W8A8_CONFIG
    assert (split_k_plan(N, K, cfg.block_n, block[1], cfg.split_target)[0] == 1) == (K == block[1])
    g = torch.Generator().manual_seed(41)
    x = torch.randn(M, K, generator=g) * 3
    w = (torch.randn(N, K, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.5
    b = torch.randn(N, generator=g)
    full = tri.linear(x, w, b, s, block, mode)
    _close(full, torch_ref.linear(x, w, b, s, block, mode), 1e-4, 1e-5)
    assert torch.equal(tri.linear(x[M - 1:], w, b, s, block, mode)[0], full[M - 1])
    xb = x.bfloat16()
    _close(tri.linear(xb, w, None, s, block, mode), torch_ref.linear(xb, w, None, s, block, mode), 0.3, 0.02)


def test_fp8_w8a8_refuses_blocks_it_cannot_serve():
    x = torch.randn(2, 48)
    w = torch.randn(8, 48).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="K block 16 is not served by W8A8"):
        tri.linear(x, w, None, torch.ones(1, 3), (16, 16), "dynamic")
    with pytest.raises(ValueError, match="act_quant 'static'"):
        tri.linear(x, w, None, torch.ones(1, 2), (32, 32), "static")


def test_fused_moe_w8a8_matches_reference():
    T, H, inter, E, k, block = 7, 64, 48, 4, 2, (32, 32)
    x, w13, w2, tw, ids = _moe_inputs(T, H, inter, E, k)
    g = torch.Generator().manual_seed(9)
    w13q, w2q = (w13 * 4).to(torch.float8_e4m3fn), (w2 * 4).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, -(-2 * inter // 32), H // 32, generator=g) + 0.5
    s2 = torch.rand(E, H // 32, -(-inter // 32), generator=g) + 0.5
    for mode in ("dynamic", "dynamic_ue8m0"):
        out = tri.fused_moe(x, w13q, w2q, tw, ids, s13, s2, block, mode)
        _close(out, torch_ref_mla.fused_moe(x, w13q, w2q, tw, ids, s13, s2, block, mode), 1e-4, 1e-5)
        assert torch.equal(tri.fused_moe(x[3:4], w13q, w2q, tw[3:4], ids[3:4], s13, s2, block, mode)[0], out[3])
    exact = torch_ref_mla.fused_moe(x, w13q, w2q, tw, ids, s13, s2, block)
    assert (out - exact).norm() / exact.norm() < 0.1  # and W8A8 stays near the dequantized result


def test_split_k_plan_depends_on_the_weight_only():
    from atomtool.serve.ops.triton.linear import split_k_plan

    assert split_k_plan(7168, 16384, 64, 128) == (5, 26 * 128)  # o_proj: 112 tiles x 5 splits
    assert split_k_plan(2112, 7168, 64, 128) == (14, 4 * 128)  # fused q_a + kv_a
    assert split_k_plan(36864, 7168, 64, 128) == (1, 7168)  # wide weights need no split
    assert split_k_plan(64, 128, 64, 128) == (1, 128)  # one K step cannot be split


def test_linear_float_path_and_errors():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    _close(tri.linear(x, w), torch_ref.linear(x, w), 1e-6)
    w8 = w.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="do not fit"):
        tri.linear(x, w8, None, torch.ones(3, 3), (16, 16))
    with pytest.raises(ValueError, match="multiple of 16"):
        tri.linear(x, w8, None, torch.ones(1, 1), (8, 8))


# ---------------------------------------------------------------- fused MoE

def _moe_inputs(T, H, inter, E, k, seed=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g) * 0.2, torch.randn(E, H, inter, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return x, w13, w2, torch.rand(T, k, generator=g), ids


@pytest.mark.parametrize("T,H,inter,E,k", [(5, 32, 24, 4, 2), (40, 48, 40, 6, 3), (1, 16, 16, 3, 1)])
def test_fused_moe_fp32(T, H, inter, E, k):
    x, w13, w2, tw, ids = _moe_inputs(T, H, inter, E, k)
    _close(tri.fused_moe(x, w13, w2, tw, ids), torch_ref_mla.fused_moe(x, w13, w2, tw, ids), 2e-5, 1e-5)


@pytest.mark.parametrize("T", [1, 6])
def test_fused_moe_slot_planes_sum_to_the_output_in_the_next_norm(T):
    """``sum_slots=False`` returns the per-slot float32 planes; ``add_rms_norm`` summing them gives the bits of
    ``add_rms_norm`` on the summed output (both backends), with foreign / padded expert ids, at T == 1 (the
    direct launch, planes not zero-filled) and above; bf16 so the rounding of the sum shows."""
    x, w13, w2, tw, ids = (t.bfloat16() if t.is_floating_point() and i < 3 else t
                           for i, t in enumerate(_moe_inputs(T, 32, 16, 4, 2, seed=12)))
    from atomtool.serve.ops.triton import fused_norm

    ids[0, 1] = -1
    g = torch.Generator().manual_seed(13)
    shared, residual = (torch.randn(T, 32, generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(32, generator=g)).bfloat16()
    for backend in (tri, torch_ref_mla):
        planes = backend.fused_moe(x, w13, w2, tw, ids, sum_slots=False)
        assert planes.dtype == torch.float32 and planes.dim() == 3 and planes.shape[1:] == (T, 32)
        summed = backend.fused_moe(x, w13, w2, tw, ids)
        norm = fused_norm.add_rms_norm if backend is tri else torch_ref_mla.add_rms_norm
        for got, want in zip(norm(planes, shared, w, 1e-6, residual), norm(summed, shared, w, 1e-6, residual),
                             strict=True):
            assert torch.equal(got, want)
    assert tri.fused_moe(x[:0], w13, w2, tw[:0], ids[:0], sum_slots=False).shape == (2, 0, 32)


def test_fused_moe_skips_experts_not_served_here():
    x, w13, w2, tw, ids = _moe_inputs(6, 32, 16, 4, 2)
    ids[0, 0], ids[3, 1], ids[5] = -1, 4, torch.tensor([7, -1])  # other ranks' experts / padding
    _close(tri.fused_moe(x, w13, w2, tw, ids), torch_ref_mla.fused_moe(x, w13, w2, tw, ids), 2e-5, 1e-5)


def test_fused_moe_bf16():
    x, w13, w2, tw, ids = _moe_inputs(9, 64, 32, 5, 2)
    args = (x.bfloat16(), w13.bfloat16(), w2.bfloat16(), tw, ids)
    _close(tri.fused_moe(*args), torch_ref_mla.fused_moe(*args), 0.05, 0.03)


def test_fused_moe_fp8_block_matches_dequantized_reference():
    T, H, inter, E, k, block = 7, 48, 40, 4, 2, (16, 16)
    x, w13, w2, tw, ids = _moe_inputs(T, H, inter, E, k)
    g = torch.Generator().manual_seed(8)
    w13q, w2q = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    s13 = torch.rand(E, -(-2 * inter // 16), -(-H // 16), generator=g) + 0.5
    s2 = torch.rand(E, -(-H // 16), -(-inter // 16), generator=g) + 0.5
    d13 = torch.stack([torch_ref.dequant_fp8_block(w13q[e], s13[e], block, torch.float32) for e in range(E)])
    d2 = torch.stack([torch_ref.dequant_fp8_block(w2q[e], s2[e], block, torch.float32) for e in range(E)])
    _close(tri.fused_moe(x, w13q, w2q, tw, ids, s13, s2, block), torch_ref_mla.fused_moe(x, d13, d2, tw, ids),
           2e-5, 1e-5)
    with pytest.raises(ValueError, match="both"):
        tri.fused_moe(x, w13q, w2q, tw, ids, s13, None, block)
    with pytest.raises(ValueError, match="do not fit"):
        tri.fused_moe(x[:, :5], w13, w2, tw, ids)


def test_fused_moe_batch_invariance():
    """Expert tiles are 16 rows for every batch size (MOE_BLOCK_M); FP8 weights and -1 / foreign expert ids
    match the reference, and a token's output has the same bits alone, in a small batch and in a large one."""
    from atomtool.serve.ops.triton.moe import MOE_BLOCK_M

    assert MOE_BLOCK_M == 16
    E, k = 4, 2
    T, H, inter, block = 40, 48, 40, (16, 16)
    x, w13, w2, tw, ids = _moe_inputs(T, H, inter, E, k, seed=10)
    ids[3, 0], ids[9] = -1, torch.tensor([E + 2, -1])
    g = torch.Generator().manual_seed(11)
    w13q, w2q = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    s13 = torch.rand(E, -(-2 * inter // 16), -(-H // 16), generator=g) + 0.5
    s2 = torch.rand(E, -(-H // 16), -(-inter // 16), generator=g) + 0.5
    d13 = torch.stack([torch_ref.dequant_fp8_block(w13q[e], s13[e], block, torch.float32) for e in range(E)])
    d2 = torch.stack([torch_ref.dequant_fp8_block(w2q[e], s2[e], block, torch.float32) for e in range(E)])
    for fp8 in (False, True):
        wa, wb = (w13q, w2q) if fp8 else (w13, w2)
        extra = (s13, s2, block) if fp8 else ()
        full = tri.fused_moe(x, wa, wb, tw, ids, *extra)
        ref = torch_ref_mla.fused_moe(x, d13 if fp8 else w13, d2 if fp8 else w2, tw, ids)
        _close(full, ref, 2e-5, 1e-5)
        small = tri.fused_moe(x[:8], wa, wb, tw[:8], ids[:8], *extra)
        _close(small, ref[:8], 2e-5, 1e-5)
        for t in (0, 3, 7):
            alone = tri.fused_moe(x[t:t + 1], wa, wb, tw[t:t + 1], ids[t:t + 1], *extra)
            assert torch.equal(alone[0], small[t]) and torch.equal(alone[0], full[t])
        part = tri.fused_moe(x[3:38], wa, wb, tw[3:38], ids[3:38], *extra)
        assert torch.equal(part, full[3:38])


def test_moe_sorting_layout():
    from atomtool.serve.ops.triton.moe import sort_tokens_by_expert

    ids = torch.tensor([[2, 0], [2, 9], [-1, 2]])
    pairs, experts = sort_tokens_by_expert(ids, num_experts=3, block_m=4)
    n = ids.numel()
    assert pairs.shape[0] == experts.shape[0] * 4 == -(-(n + 3 * 3) // 4) * 4
    assert experts.tolist()[:2] == [0, 2] and all(e == 3 for e in experts.tolist()[2:])
    assert pairs[:4].tolist() == [1, n, n, n]  # expert 0: pair (0,1), padded
    assert pairs[4:8].tolist() == [0, 2, 5, n]  # expert 2: pairs in token order
    assert (pairs[8:] == n).all()


# ---------------------------------------------------------------- launch-config variants (kernel_sweep)

@pytest.mark.parametrize("swap_ab,block_n,fused_sum", [(True, 64, True), (True, 32, False), (False, 32, True),
                                                        (False, 64, False)])
def test_fp8_linear_and_moe_launch_variants(swap_ab, block_n, fused_sum, monkeypatch):
    """The swapped-operand tile (W_tile @ a_tile^T), other block widths the sweep benchmark tries, and the
    split-K sum done by each tile's last split program or by a second kernel give the reference's results,
    with and without split-K and bias; rows stay batch-invariant; the fused and the two-kernel sums agree
    bitwise and the tile counters are left at zero."""
    import dataclasses

    lin = sys.modules["atomtool.serve.ops.triton.linear"]
    moe = sys.modules["atomtool.serve.ops.triton.moe"]
    monkeypatch.setattr(lin, "FP8_LINEAR_CONFIG", dataclasses.replace(
        lin.FP8_LINEAR_CONFIG, swap_ab=swap_ab, block_n=block_n, split_target=64, fused_sum=fused_sum))
    monkeypatch.setattr(moe, "MOE_GEMM_CONFIG", dataclasses.replace(
        moe.MOE_GEMM_CONFIG, swap_ab=swap_ab, block_n=block_n))
    g = torch.Generator().manual_seed(21)
    N, K, block = 70, 256, (32, 32)
    x = torch.randn(19, K, generator=g)
    w = (torch.randn(N, K, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // 32), K // 32, generator=g) + 0.5
    b = torch.randn(N, generator=g)
    assert lin.split_k_plan(N, K, block_n, 32)[0] > 1
    full = tri.linear(x, w, b, s, block)
    _close(full, torch_ref.linear(x, w, b, s, block), 1e-4, 1e-5)
    assert torch.equal(tri.linear(x[18:], w, b, s, block)[0], full[18])
    other = dataclasses.replace(lin.FP8_LINEAR_CONFIG, fused_sum=not fused_sum)
    monkeypatch.setattr(lin, "FP8_LINEAR_CONFIG", other)
    assert torch.equal(tri.linear(x, w, b, s, block), full)
    for counters in lin._COUNTERS.values():
        assert int(counters.abs().sum()) == 0

    T, H, inter, E, k = 7, 48, 40, 4, 2
    xm, w13, w2, tw, ids = _moe_inputs(T, H, inter, E, k)
    w13q, w2q = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    s13 = torch.rand(E, -(-2 * inter // 16), -(-H // 16), generator=g) + 0.5
    s2 = torch.rand(E, -(-H // 16), -(-inter // 16), generator=g) + 0.5
    d13 = torch.stack([torch_ref.dequant_fp8_block(w13q[e], s13[e], (16, 16), torch.float32) for e in range(E)])
    d2 = torch.stack([torch_ref.dequant_fp8_block(w2q[e], s2[e], (16, 16), torch.float32) for e in range(E)])
    out = tri.fused_moe(xm, w13q, w2q, tw, ids, s13, s2, (16, 16))
    _close(out, torch_ref_mla.fused_moe(xm, d13, d2, tw, ids), 2e-5, 1e-5)
    assert torch.equal(tri.fused_moe(xm[3:4], w13q, w2q, tw[3:4], ids[3:4], s13, s2, (16, 16))[0], out[3])
    _close(tri.fused_moe(xm, w13, w2, tw, ids), torch_ref_mla.fused_moe(xm, w13, w2, tw, ids), 1e-4, 1e-5)


def test_fused_split_k_sum_counts_each_weight_apart(monkeypatch):
    """The fused split-K sum's tile counters belong to one weight: two GEMMs that may run at once on two streams
    (a layer's side-stream branch beside its main path) never count into each other's tiles, and a weight's
    counters leave with it."""
    import dataclasses
    import gc

    lin = sys.modules["atomtool.serve.ops.triton.linear"]
    monkeypatch.setattr(lin, "FP8_LINEAR_CONFIG", dataclasses.replace(lin.FP8_LINEAR_CONFIG, split_target=64,
                                                                      fused_sum=True))
    g = torch.Generator().manual_seed(5)
    N, K, block = 40, 256, (32, 32)
    x = torch.randn(3, K, generator=g)
    ws = [(torch.randn(N, K, generator=g) * 2).to(torch.float8_e4m3fn) for _ in range(2)]
    s = torch.rand(-(-N // 32), K // 32, generator=g) + 0.5
    assert lin.split_k_plan(N, K, lin.FP8_LINEAR_CONFIG.block_n, 32)[0] > 1
    for w in ws:
        _close(tri.linear(x, w, None, s, block), torch_ref.linear(x, w, None, s, block), 1e-4, 1e-5)
    bufs = [lin._COUNTERS[id(w)] for w in ws]
    assert bufs[0].data_ptr() != bufs[1].data_ptr()
    assert all(int(b.abs().sum()) == 0 for b in bufs)
    key = id(ws[0])
    del ws[0]
    gc.collect()
    assert key not in lin._COUNTERS
