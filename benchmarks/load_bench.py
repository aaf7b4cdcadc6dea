"""Load time: the converted atomtool layout vs the raw HF checkpoint of the same model (benchmark 5).

A random Qwen3-0.6B-shaped model is written with transformers' ``save_pretrained`` (the raw checkpoint), then
converted with ``atomtool convert`` (the layout). For each, alternating, ``--reps`` times, with the page cache
dropped before each load when the machine allows it (root on the GPU machine; recorded as ``cold``):

- ``load_s``: ``atomtool.serve.loader.load_model`` (inspect + plan + materialize for the raw checkpoint;
  manifest + shards for the layout) until the weights are on the device;
- ``ready_s``: ``load_s`` + building the ``LLMEngine`` (KV pool, decode CUDA graphs) -- what ``serve`` does
  before it listens (process start and imports excluded, the same for both; one untimed warm-up load first
  keeps Triton's one-time JIT compile out of both).

Two more rows load the layout through ``layout-o_direct`` (the fast path with ``ATOMTOOL_LOAD_DIRECT_IO=1``:
O_DIRECT reads into the pinned staging buffers) and ``layout-generic`` (``safe_open`` -> ``load_weights``, the
path :mod:`atomtool.serve.layout_load` replaced), so before/after and both read modes come from one run.
``--sources`` picks the rows (raw and layout always); ``layout-8workers`` (not run unless asked for) is the
fast path with 8 reader threads instead of 4 (``ATOMTOOL_LOAD_WORKERS=8``).

The disk's sequential read rate is measured in the same run with O_DIRECT reads (16 MiB requests) of the
checkpoint's shard, so it is a cold read whatever the page cache holds. Reported: GB/s = checkpoint bytes /
load_s, its fraction of the disk rate, and the layout's speedup over the raw checkpoint (goal: >= 2x).

``--cpu``: the same full-size model loaded onto the CPU in bfloat16 (``load_model`` only, no engine), each
source with a cold-ish cache (``posix_fadvise(DONTNEED)`` on every file of the checkpoint, no root needed)
and a warm one, plus ``layout-generic``: the layout through the generic path (``safe_open`` ->
``load_weights``) that the fast path (:mod:`atomtool.serve.layout_load`) replaced, for before/after.

``--model``: ``qwen3`` (default) the dense bf16 Qwen3-0.6B-shaped checkpoint above; ``dsv32-fp8`` a
DeepSeek-V3.2-family FP8 block-quantized MoE checkpoint (:data:`DSV32_FP8_MOE_CONFIG`: hidden 2048, 6 layers
of which 5 MoE with 64 routed experts of 1024 + 1 shared, 8 active, the DSA indexer, 128x128 FP8 blocks;
~2.4 GB) in the on-disk format DeepSeek publishes: per-expert ``mlp.experts.{j}.gate_proj.weight`` /
``up_proj`` / ``down_proj`` float8_e4m3fn + float32 ``weight_scale_inv``, separate ``q_a_proj`` /
``kv_a_proj_with_mqa`` and indexer tensors, router and ``indexer.weights_proj`` bf16, the router's
``e_score_correction_bias`` float32, sharded with a ``model.safetensors.index.json``
(:func:`write_fp8_moe_checkpoint`). The raw path stacks every layer's experts into ``w13`` / ``w2`` and fuses
``q_a ‖ kv_a`` while loading; the layout stores them stacked and fused.

Run: ``python -m benchmarks.load_bench [--model qwen3|dsv32-fp8] [--sources raw,layout,...] [--smoke | --cpu]``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import mmap
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common as C
from benchmarks.throughput_bench import write_checkpoint

#: a DeepSeek-V3.2-family FP8 MoE checkpoint sized for one benchmark run (~2.4 GB): the published structure
#: (MLA + DSA indexer + noaux_tc MoE with a shared expert, first layer dense, FP8 128x128 blocks with ue8m0
#: scales) at hidden 2048 with 64 routed experts of 1024 per MoE layer (each expert tensor 2 MiB; DeepSeek's
#: are 14 MiB) and a 32k vocabulary, so routed experts are 83% of the bytes (DeepSeek-V3.2: ~95%)
DSV32_FP8_MOE_CONFIG: dict = {
    **C.DSV32_CONFIG,
    "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1024, "n_routed_experts": 64,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "num_hidden_layers": 6, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 768, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 32,
    "index_head_dim": 128, "index_topk": 2048, "vocab_size": 32768, "max_position_embeddings": 8192,
}

#: the benchmark models (``--model``): the dense bf16 Qwen3-0.6B shape and :data:`DSV32_FP8_MOE_CONFIG`
MODELS = ("qwen3", "dsv32-fp8")
#: the GPU mode's load rows (``--sources``): load_model on each, the layout fast path with O_DIRECT, the
#: layout through the generic path the fast path replaced, and (only when asked for) the fast path with 8
#: reader threads instead of 4 (``ATOMTOOL_LOAD_WORKERS=8``: does the disk serve more reads in flight faster?)
SOURCES = ("raw", "layout", "layout-o_direct", "layout-generic", "layout-8workers")
DEFAULT_SOURCES = SOURCES[:4]


def dsv32_fp8_moe_config(smoke: bool = False) -> dict:
    """:data:`DSV32_FP8_MOE_CONFIG` (``smoke``: 3 layers, hidden 256, 16 experts of 128, vocab 512)."""
    cfg = copy.deepcopy(DSV32_FP8_MOE_CONFIG)
    if smoke:
        cfg.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
                   num_experts_per_tok=4, n_group=4, topk_group=2, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                   qk_rope_head_dim=32, v_head_dim=32, index_n_heads=4, index_head_dim=64, index_topk=64,
                   vocab_size=512)
    return cfg


def _hf_config(raw_config: dict):
    """transformers' config object for ``raw_config`` (without its quantization_config)."""
    from transformers import AutoConfig

    skip = ("architectures", "model_type", "torch_dtype", "quantization_config")
    hf_cfg = AutoConfig.for_model(raw_config["model_type"], **{k: v for k, v in raw_config.items() if k not in skip})
    hf_cfg.architectures = raw_config["architectures"]
    return hf_cfg


