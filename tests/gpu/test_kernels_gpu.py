"""Triton kernels, compiled on a CUDA GPU, against the torch reference at realistic sizes.

Tolerances (stated per op; bf16 has 8 mantissa bits, so one rounding is a relative 2^-9 ~ 0.2%):
- rms_norm, rotary, silu_and_mul (bf16): |out - ref| <= 1e-2 + 1e-2 |ref| (a bf16 ulp or two; the kernels
  round at the same points as the reference).
- paged_attention, mla_attention (bf16): <= 1e-2 + 1e-2 |ref| (probabilities rounded to bf16 before the PV
  product, as FlashAttention does); float32: <= 2e-5 (summation order only).
- indexer_topk: exact equality with the reference on integer-valued bf16 inputs (every score is exact, ties
  included); on random bf16 inputs each selected position scores within 1% of the K-th best exact score.
- FP8 block linear and fused MoE (bf16): relative Frobenius error ||out - ref|| / ||ref|| <= 1e-2 (the
  reference rounds the dequantized weight / each expert's product to bf16); float32 MoE <= 1e-4 abs.
Batch invariance: a sequence's attention / indexer output is bitwise identical alone and in a batch
(decode rows through split-KV included); FP8 linear rows for M <= 16 (split-K) and MoE tokens within one
tile-height regime likewise; rows across those thresholds are only recorded in the report.
CUDA graphs: ops captured in one graph and replayed on new inputs equal eager runs bitwise.
"""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.ops import torch_ref, torch_ref_mla
from tests.kernel_inputs import assert_close_as as _close
from tests.kernel_inputs import cu_seqlens, random_block_tables

DEV = "cuda"


@pytest.fixture(scope="module")
def tri():
    import atomtool.serve.ops.triton as t

    return t


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _paged(seq_lens, bs, gen, extra=5):
    nb, bt = random_block_tables(seq_lens, bs, extra, gen)
    return nb, bt.to(DEV)


def _cu(q_lens):
    return cu_seqlens(q_lens, device=DEV)


def _lens(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


# ------------------------------------------------------------------------------ elementwise / norm

def test_rms_norm_rotary_silu_bf16(tri):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(257, 7168, generator=g).to(DEV, torch.bfloat16)
    r = torch.randn(257, 7168, generator=g).to(DEV, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(7168, generator=g)).to(DEV, torch.bfloat16)
    _close(tri.rms_norm(x, w, 1e-6), torch_ref.rms_norm(x, w, 1e-6), 1e-2, 1e-2)
    out, res = tri.rms_norm(x, w, 1e-6, r)
    ref_out, ref_res = torch_ref.rms_norm(x, w, 1e-6, r)
    _close(out, ref_out, 1e-2, 1e-2)
    assert torch.equal(res, ref_res)
    q = torch.randn(300, 64, 192, generator=g).to(DEV, torch.bfloat16)
    ang = (torch.arange(300)[:, None] * torch.rand(32, generator=g)[None]).to(DEV)
    for il in (False, True):
        _close(tri.rotary_embedding(q[..., 128:], ang.cos(), ang.sin(), il),
               torch_ref.rotary_embedding(q[..., 128:], ang.cos(), ang.sin(), il), 1e-2, 1e-2)
    h = torch.randn(300, 2 * 2048, generator=g).to(DEV, torch.bfloat16)
    _close(tri.silu_and_mul(h), torch_ref.silu_and_mul(h), 1e-2, 1e-2)


# ------------------------------------------------------------------------------ paged attention

ATTN_BATCH = ([517, 64, 1, 1, 1], [517, 700, 1000, 17, 4096])  # prefill, prefix-context chunk, decodes


def _attn_inputs(dtype, H=32, Hkv=8, D=128, bs=16, q_lens=ATTN_BATCH[0], seq_lens=ATTN_BATCH[1], seed=1):
    g = torch.Generator().manual_seed(seed)
    nb, bt = _paged(seq_lens, bs, g)
    q = torch.randn(sum(q_lens), H, D, generator=g).to(DEV, dtype)
    kc = torch.randn(nb, bs, Hkv, D, generator=g).to(DEV, dtype)
    vc = torch.randn(nb, bs, Hkv, D, generator=g).to(DEV, dtype)
    return q, kc, vc, _cu(q_lens), _lens(seq_lens), bt, D ** -0.5


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 1e-2, 1e-2), (torch.float32, 2e-5, 1e-5)])
def test_paged_attention(tri, dtype, atol, rtol):
    args = _attn_inputs(dtype)
    _close(tri.paged_attention(*args), torch_ref.paged_attention(*args), atol, rtol)
    # decode-only batch (another launch configuration)
    args = _attn_inputs(dtype, q_lens=[1] * 6, seq_lens=[1, 15, 16, 17, 2048, 3001], seed=2)
    _close(tri.paged_attention(*args), torch_ref.paged_attention(*args), atol, rtol)


def test_paged_attention_batch_invariant(tri):
    q, kc, vc, cu, sl, bt, scale = _attn_inputs(torch.bfloat16)
    full = tri.paged_attention(q, kc, vc, cu, sl, bt, scale)
    for b in (1, 3):  # the chunk with prefix context, a decode
        s, e = int(cu[b]), int(cu[b + 1])
        alone = tri.paged_attention(q[s:e], kc, vc, _cu([e - s]), sl[b:b + 1], bt[b:b + 1], scale)
        assert torch.equal(alone, full[s:e])


