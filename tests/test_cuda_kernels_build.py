"""The host side of our CUDA kernels on CPU: which inputs the top-k selection and the MLA merge + W_UV kernel
would serve, and (where nvcc is installed) that ``topk.cu`` and ``mla_merge_uv.cu`` compile for Hopper in every
configuration they are built with. Their results are checked on the GPU: the top-k against a stable sort and
the Triton kernel (tests/gpu/test_topk_gpu.py), the merge against the Triton kernel and the reference
(tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.ops.cuda import mla_merge_uv as cuda_merge
from atomtool.serve.ops.cuda import topk as cuda_topk
from atomtool.serve.ops.cuda.build import compile_cubin, nvcc_path


def test_items_per_thread_cover_the_row():
    assert [cuda_topk.items_for(w) for w in (1, 1024, 1025, 2049, 4096, 4099, 8192)] == [1, 1, 2, 4, 4, 8, 8]
    assert cuda_topk.THREADS * cuda_topk.items_for(cuda_topk.MAX_WIDTH) == cuda_topk.MAX_WIDTH


def test_not_available_off_cuda_past_the_width_or_when_turned_off(monkeypatch):
    assert not cuda_topk.available(torch.device("cpu"), 4096)
    assert not cuda_topk.available(torch.device("cuda", 0), cuda_topk.MAX_WIDTH + 1)
    monkeypatch.setenv("ATOMTOOL_CUDA_TOPK", "0")
    assert not cuda_topk.available(torch.device("cuda", 0), 4096)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed: the build is checked on the GPU machine")
@pytest.mark.parametrize("items", [1, 2, 4, 8])
def test_the_kernel_compiles_for_sm90(items, tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMTOOL_CUDA_CACHE", str(tmp_path))
    compile_cubin.cache_clear()
    cubin = compile_cubin("topk.cu", "sm_90", (("THREADS", cuda_topk.THREADS), ("ITEMS", items)))
    assert cubin[:4] == b"\x7fELF" and b"topk_rows" in cubin


def test_the_merge_serves_only_bf16_mla_of_rank_512_and_dv_128_on_cuda(monkeypatch):
    fp8 = torch.zeros(4, 128, 512, dtype=torch.float8_e4m3fn)
    scale = torch.ones(4, 128, 4)
    bf16 = torch.zeros(4, 128, 512, dtype=torch.bfloat16)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not cuda_merge.serves(torch.bfloat16, fp8, scale, 128, 16, cpu)
    # refused from the shapes and dtypes alone, before any CUDA call
    assert not cuda_merge.serves(torch.float32, bf16.float(), None, 1, 16, cuda)  # float32 models: Triton
    assert not cuda_merge.serves(torch.bfloat16, bf16[:, :, :256], None, 1, 16, cuda)  # kv_lora_rank 256
    assert not cuda_merge.serves(torch.bfloat16, torch.zeros(4, 256, 512, dtype=torch.bfloat16), None, 1, 16,
                                 cuda)  # v_head_dim 256 (GLM-5)
    assert not cuda_merge.serves(torch.bfloat16, fp8, scale, 128, 33, cuda)  # more chunks than it unrolls
    monkeypatch.setenv("ATOMTOOL_CUDA_MLA_MERGE", "0")
    assert not cuda_merge.serves(torch.bfloat16, fp8, scale, 128, 16, cuda)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed: the build is checked on the GPU machine")
@pytest.mark.parametrize("n_chunks", [16, 32])
def test_the_merge_kernel_compiles_for_sm90(n_chunks, tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMTOOL_CUDA_CACHE", str(tmp_path))
    compile_cubin.cache_clear()
    cubin = compile_cubin("mla_merge_uv.cu", "sm_90", (("N_CHUNKS", n_chunks),))
    assert cubin[:4] == b"\x7fELF" and b"mla_merge_uv" in cubin


def test_the_device_guard_switches_only_to_another_device(monkeypatch):
    import contextlib

    from atomtool.serve.ops.cuda.driver import device_guard

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert isinstance(device_guard(torch.device("cuda", 0)), contextlib.nullcontext)
    assert isinstance(device_guard(torch.device("cuda")), contextlib.nullcontext)
    guard = device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


def test_an_optional_kernel_is_built_once_per_device_and_a_failure_warns_once(monkeypatch):
    import atomtool.serve.ops.cuda.driver as driver
    from atomtool.serve.ops.cuda.build import CudaBuildError

    builds = []

    def compile_cubin(source, arch, defines):
        builds.append((source, arch, defines))
        if dict(defines).get("BAD"):
            raise CudaBuildError("nvcc failed")
        return b"cubin"

    monkeypatch.setattr(driver, "compile_cubin", compile_cubin)
    monkeypatch.setattr(driver, "load_kernel", lambda cubin, name: (cubin, name))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    k = driver.OptionalKernel("x.cu", "fn", "test", "ATOMTOOL_TEST_KERNEL")
    dev = torch.device("cuda", 0)
    assert k.ready(dev, (("A", 1),)) and k.ready(dev, (("A", 1),))
    assert builds == [("x.cu", "sm_90", (("A", 1),))] and k.get(dev, (("A", 1),)) == (b"cubin", "fn")
    with pytest.warns(RuntimeWarning, match="CUDA test kernel unavailable, using the Triton kernel: nvcc failed"):
        assert not k.ready(dev, (("BAD", 1),))
    assert not k.ready(dev, (("A", 2),)) and len(builds) == 2  # the device's failure is remembered: no rebuild
    monkeypatch.setenv("ATOMTOOL_TEST_KERNEL", "0")
    assert not k.ready(torch.device("cuda", 1), (("A", 1),))
