"""Report/CLI usability: the summary's quantization row, piped (non-terminal) output, long layer lists,
invalid config values, atomtool layouts' padding rows (tester's new-user defects)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from atomtool.inspect.classify import build_report
from atomtool.inspect.report import render

REALWORLD = Path(__file__).resolve().parent / "data" / "realworld" / "configs"


def _load(name: str) -> dict:
    return json.loads((REALWORLD / name).read_text())


def _text(report, width: int = 100) -> str:
    buf = io.StringIO()
    render(report, Console(file=buf, width=width))
    return buf.getvalue()


def _summary_row(text: str, key: str) -> str:
    return next(line for line in text.splitlines() if f" {key} " in line)


def test_quantization_row_reads_text_config_quantization():  # Kimi-K2.5: quantization_config under text_config
    cfg = _load("moonshotai__Kimi-K2.5.json")
    assert "quantization_config" not in cfg and cfg["text_config"]["quantization_config"]
    row = _summary_row(_text(build_report("kimi", cfg, {})), "quantization_config")
    assert "compressed-tensors" in row and "none" not in row


def test_quantization_row_reads_hf_quant_config():  # nvidia NVFP4: hf_quant_config.json, no quantization_config
    cfg = _load("nvidia__DeepSeek-V3.2-NVFP4.json")
    assert "quantization_config" not in cfg
    hq = _load("nvidia__DeepSeek-V3.2-NVFP4.hf_quant_config.json")
    row = _summary_row(_text(build_report("nv", cfg, {}, hf_quant_config=hq)), "quantization_config")
    assert "modelopt" in row and "nvfp4" in row


def test_quantization_row_none_when_unquantized():
    row = _summary_row(_text(build_report("q", _load("Qwen__Qwen3-0.6B.json"), {})), "quantization_config")
    assert row.replace("│", " ").split()[-1] == "none"