def test_paged_attention_split_kv_decode_long_context(tri):
    """Decode rows (split-KV + ordered merge) at Qwen3-0.6B's shape (16 / 8 heads of 128) up to 32k context,
    around the 256-key chunk span; each row bitwise equal alone and in the batch."""
    q_lens, seq_lens = [1] * 6, [1, 255, 256, 257, 8192, 32768 + 5]
    for dtype, atol, rtol in ((torch.bfloat16, 1e-2, 1e-2), (torch.float32, 2e-5, 1e-5)):
        q, kc, vc, cu, sl, bt, scale = _attn_inputs(dtype, H=16, Hkv=8, q_lens=q_lens, seq_lens=seq_lens, seed=7)
        full = tri.paged_attention(q, kc, vc, cu, sl, bt, scale)
        _close(full, torch_ref.paged_attention(q, kc, vc, cu, sl, bt, scale), atol, rtol)
        for b in (0, 3, 5):
            alone = tri.paged_attention(q[b:b + 1], kc, vc, _cu([1]), sl[b:b + 1], bt[b:b + 1], scale)
            assert torch.equal(alone, full[b:b + 1])


def test_store_kv(tri):
    g = torch.Generator().manual_seed(3)
    k = torch.randn(100, 8, 128, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(100, 8, 128, generator=g).to(DEV, torch.bfloat16)
    slots = torch.randperm(64 * 16, generator=g)[:100].to(DEV)
    slots[::7] = -1
    a = [torch.zeros(64, 16, 8, 128, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    b = [t.clone() for t in a]
    tri.store_kv(k, v, *a, slots)
    torch_ref.store_kv(k, v, *b, slots)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------------------ MLA + DSA

def _mla_inputs(dtype, H, q_lens, seq_lens, R=512, P=64, bs=64, seed=4):
    g = torch.Generator().manual_seed(seed)
    nb, bt = _paged(seq_lens, bs, g)
    T = sum(q_lens)
    lat = torch.randn(nb, bs, R + P, generator=g).to(DEV, dtype)
    qn = torch.randn(T, H, R, generator=g).to(DEV, dtype)
    qp = torch.randn(T, H, P, generator=g).to(DEV, dtype)
    return qn, qp, lat, _cu(q_lens), _lens(seq_lens), bt


def _topk_like(q_lens, seq_lens, K, seed=5):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for ql, L in zip(q_lens, seq_lens, strict=True):
        for j in range(ql):
            pos = L - ql + j
            sel = torch.randperm(pos + 1, generator=g)[:min(K, pos + 1)].sort().values
            rows.append(torch.cat([sel, torch.full((K - len(sel),), -1)]))
    return torch.stack(rows).int().to(DEV)


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 1e-2, 1e-2), (torch.float32, 2e-5, 1e-5)])
@pytest.mark.parametrize("H,q_lens,seq_lens", [(16, [300, 40, 1], [300, 3000, 2100]),
                                               (128, [1, 1, 1, 1], [1, 2048, 2049, 5000])])
def test_mla_attention_dense_and_sparse(tri, dtype, atol, rtol, H, q_lens, seq_lens):
    args = _mla_inputs(dtype, H, q_lens, seq_lens)
    scale = 192 ** -0.5
    _close(tri.mla_attention(*args, scale), torch_ref_mla.mla_attention(*args, scale), atol, rtol)
    topk = _topk_like(q_lens, seq_lens, 2048)
    _close(tri.mla_attention(*args, scale, topk), torch_ref_mla.mla_attention(*args, scale, topk), atol, rtol)


def test_mla_split_kv_decode_batch_invariant(tri):
    """Decode rows (split-KV + ordered merge, also fused with W_UV) give the same bits alone, in a decode batch,
    and beside a prefill chunk (which takes the one-program path); contexts around the 256-key dense chunk
    boundary."""
    H, scale = 128, 192 ** -0.5
    q_lens, seq_lens = [1, 1, 1, 1, 1], [255, 256, 257, 2049, 5000]
    qn, qp, lat, cu, sl, bt = _mla_inputs(torch.bfloat16, H, q_lens, seq_lens)
    topk = _topk_like(q_lens, seq_lens, 2048)
    topk[4, 1000:1300] = -1  # padding inside the list: whole chunks empty, one partly
    # with w_uv (the engine's call): the merge fused with W_UV [128, 128 (dv), 512], a strided view as the layer's
    w_uv = (torch.randn(H, 256, 512, generator=torch.Generator().manual_seed(12)) / 512 ** 0.5).to(
        DEV, torch.bfloat16)[:, 128:]
    for tk, wv in [(tk, wv) for tk in (None, topk) for wv in (None, w_uv)]:
        full = tri.mla_attention(qn, qp, lat, cu, sl, bt, scale, tk, w_uv=wv)
        _close(full, torch_ref_mla.mla_attention(qn, qp, lat, cu, sl, bt, scale, tk, w_uv=wv), 1e-2, 1e-2)
        for b in (0, 3, 4):
            sub_tk = None if tk is None else tk[b:b + 1]
            alone = tri.mla_attention(qn[b:b + 1], qp[b:b + 1], lat, _cu([1]), sl[b:b + 1], bt[b:b + 1], scale,
                                      sub_tk, w_uv=wv)
            assert torch.equal(alone, full[b:b + 1])
        # decode row 4 beside a 300-token prefill chunk of sequence 3
        g = torch.Generator().manual_seed(11)
        mq = torch.cat([torch.randn(300, H, 512, generator=g).to(DEV, torch.bfloat16), qn[4:5]])
        mp = torch.cat([torch.randn(300, H, 64, generator=g).to(DEV, torch.bfloat16), qp[4:5]])
        margs = (mq, mp, lat, _cu([300, 1]), sl[3:5], bt[3:5])
        mtk = None if tk is None else torch.cat([_topk_like([300], [2049], 2048), tk[4:5]])
        mixed = tri.mla_attention(*margs, scale, mtk, w_uv=wv)
        _close(mixed, torch_ref_mla.mla_attention(*margs, scale, mtk, w_uv=wv), 1e-2, 1e-2)
        assert torch.equal(mixed[300:], full[4:5])



