"""Linear layer with DeepSeek-V3 FP8 block-quantized weights, in Triton.

``y = x @ (W_fp8 * scale_inv[n // bn, k // bk])^T + b``: weights stay FP8 in memory (half the bytes of
BF16); each K step of the GEMM stays inside one scale block, so the block scale multiplies the partial
product once. Weight-only (``act_quant`` None): the weights are widened exactly to the activation dtype
inside the kernel, so the result matches the dequantize-then-matmul reference up to float rounding. W8A8
(``act_quant``, what the checkpoints' ``activation_scheme: dynamic`` and DeepSeek's reference inference do):
each K step's activation tile is quantized per row in registers (``_act_quant``) and the dot runs e4m3 x
e4m3 on the FP8 tensor cores; the result matches ``torch_ref.linear_w8a8``.

Why not ``torch._scaled_mm`` for W8A8: it needs a separate activation-quantization launch per linear (a
latency cost at decode) and its own tile choice per M (no batch invariance); the GPU tests probe whether
the installed torch offers the block-scaled form (see tests/gpu/test_kernels_gpu.py).
Unquantized weights go to ``torch.nn.functional.linear`` (cuBLAS).

One launch shape for every M: at M = 1 a 64x128-tile layout would give N / 128 programs (56 for o_proj)
each streaming MBs of weight serially, so the kernel uses 16x64 tiles and split-K (split-K GEMM as in
CUTLASS's "split-K serial/parallel" and FlashDecoding-style GEMV), the split count taken from the weight's
(N, K) only; the fp32 partials are summed in split order by a second kernel. Decode and prefill share the
tile shape and the split, so a row's bits never depend on the other rows or on M (batch invariance, at some
cost to prefill efficiency).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atomtool.serve.ops.torch_ref import act_quant_fp8_supported, act_quant_round_scale
from atomtool.serve.ops.triton._common import (
    dot_acc,
    dot_dtype,
    grid_dependency_wait,
    interpreting,
    launch_pdl_args,
)


@triton.jit
def _load_step(a_rows, w_rows, s_row, kk, k0, k_end, m_ok, n_ok, bk):
    """The activation tile [BLOCK_M, BLOCK_K], FP8 weight tile [BLOCK_N, BLOCK_K] and block scales [BLOCK_N] of
    the K step at k0 (Triton's pipeliner stages the two tiles through shared memory with cp.async)."""
    k = k0 + kk
    k_ok = k < k_end
    a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    sc = tl.load(s_row + k0 // bk, mask=n_ok & (k0 < k_end), other=0.0)
    return a, w, sc


@triton.jit
def _act_quant(a, ROUND_SCALE: tl.constexpr):
    """Dynamic per-token FP8 quantization of one activation tile [R, BLOCK_K] (one 1 x BLOCK_K group per row):
    scale s = max(amax, 1e-4) / 448 (a power of two rounded up under ROUND_SCALE, DeepSeek's ``ue8m0``
    ``scale_fmt``), q = e4m3(a * (1 / s)) rounded to nearest even; returns (q [R, BLOCK_K] e4m3, s [R] float32).
    DeepSeek-V3's ``act_quant`` (and transformers' fine-grained FP8 kernels); divisions are IEEE (``div_rn``)
    so the torch reference (``torch_ref.act_quant_fp8``) gives the same bits."""
    a32 = a.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(a32), axis=1), 1e-4)
    s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    if ROUND_SCALE:
        # ceil to a power of two on the float32 bits (exact for the positive normal scales here)
        s = ((s.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    # one IEEE division per row, then multiplies: a division per element costs a slow-path call on the GPU
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    q = (a32 * inv[:, None]).to(tl.float8e4nv)
    return q, s


@triton.jit
def _fp8_step(acc, a, w, sc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
              SWAP_AB: tl.constexpr, ACT_FP8: tl.constexpr = False, ROUND_SCALE: tl.constexpr = False):
    """acc + (a @ widen(w)^T) * sc for one K step inside one scale block (transposed under SWAP_AB).
    e4m3 -> fp32 -> DOT_DTYPE is exact; on sm90 Triton's direct e4m3 -> bf16 conversion measured slower (FP8
    linear 19.6 -> 25.7 us per call at M = 1), and so did widening by integer ops (1.35 -> 1.52 ms per step).
    ACT_FP8 (W8A8): the activation tile is quantized per row (``_act_quant``; the K step is the whole scale
    block, so one group) and the dot runs e4m3 x e4m3 on the FP8 tensor cores with no weight widened:
    acc + (q @ w^T) * (s_a * sc). Within one K step Hopper's e4m3 wgmma accumulates with reduced precision;
    each step's partial is promoted to the float32 accumulator (DeepSeek-V3 report, section 3.3.2: promotion
    every 128 elements), so the reference (float32 throughout) agrees up to that."""
    if ACT_FP8:
        q, sa = _act_quant(a, ROUND_SCALE)
        if SWAP_AB:
            part = tl.dot(w, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], tl.float32))
            return acc + part * (sc[:, None] * sa[None, :])
        else:
            part = tl.dot(q, tl.trans(w), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))
            return acc + part * (sa[:, None] * sc[None, :])
    if SWAP_AB:
        part = dot_acc(w.to(tl.float32), tl.trans(a), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), DOT_DTYPE)
        return acc + part * sc[:, None]
    else:
        part = dot_acc(a, tl.trans(w.to(tl.float32)), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_DTYPE)
        return acc + part * sc[None, :]