def hf_checkpoint_tensors(raw_config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor transformers' ``save_pretrained`` writes for ``raw_config`` (bf16): name -> (shape, dtype),
    in its natural order, without allocating a weight.

    The model is built on the ``meta`` device and its state dict passed through the conversion transformers
    applies when saving (``revert_weight_conversion``: fused in-memory experts -> per-expert
    ``mlp.experts.{j}.*_proj.weight``), so the names are those of a real checkpoint. The router's
    ``e_score_correction_bias`` is float32 (``_keep_in_fp32_modules_strict``; DeepSeek ships it F32).
    """
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(raw_config), dtype=torch.bfloat16)
    sd = revert_weight_conversion(model, model.state_dict())
    tied = bool(raw_config.get("tie_word_embeddings"))
    return {k: (tuple(v.shape), torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
            for k, v in sd.items() if not (tied and k == "lm_head.weight")}


def is_fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """True for the 2-D linear weights DeepSeek's FP8 releases quantize: every projection except the router
    ``mlp.gate``, ``indexer.weights_proj``, ``lm_head``, embeddings and norms (research/quant.md §2)."""
    if not name.endswith(".weight") or len(shape) != 2:
        return False
    module = name[: -len(".weight")]
    return "norm" not in module.rsplit(".", 1)[-1] and not module.endswith(
        ("mlp.gate", "indexer.weights_proj", "lm_head", "embed_tokens"))


def write_fp8_moe_checkpoint(raw_config: dict, path: Path, device: torch.device, *, shard_bytes: int = 1 << 30,
                             seed: int = 0) -> int:
    """Write a random FP8 block checkpoint of ``raw_config`` (a DeepSeek-V3-family config with a
    ``quantization_config``) in the format DeepSeek publishes, with safetensors; returns its tensor bytes.

    Tensors: :func:`hf_checkpoint_tensors`; each :func:`is_fp8_linear` weight [N, K] is float8_e4m3fn
    (N(0, 1) values clamped to +-4) with ``weight_scale_inv`` float32 [ceil(N/b0), ceil(K/b1)] (powers of two,
    as ``scale_fmt: ue8m0`` publishes them); other tensors bf16 N(0, 0.02) (norm weights 1, the router bias
    float32 0). Values are drawn on ``device`` (fast on a GPU) and written in shards of about
    ``shard_bytes`` (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``), one shard in
    host memory at a time. config.json is transformers' own plus the ``quantization_config``.
    """
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    b0, b1 = raw_config["quantization_config"]["weight_block_size"]
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[list[str]] = [[]]
    acc = 0
    entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name, (shape, dtype) in hf_checkpoint_tensors(raw_config).items():
        if is_fp8_linear(name, shape):
            entries.append((name, shape, torch.float8_e4m3fn))
            entries.append((name + "_scale_inv", (math.ceil(shape[0] / b0), math.ceil(shape[1] / b1)),
                            torch.float32))
        else:
            entries.append((name, shape, dtype))
    specs = {n: (s, d) for n, s, d in entries}
    for name, shape, dtype in entries:  # shard by running byte count, a layer's tensors stay together mostly
        nbytes = math.prod(shape) * dtype.itemsize
        if acc and acc + nbytes > shard_bytes and not name.endswith("_scale_inv"):
            shards.append([])
            acc = 0
        shards[-1].append(name)
        acc += nbytes
    total = 0
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            shape, dtype = specs[name]
            if dtype == torch.float8_e4m3fn:
                t = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).clamp_(-4, 4).to(dtype)
            elif name.endswith("_scale_inv"):
                t = torch.exp2(torch.randint(-12, -6, shape, device=device, generator=gen).float())
            elif name.endswith("e_score_correction_bias"):
                t = torch.zeros(shape, device=device, dtype=dtype)
            elif "norm" in name and name.endswith(".weight"):
                t = torch.ones(shape, device=device, dtype=dtype)
            else:
                t = torch.randn(shape, device=device, dtype=torch.float32, generator=gen).mul_(0.02).to(dtype)
            tensors[name] = t.cpu()
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        del tensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg = _hf_config(raw_config).to_dict()
    cfg["quantization_config"] = copy.deepcopy(raw_config["quantization_config"])
    cfg["architectures"] = raw_config["architectures"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return total


def write_model(model: str, path: Path, device: torch.device, smoke: bool) -> int:
    """Write the raw checkpoint of benchmark model ``model`` (one of :data:`MODELS`); returns its bytes."""
    if model == "qwen3":
        return write_checkpoint(C.qwen3_config(smoke=smoke), path, device)
    if model == "dsv32-fp8":
        return write_fp8_moe_checkpoint(dsv32_fp8_moe_config(smoke), path, device,
                                        shard_bytes=(1 << 20) if smoke else (1 << 30))
    raise ValueError(f"unknown model {model!r}; choose one of {MODELS}")


def drop_page_cache() -> bool:
    """sync + drop the page cache (root only); True when it worked."""
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_read_rate(path: Path, chunk: int = 16 << 20, may_drop: bool = True) -> tuple[float, str]:
    """Sequential read bytes/s of ``path`` with O_DIRECT (page cache bypassed); buffered after a cache drop
    when O_DIRECT is refused (e.g. tmpfs). Returns (bytes/s, method)."""
    size = path.stat().st_size
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        method = "O_DIRECT"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        method = "buffered"
    try:
        if method == "buffered" and may_drop:
            drop_page_cache()
        t0 = time.perf_counter()
        off = 0
        while off < size:
            try:
                n = os.preadv(fd, [buf], off)
            except OSError:  # O_DIRECT refused at read time: fall back once to buffered
                os.close(fd)
                fd = os.open(path, os.O_RDONLY)
                method = "buffered"
                if may_drop:
                    drop_page_cache()
                t0 = time.perf_counter()
                off = 0
                continue
            if n <= 0:
                break
            off += n
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return size / dt, method


def parallel_direct_read_rate(path: Path, threads: int, chunk: int = 16 << 20) -> float:
    """Bytes/s of reading ``path`` with O_DIRECT by ``threads`` threads (16 MiB requests dealt round-robin, so
    up to ``threads`` requests in flight): the disk's rate with a queue, which one stream does not reach.
    Raises OSError where O_DIRECT is refused (e.g. tmpfs)."""
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    offsets = list(range(0, size, chunk))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

    def read(offs: list[int]) -> None:
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        try:
            for off in offs:
                os.preadv(fd, [buf], off)
        finally:
            buf.close()

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, [offsets[i::threads] for i in range(threads)]))
        return size / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def fadvise_dontneed(root: Path) -> bool:
    """Evict ``root``'s files from the page cache (fsync + POSIX_FADV_DONTNEED; clean pages only)."""
    ok = True
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                ok = False
            finally:
                os.close(fd)
    return ok


def load_layout_generic(path: Path, device: torch.device):
    """The layout through the generic path the fast loader replaced: safe_open -> get_tensor -> load_weights.
    Returns the ``LoadedModel`` that ``load_model`` would."""
    from atomtool.convert.layout import load_layout_specs
    from atomtool.inspect.dsa import flatten_dsa_config
    from atomtool.serve.loader import LoadedModel, _layout_tensors, read_config
    from atomtool.serve.models.registry import get_model_class, resolve_architecture

    raw = read_config(path)
    arch = resolve_architecture(raw)
    config = flatten_dsa_config(raw)
    model = get_model_class(arch)(config, load_layout_specs(path), torch.bfloat16, device)
    model.load_weights(_layout_tensors(path))
    model.eval()
    return LoadedModel(model, config, arch, path, torch.bfloat16, device)


def load_layout_o_direct(path: Path, device: torch.device):
    """``load_model`` with the layout read through O_DIRECT (``ATOMTOOL_LOAD_DIRECT_IO=1``)."""
    from atomtool.serve.loader import load_model

    os.environ["ATOMTOOL_LOAD_DIRECT_IO"] = "1"
    try:
        return load_model(path, dtype="bfloat16", device=device)
    finally:
        del os.environ["ATOMTOOL_LOAD_DIRECT_IO"]


def load_layout_8workers(path: Path, device: torch.device):
    """``load_model`` with the layout fast path reading with 8 threads (``ATOMTOOL_LOAD_WORKERS=8``)."""
    from atomtool.serve.loader import load_model

    os.environ["ATOMTOOL_LOAD_WORKERS"] = "8"
    try:
        return load_model(path, dtype="bfloat16", device=device)
    finally:
        del os.environ["ATOMTOOL_LOAD_WORKERS"]


def cpu_main(reps: int, tmp_dir: str | None, model: str = "qwen3") -> int:
    """--cpu: load_model onto the CPU (bfloat16), cold-ish and warm cache, raw vs layout vs layout-generic."""
    from atomtool.convert.commands import run_convert
    from atomtool.serve.loader import load_model

    device = torch.device("cpu")
    print("env", C.env_info(device), flush=True)
    with tempfile.TemporaryDirectory(prefix="atomtool-load-", dir=tmp_dir) as tmp:
        raw, layout = Path(tmp) / "raw", Path(tmp) / "layout"
        nbytes = write_model(model, raw, device, smoke=False)
        t0 = time.perf_counter()
        run_convert(str(raw), str(layout))
        convert_s = time.perf_counter() - t0
        shard = max(raw.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        disk_Bps, method = disk_read_rate(shard, may_drop=False)
        sources = {"raw": (raw, lambda p: load_model(p, dtype="bfloat16", device=device)),
                   "layout": (layout, lambda p: load_model(p, dtype="bfloat16", device=device)),
                   "layout-generic": (layout, lambda p: load_layout_generic(p, device))}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(reps):
            for kind, (path, fn) in sources.items():
                for cache in ("cold", "warm"):
                    if cache == "cold":
                        fadvise_dontneed(path)
                    else:
                        fn(path)  # (warms the cache) -- untimed
                        gc.collect()
                    t0 = time.perf_counter()
                    fn(path)
                    times.setdefault((kind, cache), []).append(time.perf_counter() - t0)
                    gc.collect()
        rows = [{"source": k, "cache": c, "load_s": statistics.median(v), "GBps": nbytes / statistics.median(v) / 1e9,
                 "all_load_s": [round(t, 3) for t in v]} for (k, c), v in times.items()]
        med = {(r["source"], r["cache"]): r["load_s"] for r in rows}
        speed = {c: {"layout_vs_raw": med["raw", c] / med["layout", c],
                     "layout_vs_generic": med["layout-generic", c] / med["layout", c]} for c in ("cold", "warm")}
        C.record("load_cpu", model=model, checkpoint_GB=nbytes / 1e9, disk_GBps=disk_Bps / 1e9, disk_method=method,
                 convert_s=convert_s, rows=rows, speedups=speed, threads=torch.get_num_threads(),
                 cpus=os.cpu_count())
        C.print_table(f"load on CPU ({model}, {nbytes / 1e9:.2f} GB; disk {disk_Bps / 1e9:.2f} GB/s {method})", rows,
                      ["source", "cache", "load_s", "GBps", "all_load_s"])
        for c, v in speed.items():
            print(f"{c}: layout vs raw {v['layout_vs_raw']:.2f}x, layout fast vs generic {v['layout_vs_generic']:.2f}x")
    return 0


def load_once(path: Path, device: torch.device, graphs: bool, loader=None) -> tuple[float, float]:
    """(load_s, ready_s) of one load; ``loader(path, device)`` -> LoadedModel (default: ``load_model``)."""
    from atomtool.serve.engine.llm_engine import LLMEngine
    from atomtool.serve.loader import load_model

    t0 = time.perf_counter()
    loaded = loader(path, device) if loader else load_model(path, dtype="bfloat16", device=device)
    C.sync(device)
    t_load = time.perf_counter() - t0
    engine = LLMEngine(loaded.model, None, loaded.config, device=loaded.device, model_dir=loaded.model_dir,
                       max_model_len=4096, max_num_seqs=256, gpu_memory_utilization=0.5, enforce_eager=not graphs)
    C.sync(device)
    t_ready = time.perf_counter() - t0
    del engine, loaded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return t_load, t_ready


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="qwen3",
                    help="qwen3: dense bf16 Qwen3-0.6B shape; dsv32-fp8: DeepSeek-V3.2-family FP8 MoE (~2.4 GB)")
    ap.add_argument("--smoke", action="store_true", help="CPU toy sizes")
    ap.add_argument("--cpu", action="store_true", help="full-size model loaded onto the CPU (load_model only)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--sources", default=",".join(DEFAULT_SOURCES),
                    help=f"comma-separated subset of {','.join(SOURCES)} (GPU mode; raw and layout always run)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    ap.add_argument("--cache", choices=["cold", "warm", "both"], default="cold",
                    help="GPU mode: page cache dropped before each load (cold: this disk's rate bounds both "
                         "paths), or the files read once untimed first (warm: storage faster than the loader, "
                         "so each path's own work shows), or both")
    args = ap.parse_args(argv)
    if args.dir is not None and not Path(args.dir).is_dir():
        why = "not a directory" if Path(args.dir).exists() else "no such directory"
        ap.error(f"argument --dir: {args.dir}: {why} (create it first; the benchmark writes its checkpoints there)")
    unknown = set(args.sources.split(",")) - set(SOURCES)
    if unknown:
        ap.error(f"--sources: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SOURCES)}")
    if args.cpu:
        return cpu_main(args.reps, args.dir, args.model)
    device = C.pick_device(args.smoke)
    print("env", C.env_info(device), flush=True)
    from atomtool.convert.commands import run_convert

    with tempfile.TemporaryDirectory(prefix="atomtool-load-", dir=args.dir) as tmp:
        raw, layout = Path(tmp) / "raw", Path(tmp) / "layout"
        t0 = time.perf_counter()
        nbytes = write_model(args.model, raw, device, args.smoke)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_convert(str(raw), str(layout))
        convert_s = time.perf_counter() - t0
        shard = max(raw.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        disk_Bps, method = disk_read_rate(shard, may_drop=not args.smoke)
        try:  # the queued rate too: the layout's reader threads keep several requests in flight
            disk_q_Bps = parallel_direct_read_rate(shard, 8)
        except OSError:
            disk_q_Bps = disk_Bps
        # untimed warm-up: the first engine in a process pays Triton's JIT compile during graph capture, which
        # would otherwise land on whichever source is loaded first
        load_once(layout, device, graphs=not args.smoke)
        # layout-o_direct: the fast path reading with O_DIRECT; layout-generic: the path it replaced (before/after)
        sources = {"raw": (raw, None), "layout": (layout, None), "layout-o_direct": (layout, load_layout_o_direct),
                   "layout-generic": (layout, load_layout_generic), "layout-8workers": (layout, load_layout_8workers)}
        wanted = {"raw", "layout", *args.sources.split(",")}
        sources = {k: v for k, v in sources.items() if k in wanted}
        caches = ["cold", "warm"] if args.cache == "both" else [args.cache]
        for cache in caches:
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in sources}
            cold = cache == "cold"
            for _ in range(args.reps):
                for kind, (path, loader) in sources.items():
                    if cache == "cold":  # (not in --smoke: the CPU machine is shared, and toy files measure nothing)
                        cold = (not args.smoke and drop_page_cache()) and cold
                    else:
                        _read_all(path)
                    times[kind].append(load_once(path, device, graphs=not args.smoke, loader=loader))
            _report(args, sources, times, nbytes, disk_Bps, disk_q_Bps, method, cold, cache, write_s, convert_s)
    return 0


def _read_all(path: Path) -> None:
    """Read every file of a checkpoint once (fills the page cache; untimed)."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def _report(args, sources, times, nbytes, disk_Bps, disk_q_Bps, method, cold, cache, write_s, convert_s) -> None:
    """One cache mode's table, JSON row and speedup line."""
    rows = []
    for kind in sources:
        load_s = statistics.median(t for t, _ in times[kind])
        ready_s = statistics.median(t for _, t in times[kind])
        rows.append({"source": kind, "load_s": load_s, "ready_s": ready_s, "GBps": nbytes / load_s / 1e9,
                     "disk_frac": nbytes / load_s / disk_Bps, "all_load_s": [round(t, 3) for t, _ in times[kind]]})
    by = {r["source"]: r for r in rows}
    speedup = by["raw"]["load_s"] / by["layout"]["load_s"]
    others = [k for k in sources if k not in ("raw", "layout")]
    extra = {k.replace("-", "_"): by[k] for k in others}
    extra.update({f"speedup_{k.split('-')[1]}": by["raw"]["load_s"] / by[k]["load_s"] for k in others})
    C.record("load", model=args.model, checkpoint_GB=nbytes / 1e9, write_s=write_s, disk_GBps=disk_Bps / 1e9,
             disk_8streams_GBps=disk_q_Bps / 1e9,
             disk_method=method, cold_cache=cold, cache=cache, convert_s=convert_s, raw=by["raw"],
             layout=by["layout"],
             speedup_load=speedup, speedup_ready=by["raw"]["ready_s"] / by["layout"]["ready_s"],
             goal_2x_met=speedup >= 2, **extra)
    dropped = "" if cold or cache == "warm" else " (could not drop it)"
    C.print_table(f"load ({args.model}, {nbytes / 1e9:.2f} GB checkpoint; disk {disk_Bps / 1e9:.2f} GB/s {method}, "
                  f"{disk_q_Bps / 1e9:.2f} GB/s with 8 O_DIRECT streams; cache: {cache}{dropped})", rows,
                  ["source", "load_s", "ready_s", "GBps", "disk_frac", "all_load_s"])
    notes = "".join(f"; {k} {by['raw']['load_s'] / by[k]['load_s']:.2f}x" for k in others)
    print(f"layout vs raw ({cache} cache): {speedup:.2f}x (load{notes}; load + ready "
          f"{by['raw']['ready_s'] / by['layout']['ready_s']:.2f}x), convert took {convert_s:.1f} s")


if __name__ == "__main__":
    raise SystemExit(main())
