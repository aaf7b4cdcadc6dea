"""Shared pieces of the issue-7 benchmarks: environment record, ceilings, timing, result rows, model builders.

Every benchmark prints a ratio against something measured in the same run (issue 7: a ratio, never a lone number):
the device's copy bandwidth and bf16 matmul rate (:func:`measure_ceilings`), or a peer (transformers).
Results are appended as JSON lines to ``$BENCH_OUT/results.jsonl`` (``BENCH_OUT`` defaults to ``bench_out``)
and printed as a table.

Models are built through our own engine classes (``atomtool.serve.models``) with random weights created on
the target device (:func:`build_random_model`): no checkpoint on disk. FP8 block weights (DeepSeek-V3 style,
float8_e4m3fn + float32 ``weight_scale_inv`` per 128x128 block) are declared through layout specs
(:func:`fp8_layout_specs`) exactly as a converted FP8 layout would declare them.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

# --------------------------------------------------------------------------- configs

#: DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2 config.json, the fields the engine reads); layers are cut per run.
DSV32_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-6,
    # The published config has YaRN rope_scaling (factor 40). The recorded runs used plain rope (when they ran,
    # the engine could not build YaRN configs; fixed since): the rope variant does not change the step's bytes
    # or FLOPs, and keeping it plain keeps new runs comparable with the recorded ones.
    "rope_scaling": None,
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
    "vocab_size": 129280,
}

#: Qwen/Qwen3-0.6B config.json
QWEN3_06B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

#: a small DeepSeek-V3.2-style model (MLA + DSA + MoE) for the throughput run: ~0.5B parameters
SMALL_DSA_CONFIG: dict[str, Any] = {
    **{k: v for k, v in DSV32_CONFIG.items() if k != "quantization_config"},
    "hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 512, "n_routed_experts": 32,
    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "num_hidden_layers": 6, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 384, "kv_lora_rank": 256,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "index_n_heads": 8, "index_head_dim": 64,
    "index_topk": 512, "vocab_size": 32000, "max_position_embeddings": 8192, "rope_scaling": None,
}


def dsv32_config(num_layers: int, first_dense: int = 3, smoke: bool = False) -> dict[str, Any]:
    """The DeepSeek-V3.2 config cut to ``num_layers`` decoder layers (``first_dense`` of them dense MLP).

    ``smoke``: every width divided down to CPU toy sizes (same structure: MLA + DSA + MoE, FP8 128 blocks).
    """
    cfg = copy.deepcopy(DSV32_CONFIG)
    cfg.update(num_hidden_layers=num_layers, first_k_dense_replace=first_dense)
    if smoke:
        cfg.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
                   num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=4, num_key_value_heads=4,
                   q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                   index_n_heads=4, index_head_dim=64, index_topk=64, vocab_size=512)
    return cfg


def qwen3_config(smoke: bool = False) -> dict[str, Any]:
    """Qwen3-0.6B's config (``smoke``: 2 layers, hidden 128, vocab 512)."""
    cfg = copy.deepcopy(QWEN3_06B_CONFIG)
    if smoke:
        cfg.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=512)
    return cfg


def small_dsa_config(smoke: bool = False) -> dict[str, Any]:
    """:data:`SMALL_DSA_CONFIG` (``smoke``: 2 layers, hidden 128, 8 experts, vocab 512, index_topk 64)."""
    cfg = copy.deepcopy(SMALL_DSA_CONFIG)
    if smoke:
        cfg.update(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=16,
                   qk_rope_head_dim=16, v_head_dim=16, index_n_heads=2, index_head_dim=32, index_topk=64,
                   vocab_size=512)
    return cfg


# --------------------------------------------------------------------------- environment / output


def positive_int(text: str) -> int:
    """argparse ``type=`` for sizes that must be >= 1 (batch, steps, context, block size): a clear usage error
    instead of a traceback deep in the benchmark."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def out_dir() -> Path:
    """``$BENCH_OUT`` (created), where results.jsonl and logs go."""
    d = Path(os.environ.get("BENCH_OUT", "bench_out"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def pick_device(smoke: bool) -> torch.device:
    """cuda when available and not ``smoke``; else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")


