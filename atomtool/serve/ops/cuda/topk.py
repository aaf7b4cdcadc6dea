"""Per-row top-k positions in one CUDA CTA per row (``topk.cu``): the DSA indexer's selection for rows of at
most :data:`MAX_WIDTH` keys, in place of the Triton one-program kernel.

Same contract and the same bits as :func:`atomtool.serve.ops.triton.topk.select_rows` (the selection is exact:
the K largest keys, ties to the lowest position, ascending), which dispatches here on CUDA devices when
:func:`available` says so. ``ATOMTOOL_CUDA_TOPK=0`` turns it off (A/B measurements); without ``nvcc`` or when
the build fails, the Triton kernel serves and a warning says why, once.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from functools import cache

import torch

from atomtool.serve.ops.cuda.build import CudaBuildError, compile_cubin
from atomtool.serve.ops.cuda.driver import CudaDriverError, Kernel, device_guard, load_kernel

THREADS = 1024
#: widest key row served (THREADS x 8 keys in registers)
MAX_WIDTH = 8192
_FAILED: dict[int, str] = {}
#: (device index, keys per thread) whose kernel is loaded: later calls skip the capability query
_READY: set[tuple[int, int]] = set()


def items_for(width: int) -> int:
    """Keys per thread for rows ``width`` wide: the smallest power of two with THREADS x items >= width."""
    items = 1
    while THREADS * items < width:
        items *= 2
    return items


@cache
def _kernel(device_index: int, items: int) -> Kernel:
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin = compile_cubin("topk.cu", f"sm_{major}{minor}", (("THREADS", THREADS), ("ITEMS", items)))
    with torch.cuda.device(device_index):
        return load_kernel(cubin, "topk_rows")


def available(device: torch.device, width: int) -> bool:
    """Whether rows ``width`` keys wide on ``device`` go to the CUDA kernel: a CUDA (not ROCm) device of compute
    capability 8.0 or newer, ``width <= MAX_WIDTH``, ``ATOMTOOL_CUDA_TOPK`` not ``0``, and the kernel built and
    loaded (the first call per device builds it; a failure warns once and keeps the Triton kernel)."""
    if (device.type != "cuda" or torch.version.hip is not None or width > MAX_WIDTH
            or os.environ.get("ATOMTOOL_CUDA_TOPK", "1") in ("", "0")):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, items_for(width))
    if key in _READY:
        return True
    if index in _FAILED or torch.cuda.get_device_capability(index) < (8, 0):
        return False
    try:
        _kernel(*key)
    except (CudaBuildError, CudaDriverError) as e:
        _FAILED[index] = str(e)
        warnings.warn(f"CUDA top-k kernel unavailable, using the Triton kernel: {e}", RuntimeWarning, stacklevel=2)
        return False
    _READY.add(key)
    return True


def select_rows_cuda(keys: torch.Tensor, out: torch.Tensor, row0: int, topk: int, rng: torch.Tensor,
                     range_given: bool, lengths: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                     row_lens: bool, pdl: bool) -> None:
    """The CUDA twin of the one-program ``select_rows`` (arguments as there, already checked): keys [R, S] int32
    (S <= MAX_WIDTH, last dim contiguous), out [T, topk] int32, rng [R, 2] int32 key ranges (read and zeroed
    when ``range_given``), row lengths from ``lengths`` (``row_lens``) or ``cu_seqlens_q`` / ``seq_lens``;
    ``pdl``: programmatic dependent launch (the kernel waits for the previous one before reading anything).
    Raises CudaDriverError when the launch fails."""
    R, S = keys.shape
    if topk >= 1 << 16:
        raise ValueError(f"select_rows_cuda: topk {topk} must be below 65536")
    index = keys.device.index if keys.device.index is not None else torch.cuda.current_device()
    kern = _kernel(index, items_for(S))
    args = [ctypes.c_void_p(keys.data_ptr()), ctypes.c_void_p(rng.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_void_p(lengths.data_ptr()), ctypes.c_void_p(cu_seqlens_q.data_ptr()),
            ctypes.c_void_p(seq_lens.data_ptr()), ctypes.c_int(seq_lens.shape[0]), ctypes.c_int(row0),
            ctypes.c_int(S), ctypes.c_int(topk), ctypes.c_longlong(keys.stride(0)), ctypes.c_longlong(rng.stride(0)),
            ctypes.c_longlong(out.stride(0)), ctypes.c_int(int(row_lens)), ctypes.c_int(int(range_given)),
            ctypes.c_int(int(pdl))]
    with device_guard(keys.device):
        kern.launch((R, 1, 1), (THREADS, 1, 1), 0, args, pdl=pdl)