@triton.jit
def _tile(s_ptr, M, N, K, bn, k_chunk, s_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows m [BLOCK_M], columns n [BLOCK_N], their masks, the scale row pointers [BLOCK_N] and
    its K range [k_start, k_end) (program (pid_m, pid_n, pid_s) of the split-K grid)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_chunk
    return m, n, m < M, n < N, s_ptr + (n // bn).to(tl.int64) * s_sn, k_start, tl.minimum(K, k_start + k_chunk)


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, M, N, K, bn, bk, k_chunk,
                           n_splits, s_am, s_wn, s_sn, s_cm, s_cs, s_om,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, SWAP_AB: tl.constexpr,
                           FUSED_SUM: tl.constexpr, USE_PDL: tl.constexpr = False,
                           ACT_FP8: tl.constexpr = False, ROUND_SCALE: tl.constexpr = False):
    # program (pid_m, pid_n, pid_s) owns a BLOCK_M x BLOCK_N tile and the K range [pid_s * k_chunk, + k_chunk);
    # with one split (k_chunk >= K) c_ptr is the output, else it is split pid_s's fp32 partial plane.
    # SWAP_AB computes the transposed tile W_tile @ a_tile^T ([BLOCK_N, BLOCK_M]): the widened weight tile is
    # then the dot's first operand, which Hopper's wgmma reads straight from registers (the "swap AB" of
    # small-M FP8 GEMMs); the tile and the K order are the same for every M either way.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    grid_dependency_wait(USE_PDL)
    m, n, m_ok, n_ok, s_row, k_start, k_end = _tile(s_ptr, M, N, K, bn, k_chunk, s_sn, BLOCK_M, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_rows = a_ptr + m[:, None].to(tl.int64) * s_am
    w_rows = w_ptr + n[:, None].to(tl.int64) * s_wn
    for k0 in range(k_start, k_end, BLOCK_K):
        a, w, sc = _load_step(a_rows, w_rows, s_row, kk, k0, k_end, m_ok, n_ok, bk)
        acc = _fp8_step(acc, a, w, sc, BLOCK_M, BLOCK_N, DOT_DTYPE, SWAP_AB, ACT_FP8, ROUND_SCALE)
    c_base = c_ptr + pid_s.to(tl.int64) * s_cs
    if SWAP_AB:
        if HAS_BIAS and not FUSED_SUM:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(c_base + m[None, :].to(tl.int64) * s_cm + n[:, None], acc.to(c_ptr.dtype.element_ty),
                 mask=m_ok[None, :] & n_ok[:, None])
    else:
        if HAS_BIAS and not FUSED_SUM:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_base + m[:, None].to(tl.int64) * s_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    if FUSED_SUM:
        # split-K without a second launch: the last of the tile's n_splits programs to finish (a counter per
        # tile, acq_rel atomic after a CTA barrier, so every split's partial stores are visible to it) sums the
        # partials in split order -- the order of _sum_splits_kernel, so the bits are the same whichever
        # program arrives last -- and resets the counter for the next call / CUDA-graph replay.
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(cnt_ptr + tile, 1) == n_splits - 1:
            offs = m[:, None].to(tl.int64) * s_cm + n[None, :]
            ok = m_ok[:, None] & n_ok[None, :]
            tot = tl.load(c_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for sp in range(1, n_splits):
                tot += tl.load(c_ptr + sp * s_cs + offs, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + m[:, None].to(tl.int64) * s_om + n[None, :], tot.to(out_ptr.dtype.element_ty),
                     mask=ok)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _fp8_block_gemm_tma_kernel(a_desc, w_desc, s_ptr, bias_ptr, c_ptr, M, N, K, bn, bk, k_chunk, s_sn, s_cm, s_cs,
                               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr = False,
                               ACT_FP8: tl.constexpr = False, ROUND_SCALE: tl.constexpr = False,
                               SWAP_AB: tl.constexpr = False):
    # _fp8_block_gemm_kernel (no fused sum) with the activation and weight tiles fetched by the Hopper
    # tensor-memory accelerator (TMA): one bulk copy per tile instead of per-thread addresses, masks and
    # cp.async; out-of-bounds rows / columns arrive as zeros, which is what the masked loads read. Same tiles,
    # same K order, same dot: the same bits.
    grid_dependency_wait(USE_PDL)
    m, n, m_ok, n_ok, s_row, k_start, k_end = _tile(s_ptr, M, N, K, bn, k_chunk, s_sn, BLOCK_M, BLOCK_N)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = a_desc.load([tl.program_id(0) * BLOCK_M, k0])
        w = w_desc.load([tl.program_id(1) * BLOCK_N, k0])
        sc = tl.load(s_row + k0 // bk, mask=n_ok, other=0.0)
        acc = _fp8_step(acc, a, w, sc, BLOCK_M, BLOCK_N, DOT_DTYPE, SWAP_AB, ACT_FP8, ROUND_SCALE)
    c_base = c_ptr + tl.program_id(2).to(tl.int64) * s_cs
    if SWAP_AB:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(c_base + m[None, :].to(tl.int64) * s_cm + n[:, None], acc.to(c_ptr.dtype.element_ty),
                 mask=m_ok[None, :] & n_ok[:, None])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_base + m[:, None].to(tl.int64) * s_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(ws_ptr, bias_ptr, out_ptr, MN, N, N_SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    # out = ((ws[0] + ws[1]) + ws[2]) + ... (+ bias), in split-index order: a fixed order whatever M is. The
    # plane count is a compile-time constant (a weight's split count never changes; the MoE's top-k likewise),
    # so the loop unrolls and every plane's load is in flight at once instead of one L2 round trip per plane
    grid_dependency_wait(USE_PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.load(ws_ptr + i, mask=ok, other=0.0)
    for sp in tl.static_range(1, N_SPLITS):
        acc += tl.load(ws_ptr + sp * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


#: rows per split-K launch (bounds the fp32 partials workspace; does not change any row's result)
SPLIT_ROWS = 512
#: tile counters for the fused split-K sum, one zeroed int32 buffer per weight (the last program of a tile resets
#: its counter): two GEMMs may run at once on two streams (the layers' side-stream branches; one buffer per device
#: let them count into each other's tiles and sum garbage), never two on one weight. Keyed by the weight's id
#: (tensors compare elementwise, so no WeakKeyDictionary); an entry leaves with its weight.
_COUNTERS: dict[int, torch.Tensor] = {}
#: buffers a larger one replaced (a call with more tiles: another block_n), kept until their weight goes: a CUDA
#: graph captured with one keeps its address, and freed bytes would be another tensor's by the next replay
_RETIRED: dict[int, list[torch.Tensor]] = {}


def _forget(key: int) -> None:
    _COUNTERS.pop(key, None)
    _RETIRED.pop(key, None)


def _tile_counters(weight: torch.Tensor, n: int) -> torch.Tensor | None:
    """The tile counters of ``weight``'s calls (>= n of them), or None when they would have to be created while
    a CUDA graph is being captured (the two-kernel path then serves the call; the engine's eager warm-up
    creates them first). A buffer once returned stays allocated while ``weight`` lives."""
    key = id(weight)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if weight.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is None:
            weakref.finalize(weight, _forget, key)
        else:
            _RETIRED.setdefault(key, []).append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1), dtype=torch.int32, device=weight.device)
    return buf


@dataclass(frozen=True)
class Fp8LinearConfig:
    """Launch configuration of the FP8 block linear, the same for every M (batch invariance).

    block_n: output features per program; block_k: K per step (a divisor of the 128-wide scale block);
    split_target: programs the split-K plan aims for (a constant, so a given weight's split is the same on
    every call and device); num_warps / num_stages: Triton launch options; swap_ab: compute the transposed
    tile (see the kernel); fused_sum: the last split of each tile sums the partials (no second launch; same
    bits as the separate sum kernel).

    Tuned on an H200 at M = 1 with ``python -m benchmarks.kernel_sweep`` (docs/PERFORMANCE.md), over one
    DeepSeek-V3.2 step's FP8 weights: this default 1.42 ms (59% of the copy bandwidth; 1.33-1.40 ms with
    programmatic dependent launch), swap_ab 1.48 ms, block_n 32 1.52 ms, block_n 128 >= 1.93 ms, num_stages 4
    1.36 ms (not adopted: the decode step measured 3.73 ms with 3 stages, 3.76 ms with 4). fused_sum is off: in the H200 decode profile (batch
    1) the fused form cost 1.51 ms per step against 1.31 + 0.14 ms for the GEMM and the separate sum kernel; a
    TMA-kernel version (session 7, not kept) gave the DeepSeek-V3.2-shaped decode step 3.125 ms against 3.086 ms.
    """

    block_n: int = 64
    block_k: int = 128
    split_target: int = 512
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    fused_sum: bool = False
    tma: bool = True


#: the configuration every call uses (the sweep benchmark replaces it to compare candidates)
FP8_LINEAR_CONFIG = Fp8LinearConfig()
#: the configuration of W8A8 calls (``act_quant``; always the swapped tile). H200 sweep at M = 1 over one
#: DeepSeek-V3.2 step's FP8 weights (``kernel_sweep --only linear --act-quant dynamic_ue8m0``): 1.196 ms with
#: 128-wide tiles and split target 256, 1.270 ms with the weight-only default's 64 / 512, 1.33-1.55 ms for
#: 3+ stages or 8 warps
FP8_LINEAR_W8A8_CONFIG = Fp8LinearConfig(block_n=128, split_target=256)


def split_k_plan(N: int, K: int, block_n: int, block_k: int, target: int | None = None) -> tuple[int, int]:
    """(number of K splits, K elements per split) of the split-K plan for an [N, K] weight.

    Chosen from the weight's shape only, never from M: enough splits that ``N / block_n`` tiles times the
    splits reach ~``target`` programs (default: the configured ``split_target``), each split a whole number of ``block_k`` steps
    (so it never cuts a K step, and every scale block is applied exactly as without splitting).
    """
    n_tiles = triton.cdiv(N, block_n)
    k_steps = triton.cdiv(K, block_k)
    target = FP8_LINEAR_CONFIG.split_target if target is None else target
    want = max(1, min(k_steps, triton.cdiv(target, n_tiles)))
    k_chunk = triton.cdiv(k_steps, want) * block_k
    return triton.cdiv(K, k_chunk), k_chunk


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, block_size: tuple[int, int] = (128, 128),
                     act_quant: str | None = None, sum_splits: bool = True) -> torch.Tensor:
    """x: [..., K] (bf16/fp16/fp32); weight: [N, K] float8_e4m3fn; weight_scale_inv: [ceil(N/bn), ceil(K/bk)]
    float32; bias: [N] or None; act_quant: None (weights widened, activations kept) or an
    ``torch_ref.ACT_QUANT_MODES`` mode (W8A8: activations quantized per token and 1 x bk group inside the kernel, see
    ``_act_quant``; needs bk in 32 / 64 / 128). Returns [..., N] in x's dtype; ``sum_splits=False`` with a 2-d
    x of at most SPLIT_ROWS rows, no bias and a K split: the split-K planes [S, M, N] float32 unsummed instead,
    for a consumer that sums them in split order itself (``add_rms_norm``: one launch fewer). Raises
    ValueError on mismatched shapes or an unusable act_quant."""
    bn, bk = block_size
    N, K = weight.shape
    if x.shape[-1] != K or tuple(weight_scale_inv.shape) != (triton.cdiv(N, bn), triton.cdiv(K, bk)):
        raise ValueError(f"fp8 linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale "
                         f"{tuple(weight_scale_inv.shape)} and block {block_size} do not fit")
    lead = x.shape[:-1]
    a = x.reshape(-1, K)
    if a.stride(-1) != 1:
        a = a.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    s = weight_scale_inv.float().contiguous()
    M = a.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(*lead, N)
    cfg = FP8_LINEAR_W8A8_CONFIG if act_quant is not None else FP8_LINEAR_CONFIG
    block_k = next((b for b in (cfg.block_k, 128, 64, 32, 16) if bk % b == 0 and b <= cfg.block_k), 16)
    if bk % block_k:
        raise ValueError(f"fp8 linear: block size {bk} along K must be a multiple of 16")
    act_fp8, round_scale = act_quant_flags(act_quant, bk, block_k)
    # W8A8 always computes the transposed tile: with the 64-row weight tile as the dot's first operand Triton
    # emits Hopper's e4m3 wgmma (m64n16k32); the 16-row activation tile first would take the MMAv2 path,
    # which widens both operands to f16 (sm90 SASS: HMMA + F2FP per element, 2.3x slower at batch 1)
    swap_ab = cfg.swap_ab or act_fp8
    has_bias = bias is not None
    bias_arg = bias if has_bias else s
    # One tile shape and one K split for every M (decode and prefill alike): 16-row tiles (the smallest
    # tensor-core tile) and split-K chosen from the weight's shape only, the splits' fp32 partials summed in
    # split order (by the tile's last split program, or by a second kernel). A row's bits therefore depend on neither the other rows
    # nor M: strictly batch-invariant, at some cost to large-M (prefill) efficiency. A GEMV is bound by
    # streaming the weight, so the split gives decode the programs in flight it needs.
    block_m, block_n = 16, cfg.block_n
    n_splits, k_chunk = split_k_plan(N, K, block_n, block_k, cfg.split_target)
    dot = dot_dtype(x.dtype)
    pdl = launch_pdl_args(x.device)
    tma = _tma_ok(cfg, a, w)
    w_desc = _descriptor(w, block_n, block_k) if tma else None
    # rows in chunks bound the fp32 workspace ([splits, rows, N]); chunking never changes a row's bits
    for r0 in range(0, M, M if n_splits == 1 else SPLIT_ROWS):
        rows = min(SPLIT_ROWS, M - r0) if n_splits > 1 else M
        a_r, out_r = a[r0:r0 + rows], out[r0:r0 + rows]
        grid = (triton.cdiv(rows, block_m), triton.cdiv(N, block_n), n_splits)
        # one split: the kernel writes the output (with the bias); else split planes of fp32 partials
        c = out_r if n_splits == 1 else torch.empty((n_splits, rows, N), dtype=torch.float32, device=x.device)
        s_cm, s_cs = (out_r.stride(0), 0) if n_splits == 1 else (c.stride(1), c.stride(0))
        counters = (_tile_counters(weight, triton.cdiv(SPLIT_ROWS, block_m) * grid[1])
                    if cfg.fused_sum and n_splits > 1 else None)
        fused = counters is not None
        kernel_bias = has_bias and (n_splits == 1 or fused)
        opts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=dot, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, ACT_FP8=act_fp8, ROUND_SCALE=round_scale, **pdl)
        if tma:
            _fp8_block_gemm_tma_kernel[grid](_descriptor(a_r, block_m, block_k), w_desc, s, bias_arg, c, rows, N, K,
                                             bn, bk, k_chunk, s.stride(0), s_cm, s_cs, HAS_BIAS=kernel_bias,
                                             SWAP_AB=swap_ab, **opts)
        else:
            _fp8_block_gemm_kernel[grid](a_r, w, s, bias_arg, c, out_r, counters if fused else s, rows, N, K, bn, bk,
                                         k_chunk, n_splits, a_r.stride(0), w.stride(0), s.stride(0), s_cm, s_cs,
                                         out_r.stride(0), HAS_BIAS=kernel_bias, SWAP_AB=swap_ab,
                                         FUSED_SUM=fused, **opts)
        if n_splits > 1 and not fused:
            if not sum_splits and not has_bias and rows == M and len(lead) == 1:
                return c
            sum_planes(c, out_r, bias)
    return out.view(*lead, N)


def act_quant_flags(act_quant: str | None, bk: int, block_k: int) -> tuple[bool, bool]:
    """(ACT_FP8, ROUND_SCALE) kernel flags of ``act_quant`` for a weight with K-block ``bk`` run in K steps
    of ``block_k``. Raises ValueError for an unknown mode or a block W8A8 cannot serve."""
    if act_quant is None:
        return False, False
    round_scale = act_quant_round_scale(act_quant)
    if not act_quant_fp8_supported(bk) or block_k != bk:
        raise ValueError(f"fp8 act_quant: K block {bk} is not served by W8A8 (needs 32, 64 or 128)")
    return True, round_scale


def _tma_ok(cfg: Fp8LinearConfig, a: torch.Tensor, w: torch.Tensor) -> bool:
    """The TMA kernel serves this call: configured, a Hopper-or-newer CUDA device (not the interpreter), no fused
    split-K sum, and 16-byte aligned bases and row strides (TMA's requirement)."""
    if not cfg.tma or cfg.fused_sum or a.device.type != "cuda" or interpreting():
        return False
    if torch.cuda.get_device_capability(a.device)[0] < 9 or torch.version.hip is not None:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, w))


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    """Triton's host-side TMA descriptor of a row-major 2-D tensor, fetched in [rows, cols] boxes (zeros past
    its edges)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [rows, cols])


def sum_planes(planes: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out = ((planes[0] + planes[1]) + planes[2]) + ... (+ bias)``, cast to ``out``'s dtype, in one kernel.

    planes: [S, M, N] float32 contiguous (split-K partials, or the MoE's per-slot expert outputs); out: [M, N]
    contiguous; bias: [N] or None. The sum runs in plane order in float32 whatever M is, so a row's bits
    depend on neither the other rows nor M (batch invariance).
    """
    S, M, N = planes.shape
    block = 1024
    _sum_splits_kernel[(triton.cdiv(M * N, block),)](planes, bias if bias is not None else planes, out, M * N, N,
                                                     N_SPLITS=S, HAS_BIAS=bias is not None, BLOCK=block,
                                                     num_warps=4, **launch_pdl_args(out.device))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale_inv: torch.Tensor | None = None, block_size: tuple[int, int] = (128, 128),
           act_quant: str | None = None, sum_splits: bool = True) -> torch.Tensor:
    """``y = x @ W^T + b``; same contract as ``torch_ref.linear`` (FP8 block weights with ``weight_scale_inv``,
    W8A8 under ``act_quant``; ``sum_splits=False``: FP8 split-K planes may come back unsummed,
    :func:`fp8_block_linear`)."""
    if weight_scale_inv is None:
        return F.linear(x, weight, bias)
    return fp8_block_linear(x, weight, weight_scale_inv, bias, tuple(block_size), act_quant, sum_splits)
