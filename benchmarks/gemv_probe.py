"""FP8 W8A8 GEMV at decode M: the CUDA cluster-split-K kernel (ops/cuda/fp8_gemv.cu) against the Triton kernel.

Per DeepSeek-V3.2 weight shape: max error of both against ``torch_ref.linear_w8a8`` (float32), whether a row's
bits are the same at M = 1 and inside M = 13 (batch invariance), and microseconds per call at M = 1 / 8 from one
CUDA graph of back-to-back calls over rotating weight copies (> 2x L2), as GB/s of weight against the copy
bandwidth measured first in the same run.

    python3 -m benchmarks.gemv_probe [--only o_proj,q_b] [--variants auto,s1,s2,s4,s8]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks import common as C

SHAPES = {  # name: (N, K), one DeepSeek-V3.2 layer's FP8 linears
    "fused_qkv_a": (2304, 7168), "q_b": (24576, 1536), "wq_b": (8192, 1536), "o_proj": (7168, 16384),
    "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048), "dense_gate_up": (36864, 7168),
    "dense_down": (7168, 18432),
}


def _weights(N: int, K: int, copies: int, dev):
    out = []
    for i in range(copies):
        g = torch.Generator(device=dev).manual_seed(i)
        w = (torch.randn(N, K, device=dev, generator=g) * 0.5).to(torch.float8_e4m3fn)
        s = torch.rand(-(-N // 128), K // 128, device=dev, generator=g) * 1e-2 + 1e-3
        out.append((w, s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--variants", default="auto,s1,s2,s4,s8,d2,d8,early")
    ap.add_argument("--ms", default="1,8")
    args = ap.parse_args()
    from atomtool.serve.ops.cuda.fp8_gemv import fp8_gemv_w8a8, gemv_plan
    from atomtool.serve.ops.torch_ref import linear_w8a8
    from atomtool.serve.ops.triton.linear import fp8_block_linear

    dev = torch.device("cuda")
    print("env", C.env_info(dev), flush=True)
    copy_bw = C.measure_copy_bandwidth(dev)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for name in args.only.split(","):
        N, K = SHAPES[name]
        copies = max(2, -(-160_000_000 // (N * K)))
        ws = _weights(N, K, copies, dev)
        w0, s0 = ws[0]
        # correctness and invariance
        for M in (1, 13):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = linear_w8a8(x, w0, s0, (128, 128), True)
            y_cuda = fp8_gemv_w8a8(x, w0, s0, None, True).float()
            y_tri = fp8_block_linear(x, w0, s0, None, (128, 128), "dynamic_ue8m0").float()
            scale = ref.abs().max().item()
            one = fp8_gemv_w8a8(x[:1].contiguous(), w0, s0, None, True)
            print(f"[{name}] M={M}: max|cuda-ref|/max|ref| {(y_cuda - ref).abs().max().item() / scale:.2e}, "
                  f"triton {(y_tri - ref).abs().max().item() / scale:.2e}; row 0 same bits as alone: "
                  f"{torch.equal(one.float()[0], y_cuda[0])}", flush=True)
        for M in [int(m) for m in args.ms.split(",")]:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            variants = {"triton": None}
            for v in args.variants.split(","):
                kw = {}
                if v.startswith("s"):
                    kw["splits"] = int(v[1:])
                elif v.startswith("d"):
                    kw["depth"] = int(v[1:])
                elif v == "early":
                    kw["early_weights"] = True
                variants[v] = kw
            for vname, kw in variants.items():
                it = itertools.cycle(ws)
                if kw is None:
                    fn = lambda x=x, it=it: fp8_block_linear(x, *next(it), None, (128, 128), "dynamic_ue8m0")  # noqa: E731
                else:
                    fn = lambda x=x, it=it, kw=kw: fp8_gemv_w8a8(x, *next(it), None, True, **kw)  # noqa: E731
                try:
                    sec = C.seconds_per_call(fn, dev, calls=copies * max(1, 20 // copies), iters=10)
                except Exception as e:  # a variant that cannot launch (shared memory, cluster) is reported
                    print(f"[{name}] M={M} {vname}: failed: {type(e).__name__}: {e}", flush=True)
                    continue
                gbps = N * K / sec / 1e9
                plan = gemv_plan(N, K, kw.get("splits")) if kw is not None else ""
                rows.append(dict(shape=name, M=M, variant=vname, us=round(sec * 1e6, 2), GBps=round(gbps),
                                 of_copy=round(gbps * 1e9 / copy_bw, 3), plan=str(plan)))
                print(rows[-1], flush=True)
        del ws
        torch.cuda.empty_cache()
    C.print_table("FP8 GEMV: CUDA cluster split-K vs Triton", rows, ["shape", "M", "variant", "us", "GBps", "of_copy", "plan"])


if __name__ == "__main__":
    main()
