"""The fused MoE's batch-1 decode path (issue 7) on CPU under Triton's interpreter (TRITON_INTERPRET=1).

``atomtool/serve/ops/triton/moe.py``'s direct layout (T == 1) must not change a bit of the output: no
``moe_align`` launch, program p of each grouped GEMM serves pair p alone, the tile the aligned layout gives
that pair (top-k experts of one token are distinct); pairs of experts not served here (-1, ids >= E) write
zero rows to the slot planes, which are then allocated without a fill. It is compared bitwise with the
aligned path (still reachable through ``moe._fused_moe``), and against the torch reference, for float32 and
bf16 activations, float and FP8-block experts, weight-only and W8A8. The same equalities are checked compiled
at DeepSeek-V3.2 sizes in tests/gpu/test_kernels_gpu.py (test_fused_moe_direct_layout_bitwise).
"""

from __future__ import annotations

from tests.triton_interp import harness, setup_interpreter  # noqa: E402  (imports neither torch nor triton)

_TRITON_PREIMPORTED = setup_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install 'atomtool[serve]')")

from atomtool.serve.ops import torch_ref_mla  # noqa: E402
from tests.kernel_inputs import assert_close_as as _close  # noqa: E402

if not _TRITON_PREIMPORTED:
    import atomtool.serve.ops.triton as tri  # noqa: E402
    from atomtool.serve.ops.triton import moe  # noqa: E402


_interpreted_only, test_suite_in_a_fresh_process = harness(__file__, _TRITON_PREIMPORTED)

H, INTER, E, BLOCK = 64, 48, 5, (32, 32)  # INTER 48: the down GEMM's last K step is a masked partial block


def _inputs(T, k, dtype, fp8, seed):
    """(x, w13, w2, topk_weights, topk_ids, scale args) with distinct experts per token; FP8: e4m3 weights
    and random block scales (bn, bk) = BLOCK."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    tw = torch.rand(T, k, generator=g)
    if not fp8:
        return x, w13.to(dtype), w2.to(dtype), tw, ids, ()
    s13 = torch.rand(E, -(-2 * INTER // 32), H // 32, generator=g) + 0.5
    s2 = torch.rand(E, H // 32, -(-INTER // 32), generator=g) + 0.5
    return x, (w13 * 4).to(torch.float8_e4m3fn), (w2 * 4).to(torch.float8_e4m3fn), tw, ids, (s13, s2, BLOCK)


def _run(args, mode, direct):
    x, w13, w2, tw, ids, scales = args
    s13, s2, block = scales if scales else (None, None, BLOCK)
    return moe._fused_moe(x, w13, w2, tw, ids, s13, s2, block, mode, direct=direct)


def _reference(args, mode):
    x, w13, w2, tw, ids, scales = args
    return torch_ref_mla.fused_moe(x, w13, w2, tw, ids, *scales, *((mode,) if mode else ()))


def _check_reference(out, ref, dtype, fp8, mode):
    """float32: summation order only (FP8 experts' outputs reach ~300 here, so the absolute bound of
    test_triton_ops.test_fused_moe_w8a8_matches_reference). bf16: the reference rounds silu(g) * u and each
    expert's sum in bf16, and the interpreter's bf16 stores truncate (tests/test_triton_ops.py), so a relative
    Frobenius bound as in tests/gpu; W8A8 then quantizes two differently rounded activations to e4m3 (3
    mantissa bits) over K = 48..64 elements, hence the loose bound there (the float32 cases are the tight
    check of the W8A8 math)."""
    if dtype == torch.float32:
        _close(out, ref, *((1e-4, 1e-5) if fp8 else (2e-5, 1e-5)))
    else:
        assert out.dtype == ref.dtype
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert err <= (0.1 if mode else 2e-2), err


CASES = [  # (activation dtype, FP8 experts, act_quant)
    (torch.float32, False, None), (torch.bfloat16, False, None),
    (torch.float32, True, None), (torch.bfloat16, True, None),
    (torch.float32, True, "dynamic"), (torch.bfloat16, True, "dynamic_ue8m0"),
]


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors: memory the MoE leaves unwritten shows up in its output."""
    real = torch.empty

    def empty(*shape, **kw):
        t = real(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("dtype,fp8,mode", CASES)
def test_direct_layout_equals_aligned_bitwise(dtype, fp8, mode, nan_empty):
    """T == 1: the direct layout gives the aligned layout's bits, also with slots routed to experts not served
    here (-1, E + 3), which add exactly zero; both match the reference."""
    for seed, foreign in ((1, {}), (2, {1: -1, 3: E + 3})):
        x, w13, w2, tw, ids, scales = _inputs(1, 4, dtype, fp8, seed)
        for j, e in foreign.items():
            ids[0, j] = e
        args = (x, w13, w2, tw, ids, scales)
        ref = _reference(args, mode)
        aligned = _run(args, mode, direct=False)
        direct = _run(args, mode, direct=True)
        assert not direct.isnan().any()
        assert torch.equal(direct, aligned), seed
        _check_reference(direct, ref, dtype, fp8, mode)
        if foreign:  # the foreign slots add exactly zero: the bits of the served slots alone
            kept = [0, 2]
            assert torch.equal(direct, _run((x, w13, w2, tw[:, kept], ids[:, kept], scales), mode, True))
        assert torch.equal(tri.fused_moe(x, w13, w2, tw, ids, *scales, *((mode,) if mode else ())), direct)


def test_direct_layout_only_at_batch_1(monkeypatch):
    """fused_moe skips the layout launch at T == 1 only (a decision from shapes, CUDA-graph safe)."""
    args = _inputs(2, 3, torch.float32, False, 3)
    x, w13, w2, tw, ids, _ = args
    full = tri.fused_moe(x, w13, w2, tw, ids)

    def no_layout(*a, **kw):
        raise AssertionError("moe_align launched")

    monkeypatch.setattr(moe, "moe_align", no_layout)
    assert torch.equal(tri.fused_moe(x[1:], w13, w2, tw[1:], ids[1:])[0], full[1])
    with pytest.raises(AssertionError, match="moe_align launched"):
        tri.fused_moe(x, w13, w2, tw, ids)


@pytest.mark.parametrize("dtype,fp8,mode", CASES)
def test_direct_layout_serves_any_batch(dtype, fp8, mode):
    """The direct layout serves any T (fused_moe uses it at T == 1 only) with the aligned layout's bits, over
    several tokens per expert block (T = 6, 3 slots, 5 experts) with foreign expert ids among them."""
    args = _inputs(6, 3, dtype, fp8, 4)
    args[4][2, 1], args[4][5, 0] = -1, E
    aligned = _run(args, mode, direct=False)
    _check_reference(aligned, _reference(args, mode), dtype, fp8, mode)
    assert torch.equal(_run(args, mode, direct=True), aligned)
