"""The fused ops (atomtool/serve/ops/triton/fused_rope.py, fused_norm.py) vs their torch references, on CPU
under Triton's interpreter (TRITON_INTERPRET=1).

``mla_rope_store`` / ``indexer_rope_store`` / ``qk_rope_store_kv`` / ``add_rms_norm`` replace compositions of
reference ops (norm, rotary, concatenation, cache store, cast, add) by one kernel each (issue 7). Checked here: both rotary
pairings, padding slots (-1: nothing written), rows that are column slices of a wider projection output,
odd widths and head counts over one head program (masking), the indexer with rope on part of the head, all
of it and none, float32 tight and bf16 loose (the interpreter rounds bf16 stores by truncation, see
tests/test_triton_ops.py), and the shape errors.
"""

from __future__ import annotations

from tests.triton_interp import harness, setup_interpreter  # noqa: E402  (imports neither torch nor triton)

_TRITON_PREIMPORTED = setup_interpreter()

import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install 'atomtool[serve]')")

from atomtool.serve import ops as dispatch  # noqa: E402
from atomtool.serve.ops import torch_ref_mla as ref  # noqa: E402
from tests.kernel_inputs import assert_close_as as _close  # noqa: E402

if not _TRITON_PREIMPORTED:
    import atomtool.serve.ops.triton as tri_pkg  # noqa: E402, F401  (registers the backend)
    from atomtool.serve.ops.triton import fused_norm  # noqa: E402
    from atomtool.serve.ops.triton import fused_rope as tri  # noqa: E402


_interpreted_only, test_suite_in_a_fresh_process = harness(__file__, _TRITON_PREIMPORTED)


def test_registered_with_the_reference_signatures():
    from atomtool.serve.ops import torch_ref

    for name, fn in tri.OPS.items():
        reference = getattr(ref, name, None) or getattr(torch_ref, name)
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(reference).parameters)
        assert dispatch._REGISTRY[(name, "triton")] is fn
        assert dispatch.get_op(name, "cpu") is reference


def test_add_rms_norm():
    assert dispatch._REGISTRY[("add_rms_norm", "triton")] is fused_norm.add_rms_norm
    g = torch.Generator().manual_seed(4)
    x, e, r = (torch.randn(5, 2 * 37 + 3, generator=g) for _ in range(3))  # odd width: masked lanes
    w = 1 + 0.1 * torch.randn(x.shape[1], generator=g)
    out, res = fused_norm.add_rms_norm(x, e, w, 1e-6, r)
    ref_out, ref_res = ref.add_rms_norm(x, e, w, 1e-6, r)
    _close(out, ref_out, 1e-5, 1e-5)
    _close(res, ref_res, 0.0)
    # the reference is the unfused model: rms_norm(residual + (x + extra))
    _close(ref_res, r + (x + e), 0.0)
    xb, eb, rb, wb = (t.bfloat16() for t in (x, e, r, w))
    out, res = fused_norm.add_rms_norm(xb, eb[:, :], wb, 1e-6, rb)
    ref_out, ref_res = ref.add_rms_norm(xb, eb, wb, 1e-6, rb)
    _close(out, ref_out, 0.1, 0.03)
    _close(res, ref_res, 0.05, 0.02)
    with pytest.raises(ValueError, match="do not fit"):
        fused_norm.add_rms_norm(x, e[:, 1:], w, 1e-6, r)
    with pytest.raises(ValueError, match="dtypes"):
        fused_norm.add_rms_norm(x, eb, w, 1e-6, r)


