"""flatten_dsa_config (every config form) and layer_roles (THE schedule: precedence and errors).

Expected schedules are written out from the rule in research/dsa.md §2 (HF transformers / vLLM / SGLang:
layer i is full iff max(i - offset + 1, 0) % freq == 0) and cross-checked against transformers'
own GlmMoeDsaConfig where it applies.
"""

from __future__ import annotations

import pytest

from atomtool.errors import ConfigError
from atomtool.inspect.dsa import flatten_dsa_config, layer_roles, previous_full_layer

BASE = {"model_type": "glm_moe_dsa", "num_hidden_layers": 8, "qk_rope_head_dim": 64, "index_topk": 2048,
        "index_n_heads": 32, "index_head_dim": 128}
F, S = "full", "shared"


def test_flat_form_defaults():
    flat = flatten_dsa_config(dict(BASE))
    assert flat["indexer_types"] == [F] * 8
    assert flat["index_rope_dim"] == 64  # default: qk_rope_head_dim
    # GLM's indexer rope is interleaved when the flag is absent (transformers' GlmMoeDsaIndexer)
    assert flat["indexer_rope_interleave"] is True
    assert flatten_dsa_config({**BASE, "indexer_rope_interleave": False})["indexer_rope_interleave"] is False


def test_flat_form_deepseek_v32_defaults_when_fields_missing():
    flat = flatten_dsa_config({"model_type": "deepseek_v32", "num_hidden_layers": 2, "qk_rope_head_dim": 64})
    assert (flat["index_topk"], flat["index_n_heads"], flat["index_head_dim"]) == (2048, 64, 128)
    assert flat["indexer_rope_interleave"] is False  # DeepSeek-V3.2's indexer rope is NeoX


def test_text_config_form_and_top_level_override():
    raw = {"architectures": ["X"], "index_topk_freq": 2,
           "text_config": dict(BASE, index_topk_freq=4, index_skip_topk_offset=2)}
    flat = flatten_dsa_config(raw)
    # the top-level freq 2 (a runtime override) wins over text_config's 4
    assert flat["indexer_types"] == [F, F, S, F, S, F, S, F]
    assert "architectures" not in flat  # the text config, not the wrapper


def test_nested_dsa_config_form():
    raw = {"model_type": "x", "num_hidden_layers": 6, "qk_rope_head_dim": 32,
           "dsa_config": {"topk": 512, "n_heads": 16, "head_dim": 64, "rope_dim": 0, "topk_freq": 3,
                          "skip_topk_offset": 1}}
    flat = flatten_dsa_config(raw)
    assert (flat["index_topk"], flat["index_n_heads"], flat["index_head_dim"], flat["index_rope_dim"]) == (512, 16, 64, 0)
    # offset 1: full iff i % 3 == 0
    assert flat["indexer_types"] == [F, S, S, F, S, S]


def test_nested_dsa_config_keeps_flat_fields_and_schedule_keys():
    raw = dict(BASE, index_topk=99, dsa_config={"index_topk": 7, "use_index_cache": True})
    flat = flatten_dsa_config(raw)
    assert flat["index_topk"] == 99  # explicit flat field wins over the nested one
    assert flat["use_index_cache"] is True and "index_use_index_cache" not in flat


def test_non_dsa_config_is_plain_copy():
    raw = {"model_type": "llama", "num_hidden_layers": 2}
    flat = flatten_dsa_config(raw)
    assert flat == raw and flat is not raw and "indexer_types" not in flat
    assert layer_roles(flat) == ["dense", "dense"]


@pytest.mark.parametrize("freq,offset,expected", [
    (4, 3, [F, F, F, S, S, S, F, S]),  # GLM-5.2: full {0,1,2,6,...}
    (4, None, [F, F, S, S, S, F, S, S]),  # default offset 2: max(i-1,0) % 4
    (2, 1, [F, S, F, S, F, S, F, S]),
    (1, 3, [F] * 8),
    (None, None, [F] * 8),
])
def test_freq_offset_rule(freq, offset, expected):
    cfg = dict(BASE)
    if freq is not None:
        cfg["index_topk_freq"] = freq
    if offset is not None:
        cfg["index_skip_topk_offset"] = offset
    assert layer_roles(cfg) == expected


@pytest.mark.parametrize("freq,offset", [(4, 3), (2, 2), (3, 1), (1, 2)])
def test_freq_offset_rule_matches_transformers(freq, offset):
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig(num_hidden_layers=10, index_topk_freq=freq, index_skip_topk_offset=offset)
    cfg = dict(BASE, num_hidden_layers=10, index_topk_freq=freq, index_skip_topk_offset=offset)
    assert layer_roles(cfg) == hf.indexer_types


def test_precedence_indexer_types_over_pattern_over_freq():
    explicit = [F, S, F, S, F, S, F, S]
    cfg = dict(BASE, indexer_types=explicit, index_topk_pattern="FFFFFFFF", index_topk_freq=4)
    assert layer_roles(cfg) == explicit
    cfg = dict(BASE, index_topk_pattern="FSSFSSFS", index_topk_freq=2)
    assert layer_roles(cfg) == [F, S, S, F, S, S, F, S]
    cfg = dict(BASE, index_topk_pattern=["F", "S", "S", "S", "F", "S", "S", "S"])
    assert layer_roles(cfg) == [F, S, S, S, F, S, S, S]
    cfg = dict(BASE, index_topk_pattern=[F, S, F, S, F, S, F, S])  # HF's list-of-types form
    assert layer_roles(cfg) == [F, S, F, S, F, S, F, S]


@pytest.mark.parametrize("override,msg", [
    ({"indexer_types": [F, S]}, "indexer_types must list 8 layers"),
    ({"indexer_types": "full"}, "indexer_types must list 8 layers"),
    ({"indexer_types": [F] * 7 + ["sparse"]}, "unknown roles ['sparse']"),
    ({"indexer_types": [S] + [F] * 7}, "layer 0 must own an indexer"),
    ({"index_topk_pattern": "SFFFFFFF"}, "layer 0 must own an indexer"),
    ({"index_topk_pattern": "FFF"}, "index_topk_pattern must be 8 characters"),
    ({"index_topk_pattern": "FFFFFFFX"}, "index_topk_pattern must be 8 characters"),
    ({"index_topk_freq": 0}, "index_topk_freq must be an integer >= 1"),
    ({"index_topk_freq": "4"}, "index_topk_freq must be an integer >= 1"),
    ({"index_topk_freq": 4, "index_skip_topk_offset": 0}, "index_skip_topk_offset must be an integer >= 1"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"num_hidden_layers": None}, "num_hidden_layers must be a positive integer"),
])
def test_schedule_errors(override, msg):
    with pytest.raises(ConfigError) as e:
        flatten_dsa_config(dict(BASE, **override))
    assert msg in str(e.value) and str(e.value).startswith("config.json:")


def test_top_level_not_object():
    with pytest.raises(ConfigError, match="not a JSON object"):
        flatten_dsa_config([1, 2])  # type: ignore[arg-type]


def test_previous_full_layer():
    roles = [F, F, F, S, S, S, F, S]
    assert [previous_full_layer(roles, i) for i in range(8)] == [0, 1, 2, 2, 2, 2, 6, 6]
