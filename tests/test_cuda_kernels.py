"""CPU checks of the CUDA-kernel seam (atomtool/serve/ops/cuda): the cubin build and its cache, the launch plan
of the FP8 GEMV, and the errors a caller can hit without a GPU. The kernels themselves run in
tests/gpu/test_fp8_gemv_cuda_gpu.py (correctness against torch_ref and batch invariance on the H200)."""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.ops.cuda import build
from atomtool.serve.ops.cuda.fp8_gemv import BLOCK_N, fp8_gemv_w8a8, gemv_plan


def test_build_without_nvcc_names_the_fix(monkeypatch):
    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    build.compile_cubin.cache_clear()
    with pytest.raises(build.CudaBuildError, match="no nvcc found .*CUDA_HOME"):
        build.compile_cubin("fp8_gemv.cu", "sm_90a", (("ROWS", 8),))


@pytest.mark.skipif(build.nvcc_path() is None, reason="needs nvcc (the CUDA toolkit) to compile")
def test_build_compiles_a_cubin_once_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMTOOL_CUDA_CACHE", str(tmp_path))
    build.compile_cubin.cache_clear()
    cubin = build.compile_cubin("fp8_gemv.cu", "sm_90a", (("ROWS", 8), ("DEPTH", 4)))
    assert cubin[:4] == b"\x7fELF"
    files = list(tmp_path.glob("fp8_gemv-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == cubin
    build.compile_cubin.cache_clear()
    # nvcc's version is memoized by the first build, so a second nvcc run would be a rebuild
    monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: pytest.fail("rebuilt a cached cubin"))
    assert build.compile_cubin("fp8_gemv.cu", "sm_90a", (("ROWS", 8), ("DEPTH", 4))) == cubin


@pytest.mark.skipif(build.nvcc_path() is None, reason="needs nvcc (the CUDA toolkit) to compile")
def test_build_error_carries_nvcc_output(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMTOOL_CUDA_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.cu"
    bad.write_text("extern \"C\" __global__ void k() { this is not C++; }\n")
    with pytest.raises(build.CudaBuildError, match="nvcc failed on broken.cu"):
        build.compile_cubin(str(bad), "sm_90a")
    assert not list((tmp_path / "cache").glob("*"))  # nothing half-written left in the cache


@pytest.mark.parametrize(("N", "K", "want"), [
    (7168, 16384, (4, 4096)),   # o_proj: 112 tiles x 4 = 448 CTAs, one wave
    (7168, 18432, (4, 4608)),   # dense down
    (2304, 7168, (8, 896)),     # fused q_a / kv_a / indexer: capped at the portable cluster size
    (36864, 7168, (1, 7168)),   # dense gate_up: 576 tiles fill the GPU unsplit
    (7168, 2048, (4, 512)),
    (4096, 384, (3, 128)),      # fewer groups than the cap: at most one split per group
])
def test_gemv_plan(N, K, want):
    S, k_chunk = gemv_plan(N, K)
    assert (S, k_chunk) == want
    assert k_chunk % 128 == 0 and (S - 1) * k_chunk < K <= S * k_chunk  # every split non-empty
    assert -(-N // BLOCK_N) * S <= 528 or S == 1


def test_gemv_plan_forced_split_keeps_whole_groups():
    assert gemv_plan(7168, 2048, splits=8) == (8, 256)
    assert gemv_plan(7168, 2048, splits=5) == (4, 512)  # 16 groups in 5 -> 4 per split -> 4 splits


@pytest.mark.parametrize(("x", "why"), [
    (torch.zeros(1, 256, dtype=torch.float32), "float32 activations"),
    (torch.zeros(1, 200, dtype=torch.bfloat16), "K not a multiple of 128"),
    (torch.zeros(256, 1, dtype=torch.bfloat16).t(), "strided activation rows"),
])
def test_fp8_gemv_refuses_inputs_outside_its_contract(x, why):
    w = torch.zeros(64, x.shape[1], dtype=torch.float8_e4m3fn)
    s = torch.ones(1, max(1, x.shape[1] // 128))
    with pytest.raises(ValueError, match="fp8_gemv: x .* not served"):
        fp8_gemv_w8a8(x, w, s, None, True)


@pytest.mark.parametrize("why", ["scale shape", "scale dtype", "bf16 weight", "float32 bias", "16 splits",
                                 "strided weight"])
def test_fp8_gemv_refuses_weights_and_options_outside_its_contract(why):
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w, s, bias, splits = torch.zeros(64, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2), None, None
    if why == "scale shape":
        s = torch.ones(1, 3)
    elif why == "scale dtype":
        s = s.double()
    elif why == "bf16 weight":
        w = w.to(torch.bfloat16)
    elif why == "float32 bias":
        bias = torch.zeros(64)
    elif why == "16 splits":
        splits = 16
    else:
        w = torch.zeros(256, 64, dtype=torch.float8_e4m3fn).t()
    with pytest.raises(ValueError, match="not served .*1..8 splits"):
        fp8_gemv_w8a8(x, w, s, bias, True, splits=splits)
