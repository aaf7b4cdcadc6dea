"""Defects a fresh-user tester found in ``atomtool inspect``'s sliding-window and architecture handling
(CLI through typer's CliRunner: exit code + message). Oracles are transformers' own config classes and
modeling code, never inspect's output.

1. ``sliding_window`` on a Llama config was applied, though ``LlamaConfig`` has no sliding window at all
   (its logits are identical with and without the key);
2. transformers architectures atomtool has no family for (Gemma2/Gemma3) exited 1 with
   ``unknown-architecture`` while gpt-oss (also not servable) only got a warning;
3. a window longer than the model's context was counted in full; malformed ``sliding_window`` /
   ``use_sliding_window`` / ``layer_types`` were silently read as "no window"; a config without
   ``num_hidden_layers`` showed "?" without saying why;
4. a servable Mistral with a sliding window said nothing about the engine capping sequences at the window.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers.cache_utils import get_layer_types_and_kwargs

from atomtool.inspect import memory as mem
from tests.checkpoints import write_hf_checkpoint
from tests.inspect_cli import config_only, inspect_json, run_inspect
from tests.test_inspect_swa_params import GEMMA2_9B, GEMMA3_1B, MISTRAL_7B_V01, QWEN25_7B

REALWORLD = Path(__file__).resolve().parent / "data" / "realworld" / "configs"


_run = run_inspect
_json = inspect_json
_config_only = config_only


def _codes(obj: dict, severity: str | None = None) -> list[str]:
    return [f["code"] for f in obj["findings"] if severity is None or f["severity"] == severity]


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint written by transformers' save_pretrained (2 layers, max_position 512)."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("llama") / "m", "llama", seed=3, dtype=torch.bfloat16)


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ----------------------------------------------------------------------------- 1. Llama has no window


def _logits(model_type: str, window: int | None) -> torch.Tensor:
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        sliding_window=window)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.arange(1, 21).unsqueeze(0)).logits


def test_transformers_llama_ignores_sliding_window_mistral_does_not():
    """The premise, from transformers' modeling code: a 4-token window changes Mistral's logits on a
    20-token input, and leaves Llama's bitwise identical."""
    assert torch.equal(_logits("llama", None), _logits("llama", 4))
    assert not torch.allclose(_logits("mistral", None), _logits("mistral", 4))


def test_llama_fixture_with_sliding_window_is_full_attention(llama_ckpt, tmp_path):
    d = _with_config(llama_ckpt, tmp_path / "w", sliding_window=64)
    res = _run(str(d), "--gpu-memory", "1")
    assert res.exit_code == 0, res.output
    assert "no full-attention layer" not in res.stdout and "at most 64 tokens" not in res.stdout
    assert "2 layers x 128 B (gqa" in res.stdout  # 2 x 2 KV heads x head_dim 16 x BF16, per token
    assert "sliding-window-ignored" in res.stdout and "context-capped-at-window" not in res.stdout
    obj, code = _json(d)
    assert code == 0 and obj["servable"] is True
    assert (obj["memory"]["kv_layers"], obj["memory"]["swa_layers"], obj["memory"]["sliding_window"]) == (2, 0, None)
    (f,) = [f for f in obj["findings"] if f["code"] == "sliding-window-ignored"]
    assert f["severity"] == "info" and "sliding_window 64 is ignored" in f["message"] and "'llama'" in f["message"]


