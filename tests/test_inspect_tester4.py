"""Fresh-user tester report 4: inspect must agree with transformers and with the engine.

1. a config transformers' own config class refuses (strict dataclass field types) is ``config-invalid``
   (exit 1, convert refuses), with transformers' message: the same one the engine's loader raises;
   num_attention_heads not a multiple of num_key_value_heads too;
2. ``--gpu-memory``'s longest context respects the serving cap at the sliding window;
3. the required-tensor check reads ``mlp_layer_types`` (one rule with the KV/parameter estimates);
4. a size field config.json lacks takes transformers' config-class default (MistralConfig: 32 layers);
   ``num_key_value_heads`` is taken by inspect and the engine's loader alike (then checked against the
   weights: tests/test_config_weight_agreement.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.errors import ConfigError
from tests.checkpoints import write_hf_checkpoint
from tests.inspect_cli import config_only, inspect_json, run_inspect
from tests.test_inspect_swa_params import MISTRAL_7B_V01, QWEN25_7B

_run = run_inspect
_json = inspect_json
_config_only = config_only


def _with_config(src: Path, dst: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    for k in drop:
        cfg.pop(k, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints written by transformers' save_pretrained (2-4 layers)."""
    root = tmp_path_factory.mktemp("t4")
    return {arch: write_hf_checkpoint(root / arch, arch, seed=4, dtype=torch.bfloat16)
            for arch in ("qwen2", "llama", "deepseek_v32", "glm_moe_dsa")}


# ----------------------------------------------------------------------------- 1. transformers refuses


