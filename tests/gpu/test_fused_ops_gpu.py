"""The issue-7 fused ops (``mla_rope_store``, ``indexer_rope_store``, ``qk_rope_store_kv``, ``add_rms_norm``),
compiled on a CUDA GPU, against their torch references at DeepSeek-V3.2 sizes (kv_lora_rank 512 + rope 64,
index head 128 with rope 64, 64 index heads, hidden 7168), bf16.

Tolerances: bf16 |out - ref| <= 1e-2 + 1e-2 |ref| (a bf16 ulp or two: same rounding points as the reference;
LayerNorm's float32 mean/variance may differ from torch's in the last float32 bits). Also checked: a row's
result is bitwise the same alone and in a batch (batch invariance), the fused ops equal the unfused Triton
ops they replace bitwise for RMSNorm / rotary / add (same arithmetic), and replaying them from a CUDA graph
equals eager runs bitwise.

Run: ``.venv/bin/pytest -q tests/gpu/test_fused_ops_gpu.py`` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.ops import torch_ref_mla as ref
from tests.kernel_inputs import assert_close_as as _close

DEV = "cuda"
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tri():
    import atomtool.serve.ops.triton as t  # registers everything
    from atomtool.serve.ops.triton import fused_norm, fused_rope

    return t, fused_rope, fused_norm


def _tables(T, half, g):
    ang = torch.rand(T, half, generator=g) * 1000
    return ang.cos().to(DEV), ang.sin().to(DEV)


def _slots(T, nslots, g):
    s = torch.randperm(nslots, generator=g)[:T].to(DEV)
    s[::7] = -1
    return s


@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_rope_store_bf16(tri, interleaved):
    t, fr, _ = tri
    g = torch.Generator().manual_seed(0)
    T, H, R, P, nb, bs = 67, 128, 512, 64, 40, 64
    y = torch.randn(T, 1536 + R + P + 192, generator=g).to(DEV, BF16)
    kv = y[:, 1536:1536 + R + P]
    q_pe = torch.randn(T, H, 128 + P, generator=g).to(DEV, BF16)[..., 128:]
    w = (1 + 0.1 * torch.randn(R, generator=g)).to(DEV, BF16)
    cos, sin = _tables(T, P // 2, g)
    slots = _slots(T, nb * bs, g)
    got = torch.zeros(nb, bs, R + P, dtype=BF16, device=DEV)
    want, unfused = got.clone(), got.clone()
    q_got = fr.mla_rope_store(q_pe, kv, w, 1e-6, cos, sin, interleaved, got, slots)
    q_want = ref.mla_rope_store(q_pe, kv, w, 1e-6, cos, sin, interleaved, want, slots)
    _close(got, want, 1e-2, 1e-2)
    _close(q_got, q_want, 1e-2, 1e-2)
    # the unfused Triton ops it replaces: same arithmetic, same bits
    c_kv = t.rms_norm(kv[:, :R], w, 1e-6)
    k_pe = t.rotary_embedding(kv[:, None, R:], cos, sin, interleaved)[:, 0]
    t.store_cache(torch.cat((c_kv, k_pe), -1), unfused, slots)
    assert torch.equal(got, unfused)
    assert torch.equal(q_got, t.rotary_embedding(q_pe, cos, sin, interleaved))
    alone = torch.zeros_like(got)
    q_alone = fr.mla_rope_store(q_pe[5:6], kv[5:6], w, 1e-6, cos[5:6], sin[5:6], interleaved, alone, slots[5:6])
    s = int(slots[5])
    assert s >= 0 and torch.equal(alone.view(-1, R + P)[s], got.view(-1, R + P)[s])
    assert torch.equal(q_alone[0], q_got[5])


@pytest.mark.parametrize("interleaved", [False, True])
def test_indexer_rope_store_bf16(tri, interleaved):
    t, fr, _ = tri
    g = torch.Generator().manual_seed(1)
    T, H, D, nb, bs = 67, 64, 128, 40, 64
    k = (2 + torch.randn(T, D + 64, generator=g)).to(DEV, BF16)[:, 64:]
    q = torch.randn(T, H, D, generator=g).to(DEV, BF16)
    w_raw = torch.randn(T, H, generator=g).to(DEV, BF16)
    lw = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV, BF16)
    lb = (0.1 * torch.randn(D, generator=g)).to(DEV, BF16)
    cos, sin = _tables(T, 32, g)
    slots = _slots(T, nb * bs, g)
    scale = 64 ** -0.5 * 128 ** -0.5
    got = torch.zeros(nb, bs, D, dtype=BF16, device=DEV)
    want = got.clone()
    q_got, w_got = fr.indexer_rope_store(q, k, w_raw, scale, lw, lb, 1e-6, cos, sin, interleaved, got, slots)
    q_want, w_want = ref.indexer_rope_store(q, k, w_raw, scale, lw, lb, 1e-6, cos, sin, interleaved, want, slots)
    _close(got, want, 1e-2, 1e-2)
    assert torch.equal(q_got[..., :64], t.rotary_embedding(q[..., :64], cos, sin, interleaved))
    assert torch.equal(q_got[..., 64:], q[..., 64:])
    _close(q_got, q_want, 1e-2, 1e-2)
    assert torch.equal(w_got, w_want)
    alone = torch.zeros_like(got)
    fr.indexer_rope_store(q[9:10], k[9:10], w_raw[9:10], scale, lw, lb, 1e-6, cos[9:10], sin[9:10], interleaved,
                          alone, slots[9:10])
    s = int(slots[9])
    assert s >= 0 and torch.equal(alone.view(-1, D)[s], got.view(-1, D)[s])


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_rope_store_kv_bf16(tri, qk_norm):
    """Qwen3-0.6B sizes: 16 query heads, 8 KV heads, head dim 128."""
    from atomtool.serve.ops import torch_ref

    t, fr, _ = tri
    g = torch.Generator().manual_seed(4)
    T, H, Hkv, D, nb, bs = 67, 16, 8, 128, 40, 64
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(DEV, BF16)
    q, k, v = (qkv[:, a * D:b * D].view(T, b - a, D) for a, b in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv)))
    qw, kw = ((1 + 0.1 * torch.randn(D, generator=g)).to(DEV, BF16) for _ in range(2)) if qk_norm else (None, None)
    cos, sin = _tables(T, D // 2, g)
    slots = _slots(T, nb * bs, g)
    caches = [torch.zeros(nb, bs, Hkv, D, dtype=BF16, device=DEV) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    unfused = [c.clone() for c in caches]
    got = fr.qk_rope_store_kv(q, k, v, qw, kw, 1e-6, cos, sin, False, *caches, slots)
    want = torch_ref.qk_rope_store_kv(q, k, v, qw, kw, 1e-6, cos, sin, False, *ref_caches, slots)
    _close(got, want, 1e-2, 1e-2)
    for c, r in zip(caches, ref_caches, strict=True):
        _close(c, r, 1e-2, 1e-2)
    # against the unfused Triton ops: v bitwise; q/k within a bf16 ulp (the per-head norm reduces over a 2-D
    # tile, norm.py over a row: float32 sums in another order)
    uq, uk = (t.rms_norm(q, qw, 1e-6), t.rms_norm(k, kw, 1e-6)) if qk_norm else (q, k)
    uq, uk = t.rotary_embedding(uq, cos, sin, False), t.rotary_embedding(uk, cos, sin, False)
    t.store_kv(uk, v, *unfused, slots)
    assert torch.equal(caches[1], unfused[1])
    _close(got, uq, 1e-2, 1e-2)
    _close(caches[0], unfused[0], 1e-2, 1e-2)
    if not qk_norm:  # no reduction: the same arithmetic, the same bits
        assert torch.equal(got, uq) and torch.equal(caches[0], unfused[0])
    alone = fr.qk_rope_store_kv(q[3:4], k[3:4], v[3:4], qw, kw, 1e-6, cos[3:4], sin[3:4], False,
                                *[torch.zeros_like(c) for c in caches], slots[3:4])
    assert torch.equal(alone[0], got[3])


def test_add_rms_norm_bf16(tri):
    t, _, fn = tri
    g = torch.Generator().manual_seed(2)
    x, e, r = (torch.randn(33, 7168, generator=g).to(DEV, BF16) for _ in range(3))
    w = (1 + 0.1 * torch.randn(7168, generator=g)).to(DEV, BF16)
    o, s = fn.add_rms_norm(x, e, w, 1e-6, r)
    uo, us = t.rms_norm(x + e, w, 1e-6, r)  # the unfused model: routed + shared, then the residual norm
    assert torch.equal(s, us) and torch.equal(o, uo)
    ro, rs = ref.add_rms_norm(x, e, w, 1e-6, r)
    _close(o, ro, 1e-2, 1e-2)
    assert torch.equal(s, rs)


def test_add_rms_norm_sums_planes_as_sum_planes_does(tri):
    """Float32 planes (split-K partials / MoE slots, 13 of them) summed inside the norm: bitwise the separate
    ``sum_planes`` kernel then the norm, with and without an extra, at DeepSeek-V3.2's hidden size."""
    from atomtool.serve.ops.triton.linear import sum_planes

    t, _, fn = tri
    g = torch.Generator().manual_seed(3)
    planes = torch.randn(13, 5, 7168, generator=g).to(DEV)
    e, r = (torch.randn(5, 7168, generator=g).to(DEV, BF16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(7168, generator=g)).to(DEV, BF16)
    summed = sum_planes(planes, torch.empty(5, 7168, dtype=BF16, device=DEV))
    for extra in (e, None):
        got = fn.add_rms_norm(planes, extra, w, 1e-6, r)
        want = fn.add_rms_norm(summed, extra, w, 1e-6, r) if extra is not None else t.rms_norm(summed, w, 1e-6, r)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_fused_ops_replay_in_a_cuda_graph(tri):
    _, fr, fn = tri
    g = torch.Generator().manual_seed(3)
    T = 8
    kv = torch.randn(T, 576, generator=g).to(DEV, BF16)
    q_pe = torch.randn(T, 128, 64, generator=g).to(DEV, BF16)
    k = torch.randn(T, 128, generator=g).to(DEV, BF16)
    q = torch.randn(T, 64, 128, generator=g).to(DEV, BF16)
    w_raw = torch.randn(T, 64, generator=g).to(DEV, BF16)
    x, e, r = (torch.randn(T, 7168, generator=g).to(DEV, BF16) for _ in range(3))
    w512, w7168 = torch.ones(512, dtype=BF16, device=DEV), torch.ones(7168, dtype=BF16, device=DEV)
    lnw, lnb = torch.ones(128, dtype=BF16, device=DEV), torch.zeros(128, dtype=BF16, device=DEV)
    cos, sin = _tables(T, 32, g)
    slots = torch.arange(T, device=DEV)
    lat = torch.zeros(4, 16, 576, dtype=BF16, device=DEV)
    idx = torch.zeros(4, 16, 128, dtype=BF16, device=DEV)

    def step():
        qp = fr.mla_rope_store(q_pe, kv, w512, 1e-6, cos, sin, True, lat, slots)
        qi, wi = fr.indexer_rope_store(q, k, w_raw, 0.01, lnw, lnb, 1e-6, cos, sin, False, idx, slots)
        return [qp, qi, wi, *fn.add_rms_norm(x, e, w7168, 1e-6, r)]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for src in (kv, q_pe, k, q, w_raw, x, e, r):
        src.copy_(torch.randn(src.shape, generator=g).to(DEV, BF16))
    graph.replay()
    replay = [lat.clone(), idx.clone()] + [o.clone() for o in outs]
    eager = step()
    for a, b in zip(replay, [lat, idx, *eager], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("interleaved", [False, True])
def test_indexer_scoring_rotates_queries_bitwise_as_the_rope_store(tri, interleaved):
    """The decode path's scoring rotates the raw index queries itself (``indexer_topk(..., cos, sin)``): the
    orderable score keys must be bitwise those of the queries ``indexer_rope_store`` rotates, in bf16 at
    DeepSeek-V3.2 sizes, with and without the store's own queries (q None leaves keys and weights the same)."""
    _, fr, _ = tri
    from atomtool.serve.ops.triton.indexer import indexer_keys, indexer_topk
    from atomtool.serve.ops.triton.topk import row_range_buffer

    g = torch.Generator().manual_seed(4)
    T, H, D, bs, ctx = 3, 64, 128, 64, 3000
    nb = T * (ctx // bs + 1)
    q = torch.randn(T, H, D, generator=g).to(DEV, BF16)
    k = torch.randn(T, D, generator=g).to(DEV, BF16)
    w_raw = torch.randn(T, H, generator=g).to(DEV, BF16)
    lw, lb = torch.ones(D, dtype=BF16, device=DEV), torch.zeros(D, dtype=BF16, device=DEV)
    cos, sin = _tables(T, 32, g)
    cache = torch.randn(nb, bs, D, generator=g).to(DEV, BF16)
    cache_b = cache.clone()
    slots = torch.tensor([ctx - 1 + b * (ctx // bs + 1) * bs for b in range(T)], device=DEV)
    q_rot, w = fr.indexer_rope_store(q, k, w_raw, 0.01, lw, lb, 1e-6, cos, sin, interleaved, cache, slots)
    none, w_b = fr.indexer_rope_store(None, k, w_raw, 0.01, lw, lb, 1e-6, cos, sin, interleaved, cache_b, slots)
    assert none is None and torch.equal(w, w_b) and torch.equal(cache, cache_b)
    cu = torch.arange(T + 1, dtype=torch.int32, device=DEV)
    seq_lens = torch.full((T,), ctx, dtype=torch.int32, device=DEV)
    per = ctx // bs + 1
    bt = torch.arange(T * per, dtype=torch.int32, device=DEV).view(T, per)
    keys = []
    for qq, tabs in ((q_rot, (None, None)), (q, (cos, sin))):
        rng = row_range_buffer(T, q.device)
        keys.append(indexer_keys(qq, w, cache, cu, seq_lens, bt, 0, T, rng, *tabs, interleaved)[:, :ctx])
        rng.zero_()
    assert torch.equal(keys[0], keys[1])
    assert torch.equal(indexer_topk(q, w, cache, cu, seq_lens, bt, 2048, cos, sin, interleaved),
                       indexer_topk(q_rot, w, cache, cu, seq_lens, bt, 2048))