def env_info(device: torch.device) -> dict[str, Any]:
    """Date (UTC), GPU name, driver-visible memory, torch / triton / transformers versions, host."""
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
    }
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # not installed: recorded as absent
            info[mod] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count,
                    cuda=torch.version.cuda)
    else:
        info["gpu"] = None
    return info


def record(bench: str, **fields: Any) -> dict[str, Any]:
    """Append one result row (JSON) to ``$BENCH_OUT/results.jsonl`` and print it compactly."""
    row = {"bench": bench, **fields}
    with open(out_dir() / "results.jsonl", "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print("RESULT " + json.dumps(row, default=str), flush=True)
    return row


def print_table(title: str, rows: list[dict[str, Any]], cols: list[str]) -> None:
    """A fixed-width table of ``rows`` (missing cells blank); floats with 4 significant digits."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    print(f"\n== {title}")
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    print(flush=True)


# --------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, *, warmup: int = 2, iters: int = 10) -> dict[str, float]:
    """Median / min / max wall seconds of ``fn()`` (device synchronised around each call; host work included)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def time_gpu(fn: Callable[[], Any], device: torch.device, *, warmup: int = 2, iters: int = 20) -> float:
    """Median device seconds of ``fn()`` measured with CUDA events (host clock on CPU)."""
    if device.type != "cuda":
        return time_fn(fn, device, warmup=warmup, iters=iters)["median_s"]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) / 1e3


