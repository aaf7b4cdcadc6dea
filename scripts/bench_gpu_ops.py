#!/usr/bin/env python3
"""Time the Triton kernels on a CUDA GPU at model-like sizes, next to a torch baseline where one exists.

    python3 scripts/bench_gpu_ops.py [--out bench.json]

Each line: op, case, Triton time (ms, median of triton.testing.do_bench), the bytes or FLOPs that bound it
and the rate reached, and the baseline's time (cuBLAS / PyTorch SDPA / torch._scaled_mm) when there is a
like-for-like one. A sanity check of the kernels' speed, not the project's benchmark (benchmarks/ is).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

import atomtool.serve.ops.triton as tri

DEV = "cuda"
BF16 = torch.bfloat16


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=5, rep=30))


def paged(B, ctx, bs):
    nblk = -(-ctx // bs)
    bt = torch.randperm(B * nblk, device=DEV).int().view(B, nblk)
    return B * nblk, bt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []

    def add(op, case, ms, work, unit, base_ms=None, base=None):
        rate = work / (ms * 1e-3) / 1e12
        rows.append({"op": op, "case": case, "triton_ms": round(ms, 4), f"{unit}": round(rate, 2),
                     "baseline": base, "baseline_ms": None if base_ms is None else round(base_ms, 4)})
        print(rows[-1], flush=True)

    # paged attention: decode (bandwidth-bound) and prefill (compute-bound), Llama-3-8B heads
    H, Hkv, D, bs = 32, 8, 128, 16
    for B, ctx in ((64, 4096), (1, 32768)):
        nb, bt = paged(B, ctx, bs)
        kc = torch.randn(nb, bs, Hkv, D, device=DEV, dtype=BF16)
        vc = torch.randn_like(kc)
        q = torch.randn(B, H, D, device=DEV, dtype=BF16)
        cu = torch.arange(B + 1, device=DEV, dtype=torch.int32)
        sl = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
        ms = bench(lambda: tri.paged_attention(q, kc, vc, cu, sl, bt, D ** -0.5))  # noqa: B023
        add("paged_attention", f"decode B={B} ctx={ctx}", ms, 2 * B * ctx * Hkv * D * 2, "TB/s")
    T = 4096
    nb, bt = paged(1, T, bs)
    kc = torch.randn(nb, bs, Hkv, D, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    q = torch.randn(T, H, D, device=DEV, dtype=BF16)
    cu = torch.tensor([0, T], device=DEV, dtype=torch.int32)
    sl = torch.tensor([T], device=DEV, dtype=torch.int32)
    ms = bench(lambda: tri.paged_attention(q, kc, vc, cu, sl, bt, D ** -0.5))
    qq, kk = q.transpose(0, 1)[None], torch.randn(1, H, T, D, device=DEV, dtype=BF16)
    base = bench(lambda: F.scaled_dot_product_attention(qq, kk, kk, is_causal=True))
    add("paged_attention", f"prefill T={T}", ms, 2 * 2 * H * T * T * D / 2, "TFLOP/s", base, "SDPA causal (contiguous)")

    # MLA absorbed decode, DeepSeek-V3.2 dims, dense and sparse (top-2048)
    Hm, R, P, bs = 128, 512, 64, 64
    for B, ctx in ((64, 4096), (8, 32768)):
        nb, bt = paged(B, ctx, bs)
        lat = torch.randn(nb, bs, R + P, device=DEV, dtype=BF16)
        qn = torch.randn(B, Hm, R, device=DEV, dtype=BF16)
        qp = torch.randn(B, Hm, P, device=DEV, dtype=BF16)
        cu = torch.arange(B + 1, device=DEV, dtype=torch.int32)
        sl = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
        ms = bench(lambda: tri.mla_attention(qn, qp, lat, cu, sl, bt, 0.1))  # noqa: B023
        add("mla_attention", f"dense decode B={B} ctx={ctx} H={Hm}", ms, B * ctx * (R + P) * 2, "TB/s")
        topk = torch.stack([torch.randperm(ctx, device=DEV)[:2048].sort().values for _ in range(B)]).int()
        ms = bench(lambda: tri.mla_attention(qn, qp, lat, cu, sl, bt, 0.1, topk))  # noqa: B023
        add("mla_attention", f"sparse decode B={B} ctx={ctx} topk=2048", ms, B * 2048 * (R + P) * 2, "TB/s")
        # indexer over the same context (Hi=64, Di=128)
        ikc = torch.randn(nb, bs, 128, device=DEV, dtype=BF16)
        iq = torch.randn(B, 64, 128, device=DEV, dtype=BF16)
        iw = torch.rand(B, 64, device=DEV)
        icos, isin = torch.rand(B, 32, device=DEV).cos(), torch.rand(B, 32, device=DEV).sin()  # query rope, 64 dims
        ms = bench(lambda: tri.indexer_topk(iq, iw, ikc, cu, sl, bt, 2048, icos, isin))  # noqa: B023
        add("indexer_topk", f"decode B={B} ctx={ctx}", ms, B * ctx * 128 * 2, "TB/s")

    # FP8 block linear vs bf16 cuBLAS and torch._scaled_mm with 1x128 / 128x128 block scales
    N, K = 7168, 2048 * 4
    w8 = (torch.randn(N, K, device=DEV) * 0.1).to(torch.float8_e4m3fn)
    s = torch.rand(N // 128, K // 128, device=DEV) + 0.5
    wb = w8.to(BF16)
    for M in (1, 128, 4096):
        x = torch.randn(M, K, device=DEV, dtype=BF16)
        ms = bench(lambda: tri.linear(x, w8, None, s))  # noqa: B023
        base = bench(lambda: F.linear(x, wb))  # noqa: B023
        add("linear_fp8_block", f"M={M} N={N} K={K}", ms, 2 * M * N * K, "TFLOP/s", base, "bf16 cuBLAS F.linear")
        try:
            xa = x.to(torch.float8_e4m3fn)
            sa = torch.ones(K // 128, M, device=DEV).t()
            sm = bench(lambda: torch._scaled_mm(xa, w8.t(), scale_a=sa, scale_b=s.t(), out_dtype=BF16))  # noqa: B023
            rows[-1]["scaled_mm_blockwise_ms"] = round(sm, 4)
        except Exception as e:  # noqa: BLE001 - report whatever torch says
            rows[-1]["scaled_mm_blockwise_error"] = str(e)[:200]

    # fused MoE (64 experts of DeepSeek-V3 width, top-8) vs a per-expert bf16 loop
    E, k, Hd, inter = 64, 8, 7168, 2048
    w13 = torch.empty(E, 2 * inter, Hd, device=DEV, dtype=BF16).normal_(0, 0.02)
    w2 = torch.empty(E, Hd, inter, device=DEV, dtype=BF16).normal_(0, 0.02)
    for T in (1, 64, 4096):
        x = torch.randn(T, Hd, device=DEV, dtype=BF16)
        ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)])
        tw = torch.rand(T, k, device=DEV)
        ms = bench(lambda: tri.fused_moe(x, w13, w2, tw, ids))  # noqa: B023
        touched = int(ids.unique().numel())
        add("fused_moe", f"T={T} E={E} k={k} H={Hd} I={inter}", ms, touched * 3 * inter * Hd * 2, "TB/s (weights)")

    x = torch.randn(4096, 7168, device=DEV, dtype=BF16)
    w = torch.ones(7168, device=DEV, dtype=BF16)
    ms = bench(lambda: tri.rms_norm(x, w, 1e-6, x))
    add("rms_norm+residual", "T=4096 H=7168", ms, 4096 * 7168 * 2 * 4, "TB/s")

    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
