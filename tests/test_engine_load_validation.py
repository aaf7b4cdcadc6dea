"""Checkpoints whose weights or config values disagree with each other, fed to ``atomtool generate``: one
``error:`` line naming the tensor or field, exit 1, no traceback -- for raw checkpoints and converted layouts.

- a wrong-shaped weight: parameters are sized from the config, never from the (source-derived) specs, so
  the mis-shape is named instead of a matmul failing mid-forward;
- nonsense config values (``num_attention_heads: -4``, ``max_position_embeddings: 0``, ``rope_theta: -1``):
  refused with inspect's ``config-invalid`` check before a model is built;
- a present but mis-shaped tensor is a shape mismatch only, never also "missing";
- an exception text transformers spreads over several lines is squeezed onto the one error line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.errors import one_line
from atomtool.inspect.config_check import invalid_size_fields
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import convert_checkpoint

DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3)


@pytest.fixture(scope="module")
def qwen3_layout(qwen3, tmp_path_factory):
    return convert_checkpoint(qwen3, tmp_path_factory.mktemp("layout") / "out")


@pytest.fixture
def no_model_build(monkeypatch):
    """Fail the test if the loader gets as far as building (allocating) a model."""
    import atomtool.serve.loader as loader

    def refuse(arch):
        raise AssertionError(f"the loader built a {arch} model before refusing the input")

    monkeypatch.setattr(loader, "get_model_class", refuse)


def generate_error(model_dir: Path) -> str:
    """``atomtool generate DIR --prompt hi``: exactly one ``error:`` line on stderr, exit 1, no traceback."""
    res = CliRunner().invoke(app, ["generate", str(model_dir), "--prompt", "hi", "--max-tokens", "2"])
    assert res.exit_code == 1, (res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def copy_with_config(src: Path, dst: Path, **changes) -> Path:
    d = shutil.copytree(src, dst)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def truncate_down_proj(shard: Path, name: str = DOWN) -> None:
    """Replace tensor ``name`` [64, 128] in ``shard`` by its first 3 columns ([64, 3])."""
    sd = load_file(shard)
    sd[name] = sd[name][:, :3].contiguous()
    save_file(sd, shard, metadata={"format": "pt"})


def test_wrong_shaped_weight_in_raw_checkpoint_is_named(qwen3, tmp_path):
    bad = shutil.copytree(qwen3, tmp_path / "bad")
    truncate_down_proj(bad / "model.safetensors")
    line = generate_error(bad)
    # inspect's shape-mismatch finding, refused before the model is built
    assert line == (f"error: {bad}: shape mismatch between config.json and the weights: {DOWN} is [64, 3] but "
                    "config.json implies [64, 128] (dim 1 = intermediate_size=128); the engine cannot load these "
                    "weights with this config.json")


def test_wrong_shaped_weight_converted_then_served_is_named(qwen3, tmp_path):
    """convert refuses the mis-shaped tensor (inspect's shape-mismatch); forced into a layout, the loader
    refuses the layout with the same message, before building the model."""
    bad = shutil.copytree(qwen3, tmp_path / "bad")
    truncate_down_proj(bad / "model.safetensors")
    res = CliRunner().invoke(app, ["convert", str(bad), str(tmp_path / "layout")])
    assert res.exit_code == 1 and "shape-mismatch" in res.output
    res = CliRunner().invoke(app, ["convert", str(bad), str(tmp_path / "layout"), "--force"])
    assert res.exit_code == 0, res.output
    line = generate_error(tmp_path / "layout")
    assert line == (f"error: {tmp_path / 'layout'}: shape mismatch between config.json and the weights: {DOWN} is "
                    "[64, 3] but config.json implies [64, 128] (dim 1 = intermediate_size=128); the engine cannot "
                    "load these weights with this config.json")


def test_wrong_shaped_weight_edited_into_a_layout_is_named(qwen3_layout, tmp_path):
    """The manifest says [64, 128] but the shard holds [64, 3] (header and manifest disagree)."""
    from atomtool.convert.layout import tensor_files

    layout = shutil.copytree(qwen3_layout, tmp_path / "layout")
    truncate_down_proj(layout / tensor_files(layout)[DOWN])
    line = generate_error(layout)
    # named before the model is built: the manifest's entry against the shard header (tensor, shard, both shapes)
    assert f"{DOWN}: the manifest says" in line and "[64, 128]" in line and "holds" in line and "[64, 3]" in line
    assert tensor_files(layout)[DOWN] in line
    assert "missing" not in line


BAD_VALUES = [
    ({"num_attention_heads": -4}, "num_attention_heads must be a positive integer, got -4"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
    ({"rope_theta": -1}, "rope_theta must be a positive finite number, got -1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
     "rope_parameters.rope_theta must be a positive finite number, got 0.0"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive finite number, got nan"),  # json writes NaN
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive finite number, got -1.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     "rope_parameters.rope_theta must be a positive finite number, got inf"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_VALUES, ids=lambda v: str(v)[:40])
def test_nonsense_config_value_in_raw_checkpoint_is_refused_before_building(qwen3, tmp_path, no_model_build,
                                                                             changes, message):
    bad = copy_with_config(qwen3, tmp_path / "bad", **changes)
    assert generate_error(bad) == f"error: config.json: {message}"


@pytest.mark.parametrize(("changes", "message"), BAD_VALUES, ids=lambda v: str(v)[:40])
def test_nonsense_config_value_in_layout_is_refused_before_building(qwen3_layout, tmp_path, no_model_build,
                                                                    changes, message):
    bad = copy_with_config(qwen3_layout, tmp_path / "bad", **changes)
    assert generate_error(bad) == f"error: config.json: {message}"


def test_config_check_flags_rope_theta_wherever_it_lives():
    """inspect and the loader share this check: top level, rope_parameters, per-layer-type dicts."""
    assert invalid_size_fields({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 1e6}}) == []
    msgs = [f.message for f in invalid_size_fields({
        "rope_theta": True,
        "rope_parameters": {"full_attention": {"rope_theta": -5}, "sliding_attention": {"rope_theta": 1e4}},
        "rope_scaling": {"rope_theta": "big"}})]
    assert msgs == ["config.json: rope_theta must be a positive finite number, got True",
                    "config.json: rope_parameters.full_attention.rope_theta must be a positive finite number, got -5",
                    "config.json: rope_scaling.rope_theta must be a positive finite number, got 'big'"]
    assert all(f.code == "config-invalid" and f.severity == "error"
               for f in invalid_size_fields({"max_position_embeddings": 0, "rope_theta": 0}))


@pytest.mark.parametrize(("changes", "mismatched"), [
    ({"hidden_size": 63}, ["model.embed_tokens.weight is [128, 64] but config.json implies [128, 63] "
                           "(dim 1 = hidden_size=63)", "lm_head.weight"]),
    ({"vocab_size": 100}, ["model.embed_tokens.weight is [128, 64] but config.json implies [100, 64] "
                           "(dim 0 = vocab_size=100)", "(lm_head.weight)"]),
])
def test_present_but_misshaped_tensors_are_not_called_missing(qwen3, tmp_path, changes, mismatched):
    bad = copy_with_config(qwen3, tmp_path / "bad", **changes)
    line = generate_error(bad)
    assert line.startswith(f"error: {bad}: shape mismatch between config.json and the weights: ")
    assert "missing" not in line
    for item in mismatched:
        assert item in line


def test_multiline_transformers_error_is_one_line(qwen3, tmp_path):
    """layer_types has 2 entries, num_hidden_layers says 1: transformers' validation error spans lines."""
    bad = copy_with_config(qwen3, tmp_path / "bad", num_hidden_layers=1)
    line = generate_error(bad)
    assert line.startswith(f"error: {bad / 'config.json'}: transformers cannot build its config (Qwen3Config): ")
    assert "num_hidden_layers" in line and "layer_types" in line


def test_one_line_squeezes_whitespace():
    assert one_line(ValueError("Class validation error:\n  ValueError: bad\n\tthing  ")) == \
        "Class validation error: ValueError: bad thing"
    assert one_line("already one line") == "already one line"


def test_config_check_flags_more_experts_per_token_than_experts():
    """inspect and the loader share this check (the router could not pick 999 of 8 experts)."""
    assert invalid_size_fields({"n_routed_experts": 8, "num_experts_per_tok": 8}) == []
    assert [f.message for f in invalid_size_fields({"n_routed_experts": 8, "num_experts_per_tok": 999})] == [
        "config.json: num_experts_per_tok (999) exceeds the number of routed experts (8)"]
    assert [f.message for f in invalid_size_fields({"num_experts": 4, "num_experts_per_tok": 5})] == [
        "config.json: num_experts_per_tok (5) exceeds the number of routed experts (4)"]