def _fp8_kv_b_gpu(H=128, dn=128, dv=128, R=512, seed=13):
    """DeepSeek-V3.2's kv_b_proj as FP8 128x128 blocks: (W_UK, W_UV) as HeadWeights and the dequantized bf16
    [H, dn + dv, R] the engine used to cache (``dequant_fp8_block``)."""
    g = torch.Generator().manual_seed(seed)
    n = H * (dn + dv)
    w8 = (torch.randn(n, R, generator=g) * 2).to(torch.float8_e4m3fn).to(DEV)
    sc = (torch.rand(n // 128, R // 128, generator=g) / 64).to(DEV)
    dq = torch_ref.dequant_fp8_block(w8, sc, (128, 128), torch.bfloat16).view(H, dn + dv, R)
    rows = sc.repeat_interleave(128, 0).view(H, dn + dv, -1)
    w = w8.view(H, dn + dv, R)
    return (torch_ref_mla.HeadWeights(w[:, :dn], rows[:, :dn], 128, torch.bfloat16),
            torch_ref_mla.HeadWeights(w[:, dn:], rows[:, dn:], 128, torch.bfloat16), dq)


def test_mla_fp8_head_weights_give_the_bits_of_the_dequantized_weight(tri):
    """The engine's absorbed form reads kv_b_proj as FP8 (W_UK in ``mla_absorb_q``, W_UV in the fused merge,
    both preloaded before the PDL wait and widened in the kernel): close to the dequantized bf16 weight's
    results and the reference at DeepSeek-V3.2 sizes (not bitwise: the H200 run showed the compiled FP8 and
    bf16 forms differ in the last bits), and the absorb batch-invariant (a row alone, among 8, among 300)."""
    uk, uv, dq = _fp8_kv_b_gpu()
    g = torch.Generator().manual_seed(14)
    q = torch.randn(300, 128, 192, generator=g).to(DEV, torch.bfloat16)[..., :128]
    qa = tri.mla_absorb_q(q, uk)
    _close(qa, tri.mla_absorb_q(q, dq[:, :128]), 1e-2, 1e-2)
    _close(qa, torch_ref_mla.mla_absorb_q(q, dq[:, :128]), 1e-2, 1e-2)
    for rows in (slice(7, 8), slice(0, 8)):
        assert torch.equal(tri.mla_absorb_q(q[rows], uk), qa[rows])
    H, scale = 128, 192 ** -0.5
    q_lens, seq_lens = [1, 1, 1], [1, 2049, 5000]
    args = _mla_inputs(torch.bfloat16, H, q_lens, seq_lens)
    topk = _topk_like(q_lens, seq_lens, 2048)
    for tk in (None, topk):
        fp8 = tri.mla_attention(*args, scale, tk, w_uv=uv)
        _close(fp8, tri.mla_attention(*args, scale, tk, w_uv=dq[:, 128:]), 1e-2, 1e-2)
        _close(fp8, torch_ref_mla.mla_attention(*args, scale, tk, w_uv=dq[:, 128:]), 1e-2, 1e-2)


@pytest.mark.parametrize("fp8", [True, False])
def test_mla_cuda_merge_matches_the_triton_merge_and_the_reference(tri, fp8, monkeypatch):
    """The CUDA merge + W_UV kernel (atomtool/serve/ops/cuda/mla_merge_uv.cu: bf16, kv_lora_rank 512, v_head_dim
    128) serves the decode rows on this GPU; it matches the Triton kernel and the reference within bf16
    rounding, sparse and dense, one row tile and two (20 rows), a prefill chunk beside (its rows untouched), and
    a row's bits are the same alone and in the batch."""
    from atomtool.serve.ops.cuda import mla_merge_uv as cm
    from atomtool.serve.ops.cuda.build import nvcc_path

    if nvcc_path() is None:
        pytest.skip("no nvcc: the CUDA merge cannot be built here")
    uk, uv, dq = _fp8_kv_b_gpu()
    w_uv = uv if fp8 else dq[:, 128:]
    assert cm.serves(torch.bfloat16, uv.weight if fp8 else w_uv, uv.scale if fp8 else None, 128, 16,
                     torch.device(DEV))
    H, scale = 128, 192 ** -0.5
    q_lens = [1] * 20 + [37]
    seq_lens = [1, 300, 2049, 5000] * 5 + [3000]
    args = _mla_inputs(torch.bfloat16, H, q_lens, seq_lens)
    topk = _topk_like(q_lens, seq_lens, 2048)
    for tk in (None, topk):
        cuda = tri.mla_attention(*args, scale, tk, w_uv=w_uv)
        _close(cuda, torch_ref_mla.mla_attention(*args, scale, tk, w_uv=dq[:, 128:]), 1e-2, 1e-2)
        monkeypatch.setenv("ATOMTOOL_CUDA_MLA_MERGE", "0")
        triton_out = tri.mla_attention(*args, scale, tk, w_uv=w_uv)
        monkeypatch.delenv("ATOMTOOL_CUDA_MLA_MERGE")
        _close(cuda, triton_out, 1e-2, 1e-2)
        assert torch.equal(cuda[20:], triton_out[20:])  # prefill rows: the reference GEMM either way
        qn, qp, lat, cu, sl, bt = args
        for b in (0, 3, 17):
            alone = tri.mla_attention(qn[b:b + 1], qp[b:b + 1], lat, _cu([1]), sl[b:b + 1], bt[b:b + 1], scale,
                                      None if tk is None else tk[b:b + 1], w_uv=w_uv)
            assert torch.equal(alone, cuda[b:b + 1])


@pytest.mark.parametrize("H", [32, 128, 256])
def test_mla_cuda_split_matches_the_triton_split_and_the_reference(tri, H, monkeypatch):
    """The CUDA split-KV kernel (atomtool/serve/ops/cuda/mla_split.cu: bf16, kv_lora_rank 512, rope 64, heads a
    multiple of its heads per CTA) serves the decode rows on this GPU; its partials, merged, match the Triton split's and the
    reference within bf16 rounding: dense rows from 1 key to 20,000 (chunks of one to ten 64-key blocks, the
    stage refill), sparse rows with padding and entries past the query's position, a strided latent cache, and
    a peaked softmax (scale 1: each row's output is its best key's latent row, so a wrong key shows). A row's
    bits are the same alone and in the batch."""
    from atomtool.serve.ops.cuda import mla_split as cs
    from atomtool.serve.ops.cuda.build import nvcc_path

    if nvcc_path() is None:
        pytest.skip("no nvcc: the CUDA split kernel cannot be built here")
    q_lens, seq_lens = [1] * 6, [1, 5, 130, 2049, 5000, 20000]
    qn, qp, lat, cu, sl, bt = _mla_inputs(torch.bfloat16, H, q_lens, seq_lens)
    wide = torch.zeros(*lat.shape[:2], 640, device=DEV, dtype=torch.bfloat16)
    wide[..., :576] = lat
    topk = _topk_like(q_lens, seq_lens, 2048)
    topk[3, 100:180] = -1  # padding inside the list
    topk[4, 5:9] = 4999 + torch.arange(1, 5, device=DEV, dtype=torch.int32)  # past the query's position
    assert cs.serves(qn, qp, lat, bt, topk) and cs.serves(qn, qp, wide[..., :576], bt, topk)
    for latent, tk, scale in [(lat, None, 192 ** -0.5), (lat, topk, 192 ** -0.5), (wide[..., :576], topk, 192 ** -0.5),
                              (lat, None, 1.0), (lat, topk, 1.0)]:
        args = (qn, qp, latent, cu, sl, bt)
        cuda = tri.mla_attention(*args, scale, tk)
        _close(cuda, torch_ref_mla.mla_attention(*args, scale, tk), 1e-2, 1e-2)
        monkeypatch.setenv("ATOMTOOL_CUDA_MLA_SPLIT", "0")
        triton_out = tri.mla_attention(*args, scale, tk)
        monkeypatch.delenv("ATOMTOOL_CUDA_MLA_SPLIT")
        _close(cuda, triton_out, 1e-2, 1e-2)
        for b in (1, 5):  # alone: 32 heads per CTA (one wave); the batch of 6: 64 when H allows
            alone = tri.mla_attention(qn[b:b + 1], qp[b:b + 1], latent, _cu([1]), sl[b:b + 1], bt[b:b + 1], scale,
                                      None if tk is None else tk[b:b + 1])
            assert torch.equal(alone, cuda[b:b + 1])
        if H % 64 == 0:  # both CTA sizes forced over the whole batch: the same bits
            forced = []
            for heads in (32, 64):
                monkeypatch.setattr(cs, "HEADS", heads)
                forced.append(tri.mla_attention(*args, scale, tk))
            monkeypatch.setattr(cs, "HEADS", None)
            assert torch.equal(forced[0], forced[1]) and torch.equal(forced[0], cuda)


def _indexer_inputs(q_lens, seq_lens, integer, Hi=64, Di=128, bs=64, seed=6):
    g = torch.Generator().manual_seed(seed)
    nb, bt = _paged(seq_lens, bs, g)
    T = sum(q_lens)
    if integer:
        q = torch.randint(-2, 3, (T, Hi, Di), generator=g).float()
        kc = torch.randint(-2, 3, (nb, bs, Di), generator=g).float()
        w = torch.randint(-2, 3, (T, Hi), generator=g).float()
    else:
        q, kc, w = torch.randn(T, Hi, Di, generator=g), torch.randn(nb, bs, Di, generator=g), torch.rand(T, Hi, generator=g)
    return (q.to(DEV, torch.bfloat16), w.to(DEV), kc.to(DEV, torch.bfloat16), _cu(q_lens), _lens(seq_lens), bt)


INDEXER_BATCH = ([1, 1, 1, 1, 500, 37], [2047, 2048, 2049, 5000, 2500, 4000])


def test_indexer_topk_exact_on_integer_scores(tri):
    args = _indexer_inputs(*INDEXER_BATCH, integer=True)
    out, ref = tri.indexer_topk(*args, 2048), torch_ref_mla.indexer_topk(*args, 2048)
    assert torch.equal(out, ref)
    # batch invariance: the 500-token chunk alone selects exactly the same positions
    q, w, kc, cu, sl, bt = args
    s, e = int(cu[4]), int(cu[5])
    alone = tri.indexer_topk(q[s:e], w[s:e], kc, _cu([e - s]), sl[4:5], bt[4:5], 2048)
    assert torch.equal(alone, out[s:e])


def test_indexer_topk_random_bf16_selects_top_scores(tri, gpu_report):
    q_lens, seq_lens = [1, 3], [5000, 3000]
    q, w, kc, cu, sl, bt = _indexer_inputs(q_lens, seq_lens, integer=False)
    out = tri.indexer_topk(q, w, kc, cu, sl, bt, 2048)
    ref = torch_ref_mla.indexer_topk(q, w, kc, cu, sl, bt, 2048)
    overlap = []
    for b, L in enumerate(seq_lens):
        k_all = kc[bt[b, : -(-L // 64)].long()].reshape(-1, kc.shape[-1])[:L].float()
        for t in range(int(cu[b]), int(cu[b + 1])):
            pos = L - (int(cu[b + 1]) - t)
            scores = (w[t, :, None] * torch.relu(q[t].float() @ k_all[:pos + 1].T)).sum(0)
            kth = scores.sort(descending=True).values[2047]
            sel = out[t].long()
            assert (sel >= 0).all() and sel.unique().numel() == 2048
            assert (scores[sel] >= kth - 0.01 * kth.abs()).all()
            overlap.append(len(set(sel.tolist()) & set(ref[t].tolist())) / 2048)
    gpu_report["indexer_bf16_selection_overlap_with_reference_min"] = min(overlap)


# ------------------------------------------------------------------------------ FP8 linear, MoE

def _fp8_weight(N, K, gen, block=(128, 128), lead=()):
    w = torch.randn(*lead, N, K, generator=gen) * 0.05
    s = torch.rand(*lead, -(-N // block[0]), -(-K // block[1]), generator=gen) * 0.02 + 0.01
    q = (w / s.repeat_interleave(block[0], -2)[..., :N, :].repeat_interleave(block[1], -1)[..., :K]).clamp(-448, 448)
    return q.to(torch.float8_e4m3fn).to(DEV), s.to(DEV)


@pytest.mark.parametrize("M", [1, 5, 16, 17, 77, 1024])
def test_fp8_block_linear(tri, M, gpu_report):
    g = torch.Generator().manual_seed(7)
    w, s = _fp8_weight(4096 + 64, 7168, g)  # N not a multiple of 128
    x = torch.randn(M, 7168, generator=g).to(DEV, torch.bfloat16)
    err = _rel(tri.linear(x, w, None, s), torch_ref.linear(x, w, None, s))
    gpu_report[f"fp8_linear_rel_err_M{M}"] = err
    assert err <= 1e-2


@pytest.mark.parametrize("N,K", [(7168, 16384), (2112, 7168), (24576, 1536)])  # o_proj, q_a+kv_a, q_b
def test_fp8_block_linear_small_m_split_k_batch_invariant(tri, N, K, gpu_report):
    """Split-K (splits chosen from the weight only, partials summed in split order) for every M: accurate,
    and each row bitwise equal alone, in a batch of 16 and in a prefill-sized batch."""
    g = torch.Generator().manual_seed(17)
    w, s = _fp8_weight(N, K, g)
    x = torch.randn(16, K, generator=g).to(DEV, torch.bfloat16)
    b = torch.randn(N, generator=g).to(DEV, torch.bfloat16)
    full = tri.linear(x, w, b, s)
    err = _rel(full, torch_ref.linear(x, w, b, s))
    gpu_report[f"fp8_linear_split_k_rel_err_N{N}_K{K}"] = err
    assert err <= 1e-2
    for m in (1, 3, 16):
        sub = tri.linear(x[:m], w, b, s)
        assert torch.equal(sub, full[:m])
        assert torch.equal(tri.linear(x[m - 1:m], w, b, s)[0], full[m - 1])
    assert torch.equal(tri.linear(x[:1], w, b, s), tri.linear(x[:1], w, b, s))  # deterministic
    big = tri.linear(torch.cat([x, x]).repeat(40, 1)[:1100], w, b, s)  # > SPLIT_ROWS: several launches
    assert torch.equal(big[0], full[0]) and torch.equal(big[1099], full[1099 % 16])


@pytest.mark.parametrize("M", [1, 7, 16, 600])
def test_fp8_block_linear_tma_changes_no_bit(tri, M, monkeypatch):
    """The Hopper TMA path (Fp8LinearConfig.tma) fetches the same tiles as the masked loads: bitwise the same
    output, with and without bias, for a K that is not a whole number of steps, an N that is not a whole number
    of tiles, and an activation view whose alignment rules TMA out (it falls back)."""
    import dataclasses
    import importlib

    L = importlib.import_module("atomtool.serve.ops.triton.linear")  # the package re-exports the op `linear`

    g = torch.Generator().manual_seed(23)
    w, s = _fp8_weight(2112 + 40, 7168 - 64, g)
    x = torch.randn(M, 7168, generator=g).to(DEV, torch.bfloat16)
    b = torch.randn(w.shape[0], generator=g).to(DEV, torch.bfloat16)
    outs = {}
    for tma in (False, True):
        monkeypatch.setattr(L, "FP8_LINEAR_CONFIG", dataclasses.replace(L.FP8_LINEAR_CONFIG, tma=tma))
        assert L._tma_ok(L.FP8_LINEAR_CONFIG, x[:, :7104], w) == (tma and torch.cuda.get_device_capability()[0] >= 9)
        outs[tma] = (tri.linear(x[:, :7104], w, None, s), tri.linear(x[:, :7104], w, b, s),
                     tri.linear(x[:, 1:7105], w, b, s))
    for a, c in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize("mode", ["dynamic", "dynamic_ue8m0"])
@pytest.mark.parametrize("N,K", [(7168, 16384), (2112 + 40, 7168), (24576, 1536)])
def test_fp8_block_linear_w8a8(tri, mode, N, K, monkeypatch, gpu_report):
    """W8A8 (per-token 1x128 activation groups quantized in the kernel, e4m3 x e4m3 tensor-core dots) against
    the W8A8 reference for M = 1 .. 600, with the TMA and the pointer tile loads giving the same bits, and
    each row the same bits alone as in the batch; its distance to the weight-only result is reported."""
    import dataclasses
    import importlib

    L = importlib.import_module("atomtool.serve.ops.triton.linear")
    g = torch.Generator().manual_seed(29)
    w, s = _fp8_weight(N, K, g)
    x = torch.randn(600, K, generator=g).to(DEV, torch.bfloat16)
    b = torch.randn(N, generator=g).to(DEV, torch.bfloat16)
    full = tri.linear(x, w, b, s, (128, 128), mode)
    ref = torch_ref.linear(x.float(), w, b.float(), s, (128, 128), mode)
    err = _rel(full, ref)
    gpu_report[f"fp8_w8a8_{mode}_rel_err_N{N}_K{K}"] = err
    gpu_report[f"fp8_w8a8_{mode}_vs_weight_only_rel_N{N}_K{K}"] = _rel(full, torch_ref.linear(x.float(), w, b.float(), s))
    assert err <= 1e-2
    for m in (1, 7, 16):
        assert torch.equal(tri.linear(x[:m], w, b, s, (128, 128), mode), full[:m])
        assert torch.equal(tri.linear(x[m - 1:m], w, b, s, (128, 128), mode)[0], full[m - 1])
    monkeypatch.setattr(L, "FP8_LINEAR_W8A8_CONFIG", dataclasses.replace(L.FP8_LINEAR_W8A8_CONFIG, tma=False))
    assert not L._tma_ok(L.FP8_LINEAR_W8A8_CONFIG, x, w)  # the pointer kernel now
    assert torch.equal(tri.linear(x[:17], w, b, s, (128, 128), mode), full[:17])


def test_fused_moe_w8a8(tri, gpu_report):
    """W8A8 experts against the W8A8 reference at decode and prefill sizes; a token's bits do not depend on
    its batch."""
    g = torch.Generator().manual_seed(19)
    E, k, H, inter = 64, 6, 1024, 512
    x = torch.randn(300, H, generator=g).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(300)]).to(DEV)
    tw = torch.rand(300, k, generator=g).to(DEV)
    q13, s13 = _fp8_weight(2 * inter, H, g, lead=(E,))
    q2, s2 = _fp8_weight(H, inter, g, lead=(E,))
    for mode in ("dynamic", "dynamic_ue8m0"):
        out = tri.fused_moe(x, q13, q2, tw, ids, s13, s2, (128, 128), mode)
        err = _rel(out, torch_ref_mla.fused_moe(x.float(), q13, q2, tw, ids, s13, s2, (128, 128), mode))
        gpu_report[f"fused_moe_w8a8_{mode}_rel_err"] = err
        assert err <= 2e-2
        for t in (0, 7, 299):
            assert torch.equal(tri.fused_moe(x[t:t + 1], q13, q2, tw[t:t + 1], ids[t:t + 1], s13, s2, (128, 128),
                                             mode)[0], out[t])


@pytest.mark.parametrize("T", [1, 64, 1000])
def test_fused_moe_bf16_and_fp8(tri, T, gpu_report):
    g = torch.Generator().manual_seed(8)
    E, k, H, inter = 64, 6, 1024, 512
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    tw = torch.rand(T, k, generator=g).to(DEV)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).to(DEV, torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(DEV, torch.bfloat16)
    err = _rel(tri.fused_moe(x, w13, w2, tw, ids), torch_ref_mla.fused_moe(x, w13, w2, tw, ids))
    gpu_report[f"fused_moe_bf16_rel_err_T{T}"] = err
    assert err <= 1e-2
    q13, s13 = _fp8_weight(2 * inter, H, g, lead=(E,))
    q2, s2 = _fp8_weight(H, inter, g, lead=(E,))
    d13 = torch.stack([torch_ref.dequant_fp8_block(q13[e], s13[e], (128, 128), torch.bfloat16) for e in range(E)])
    d2 = torch.stack([torch_ref.dequant_fp8_block(q2[e], s2[e], (128, 128), torch.bfloat16) for e in range(E)])
    err8 = _rel(tri.fused_moe(x, q13, q2, tw, ids, s13, s2), torch_ref_mla.fused_moe(x, d13, d2, tw, ids))
    gpu_report[f"fused_moe_fp8_rel_err_T{T}"] = err8
    assert err8 <= 1e-2


def test_fused_moe_decode_tiles_batch_invariant(tri, gpu_report):
    """Expert tiles are 16 rows for every batch (MOE_BLOCK_M): a token gives the same bits alone, in a
    64-token batch and in a 1000-token batch, BF16 and FP8."""
    g = torch.Generator().manual_seed(12)
    E, k, H, inter, T = 64, 6, 1024, 512, 64
    x = torch.randn(1000, H, generator=g).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(1000)]).to(DEV)
    ids[5, 2] = -1
    tw = torch.rand(1000, k, generator=g).to(DEV)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).to(DEV, torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(DEV, torch.bfloat16)
    q13, s13 = _fp8_weight(2 * inter, H, g, lead=(E,))
    q2, s2 = _fp8_weight(H, inter, g, lead=(E,))
    for _name, a13, a2, extra in (("bf16", w13, w2, ()), ("fp8", q13, q2, (s13, s2))):
        def run(a, b, a13=a13, a2=a2, extra=extra):
            return tri.fused_moe(x[a:b], a13, a2, tw[a:b], ids[a:b], *extra)
        batch = run(0, T)
        for t in (0, 5, 63):
            assert torch.equal(run(t, t + 1)[0], batch[t])
        assert torch.equal(run(0, 1000)[:T], batch)


def test_fused_moe_fp32(tri):
    g = torch.Generator().manual_seed(9)
    T, E, k, H, inter = 50, 16, 4, 256, 128
    x = torch.randn(T, H, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    tw = torch.rand(T, k, generator=g).to(DEV)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).to(DEV)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(DEV)
    _close(tri.fused_moe(x, w13, w2, tw, ids), torch_ref_mla.fused_moe(x, w13, w2, tw, ids), 1e-4, 1e-4)


# ------------------------------------------------------------------------------ CUDA graph capture

def test_ops_replay_in_a_cuda_graph(tri):
    """The decode-path ops launch without host syncs: capture once, change the inputs in place, replay."""
    q_lens, seq_lens = [1, 1, 1], [700, 2049, 33]
    qn, qp, lat, cu, sl, bt = _mla_inputs(torch.bfloat16, 16, q_lens, seq_lens)
    iq, iw, ikc, _, _, _ = _indexer_inputs(q_lens, seq_lens, integer=False)
    ikc = torch.randn(lat.shape[0], lat.shape[1], 128, device=DEV).bfloat16()
    x = torch.randn(3, 1024, device=DEV).bfloat16()
    w13 = (torch.randn(8, 1024, 1024, device=DEV) * 0.05).bfloat16()
    w2 = (torch.randn(8, 1024, 512, device=DEV) * 0.05).bfloat16()
    ids = torch.tensor([[0, 3], [7, 3], [5, 1]], device=DEV)
    tw = torch.rand(3, 2, device=DEV)

    def step():
        topk = tri.indexer_topk(iq, iw, ikc, cu, sl, bt, 64)
        return tri.mla_attention(qn, qp, lat, cu, sl, bt, 0.1, topk), tri.fused_moe(x, w13, w2, tw, ids)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (qn, iq, x):
        t.copy_(torch.randn_like(t))
    sl.copy_(_lens([650, 2049, 40]))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(outs, eager, strict=True):
        assert torch.equal(a, b)


def test_fused_moe_direct_layout_bitwise(tri, gpu_report, monkeypatch):
    """DeepSeek-V3.2 MoE shapes (H 7168, I 2048, E 256, k 8, FP8 128 x 128 blocks, bf16 activations), weight-only
    and W8A8 ``dynamic_ue8m0``: at T == 1 the direct layout (no ``moe_align``, no zero-fill of the slot planes)
    gives the aligned layout's bits, also with slots routed to experts not served here (-1, E + 3)
    (tests/test_moe_decode_path.py checks the same under the interpreter). Records both layouts' time per MoE
    layer at T == 1 (CUDA-graph replays)."""
    from atomtool.serve.ops.triton import moe

    H, inter, E, k = 7168, 2048, 256, 8
    g = torch.Generator(device=DEV).manual_seed(23)
    q13 = (torch.randn(E, 2 * inter, H, generator=g, device=DEV, dtype=torch.bfloat16) * 8).to(torch.float8_e4m3fn)
    q2 = (torch.randn(E, H, inter, generator=g, device=DEV, dtype=torch.bfloat16) * 8).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 2 * inter // 128, H // 128, generator=g, device=DEV) * 0.002 + 0.002
    s2 = torch.rand(E, H // 128, inter // 128, generator=g, device=DEV) * 0.002 + 0.002
    x = torch.randn(1, H, generator=g, device=DEV).bfloat16()
    ids = torch.randperm(E, generator=g, device=DEV)[:k][None]
    tw = torch.rand(1, k, generator=g, device=DEV)
    foreign = ids.clone()
    foreign[0, 2], foreign[0, 5] = -1, E + 3
    real_empty = torch.empty

    def nan_empty(*shape, **kw):  # memory left unwritten shows up as NaN in the output
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def run(i, mode, direct, w=tw):
        return moe._fused_moe(x, q13, q2, w, i, s13, s2, (128, 128), mode, direct=direct)

    for mode in (None, "dynamic_ue8m0"):
        name = mode or "weight_only"
        for i in (ids, foreign):
            monkeypatch.setattr(torch, "empty", nan_empty)
            direct = run(i, mode, True)
            monkeypatch.setattr(torch, "empty", real_empty)
            assert not direct.isnan().any()
            assert torch.equal(direct, run(i, mode, False)), name
            assert torch.equal(tri.fused_moe(x, q13, q2, tw, i, s13, s2, (128, 128), mode), direct)
        kept = [j for j in range(k) if j not in (2, 5)]  # the foreign slots add exactly zero
        assert torch.equal(run(foreign, mode, True), run(foreign[:, kept], mode, False, tw[:, kept]))
        ref = torch_ref_mla.fused_moe(x.float(), q13, q2, tw, ids, s13, s2, (128, 128), mode)
        gpu_report[f"fused_moe_dsv32_T1_{name}_rel_err"] = err = _rel(run(ids, mode, True), ref)
        assert err <= 5e-2, (name, err)  # sanity only (bf16 activations vs the float32 reference)
        for direct_ in (False, True):
            us = _graph_us(lambda d=direct_, m=mode: run(ids, m, d), reps=20)
            gpu_report[f"fused_moe_dsv32_T1_{name}_{'direct' if direct_ else 'aligned'}_us"] = round(us, 1)


# ------------------------------------------------------------------------------ MoE router logits

def _graph_us(fn, reps=50):
    """Mean device time of ``fn()`` in microseconds, replayed from a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


@pytest.mark.parametrize("T", [1, 64])
def test_router_logits_bf16(tri, T, gpu_report):
    """The MoE gate's logits at DeepSeek-V3 shapes (E 256, H 7168, bf16 x and weight): within
    1e-5 * (|x| @ |w|^T) of the float64 product and 2e-5 of the float32 reference (exact bf16 products, float32
    sums in another order), every row bitwise the same alone, in prefixes of the batch and in the batch; the
    kernel's and the torch path's (cast + float32 GEMV over a float32 weight copy) times go to the report."""
    g = torch.Generator().manual_seed(29)
    x = torch.randn(T, 7168, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(256, 7168, generator=g) * 0.02).to(DEV, torch.bfloat16)
    out = tri.router_logits(x, w)
    mag = (x.double().abs() @ w.double().abs().T)
    err = (out.double() - x.double() @ w.double().T).abs()
    gpu_report[f"router_logits_err_over_mag_T{T}"] = float((err / mag).max())
    assert bool((err <= 1e-5 * mag).all())
    assert bool(((out - torch_ref.router_logits(x, w)).abs().double() <= 2e-5 * mag).all())
    for t in sorted({0, T // 2, T - 1}):
        assert torch.equal(tri.router_logits(x[t:t + 1], w), out[t:t + 1])
    for m in (2, 16, 17):
        if m < T:
            assert torch.equal(tri.router_logits(x[:m], w), out[:m])
    assert torch.equal(tri.router_logits(x, w), out)  # deterministic
    w32 = w.float()
    gpu_report[f"router_logits_us_T{T}"] = _graph_us(lambda: tri.router_logits(x, w))
    gpu_report[f"router_logits_torch_path_us_T{T}"] = _graph_us(lambda: torch.nn.functional.linear(x.float(), w32))


#: router_logits tiles (BT, BE, UNROLL, warps, stages) timed by test_router_logits_configs, besides _CONFIGS
_ROUTER_TILES = ((1, 2, 8, 2, 4), (1, 1, 8, 1, 4), (1, 4, 8, 2, 4), (1, 2, 16, 1, 3), (1, 2, 4, 1, 6),
                 (1, 2, 8, 1, 1), (2, 4, 4, 2, 4), (4, 4, 4, 4, 3))


@pytest.mark.parametrize("T", [1, 64])
def test_router_logits_configs(T, gpu_report):
    """Every tile of router_logits gives bitwise the default's logits compiled too (the order is fixed by the
    128 lanes, router_gemv's module doc), and so does a launch without PDL (no L2 prefetch); each tile's time
    goes to the report, for retuning _CONFIGS."""
    import importlib

    R = importlib.import_module("atomtool.serve.ops.triton.router_gemv")
    g = torch.Generator().manual_seed(31)
    x = torch.randn(T, 7168, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(256, 7168, generator=g) * 0.02).to(DEV, torch.bfloat16)
    ref = R.router_logits(x, w)
    with pytest.MonkeyPatch.context() as mp:  # without PDL (and so without the L2 prefetch): same bits
        mp.setitem(importlib.import_module("atomtool.serve.ops.triton._common")._PDL, str(x.device), False)
        assert torch.equal(R.router_logits(x, w), ref)
        gpu_report[f"router_logits_us_T{T}_no_pdl"] = round(_graph_us(lambda: R.router_logits(x, w)), 2)
    for cfg in {tuple(c[1:]) for c in R._CONFIGS} | set(_ROUTER_TILES):
        assert torch.equal(R.router_logits(x, w, config=cfg), ref), cfg
        gpu_report[f"router_logits_us_T{T}_tile{'_'.join(map(str, cfg))}"] = round(
            _graph_us(lambda cfg=cfg: R.router_logits(x, w, config=cfg)), 2)
