"""The device's two ceilings, measured first in a run (issue 7, benchmark 1: every later figure is a ratio against these).

- copy bandwidth: a 2 GiB device-to-device copy (bytes read + bytes written), 3 random source buffers rotated;
- matmul rate: an 8192^3 bf16 ``torch.mm`` (cuBLAS) on random data, 3 input sets rotated.

Writes ``$BENCH_OUT/ceilings.json`` (read by the other benchmarks of the run) and a result row.
Run: ``python -m benchmarks.ceilings [--smoke]``.
"""

from __future__ import annotations

import argparse
import json

from benchmarks import common as C


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU toy sizes")
    args = ap.parse_args(argv)
    device = C.pick_device(args.smoke)
    env = C.env_info(device)
    bw = C.measure_copy_bandwidth(device)
    mm = C.measure_matmul_rate(device)
    bw2 = C.measure_copy_bandwidth(device)  # second measurement: the spread says what is noise
    data = {"device": device.type, "copy_bw_Bps": max(bw, bw2), "matmul_flops": mm}
    (C.out_dir() / "ceilings.json").write_text(json.dumps(data))
    C.record("ceilings", env=env, copy_GBps=bw / 1e9, copy_GBps_repeat=bw2 / 1e9, matmul_TFLOPs=mm / 1e12)
    print(f"copy bandwidth {bw / 1e9:.0f} / {bw2 / 1e9:.0f} GB/s (read+write), bf16 matmul {mm / 1e12:.3g} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
