"""W8A8 FP8 block linear for decode-sized M on Hopper: the CUDA kernel of ``fp8_gemv.cu`` (see its header).

Same contract as ``torch_ref.fp8_matmul`` with ``act_quant`` set (DeepSeek-V3's act_quant + fp8_gemm), for
bf16 activations, 128 x 128 weight blocks and K a multiple of 128. The K split is a cluster of up to 8 CTAs
whose partials are summed in rank order in distributed shared memory: one launch, no float32 workspace.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from atomtool.serve.ops.cuda.build import compile_cubin
from atomtool.serve.ops.cuda.driver import Kernel, device_guard, load_kernel

BLOCK_N = 64
MAX_CLUSTER = 8


@cache
def _kernel(device_index: int, rows: int, depth: int) -> Kernel:
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin = compile_cubin("fp8_gemv.cu", f"sm_{major}{minor}a", (("ROWS", rows), ("DEPTH", depth)))
    with torch.cuda.device(device_index):
        return load_kernel(cubin, "fp8_gemv_w8a8")


def gemv_plan(N: int, K: int, splits: int | None = None, target: int = 528) -> tuple[int, int]:
    """(cluster size S, K per CTA) for an [N, K] weight with K a multiple of 128: S (1..8) K splits so that
    ceil(N / 64) * S CTAs stay within ``target`` (one wave of 4 CTAs per SM on a 132-SM H100 / H200: the H200
    probe measured a second, partial wave at 20-40% of a call's time), each split a whole number of 128-wide
    groups; ``splits`` forces S. From the weight's shape only (a constant target, so the bits do not depend on
    the device's SM count either)."""
    groups = K // 128
    tiles = -(-N // BLOCK_N)
    s = splits if splits is not None else max(1, min(MAX_CLUSTER, groups, target // tiles))
    per = -(-groups // s)
    return -(-groups // per), per * 128


def fp8_gemv_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                  bias: torch.Tensor | None, round_scale: bool, splits: int | None = None, depth: int = 4,
                  early_weights: bool = False, pdl: bool = True) -> torch.Tensor:
    """x: [M, K] bf16 (last dim contiguous, rows 16-byte aligned); weight: [N, K] float8_e4m3fn contiguous;
    weight_scale_inv: [ceil(N/128), K/128] float32 contiguous; bias: [N] bf16 or None; splits: force the K split
    (1..8). Returns [M, N] bf16.

    With ``early_weights`` the kernel reads the weights before its programmatic-dependent-launch wait (model
    parameters, never written by the kernel before it), so weights and scales are taken as given, never copied
    here: a copy launched just before would race with such reads.

    Raises:
        ValueError: inputs outside the kernel's contract (the message names them).
    """
    M, K = x.shape
    N = weight.shape[0]
    if (x.dtype != torch.bfloat16 or K % 128 or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16
            or weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (N, K) or not weight.is_contiguous()
            or weight_scale_inv.dtype != torch.float32 or not weight_scale_inv.is_contiguous()
            or tuple(weight_scale_inv.shape) != (-(-N // 128), K // 128)
            or (bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (N,)))
            or (splits is not None and not 1 <= splits <= MAX_CLUSTER)):
        raise ValueError(
            f"fp8_gemv: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, scales "
            f"{tuple(weight_scale_inv.shape)} {weight_scale_inv.dtype}, bias "
            f"{None if bias is None else (tuple(bias.shape), bias.dtype)}, splits {splits} not served (bf16 x with "
            f"K % 128 == 0 and aligned rows, contiguous e4m3 weight, float32 [ceil(N/128), K/128] scales, bf16 bias, "
            f"1..{MAX_CLUSTER} splits)")
    w, s = weight, weight_scale_inv
    out = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return out
    S, k_chunk = gemv_plan(N, K, splits)
    rows = 8 if M <= 8 else 16
    shared = rows * (k_chunk + 16) + rows * (k_chunk // 128) * 4 + rows * BLOCK_N * 4 + (k_chunk // 128) * 4
    kern = _kernel(x.device.index if x.device.index is not None else torch.cuda.current_device(), rows, depth)
    grid = (S, -(-N // BLOCK_N), -(-M // rows))
    args = [ctypes.c_void_p(x.data_ptr()), ctypes.c_longlong(x.stride(0)), ctypes.c_void_p(w.data_ptr()),
            ctypes.c_void_p(s.data_ptr()), ctypes.c_int(s.stride(0)),
            ctypes.c_void_p(bias.data_ptr() if bias is not None else 0), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_longlong(out.stride(0)), ctypes.c_int(M), ctypes.c_int(N), ctypes.c_int(K),
            ctypes.c_int(k_chunk), ctypes.c_int(int(round_scale)), ctypes.c_int(int(early_weights))]
    with device_guard(x.device):  # the launch goes to the current stream of x's device
        kern.launch(grid, (128, 1, 1), shared, args, cluster=(S, 1, 1), pdl=pdl)
    return out
