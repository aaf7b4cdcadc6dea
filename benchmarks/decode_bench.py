"""Decode step time against the memory roofline (issue 7, benchmark 2).

Models (random weights created on the device through our engine classes, no checkpoint):

- ``dsv32``: DeepSeek-V3.2-shaped, FP8 block weights, the published layer dims (hidden 7168, 128 heads,
  q_lora_rank 1536, kv_lora_rank 512, rope 64, 256 routed experts of 2048 + 1 shared, 8 active, indexer
  64 heads x 128, index_topk 2048), 3 dense-MLP layers + as many MoE layers as fit beside the KV pool.
- ``qwen3``: Qwen3-0.6B-shaped, bf16.

For each (context, batch) the sequences' KV contexts are faked (disjoint blocks filled with random values),
then one decode step runs through the engine's ``ModelRunner.prepare`` + ``ModelRunner.run`` with decode CUDA
graphs (``DecodeCudaGraphs``, the runner's own graph path). Reported per point:

- ``step_ms``: host-inclusive step (prepare + graph replay + logits copy, synchronised), median;
- ``gpu_ms``: the graph replay alone, CUDA events, median;
- ``floor_ms``: max(bytes / copy bandwidth, FLOPs / matmul rate), both ceilings measured in this run. Bytes
  = every weight the step touches (FP8 bytes + scales; for MoE layers the shared expert, the router and the
  *distinct routed experts this batch selected*, counted from the step's own routing) + KV read (DSA: the
  top-k latent rows, min(ctx, index_topk) x (kv_lora_rank + rope) per sequence and layer, plus every index
  key, ctx x index_head_dim) + lm_head. Dense attention (Qwen3): every K and V row;
- ``roofline_frac`` = floor_ms / gpu_ms (1.0 = at the roofline), and the same against step_ms.

Run: ``python -m benchmarks.decode_bench [--model dsv32|qwen3|all] [--smoke]``.
"""

from __future__ import annotations

import argparse
import gc
import math

import torch

from atomtool.serve.engine.cuda_graphs import pick_context
from benchmarks import common as C
from benchmarks import trace_report


