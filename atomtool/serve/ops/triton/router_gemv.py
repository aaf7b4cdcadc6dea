"""The MoE gate's logits ``x @ W^T`` in float32 (``router_logits``) in one Triton launch.

Same contract as :func:`atomtool.serve.ops.torch_ref.router_logits` (HF ``DeepseekV3TopkRouter``:
``F.linear(x.float(), weight.float())``), without its two kernels and its float32 weight copy: x and the
[E, H] gate weight are read in their own dtypes (bf16/fp16: half the bytes of a float32 copy), each product
is formed in float32 (exact for bf16/fp16 operands) and summed in float32 -- CUDA-core FMAs, no tensor-core
dot (no TF32, and a dot needs 16 experts per program, too few programs at decode).

Layout: a program owns a [BT tokens, BE experts] tile of the output. It keeps ``LANES`` = 128 float32
partial sums per output: lane j adds the products of k = j, j + 128, j + 256, ... in increasing k, and the
128 lanes are then summed by a fixed pairwise tree (lane j + 64 onto lane j, then j + 32, ...,
:func:`_lane_tree_sum`). That order depends on k and the lane count only, not on the tile (BT, BE), the
chunks per step, the pipeline depth or the warps, so every config gives each token bitwise the same
logits: a token's logits do not depend on the batch (``_config`` picks the tile from T; the tests check the
bits across configs and batches). Products of bf16/fp16 operands are exact, so whether the compiler fuses
multiply and add changes no bit.

Decode (T = 1, E = 256, H = 7168): 256 one-warp programs of one expert, each streaming its weight row
(14 KB) in 2 KB steps (8 chunks of 128), software-pipelined 4 deep (Triton's asynchronous copies through
shared memory). With PDL (:func:`launch_pdl_args`) the launch overlaps the previous kernel's tail, and
each program hints its weight rows into L2 (``prefetch.global.L2``) before it waits for x: the weight is
immutable, so only x has to wait. Without PDL (and under the interpreter) there is no prefetch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.torch_ref import check_router_logits
from atomtool.serve.ops.triton._common import grid_dependency_wait, launch_pdl_args, prefetch_l2

#: float32 partial sums per output (fixes the summation order; every config uses it)
LANES = 128


@triton.jit
def _fold(v, BT: tl.constexpr, BE: tl.constexpr, HALF: tl.constexpr):
    """[BT, BE, 2 * HALF] -> [BT, BE, HALF]: ``v[..., j] + v[..., j + HALF]`` (two terms: no order)."""
    return tl.sum(tl.reshape(v, [BT, BE, 2, HALF]), axis=2)


@triton.jit
def _lane_tree_sum(v, BT: tl.constexpr, BE: tl.constexpr):
    """Sum of the 128 lanes of ``v`` [BT, BE, 128] -> [BT, BE] by halving folds: a fixed order, whatever
    layout Triton gives the tile (a plain ``tl.sum``'s order follows the layout, hence the tile shape)."""
    v = _fold(v, BT, BE, 64)
    v = _fold(v, BT, BE, 32)
    v = _fold(v, BT, BE, 16)
    v = _fold(v, BT, BE, 8)
    v = _fold(v, BT, BE, 4)
    v = _fold(v, BT, BE, 2)
    v = _fold(v, BT, BE, 1)
    return tl.reshape(v, [BT, BE])


@triton.jit
def _router_logits_kernel(
    x_ptr, w_ptr, out_ptr, T, E, K, s_xt, s_we, s_ot,
    BT: tl.constexpr, BE: tl.constexpr, LANES_: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
    PF_LINES: tl.constexpr = 128, USE_PDL: tl.constexpr = False,
):
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_e = pid_e * BE + tl.arange(0, BE)
    offs_j = tl.arange(0, LANES_)
    t_ok = offs_t < T
    e_ok = offs_e < E
    # 3-d pointers ([BT, 1, lanes] and [1, BE, lanes]): the tiles broadcast into the [BT, BE, lanes] products
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None, None] * s_xt
    w_rows = w_ptr + offs_e.to(tl.int64)[None, :, None] * s_we
    acc = tl.zeros([BT, BE, LANES_], dtype=tl.float32)
    if USE_PDL:
        # the weight is immutable: while the previous kernel finishes, pull this program's rows into L2 (one
        # hint per 128 bytes of bf16; addresses clamped in bounds), so the loop below mostly hits L2
        pe = tl.minimum(offs_e, E - 1).to(tl.int64)[:, None] * s_we
        for p0 in range(0, K, 64 * PF_LINES):
            pk = tl.minimum(p0 + tl.arange(0, PF_LINES) * 64, K - 1)[None, :]
            prefetch_l2(w_ptr + pe + pk)
    grid_dependency_wait(USE_PDL)  # x comes from the previous kernel
    # software-pipelined (STAGES - 1 steps of loads in flight, asynchronous copies through shared memory,
    # which also hand the tiles over in the accumulator's layout)
    for k0 in tl.range(0, K, LANES_ * UNROLL, num_stages=STAGES):
        for u in tl.static_range(UNROLL):
            k = (k0 + u * LANES_ + offs_j)[None, None, :]
            k_ok = k < K
            w = tl.load(w_rows + k, mask=e_ok[None, :, None] & k_ok, other=0.0).to(tl.float32)
            x = tl.load(x_rows + k, mask=t_ok[:, None, None] & k_ok, other=0.0).to(tl.float32)
            acc += x * w
    out = _lane_tree_sum(acc, BT, BE)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * s_ot + offs_e[None, :], out,
             mask=t_ok[:, None] & e_ok[None, :])


