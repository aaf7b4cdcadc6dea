"""``atomtool inspect`` and ``atomtool generate`` agree (fresh-user tester, round 5): what inspect calls
servable runs, and runs as transformers runs it; what it refuses, generate refuses with the same words.

Every case is a tiny checkpoint written by transformers' ``save_pretrained`` (config.json edited where the
case is an edit), fed to both commands on CPU:

1. a group-limited MoE router that cannot run (``n_group`` not dividing ``n_routed_experts``, 0, one expert
   per group; ``topk_group`` 0 or above ``n_group``): ``config-invalid`` in inspect, the same line in generate,
   no traceback; ``num_experts_per_tok: 0``, which transformers runs, is served as transformers serves it;
2. ``n_shared_experts: 0``: transformers writes zero-row ``shared_experts`` tensors; the engine serves the
   checkpoint (raw and converted) with transformers' greedy tokens;
3. features the engine's layers refuse (MLA without ``q_lora_rank``, MLA with ``attention_bias``, dynamic /
   longrope rope): inspect's ``feature-not-servable`` carries the engine's words, generate refuses with them.
"""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from tests import test_config_weight_agreement as agree
from tests.checkpoints import (
    dequantize_fp8_block_checkpoint,
    write_fp8_block_checkpoint,
    write_hf_checkpoint,
    write_state_dict,
)
from tests.inspect_cli import inspect_json
from tests.test_config_weight_agreement import (
    assert_refused_alike,
    edited,
    findings,
    generate_error,
    greedy_tokens,
    hf_greedy_tokens,
)

#: the shared fixtures (tiny checkpoints written once per module; a guard that no model is built)
ckpt = agree.ckpt
no_model_build = agree.no_model_build

# ----------------------------------------------------------------------------- 1. MoE router groups

ROUTER_EDITS = [  # the fixture: 8 routed experts, n_group 2, topk_group 1
    ({"n_group": 3}, "n_group (3) must divide n_routed_experts (8)"),
    ({"n_group": 0}, "n_group must be a positive integer"),
    ({"n_group": 8, "topk_group": 1}, "leaves 1 routed expert per group"),
    ({"topk_group": 3}, "topk_group (3) exceeds n_group (2)"),
    ({"topk_group": 0}, "topk_group must be a positive integer"),
]


@pytest.mark.parametrize(("changes", "needle"), ROUTER_EDITS, ids=[str(c) for c, _ in ROUTER_EDITS])
def test_router_groups_that_cannot_run_are_config_invalid_in_both(ckpt, tmp_path, no_model_build, changes,
                                                                  needle):
    bad = edited(ckpt("deepseek_v3"), tmp_path / "bad", **changes)
    found, report, rc = findings(bad, "config-invalid")
    assert rc == 1 and not report["servable"]
    assert len(found) == 1 and needle in found[0]["message"], found
    assert generate_error(bad) == found[0]["message"]


def test_router_group_default_is_named_when_config_leaves_it_out(ckpt, tmp_path, no_model_build):
    import transformers

    default = transformers.DeepseekV3Config().n_group  # 8: one of the fixture's 8 experts per group
    bad = edited(ckpt("deepseek_v3"), tmp_path / "bad", drop=("n_group",), topk_group=1)
    found, _, rc = findings(bad, "config-invalid")
    assert rc == 1 and len(found) == 1
    assert f"n_group={default} is transformers' default" in found[0]["message"]
    assert generate_error(bad) == found[0]["message"]


def test_zero_experts_per_token_runs_as_transformers_runs_it(ckpt, tmp_path):
    ok = edited(ckpt("deepseek_v3"), tmp_path / "k0", num_experts_per_tok=0)
    _, report, rc = findings(ok, "config-invalid")
    assert rc == 0 and report["servable"], report["findings"]
    assert greedy_tokens(ok) == hf_greedy_tokens(ok)


# ----------------------------------------------------------------------------- 2. n_shared_experts 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_zero_shared_experts_checkpoint_is_served_as_transformers_serves_it(tmp_path, arch):
    src = write_hf_checkpoint(tmp_path / "src", arch, seed=3, n_shared_experts=0)
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "pt") as f:  # the case: empty tensors on disk
        empty = [k for k in f.keys() if ".shared_experts." in k]
        assert empty and all(0 in f.get_slice(k).get_shape() for k in empty)
    report, rc = findings(src, "unexpected-tensors")[1:]
    assert rc == 0 and report["servable"], report["findings"]
    want = hf_greedy_tokens(src)
    assert greedy_tokens(src) == want
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "layout")])
    assert res.exit_code == 0, res.output
    assert greedy_tokens(tmp_path / "layout") == want