def _distinct_experts(model, runner, batch) -> dict[int, int]:
    """Layer index -> number of distinct routed experts this batch selects (one eager forward with hooks)."""
    from atomtool.serve.layers.moe import DeepseekMoE
    from atomtool.serve.ops import get_op

    counts: dict[int, int] = {}
    hooks = []
    for i, layer in enumerate(getattr(model.model, "layers", [])):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, DeepseekMoE):
            continue

        def hook(mod, args, _out, i=i):
            x = args[0]
            _, ids = get_op("grouped_topk", x.device)(
                mod.gate(x), mod.gate.e_score_correction_bias, mod.top_k, mod.n_group, mod.topk_group,
                mod.norm_topk_prob, mod.routed_scaling_factor)
            counts[i] = int(torch.unique(ids).numel())

        hooks.append(mlp.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            runner._forward_logits(batch)
    finally:
        for h in hooks:
            h.remove()
    return counts


def step_bytes_flops(model, cfg: dict, B: int, ctx: int, distinct: dict[int, int]) -> tuple[int, int, dict]:
    """(bytes, FLOPs, breakdown) one decode step of B sequences at context ``ctx`` must read / do at least."""
    from atomtool.inspect.dsa import FULL

    E = int(cfg.get("n_routed_experts") or 0)
    H = cfg["hidden_size"]
    w_bytes = 0
    w_params_per_token = 0
    expert_bytes = 0
    for name, p in model.named_parameters():  # tied aliases appear once
        nb = C.param_bytes(p)
        if ".mlp.experts." in name:
            layer = int(name.split(".")[2])
            used = distinct.get(layer, 0)
            expert_bytes += nb * used // E
            if name.endswith(".weight"):
                w_params_per_token += p.numel() * int(cfg["num_experts_per_tok"]) // E
        elif name == "model.embed_tokens.weight":
            w_bytes += B * H * p.element_size()
            if getattr(model, "tied", False) or getattr(model, "tie_word_embeddings", False):
                w_bytes += nb  # the tied lm_head reads the whole table
                w_params_per_token += p.numel()
        elif name.endswith(".weight") and p.dim() == 2:
            w_bytes += nb
            w_params_per_token += p.numel()
        else:
            w_bytes += nb
    kv_bytes = 0
    attn_flops = 0
    L = cfg["num_hidden_layers"]
    if "kv_lora_rank" in cfg:
        lat = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        el = model.dtype.itemsize if hasattr(model.dtype, "itemsize") else 2
        roles = getattr(model, "roles", ["dense"] * L)
        topk = int(cfg.get("index_topk") or ctx)
        Hq = cfg["num_attention_heads"]
        for role in roles:
            keys = min(ctx, topk) if role != "dense" else ctx
            kv_bytes += B * keys * lat * el
            attn_flops += B * Hq * 2 * (lat + cfg["kv_lora_rank"]) * keys
            if role == FULL:
                kv_bytes += B * ctx * int(cfg["index_head_dim"]) * el
                attn_flops += B * 2 * int(cfg["index_n_heads"]) * int(cfg["index_head_dim"]) * ctx
    else:
        hkv = cfg["num_key_value_heads"]
        D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
        kv_bytes = L * B * ctx * 2 * hkv * D * 2
        attn_flops = L * B * cfg["num_attention_heads"] * 2 * 2 * D * ctx
    flops = 2 * B * w_params_per_token + attn_flops
    total = w_bytes + expert_bytes + kv_bytes
    return total, flops, {"weight_GB": (w_bytes + expert_bytes) / 1e9, "kv_GB": kv_bytes / 1e9,
                          "expert_GB": expert_bytes / 1e9}


def choose_moe_layers(device: torch.device, max_tokens: int, smoke: bool) -> int:
    """MoE layers that fit beside 3 dense layers and a KV pool of ``max_tokens`` tokens (>= 1)."""
    if smoke or device.type != "cuda":
        return 2
    free, _ = torch.cuda.mem_get_info(device)
    gb = 1e9
    fixed = 3 * 0.62 * gb + 3.8 * gb  # dense layers (attn + 18432 MLP, FP8) + embed + lm_head (bf16)
    kv_layer = max_tokens * (576 + 128) * 2
    per_moe = 11.6 * gb + kv_layer  # 256 x 2048 experts FP8 + attn, and its KV
    reserve = 14 * gb  # activations, graphs, eager routing pass, allocator slack
    return max(1, int((free - fixed - 3 * kv_layer - reserve) // per_moe))


def run_model(name: str, args, device: torch.device, ceil: dict) -> list[dict]:
    smoke = args.smoke
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if smoke:
        contexts = [min(c, 256) for c in contexts][:1] + ([200] if len(contexts) > 1 else [])
        batches = [min(b, 4) for b in batches]
        batches = sorted(set(batches))
    bs = 16 if not smoke else 16
    max_tokens_needed = max(batches) * (max(contexts) + bs)
    if name == "dsv32":
        n_moe = args.moe_layers or choose_moe_layers(device, max_tokens_needed, smoke)
        args.moe_layers_used = n_moe
        raw = C.dsv32_config(3 + n_moe, 3, smoke=smoke)
        model, cfg = C.build_random_model(raw, device, fp8=True, fp8_activations=args.fp8_activations)
        act = f"W8A8 {model.act_quant}" if model.act_quant else "weight-only"
        label = f"DeepSeek-V3.2-shaped FP8 ({act}), {3 + n_moe} layers (3 dense + {n_moe} MoE)"
    else:
        raw = C.qwen3_config(smoke=smoke)
        model, cfg = C.build_random_model(raw, device)
        label = "Qwen3-0.6B-shaped bf16, 28 layers" if not smoke else "Qwen3 toy"
    C.sync(device)
    planes = model.kv_plane_specs()
    from atomtool.serve.engine.kv_cache import bytes_per_block

    per_block = bytes_per_block(planes, bs)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free - (10 << 30)
    else:
        budget = 1 << 30
    cap_blocks = max(1, budget // per_block)
    need_blocks = {(B, c): B * math.ceil(c / bs) for B in batches for c in contexts}
    fits = [n for n in need_blocks.values() if n + 1 <= cap_blocks]
    num_blocks = int(max(fits) + 1 if fits else cap_blocks)  # the largest point that fits; others are skipped
    print(f"[{name}] {label}; KV pool {num_blocks} blocks x {bs} tokens = {num_blocks * per_block / 1e9:.1f} GB",
          flush=True)
    max_len = max(contexts) + bs
    runner, pool = C.make_runner(model, device, num_blocks=num_blocks, block_size=bs, max_model_len=max_len,
                                 graph_sizes=batches)
    C.fill_cache_random_(pool)
    rows = []
    for ctx in contexts:
        for B in batches:
            if need_blocks[(B, ctx)] > num_blocks:
                r = C.record("decode", model=name, batch=B, ctx=ctx, skipped=(
                    f"KV for {B}x{ctx} tokens needs {need_blocks[(B, ctx)] * per_block / 1e9:.0f} GB, "
                    f"pool holds {num_blocks * per_block / 1e9:.0f} GB"))
                rows.append(r)
                continue
            seqs = C.fake_sequences(B, ctx, bs, cfg["vocab_size"], seed=B * 7 + ctx)
            sched = C.scheduler_output(seqs)
            batch = runner.prepare(sched)
            distinct = _distinct_experts(model, runner, batch) if name == "dsv32" else {}
            nbytes, flops, parts = step_bytes_flops(model, cfg, B, ctx, distinct)
            t_mem = nbytes / ceil["copy_bw_Bps"]
            t_cmp = flops / ceil["matmul_flops"]
            floor = max(t_mem, t_cmp)
            graphed = runner.graphs is not None and runner.graphs.can_run(batch)
            one = C.time_fn(lambda batch=batch: runner.run(batch), device, warmup=1, iters=1)["median_s"]
            iters = max(3, min(args.iters, int(args.point_budget_s / 3 / max(one, 1e-6))))  # bound slow points
            step = C.time_fn(lambda sched=sched: runner.run(runner.prepare(sched)), device, warmup=1,
                             iters=iters)
            if graphed:
                runner.run(batch)  # loads the static inputs
                gsize = next(s for s in runner.graphs.sizes if s >= B)
                gctx = pick_context(runner.graphs.contexts, batch.seq_lens_cpu, gsize)
                gpu = C.time_gpu(runner.graphs.graphs[gctx, gsize].replay, device, warmup=1, iters=iters * 2)
            else:
                gpu = C.time_gpu(lambda batch=batch: runner.run(batch), device, warmup=1, iters=iters)
            r = C.record("decode", model=name, label=label, batch=B, ctx=ctx, graphs=graphed,
                         act_quant=getattr(model, "act_quant", None),
                         step_ms=step["median_s"] * 1e3, gpu_ms=gpu * 1e3, floor_ms=floor * 1e3,
                         bound="memory" if t_mem >= t_cmp else "compute", bytes_GB=nbytes / 1e9,
                         flops_G=flops / 1e9, roofline_frac=floor / gpu, roofline_frac_step=floor / step["median_s"],
                         achieved_GBps=nbytes / gpu / 1e9, iters=iters, distinct_experts=(
                             round(sum(distinct.values()) / len(distinct), 1) if distinct else None), **parts)
            rows.append(r)
    if args.profile:
        if device.type == "cuda":
            profile_step(name, runner, cfg, bs)
        else:
            print(f"[{name}] --profile: skipped, it needs a CUDA device (torch.profiler's GPU kernels)", flush=True)
    return rows


def profile_step(name: str, runner, cfg: dict, bs: int) -> None:
    """torch.profiler over 3 graph replays and one eager step at batch 1 and context 4096 (or as long as the
    runner's KV pool and block tables allow): top kernels by GPU time, and for the graph replays the chrome
    trace plus :mod:`benchmarks.trace_report`'s exposed-time report."""
    from torch.profiler import ProfilerActivity, profile

    capacity = min(runner.kv_pool.num_blocks, runner.block_tables.table.shape[1]) * bs
    ctx = min(4096, capacity)
    seqs = C.fake_sequences(1, ctx, bs, cfg["vocab_size"], seed=1)
    sched = C.scheduler_output(seqs)
    batch = runner.prepare(sched)
    for mode in ("graph", "eager"):
        if mode == "graph" and runner.graphs is None:
            continue
        fn = (lambda: runner.run(runner.prepare(sched))) if mode == "graph" else (
            lambda: runner._forward_logits(batch))
        with torch.inference_mode():
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
        print(f"\n== profile {name} decode batch 1 ctx {ctx} ({mode}, 3 steps)")
        table = prof.key_averages()
        print(table.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
        full = table.table(sort_by="self_cuda_time_total", row_limit=-1, max_name_column_width=90)
        (C.out_dir() / f"profile_{name}_{mode}.txt").write_text(full)
        if mode == "graph":  # per-stream timeline (the side stream's overlap), for chrome://tracing / perfetto
            trace = C.out_dir() / f"trace_{name}_{mode}.json"
            prof.export_chrome_trace(str(trace))
            # exposed time per kernel and one layer's timeline; in the DSA model both residual norms of a
            # layer are add_rms_norm (they sum the split-K / expert-slot planes), so a layer spans two markers
            text = trace_report.report(trace, every=2 if name == "dsv32" else 1)
            (C.out_dir() / f"trace_report_{name}.txt").write_text(text + "\n")
            print(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all", choices=["dsv32", "qwen3", "all"])
    ap.add_argument("--smoke", action="store_true", help="CPU toy sizes")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--moe-layers", type=int, default=0, help="MoE layers of the dsv32 model (0: as many as fit)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--point-budget-s", type=float, default=6.0, help="rough seconds of timing per point")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of a batch-1 step")
    ap.add_argument("--fp8-activations", default="auto", choices=["auto", "dynamic", "weight-only"],
                    help="FP8 linears and experts: W8A8 or weight-only (as atomtool serve --fp8-activations)")
    args = ap.parse_args(argv)
    device = C.pick_device(args.smoke)
    torch.manual_seed(0)
    print("env", C.env_info(device), flush=True)
    ceil = C.load_or_measure_ceilings(device)
    print(f"ceilings: copy {ceil['copy_bw_Bps'] / 1e9:.0f} GB/s, matmul {ceil['matmul_flops'] / 1e12:.3g} TFLOP/s",
          flush=True)
    rows = []
    for name in (["dsv32", "qwen3"] if args.model == "all" else [args.model]):
        retry = False
        try:
            rows += run_model(name, args, device, ceil)
        except torch.OutOfMemoryError as exc:  # the fit estimate was wrong: once more with 3 MoE layers fewer
            if name != "dsv32" or getattr(args, "moe_layers_used", 1) <= 1:
                raise
            print(f"[{name}] out of memory with {args.moe_layers_used} MoE layers ({exc}); retrying", flush=True)
            retry = True
        if retry:  # outside the except block, so the failed attempt's frames (and tensors) are released
            gc.collect()
            torch.cuda.empty_cache()
            args.moe_layers = max(1, args.moe_layers_used - 3)
            rows += run_model(name, args, device, ceil)
        gc.collect()  # the model and its KV pool went out of scope with run_model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    C.print_table("decode step vs roofline", rows, ["model", "batch", "ctx", "step_ms", "gpu_ms", "floor_ms",
                                                    "bound", "roofline_frac", "roofline_frac_step", "bytes_GB",
                                                    "distinct_experts", "skipped"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