#: (largest T, BT tokens, BE experts, UNROLL chunks of 128 per pipelined step, warps, stages), the first
#: whose T bound covers the batch. Every choice gives the same bits (module doc), so the table is tuned for
#: speed only: decode spreads the weight over E programs (one expert row each) with 3 steps in flight;
#: larger batches use larger tiles (each loaded x / W row reused BE / BT times). Chosen by reading the sm_90
#: SASS (vector asynchronous copies, no layout change in the loop); the decode row by timing (H200, CUDA graph,
#: T = 1, E 256, H 7168, tests/gpu test_router_logits_configs): one expert per program 3.13 us, two 3.69 us;
#: the T = 64 row measured 25.6 us (cast + cuBLAS float32: 20.6 us), its alternatives not yet.
_CONFIGS = (
    (2, 1, 1, 8, 1, 4),
    (16, 4, 2, 4, 2, 4),
    (64, 8, 4, 2, 4, 3),
    (None, 16, 8, 2, 8, 3),
)


def _config(T: int) -> tuple[int, int, int, int, int]:
    """(BT, BE, UNROLL, num_warps, num_stages) for a batch of T tokens (:data:`_CONFIGS`)."""
    for t_max, *cfg in _CONFIGS:
        if t_max is None or T <= t_max:
            return tuple(cfg)
    raise AssertionError("unreachable: the last config covers every T")


def router_logits(x: torch.Tensor, weight: torch.Tensor, *,
                  config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Router logits ``x @ weight^T`` [T, E] float32; the contract of ``torch_ref.router_logits``.

    Args:
        x: [T, H] bf16/fp16 (float32 works too, with rounded products); any row stride, last dim contiguous
            or copied.
        weight: [E, H] gate weight in the model dtype (any float dtype, independent of x's).
        config: (BT, BE, UNROLL, num_warps, num_stages) to force a tile (tests: every tile gives the same bits); None:
            chosen from T.
    Returns:
        [T, E] float32; a token's row is bitwise the same for every T and batch position (module doc); it
        equals the reference up to float32 summation order.
    Raises:
        ValueError: shapes that do not form [T, H] @ [E, H]^T (message names both shapes).
    """
    check_router_logits(x, weight)
    T, K = x.shape
    E = weight.shape[0]
    out = torch.empty((T, E), dtype=torch.float32, device=x.device)
    if T == 0 or E == 0:
        return out
    if K == 0:
        return out.zero_()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    bt, be, unroll, warps, stages = config if config is not None else _config(T)
    grid = (triton.cdiv(T, bt), triton.cdiv(E, be))
    _router_logits_kernel[grid](
        x, weight, out, T, E, K, x.stride(0), weight.stride(0), out.stride(0),
        BT=bt, BE=be, LANES_=LANES, UNROLL=unroll, STAGES=stages, num_warps=warps, **launch_pdl_args(x.device),
    )
    return out
