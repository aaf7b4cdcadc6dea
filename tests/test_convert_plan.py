"""Unit tests of the pure conversion plan and the dtype policy (no files: hand-built InspectReports).

Shapes follow the real releases (research/dsa.md §3): DeepSeek-V3.2 q_a 1536 rows, kv_a_proj_with_mqa 576
rows (not a multiple of 128), indexer wk 128 rows, weights_proj 64 rows (BF16 even in FP8 releases).
"""

from __future__ import annotations

import math

import pytest
import torch

from atomtool.convert.cast import cast_messages, cast_warnings, checked_cast, describe_cast, is_lossless
from atomtool.convert.plan import build_plan
from atomtool.errors import ConversionError
from atomtool.inspect.dsa import flatten_dsa_config
from atomtool.inspect.types import DsaInfo, InspectReport, ModuleInfo, TensorInfo

_SCHEME = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


def make_report(tensors: dict[str, tuple[str, tuple[int, ...]]], arch: str, config: dict,
                family: str) -> InspectReport:
    """A minimal InspectReport: modules = ``<m>.weight`` 2-D tensors with their companions; scheme from
    the weight dtype (fp8_block when a ``weight_scale_inv`` is present)."""
    infos = {n: TensorInfo(n, d, tuple(s), "model.safetensors") for n, (d, s) in tensors.items()}
    flat = flatten_dsa_config(config)
    block = tuple(config.get("quantization_config", {}).get("weight_block_size", ())) or None
    modules, in_module = [], set()
    for n, t in infos.items():
        if n.endswith(".weight") and len(t.shape) >= 2 and "embed" not in n and not n.endswith("mlp.gate.weight"):
            prefix = n[: -len(".weight")]
            roles = {r: infos[f"{prefix}.{r}"] for r in ("weight", "weight_scale_inv", "bias")
                     if f"{prefix}.{r}" in infos}
            fp8 = "weight_scale_inv" in roles
            modules.append(ModuleInfo(prefix, "fp8_block" if fp8 else _SCHEME[t.dtype], t.dtype, t.shape, roles,
                                      block_size=block if fp8 else None))
            in_module.update(x.name for x in roles.values())
    dsa = None
    if "indexer_types" in flat:
        dsa = DsaInfo(flat["index_topk"], flat["index_n_heads"], flat["index_head_dim"], flat["index_rope_dim"],
                      flat["indexer_rope_interleave"], flat["indexer_types"])
    return InspectReport(source="mem", architecture=arch, model_type=config.get("model_type", ""), family=family,
                         servable=True, config=config, config_flat=flat, dsa=dsa, tensors=infos, modules=modules,
                         other_tensors=[n for n in infos if n not in in_module], totals={}, memory={}, findings=[])


def mla_tensors(layers: int, roles: list[str], *, fp8: bool, block: int = 128, hidden: int = 256,
                q_rank: int = 1536, kv_rows: int = 576, moe_from: int = 1, experts: int = 4, inter: int = 256,
                mtp: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    t: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.embed_tokens.weight": ("BF16", (100, hidden)), "model.norm.weight": ("BF16", (hidden,)),
        "lm_head.weight": ("BF16", (100, hidden)),
    }

    def lin(name: str, rows: int, cols: int, quant: bool = True) -> None:
        if fp8 and quant:
            t[f"{name}.weight"] = ("F8_E4M3", (rows, cols))
            t[f"{name}.weight_scale_inv"] = ("F32", (math.ceil(rows / block), math.ceil(cols / block)))
        else:
            t[f"{name}.weight"] = ("BF16", (rows, cols))

    for i in range(layers + (1 if mtp else 0)):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = ("BF16", (hidden,))
        lin(f"{p}.self_attn.q_a_proj", q_rank, hidden)
        lin(f"{p}.self_attn.kv_a_proj_with_mqa", kv_rows, hidden)
        lin(f"{p}.self_attn.q_b_proj", 64, q_rank)
        if i >= layers or roles[i] == "full":
            lin(f"{p}.self_attn.indexer.wq_b", 64, q_rank)
            lin(f"{p}.self_attn.indexer.wk", 128, hidden)
            lin(f"{p}.self_attn.indexer.weights_proj", 64, hidden, quant=False)
            t[f"{p}.self_attn.indexer.k_norm.weight"] = ("BF16", (128,))
            t[f"{p}.self_attn.indexer.k_norm.bias"] = ("BF16", (128,))
        if i < moe_from:
            lin(f"{p}.mlp.gate_proj", inter, hidden)
            lin(f"{p}.mlp.up_proj", inter, hidden)
            lin(f"{p}.mlp.down_proj", hidden, inter)
        else:
            t[f"{p}.mlp.gate.weight"] = ("BF16", (experts, hidden))
            t[f"{p}.mlp.gate.e_score_correction_bias"] = ("F32", (experts,))
            for e in range(experts):
                lin(f"{p}.mlp.experts.{e}.gate_proj", inter, hidden)
                lin(f"{p}.mlp.experts.{e}.up_proj", inter, hidden)
                lin(f"{p}.mlp.experts.{e}.down_proj", hidden, inter)
            lin(f"{p}.mlp.shared_experts.gate_proj", inter, hidden)
            lin(f"{p}.mlp.shared_experts.up_proj", inter, hidden)
            lin(f"{p}.mlp.shared_experts.down_proj", hidden, inter)
    return t