def seconds_per_call(fn: Callable[[], Any], device: torch.device, *, calls: int = 20, graph: bool = True,
                     warmup: int = 3, iters: int = 10) -> float:
    """Seconds per ``fn()`` for a short kernel: ``calls`` back-to-back calls, replayed from one CUDA graph
    (``graph``; no launch overhead, as inside the engine's decode graphs) or launched eagerly, timed
    ``iters`` times with CUDA events (:func:`time_gpu`, median), divided by ``calls``. ``warmup`` calls run
    first (compilation, caches), on a side stream when capturing, as torch's graph capture asks. Host clock
    on CPU. The one timing rule of ``kernel_sweep``, ``topk_bench`` and the router GPU test."""
    if device.type != "cuda":
        return time_fn(fn, device, warmup=1, iters=max(1, iters // 3))["median_s"]

    def eager() -> None:
        for _ in range(calls):
            fn()

    run = eager
    if graph:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            eager()
        run = g.replay
    else:
        for _ in range(warmup):
            fn()
    return time_gpu(run, device, warmup=2, iters=iters) / calls


# --------------------------------------------------------------------------- ceilings


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + bytes written (the usual STREAM-copy convention).

    Rotates over 3 source buffers of ``nbytes`` (default 2 GiB on CUDA, 64 MiB on CPU), random data.
    """
    nbytes = nbytes or ((2 << 30) if device.type == "cuda" else (64 << 20))
    n = nbytes // 2
    srcs = [torch.randn(n, dtype=torch.bfloat16, device=device) for _ in range(3)]
    dst = torch.empty_like(srcs[0])
    i = [0]

    def step():
        dst.copy_(srcs[i[0] % 3])
        i[0] += 1

    t = time_gpu(step, device, warmup=3, iters=20 if device.type == "cuda" else 5)
    return 2 * nbytes / t


def measure_matmul_rate(device: torch.device, n: int | None = None) -> float:
    """Dense bf16 matmul FLOP/s of an ``n x n x n`` product (default 8192 on CUDA, 512 on CPU), random data,
    3 input sets rotated."""
    n = n or (8192 if device.type == "cuda" else 512)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sets = [(torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device))
            for _ in range(3)]
    out = torch.empty(n, n, dtype=dtype, device=device)
    i = [0]

    def step():
        a, b = sets[i[0] % 3]
        torch.mm(a, b, out=out)
        i[0] += 1

    t = time_gpu(step, device, warmup=3, iters=20 if device.type == "cuda" else 3)
    return 2 * n ** 3 / t


def load_or_measure_ceilings(device: torch.device) -> dict[str, float]:
    """The ceilings written by ceilings.py earlier in this run (``$BENCH_OUT/ceilings.json``), else measured now.

    Returns {"copy_bw_Bps": bytes/s, "matmul_flops": FLOP/s}.
    """
    path = out_dir() / "ceilings.json"
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("device") == device.type:
            return data
    data = {"device": device.type, "copy_bw_Bps": measure_copy_bandwidth(device),
            "matmul_flops": measure_matmul_rate(device)}
    path.write_text(json.dumps(data))
    return data


# --------------------------------------------------------------------------- models


def fp8_layout_specs(config_flat: dict[str, Any], arch_cls) -> dict:
    """Layout specs declaring every Linear and the stacked experts FP8 block (128x128), as a converted
    DeepSeek FP8 checkpoint's layout does; embeddings, norms, router and lm_head stay float.

    Built by instantiating the model on the ``meta`` device (no memory) to enumerate its Linear modules.
    Returns {tensor name: OutputTensor}.
    """
    from atomtool.convert.plan_types import OutputTensor, PartSpec
    from atomtool.serve.layers.linear import Linear, fp8_block_size
    from atomtool.serve.layers.mla import MLAAttention
    from atomtool.serve.layers.moe import StackedExperts

    block = fp8_block_size(config_flat)
    meta = arch_cls(config_flat, None, torch.bfloat16, "meta")
    specs: dict[str, OutputTensor] = {}

    def add(name: str, shape: tuple[int, ...], parts=()):
        scale_shape = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
        specs[f"{name}.weight"] = OutputTensor(f"{name}.weight", "F8_E4M3", tuple(shape), "fp8_block", "copy",
                                               tuple(parts), block)
        specs[f"{name}.weight_scale_inv"] = OutputTensor(f"{name}.weight_scale_inv", "F32", scale_shape,
                                                         "fp8_block", "copy", (), block)

    for name, mod in meta.named_modules():
        if isinstance(mod, Linear) and not name.startswith("lm_head"):
            parts = ()
            if name.endswith("fused_qkv_a_proj"):
                attn_prefix = name[: -len(".fused_qkv_a_proj")]
                attn = meta.get_submodule(attn_prefix)
                assert isinstance(attn, MLAAttention)
                parts = tuple(PartSpec(f"{attn_prefix}.{p}.weight", rows=r) for p, r in attn.splits.items())
            add(name, (mod.out_features, mod.in_features), parts)
        elif isinstance(mod, StackedExperts):
            add(f"{name}.w13", tuple(mod.w13.weight.shape))
            add(f"{name}.w2", tuple(mod.w2.weight.shape))
    return specs


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place, on the parameters' own device, in chunks (bounded temporaries).

    Norm weights 1, biases 0, router bias 0; matrices N(0, 1/in_features) (FP8: N(0,1) values clamped to
    +-4 with ``weight_scale_inv`` = 1/sqrt(in_features)); embeddings N(0, 1).
    """
    gen_seed = seed
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.dtype in (torch.float8_e4m3fn,):
            flat = p.view(-1, p.shape[-1])
            step = max(1, (1 << 28) // flat.shape[1])
            g = torch.Generator(device=p.device).manual_seed(gen_seed)
            for s in range(0, flat.shape[0], step):
                chunk = torch.randn(min(step, flat.shape[0] - s), flat.shape[1], device=p.device,
                                    dtype=torch.bfloat16, generator=g)
                flat[s:s + chunk.shape[0]].copy_(chunk.clamp_(-4, 4).to(p.dtype))
        elif leaf == "weight_scale_inv":
            # scale_inv [.., N/bn, K/bk]: K = in_features of the owning weight
            owner = model.get_parameter(name[: -len("_scale_inv")])
            p.fill_(1.0 / math.sqrt(owner.shape[-1]))
        elif "norm" in name and leaf == "weight":
            p.fill_(1.0)
        elif leaf in ("bias", "e_score_correction_bias"):
            p.zero_()
        elif p.dim() >= 2:
            std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(p.shape[-1])
            g = torch.Generator(device=p.device).manual_seed(gen_seed)
            p.normal_(0.0, std, generator=g)
        else:
            p.fill_(1.0)
        gen_seed += 1


def build_random_model(raw_config: dict[str, Any], device: torch.device, *, dtype: torch.dtype = torch.bfloat16,
                       fp8: bool = False, seed: int = 0, fp8_activations: str = "auto"):
    """Our engine model class for ``raw_config`` with random weights created directly on ``device``.

    Returns (model, config_flat). ``fp8``: DeepSeek FP8 block weights (see :func:`fp8_layout_specs`), their
    activations treated as ``fp8_activations`` says (``auto`` | ``dynamic`` | ``weight-only``, as
    ``atomtool serve --fp8-activations``); ``model.act_quant`` records the outcome.
    """
    from atomtool.inspect.dsa import flatten_dsa_config
    from atomtool.serve.models.registry import get_model_class, resolve_architecture

    cfg = flatten_dsa_config(raw_config)
    cls = get_model_class(resolve_architecture(cfg))
    specs = fp8_layout_specs(cfg, cls) if fp8 else None
    model = cls(cfg, specs, dtype, device)
    init_random_(model, seed)
    model.post_load()
    from atomtool.serve.layers.fp8_activations import apply_fp8_activations, resolve_fp8_activations

    act = resolve_fp8_activations(fp8_activations, cfg, dtype, device)
    model.act_quant = act if apply_fp8_activations(model, act) else None
    model.eval()
    return model, cfg


def make_runner(model, device: torch.device, *, num_blocks: int, block_size: int, max_model_len: int,
                graph_sizes: list[int] | None):
    """The engine's :class:`ModelRunner` over a fresh :class:`KVCachePool` of ``num_blocks`` blocks.

    ``graph_sizes``: decode batch sizes to capture as CUDA graphs (through the runner's own
    ``DecodeCudaGraphs`` / ``runner.run`` path); None or a CPU device: eager.
    """
    from atomtool.serve.engine.cuda_graphs import DecodeCudaGraphs
    from atomtool.serve.engine.kv_cache import KVCachePool
    from atomtool.serve.engine.model_runner import ModelRunner
    from atomtool.serve.ops import backend_for

    pool = KVCachePool(model.kv_plane_specs(), num_blocks, block_size, device)
    runner = ModelRunner(model, pool, device, enforce_eager=True, max_model_len=max_model_len)
    if graph_sizes and device.type == "cuda" and backend_for(device) != "torch":
        graphs = DecodeCudaGraphs(runner._forward_logits, device, max_num_seqs=max(graph_sizes),
                                  max_model_len=max_model_len, block_size=block_size, sizes=graph_sizes)
        graphs.capture()
        runner.graphs = graphs
    return runner, pool


def fill_cache_random_(pool, seed: int = 0) -> None:
    """Fill every KV plane with N(0, 1) values (never time on zeros: sparse or zero data can take faster paths)."""
    g = None
    for layer in pool.caches:
        for t in layer.values():
            if g is None:
                g = torch.Generator(device=t.device).manual_seed(seed)
            flat = t.view(t.shape[0], -1)
            step = max(1, (1 << 28) // flat.shape[1])
            for s in range(0, flat.shape[0], step):
                flat[s:s + step].normal_(generator=g)


def fake_sequences(batch: int, ctx: int, block_size: int, vocab: int, *, new_tokens: int = 1,
                   first_block: int = 0, seed: int = 0) -> list[SimpleNamespace]:
    """``batch`` sequence stand-ins of ``ctx`` tokens each with disjoint block tables, positioned so the next
    step computes their last ``new_tokens`` tokens (1: a decode step over ``ctx - 1`` cached tokens).

    Exposes what :meth:`ModelRunner.prepare` reads: token_ids, num_computed_tokens, block_table.
    """
    g = torch.Generator().manual_seed(seed)
    nb = math.ceil(ctx / block_size)
    seqs = []
    for b in range(batch):
        ids = torch.randint(0, vocab, (ctx,), generator=g).tolist()
        table = list(range(first_block + b * nb, first_block + (b + 1) * nb))
        seqs.append(SimpleNamespace(token_ids=ids, num_computed_tokens=ctx - new_tokens, block_table=table))
    return seqs


def scheduler_output(seqs: list[SimpleNamespace], new_tokens: int = 1):
    from atomtool.serve.engine.scheduler import SchedulerOutput

    return SchedulerOutput(seqs=list(seqs), num_new_tokens=[new_tokens] * len(seqs))


def param_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
