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

The disk's sequential read rate is measured in the same run with O_DIRECT reads (16 MiB requests) of the
checkpoint's shard, so it is a cold read whatever the page cache holds. Reported: GB/s = checkpoint bytes /
load_s, its fraction of the disk rate, and the layout's speedup over the raw checkpoint (goal: >= 2x).

``--cpu``: the same full-size model loaded onto the CPU in bfloat16 (``load_model`` only, no engine), each
source with a cold-ish cache (``posix_fadvise(DONTNEED)`` on every file of the checkpoint, no root needed)
and a warm one, plus ``layout-generic``: the layout through the generic path (``safe_open`` ->
``load_weights``) that the fast path (:mod:`atomtool.serve.layout_load`) replaced, for before/after.

Run: ``python -m benchmarks.load_bench [--smoke | --cpu]``.
"""

from __future__ import annotations

import argparse
import gc
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


def cpu_main(reps: int, tmp_dir: str | None) -> int:
    """--cpu: load_model onto the CPU (bfloat16), cold-ish and warm cache, raw vs layout vs layout-generic."""
    from atomtool.convert.commands import run_convert
    from atomtool.serve.loader import load_model

    device = torch.device("cpu")
    print("env", C.env_info(device), flush=True)
    with tempfile.TemporaryDirectory(prefix="atomtool-load-", dir=tmp_dir) as tmp:
        raw, layout = Path(tmp) / "raw", Path(tmp) / "layout"
        nbytes = write_checkpoint(C.qwen3_config(), raw, device)
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
        C.record("load_cpu", checkpoint_GB=nbytes / 1e9, disk_GBps=disk_Bps / 1e9, disk_method=method,
                 convert_s=convert_s, rows=rows, speedups=speed, threads=torch.get_num_threads(),
                 cpus=os.cpu_count())
        C.print_table(f"load on CPU ({nbytes / 1e9:.2f} GB bf16; disk {disk_Bps / 1e9:.2f} GB/s {method})", rows,
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
    ap.add_argument("--smoke", action="store_true", help="CPU toy sizes")
    ap.add_argument("--cpu", action="store_true", help="full-size model loaded onto the CPU (load_model only)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.cpu:
        return cpu_main(args.reps, args.dir)
    device = C.pick_device(args.smoke)
    print("env", C.env_info(device), flush=True)
    from atomtool.convert.commands import run_convert

    with tempfile.TemporaryDirectory(prefix="atomtool-load-", dir=args.dir) as tmp:
        raw, layout = Path(tmp) / "raw", Path(tmp) / "layout"
        nbytes = write_checkpoint(C.qwen3_config(smoke=args.smoke), raw, device)
        t0 = time.perf_counter()
        run_convert(str(raw), str(layout))
        convert_s = time.perf_counter() - t0
        shard = max(raw.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        disk_Bps, method = disk_read_rate(shard, may_drop=not args.smoke)
        # untimed warm-up: the first engine in a process pays Triton's JIT compile during graph capture, which
        # would otherwise land on whichever source is loaded first
        load_once(layout, device, graphs=not args.smoke)
        # layout-o_direct: the fast path reading with O_DIRECT; layout-generic: the path it replaced (before/after)
        sources = {"raw": (raw, None), "layout": (layout, None), "layout-o_direct": (layout, load_layout_o_direct),
                   "layout-generic": (layout, load_layout_generic)}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in sources}
        cold = True
        for _ in range(args.reps):
            for kind, (path, loader) in sources.items():
                # (not in --smoke: the CPU machine is shared, and toy files measure nothing)
                cold = (not args.smoke and drop_page_cache()) and cold
                times[kind].append(load_once(path, device, graphs=not args.smoke, loader=loader))
        rows = []
        for kind in sources:
            load_s = statistics.median(t for t, _ in times[kind])
            ready_s = statistics.median(t for _, t in times[kind])
            rows.append({"source": kind, "load_s": load_s, "ready_s": ready_s, "GBps": nbytes / load_s / 1e9,
                         "disk_frac": nbytes / load_s / disk_Bps, "all_load_s": [round(t, 3) for t, _ in times[kind]]})
        speedup = rows[0]["load_s"] / rows[1]["load_s"]
        C.record("load", checkpoint_GB=nbytes / 1e9, disk_GBps=disk_Bps / 1e9, disk_method=method, cold_cache=cold,
                 convert_s=convert_s, raw=rows[0], layout=rows[1], layout_o_direct=rows[2], layout_generic=rows[3],
                 speedup_load=speedup, speedup_o_direct=rows[0]["load_s"] / rows[2]["load_s"],
                 speedup_ready=rows[0]["ready_s"] / rows[1]["ready_s"], goal_2x_met=speedup >= 2)
        C.print_table(f"load ({nbytes / 1e9:.2f} GB checkpoint; disk {disk_Bps / 1e9:.2f} GB/s {method}; "
                      f"cold cache: {cold})", rows, ["source", "load_s", "ready_s", "GBps", "disk_frac", "all_load_s"])
        print(f"layout vs raw: {speedup:.2f}x (load; O_DIRECT {rows[0]['load_s'] / rows[2]['load_s']:.2f}x; "
              f"the generic path it replaced {rows[0]['load_s'] / rows[3]['load_s']:.2f}x), "
              f"convert took {convert_s:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
