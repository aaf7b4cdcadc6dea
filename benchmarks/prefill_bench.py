"""Long-prompt prefill: tokens/s and achieved TFLOP/s against the measured matmul ceiling (benchmark 4).

One prompt of 8k or 32k tokens, computed in a single chunk through ``ModelRunner.prepare`` /
``ModelRunner.run`` (eager: prefill is not graphed), on

- ``dsv32``: the DeepSeek-V3.2-shaped FP8 model (3 dense + ``--moe-layers`` MoE layers, real widths);
- ``qwen3``: the Qwen3-0.6B-shaped bf16 model.

FLOPs counted (multiply-add = 2): every weight matrix a token passes through (MoE: the shared expert and
``num_experts_per_tok`` routed experts; MLA in the absorbed form, whose per-token cost is the kv_b_proj
matrix), the lm_head for the last token only, and attention: causal dense (Qwen3: QK^T and PV over the
prefix) or DSA (MLA over min(position + 1, index_topk) selected keys with (kv_lora_rank + rope) + kv_lora_rank
per key and head, plus the indexer's ``index_n_heads x index_head_dim`` dot with every earlier key). The
ceiling is the bf16 ``torch.mm`` rate measured in the run (the FP8 weights are widened to bf16 in the kernel,
so bf16 is the relevant unit).

Run: ``python -m benchmarks.prefill_bench [--model dsv32|qwen3|all] [--smoke]``.
"""

from __future__ import annotations

import argparse
import gc

import torch

from benchmarks import common as C


def prefill_flops(model, cfg: dict, T: int) -> int:
    """Multiply-add FLOPs (x2) of a T-token prefill from position 0 (see the module docstring)."""
    E = int(cfg.get("n_routed_experts") or 0)
    k = int(cfg.get("num_experts_per_tok") or 0)
    per_token = 0
    lm_head = 0
    for name, p in model.named_parameters():
        if not name.endswith(".weight") or p.dim() < 2 or name == "model.embed_tokens.weight":
            if name == "model.embed_tokens.weight" and getattr(model, "tied", False):
                lm_head = p.numel()
            continue
        if ".mlp.experts." in name:
            per_token += p.numel() * k // E
        elif name.startswith("lm_head"):
            lm_head = p.numel()
        elif ".gate.weight" in name and ".mlp." in name and p.shape[0] == E:
            per_token += p.numel()
        else:
            per_token += p.numel()
    flops = 2 * T * per_token + 2 * lm_head
    L = cfg["num_hidden_layers"]
    if "kv_lora_rank" in cfg:
        topk = int(cfg.get("index_topk") or T)
        keys = topk * (topk + 1) // 2 + (T - topk) * topk if T > topk else T * (T + 1) // 2
        causal = T * (T + 1) // 2
        per_key = cfg["num_attention_heads"] * 2 * (2 * cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        idx = 2 * int(cfg.get("index_n_heads", 0)) * int(cfg.get("index_head_dim", 0))
        flops += L * (keys * per_key + causal * idx)
    else:
        D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        flops += L * (T * (T + 1) // 2) * cfg["num_attention_heads"] * 2 * 2 * D
    return flops


def run_model(name: str, args, device: torch.device, ceil: dict) -> list[dict]:
    smoke = args.smoke
    contexts = [int(c) for c in args.contexts.split(",")]
    if smoke:
        contexts = [128, 256]
    if name == "dsv32":
        raw = C.dsv32_config(3 + args.moe_layers, 3, smoke=smoke)
        model, cfg = C.build_random_model(raw, device, fp8=True, fp8_activations=args.fp8_activations)
        act = f"W8A8 {model.act_quant}" if model.act_quant else "weight-only"
        label = f"DeepSeek-V3.2-shaped FP8 ({act}), 3 dense + {args.moe_layers} MoE layers"
    else:
        model, cfg = C.build_random_model(C.qwen3_config(smoke=smoke), device)
        label = "Qwen3-0.6B-shaped bf16"
    bs = 16
    max_len = max(contexts) + bs
    runner, pool = C.make_runner(model, device, num_blocks=max_len // bs + 2, block_size=bs,
                                 max_model_len=max_len, graph_sizes=None)
    rows = []
    for T in contexts:
        seqs = C.fake_sequences(1, T, bs, cfg["vocab_size"], new_tokens=T, seed=T)
        sched = C.scheduler_output(seqs, new_tokens=T)
        try:
            t = C.time_fn(lambda sched=sched: runner.run(runner.prepare(sched)), device, warmup=1,
                          iters=args.iters)["median_s"]
        except torch.OutOfMemoryError as exc:
            rows.append(C.record("prefill", model=name, tokens=T, error=f"OOM: {str(exc)[:200]}"))
            torch.cuda.empty_cache()
            continue
        flops = prefill_flops(model, cfg, T)
        rows.append(C.record("prefill", model=name, label=label, act_quant=getattr(model, "act_quant", None),
                             tokens=T, time_s=t, tok_s=T / t,
                             TFLOPs=flops / t / 1e12, flops_T=flops / 1e12,
                             matmul_frac=flops / t / ceil["matmul_flops"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all", choices=["dsv32", "qwen3", "all"])
    ap.add_argument("--smoke", action="store_true", help="CPU toy sizes")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--fp8-activations", default="auto", choices=["auto", "dynamic", "weight-only"],
                    help="FP8 linears and experts of the dsv32 model: W8A8 or weight-only")
    args = ap.parse_args(argv)
    device = C.pick_device(args.smoke)
    print("env", C.env_info(device), flush=True)
    ceil = C.load_or_measure_ceilings(device)
    rows = []
    for name in (["dsv32", "qwen3"] if args.model == "all" else [args.model]):
        rows += run_model(name, args, device, ceil)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    C.print_table("prefill", rows, ["model", "tokens", "time_s", "tok_s", "TFLOPs", "matmul_frac", "error"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
