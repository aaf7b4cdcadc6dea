"""The MoE gate's logits op ``router_logits`` (Triton kernel, ops/triton/router_gemv.py) vs the torch reference
(``torch_ref.router_logits`` = HF ``DeepseekV3TopkRouter``'s ``F.linear(x.float(), weight.float())``), on CPU
under Triton's interpreter (TRITON_INTERPRET=1), and its use by ``TopkRouter``.

Tolerance: bf16/fp16 products are exact in float32, so kernel and reference differ only in float32 summation
order: |out - ref| <= 1e-5 * (|x| @ |w|^T) elementwise (relative to the sum of the magnitudes of the products;
the observed error is about 1e-7 of it). Batch invariance and tile independence are checked bitwise. The same
op runs compiled at DeepSeek-V3 shapes in tests/gpu/test_kernels_gpu.py (test_router_logits_bf16).
"""

from __future__ import annotations

# Same interpreter setup as tests/test_triton_ops.py: TRITON_INTERPRET must be set before triton is first
# imported; if another module of this session imported triton compiled, rerun this file in a fresh process.
from tests.triton_interp import harness, setup_interpreter  # noqa: E402  (imports neither torch nor triton)

_TRITON_PREIMPORTED = setup_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install 'atomtool[serve]')")

from atomtool.serve import ops as dispatch  # noqa: E402
from atomtool.serve.layers import moe as moe_layer  # noqa: E402
from atomtool.serve.ops import torch_ref  # noqa: E402

if not _TRITON_PREIMPORTED:
    import atomtool.serve.ops.triton as tri  # noqa: E402
    from atomtool.serve.ops.triton import router_gemv  # noqa: E402
    from atomtool.serve.ops.triton.router_gemv import router_logits  # noqa: E402


_interpreted_only, test_suite_in_a_fresh_process = harness(__file__, _TRITON_PREIMPORTED)


def _inputs(T, E, H, dtype, seed=0, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(E, H, generator=g) * 0.05).to(w_dtype or dtype)
    return x, w


def _assert_close(out, x, w):
    ref = torch_ref.router_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    bound = 1e-5 * (x.float().abs() @ w.float().abs().T) + 1e-30
    err = (out - ref).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3g}"


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_registered_as_the_triton_backend_op_and_in_the_reference():
    assert dispatch._REGISTRY[("router_logits", "triton")] is router_logits
    assert tri.OPS["router_logits"] is router_logits
    assert "router_logits" in dispatch.OP_NAMES
    assert dispatch.get_op("router_logits", "cpu") is torch_ref.router_logits


def test_reference_is_hf_float32_linear():
    x, w = _inputs(5, 8, 40, torch.bfloat16)
    assert torch.equal(torch_ref.router_logits(x, w), torch.nn.functional.linear(x.float(), w.float()))