def test_add_rms_norm_sums_float32_planes_first():
    """x as [S, T, H] float32 planes: summed in plane order, rounded to the dtype, then the same formula, on
    both backends (the Triton kernel bitwise equal to the reference and to the unfused sum + op); bad planes
    (wrong dtype, shape, none) raise the op's ValueError on both."""
    g = torch.Generator().manual_seed(5)
    planes = torch.randn(3, 4, 2 * 37 + 3, generator=g)
    e, r = (torch.randn(4, planes.shape[2], generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(planes.shape[2], generator=g)).bfloat16()
    from atomtool.serve.ops.triton.linear import sum_planes

    # each backend against its own unfused form, bitwise (the interpreter's bf16 casts truncate, so the
    # backends only agree within rounding, checked last)
    summed = ((planes[0] + planes[1]) + planes[2]).bfloat16()
    tri_summed = sum_planes(planes, torch.empty_like(summed))
    for got, want in ((ref.add_rms_norm(planes, e, w, 1e-6, r), ref.add_rms_norm(summed, e, w, 1e-6, r)),
                      (fused_norm.add_rms_norm(planes, e, w, 1e-6, r),
                       fused_norm.add_rms_norm(tri_summed, e, w, 1e-6, r))):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(fused_norm.add_rms_norm(planes, e, w, 1e-6, r), ref.add_rms_norm(planes, e, w, 1e-6, r),
                    strict=True):
        _close(a, b, 0.1, 0.03)
    for backend in (ref.add_rms_norm, fused_norm.add_rms_norm):
        with pytest.raises(ValueError, match="planes are float32"):
            backend(planes.bfloat16(), e, w, 1e-6, r)
        with pytest.raises(ValueError, match="do not fit"):
            backend(planes[:, :3], e, w, 1e-6, r)
        with pytest.raises(ValueError, match="do not fit"):
            backend(planes[:0], e, w, 1e-6, r)
    # no extra: rms_norm with a residual, of the summed planes
    for got, want in ((ref.add_rms_norm(planes, None, w, 1e-6, r), ref.rms_norm(summed, w, 1e-6, r)),
                      (fused_norm.add_rms_norm(planes, None, w, 1e-6, r),
                       fused_norm.add_rms_norm(tri_summed, torch.zeros_like(r), w, 1e-6, r))):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _tables(T, half, seed=0):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(T, half, generator=g) * 40
    return ang.cos(), ang.sin()


SLOTS = torch.tensor([5, -1, 0, 13, 7, -1])  # two padding tokens; slots across blocks


def _untouched(cache, value=9.0):
    nb, bs = cache.shape[:2]
    rows = torch.ones(nb * bs, dtype=torch.bool)
    rows[SLOTS[SLOTS >= 0]] = False
    return bool((cache.reshape(nb * bs, -1)[rows] == value).all())


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_rope_store(interleaved, dtype):
    T, H, R, P, nb, bs = 6, 19, 24, 10, 4, 4  # 19 heads: two head programs; R not a power of two; P/2 odd
    g = torch.Generator().manual_seed(1)
    y = torch.randn(T, 7 + R + P + 3, generator=g).to(dtype)  # a wider fused projection row
    kv = y[:, 7:7 + R + P]
    q = torch.randn(T, H, 5 + P, generator=g).to(dtype)  # rope slice after 5 nope dims: a strided view
    w = (1 + 0.1 * torch.randn(R, generator=g)).to(dtype)
    cos, sin = _tables(T, P // 2)
    got = torch.full((nb, bs, R + P), 9.0, dtype=dtype)
    want = got.clone()
    q_got = tri.mla_rope_store(q[..., 5:], kv, w, 1e-6, cos, sin, interleaved, got, SLOTS)
    q_want = ref.mla_rope_store(q[..., 5:], kv, w, 1e-6, cos, sin, interleaved, want, SLOTS)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (0.05, 0.02)
    _close(got, want, *tol)
    _close(q_got, q_want, *tol)
    assert _untouched(got)


def test_mla_rope_store_errors_and_empty():
    cache = torch.zeros(2, 4, 12)
    q = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="do not fit latent cache"):
        tri.mla_rope_store(q, torch.randn(1, 12), torch.ones(8), 1e-6, *_tables(1, 3), False, cache, SLOTS[:1])
    with pytest.raises(ValueError, match="contiguous"):
        tri.mla_rope_store(q, torch.randn(1, 12), torch.ones(8), 1e-6, *_tables(1, 2), False,
                           torch.zeros(2, 12, 4).transpose(1, 2), SLOTS[:1])
    out = tri.mla_rope_store(q[:0], torch.randn(0, 12), torch.ones(8), 1e-6, *_tables(0, 2), False, cache,
                             SLOTS[:0])
    assert out.shape == (0, 2, 4) and (cache == 0).all()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [10, 40, 0])  # part of the head, all of it, none
