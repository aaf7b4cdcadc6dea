"""Where one sparse-MLA split-KV decode program's time goes: cycle stamps inside a copy of the split kernel.

``_mla_split_kernel`` (atomtool/serve/ops/triton/mla.py) takes ~20 us per program at decode whatever the
program count (docs/PERFORMANCE.md, session 13), so its cost is one program's dependent chain. This probe runs
an instrumented copy of that kernel (the same query load, top-k index load, block-table lookup, latent gather,
dots, online softmax and partial stores; a copy because the stamps must sit between its stages) at batch 1,
128 heads, kv_lora_rank 512 + rope 64, top-k 2048 of 4096, 64-token pages. Each stamp reads the SM's
``%clock64`` in an inline-asm statement that takes a value computed from the stage's result as an operand, so
it cannot run before the stage has finished (the reductions that make those values add some time: the run
without stamps gives the kernel's own time). L2 is flushed before each launch (the model's KV rows come from
HBM; its query, indices and block table would be in L2, so those loads read slower here than in the model).
Prints, per block_n / stages candidate, the kernel time (CUDA events, median of 20) with and without stamps
and the slowest program's time at each stage. CUDA only (inline PTX).

    python3 -m benchmarks.mla_split_stamps
    python3 -m benchmarks.mla_split_stamps --cuda   # the CUDA kernel (mla_split.cu built with -DSTAMPS=1)

``--cuda`` stamps the CUDA split kernel the engine uses on Hopper instead (thread 0 of each CTA: row set up,
key offsets, then per 64-key block: data ready, scores, probabilities, values; end), with L2 flushed before each
launch and without (the model's case: the query, indices and block table were just written).
"""

from __future__ import annotations

import argparse
import subprocess

import torch
import triton
import triton.language as tl

from atomtool.serve.ops.triton._common import dot_acc, online_softmax_step, paged_rows
from atomtool.serve.ops.triton.mla import _load_query
from benchmarks import common as C

#: stamp slots per program: start, query, then (indices, block table, latent, dots) per key block, end
SLOTS = 24


@triton.jit
def _put(ts, i, dep):
    """Store the SM cycle counter at slot i, read after ``dep`` (a float32 scalar) is known."""
    d = tl.full([1], 0.0, tl.float32) + dep
    stamp = tl.inline_asm_elementwise("mov.u64 $0, %clock64; // $1", "=l,f", [d], dtype=tl.int64, is_pure=False,
                                      pack=1)
    tl.store(ts + i + tl.arange(0, 1), stamp)


@triton.jit
def _tile_sum(x):
    return tl.sum(tl.sum(x.to(tl.float32), 1), 0)


@triton.jit
def _stamped_split_kernel(qn_ptr, qp_ptr, lat_ptr, ws_acc_ptr, ws_ml_ptr, bt_ptr, topk_ptr, ts_ptr,
                          H, R, P, block_size, sm_scale, s_qnt, s_qnh, s_qpt, s_qph, s_lb, s_ls, s_bt, s_tk,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
                          SPAN: tl.constexpr, STAMPS: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    c = tl.program_id(2)
    ts = ts_ptr + (hb * tl.num_programs(2) + c) * 24
    _put(ts, 0, 0.0)
    t64 = b.to(tl.int64)
    qpos = 4095
    start = c * SPAN
    end = start + SPAN
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    r = tl.arange(0, R_PAD)
    r_ok = r < R
    p = tl.arange(0, P_PAD)
    p_ok = p < P
    qn, qp = _load_query(qn_ptr, qp_ptr, t64, h, h_ok, r, r_ok, p, p_ok, s_qnt, s_qnh, s_qpt, s_qph)
    if STAMPS:
        _put(ts, 1, _tile_sum(qn) + _tile_sum(qp))
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    k = 0
    for n in range(start, end, BLOCK_N):
        j = n + tl.arange(0, BLOCK_N)
        j_ok = j < end
        s = tl.load(topk_ptr + t64 * s_tk + j, mask=j_ok, other=-1)
        s_ok = j_ok & (s >= 0) & (s <= qpos)
        s = tl.where(s_ok, s, 0)
        if STAMPS:
            _put(ts, 2 + k * 4, tl.sum(s, 0).to(tl.float32))
        row = paged_rows(bt_ptr, b, s_bt, s, s_ok, block_size, s_lb, s_ls)
        if STAMPS:
            _put(ts, 3 + k * 4, tl.sum(row, 0).to(tl.float32))
        lat = tl.load(lat_ptr + row[:, None] + r[None, :], mask=s_ok[:, None] & r_ok[None, :], other=0.0)
        pe = tl.load(lat_ptr + row[:, None] + R + p[None, :], mask=s_ok[:, None] & p_ok[None, :], other=0.0)
        if STAMPS:
            _put(ts, 4 + k * 4, _tile_sum(lat) + _tile_sum(pe))
        scores = dot_acc(qn, tl.trans(lat), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), tl.bfloat16)
        scores = dot_acc(qp, tl.trans(pe), scores, tl.bfloat16) * qk_scale
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        prob, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        acc = dot_acc(prob.to(lat.dtype), lat, acc * alpha[:, None], tl.bfloat16)
        if STAMPS:
            _put(ts, 5 + k * 4, tl.sum(tl.sum(acc, 1), 0))
        k += 1
    base = c * H + h.to(tl.int64)
    tl.store(ws_acc_ptr + base[:, None] * R + r[None, :], acc, mask=h_ok[:, None] & r_ok[None, :])
    tl.store(ws_ml_ptr + base * 2, m_i, mask=h_ok)
    tl.store(ws_ml_ptr + base * 2 + 1, l_i, mask=h_ok)
    _put(ts, 23, tl.sum(m_i, 0))


