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


def _expand(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.replace(" ", "").split(","):
        if ".." not in part:
            out.append(int(part))
            continue
        rng, _, step = part.partition(":")
        a, b = rng.split("..")
        out.extend(range(int(a), int(b) + 1, int(step or 1)))
    return out


def _cell(text: str, label: str) -> str:
    """The second cell of the row labelled ``label``, its wrapped continuation lines joined."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if label in line)
    cells = [lines[i].split("│")[2].strip()]
    for line in lines[i + 1:]:
        parts = line.split("│")
        if len(parts) < 3 or parts[1].strip():
            break
        cells.append(parts[2].strip())
    return " ".join(cells)


def test_long_dsa_layer_lists_are_never_truncated():  # GLM-5.2: 57 shared layers in 19 runs
    from atomtool.inspect.dsa import flatten_dsa_config

    cfg = _load("zai-org__GLM-5.2.json")
    roles = flatten_dsa_config(cfg)["indexer_types"]
    report = build_report("glm52", cfg, {})
    for width in (80, 160):
        text = _text(report, width)
        assert "…" not in text
        for role in ("full", "shared"):
            want = [i for i, r in enumerate(roles) if r == role]
            assert _expand(_cell(text, f"{role} layers ({len(want)})")) == want


def test_piped_output_does_not_wrap_module_names(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from atomtool.cli import app
    from tests.checkpoints import write_hf_checkpoint

    ckpt = write_hf_checkpoint(tmp_path / "ds3", "deepseek_v3", seed=6)
    monkeypatch.delenv("COLUMNS", raising=False)
    res = CliRunner().invoke(app, ["inspect", str(ckpt)])  # stdout is not a terminal here
    assert res.exit_code == 0, res.output
    for pattern in ("model.layers.{0..2}.self_attn.kv_a_proj_with_mqa",
                    "model.layers.{1,2}.mlp.experts.{0..7}.down_proj"):
        assert pattern in res.stdout


def _invoke(*args: str):
    from typer.testing import CliRunner

    from atomtool.cli import app

    return CliRunner().invoke(app, list(args))


def _config_dir(tmp_path, **overrides) -> Path:
    cfg = {**_load("Qwen__Qwen3-0.6B.json"), **overrides}
    d = tmp_path / "bad"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_nonsense_layer_count_is_an_error_finding(tmp_path):
    res = _invoke("inspect", str(_config_dir(tmp_path, num_hidden_layers="four")))
    assert res.exit_code == 1, res.output
    assert "config-invalid" in res.stdout and "num_hidden_layers must be a positive integer, got 'four'" in res.stdout
    assert "error: " in res.stderr and "num_hidden_layers" in res.stderr
    assert _summary_row(res.stdout, "servable").replace("│", " ").split()[-1] == "no"


def test_negative_and_zero_sizes_are_errors_and_never_printed(tmp_path):
    res = _invoke("inspect", str(_config_dir(tmp_path, num_hidden_layers=-3, hidden_size=0)), "--json")
    assert res.exit_code == 1
    obj = json.loads(res.stdout)
    msgs = [f["message"] for f in obj["findings"] if f["code"] == "config-invalid" and f["severity"] == "error"]
    assert any("num_hidden_layers" in m and "-3" in m for m in msgs) and any("hidden_size" in m for m in msgs)
    assert obj["memory"]["kv_bytes_per_token"] is None and obj["totals"]["parameters"] is None
    assert obj["servable"] is False
    text = _invoke("inspect", str(_config_dir(tmp_path / "t", num_hidden_layers=-3, hidden_size=0))).stdout
    assert "KV cache / token" not in text and "-3 layers" not in text and " 0 B" not in text


def test_real_configs_have_no_invalid_size_fields():
    from atomtool.inspect.config_check import invalid_size_fields
    from atomtool.inspect.dsa import flatten_dsa_config

    for path in sorted(REALWORLD.glob("*.json")):
        cfg = json.loads(path.read_text())
        if "hf_quant_config" in path.name or "inference-config" in path.name:
            continue
        assert invalid_size_fields(flatten_dsa_config(cfg)) == [], path.name


def test_fp8_layout_parameters_exclude_padding_rows(tmp_path):
    from atomtool.convert.layout import load_layout_specs
    from atomtool.inspect.classify import inspect_checkpoint
    from tests.checkpoints import write_fp8_block_checkpoint, write_hf_checkpoint

    hf = write_hf_checkpoint(tmp_path / "hf", "glm_moe_dsa", seed=3)
    fp8 = write_fp8_block_checkpoint(hf, tmp_path / "fp8", block=128)  # tiny dims: every part padded to 128
    layout = tmp_path / "layout"
    res = _invoke("convert", str(fp8), str(layout))
    assert res.exit_code == 0, res.output
    pad_rows = sum(p.pad_rows for s in load_layout_specs(layout).values() if s.name.endswith(".weight")
                   for p in s.parts)
    assert pad_rows > 0  # the case under test: the layout stores zero rows
    src, out = inspect_checkpoint(str(fp8)), inspect_checkpoint(str(layout))
    assert out.totals["parameters"] == src.totals["parameters"]
    assert out.totals["by_scheme"]["fp8_block"]["parameters"] == src.totals["by_scheme"]["fp8_block"]["parameters"]
    assert out.totals["padding_rows"] == pad_rows and "padding_rows" not in src.totals
    text = _invoke("inspect", str(layout)).stdout
    assert f"(+{pad_rows:,} padding rows)" in text


def test_bad_fp8_block_size_is_a_config_error():
    import pytest

    from atomtool.errors import ConfigError

    cfg = _load("Qwen__Qwen3-0.6B.json")
    for bad in ([0, 128], [False, False], [128, float("inf")], [128.5, 128]):
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": bad}
        with pytest.raises(ConfigError, match="weight_block_size must be two positive integers"):
            build_report("q", cfg, {})
