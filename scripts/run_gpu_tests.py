#!/usr/bin/env python3
"""Run the GPU test suite (tests/gpu) and write a summary.

Usage (on a machine with a CUDA GPU and the project installed; this script installs nothing):

    python3 scripts/run_gpu_tests.py [--out DIR] [-- extra pytest args]

DIR defaults to ``$OUT`` when set, else ``./gpu-test-results``. Written there:
``summary.md`` (environment, torch._scaled_mm block-scale probe, pass/fail counts, failures, measured numbers,
kernel timings with ``--bench``),
``metrics.json`` (numbers the tests recorded: bf16 logit errors, top-1 agreement, kernel errors),
``junit.xml`` and ``pytest.log``. Exit status: pytest's (0 when everything passed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict:
    """Versions and the device, read in a subprocess so a broken CUDA setup cannot take this script down."""
    code = (
        "import json, torch, triton, transformers; d = {'torch': torch.__version__, 'triton': triton.__version__,"
        " 'transformers': transformers.__version__, 'cuda_available': torch.cuda.is_available()}\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d.update(device=p.name, capability=f'{p.major}.{p.minor}', sms=p.multi_processor_count,"
        " memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)\n"
        "print(json.dumps(d))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr.strip()[-2000:]}


PROBE = r"""
import json, torch
out = {}
try:
    M, N, K = 256, 512, 1024
    a = torch.randn(M, K, device='cuda').to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device='cuda').to(torch.float8_e4m3fn)
    ref = a.float() @ b.float().T
    sa = torch.ones(M, K // 128, device='cuda')            # 1x128 blocks of A
    sb = torch.ones(N // 128, K // 128, device='cuda')     # 128x128 blocks of B
    tries = {
        'blockwise_1x128_128x128': lambda: torch._scaled_mm(a, b.T, scale_a=sa.t().contiguous().t(),
                                                            scale_b=sb.t(), out_dtype=torch.bfloat16),
        'rowwise': lambda: torch._scaled_mm(a, b.T, scale_a=torch.ones(M, 1, device='cuda'),
                                            scale_b=torch.ones(1, N, device='cuda'), out_dtype=torch.bfloat16),
    }
    for name, fn in tries.items():
        try:
            y = fn().float()
            out[name] = {'ok': True, 'rel_err': float((y - ref).norm() / ref.norm())}
        except Exception as e:  # noqa: BLE001 - the probe reports whatever torch says
            out[name] = {'ok': False, 'error': f'{type(e).__name__}: {str(e)[:300]}'}
except Exception as e:  # noqa: BLE001
    out['error'] = f'{type(e).__name__}: {e}'
print(json.dumps(out))
"""


def scaled_mm_probe() -> dict:
    """Whether this torch offers FP8 ``_scaled_mm`` with DeepSeek-style block scales on this GPU."""
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr.strip()[-2000:]}


def junit_counts(path: Path) -> tuple[dict, list[tuple[str, str]]]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[tuple[str, str]] = []
    if not path.exists():
        return counts, failed
    root = ET.parse(path).getroot()
    for suite in root.iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                failed.append((f"{case.get('classname')}::{case.get('name')}", (el.get("message") or "")[:500]))
    return counts, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-test-results", help="result directory")
    ap.add_argument("--bench", action="store_true", help="also time the kernels (scripts/bench_gpu_ops.py)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    env = environment()
    probe = scaled_mm_probe() if env.get("cuda_available") else {"skipped": "no CUDA"}
    metrics_path = out / "metrics.json"
    junit = out / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", str(ROOT / "tests" / "gpu"), f"--junitxml={junit}",
           "-p", "no:cacheprovider", *args.pytest_args]
    t0 = time.time()
    with open(out / "pytest.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "ATOMTOOL_GPU_REPORT": str(metrics_path), "PYTHONUNBUFFERED": "1"})
    elapsed = time.time() - t0
    counts, failed = junit_counts(junit)
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}

    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = ["# atomtool GPU test summary", "", f"- command: `{' '.join(cmd)}`", f"- wall time: {elapsed:.0f} s",
             f"- exit status: {proc.returncode}",
             f"- tests: {counts['tests']}, passed {passed}, failed {counts['failures']}, errors {counts['errors']}, "
             f"skipped {counts['skipped']}", "", "## Environment", "", "```json", json.dumps(env, indent=2), "```",
             "", "## torch._scaled_mm probe (FP8)", "", "```json", json.dumps(probe, indent=2), "```", ""]
    if failed:
        lines += ["## Failures", ""] + [f"- `{n}`: {m}" for n, m in failed] + [""]
    lines += ["## Measured numbers", "", "```json", json.dumps(metrics, indent=2, default=str), "```", ""]
    if args.bench:
        bench_json = out / "bench.json"
        with open(out / "bench.log", "w") as log:
            pypath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
            subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu_ops.py"), "--out", str(bench_json)],
                           cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": pypath})
        rows = json.loads(bench_json.read_text()) if bench_json.exists() else []
        lines += ["## Kernel timings (scripts/bench_gpu_ops.py)", ""]
        lines += [f"- {json.dumps(r)}" for r in rows] or ["- failed: see bench.log"]
        lines += [""]
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join((out / "pytest.log").read_text().splitlines()[-80:]))
    print("\n".join(lines[:8]))
    print(f"summary: {out / 'summary.md'}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
