"""Benchmark ``atomtool convert`` against ``cp`` of the same files on the same disk, in the same run.

Builds a synthetic GLM-MoE-DSA-shaped BF16 checkpoint (MLA attention with indexers on an IndexShare
schedule, stacked-expert MoE layers: the fusion mix of a real one) of about ``--gb`` gigabytes in
1 GB shards, then measures, on the same files:

- ``cp``: ``cp -r SRC DST`` followed by ``sync`` (the conversion fsyncs its files, so the copy does too);
  also reported without the sync;
- ``convert``: ``python -m atomtool.cli convert SRC OUT --json`` as a subprocess: wall time end to end
  (interpreter start, inspect, plan, write) and the write phase alone, plus its peak RSS (``wait4``).

Both read the source from the page cache (it was just written; the machine's RAM holds it) and write to
the same filesystem. The benchmark process itself never imports torch (the checkpoint is generated in a
child), so the RSS a fork inherits does not inflate convert's peak. Prints one JSON line and a short
table. Usage::

    .venv/bin/python benchmarks/convert_bench.py            # ~2 GB
    .venv/bin/python benchmarks/convert_bench.py --gb 20 --dir /mnt/nvme/bench
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

H, Q_RANK, KV_RANK, ROPE, HEADS, NOPE, V = 2048, 768, 512, 64, 16, 128, 128
INTER, MOE_INTER, EXPERTS, IDX_HEADS, IDX_DIM = 8192, 768, 32, 32, 128


def _fill(shape, gen):
    """BF16 values in [-1, 1) (cheap to make; content does not change copy speed)."""
    import torch

    return (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1).to(torch.bfloat16)


def layer_shapes(i: int, full: bool, moe: bool) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of layer ``i`` (all BF16 but the router's F32 ``e_score_correction_bias``)."""
    p = f"model.layers.{i}"
    t = {
        f"{p}.input_layernorm.weight": (H,),
        f"{p}.post_attention_layernorm.weight": (H,),
        f"{p}.self_attn.q_a_proj.weight": (Q_RANK, H),
        f"{p}.self_attn.q_a_layernorm.weight": (Q_RANK,),
        f"{p}.self_attn.q_b_proj.weight": (HEADS * (NOPE + ROPE), Q_RANK),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": (KV_RANK + ROPE, H),
        f"{p}.self_attn.kv_a_layernorm.weight": (KV_RANK,),
        f"{p}.self_attn.kv_b_proj.weight": (HEADS * (NOPE + V), KV_RANK),
        f"{p}.self_attn.o_proj.weight": (H, HEADS * V),
    }
    if full:
        t.update({
            f"{p}.self_attn.indexer.wq_b.weight": (IDX_HEADS * IDX_DIM, Q_RANK),
            f"{p}.self_attn.indexer.wk.weight": (IDX_DIM, H),
            f"{p}.self_attn.indexer.k_norm.weight": (IDX_DIM,),
            f"{p}.self_attn.indexer.k_norm.bias": (IDX_DIM,),
            f"{p}.self_attn.indexer.weights_proj.weight": (IDX_HEADS, H),
        })
    if not moe:
        for n, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
            t[f"{p}.mlp.{n}.weight"] = shape
        return t
    t[f"{p}.mlp.gate.weight"] = (EXPERTS, H)
    t[f"{p}.mlp.gate.e_score_correction_bias"] = (EXPERTS,)
    mlp = (("gate_proj", (MOE_INTER, H)), ("up_proj", (MOE_INTER, H)), ("down_proj", (H, MOE_INTER)))
    for e in range(EXPERTS):
        for n, shape in mlp:
            t[f"{p}.mlp.experts.{e}.{n}.weight"] = shape
    for n, shape in mlp:
        t[f"{p}.mlp.shared_experts.{n}.weight"] = shape
    return t


