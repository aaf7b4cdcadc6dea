"""scripts/make_fixture.py: flag validation before anything is written, and atomic output."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("make_fixture", Path(__file__).resolve().parents[1] / "scripts"
                                               / "make_fixture.py")
mf = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mf)


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        mf.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_fp8_block_without_fp8_format_is_an_error(tmp_path, capsys):
    err = _usage_error([str(tmp_path / "out"), "--arch", "llama", "--fp8-block", "16"], capsys)
    assert "--fp8-block applies to --format fp8-block only (got --format hf)" in err
    assert list(tmp_path.iterdir()) == []


def test_mxfp4_on_a_dense_arch_is_an_error_before_writing(tmp_path, capsys):
    err = _usage_error([str(tmp_path / "out"), "--arch", "qwen3", "--format", "mxfp4"], capsys)
    assert "--format mxfp4 needs an MoE arch" in err and "qwen3 is dense" in err and "glm_moe_dsa" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_writer_failure_leaves_no_partial_output(tmp_path, capsys, monkeypatch):
    def broken(src, dst):
        Path(dst).mkdir(parents=True)
        (Path(dst) / "config.json").write_text("{}")
        raise ValueError("boom halfway")

    monkeypatch.setitem(mf.WRITERS, "awq", broken)
    assert mf.main([str(tmp_path / "out"), "--arch", "llama", "--format", "awq"]) == 1
    assert capsys.readouterr().err.strip().endswith("\nerror: boom halfway")
    assert list(tmp_path.iterdir()) == []  # neither out nor the temporary sibling


def test_fp8_block_fixture_records_the_block(tmp_path, capsys):
    out = tmp_path / "fp8"
    assert mf.main([str(out), "--arch", "llama", "--format", "fp8-block", "--fp8-block", "16"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [16, 16]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]
