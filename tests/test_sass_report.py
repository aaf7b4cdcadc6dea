"""benchmarks/sass_report.py: ptxas / SASS parsing, the launcher's integer specialization, one real sm_90a compile
of the FP8 linear (Triton's bundled ptxas and nvdisasm; no GPU needed) and the CLI's errors."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import sass_report as S

PTXAS_SERIALIZED = """ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the \
function '_k'
ptxas info    : Compiling entry function '_k' for 'sm_90a'
ptxas info    : Function properties for _k
    360 bytes stack frame, 252 bytes spill stores, 360 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 360 bytes cumulative stack size
"""


def test_parse_ptxas_reads_registers_spills_and_serialization():
    assert S.parse_ptxas(PTXAS_SERIALIZED) == {"registers": 255, "spill_bytes": 612, "wgmma_serialized": True}
    clean = "ptxas info    : Used 62 registers, used 1 barriers\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    assert S.parse_ptxas(clean) == {"registers": 62, "spill_bytes": 0, "wgmma_serialized": False}
    with pytest.raises(S.SassReportError, match="no registers"):
        S.parse_ptxas("ptxas fatal   : Unresolved extern function 'x'")


def test_sass_histogram_counts_opcodes_without_modifiers_or_predicates():
    sass = """        /*0010*/                   HGMMA.64x32x16.F32.BF16 R168, gdesc[UR56], RZ, !UPT, gsb0 ;
        /*0020*/               @P0 EXIT ;
        /*0030*/              @!P1 BRA `(.L_x_0) ;
        /*0040*/                   HGMMA.64x32x16.F32.BF16 R168, gdesc[UR8], R168, gsb0 ;
.L_x_0:
        /*0050*/                   QGMMA.64x16x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;"""
    assert S.sass_histogram(sass) == {"HGMMA": 2, "EXIT": 1, "BRA": 1, "QGMMA": 1}


def test_int_specialization_follows_the_launcher():
    assert S.int_specialization(1) == ("constexpr", False)
    assert S.int_specialization(2048) == ("i32", True)
    assert S.int_specialization(0) == ("i32", True)
    assert S.int_specialization(65) == ("i32", False)
    assert S.int_specialization(1 << 33) == ("i64", True)


def _run(tmp_path, *args):
    """The tool in a fresh process without Triton's interpreter (the test session may have turned it on)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["BENCH_OUT"] = str(tmp_path)
    return subprocess.run([sys.executable, "-m", "benchmarks.sass_report", *args], capture_output=True, text=True,
                          env=env, cwd=Path(__file__).resolve().parents[1], timeout=600)


def test_compiles_the_linear_for_sm90_with_its_launch_configuration(tmp_path):
    """A real sm_90a compile of the FP8 linear, W8A8 and weight-only (Triton's bundled ptxas and nvdisasm; no
    GPU): the recorded rows carry the engine's launch options and Hopper's tensor-core instructions."""
    run = _run(tmp_path, "--only", "fp8_linear_w8a8,fp8_linear_weight_only")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "wgmma_serialized" in run.stdout
    rows = {r["kernel"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    w8a8, wo = rows["fp8_linear_w8a8"], rows["fp8_linear_weight_only"]
    lin = importlib.import_module("atomtool.serve.ops.triton.linear")
    assert w8a8["num_warps"] == lin.FP8_LINEAR_W8A8_CONFIG.num_warps and w8a8["arch"] == "sm_90a"
    assert w8a8["registers"] > 0 and w8a8["shared_kb"] > 0 and w8a8["sass_instructions"] > 100
    assert w8a8["wgmma"] > 0 and w8a8["mma_sync"] == 0  # e4m3 x e4m3 on Hopper's wgmma (QGMMA)
    assert wo["registers"] > 0 and wo["wgmma"] + wo["mma_sync"] > 0


def test_cli_refuses_unknown_kernels_and_the_interpreter(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="unknown kernel.*'nope'.*choose from"):
        S.main(["--only", "nope"])
    with pytest.raises(SystemExit, match="unknown kernel"):
        S.main(["--only", ","])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="interpreter is on"):
        S.main(["--only", "mla_split"])
