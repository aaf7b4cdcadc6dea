"""The fused ops (atomtool/serve/ops/triton/fused_rope.py, fused_norm.py) vs their torch references, on CPU
under Triton's interpreter (TRITON_INTERPRET=1).

``mla_kv_store`` / ``indexer_k_store`` / ``rotary_embedding_prefix`` / ``add_rms_norm`` replace compositions
of reference ops (norm, rotary, concatenation, cache store, add) by one kernel each (issue 7). Checked here:
both rotary pairings, padding slots (-1: nothing written), a kv row that is a column slice of a wider
projection output, odd widths (masking), the indexer without rope, float32 tight and bf16 loose (the
interpreter rounds bf16 stores by truncation, see tests/test_triton_ops.py), and the shape errors.
"""

from __future__ import annotations

import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
os.environ["TRITON_INTERPRET"] = "1"

import inspect  # noqa: E402
import subprocess  # noqa: E402

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


@pytest.fixture(autouse=True)
def _in_process_only_with_an_interpreted_triton(request):
    if _TRITON_PREIMPORTED and request.node.name != "test_suite_in_a_fresh_process":
        pytest.skip("triton was imported compiled earlier in this session: covered by test_suite_in_a_fresh_process")


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="triton is interpreted in this process: tests run here")
def test_suite_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def test_registered_with_the_reference_signatures():
    for name, fn in tri.OPS.items():
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(getattr(ref, name)).parameters)
        assert dispatch._REGISTRY[(name, "triton")] is fn
        assert dispatch._REGISTRY[(name, "torch")] is getattr(ref, name)


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


def _tables(T, half, seed=0):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(T, half, generator=g) * 40
    return ang.cos(), ang.sin()


SLOTS = torch.tensor([5, -1, 0, 13, 7, -1])  # two padding tokens; slots across blocks


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_kv_store(interleaved, dtype):
    T, R, P, nb, bs = 6, 24, 10, 4, 4  # R not a power of two (masked norm), P/2 = 5 odd
    g = torch.Generator().manual_seed(1)
    y = torch.randn(T, 7 + R + P + 3, generator=g).to(dtype)  # a wider fused projection row
    kv = y[:, 7:7 + R + P]
    w = (1 + 0.1 * torch.randn(R, generator=g)).to(dtype)
    cos, sin = _tables(T, P // 2)
    got = torch.full((nb, bs, R + P), 9.0, dtype=dtype)
    want = got.clone()
    tri.mla_kv_store(kv, w, 1e-6, cos, sin, interleaved, got, SLOTS)
    ref.mla_kv_store(kv, w, 1e-6, cos, sin, interleaved, want, SLOTS)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (0.05, 0.02)
    _close(got, want, *tol)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[SLOTS[SLOTS >= 0]] = False
    assert (got.view(nb * bs, -1)[untouched] == 9.0).all()


def test_mla_kv_store_errors_and_empty():
    cache = torch.zeros(2, 4, 12)
    with pytest.raises(ValueError, match="do not fit latent cache"):
        tri.mla_kv_store(torch.randn(1, 12), torch.ones(8), 1e-6, *_tables(1, 3), False, cache, SLOTS[:1])
    with pytest.raises(ValueError, match="contiguous"):
        tri.mla_kv_store(torch.randn(1, 12), torch.ones(8), 1e-6, *_tables(1, 2), False,
                         torch.zeros(2, 12, 4).transpose(1, 2), SLOTS[:1])
    tri.mla_kv_store(torch.randn(0, 12), torch.ones(8), 1e-6, *_tables(0, 2), False, cache, SLOTS[:0])
    assert (cache == 0).all()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [10, 0])
def test_indexer_k_store(interleaved, dtype, rope):
    T, D, nb, bs = 6, 40, 4, 4
    g = torch.Generator().manual_seed(2)
    y = (3 + torch.randn(T, D + 9, generator=g)).to(dtype)  # non-zero mean: the centering matters
    k = y[:, 5:5 + D]
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    b = (0.1 * torch.randn(D, generator=g)).to(dtype)
    cos, sin = _tables(T, rope // 2) if rope else (None, None)
    got = torch.full((nb, bs, D), 9.0, dtype=dtype)
    want = got.clone()
    tri.indexer_k_store(k, w, b, 1e-6, cos, sin, interleaved, got, SLOTS)
    ref.indexer_k_store(k, w, b, 1e-6, cos, sin, interleaved, want, SLOTS)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (0.05, 0.02)
    _close(got, want, *tol)


def test_indexer_k_store_errors():
    with pytest.raises(ValueError, match="do not fit index_k cache"):
        tri.indexer_k_store(torch.randn(2, 8), torch.ones(8), torch.zeros(8), 1e-6, *_tables(2, 5), False,
                            torch.zeros(2, 4, 8), SLOTS[:2])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_prefix(interleaved):
    T, H, D, R = 5, 19, 22, 8  # 19 heads: two head blocks
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, D, generator=g)
    cos, sin = _tables(T, R // 2)
    _close(tri.rotary_embedding_prefix(x, cos, sin, interleaved),
           ref.rotary_embedding_prefix(x, cos, sin, interleaved), 1e-6, 1e-6)
    xb = torch.randn(T, H, D + 6, generator=g).bfloat16()[..., 3:3 + D]  # strided heads
    _close(tri.rotary_embedding_prefix(xb, cos, sin, interleaved),
           ref.rotary_embedding_prefix(xb, cos, sin, interleaved), 0.05, 0.02)
    with pytest.raises(ValueError, match="do not fit head dim 22"):
        tri.rotary_embedding_prefix(x, *_tables(T, 12))
