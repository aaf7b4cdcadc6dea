"""Per-row top-k positions in one CUDA CTA per row (``topk.cu``): the DSA indexer's selection for rows of at
most :data:`MAX_WIDTH` keys, in place of the Triton one-program kernel.

Same contract and the same bits as :func:`atomtool.serve.ops.triton.topk.select_rows` (the selection is exact:
the K largest keys, ties to the lowest position, ascending), which dispatches here on CUDA devices when
:func:`available` says so. ``ATOMTOOL_CUDA_TOPK=0`` turns it off (A/B measurements); without ``nvcc`` or when
the build fails, the Triton kernel serves and a warning says why, once.
"""

from __future__ import annotations

import ctypes

import torch

from atomtool.serve.ops.cuda.driver import OptionalKernel, device_guard

THREADS = 1024
#: widest key row served (THREADS x 8 keys in registers)
MAX_WIDTH = 8192


def items_for(width: int) -> int:
    """Keys per thread for rows ``width`` wide: the smallest power of two with THREADS x items >= width."""
    items = 1
    while THREADS * items < width:
        items *= 2
    return items


#: the kernel, per device and keys per thread
KERNEL = OptionalKernel("topk.cu", "topk_rows", "top-k", "ATOMTOOL_CUDA_TOPK")


def _defines(width: int) -> tuple[tuple[str, int], ...]:
    return (("THREADS", THREADS), ("ITEMS", items_for(width)))


def available(device: torch.device, width: int) -> bool:
    """Whether rows ``width`` keys wide on ``device`` go to the CUDA kernel: ``width <= MAX_WIDTH``, a CUDA (not
    ROCm) device of compute capability 8.0 or newer, ``ATOMTOOL_CUDA_TOPK`` not ``0``, and the kernel built and
    loaded (the first call per device builds it; a failure warns once and keeps the Triton kernel)."""
    return width <= MAX_WIDTH and KERNEL.ready(device, _defines(width))


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
    kern = KERNEL.get(keys.device, _defines(S))
    args = [ctypes.c_void_p(keys.data_ptr()), ctypes.c_void_p(rng.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_void_p(lengths.data_ptr()), ctypes.c_void_p(cu_seqlens_q.data_ptr()),
            ctypes.c_void_p(seq_lens.data_ptr()), ctypes.c_int(seq_lens.shape[0]), ctypes.c_int(row0),
            ctypes.c_int(S), ctypes.c_int(topk), ctypes.c_longlong(keys.stride(0)), ctypes.c_longlong(rng.stride(0)),
            ctypes.c_longlong(out.stride(0)), ctypes.c_int(int(row_lens)), ctypes.c_int(int(range_given)),
            ctypes.c_int(int(pdl))]
    with device_guard(keys.device):
        kern.launch((R, 1, 1), (THREADS, 1, 1), 0, args, pdl=pdl)
