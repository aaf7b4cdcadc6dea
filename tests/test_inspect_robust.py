"""Hostile / malformed config values never crash classification: build_report either returns a report
(that renders and serialises) or raises an AtomtoolError (one-line CLI error)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from atomtool.errors import AtomtoolError
from atomtool.inspect.classify import build_report
from atomtool.inspect.report import render, to_json
from atomtool.inspect.types import TensorInfo

REAL = Path(__file__).resolve().parent / "data" / "realworld" / "configs"  # vendored real configs
BASES = {
    "glm": {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_hidden_layers": 4,
            "hidden_size": 64, "vocab_size": 128, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "num_attention_heads": 4, "index_topk": 8,
            "index_n_heads": 4, "index_head_dim": 16, "index_topk_freq": 2, "n_routed_experts": 4,
            "moe_intermediate_size": 16, "intermediate_size": 32, "first_k_dense_replace": 1, "dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                    "modules_to_not_convert": ["lm_head"]}},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
              "hidden_size": 64, "vocab_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "torch_dtype": "float16",
              "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4,
                                                        "group_size": 32}}}, "ignore": ["re:.*lm_head"]}},
}
TENSORS = {
    n: TensorInfo(n, d, s, "model.safetensors", (0, b))
    for n, d, s, b in [
        ("model.layers.0.self_attn.q_a_proj.weight", "F8_E4M3", (32, 64), 2048),
        ("model.layers.0.self_attn.q_a_proj.weight_scale_inv", "F32", (1, 1), 4),
        ("model.layers.0.self_attn.indexer.wk.weight", "BF16", (16, 64), 2048),
        ("model.layers.1.mlp.gate.weight", "BF16", (4, 64), 512),
        ("model.layers.0.self_attn.q_proj.weight_packed", "I32", (64, 8), 2048),
        ("model.layers.0.self_attn.q_proj.weight_scale", "BF16", (64, 2), 256),
        ("model.layers.0.self_attn.q_proj.weight_shape", "I64", (2,), 16),
        ("lm_head.weight", "BF16", (128, 64), 16384),
        ("model.norm.weight", "BF16", (64,), 128),
    ]
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def _check(cfg: dict, tensors: dict) -> None:
    try:
        report = build_report("fuzz", cfg, tensors, gpu_memory_gb=80)
    except AtomtoolError as exc:
        assert "\n" not in str(exc)
        return
    json.dumps(to_json(report, show_tensors=True), allow_nan=True)
    render(report, Console(file=io.StringIO(), width=100), show_tensors=True)


@pytest.mark.parametrize("base", sorted(BASES))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_config_values_never_crash(base, data):
    cfg = json.loads(json.dumps(BASES[base]))
    keys = sorted(cfg) + ["indexer_types", "index_topk_pattern", "index_skip_topk_offset", "dsa_config",
                          "text_config", "tie_word_embeddings", "head_dim", "layer_types", "mlp_layer_types"]
    for key in data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=4)):
        cfg[key] = data.draw(json_values)
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and data.draw(st.booleans()):
        for key in data.draw(st.lists(st.sampled_from(sorted(q) + ["ignore", "weight_block_size", "group_size",
                                                                   "exclude_modules", "bits", "dynamic"]),
                                      min_size=1, max_size=3)):
            q[key] = data.draw(json_values)
    _check(cfg, TENSORS if data.draw(st.booleans()) else {})


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_real_configs_with_random_values_never_crash(data):
    path = data.draw(st.sampled_from(sorted(REAL.glob("*.json"))))
    cfg = json.loads(path.read_text())
    for key in data.draw(st.lists(st.sampled_from(sorted(cfg)), min_size=1, max_size=3)):
        cfg[key] = data.draw(json_values)
    _check(cfg, {})


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("n", [10**12, 10**6, -1, True, 2.5])
def test_absurd_layer_counts_are_bounded(base, n):
    cfg = json.loads(json.dumps(BASES[base]))
    cfg["num_hidden_layers"] = n
    cfg["num_nextn_predict_layers"] = 10**12
    _check(cfg, {})  # returns quickly: no 10^12-entry schedule, no 10^12-iteration estimate