def test_real_llama31_config_with_sliding_window_counts_every_layer(tmp_path):
    cfg = json.loads((REALWORLD / "meta-llama__Llama-3.1-8B.json").read_text())
    plain, code0 = _json(_config_only(tmp_path, cfg, "plain"))
    windowed, code1 = _json(_config_only(tmp_path, {**cfg, "sliding_window": 4096}, "w"))
    assert code0 == code1 == 0
    # 32 layers x (K + V) x 8 KV heads x head_dim 128 x BF16, by hand
    assert plain["memory"]["kv_bytes_per_token"] == windowed["memory"]["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert windowed["memory"]["swa_layers"] == 0


#: the model_types the brief names, plus more families with a sliding window in transformers
MODEL_TYPES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
               "gemma3_text", "gpt_oss", "phi3", "starcoder2", "deepseek_v3", "glm_moe_dsa", "ministral", "smollm3",
               "cohere2", "olmo3", "exaone4", "vaultgemma", "phimoe", "dots1"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("use_sliding_window", [None, False, True])
def test_window_applies_exactly_as_transformers_config_classes_say(model_type, use_sliding_window):
    """Oracle per model_type: transformers' config class built from the same fields. Its KV-cache layer
    types (``get_layer_types_and_kwargs``) say which layers slide; a window the class does not declare as a
    field is never read by the modeling code (the Llama test above), so such "sliding" layers are full."""
    fields = {"sliding_window": 64, "num_hidden_layers": 4, "max_window_layers": 2}
    if use_sliding_window is not None:
        fields["use_sliding_window"] = use_sliding_window
    hf = transformers.AutoConfig.for_model(model_type, **fields)
    declared = {f.name for f in dataclasses.fields(type(hf))}
    types, kwargs = get_layer_types_and_kwargs(hf)
    slides = "sliding_window" in declared and hf.sliding_window == 64
    expected = ["sliding" if t == "sliding_attention" and slides else "full" for t in types]
    flat = {"model_type": model_type, **fields}
    assert mem.layer_attention_kinds(flat) == expected
    if "sliding" in expected:
        assert mem.effective_sliding_window(flat) == kwargs["sliding_window"] == 64
    if not slides:  # (SmolLM3 keeps a window its layer_types never use: either answer is right there)
        assert mem.effective_sliding_window(flat) is None


# ----------------------------------------------------------------------------- 2. Gemma: a warning, exit 0


@pytest.mark.parametrize("cfg", [GEMMA2_9B, GEMMA3_1B], ids=["gemma-2-9b", "gemma-3-1b-it"])
def test_gemma_is_not_servable_warning_not_unknown_architecture(cfg, tmp_path):
    d = _config_only(tmp_path, cfg)
    obj, code = _json(d)
    assert code == 0, obj["findings"]
    assert "unknown-architecture" not in _codes(obj) and _codes(obj, "error") == []
    (f,) = [f for f in obj["findings"] if f["code"] == "architecture-not-servable"]
    arch = cfg["architectures"][0]
    assert f["severity"] == "warning" and arch in f["message"] and "does not serve" in f["message"]
    assert obj["servable"] is False and obj["totals"]["parameters"] > 0 and obj["memory"]["kv_bytes_per_token"] > 0
    table = _run(str(d))
    assert table.exit_code == 0 and "architecture-not-servable" in table.stdout
    assert re.search(r"\bservable\W+no\b", table.stdout)


def test_architecture_nobody_knows_is_still_an_error(tmp_path):
    cfg = {**GEMMA2_9B, "architectures": ["Gemma2ForCausalLMM"]}  # a typo: neither atomtool nor transformers
    obj, code = _json(_config_only(tmp_path, cfg))
    assert code == 1 and _codes(obj, "error") == ["unknown-architecture"]
    assert "'Gemma2ForCausalLMM'" in obj["findings"][0]["message"]


# ----------------------------------------------------------------------------- 3. odd values


def test_window_longer_than_the_context_is_capped(tmp_path):
    cfg = {**MISTRAL_7B_V01, "sliding_window": 1_000_000}  # max_position_embeddings 32768
    d = _config_only(tmp_path, cfg)
    res = _run(str(d))
    assert res.exit_code == 0, res.output
    # 32 layers x 4096 B/token (2 x 8 KV heads x 128 x BF16) x 32768 tokens = 4 GiB, not 122.07 GiB
    assert "32 layers x 4096 B/token, at most 32,768 tokens each = 4.00 GiB" in res.stdout
    assert "sliding_window 1,000,000 exceeds max_position_embeddings 32,768" in res.stdout
    assert "122.07 GiB" not in res.stdout
    obj, _ = _json(d)
    assert obj["memory"]["sliding_window"] == 32768
    assert mem.kv_bytes_for_context(obj["memory"], 10**6) == 32 * 4096 * 32768


@pytest.mark.parametrize("value", ["4096", 0, -4096, True, [4096], 4096.0])
def test_malformed_sliding_window_is_config_invalid(value, tmp_path):
    cfg = {**MISTRAL_7B_V01, "sliding_window": value}
    if not isinstance(value, int) or isinstance(value, bool):  # transformers' strict field type: int | None
        with pytest.raises(Exception, match="sliding_window"):
            transformers.AutoConfig.for_model("mistral", sliding_window=value)
    # (0 and negatives transformers keeps, but a window of no tokens cannot be sized: refused as well)
    d = _config_only(tmp_path, cfg)
    res = _run(str(d))
    assert res.exit_code == 1
    assert f"sliding_window must be a positive integer (tokens) or null, got {value!r}" in res.stdout
    assert "config-invalid" in res.stdout and "sliding_window must be" in res.stderr
    obj, _ = _json(d)
    assert obj["memory"]["kv_bytes_per_token"] is None and obj["servable"] is False


def test_null_window_is_no_window_and_ignored_field_is_not_judged(tmp_path):
    obj, code = _json(_config_only(tmp_path, {**MISTRAL_7B_V01, "sliding_window": None}, "null"))
    assert code == 0 and obj["memory"]["swa_layers"] == 0 and _codes(obj, "error") == []
    # LlamaConfig never reads sliding_window (transformers keeps "4096" as is): not an error
    llama = json.loads((REALWORLD / "meta-llama__Llama-3.1-8B.json").read_text())
    assert transformers.AutoConfig.for_model("llama", sliding_window="4096").sliding_window == "4096"
    obj, code = _json(_config_only(tmp_path, {**llama, "sliding_window": "4096"}, "llama"))
    assert code == 0 and _codes(obj, "error") == []


@pytest.mark.parametrize("value", ["true", 1])
def test_use_sliding_window_not_a_bool_is_config_invalid(value, tmp_path):
    with pytest.raises(Exception, match="use_sliding_window"):
        transformers.AutoConfig.for_model("qwen2", use_sliding_window=value)
    res = _run(str(_config_only(tmp_path, {**QWEN25_7B, "use_sliding_window": value})))
    assert res.exit_code == 1
    assert f"use_sliding_window must be true or false, got {value!r}" in res.stdout


@pytest.mark.parametrize("layer_types,needle", [
    (["sliding_attention", "full_attention"] * 20, "layer_types has 40 entries but num_hidden_layers is 42"),
    (["sliding_attention", "global"] * 21, "layer_types has unknown layer type(s) 'global'"),
    ("sliding_attention", "layer_types must be a list"),
])
def test_bad_layer_types_are_config_invalid(layer_types, needle, tmp_path):
    with pytest.raises(Exception, match="layer_types"):
        transformers.AutoConfig.for_model("gemma2", num_hidden_layers=42, layer_types=layer_types)
    res = _run(str(_config_only(tmp_path, {**GEMMA2_9B, "layer_types": layer_types})))
    assert res.exit_code == 1 and needle in res.stdout and "config-invalid" in res.stdout


def test_missing_num_hidden_layers_is_explained(tmp_path):
    # a model_type transformers does not know (remote code): no default to take, the count is unknown
    # (a known one takes its config class's default: tests/test_inspect_tester4.py)
    cfg = {k: v for k, v in MISTRAL_7B_V01.items() if k != "num_hidden_layers"}
    cfg["model_type"] = "my_remote_mistral"
    d = _config_only(tmp_path, cfg)
    res = _run(str(d))
    # a servable architecture: the engine's loader refuses a config.json without its layer count
    assert res.exit_code == 1, res.output
    assert re.search(r"\blayers\W+\?", res.stdout)
    assert "config-missing-field" in res.stdout
    assert "config.json has no num_hidden_layers (shown as '?'): the engine refuses a config without it" \
           in res.stdout
    # not served by atomtool: only the figures are unknown
    d = _config_only(tmp_path, {**cfg, "architectures": ["MyRemoteForCausalLM"]}, "remote")
    res = _run(str(d))
    assert "config.json has no num_hidden_layers: the layer count, KV cache per token and parameter estimate " \
           "cannot be computed (shown as '?')" in res.stdout


# ----------------------------------------------------------------------------- 4. servable + sliding


def test_servable_mistral_with_window_says_the_engine_caps_sequences(llama_ckpt, tmp_path):
    from atomtool.serve.models.llama import LlamaForCausalLM

    d = _with_config(llama_ckpt, tmp_path / "mistral", architectures=["MistralForCausalLM"], model_type="mistral",
                     sliding_window=64)
    res = _run(str(d), "--gpu-memory", "1")
    assert res.exit_code == 0, res.output
    assert re.search(r"\bservable\W+yes\b", res.stdout)
    assert "context-capped-at-window" in res.stdout
    assert ("atomtool serves at most 64 tokens per sequence: sliding-window attention is not implemented (exact "
            "within the window); the model's max_position_embeddings is 512") in res.stdout
    obj, _ = _json(d)
    (f,) = [f for f in obj["findings"] if f["code"] == "context-capped-at-window"]
    assert f["severity"] == "warning" and obj["servable"] is True
    # the engine's own cap for this config (the rule the finding mirrors)
    model = LlamaForCausalLM(obj["config_flat"], None, torch.float32, "meta")
    assert model.context_limit == 64


@pytest.mark.parametrize("cfg,why", [
    ({**QWEN25_7B, "max_window_layers": 0}, "use_sliding_window false: no layer slides"),
    ({**MISTRAL_7B_V01, "sliding_window": 32768}, "the window is the whole context"),
    ({**GEMMA2_9B}, "not served by atomtool"),
])
def test_no_cap_finding_when_the_engine_does_not_cap(cfg, why, tmp_path):
    obj, code = _json(_config_only(tmp_path, cfg))
    assert code == 0, why
    assert "context-capped-at-window" not in _codes(obj), why