def mla_config(layers: int, roles: list[str], fp8: bool, block: int = 128) -> dict:
    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_hidden_layers": layers,
           "indexer_types": roles, "index_topk": 8, "index_n_heads": 64, "index_head_dim": 128,
           "qk_rope_head_dim": 64, "n_routed_experts": 4, "num_nextn_predict_layers": 1}
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [block, block]}
    return cfg


def mla_report(roles: list[str], *, fp8: bool = False, block: int = 128, **kw) -> InspectReport:
    return make_report(mla_tensors(len(roles), roles, fp8=fp8, block=block, **kw), "GlmMoeDsaForCausalLM",
                       mla_config(len(roles), roles, fp8, block), "deepseek_mla")


def _parts(plan, name):
    return [(p.source.rsplit(".", 2)[-2], p.rows, p.pad_rows) for p in plan.tensors[name].parts]


def test_every_source_tensor_in_exactly_one_output():
    report = mla_report(["full", "shared", "full"], fp8=True, mtp=True)
    plan = build_plan(report)
    seen = [p.source for o in plan.tensors.values() for p in o.parts]
    assert sorted(seen) == sorted(report.tensors)
    assert len(seen) == len(set(seen))


def test_bf16_full_layer_fuses_indexer_rows_in_order():
    plan = build_plan(mla_report(["full", "shared", "full"]))
    fused = plan.tensors["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
    assert fused.op == "concat" and fused.dtype == "BF16" and fused.shape == (1536 + 576 + 128 + 64, 256)
    assert _parts(plan, fused.name) == [("q_a_proj", (0, 1536), 0), ("kv_a_proj_with_mqa", (1536, 2112), 0),
                                        ("wk", (2112, 2240), 0), ("weights_proj", (2240, 2304), 0)]
    assert "model.layers.0.self_attn.indexer.wk.weight" not in plan.tensors
    # the indexer's other tensors keep their names
    assert "model.layers.0.self_attn.indexer.wq_b.weight" in plan.tensors


def test_shared_layer_gets_no_indexer_rows():
    plan = build_plan(mla_report(["full", "shared", "full"]))
    fused = plan.tensors["model.layers.1.self_attn.fused_qkv_a_proj.weight"]
    assert _parts(plan, fused.name) == [("q_a_proj", (0, 1536), 0), ("kv_a_proj_with_mqa", (1536, 2112), 0)]
    assert not any(".layers.1.self_attn.indexer" in n for n in plan.tensors)


def test_fp8_fuses_q_a_and_kv_a_keeps_indexer_separate():
    plan = build_plan(mla_report(["full", "shared", "full"], fp8=True))
    w = plan.tensors["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
    s = plan.tensors["model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv"]
    assert (w.dtype, w.shape, w.scheme, w.block_size) == ("F8_E4M3", (2112, 256), "fp8_block", (128, 128))
    assert (s.dtype, s.shape) == ("F32", (12 + 5, 2))
    assert [p.rows for p in s.parts] == [(0, 12), (12, 17)]
    assert all(p.pad_rows == 0 for p in w.parts + s.parts)  # 1536 is block-aligned, kv_a is last
    for name in ("model.layers.0.self_attn.indexer.wk.weight", "model.layers.0.self_attn.indexer.wk.weight_scale_inv",
                 "model.layers.0.self_attn.indexer.weights_proj.weight"):
        assert plan.tensors[name].op == "copy"
    assert plan.tensors["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == "BF16"
    assert any("indexer parts" in n and "layers.0." in n and "schemes differ" in n for n in plan.notes)


def test_fp8_misaligned_part_is_padded_with_zero_rows():
    # q_a 40 rows with 16-row blocks: 8 zero rows after it; kv_a (last) unpadded
    plan = build_plan(mla_report(["full", "full"], fp8=True, block=16, q_rank=40, kv_rows=40))
    w = plan.tensors["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
    assert _parts(plan, w.name) == [("q_a_proj", (0, 40), 8), ("kv_a_proj_with_mqa", (48, 88), 0)]
    assert w.shape == (88, 256)
    s = plan.tensors["model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv"]
    assert s.shape == (3 + 3, 16) and [p.rows for p in s.parts] == [(0, 3), (3, 6)]
    assert any("zero rows after q_a_proj (+8)" in n for n in plan.notes)


def test_experts_stacked_with_scales():
    plan = build_plan(mla_report(["full", "full"], fp8=True, block=128, experts=4, inter=192))
    w13 = plan.tensors["model.layers.1.mlp.experts.w13.weight"]
    w2 = plan.tensors["model.layers.1.mlp.experts.w2.weight"]
    # gate 192 rows is not 128-aligned: 64 zero rows between gate and up in each expert
    assert w13.op == "stack" and w13.shape == (4, 192 + 64 + 192, 256)
    assert [(p.source, p.stack_index, p.rows, p.pad_rows) for p in w13.parts[:2]] == [
        ("model.layers.1.mlp.experts.0.gate_proj.weight", 0, (0, 192), 64),
        ("model.layers.1.mlp.experts.0.up_proj.weight", 0, (256, 448), 0)]
    assert [p.stack_index for p in w13.parts] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert w2.shape == (4, 256, 192) and [p.rows for p in w2.parts] == [(0, 256)] * 4
    assert plan.tensors["model.layers.1.mlp.experts.w13.weight_scale_inv"].shape == (4, 2 + 2, 2)
    assert plan.tensors["model.layers.1.mlp.experts.w2.weight_scale_inv"].shape == (4, 2, 2)
    assert not any(".experts.0." in n for n in plan.tensors)
    # dense MLP of layer 0 and shared experts fuse gate|up
    assert plan.tensors["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 192 + 64, 256)
    assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight_scale_inv" in plan.tensors
    assert plan.tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"


def test_mtp_layer_copied_unchanged():
    plan = build_plan(mla_report(["full", "shared"], mtp=True))
    assert "model.layers.2.self_attn.q_a_proj.weight" in plan.tensors
    assert "model.layers.2.self_attn.indexer.wk.weight" in plan.tensors
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in plan.tensors
    assert not any(n.startswith("model.layers.2.") and ("fused" in n or "w13" in n) for n in plan.tensors)


def test_mixed_base_schemes_are_not_fused():
    t = mla_tensors(1, ["full"], fp8=True)
    t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] = ("BF16", (576, 256))
    del t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    plan = build_plan(make_report(t, "DeepseekV32ForCausalLM", mla_config(1, ["full"], True), "deepseek_mla"))
    assert "model.layers.0.self_attn.q_a_proj.weight" in plan.tensors
    assert "model.layers.0.self_attn.fused_qkv_a_proj.weight" not in plan.tensors
    assert any("fused_qkv_a_proj: not fused, storage schemes differ" in n for n in plan.notes)


def dense_report(bias: bool, dtype: str = "BF16") -> InspectReport:
    t: dict[str, tuple[str, tuple[int, ...]]] = {"model.embed_tokens.weight": (dtype, (100, 64))}
    for i in range(2):
        p = f"model.layers.{i}"
        for name, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", 64)):
            t[f"{p}.self_attn.{name}.weight"] = (dtype, (rows, 64))
            if bias and name != "o_proj":
                t[f"{p}.self_attn.{name}.bias"] = (dtype, (rows,))
        for name in ("gate_proj", "up_proj"):
            t[f"{p}.mlp.{name}.weight"] = (dtype, (128, 64))
        t[f"{p}.mlp.down_proj.weight"] = (dtype, (64, 128))
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2}
    return make_report(t, "Qwen2ForCausalLM", cfg, "llama")


def test_dense_qkv_and_gate_up_with_bias():
    plan = build_plan(dense_report(bias=True))
    qkv = plan.tensors["model.layers.1.self_attn.qkv_proj.weight"]
    assert qkv.shape == (128, 64) and [p.rows for p in qkv.parts] == [(0, 64), (64, 96), (96, 128)]
    b = plan.tensors["model.layers.1.self_attn.qkv_proj.bias"]
    assert b.shape == (128,) and [p.source.split(".")[-2] for p in b.parts] == ["q_proj", "k_proj", "v_proj"]
    assert plan.tensors["model.layers.0.mlp.gate_up_proj.weight"].shape == (256, 64)
    assert "model.layers.0.self_attn.o_proj.weight" in plan.tensors
    # layer order is natural: layer 0's outputs before layer 1's
    names = list(plan.tensors)
    assert names.index("model.layers.0.mlp.gate_up_proj.weight") < names.index("model.layers.1.self_attn.qkv_proj.weight")


def test_explicit_dtype_casts_plain_float_only_and_warns_once_per_pair():
    report = mla_report(["full", "shared"], fp8=True)
    plan = build_plan(report, "float16")
    assert plan.tensors["model.layers.0.self_attn.fused_qkv_a_proj.weight"].dtype == "F8_E4M3"
    assert plan.tensors["model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv"].dtype == "F32"
    assert plan.tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"  # fp32_keep
    wp = plan.tensors["model.layers.0.self_attn.indexer.weights_proj.weight"]
    assert (wp.dtype, wp.op, wp.scheme) == ("F16", "cast", "fp16")
    assert len(plan.warnings) == 1
    n_bf16 = sum(1 for n, t in report.tensors.items() if t.dtype == "BF16")
    assert plan.warnings[0].startswith(f"{n_bf16} tensors cast BF16 -> F16 (lossy:")
    assert "overflow" in plan.warnings[0] and "(+" in plan.warnings[0]
    assert plan.config["dtype"] == "float16"
    assert build_plan(report).warnings == []


def test_widening_cast_is_a_note_not_a_warning():
    """A lossless widening (BF16 -> F32) loses nothing: an info note (``infos``, ``notes``), not a warning."""
    plan = build_plan(dense_report(bias=False, dtype="BF16"), "float32")
    assert plan.warnings == []
    assert len(plan.infos) == 1 and "BF16 -> F32 (lossless widening), e.g." in plan.infos[0]
    assert plan.infos[0] in plan.notes
    assert plan.tensors["model.layers.0.self_attn.qkv_proj.weight"].dtype == "F32"


def test_unknown_dtype_is_an_error():
    with pytest.raises(ConversionError, match="unknown --dtype 'int8'"):
        build_plan(dense_report(bias=False), "int8")


def test_output_config_carries_flattened_schedule_text_config():
    roles = ["full", "shared", "full"]
    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
           "text_config": {"model_type": "glm_moe_dsa", "num_hidden_layers": 3, "index_topk_freq": 2,
                           "index_skip_topk_offset": 2, "qk_rope_head_dim": 64}}
    report = make_report(mla_tensors(3, ["full", "full", "shared"], fp8=False), "GlmMoeDsaForCausalLM", cfg,
                         "deepseek_mla")
    plan = build_plan(report)
    assert plan.config["text_config"]["indexer_types"] == report.config_flat["indexer_types"] == \
        ["full", "full", "shared"]
    assert plan.config["text_config"]["index_rope_dim"] == 64 and "indexer_types" not in plan.config
    assert report.config["text_config"].get("indexer_types") is None  # the report is not mutated
    del roles


def test_cast_helpers():
    assert is_lossless("BF16", "F32") and is_lossless("F16", "F32")
    assert not is_lossless("BF16", "F16") and not is_lossless("F16", "BF16") and not is_lossless("F32", "BF16")
    assert describe_cast("F32", "BF16") == "lossy: rounds to 8 significant bits"
    assert cast_warnings([("a", "F32", "BF16"), ("b", "BF16", "F32"), ("c", "F32", "BF16")]) == [
        "2 tensors cast F32 -> BF16 (lossy: rounds to 8 significant bits), e.g. a, c",
        "1 tensor cast BF16 -> F32 (lossless widening), e.g. b"]
    assert cast_messages([("a", "F32", "BF16"), ("b", "BF16", "F32")]) == (
        ["1 tensor cast F32 -> BF16 (lossy: rounds to 8 significant bits), e.g. a"],
        ["1 tensor cast BF16 -> F32 (lossless widening), e.g. b"])
    t = torch.tensor([1.0, 7e4, float("inf")], dtype=torch.bfloat16)
    with pytest.raises(ConversionError, match=r"w\.x: casting BF16 -> F16 overflows \(\|value\| up to 70144"):
        checked_cast(t, torch.float16, name="w.x")
    ok = checked_cast(torch.tensor([1.0, float("inf"), 6e4]), torch.float16, name="ok")  # inf stays inf
    assert torch.isinf(ok[1]) and ok[2] == 6e4
