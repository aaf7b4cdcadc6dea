"""``atomtool inspect`` end to end: JSON schema, tables, exit codes, bad input (one line, exit 1)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import save_file
from typer.testing import CliRunner

from atomtool.cli import app
from tests.checkpoints import load_state_dict, write_fp8_block_checkpoint, write_hf_checkpoint

TOP_KEYS = {"source", "architecture", "model_type", "family", "servable", "config_flat", "dsa", "modules",
            "totals", "memory", "findings"}


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("cli") / "glm", "glm_moe_dsa", seed=5)


@pytest.fixture(scope="module")
def ds3(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("cli") / "ds3", "deepseek_v3", seed=6)


def _run(*args: str):
    return CliRunner().invoke(app, ["inspect", *args])


def test_json_schema_keys(glm):
    res = _run(str(glm), "--json")
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert set(obj) == TOP_KEYS
    assert obj["source"] == str(glm)
    assert (obj["architecture"], obj["model_type"], obj["family"], obj["servable"]) == (
        "GlmMoeDsaForCausalLM", "glm_moe_dsa", "deepseek_mla", True)
    assert set(obj["dsa"]) == {"index_topk", "index_n_heads", "index_head_dim", "index_rope_dim", "layers"}
    assert obj["dsa"]["layers"] == [{"layer": i, "role": r} for i, r in enumerate(["full", "full", "shared", "full"])]
    assert obj["config_flat"]["indexer_types"] == ["full", "full", "shared", "full"]
    for m in obj["modules"]:
        assert set(m) == {"name", "scheme", "dtype", "shape", "declared_quantized", "treated_as"}
    names = {m["name"] for m in obj["modules"]}
    assert "model.layers.3.self_attn.q_a_proj" in names
    assert "model.layers.2.self_attn.indexer.wk" not in names  # shared layer: no indexer tensors
    assert set(obj["totals"]) == {"parameters", "bytes", "by_dtype", "by_scheme"}
    assert {"weights_bytes", "kv_bytes_per_token"} <= set(obj["memory"])
    assert obj["memory"]["weights_bytes"] == obj["totals"]["bytes"]
    for f in obj["findings"]:
        assert set(f) == {"code", "severity", "module", "message"}
    assert "tensors" not in obj


def test_json_with_tensors(glm):
    obj = json.loads(_run(str(glm), "--json", "--tensors").stdout)
    sd = load_state_dict(glm)
    assert {t["name"] for t in obj["tensors"]} == set(sd)
    t = next(t for t in obj["tensors"] if t["name"] == "model.layers.0.self_attn.indexer.wk.weight")
    assert (t["dtype"], t["shape"], t["file"]) == ("F32", [16, 64], "model.safetensors")


def test_tables_collapse_repeated_modules(ds3):
    res = CliRunner().invoke(app, ["inspect", str(ds3)], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    # 3 layers, first_k_dense_replace 1 -> layers 1-2 are MoE with 8 experts each: one row of 16
    row = next(line for line in res.stdout.splitlines() if ".mlp.experts." in line and "down_proj" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[:3] == ["model.layers.{1,2}.mlp.experts.{0..7}.down_proj", "16", "fp32"]
    assert "DeepseekV3ForCausalLM" in res.stdout and "No findings." in res.stdout


def test_tensors_flag_lists_every_tensor(ds3):
    res = CliRunner().invoke(app, ["inspect", str(ds3), "--tensors"], env={"COLUMNS": "250"})
    assert res.exit_code == 0
    for name in ("model.layers.2.mlp.experts.7.up_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert name in res.stdout


def test_gpu_memory(ds3):
    obj = json.loads(_run(str(ds3), "--json", "--gpu-memory", "0.01").stdout)
    m = obj["memory"]
    # a float32 checkpoint is served in BF16 on a GPU: 2 bytes per weight element, except the router's
    # e_score_correction_bias, which the engine keeps in float32
    from safetensors import safe_open

    served = 0
    for shard in sorted(ds3.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                numel = math.prod(f.get_slice(name).get_shape())
                served += numel * (4 if name.endswith("e_score_correction_bias") else 2)
    assert m["kv_dtype"] == "BF16"
    assert m["max_context_tokens"] == (10**7 - served) // m["kv_bytes_per_token"]
    res = _run(str(ds3), "--gpu-memory", "-1")
    assert res.exit_code == 1 and res.stderr.strip() == "error: --gpu-memory must be a positive number of GB, got -1.0"


def test_error_finding_exits_1_after_report(ds3, tmp_path):
    dst = write_fp8_block_checkpoint(ds3, tmp_path / "fp8", block=16)
    sd = load_state_dict(dst)
    del sd["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(sd, str(dst / "model.safetensors"))
    res = _run(str(dst), "--json")
    assert res.exit_code == 1
    obj = json.loads(res.stdout)  # the full report was printed first
    err = [f for f in obj["findings"] if f["severity"] == "error"]
    assert [(f["code"], f["module"]) for f in err] == [("fp8-without-scale", "model.layers.1.self_attn.o_proj")]
    assert res.stderr.count("\n") == 1 and "fp8-without-scale" not in res.stderr
    assert "model.layers.1.self_attn.o_proj" in res.stderr


def test_unknown_architecture_reports_and_exits_1(ds3, tmp_path):
    dst = tmp_path / "unknown"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes((ds3 / "model.safetensors").read_bytes())
    cfg = json.loads((ds3 / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    res = _run(str(dst), "--json")
    assert res.exit_code == 1
    obj = json.loads(res.stdout)
    assert (obj["family"], obj["servable"]) == ("unknown", False)
    assert obj["modules"]  # still classified
    assert [f["code"] for f in obj["findings"] if f["severity"] == "error"] == ["unknown-architecture"]
    assert "FancyNewForCausalLM" in res.stderr and res.stderr.count("\n") == 1


def test_config_not_json_is_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],,}')
    res = subprocess.run([sys.executable, "-m", "atomtool.cli", "inspect", str(tmp_path)],
                         capture_output=True, text=True)
    if "No module named atomtool.cli.__main__" in res.stderr or res.returncode == 2 and not res.stderr.startswith("error"):
        res = subprocess.run([str(Path(sys.executable).parent / "atomtool"), "inspect", str(tmp_path)],
                             capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1
    assert "config.json" in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_invalid_schedule_in_config_is_an_error_finding(glm, tmp_path):
    dst = tmp_path / "bad_schedule"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes((glm / "model.safetensors").read_bytes())
    cfg = json.loads((glm / "config.json").read_text())
    cfg["indexer_types"] = ["shared", "full", "full", "full"]
    (dst / "config.json").write_text(json.dumps(cfg))
    res = _run(str(dst), "--json")
    assert res.exit_code == 1
    obj = json.loads(res.stdout)
    err = [f for f in obj["findings"] if f["severity"] == "error"]
    assert err[0]["code"] == "config-invalid" and "layer 0 must own an indexer" in err[0]["message"]
    assert obj["dsa"] is None


def test_config_only_directory(glm, tmp_path):
    (tmp_path / "config.json").write_text((glm / "config.json").read_text())
    res = _run(str(tmp_path), "--json")
    assert res.exit_code == 0
    obj = json.loads(res.stdout)
    full = json.loads(_run(str(glm), "--json").stdout)
    assert obj["modules"] == [] and obj["dsa"] == full["dsa"]
    # sizes from the config alone equal what the real checkpoint holds (F32 model)
    assert obj["totals"]["parameters"] == full["totals"]["parameters"]
    assert obj["memory"]["weights_bytes"] == full["memory"]["weights_bytes"]
    assert obj["memory"]["kv_bytes_per_token"] == full["memory"]["kv_bytes_per_token"]
    assert [f["code"] for f in obj["findings"]] == ["config-only"]
    res = _run(str(tmp_path))
    assert "none (config only)" in res.stdout
