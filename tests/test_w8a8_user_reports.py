"""New-user reports on ``--fp8-activations`` (W8A8 for FP8 block checkpoints), CPU.

Reproducers of defects found by trying the feature as a user would (README "FP8 block checkpoints ... run W8A8
by default"), fixed since: an explicit ``dynamic`` that runs nowhere now says why (a note on stderr), and a
static-activation FP8 checkpoint is refused by name (``feature-not-servable``) instead of failing to load
its weights. The other tests pin what already worked.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.errors import EngineError
from atomtool.serve import LLM
from tests.checkpoints import write_fp8_block_checkpoint, write_hf_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("w8a8u") / "src", "llama", seed=5)


@pytest.fixture(scope="module")
def fp8_b16(src, tmp_path_factory):
    """(16, 16) blocks: a K block W8A8 does not serve (README: stays weight-only)."""
    return write_fp8_block_checkpoint(src, tmp_path_factory.mktemp("w8a8u") / "b16", block=(16, 16))


def generate(path, *args):
    return CliRunner().invoke(app, ["generate", str(path), "--prompt", "hello world", "--max-tokens", "2",
                                    "--device", "cpu", *args], env={"COLUMNS": "200"})


@pytest.mark.parametrize("value", ["Dynamic", "weight_only", ""])
def test_api_rejects_bad_value_before_loading(src, value):
    """Works: a wrong spelling through the Python API is an EngineError naming the choices."""
    with pytest.raises(EngineError, match="expected one of auto, dynamic, weight-only"):
        LLM(str(src), device="cpu", fp8_activations=value)


def test_explicit_dynamic_on_unsupported_block_says_so(fp8_b16):
    llm = LLM(str(fp8_b16), device="cpu", dtype="bfloat16", fp8_activations="dynamic")
    assert llm.engine.act_quant is None  # README: blocks other than 32/64/128 along K stay weight-only
    res = generate(fp8_b16, "--dtype", "bfloat16", "--fp8-activations", "dynamic")
    assert res.exit_code == 0, res.output
    assert "weight-only" in res.output.lower() or "w8a8" in res.output.lower(), res.output


def test_explicit_dynamic_on_plain_model_says_so(src):
    res = generate(src, "--fp8-activations", "dynamic")
    assert res.exit_code == 0, res.output
    assert "fp8" in res.output.lower(), res.output


@pytest.fixture(scope="module")
def fp8_static(src, tmp_path_factory):
    """An FP8 block checkpoint with ``activation_scheme: static`` and per-layer ``input_scale`` tensors."""
    import json

    dst = write_fp8_block_checkpoint(src, tmp_path_factory.mktemp("w8a8u") / "static", block=(32, 32))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["activation_scheme"] = "static"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(dst / "model.safetensors")
    for key in [k for k in tensors if k.endswith(".weight_scale_inv")]:
        tensors[key.replace(".weight_scale_inv", ".input_scale")] = torch.tensor(0.01)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("value", ["auto", "dynamic", "weight-only"])
def test_static_activation_checkpoint_clear_error(fp8_static, value):
    res = generate(fp8_static, "--dtype", "bfloat16", "--fp8-activations", value)
    assert res.exit_code == 1, res.output
    assert "missing tensors" not in res.output, res.output
    assert "static" in res.output or "input_scale" in res.output, res.output


def test_inspect_names_static_activation_scales(fp8_static):
    """inspect says what generate refuses: the static activation scheme, as a feature-not-servable finding."""
    res = CliRunner().invoke(app, ["inspect", str(fp8_static), "--json"])
    assert res.exit_code == 0, res.output
    import json

    findings = json.loads(res.stdout)["findings"]
    hit = [f for f in findings if f["code"] == "feature-not-servable"]
    assert hit and "activation_scheme 'static'" in hit[0]["message"], findings


def test_mla_kv_b_proj_is_not_counted_as_w8a8(tmp_path):
    """MLA's kv_b_proj is consumed dequantized in the absorbed form (W_UK / W_UV), never as a Linear: under
    dynamic it is left weight-only and not counted, while the MLA projections that run as Linears (fused q_a /
    kv_a, q_b, o_proj) and the FP8 experts run W8A8."""
    src = write_hf_checkpoint(tmp_path / "src", "deepseek_v3", seed=2)
    fp8 = write_fp8_block_checkpoint(src, tmp_path / "fp8", block=(32, 32), float_dtype=None)
    llm = LLM(str(fp8), device="cpu", dtype="float32", fp8_activations="dynamic", kv_cache_memory=1 << 22)
    mods = dict(llm.engine.model.named_modules())
    kv_b = [m for n, m in mods.items() if n.endswith("self_attn.kv_b_proj")]
    assert kv_b and all(m.block_size is not None and m.act_quant is None for m in kv_b)
    on = {n.rsplit(".", 1)[-1] for n, m in mods.items() if getattr(m, "act_quant", None)}
    assert {"o_proj", "q_b_proj"} <= on and "kv_b_proj" not in on, on