def layer_tensors(i: int, full: bool, moe: bool, gen) -> dict:
    """The tensors of :func:`layer_shapes`, filled by :func:`_fill`."""
    return {n: _fill(shape, gen).float() if n.endswith("e_score_correction_bias") else _fill(shape, gen)
            for n, shape in layer_shapes(i, full, moe).items()}


VOCAB = 32000
#: the fewest layers the synthetic checkpoint has: layer 0 dense + ``full``, layer 1 MoE + ``shared``
MIN_LAYERS = 2


def _nbytes(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) * (4 if n.endswith("e_score_correction_bias") else 2) for n, s in shapes.items())


def layer_count(gb: float) -> int:
    """Layers of the checkpoint closest to ``gb`` GB (embeddings + MoE layers), at least :data:`MIN_LAYERS`."""
    per_moe = _nbytes(layer_shapes(0, True, True))
    return max(MIN_LAYERS, round((gb * 1e9 - 2 * VOCAB * H * 2) / per_moe))


def checkpoint_gb(layers: int) -> float:
    """Size in GB (1e9 bytes) of the synthetic checkpoint with ``layers`` layers."""
    embed = 2 * VOCAB * H * 2 + H * 2
    return (embed + sum(_nbytes(layer_shapes(i, i % 2 == 0, i > 0)) for i in range(layers))) / 1e9


def min_gb() -> float:
    """The smallest checkpoint this benchmark writes (:data:`MIN_LAYERS` layers), in GB."""
    return checkpoint_gb(MIN_LAYERS)


def checked_gb(gb: float) -> float:
    """``gb`` itself, or, below :func:`min_gb`, the minimum with a ``note:`` line on stderr (the requested size
    cannot be written, and a silently larger checkpoint would mislabel the run)."""
    if layer_count(gb) == MIN_LAYERS and gb < min_gb():
        print(f"note: --gb {gb:g} is below the smallest checkpoint this benchmark writes ({MIN_LAYERS} layers, "
              f"{min_gb():.3f} GB); using {min_gb():.3f} GB", file=sys.stderr, flush=True)
        return min_gb()
    return gb


def write_synthetic(root: Path, gb: float, shard_bytes: int = 10**9) -> tuple[int, int]:
    """Write the synthetic checkpoint; returns (layers, bytes)."""
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    vocab = VOCAB
    embed = {"model.embed_tokens.weight": _fill((vocab, H), gen), "lm_head.weight": _fill((vocab, H), gen),
             "model.norm.weight": _fill((H,), gen)}
    layers = layer_count(gb)
    roles = ["full" if i % 2 == 0 else "shared" for i in range(layers)]
    shards: list[dict] = [dict(embed)]
    size = sum(v.numel() * v.element_size() for v in embed.values())
    for i in range(layers):
        for name, v in layer_tensors(i, roles[i] == "full", i > 0, gen).items():
            nb = v.numel() * v.element_size()
            if size + nb > shard_bytes and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][name] = v
            size += nb
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / fname), metadata={"format": "pt"})
        for name, v in shard.items():
            weight_map[name] = fname
            total += v.numel() * v.element_size()
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    config = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": H,
              "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
              "q_lora_rank": Q_RANK, "kv_lora_rank": KV_RANK, "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE,
              "v_head_dim": V, "intermediate_size": INTER, "moe_intermediate_size": MOE_INTER,
              "n_routed_experts": EXPERTS, "n_shared_experts": 1, "num_experts_per_tok": 4,
              "first_k_dense_replace": 1, "vocab_size": vocab, "index_topk": 2048, "index_n_heads": IDX_HEADS,
              "index_head_dim": IDX_DIM, "indexer_types": roles, "dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return layers, total


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def time_cp(src: Path, dst: Path) -> tuple[float, float]:
    """(seconds of cp alone, seconds of cp + sync)."""
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    t1 = time.perf_counter()
    os.sync()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0


