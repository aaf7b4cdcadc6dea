"""The CUDA top-k kernel's host side on CPU: which rows it would serve, and (where nvcc is installed) that
``topk.cu`` compiles for Hopper at every row width it serves. Its results are checked on the GPU against a
stable sort and the Triton kernel (tests/gpu/test_topk_gpu.py)."""

from __future__ import annotations

import pytest
import torch

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
