"""Sweep the launch configurations of the FP8 block linear and the fused-MoE grouped GEMM at decode sizes.

Issue 7: at batch 1 the DeepSeek-V3.2-shaped decode step spends ~40% of its time in these two kernels, at
2.2-2.7 TB/s. Both use one launch configuration for every batch size (batch invariance), so the choice is a
constant; this benchmark measures candidates on the weights of the real model dimensions and prints each
one's achieved bandwidth against the device copy bandwidth measured in the same run.

- FP8 linear: every FP8 weight of one DeepSeek-V3.2 decode step at M = 1 (fused q_a/kv_a/indexer rows,
  q_b, indexer q_b, o_proj, dense gate_up/down, shared expert), weighted by how often a step runs it
  (3 dense + 8 MoE layers, as ``decode_bench``), each call replayed from a CUDA graph; several weight copies
  are rotated so no call is served from L2. Metric: step-weighted time, bytes / time.
- Fused MoE at T = 1 and 8 (routing random, distinct experts per call), the routed experts of one layer
  (E = 256, hidden 7168, intermediate 2048, FP8 128x128 blocks).
- Sparse MLA decode (split-KV kernel + merge fused with the W_UV product) at batch 1, 8 and 64: 128 heads,
  kv_lora_rank 512, v_head_dim 128, top-k 2048; first the unfused default (merge kernel + cuBLAS batched GEMM).

    python -m benchmarks.kernel_sweep [--quick] [--smoke] [--only linear|moe|mla]

Prints one table per kernel and records rows in ``$BENCH_OUT/results.jsonl`` (bench ``kernel_sweep``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import os
import time

import torch

from benchmarks import common as C

# (name, N, K, calls per step) for the DeepSeek-V3.2 dims: 11 attention layers, 3 dense MLPs, 8 shared experts
DSV32_LINEARS = [
    ("fused_qkv_a (q_a+kv_a+index k+weights)", 1536 + 576 + 128 + 64, 7168, 11),
    ("q_b_proj", 128 * 192, 1536, 11),
    ("indexer wq_b", 64 * 128, 1536, 11),
    ("o_proj", 7168, 128 * 128, 11),
    ("dense gate_up", 2 * 18432, 7168, 3),
    ("dense down", 7168, 18432, 3),
    ("shared gate_up", 2 * 2048, 7168, 8),
    ("shared down", 7168, 2048, 8),
]


def _fp8_weight(N: int, K: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(N, K, device=device, generator=gen) * 0.05).to(torch.float8_e4m3fn)
    s = torch.rand((N + 127) // 128, (K + 127) // 128, device=device, generator=gen) * 0.01 + 0.001
    return w, s


def sweep_linear(device, configs, shapes, copy_bw: float, act_quant: str | None = None) -> list[dict]:
    L = importlib.import_module("atomtool.serve.ops.triton.linear")  # the package re-exports `linear` the op

    gen = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, N, K, _ in shapes:
        n_copies = max(1, min(8, (256 << 20) // (N * K) + 1))  # > L2 (50 MB on an H200) per rotation
        weights[name] = [_fp8_weight(N, K, device, gen) for _ in range(n_copies)]
    x = {K: torch.randn(1, K, device=device, dtype=torch.bfloat16, generator=gen) for _, _, K, _ in shapes}
    step_bytes = sum(N * K * c for _, N, K, c in shapes)
    rows = []
    attr = "FP8_LINEAR_W8A8_CONFIG" if act_quant else "FP8_LINEAR_CONFIG"
    default = getattr(L, attr)
    try:
        for cfg in configs:
            setattr(L, attr, cfg)
            total = 0.0
            per = {}
            for name, _n, K, count in shapes:
                ws = weights[name]
                i = [0]

                def call(ws=ws, K=K, i=i):
                    w, s = ws[i[0] % len(ws)]
                    i[0] += 1
                    L.fp8_block_linear(x[K], w, s, act_quant=act_quant)

                t = C.seconds_per_call(call, device)
                per[name] = t
                total += t * count
            # W8A8 always runs the swapped tile (linear.py), whatever the config says: record what ran
            ran = vars(cfg) | ({"swap_ab": True} if act_quant else {})
            row = C.record("kernel_sweep", kernel="fp8_linear", M=1, act_quant=act_quant, **ran,
                           step_ms=total * 1e3,
                           step_GBps=step_bytes / total / 1e9, of_copy=step_bytes / total / copy_bw,
                           per_us={k: round(v * 1e6, 2) for k, v in per.items()})
            rows.append(row)
            print(f"  {cfg}: {total * 1e3:.3f} ms/step, {step_bytes / total / 1e9:,.0f} GB/s "
                  f"({step_bytes / total / copy_bw:.0%} of copy)", flush=True)
    finally:
        setattr(L, attr, default)
    return rows


def sweep_moe(device, configs, T_list, copy_bw: float, smoke: bool, act_quant: str | None = None) -> list[dict]:
    Mo = importlib.import_module("atomtool.serve.ops.triton.moe")

    E, H, inter, k = (256, 7168, 2048, 8) if not smoke else (16, 256, 128, 4)
    gen = torch.Generator(device=device).manual_seed(1)
    w13 = (torch.randn(E, 2 * inter, H, device=device, generator=gen) * 0.05).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, inter, device=device, generator=gen) * 0.05).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 2 * inter // 128, H // 128, device=device, generator=gen) * 0.01
    s2 = torch.rand(E, H // 128, inter // 128, device=device, generator=gen) * 0.01
    rows = []
    attr = "MOE_GEMM_W8A8_CONFIG" if act_quant else "MOE_GEMM_CONFIG"
    default = getattr(Mo, attr)
    try:
        for T in T_list:
            x = torch.randn(T, H, device=device, dtype=torch.bfloat16, generator=gen)
            routes = [torch.stack([torch.randperm(E, device=device, generator=gen)[:k] for _ in range(T)])
                      for _ in range(16)]
            weights = torch.rand(T, k, device=device, generator=gen)
            distinct = sum(len(torch.unique(r)) for r in routes) / len(routes)
            nbytes = distinct * (w13[0].numel() + w2[0].numel())
            for cfg in configs:
                setattr(Mo, attr, cfg)
                i = [0]

                def call(x=x, routes=routes, weights=weights, i=i):
                    ids = routes[i[0] % len(routes)]
                    i[0] += 1
                    Mo.fused_moe(x, w13, w2, weights, ids, s13, s2, act_quant=act_quant)

                t = C.seconds_per_call(call, device, calls=16)
                row = C.record("kernel_sweep", kernel="fused_moe_fp8", T=T, act_quant=act_quant, **vars(cfg),
                               us=t * 1e6,
                               GBps=nbytes / t / 1e9, of_copy=nbytes / t / copy_bw, distinct_experts=distinct)
                rows.append(row)
                print(f"  T={T} {cfg}: {t * 1e6:.1f} us, {nbytes / t / 1e9:,.0f} GB/s "
                      f"({nbytes / t / copy_bw:.0%} of copy)", flush=True)
    finally:
        setattr(Mo, attr, default)
    return rows


def sweep_mla(device, candidates, copy_bw: float, smoke: bool) -> list[dict]:
    """Sparse MLA decode (split-KV + merge with W_UV) at batch 1, 8 and 64: 128 heads, kv_lora_rank 512, rope
    64, v_head_dim 128, top-k 2048 of a 4096-token context (smoke: toy sizes). ``candidates``:
    (MlaDecodeConfig, SPLIT_CHUNK_SPARSE). The first row of each batch is the unfused default (split-KV,
    merge kernel, then the W_UV product as cuBLAS's batched GEMM), the engine's path before the fusion."""
    mla = importlib.import_module("atomtool.serve.ops.triton.mla")
    from atomtool.serve.ops.torch_ref_mla import mla_output_uv

    H, R, P, K, ctx, bs, dv = (128, 512, 64, 2048, 4096, 64, 128) if not smoke else (16, 256, 32, 64, 200, 16, 32)
    gen = torch.Generator(device=device).manual_seed(2)
    rows = []
    default = (mla.MLA_DECODE_CONFIG, mla.SPLIT_CHUNK_SPARSE)
    w_uv = torch.randn(H, dv, R, device=device, dtype=torch.bfloat16, generator=gen) / R ** 0.5
    for B in (1, 8) if smoke else (1, 8, 64):
        blocks = B * (ctx // bs + 1)
        latent = torch.randn(blocks, bs, R + P, device=device, dtype=torch.bfloat16, generator=gen)
        bt = torch.randperm(blocks, device=device, generator=gen).to(torch.int32).view(B, -1)
        seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        cu = torch.arange(B + 1, dtype=torch.int32, device=device)
        topk = torch.stack([torch.randperm(ctx, device=device, generator=gen)[:K].sort().values
                            for _ in range(B)]).to(torch.int32)
        qn = torch.randn(B, H, R, device=device, dtype=torch.bfloat16, generator=gen)
        qp = torch.randn(B, H, P, device=device, dtype=torch.bfloat16, generator=gen)
        nbytes = B * K * (R + P) * 2
        args = (qn, qp, latent, cu, seq_lens, bt, 0.1, topk)
        t = C.seconds_per_call(lambda a=args: mla_output_uv(mla.mla_attention(*a), w_uv), device)
        rows.append(C.record("kernel_sweep", kernel="mla_decode", B=B, chunk=default[1], **vars(default[0]),
                             fused_uv=False, us=t * 1e6, GBps=nbytes / t / 1e9))
        print(f"  B={B} unfused default (merge + cuBLAS W_UV): {t * 1e6:.1f} us", flush=True)
        for split in ("cuda", "triton"):  # the engine's path with the CUDA split-KV kernel (mla_split.cu) and without
            os.environ["ATOMTOOL_CUDA_MLA_SPLIT"] = "1" if split == "cuda" else "0"
            try:
                t = C.seconds_per_call(lambda a=args: mla.mla_attention(*a, w_uv=w_uv), device)
            finally:
                os.environ.pop("ATOMTOOL_CUDA_MLA_SPLIT")
            rows.append(C.record("kernel_sweep", kernel="mla_decode", B=B, chunk=default[1], **vars(default[0]),
                                 fused_uv=True, split=split, us=t * 1e6, GBps=nbytes / t / 1e9))
            print(f"  B={B} default, {split} split-KV kernel: {t * 1e6:.1f} us", flush=True)
        try:
            for cfg, chunk in candidates:
                mla.MLA_DECODE_CONFIG, mla.SPLIT_CHUNK_SPARSE = cfg, chunk
                try:
                    t = C.seconds_per_call(lambda a=args: mla.mla_attention(*a, w_uv=w_uv), device)
                except Exception as e:  # a tile that does not fit shared memory / registers
                    print(f"  B={B} {cfg} chunk={chunk}: failed ({type(e).__name__})", flush=True)
                    continue
                rows.append(C.record("kernel_sweep", kernel="mla_decode", B=B, chunk=chunk, **vars(cfg), fused_uv=True,
                                     us=t * 1e6, GBps=nbytes / t / 1e9))
                print(f"  B={B} {cfg} chunk={chunk}: {t * 1e6:.1f} us", flush=True)
        finally:
            mla.MLA_DECODE_CONFIG, mla.SPLIT_CHUNK_SPARSE = default
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU toy sizes under the Triton interpreter")
    ap.add_argument("--quick", action="store_true", help="a few candidates only")
    ap.add_argument("--only", choices=["linear", "moe", "mla"], default=None)
    ap.add_argument("--act-quant", choices=["dynamic", "dynamic_ue8m0"], default=None,
                    help="sweep the W8A8 FP8 linear and MoE kernels (activations quantized per token) instead of "
                         "weight-only (MLA has no FP8 operands: --only mla ignores it)")
    args = ap.parse_args(argv)
    device = C.pick_device(args.smoke)
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("kernel_sweep needs a CUDA device (or --smoke)")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from atomtool.serve.ops.triton.linear import FP8_LINEAR_W8A8_CONFIG, Fp8LinearConfig
    from atomtool.serve.ops.triton.mla import MlaDecodeConfig
    from atomtool.serve.ops.triton.moe import MOE_GEMM_W8A8_CONFIG, MoeGemmConfig

    print("env", C.env_info(device))
    copy_bw = C.load_or_measure_ceilings(device)["copy_bw_Bps"]
    print(f"copy bandwidth {copy_bw / 1e9:,.0f} GB/s")
    t0 = time.time()
    if args.smoke:
        lin = [Fp8LinearConfig(), Fp8LinearConfig(block_n=64, split_target=256, swap_ab=True)]
        moe = [MoeGemmConfig(), MoeGemmConfig(swap_ab=False)]
        shapes = [("small", 256, 512, 2), ("tall", 512, 256, 1)]
        T_list = [1]
    else:
        shapes = DSV32_LINEARS
        T_list = [1, 8]
        if args.act_quant and args.quick:  # the W8A8 defaults, the weight-only ones, and the pointer loads
            lin = [FP8_LINEAR_W8A8_CONFIG, Fp8LinearConfig(), dataclasses.replace(FP8_LINEAR_W8A8_CONFIG, tma=False)]
            moe = [MOE_GEMM_W8A8_CONFIG, MoeGemmConfig()]
        elif args.act_quant:  # W8A8 always runs the swapped (wgmma) tile
            lin = [Fp8LinearConfig(block_n=bn, split_target=tg, num_warps=nw, num_stages=ns)
                   for bn, tg, ns, nw in itertools.product((64, 128), (256, 512, 1024), (3, 4, 6), (4,))]
            lin += [Fp8LinearConfig(block_n=128, num_warps=8), Fp8LinearConfig(block_n=256, num_warps=8),
                    Fp8LinearConfig(tma=False)]
            moe = [MoeGemmConfig(block_n=bn, num_warps=nw, num_stages=ns)
                   for bn, ns, nw in itertools.product((64, 128), (3, 4, 6), (4, 8))]
        elif args.quick:
            lin = [Fp8LinearConfig(tma=False), Fp8LinearConfig(), Fp8LinearConfig(block_n=128),
                   Fp8LinearConfig(block_n=128, num_warps=8), Fp8LinearConfig(block_n=128, num_stages=4),
                   Fp8LinearConfig(block_n=128, split_target=1024), Fp8LinearConfig(block_n=256),
                   Fp8LinearConfig(block_n=256, num_warps=8)]
            moe = [MoeGemmConfig(), MoeGemmConfig(num_stages=4), MoeGemmConfig(swap_ab=False)]
        else:
            lin = [Fp8LinearConfig(block_n=bn, split_target=tg, num_warps=4, num_stages=ns, swap_ab=sw)
                   for sw, bn, tg, ns in itertools.product((False, True), (32, 64, 128), (528, 1056), (3, 4))
                   if not (sw and bn == 32)]
            moe = [MoeGemmConfig(block_n=bn, num_warps=4, num_stages=ns, swap_ab=sw)
                   for sw, bn, ns in itertools.product((False, True), (32, 64, 128), (3, 4))
                   if not (sw and bn == 32)]
    if args.smoke:
        mla_c = [(MlaDecodeConfig(), 128), (MlaDecodeConfig(block_h=32, block_n=16), 64)]
    else:
        mla_c = [(MlaDecodeConfig(block_h=bh, block_n=bn, num_warps=nw), ch)
                 for bh, bn, nw, ch in itertools.product((16, 32, 64), (32, 64), (4, 8), (64, 128))]
    results = []
    if args.only in (None, "linear"):
        print(f"\n== FP8 linear at M=1, {len(lin)} configs")
        results += sweep_linear(device, lin, shapes, copy_bw, args.act_quant)
        best = min((r for r in results if r["kernel"] == "fp8_linear"), key=lambda r: r["step_ms"])
        print(f"best linear: {best}")
    if args.only in (None, "moe"):
        print(f"\n== fused MoE FP8, {len(moe)} configs")
        mo = sweep_moe(device, moe, T_list, copy_bw, args.smoke, args.act_quant)
        for T in T_list:
            best = min((r for r in mo if r["T"] == T), key=lambda r: r["us"])
            print(f"best moe T={T}: {best}")
        results += mo
    if args.only in (None, "mla"):
        print(f"\n== sparse MLA decode, {len(mla_c)} configs")
        ml = sweep_mla(device, mla_c, copy_bw, args.smoke)
        for B in (1, 8, 64):
            fused = [r for r in ml if r["B"] == B and r["fused_uv"]]
            if fused:
                print(f"best mla B={B} (fused merge + W_UV): {min(fused, key=lambda r: r['us'])}")
        results += ml
    print(f"sweep done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