# (T, E, H): T in {1, 3, 17, 40}; H never a multiple of the 128 lanes nor of a 2048-wide unrolled step
CASES = [(1, 8, 200), (3, 64, 333), (17, 256, 300), (40, 64, 1000), (1, 256, 2100), (40, 8, 130)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,E,H", CASES)
def test_matches_reference(T, E, H, dtype):
    x, w = _inputs(T, E, H, dtype, seed=T * 1000 + E)
    _assert_close(router_logits(x, w), x, w)


def test_tolerance_is_tight_enough_to_catch_a_bf16_rounding():
    """The check above fails for logits that went through bf16 once (what an unfused bf16 GEMV would give)."""
    x, w = _inputs(3, 64, 333, torch.bfloat16)
    with pytest.raises(AssertionError):
        _assert_close(torch_ref.router_logits(x, w).bfloat16().float(), x, w)


def test_mixed_dtypes_and_strided_operands():
    """x fp16 with a bf16 weight; x a column slice of a wider buffer (row stride > H) and a transposed view
    (last dim not contiguous, copied); the weight a slice of a taller one."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(17, 400, generator=g).half()
    x = buf[:, 7:307]
    wbuf = (torch.randn(70, 300, generator=g) * 0.05).bfloat16()
    w = wbuf[3:67]
    out = router_logits(x, w)
    _assert_close(out, x, w)
    xt = x.contiguous().T.contiguous().T  # same values, last-dim stride 17
    assert xt.stride(-1) != 1
    assert torch.equal(_bits(router_logits(xt, w)), _bits(out))


def test_float32_inputs_follow_the_reference():
    """Not used by TopkRouter (float32 models keep F.linear), but the op accepts them: products round in
    float32 then, so the bound is looser by one rounding per product."""
    x, w = _inputs(3, 8, 300, torch.float32)
    ref = torch_ref.router_logits(x, w)
    assert bool(((router_logits(x, w) - ref).abs() <= 2e-5 * (x.abs() @ w.abs().T)).all())


def test_batch_invariant_bitwise():
    """Row t's logits are bitwise the same computed alone, in a prefix of the batch and in the whole batch
    (T = 1, 2, 5, 17, 40 use different tiles: _config)."""
    x, w = _inputs(40, 64, 1000, torch.bfloat16, seed=11)
    full = router_logits(x, w)
    for t in (0, 16, 39):
        assert torch.equal(_bits(router_logits(x[t:t + 1], w)), _bits(full[t:t + 1]))
    for m in (2, 5, 17):
        assert torch.equal(_bits(router_logits(x[:m], w)), _bits(full[:m]))
    assert torch.equal(_bits(router_logits(x[23:25], w)), _bits(full[23:25]))


def test_every_tile_gives_the_same_bits():
    """The summation order depends on k and the 128 lanes only: every config of the table (and an odd one)
    gives bitwise the same logits."""
    x, w = _inputs(9, 24, 300, torch.float16, seed=5)
    outs = [router_logits(x, w, config=cfg[1:]) for cfg in router_gemv._CONFIGS]
    outs.append(router_logits(x, w, config=(2, 16, 3, 2, 1)))  # odd tile and chunk count, no pipelining
    for o in outs[1:]:
        assert torch.equal(_bits(o), _bits(outs[0]))
    _assert_close(outs[0], x, w)


def test_configs_cover_every_batch_size():
    assert router_gemv._config(1)[:2] == (1, 1)  # decode: one expert a program, E programs
    assert router_gemv._config(10 ** 6) == router_gemv._CONFIGS[-1][1:]


def test_empty_batch():
    x, w = _inputs(0, 8, 100, torch.bfloat16)
    out = router_logits(x, w)
    assert out.shape == (0, 8) and out.dtype == torch.float32


@pytest.mark.parametrize("fn", ["triton", "torch"])
@pytest.mark.parametrize("xs,ws", [((3, 64), (8, 65)), ((64,), (8, 64)), ((3, 64), (8, 2, 32))])
def test_shape_mismatch_names_both_shapes(fn, xs, ws):
    op = router_logits if fn == "triton" else torch_ref.router_logits
    with pytest.raises(ValueError, match="router_logits") as e:
        op(torch.zeros(xs, dtype=torch.bfloat16), torch.zeros(ws, dtype=torch.bfloat16))
    assert str(tuple(xs)) in str(e.value) and str(tuple(ws)) in str(e.value)


# ---------------------------------------------------------------- TopkRouter wiring


def _router(dtype, E=16, H=200):
    r = moe_layer.TopkRouter(H, E, dtype, "cpu")
    r.weight.data.copy_((torch.randn(E, H, generator=torch.Generator().manual_seed(2)) * 0.05).to(dtype))
    return r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_router_uses_the_kernel_and_holds_no_float32_copy(dtype, monkeypatch):
    """Where the backend provides router_logits (Triton on CUDA; here forced by patching the dispatch), a
    bf16/fp16 gate calls it with its weight as is and keeps no float32 copy."""
    calls = []

    def fake_get_op(name, device):
        if name == "router_logits":
            return lambda x, w: calls.append((x, w)) or router_logits(x, w)
        return dispatch.get_op(name, device)

    monkeypatch.setattr(moe_layer, "get_op", fake_get_op)
    r = _router(dtype)
    r.post_load()
    assert r._w32 is None
    x = torch.randn(3, 200).to(dtype)
    out = r(x)
    assert len(calls) == 1 and calls[0][1] is r.weight and calls[0][0] is x
    _assert_close(out, x, r.weight)
    r(x.float())  # float32 activations keep F.linear (cast weight, no copy held)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_router_torch_path_unchanged(dtype):
    """CPU / torch backend: F.linear in float32 over the cached float32 weight (bf16) or the weight itself
    (float32), bitwise as before."""
    r = _router(dtype)
    r.post_load()
    assert (r._w32 is not None) == (dtype != torch.float32)
    if r._w32 is not None:
        assert torch.equal(r._w32, r.weight.float())
    x = torch.randn(3, 200).to(dtype)
    assert torch.equal(r(x), torch.nn.functional.linear(x.float(), r.weight.float()))
