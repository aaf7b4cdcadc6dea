"""Load time: the converted atomtool layout vs the raw HF checkpoint of the same model (benchmark 5).

A random Qwen3-0.6B-shaped model is written with transformers' ``save_pretrained`` (the raw checkpoint), then
converted with ``atomtool convert`` (the layout). For each, alternating, ``--reps`` times, with the page cache
dropped before each load when the machine allows it (root on the GPU machine; recorded as ``cold``):

- ``load_s``: ``atomtool.serve.loader.load_model`` (inspect + plan + materialize for the raw checkpoint;
  manifest + shards for the layout) until the weights are on the device;
- ``ready_s``: ``load_s`` + building the ``LLMEngine`` (KV pool, decode CUDA graphs) -- what ``serve`` does
  before it listens (process start and imports excluded, the same for both; one untimed warm-up load first
  keeps Triton's one-time JIT compile out of both).

The disk's sequential read rate is measured in the same run with O_DIRECT reads (16 MiB requests) of the
checkpoint's shard, so it is a cold read whatever the page cache holds. Reported: GB/s = checkpoint bytes /
load_s, its fraction of the disk rate, and the layout's speedup over the raw checkpoint (goal: >= 2x).

Run: ``python -m benchmarks.load_bench [--smoke]``.
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


def load_once(path: Path, device: torch.device, graphs: bool) -> tuple[float, float]:
    from atomtool.serve.engine.llm_engine import LLMEngine
    from atomtool.serve.loader import load_model

    t0 = time.perf_counter()
    loaded = load_model(path, dtype="bfloat16", device=device)
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
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = ap.parse_args(argv)
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
        times: dict[str, list[tuple[float, float]]] = {"layout": [], "raw": []}
        cold = True
        for _ in range(args.reps):
            for kind, path in (("raw", raw), ("layout", layout)):
                # (not in --smoke: the CPU machine is shared, and toy files measure nothing)
                cold = (not args.smoke and drop_page_cache()) and cold
                times[kind].append(load_once(path, device, graphs=not args.smoke))
        rows = []
        for kind in ("raw", "layout"):
            load_s = statistics.median(t for t, _ in times[kind])
            ready_s = statistics.median(t for _, t in times[kind])
            rows.append({"source": kind, "load_s": load_s, "ready_s": ready_s, "GBps": nbytes / load_s / 1e9,
                         "disk_frac": nbytes / load_s / disk_Bps, "all_load_s": [round(t, 3) for t, _ in times[kind]]})
        speedup = rows[0]["load_s"] / rows[1]["load_s"]
        C.record("load", checkpoint_GB=nbytes / 1e9, disk_GBps=disk_Bps / 1e9, disk_method=method, cold_cache=cold,
                 convert_s=convert_s, raw=rows[0], layout=rows[1], speedup_load=speedup,
                 speedup_ready=rows[0]["ready_s"] / rows[1]["ready_s"], goal_2x_met=speedup >= 2)
        C.print_table(f"load ({nbytes / 1e9:.2f} GB checkpoint; disk {disk_Bps / 1e9:.2f} GB/s {method}; "
                      f"cold cache: {cold})", rows, ["source", "load_s", "ready_s", "GBps", "disk_frac", "all_load_s"])
        print(f"layout vs raw: {speedup:.2f}x (load), convert took {convert_s:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