def test_shared_expert_rows_with_n_shared_experts_zero_are_refused_alike(ckpt, tmp_path, no_model_build):
    # transformers builds 0-row shared experts for this config and refuses the stored 32 rows (size mismatch)
    bad = edited(ckpt("deepseek_v3"), tmp_path / "bad", n_shared_experts=0)
    assert_refused_alike(bad, "mlp.shared_experts.down_proj.weight is [64, 32] but config.json implies [64, 0]",
                         "moe_intermediate_size=32 x n_shared_experts=0 = 0")


# ----------------------------------------------------------------------------- 3. features the engine refuses

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
            "original_max_position_embeddings": 256}
FEATURES = [
    ("deepseek_v3", {"q_lora_rank": None}, "MLA without q_lora_rank (a plain q_proj) is not supported"),
    ("deepseek_v3", {"attention_bias": True}, "MLA with attention_bias=true is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope type 'dynamic' (sequence-length dependent) is not supported by the engine"),
    ("llama", {"rope_parameters": LONGROPE},
     "rope type 'longrope' (sequence-length dependent) is not supported by the engine"),
]


@pytest.mark.parametrize(("arch", "overrides", "words"), FEATURES, ids=["no-q-lora", "mla-bias", "dynamic",
                                                                         "longrope"])
def test_feature_the_engine_refuses_is_not_servable_in_inspect(tmp_path, no_model_build, arch, overrides, words):
    if "rope_parameters" in overrides:  # transformers writes the rope config; edit it in
        src = write_hf_checkpoint(tmp_path / "src", arch, seed=1)
        model_dir = edited(src, tmp_path / "m", **overrides)
    else:  # transformers builds the model (plain q_proj / biased projections) and writes its tensors
        model_dir = write_hf_checkpoint(tmp_path / "m", arch, seed=1, **overrides)
    found, report, rc = findings(model_dir, "feature-not-servable")
    assert not report["servable"]
    assert [f["message"] for f in found] == [f"config.json: {words}"]
    assert [f for f in report["findings"] if f["severity"] == "error"] == []  # the config itself is valid
    line = generate_error(model_dir)
    assert line == f"{model_dir}/config.json: {words}; atomtool cannot serve this checkpoint"
    assert json.loads((model_dir / "config.json").read_text())  # (edited config readable: the case is real)


# ----------------------------------------------------------------------------- 4. fields the family does not read

IGNORED_FIELDS = [  # (fixture, config.json edit): transformers builds the same model with and without the edit
    ("deepseek_v3", {"moe_layer_freq": 2}),  # DeepSeek's remote code reads it; transformers' DeepseekV3 does not
    ("qwen2", {"sliding_window": 0, "use_sliding_window": False}),  # Qwen2MoeConfig even defaults it to 0
    ("qwen3", {"sliding_window": 0}),  # use_sliding_window absent: Qwen3Config's default false
    ("deepseek_v3", {"num_key_value_heads": 3}),  # MLA: every query head has its own K/V from the latent
    ("deepseek_v3", {"num_key_value_heads": 8}),
]


@pytest.mark.parametrize(("arch", "changes"), IGNORED_FIELDS, ids=[f"{a}-{c}" for a, c in IGNORED_FIELDS])
def test_field_the_family_does_not_read_is_not_refused(ckpt, tmp_path, arch, changes):
    src = ckpt(arch)
    model_dir = edited(src, tmp_path / "m", **changes)
    report, rc = findings(model_dir, "config-invalid")[1:]
    assert rc == 0 and report["servable"], [f for f in report["findings"] if f["severity"] != "info"]
    assert [f for f in report["findings"] if f["severity"] == "error"] == []
    want = hf_greedy_tokens(model_dir)
    assert want == hf_greedy_tokens(src)  # (the oracle: transformers ignores the edit)
    assert greedy_tokens(model_dir) == want



# ----------------------------------------------------------------------------- 5. FP8 block size from the scales


def fp8_without_quantization_config(src, root, block):
    """(an FP8 block checkpoint of ``src`` whose config.json lost ``quantization_config``, its plain-float
    dequantized copy: the oracle transformers loads without FP8 support)."""
    fp8 = write_fp8_block_checkpoint(src, root / "fp8", block=block)
    oracle = root / "oracle"
    shutil.copytree(fp8, oracle, ignore=shutil.ignore_patterns("*.safetensors"))
    write_state_dict(oracle, dequantize_fp8_block_checkpoint(fp8))
    for d in (fp8, oracle):
        cfg = json.loads((d / "config.json").read_text())
        del cfg["quantization_config"]
        (d / "config.json").write_text(json.dumps(cfg))
    return fp8, oracle


