"""The host side of our CUDA kernels on CPU: which inputs the top-k selection and the MLA merge + W_UV kernel
would serve, and (where nvcc is installed) that ``topk.cu`` and ``mla_merge_uv.cu`` compile for Hopper in every
configuration they are built with. Their results are checked on the GPU: the top-k against a stable sort and
the Triton kernel (tests/gpu/test_topk_gpu.py), the merge against the Triton kernel and the reference
(tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.ops.cuda import mla_merge_uv as cuda_merge
from atomtool.serve.ops.cuda import mla_split as cuda_split
from atomtool.serve.ops.cuda import topk as cuda_topk
from atomtool.serve.ops.cuda.build import SRC_DIR, compile_cubin, nvcc_path


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



def test_the_split_serves_only_bf16_mla_of_rank_512_rope_64_and_64_head_blocks_on_cuda(monkeypatch):
    def inputs(H=128, R=512, P=64, dtype=torch.bfloat16):
        return (torch.zeros(1, H, R, dtype=dtype), torch.zeros(1, H, P, dtype=dtype),
                torch.zeros(4, 64, R + P, dtype=dtype), torch.zeros(1, 4, dtype=torch.int32),
                torch.zeros(1, 2048, dtype=torch.int32))

    qn, qp, lat, bt, tk = inputs()
    assert not cuda_split.serves(qn, qp, lat, bt, tk)  # a CPU tensor
    monkeypatch.setattr(cuda_split.KERNEL, "enabled", lambda device: True)  # as on a CUDA device
    monkeypatch.setattr(cuda_split.KERNEL, "ready", lambda device, defines, shared=0: True)
    assert cuda_split.serves(qn, qp, lat, bt, tk) and cuda_split.serves(qn, qp, lat, bt, None)
    assert not cuda_split.serves(*inputs(dtype=torch.float32))  # float32 models: Triton
    assert not cuda_split.serves(*inputs(R=256))  # kv_lora_rank 256
    assert not cuda_split.serves(*inputs(P=32))  # another rope dim
    assert not cuda_split.serves(*inputs(H=16))  # 16 heads (DeepSeek-V3 at TP 8)
    assert cuda_split.serves(*inputs(H=32))
    assert not cuda_split.serves(qn, qp, lat, bt, tk.long())  # int64 top-k
    assert not cuda_split.serves(qn, qp, torch.zeros(4, 64, 580, dtype=torch.bfloat16)[..., :576], bt, tk)  # rows
    # not 16-byte aligned
    assert cuda_split.serves(qn, qp, torch.zeros(4, 64, 640, dtype=torch.bfloat16)[..., :576], bt, tk)
    # the H100 / H200 per-block opt-in limit, both head blocks; the sizes the kernel's layout adds up to
    assert cuda_split.shared_bytes(32) == 190592 and cuda_split.shared_bytes(64) == 232192 <= 232448


def test_the_split_takes_32_heads_per_cta_while_one_wave_holds_the_grid(monkeypatch):
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(cuda_split, "_SM_COUNTS", {0: 132})  # an H100 / H200
    monkeypatch.setattr(cuda_split.KERNEL, "ready", lambda device, defines, shared=0: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # DeepSeek-V3.2 (128 heads, 16 chunks): batch 1 is 64 CTAs of 32 heads, batch 2 is 128, batch 3 would be 192
    assert [cuda_split.heads_for(B, 128, 16, dev) for B in (1, 2, 3, 64)] == [32, 32, 64, 64]
    assert [cuda_split.heads_for(B, 64, 16, dev) for B in (1, 4, 5)] == [32, 32, 64]  # GLM-5.2 / Kimi-K2: 64 heads
    assert cuda_split.heads_for(64, 32, 16, dev) == 32  # 32 heads: never 64
    monkeypatch.setattr(cuda_split, "HEADS", 64)  # forced (A/B runs), where H allows it
    assert cuda_split.heads_for(1, 128, 16, dev) == 64 and cuda_split.heads_for(1, 96, 16, dev) == 32
    monkeypatch.setattr(cuda_split, "HEADS", None)
    # a device whose blocks cannot hold the 64-heads kernel's shared memory keeps 32 heads at every batch
    monkeypatch.setattr(cuda_split.KERNEL, "ready", lambda device, defines, shared=0: dict(defines)["HEADS"] == 32)
    assert cuda_split.heads_for(64, 128, 16, dev) == 32


def test_the_mla_kernels_are_not_served_where_their_shared_memory_does_not_fit(monkeypatch):
    """An sm_89 GPU (101,376 bytes per block at most): the split (186 KB) and the merge (146 KB) kernels leave
    the decode rows to Triton, asked before any build."""
    import atomtool.serve.ops.cuda.driver as driver

    monkeypatch.setattr(driver, "max_shared_optin", lambda index: 101376)
    monkeypatch.setattr(driver, "compile_cubin", lambda *a: pytest.fail("built a kernel that cannot launch"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for kernel in (cuda_split.KERNEL, cuda_merge.KERNEL):
        monkeypatch.setattr(kernel, "enabled", lambda device: True)
    bf16 = torch.bfloat16
    assert not cuda_split.serves(torch.zeros(1, 128, 512, dtype=bf16), torch.zeros(1, 128, 64, dtype=bf16),
                                 torch.zeros(4, 64, 576, dtype=bf16), torch.zeros(1, 4, dtype=torch.int32), None)
    assert not cuda_merge.serves(bf16, torch.zeros(4, 128, 512, dtype=bf16), None, 1, 16, torch.device("cuda", 0))


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed: the build is checked on the GPU machine")
@pytest.mark.parametrize("source,function,defines", [
    ("mla_merge_uv.cu", "mla_merge_uv", (("N_CHUNKS", 16),)), ("mla_merge_uv.cu", "mla_merge_uv", (("N_CHUNKS", 32),)),
    ("mla_split.cu", "mla_split", (("HEADS", 32),)), ("mla_split.cu", "mla_split", (("HEADS", 64),))])
def test_the_mla_kernels_compile_for_sm90_without_spills(source, function, defines, tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("ATOMTOOL_CUDA_CACHE", str(tmp_path))
    compile_cubin.cache_clear()
    cubin = compile_cubin(source, "sm_90", defines)
    assert cubin[:4] == b"\x7fELF" and function.encode() in cubin
    r = subprocess.run([nvcc_path(), "-cubin", "-gencode=arch=compute_90,code=sm_90", "-O3", "-Xptxas", "-v",
                        *[f"-D{k}={v}" for k, v in defines], "-o", str(tmp_path / "x.cubin"), str(SRC_DIR / source)],
                       capture_output=True, text=True, check=True)
    assert "0 bytes spill stores" in r.stderr, r.stderr


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
    monkeypatch.setattr(driver, "max_shared_optin", lambda index: 101376)  # an sm_89 (L40S, RTX 4090)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    k = driver.OptionalKernel("x.cu", "fn", "test", "ATOMTOOL_TEST_KERNEL")
    dev = torch.device("cuda", 0)
    assert k.ready(dev, (("A", 1),)) and k.ready(dev, (("A", 1),))
    assert builds == [("x.cu", "sm_90", (("A", 1),))] and k.get(dev, (("A", 1),)) == (b"cubin", "fn")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # more shared memory than the device's blocks may have: not served, quietly
        assert not k.ready(dev, (("A", 3),), shared=190592) and len(builds) == 1
    assert k.ready(dev, (("A", 1),), shared=190592)  # (already loaded for these defines: as before)
    with pytest.warns(RuntimeWarning, match="CUDA test kernel unavailable, using the Triton kernel: nvcc failed"):
        assert not k.ready(dev, (("BAD", 1),))
    assert not k.ready(dev, (("A", 2),)) and len(builds) == 2  # the device's failure is remembered: no rebuild
    monkeypatch.setenv("ATOMTOOL_TEST_KERNEL", "0")
    assert not k.ready(torch.device("cuda", 1), (("A", 1),))