BAD_CONFIGS = [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": "0"}, "max_window_layers"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1.5}, "max_window_layers"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": None}, "max_window_layers"),
    ("llama", {"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ("llama", {"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ("llama", {"attention_bias": "no"}, "attention_bias"),
    ("llama", {"mlp_bias": 1}, "mlp_bias"),
    ("llama", {"eos_token_id": "2"}, "eos_token_id"),
    ("llama", {"rope_parameters": "x"}, "rope_parameters"),
]


@pytest.mark.parametrize("arch,changes,field", BAD_CONFIGS,
                         ids=[f"{a}-{f}-{list(c.values())[-1]!r}" for a, c, f in BAD_CONFIGS])
def test_config_transformers_refuses_is_config_invalid(ckpts, tmp_path, arch, changes, field):
    from atomtool.inspect.dsa import flatten_dsa_config
    from atomtool.serve.layers.rotary import hf_config_from_flat

    d = _with_config(ckpts[arch], tmp_path / "m", **changes)
    cfg = json.loads((d / "config.json").read_text())
    # the oracle: transformers itself refuses it, and the engine's loader says so with this message
    with pytest.raises(ConfigError) as engine:
        hf_config_from_flat(flatten_dsa_config(cfg))
    assert field in str(engine.value)
    res = _run(str(d))
    assert res.exit_code == 1, res.output
    assert re.search(r"\bservable\W+no\b", res.stdout)
    assert "config-invalid" in res.stdout
    assert str(engine.value) in res.stdout  # one line, the engine's own words
    obj, rc = _json(d)
    assert rc == 1 and obj["servable"] is False
    (f,) = [f for f in obj["findings"] if f["code"] == "config-invalid"]
    assert f["severity"] == "error" and f["message"] == str(engine.value) and "\n" not in f["message"]


def test_convert_refuses_a_config_transformers_refuses(ckpts, tmp_path):
    d = _with_config(ckpts["qwen2"], tmp_path / "m", use_sliding_window=True, sliding_window=8,
                     max_window_layers="0")
    res = CliRunner().invoke(app, ["convert", str(d), str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    assert "transformers cannot build its config" in res.output and "max_window_layers" in res.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_heads_not_a_multiple_of_kv_heads_is_config_invalid(ckpts, tmp_path):
    cfg = json.loads((ckpts["llama"] / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv = heads - 1
    assert heads % kv
    d = _with_config(ckpts["llama"], tmp_path / "m", num_key_value_heads=kv)
    res = _run(str(d))
    assert res.exit_code == 1, res.output
    assert (f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
            in res.stdout)


def test_valid_fixtures_stay_clean(ckpts):
    for arch, d in ckpts.items():
        obj, rc = _json(d)
        assert rc == 0 and obj["servable"] is True, (arch, obj["findings"])
        assert not [f for f in obj["findings"] if f["severity"] == "error"], arch


# ----------------------------------------------------------------------------- 2. longest context vs cap


def _context_row(stdout: str, gb: str) -> str:
    return next(line for line in stdout.splitlines() if f"longest context in {gb} GB" in line)


def test_mistral_v01_longest_context_respects_the_window_cap(tmp_path):
    d = _config_only(tmp_path, MISTRAL_7B_V01)
    res = _run(str(d), "--gpu-memory", "20")
    assert res.exit_code == 0, res.output
    assert "4,096 tokens (capped by the sliding window; model max 32,768)" in _context_row(res.stdout, "20")
    assert "not limited" not in res.stdout
    assert "atomtool serves at most 4,096 tokens" in res.stdout
    obj, _ = _json(d, "--gpu-memory", "20")
    assert obj["memory"]["max_context_tokens"] == 4096
    assert obj["memory"]["context_capped_at_window"] == 4096


def test_memory_shorter_than_the_window_is_not_called_capped(tmp_path):
    d = _config_only(tmp_path, MISTRAL_7B_V01)
    obj, _ = _json(d, "--gpu-memory", "20")
    weights = obj["memory"]["weights_bytes"]
    per_token = 32 * obj["memory"]["swa_bytes_per_token_per_layer"]
    gb = (weights + 1000 * per_token) / 1e9  # room for 1000 tokens of sliding-window KV
    obj, _ = _json(d, "--gpu-memory", f"{gb}")
    assert obj["memory"]["max_context_tokens"] == 1000
    res = _run(str(d), "--gpu-memory", f"{gb}")
    assert "1,000 tokens (model max 32,768)" in _context_row(res.stdout, f"{gb:g}")


def test_qwen2_sliding_layers_cap_the_longest_context(tmp_path):
    cfg = {**QWEN25_7B, "use_sliding_window": True, "max_window_layers": 14, "sliding_window": 4096}
    d = _config_only(tmp_path, cfg)
    res = _run(str(d), "--gpu-memory", "80")
    assert res.exit_code == 0, res.output
    row = _context_row(res.stdout, "80")
    assert f"4,096 tokens (capped by the sliding window; model max {cfg['max_position_embeddings']:,})" in row
    assert "context-capped-at-window" in res.stdout
    obj, _ = _json(d, "--gpu-memory", "80")
    assert obj["memory"]["max_context_tokens"] == 4096 and obj["memory"]["swa_layers"] == 14


# ----------------------------------------------------------------------------- 3. mlp_layer_types


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_required_tensors_read_mlp_layer_types(ckpts, tmp_path, arch):
    cfg = json.loads((ckpts[arch] / "config.json").read_text())
    assert "sparse" in cfg["mlp_layer_types"] and cfg.get("first_k_dense_replace")
    d = _with_config(ckpts[arch], tmp_path / "m", drop=("first_k_dense_replace",))
    # transformers reads the MLP layout from mlp_layer_types: it builds this config's model unchanged
    hf = transformers.AutoConfig.from_pretrained(d)
    assert hf.mlp_layer_types == cfg["mlp_layer_types"]
    res = _run(str(d))
    assert res.exit_code == 0, res.output
    assert "missing-tensors" not in res.stdout
    # and the check still bites: a config claiming every layer is MoE misses the dense layer's experts
    d2 = _with_config(ckpts[arch], tmp_path / "m2", drop=("first_k_dense_replace",),
                      mlp_layer_types=["sparse"] * cfg["num_hidden_layers"])
    res = _run(str(d2))
    assert res.exit_code == 1 and "required tensor(s) missing" in res.stdout
    assert "model.layers.0.mlp.gate.weight" in res.stdout


# ----------------------------------------------------------------------------- 4. transformers' defaults


def test_mistral_without_num_hidden_layers_takes_mistralconfig_default(tmp_path):
    from atomtool.serve.model_config import check_size_fields

    n = transformers.MistralConfig().num_hidden_layers  # the oracle: 32
    cfg = {k: v for k, v in MISTRAL_7B_V01.items() if k != "num_hidden_layers"}
    d = _config_only(tmp_path, cfg)
    # the engine's loader refuses it (it does not assume a reference model's layer count) ...
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        check_size_fields(cfg, d / "config.json")
    res = _run(str(d), "--gpu-memory", "20")
    assert res.exit_code == 1, res.output  # ... so inspect says so: an error, not servable
    assert re.search(r"\bservable\W+no\b", res.stdout)
    assert (f"config.json has no num_hidden_layers (inspect sizes the model with transformers' MistralConfig "
            f"default {n}): the engine refuses a config without it") in res.stdout
    # ... and sizes it as transformers would: layers, Memory section and window cap as with the field
    assert re.search(rf"\blayers\W+{n}\b", res.stdout)
    assert "context-capped-at-window" in res.stdout and "atomtool serves at most 4,096 tokens" in res.stdout
    assert "Memory" in res.stdout and f"{n} layers x 4096 B/token" in res.stdout
    obj, _ = _json(d)
    assert obj["config_flat"]["num_hidden_layers"] == n
    full, _ = _json(_config_only(tmp_path, MISTRAL_7B_V01, "full"))
    assert obj["memory"]["kv_bytes_per_token"] == full["memory"]["kv_bytes_per_token"]
    assert obj["totals"]["parameters"] == full["totals"]["parameters"]


def test_unserved_family_without_num_hidden_layers_takes_the_default_as_a_warning(tmp_path):
    n = transformers.Phi3Config().num_hidden_layers
    cfg = {k: v for k, v in MISTRAL_7B_V01.items() if k != "num_hidden_layers"}
    cfg.update(architectures=["Phi3ForCausalLM"], model_type="phi3")
    res = _run(str(_config_only(tmp_path, cfg)))
    assert res.exit_code == 0, res.output
    assert (f"config.json has no num_hidden_layers: using transformers' Phi3Config default {n}, as "
            f"transformers does") in res.stdout
    assert re.search(rf"\blayers\W+{n}\b", res.stdout)


def test_mistral_without_kv_heads_takes_mistralconfig_default(tmp_path):
    from atomtool.serve.model_config import check_size_fields, complete_config

    cfg = {k: v for k, v in MISTRAL_7B_V01.items() if k != "num_key_value_heads"}
    kv = transformers.MistralConfig(**{k: v for k, v in cfg.items() if k != "model_type"}).num_key_value_heads
    d = _config_only(tmp_path, cfg)
    check_size_fields(cfg, d / "config.json")  # the engine's loader takes it too, with the same value
    assert complete_config(cfg, d / "config.json")[1]["num_key_value_heads"] == kv
    res = _run(str(d))
    assert res.exit_code == 0, res.output
    assert f"config.json has no num_key_value_heads: using transformers' MistralConfig default {kv}" in res.stdout
    obj, _ = _json(d)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert obj["memory"]["swa_bytes_per_token_per_layer"] == 2 * kv * head_dim * 2


def test_llama_without_kv_heads_is_plain_multi_head_silently(tmp_path):
    cfg = {**{k: v for k, v in MISTRAL_7B_V01.items() if k not in ("num_key_value_heads", "sliding_window")},
           "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert transformers.LlamaConfig(num_attention_heads=32).num_key_value_heads == 32
    obj, rc = _json(_config_only(tmp_path, cfg))
    assert rc == 0 and not [f for f in obj["findings"] if f["code"] == "config-missing-field"]
    assert obj["memory"]["kv_bytes_per_token_per_layer"] == 2 * 32 * 128 * 2