def test_indexer_rope_store(interleaved, dtype, rope):
    T, H, D, nb, bs = 6, 19, 40, 4, 4
    g = torch.Generator().manual_seed(2)
    y = (3 + torch.randn(T, D + 9, generator=g)).to(dtype)  # non-zero mean: the centering matters
    k = y[:, 5:5 + D]
    q = torch.randn(T, H, D, generator=g).to(dtype)
    w_raw = torch.randn(T, H + 3, generator=g).to(dtype)[:, 3:]
    lw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    lb = (0.1 * torch.randn(D, generator=g)).to(dtype)
    cos, sin = _tables(T, rope // 2) if rope else (None, None)
    got = torch.full((nb, bs, D), 9.0, dtype=dtype)
    want = got.clone()
    q_got, w_got = tri.indexer_rope_store(q, k, w_raw, 0.0625, lw, lb, 1e-6, cos, sin, interleaved, got, SLOTS)
    q_want, w_want = ref.indexer_rope_store(q, k, w_raw, 0.0625, lw, lb, 1e-6, cos, sin, interleaved, want,
                                            SLOTS)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (0.05, 0.02)
    _close(got, want, *tol)
    _close(q_got, q_want, *tol)
    _close(w_got, w_want, 0.0)  # float32(w_raw) * scale: exact
    assert _untouched(got)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_indexer_rope_store_without_queries_stores_the_same_keys(impl, interleaved):
    """q None (the decode path: the scoring rotates the queries): keys and head weights as with queries."""
    fn = tri.indexer_rope_store if impl == "triton" else ref.indexer_rope_store
    T, H, D, nb, bs = 6, 5, 16, 4, 4
    g = torch.Generator().manual_seed(3)
    k, q, w_raw = torch.randn(T, D, generator=g) + 2, torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g)
    lw, lb = 1 + 0.1 * torch.randn(D, generator=g), 0.1 * torch.randn(D, generator=g)
    cos, sin = _tables(T, 4)
    with_q, without_q = (torch.full((nb, bs, D), 9.0) for _ in range(2))
    _, w1 = fn(q, k, w_raw, 0.5, lw, lb, 1e-6, cos, sin, interleaved, with_q, SLOTS)
    q2, w2 = fn(None, k, w_raw, 0.5, lw, lb, 1e-6, cos, sin, interleaved, without_q, SLOTS)
    assert q2 is None and torch.equal(w1, w2) and torch.equal(with_q, without_q)


