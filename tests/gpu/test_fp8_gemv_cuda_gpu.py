"""The CUDA cluster-split-K FP8 GEMV (atomtool/serve/ops/cuda/fp8_gemv.cu; an experiment, not dispatched by the
engine: docs/PERFORMANCE.md step 49) on a Hopper GPU: against ``torch_ref.linear_w8a8`` (float32) at the
Triton kernel's accuracy, a row's bits the same alone and in a batch (and across the 8- and 16-row tiles),
bias, and a CUDA-graph replay equal to the eager call."""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.ops.torch_ref import linear_w8a8

DEV = "cuda"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper (sm_90) GPU")


@pytest.fixture(scope="module")
def gemv():
    from atomtool.serve.ops.cuda.build import nvcc_path
    from atomtool.serve.ops.cuda.fp8_gemv import fp8_gemv_w8a8

    if nvcc_path() is None:
        pytest.skip("needs nvcc to build the kernel")
    return fp8_gemv_w8a8


def _weight(N, K, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(N, K, device=DEV, generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // 128), K // 128, device=DEV, generator=g) * 1e-2 + 1e-3
    return w, s


@pytest.mark.parametrize(("N", "K"), [(7168, 16384), (2304, 7168), (24576, 1536), (200, 384)])
@pytest.mark.parametrize("round_scale", [True, False])
def test_matches_reference_and_is_batch_invariant(gemv, N, K, round_scale):
    from atomtool.serve.ops.triton.linear import fp8_block_linear

    w, s = _weight(N, K, N + K)
    x = torch.randn(13, K, device=DEV, dtype=torch.bfloat16)
    ref = linear_w8a8(x, w, s, (128, 128), round_scale)
    y = gemv(x, w, s, None, round_scale).float()
    tri = fp8_block_linear(x, w, s, None, (128, 128), "dynamic_ue8m0" if round_scale else "dynamic").float()
    scale = ref.abs().max()
    err, err_tri = ((y - ref).abs().max() / scale).item(), ((tri - ref).abs().max() / scale).item()
    assert err <= max(2 * err_tri, 1e-2), (err, err_tri)
    for M in (1, 5, 8):  # alone, in an 8-row tile, at a tile's edge: the same bits as inside the 13-row batch
        assert torch.equal(gemv(x[:M].contiguous(), w, s, None, round_scale).float(), y[:M])


def test_bias_and_graph_replay(gemv):
    w, s = _weight(7168, 2048, 1)
    bias = torch.randn(7168, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(3, 2048, device=DEV, dtype=torch.bfloat16)
    y = gemv(x, w, s, bias, True)
    ref = (linear_w8a8(x, w, s, (128, 128), True) + bias.float()).to(torch.bfloat16)
    assert (y.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemv(x, w, s, bias, True)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemv(x, w, s, bias, True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)
