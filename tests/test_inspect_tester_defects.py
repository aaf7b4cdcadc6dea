"""Defects a tester found in ``atomtool inspect`` (CLI through typer's CliRunner: exit code + message).

1. config-only directories whose declared quantization cannot be served said ``servable yes``;
2. ``--gpu-memory inf`` crashed with an OverflowError traceback;
3. the table report printed only the first message of a collapsed finding group;
4. a broken atomtool layout manifest gave ``No findings`` while generate/verify refuse the directory.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.convert.layout import MANIFEST_NAME, load_layout_specs, read_manifest
from atomtool.errors import LayoutError
from atomtool.inspect.families import SERVABLE_SCHEMES
from tests.checkpoints import tiny_config

CONFIGS = Path(__file__).resolve().parent / "data" / "realworld" / "configs"


def _run(*args: str):
    return CliRunner().invoke(app, ["inspect", *args])


def _config_only(tmp_path: Path, cfg: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _llama(**overrides) -> dict:
    return tiny_config("llama", **overrides).to_dict()


# ----------------------------------------------------------------------------- 1. declared quantization


def _not_servable(obj: dict) -> list[dict]:
    return [f for f in obj["findings"] if f["code"] == "scheme-not-servable"]


def test_deepseek_v32_nvfp4_config_with_hf_quant_config_is_not_servable(tmp_path):
    shutil.copy(CONFIGS / "nvidia__DeepSeek-V3.2-NVFP4.json", tmp_path / "config.json")
    shutil.copy(CONFIGS / "nvidia__DeepSeek-V3.2-NVFP4.hf_quant_config.json", tmp_path / "hf_quant_config.json")
    res = _run(str(tmp_path), "--json")
    assert res.exit_code == 0, res.output  # a warning, not an error: inspect still reports everything
    obj = json.loads(res.stdout)
    assert obj["servable"] is False
    (f,) = _not_servable(obj)
    assert f["severity"] == "warning"
    assert "nvfp4" in f["message"] and "declared by hf_quant_config.json; no weights to check" in f["message"]
    table = _run(str(tmp_path))
    assert re.search(r"\bservable\W+no\b", table.stdout), table.stdout


def test_glm52_nvfp4_config_only_is_not_servable(tmp_path):
    shutil.copy(CONFIGS / "nvidia__GLM-5.2-NVFP4.json", tmp_path / "config.json")
    obj = json.loads(_run(str(tmp_path), "--json").stdout)
    assert obj["servable"] is False
    (f,) = _not_servable(obj)
    assert "nvfp4" in f["message"]


def test_awq_config_only_is_not_servable(tmp_path):
    cfg = _llama(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                                      "zero_point": True})
    res = _run(str(_config_only(tmp_path, cfg)), "--json")
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["servable"] is False
    (f,) = _not_servable(obj)
    assert "awq" in f["message"] and "no weights to check" in f["message"]


def test_unrecognised_quant_method_config_only_is_not_servable(tmp_path):
    cfg = _llama(quantization_config={"quant_method": "hqq", "nbits": 4})
    obj = json.loads(_run(str(_config_only(tmp_path, cfg)), "--json").stdout)
    assert obj["servable"] is False
    assert "unknown (hqq)" in _not_servable(obj)[0]["message"]


@pytest.mark.parametrize("qcfg", [None, {"quant_method": "fp8", "weight_block_size": [128, 128],
                                         "activation_scheme": "dynamic"}], ids=["bf16", "fp8_block"])
def test_servable_declared_schemes_stay_servable(tmp_path, qcfg):
    assert "fp8_block" in SERVABLE_SCHEMES  # the one definition this test relies on
    cfg = _llama() if qcfg is None else _llama(quantization_config=qcfg)
    obj = json.loads(_run(str(_config_only(tmp_path, cfg)), "--json").stdout)
    assert obj["servable"] is True
    assert _not_servable(obj) == []


def test_real_glm5_fp8_config_only_stays_servable(tmp_path):
    shutil.copy(CONFIGS / "zai-org__GLM-5-FP8.json", tmp_path / "config.json")
    obj = json.loads(_run(str(tmp_path), "--json").stdout)
    assert obj["servable"] is True and _not_servable(obj) == []


# ----------------------------------------------------------------------------- 2. --gpu-memory bounds


@pytest.mark.parametrize("value", ["inf", "-inf", "1e7", "1e300"])
def test_gpu_memory_non_finite_or_absurd_is_one_line_error(tmp_path, value):
    d = _config_only(tmp_path, _llama())
    res = _run(str(d), "--gpu-memory", value)
    assert res.exit_code == 1
    assert isinstance(res.exception, SystemExit), res.exception  # no OverflowError escaping
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --gpu-memory must be a positive number of GB")
    if not value.startswith("-"):
        assert "(at most 1e+06)" in err


@pytest.mark.parametrize("value", ["nan", "0", "-1"])
def test_gpu_memory_still_refuses_nan_zero_negative(tmp_path, value):
    res = _run(str(_config_only(tmp_path, _llama())), "--gpu-memory", value)
    assert res.exit_code == 1
    assert res.stderr.strip().startswith("error: --gpu-memory must be a positive number of GB, got ")


def test_gpu_memory_at_the_limit_is_accepted(tmp_path):
    res = _run(str(_config_only(tmp_path, _llama())), "--json", "--gpu-memory", "1e6")
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)["memory"]
    assert m["gpu_memory_gb"] == 1e6 and m["max_context_tokens"] > 0


# ----------------------------------------------------------------------------- 3. collapsed findings


def test_table_prints_every_distinct_config_invalid_message(tmp_path):
    d = _config_only(tmp_path, {**_llama(), "num_attention_heads": -4, "vocab_size": 0})
    res = _run(str(d))
    assert res.exit_code == 1
    assert "config-invalid x2" in res.stdout
    assert "config.json: num_attention_heads must be a positive integer, got -4" in res.stdout
    assert "config.json: vocab_size must be a positive integer, got 0" in res.stdout


def test_messages_differing_only_in_layer_number_still_collapse():
    from atomtool.inspect.report import collapse_findings
    from atomtool.inspect.types import Finding

    fs = [Finding("dsa-shared-layer-with-indexer", "warning", f"model.layers.{i}.self_attn.indexer",
                  f"model.layers.{i}: schedule role 'shared' (reuses the top-k of layer {i - 1}) but ...")
          for i in (3, 5, 7)]
    ((_, code, n, where, msgs),) = collapse_findings(fs)
    assert (code, n, where) == ("dsa-shared-layer-with-indexer", 3, "model.layers.{3..7:2}.self_attn.indexer")
    assert msgs == [fs[0].message]


# ----------------------------------------------------------------------------- 4. broken layout manifest


@pytest.mark.parametrize("manifest", [
    json.dumps({"format": "atomtool-layout", "version": 99, "tensors": {}}),
    "{not json",
    "[]",
    json.dumps({"format": "atomtool-layout", "version": 1, "tensors": {"x.weight": {"shape": "bad"}}}),
], ids=["version99", "invalid-json", "list", "bad-entry"])
def test_broken_layout_manifest_is_an_error_finding(tmp_path, manifest):
    d = _config_only(tmp_path, _llama())
    (d / MANIFEST_NAME).write_text(manifest)
    with pytest.raises(LayoutError) as exc:  # convert's own reader: what generate/verify refuse with
        load_layout_specs(d)
    res = _run(str(d), "--json")
    assert res.exit_code == 1
    obj = json.loads(res.stdout)  # the report is still printed, then exit 1
    (f,) = [f for f in obj["findings"] if f["code"] == "layout-manifest-invalid"]
    assert f["severity"] == "error" and str(exc.value) in f["message"]
    assert res.stderr.strip().startswith("error: 1 error finding(s); first: ")
    table = _run(str(d))
    assert table.exit_code == 1 and "layout-manifest-invalid" in table.stdout
    assert "No findings" not in table.stdout


def test_version99_message_is_read_manifests(tmp_path):
    d = _config_only(tmp_path, _llama())
    (d / MANIFEST_NAME).write_text(json.dumps({"format": "atomtool-layout", "version": 99, "tensors": {}}))
    obj = json.loads(_run(str(d), "--json").stdout)
    (f,) = [f for f in obj["findings"] if f["code"] == "layout-manifest-invalid"]
    assert "layout version 99 is not supported (expected 1)" in f["message"]
    with pytest.raises(LayoutError, match="layout version 99"):
        read_manifest(d)


def test_directory_without_manifest_has_no_layout_finding(tmp_path):
    obj = json.loads(_run(str(_config_only(tmp_path, _llama())), "--json").stdout)
    assert not [f for f in obj["findings"] if f["code"] == "layout-manifest-invalid"]