@pytest.mark.parametrize(("arch", "block"), [("deepseek_v3", 16), ("llama", (16, 32))])
def test_fp8_block_without_quantization_config_uses_the_block_inspect_infers(ckpt, tmp_path, arch, block):
    fp8, oracle = fp8_without_quantization_config(ckpt(arch), tmp_path, block)
    report, rc = inspect_json(fp8)
    assert rc == 0 and report["servable"], [f for f in report["findings"] if f["severity"] != "info"]
    want = hf_greedy_tokens(oracle)
    assert greedy_tokens(fp8) == want
    res = CliRunner().invoke(app, ["convert", str(fp8), str(tmp_path / "layout")])
    assert res.exit_code == 0, res.output
    assert "weight_block_size" not in (tmp_path / "layout" / "config.json").read_text()  # (the case)
    assert greedy_tokens(tmp_path / "layout") == want


# ----------------------------------------------------------------------------- 6. messages


def test_one_fact_one_finding(ckpt, tmp_path, no_model_build):
    bad = edited(ckpt("deepseek_v32"), tmp_path / "bad", index_topk=0)
    found, _, rc = findings(bad, "config-invalid")
    assert rc == 1
    assert [f["message"] for f in found] == ["config.json: index_topk must be a positive integer, got 0"]
    assert generate_error(bad) == found[0]["message"]


@pytest.mark.parametrize("field", ["num_hidden_layers", "qk_rope_head_dim"])
def test_dsa_config_without_a_schedule_field_names_it_and_transformers_default(ckpt, tmp_path, no_model_build,
                                                                               field):
    import transformers

    default = getattr(transformers.GlmMoeDsaConfig(), field)  # the oracle: 78 layers, rope dim 64
    bad = edited(ckpt("glm_moe_dsa"), tmp_path / "bad", drop=(field,))
    found, report, rc = findings(bad, "config-missing-field")
    named = f"{field} (transformers' GlmMoeDsaConfig default: {default})"
    assert rc == 1 and not report["servable"]
    assert [f["severity"] for f in found] == ["error"] and f"config.json has no {named}" in found[0]["message"]
    assert not [f for f in report["findings"] if f["code"] == "config-invalid"]  # not "got None" / index rope
    assert f"missing required field {named}" in generate_error(bad)


def test_missing_tensors_from_a_defaulted_schedule_field_name_the_default(ckpt, tmp_path):
    import transformers

    default = transformers.DeepseekV3Config().first_k_dense_replace  # 3: every fixture layer is dense
    bad = edited(ckpt("deepseek_v3"), tmp_path / "bad", drop=("first_k_dense_replace",))
    found, _, rc = findings(bad, "missing-tensors")
    assert rc == 1 and len(found) == 1
    msg = found[0]["message"]
    assert "model.layers.1.mlp.gate_proj.weight" in msg and "model.layers.0." not in msg  # layer 0 is dense
    assert f"first_k_dense_replace={default} is transformers' DeepseekV3Config default" in msg
    line = generate_error(bad)
    assert "model.layers.1.mlp.gate_up_proj.weight" in line and f"defaults: first_k_dense_replace={default}" in line
    assert "num_mtp_layers" not in line  # (defaulted too, but no engine model reads it)


def test_unknown_quant_method_is_named_and_scales_that_fit_no_block_are_refused_by_both(ckpt, tmp_path,
                                                                                       no_model_build):
    fp8 = write_fp8_block_checkpoint(ckpt("llama"), tmp_path / "fp8", block=24)  # no power-of-two block fits
    qc = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert not [f for f in inspect_json(fp8)[0]["findings"] if f["code"] == "quant-method-unknown"]
    bad = edited(fp8, tmp_path / "bad", quantization_config={**qc, "quant_method": "bogus"})
    unknown, report, rc = findings(bad, "quant-method-unknown")
    assert len(unknown) == 1 and "quant_method 'bogus' is known neither to atomtool nor to transformers" \
        in unknown[0]["message"]
    scale = [f for f in report["findings"] if f["code"] == "scale-shape-mismatch"]
    assert rc == 1 and not report["servable"] and scale and all(f["severity"] == "error" for f in scale)
    line = generate_error(bad)
    assert line.startswith(f"{bad}: scale-shape-mismatch: {scale[0]['message']}"), (line, scale[0])


def test_qk_norms_under_a_model_type_without_them_are_refused_alike(ckpt, tmp_path, no_model_build):
    bad = edited(ckpt("qwen3"), tmp_path / "bad", model_type="llama")  # a Qwen3 checkpoint mislabelled
    found, report, rc = findings(bad, "unexpected-tensors")
    assert rc == 1 and not report["servable"] and len(found) == 1
    assert found[0]["message"].startswith("4 q/k norm tensor(s) the model of model_type 'llama' does not have: "
                                          "model.layers.0.self_attn.k_norm.weight")
    assert generate_error(bad).startswith(f"{bad}: unexpected-tensors: {found[0]['message']}")
    _, report, rc = findings(ckpt("qwen3"), "unexpected-tensors")  # the real model_type: no finding
    assert rc == 0 and report["servable"]