def _inputs(dev: torch.device, H: int, R: int, P: int, K: int, ctx: int, bs: int) -> tuple[torch.Tensor, ...]:
    """One decode row: (q_nope_absorbed [1, H, R], q_pe [1, H, P], latent pool [*, bs, R + P], block table
    [1, *], top-k [1, K]) with its ctx-token context's pages spread over a 40x larger pool."""
    g = torch.Generator(device=dev).manual_seed(2)
    pool = 40 * (ctx // bs + 1)
    latent = torch.randn(pool, bs, R + P, device=dev, dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(pool, device=dev, generator=g)[: ctx // bs + 1].to(torch.int32).view(1, -1)
    topk = torch.randperm(ctx, device=dev, generator=g)[:K].sort().values.to(torch.int32).view(1, -1)
    qn = torch.randn(1, H, R, device=dev, dtype=torch.bfloat16, generator=g)
    qp = torch.randn(1, H, P, device=dev, dtype=torch.bfloat16, generator=g)
    return qn, qp, latent, bt, topk


def _median_us(launch, iters: int, flush: torch.Tensor | None) -> float:
    samples = []
    for _ in range(iters + 1):
        if flush is not None:
            flush.zero_()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        launch()
        e1.record()
        torch.cuda.synchronize()
        samples.append(e0.elapsed_time(e1) * 1e3)
    return sorted(samples[1:])[len(samples) // 2 - 1]


CUDA_SLOTS = 16
CUDA_STAGES = [(1, "row"), (2, "offsets")] + [(3 + 4 * k + i, f"{nm}{k}") for k in range(2)
                                              for i, nm in enumerate(("data", "scores", "probs", "values"))] + [
    (11, "end")]


def cuda_main(iters: int, ghz: float) -> int:
    """The CUDA kernel's stamps (see the module docstring)."""
    import ctypes

    from atomtool.serve.ops.cuda import mla_split as cs
    from atomtool.serve.ops.cuda.build import compile_cubin
    from atomtool.serve.ops.cuda.driver import load_kernel

    dev = torch.device("cuda")
    H, R, P, K, ctx, bs = 128, 512, 64, 2048, 4096, 64
    qn, qp, latent, bt, topk = _inputs(dev, H, R, P, K, ctx, bs)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
    n_chunks = K // 128
    ws_acc = torch.empty(1, n_chunks, H, R, device=dev)
    ws_ml = torch.empty(1, n_chunks, H, 2, device=dev)
    heads = cs.heads_for(1, H, n_chunks, dev)
    ts = torch.zeros(H // heads * n_chunks, CUDA_SLOTS, dtype=torch.int64, device=dev)
    assert cs.serves(qn, qp, latent, bt, topk)
    plain = cs.KERNEL.get(dev, cs.defines(heads))
    major, minor = torch.cuda.get_device_capability(dev)
    cubin = compile_cubin("mla_split.cu", f"sm_{major}{minor}", (("STAMPS", 1), *cs.defines(heads)))
    stamped = load_kernel(cubin, "mla_split")
    grid, kargs = cs.launch_args(qn, qp, latent, ws_acc, ws_ml, cu, sl, bt, topk, 0.1, 128, False, heads)
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for flushed in (True, False):
        flush = flush_buf if flushed else None
        t_plain = _median_us(lambda: plain.launch(grid, (cs.THREADS, 1, 1), cs.shared_bytes(heads), kargs), iters, flush)
        t_stamped = _median_us(lambda: stamped.launch(grid, (cs.THREADS, 1, 1), cs.shared_bytes(heads),
                                                      kargs + [ctypes.c_void_p(ts.data_ptr())]), iters, flush)
        rel = (ts.cpu().double() - ts.cpu().double()[:, :1]) / ghz / 1e3
        stages_us = {nm: round(float(rel[:, i].max()), 2) for i, nm in CUDA_STAGES}
        l2 = "flushed" if flushed else "warm"
        print(f"\nCUDA split kernel ({heads} heads per CTA), L2 {l2}: kernel {t_plain:.1f} us, with stamps "
              f"{t_stamped:.1f} us; slowest CTA, us since its start:")
        print("  " + ", ".join(f"{nm} {v}" for nm, v in stages_us.items()))
        C.record("mla_split_stamps", kernel="cuda", l2_flushed=flushed, kernel_us=t_plain, stamped_us=t_stamped,
                 **stages_us)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cuda", action="store_true", help="stamp the CUDA split kernel (mla_split.cu) instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mla_split_stamps needs a CUDA device (inline PTX stamps)")
    dev = torch.device("cuda")
    ghz = float(subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True).stdout.split()[0]) / 1e3
    print("env", C.env_info(dev), f"SM clock {ghz} GHz (max; stamps are converted with it)")
    if args.cuda:
        return cuda_main(args.iters, ghz)
    H, R, P, K, ctx, bs, span = 128, 512, 64, 2048, 4096, 64, 128
    qn, qp, latent, bt, topk = _inputs(dev, H, R, P, K, ctx, bs)
    n_chunks, block_h = K // span, 64
    ws_acc = torch.empty(1, n_chunks, H, R, device=dev)
    ws_ml = torch.empty(1, n_chunks, H, 2, device=dev)
    programs = (H // block_h) * n_chunks
    ts = torch.zeros(programs, SLOTS, dtype=torch.int64, device=dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for bn, stages in ((64, 2), (64, 1), (32, 2), (128, 1)):
        times = {}
        for stamps in (False, True):
            def launch(stamps=stamps, bn=bn, stages=stages):
                _stamped_split_kernel[(1, H // block_h, n_chunks)](
                    qn, qp, latent, ws_acc, ws_ml, bt, topk, ts, H, R, P, bs, 0.1, qn.stride(0), qn.stride(1),
                    qp.stride(0), qp.stride(1), latent.stride(0), latent.stride(1), bt.stride(0), topk.stride(0),
                    BLOCK_H=block_h, BLOCK_N=bn, R_PAD=R, P_PAD=P, SPAN=span, STAMPS=stamps, num_warps=8,
                    num_stages=stages)
            times[stamps] = _median_us(launch, args.iters, flush)
        rel = (ts.cpu().double() - ts.cpu().double()[:, :1]) / ghz / 1e3  # us since each program's start
        names = [(1, "query")] + [(2 + k * 4 + i, f"{nm}{k}") for k in range(span // bn)
                                  for i, nm in enumerate(("indices", "block_table", "latent", "dots"))]
        stages_us = {nm: round(float(rel[:, i].max()), 2) for i, nm in names + [(23, "end")]}
        print(f"\nblock_n {bn}, {stages} stages: kernel {times[False]:.1f} us, with stamps {times[True]:.1f} us;"
              " slowest program, us since its start:")
        print("  " + ", ".join(f"{nm} {v}" for nm, v in stages_us.items()))
        C.record("mla_split_stamps", block_n=bn, num_stages=stages, kernel_us=times[False],
                 stamped_us=times[True], **stages_us)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