def test_indexer_rope_store_errors():
    with pytest.raises(ValueError, match="do not fit index_k cache"):
        tri.indexer_rope_store(torch.randn(2, 3, 8), torch.randn(2, 8), torch.randn(2, 3), 1.0, torch.ones(8),
                               torch.zeros(8), 1e-6, *_tables(2, 5), False, torch.zeros(2, 4, 8), SLOTS[:2])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_rope_store_kv(interleaved, dtype, qk_norm):
    from atomtool.serve.ops import torch_ref

    T, H, Hkv, D, nb, bs = 6, 19, 3, 12, 4, 4  # 19 query heads: two head programs; GQA group not a power of 2
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(T, (H + 2 * Hkv) * D + 5, generator=g).to(dtype)[:, 5:]  # views of a fused qkv row
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    qw, kw = ((1 + 0.1 * torch.randn(D, generator=g)).to(dtype) for _ in range(2)) if qk_norm else (None, None)
    cos, sin = _tables(T, D // 2)
    caches = [torch.full((nb, bs, Hkv, D), 9.0, dtype=dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    got = tri.qk_rope_store_kv(q, k, v, qw, kw, 1e-6, cos, sin, interleaved, *caches, SLOTS)
    want = torch_ref.qk_rope_store_kv(q, k, v, qw, kw, 1e-6, cos, sin, interleaved, *ref_caches, SLOTS)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (0.05, 0.02)
    _close(got, want, *tol)
    for c, r in zip(caches, ref_caches, strict=True):
        _close(c, r, *tol)
        assert _untouched(c)


def test_qk_rope_store_kv_errors():
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    caches = [torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)]
    with pytest.raises(ValueError, match="do not fit caches"):  # rope over part of the head
        tri.qk_rope_store_kv(q, k, v, None, None, 1e-6, *_tables(2, 2), False, *caches, SLOTS[:2])
    with pytest.raises(ValueError, match="only one q/k norm"):
        tri.qk_rope_store_kv(q, k, v, torch.ones(8), None, 1e-6, *_tables(2, 4), False, *caches, SLOTS[:2])
    with pytest.raises(ValueError, match="contiguous"):
        tri.qk_rope_store_kv(q, k, v, None, None, 1e-6, *_tables(2, 4), False, caches[0],
                             torch.zeros(2, 2, 4, 8).transpose(1, 2), SLOTS[:2])


FUSED = ("mla_rope_store", "indexer_rope_store", "add_rms_norm", "qk_rope_store_kv")


def _decode_step(model_name, ctx, batch=3):
    """(logits [batch, vocab], kv caches) of one float32 decode step of a tiny engine model over random cached
    contexts (benchmarks.common builders; same seeds -> same weights and caches)."""
    from benchmarks import common as C

    cfg = {"dsv32": lambda: C.dsv32_config(3, first_dense=1, smoke=True), "qwen3": lambda: C.qwen3_config(True)}
    cpu = torch.device("cpu")
    model, flat = C.build_random_model(cfg[model_name](), cpu, dtype=torch.float32)
    runner, pool = C.make_runner(model, cpu, num_blocks=batch * (-(-ctx // 16)) + 1, block_size=16,
                                 max_model_len=ctx + 16, graph_sizes=None)
    C.fill_cache_random_(pool)
    seqs = C.fake_sequences(batch, ctx, 16, int(flat["vocab_size"]))
    return runner.run(runner.prepare(C.scheduler_output(seqs))), pool.caches


@pytest.mark.parametrize("model_name,ctx", [("dsv32", 80), ("qwen3", 40)])  # dsv32: past index_topk 64
def test_models_with_the_fused_triton_ops_match_the_reference(model_name, ctx, monkeypatch):
    """The layers hand the fused ops the right tensors (strided views of fused projections, rotary tables,
    cache planes): one decode step with the four fused ops on Triton equals the all-reference step."""
    from atomtool.serve.ops import torch_ref

    want_logits, want_caches = _decode_step(model_name, ctx)
    calls = []

    def counted(name, fn):
        return lambda *a, **k: calls.append(name) or fn(*a, **k)

    for name in FUSED:
        monkeypatch.setitem(dispatch._REGISTRY, (name, "torch"), counted(name, dispatch._REGISTRY[(name, "triton")]))
    assert dispatch.get_op("qk_rope_store_kv", "cpu") is not torch_ref.qk_rope_store_kv
    got_logits, got_caches = _decode_step(model_name, ctx)
    expected = {"dsv32": {"mla_rope_store", "indexer_rope_store", "add_rms_norm"}, "qwen3": {"qk_rope_store_kv"}}
    assert set(calls) == expected[model_name]
    _close(got_logits, want_logits, 1e-4, 1e-4)
    for got, want in zip(got_caches, want_caches, strict=True):
        for plane in want:
            _close(got[plane], want[plane], 1e-5, 1e-5)
