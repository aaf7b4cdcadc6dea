"""benchmarks/server_host_bench.py runs end to end (child server over a scripted engine, streaming clients,
the child's CPU time from /proc) and reports a finite cost per streamed token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_server_host_bench_smoke():
    res = subprocess.run([sys.executable, "-m", "benchmarks.server_host_bench", "--clients", "2", "--tokens", "8",
                          "--seconds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    header, row = [line.split() for line in res.stdout.strip().splitlines()[-2:]]
    values = dict(zip(["endpoint", "clients", "chunks", "wall", "tok_s", "cpu", "us_token", "per_core"], row,
                      strict=True))
    assert "us/token" in " ".join(header) and values["endpoint"] == "chat" and int(values["chunks"]) > 0
    assert 0 < float(values["us_token"]) < 1e6