def time_convert(src: Path, out: Path) -> tuple[float, dict, int]:
    """(wall seconds, convert's --json summary, peak RSS bytes) of one conversion subprocess."""
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "atomtool.cli", "convert", str(src), str(out), "--json",
                             "--shard-size", "1GB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout = proc.stdout.read()  # type: ignore[union-attr]
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"convert failed: {stderr.decode()}")
    return wall, json.loads(stdout), usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="synthetic checkpoint size in GB (default 2)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir on the repo's disk)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--repeat", type=int, default=3, help="cp/convert pairs; the median-ratio pair is reported")
    ap.add_argument("--write-doc", action="store_true", help="replace the '## convert' section of docs/PERFORMANCE.md")
    ap.add_argument("--generate-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.gb > 0:
        ap.error(f"--gb must be a positive size in GB, not {args.gb:g}")
    if args.generate_only:  # child process: keeps torch out of the parent, whose RSS a fork would inherit
        print(json.dumps(write_synthetic(Path(args.generate_only), args.gb)))
        return
    args.gb = checked_gb(args.gb)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="convert_bench_", dir=Path.cwd()))
    base.mkdir(parents=True, exist_ok=True)
    try:
        src = base / "src"
        gen = subprocess.run([sys.executable, __file__, "--gb", str(args.gb), "--generate-only", str(src)],
                             check=True, capture_output=True, text=True)
        layers, _ = json.loads(gen.stdout.strip().splitlines()[-1])
        nbytes = dir_bytes(src)
        runs = []
        for _ in range(args.repeat):  # interleaved, so both see the same background load
            shutil.rmtree(base / "cp", ignore_errors=True)
            shutil.rmtree(base / "out", ignore_errors=True)
            cp_s, cp_sync_s = time_cp(src, base / "cp")
            wall, summary, rss = time_convert(src, base / "out")
            runs.append((cp_s, cp_sync_s, wall, summary["seconds"], rss, cp_sync_s / summary["seconds"]))
        runs.sort(key=lambda r: r[5])
        cp_s, cp_sync_s, wall, write_s, rss, _ = runs[len(runs) // 2]  # the run with the median ratio
        ratios = [r[5] for r in runs]
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
            "cpus": os.cpu_count(), "gb": round(nbytes / 1e9, 3), "layers": layers,
            "tensors_out": summary["tensors"],
            "cp_gbps": round(nbytes / 1e9 / cp_s, 3), "cp_sync_gbps": round(nbytes / 1e9 / cp_sync_s, 3),
            "convert_write_gbps": round(nbytes / 1e9 / write_s, 3), "convert_wall_gbps": round(nbytes / 1e9 / wall, 3),
            "convert_write_vs_cp_sync": round(cp_sync_s / write_s, 3),
            "convert_wall_vs_cp_sync": round(cp_sync_s / wall, 3),
            "convert_peak_rss_mb": round(max(r[4] for r in runs) / 1e6, 1),
            "repeat": args.repeat, "write_vs_cp_sync_min": round(ratios[0], 3),
            "write_vs_cp_sync_max": round(ratios[-1], 3),
            "largest_output_mb": round(max(1, _largest_output(base / "out")) / 1e6, 1),
        }
        print(json.dumps(result))
        print(f"\n{result['gb']} GB checkpoint ({layers} layers -> {summary['tensors']} output tensors)")
        print(f"  cp -r + sync      {result['cp_sync_gbps']:6.2f} GB/s   (cp alone {result['cp_gbps']:.2f} GB/s)")
        print(f"  convert (write)   {result['convert_write_gbps']:6.2f} GB/s   = {result['convert_write_vs_cp_sync']:.2f}x cp+sync")
        print(f"  convert (wall)    {result['convert_wall_gbps']:6.2f} GB/s   = {result['convert_wall_vs_cp_sync']:.2f}x cp+sync "
              "(incl. interpreter start, inspect, plan)")
        print(f"  convert peak RSS  {result['convert_peak_rss_mb']:.0f} MB (largest output tensor "
              f"{result['largest_output_mb']:.0f} MB)")
        if args.write_doc:
            write_doc(result, summary, sys.argv[1:])
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def _baseline_rss() -> float:
    """Peak RSS (MB) of an interpreter that only imports what convert imports (torch, atomtool)."""
    code = ("import resource, atomtool.cli, atomtool.convert.commands, atomtool.inspect.classify;"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def write_doc(r: dict, summary: dict, argv: list[str]) -> None:
    """Replace the '## convert' section of docs/PERFORMANCE.md (other sections untouched)."""
    doc = Path(__file__).resolve().parents[1] / "docs" / "PERFORMANCE.md"
    text = doc.read_text() if doc.exists() else "# Performance\n\nEach section is written by its benchmark.\n"
    base = _baseline_rss()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    import torch

    section = f"""## convert

- Command: `.venv/bin/python benchmarks/convert_bench.py {' '.join(argv)}`
- Date: {r['date']}
- Machine: {cpu}, {r['cpus']} CPUs visible (shared with other jobs), Linux {platform.release()}
- Software: Python {platform.python_version()}, torch {torch.__version__}; source and output on the same
  filesystem, page cache warm for both runs

Input: synthetic GLM-MoE-DSA-shaped BF16 checkpoint, {r['gb']} GB, {r['layers']} layers (MLA + indexers on an
IndexShare schedule, {EXPERTS} experts per MoE layer) -> {r['tensors_out']} output tensors (fused
`fused_qkv_a_proj` with indexer rows, `gate_up_proj`, stacked `w13`/`w2`), 1 GB shards, per-tensor sha256.

| what | GB/s | vs `cp -r` + `sync` |
|---|---|---|
| `cp -r SRC DST` + `sync` | {r['cp_sync_gbps']:.3f} | 1.00x |
| `cp -r SRC DST` alone (no sync; page cache only) | {r['cp_gbps']:.3f} | {r['cp_gbps'] / r['cp_sync_gbps']:.2f}x |
| `atomtool convert`, write phase (fsyncs every shard) | {r['convert_write_gbps']:.3f} | {r['convert_write_vs_cp_sync']:.2f}x |
| `atomtool convert`, wall (interpreter start, inspect, plan, write) | {r['convert_wall_gbps']:.3f} | {r['convert_wall_vs_cp_sync']:.2f}x |

{r['repeat']} interleaved cp/convert pairs; the table shows the pair with the median write-phase ratio
(range over the pairs: {r['write_vs_cp_sync_min']:.2f}x to {r['write_vs_cp_sync_max']:.2f}x).

- peak RSS of the convert process (max over the runs): {r['convert_peak_rss_mb']:.0f} MB, of which {base:.0f} MB is the interpreter
  with torch and atomtool imported; the largest output tensor is {r['largest_output_mb']:.0f} MB and is never
  held whole: outputs that need no cast are written part by part with `copy_file_range` (the in-kernel
  copy `cp` uses) while a thread pool computes each tensor's sha256 through short-lived read-only mmaps
  (at most one 64 MB window per hashing thread). Outputs that need a cast are built one at a time.
- The gap to `cp` is the sha256 of every tensor (one extra read pass over the data, ~0.8 GB/s per core
  here) and the per-shard fsync; convert's wall time also includes starting Python with torch and
  inspecting the headers. On this shared 2-core machine the numbers vary by up to 2x between runs with
  other jobs' load.
"""
    import re

    pattern = re.compile(r"^## convert\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)


def _largest_output(out: Path) -> int:
    manifest = json.loads((out / "atomtool.json").read_text())
    sizes = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
    best = 0
    for e in manifest["tensors"].values():
        n = sizes.get(e["dtype"], 4)
        for d in e["shape"]:
            n *= d
        best = max(best, n)
    return best


if __name__ == "__main__":
    main()
