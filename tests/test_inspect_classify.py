"""Classification of real (transformers-written) tiny checkpoints and their quantized variants.

Expected values come from how each fixture was built (tests/checkpoints.py) and from the published
formats (research/quant.md), never from inspect's own output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atomtool.inspect.classify import build_report, inspect_checkpoint
from atomtool.inspect.quant import exclusion_matches, parse_quant_config
from atomtool.inspect.types import TensorInfo
from tests.checkpoints import (
    ARCHS,
    GLM_EXPLICIT_TYPES,
    GLM_FREQ_ROLES,
    dequantize_fp8_block_checkpoint,
    is_quantizable_linear,
    load_state_dict,
    write_awq_checkpoint,
    write_ct_fp8_checkpoint,
    write_ct_int4_checkpoint,
    write_fp8_block_checkpoint,
    write_gptq_checkpoint,
    write_hf_checkpoint,
    write_mxfp4_checkpoint,
    write_nvfp4_checkpoint,
)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Every arch in float32 plus a BF16 DeepSeek-V3.2 and a GLM with explicit indexer_types."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {arch: write_hf_checkpoint(root / arch, arch, seed=1) for arch in ARCHS}
    out["v32_bf16"] = write_hf_checkpoint(root / "v32_bf16", "deepseek_v32", seed=2, dtype=torch.bfloat16,
                                          max_shard_size="100KB")
    out["glm_explicit"] = write_hf_checkpoint(root / "glm_explicit", "glm_moe_dsa", seed=3,
                                              indexer_types=GLM_EXPLICIT_TYPES)
    out["glm_freq_only"] = write_hf_checkpoint(root / "glm_freq_only", "glm_moe_dsa", seed=3,
                                               drop_config_keys=["indexer_types"])
    out["llama_tied"] = write_hf_checkpoint(root / "llama_tied", "llama", tie_word_embeddings=True)
    return out


def _mods(report):
    return {m.name: m for m in report.modules}


def _linear_weights(path: Path) -> dict[str, tuple[int, ...]]:
    """Module name -> [out, in] of every 2-D ``.weight`` transformers wrote, minus embeddings."""
    sd = load_state_dict(path)
    return {k[: -len(".weight")]: tuple(v.shape) for k, v in sd.items()
            if k.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in k}


@pytest.mark.parametrize("arch", ARCHS)
def test_float_checkpoint_every_linear_module(ckpts, arch):
    report = inspect_checkpoint(str(ckpts[arch]))
    expected = _linear_weights(ckpts[arch])
    mods = _mods(report)
    assert set(mods) == set(expected)
    for name, shape in expected.items():
        m = mods[name]
        assert (m.scheme, m.dtype, m.shape) == ("fp32", "F32", shape), name
        assert m.treated_as == "unquantized" and not m.declared_quantized
    assert report.servable and report.family == ("llama" if arch in ("llama", "qwen2", "qwen3") else "deepseek_mla")
    assert [f for f in report.findings if f.severity != "info"] == []
    # totals: every tensor counted once; parameters = every element (plain float checkpoint)
    sd = load_state_dict(ckpts[arch])
    assert report.totals["parameters"] == sum(t.numel() for t in sd.values())
    assert report.totals["bytes"] == sum(t.numel() * 4 for t in sd.values())
    assert report.totals["by_dtype"]["F32"]["tensors"] == len(sd)


def test_norms_embeddings_are_not_modules(ckpts):
    report = inspect_checkpoint(str(ckpts["qwen3"]))
    assert "model.embed_tokens.weight" in report.other_tensors
    assert "model.layers.0.self_attn.q_norm.weight" in report.other_tensors  # Qwen3 qk-norm
    assert not any("norm" in m.name for m in report.modules)


def test_tied_embeddings_have_no_lm_head(ckpts):
    report = inspect_checkpoint(str(ckpts["llama_tied"]))
    assert "lm_head" not in _mods(report)
    assert report.config_flat["tie_word_embeddings"] is True


def test_bf16_checkpoint_keeps_fp32_router_bias_without_finding(ckpts):
    report = inspect_checkpoint(str(ckpts["v32_bf16"]))
    assert len({t.file for t in report.tensors.values()}) > 1  # sharded
    assert report.tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert {m.scheme for m in report.modules} == {"bf16"}
    assert not [f for f in report.findings if f.code == "float-dtype-differs"]


def test_dsa_schedules_and_cross_check(ckpts):
    freq = inspect_checkpoint(str(ckpts["glm_moe_dsa"]))
    assert freq.dsa.roles == GLM_FREQ_ROLES
    only = inspect_checkpoint(str(ckpts["glm_freq_only"]))
    assert "indexer_types" not in only.config and only.dsa.roles == GLM_FREQ_ROLES
    explicit = inspect_checkpoint(str(ckpts["glm_explicit"]))
    assert explicit.dsa.roles == GLM_EXPLICIT_TYPES
    for r in (freq, only, explicit):
        assert not [f for f in r.findings if f.code.startswith("dsa-")]
        owners = {m.name.split(".")[2] for m in r.modules if ".indexer." in m.name}
        assert owners == {str(i) for i, role in enumerate(r.dsa.roles) if role == "full"}
    v32 = inspect_checkpoint(str(ckpts["deepseek_v32"]))
    assert v32.dsa.roles == ["full"] * 3
    assert (v32.dsa.index_topk, v32.dsa.index_n_heads, v32.dsa.index_head_dim, v32.dsa.index_rope_dim) == (8, 4, 16, 8)
    assert inspect_checkpoint(str(ckpts["deepseek_v3"])).dsa is None


def test_dsa_cross_check_findings(ckpts):
    report = inspect_checkpoint(str(ckpts["glm_moe_dsa"]))
    tensors = dict(report.tensors)
    # full layer 1 loses its indexer; shared layer 2 gains one
    for name in [n for n in tensors if n.startswith("model.layers.1.self_attn.indexer.")]:
        t = tensors.pop(name)
        tensors[name.replace("layers.1.", "layers.2.")] = TensorInfo(t.name.replace("layers.1.", "layers.2."),
                                                                       t.dtype, t.shape, t.file, t.data_offsets)
    r = build_report("x", report.config, tensors)
    codes = {(f.code, f.severity, f.module) for f in r.findings}
    assert ("dsa-full-layer-without-indexer", "error", "model.layers.1.self_attn.indexer") in codes
    assert ("dsa-shared-layer-with-indexer", "warning", "model.layers.2.self_attn.indexer") in codes


def test_kv_cache_bytes_mla_and_gqa(ckpts):
    from atomtool.serve.engine.kv_cache import bytes_per_block
    from atomtool.serve.loader import load_model

    glm = inspect_checkpoint(str(ckpts["glm_moe_dsa"]))
    # 4 layers x (kv_lora_rank 32 + qk_rope 8) x 4 B (F32 model) + 3 full layers x index_head_dim 16 x 4 B
    assert glm.memory["kv_bytes_per_token"] == 4 * 40 * 4 + 3 * 16 * 4
    # ... which is what the engine allocates per token (so inspect --gpu-memory predicts serve's context)
    engine = load_model(ckpts["glm_moe_dsa"], device="cpu", dtype="float32").model
    assert bytes_per_block(engine.kv_plane_specs(), 16) == 16 * glm.memory["kv_bytes_per_token"]
    llama = inspect_checkpoint(str(ckpts["llama"]))
    # 2 layers x K and V x 2 kv heads x head_dim 16 x 4 B
    assert llama.memory["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    r = inspect_checkpoint(str(ckpts["llama"]), gpu_memory_gb=0.001)
    # a GPU question: this float32 checkpoint is served in BF16 there, weights (all float) and KV alike
    assert r.memory["kv_dtype"] == "BF16"
    served_weights = r.totals["bytes"] // 2
    assert r.memory["max_context_tokens"] == (10**6 - served_weights) // r.memory["kv_bytes_per_token"]
    assert inspect_checkpoint(str(ckpts["llama"]), gpu_memory_gb=1e-6).memory["max_context_tokens"] == 0


# ----------------------------------------------------------------------------- FP8 block


@pytest.fixture(scope="module")
def fp8(ckpts, tmp_path_factory) -> Path:
    return write_fp8_block_checkpoint(ckpts["deepseek_v32"], tmp_path_factory.mktemp("fp8") / "fp8", block=16)


def test_fp8_block_as_deepseek_ships_it(fp8, ckpts):
    report = inspect_checkpoint(str(fp8))
    mods = _mods(report)
    src = load_state_dict(ckpts["deepseek_v32"])
    for name, m in mods.items():
        if is_quantizable_linear(name + ".weight", src[name + ".weight"]):
            assert (m.scheme, m.dtype, m.block_size, m.treated_as) == ("fp8_block", "F8_E4M3", (16, 16), "quantized")
            assert m.declared_quantized
            assert m.shape == tuple(src[name + ".weight"].shape)
        else:
            assert (m.scheme, m.treated_as) == ("bf16", "unquantized"), name
    # router: never declared; indexer.weights_proj: config (no exclusion list) claims it -> info finding
    assert not mods["model.layers.1.mlp.gate"].declared_quantized
    assert not mods["lm_head"].declared_quantized
    wp = mods["model.layers.0.self_attn.indexer.weights_proj"]
    assert wp.declared_quantized and wp.treated_as == "unquantized"
    msgs = {f.module: f for f in report.findings if f.code == "config-quant-stored-float"}
    assert set(msgs) == {f"model.layers.{i}.self_attn.indexer.weights_proj" for i in range(3)}
    f = msgs["model.layers.0.self_attn.indexer.weights_proj"]
    assert f.severity == "info"
    assert "stored BF16 [4, 64]" in f.message and "fp8, block [16, 16]" in f.message and "unquantized" in f.message
    assert not [x for x in report.findings if x.severity == "error"]
    # the F32 weight_scale_inv tensors are not a float cast
    assert not [x for x in report.findings if x.code == "float-dtype-differs"]
    # kv_a_proj_with_mqa [40, 64] with block 16 -> scale [3, 4] (non-aligned rows)
    assert report.tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (3, 4)


def test_fp8_block_128_on_tiny_weights_is_still_block(ckpts, tmp_path):
    """With the real [128, 128] blocks, tiny weights have a [1, 1] scale grid: that is fp8_block, not per-tensor."""
    dst = write_fp8_block_checkpoint(ckpts["deepseek_v32"], tmp_path / "fp8_128", block=128)
    report = inspect_checkpoint(str(dst))
    mods = _mods(report)
    assert report.tensors["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (1, 1)
    fp8_mods = [m for m in mods.values() if m.dtype == "F8_E4M3"]
    assert fp8_mods and all((m.scheme, m.block_size) == ("fp8_block", (128, 128)) for m in fp8_mods)
    assert not [f for f in report.findings if f.code == "scheme-mismatch"]


def test_fp8_dequantize_is_exact(fp8):
    deq = dequantize_fp8_block_checkpoint(fp8)
    sd = load_state_dict(fp8)
    w = sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    s = sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    got = deq["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(got[17, 33], w[17, 33].float() * s[1, 2])
    assert not any(k.endswith("_scale_inv") for k in deq)


def test_fp8_stored_float_layer_and_missing_scale(fp8, ckpts, tmp_path):
    dst = write_fp8_block_checkpoint(ckpts["deepseek_v32"], tmp_path / "partial", block=16,
                                     leave_float=["layers.1.self_attn.o_proj"])
    report = inspect_checkpoint(str(dst))
    m = _mods(report)["model.layers.1.self_attn.o_proj"]
    assert (m.scheme, m.declared_quantized, m.treated_as) == ("bf16", True, "unquantized")
    f = next(f for f in report.findings if f.module == "model.layers.1.self_attn.o_proj")
    assert f.code == "config-quant-stored-float" and f.severity == "warning"
    assert "model.layers.1.self_attn.o_proj" in f.message and "BF16" in f.message and "fp8" in f.message

    base = inspect_checkpoint(str(fp8))
    tensors = {k: v for k, v in base.tensors.items() if k != "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"}
    r = build_report("x", base.config, tensors)
    f = [f for f in r.findings if f.code == "fp8-without-scale"]
    assert len(f) == 1 and f[0].severity == "error" and f[0].module == "model.layers.2.mlp.experts.3.up_proj"


def test_fp8_scale_shape_mismatch_and_fusion_disagreement(fp8):
    base = inspect_checkpoint(str(fp8))
    tensors = dict(base.tensors)
    name = "model.layers.0.self_attn.q_b_proj.weight_scale_inv"
    t = tensors[name]
    tensors[name] = TensorInfo(name, "F32", (6, 1), t.file, t.data_offsets)  # [96, 32] needs [6, 2]
    # gate/up of layer 0's dense MLP disagree: up_proj stored BF16
    up = tensors.pop("model.layers.0.mlp.up_proj.weight")
    tensors.pop("model.layers.0.mlp.up_proj.weight_scale_inv")
    tensors[up.name] = TensorInfo(up.name, "BF16", up.shape, up.file, (0, 2 * up.numel))
    r = build_report("x", base.config, tensors)
    by_code = {f.code: f for f in r.findings if f.severity == "error"}
    assert by_code["scale-shape-mismatch"].module == "model.layers.0.self_attn.q_b_proj"
    assert "[6, 2]" in by_code["scale-shape-mismatch"].message
    assert by_code["fused-shards-disagree"].module == "model.layers.0.mlp.gate_up_proj"


def test_glm_exclusion_alias_and_unmatched_entries(ckpts, tmp_path):
    # GLM FP8 lists "indexers_proj", which means indexer.weights_proj; layer 2 is shared (no indexer)
    dst = write_fp8_block_checkpoint(
        ckpts["glm_moe_dsa"], tmp_path / "glm", block=16,
        modules_to_not_convert=["model.layers.0.self_attn.indexers_proj", "model.layers.2.self_attn.indexers_proj",
                                "model.layers.1.mlp.gate", "lm_head"])
    report = inspect_checkpoint(str(dst))
    mods = _mods(report)
    assert not mods["model.layers.0.self_attn.indexer.weights_proj"].declared_quantized
    assert mods["model.layers.1.self_attn.indexer.weights_proj"].declared_quantized
    unmatched = [f for f in report.findings if f.code == "exclusion-matches-nothing"]
    assert len(unmatched) == 1 and "model.layers.2.self_attn.indexers_proj" in unmatched[0].message


# ----------------------------------------------------------------------------- other schemes


@pytest.fixture(scope="module")
def quantized(ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q")
    src = ckpts["deepseek_v3"]
    return {
        "ct_int4": write_ct_int4_checkpoint(src, root / "ct_int4", group_size=32),
        "ct_fp8": write_ct_fp8_checkpoint(src, root / "ct_fp8"),
        "ct_fp8_tensor": write_ct_fp8_checkpoint(src, root / "ct_fp8_tensor", strategy="tensor"),
        "nvfp4": write_nvfp4_checkpoint(src, root / "nvfp4"),
        "mxfp4": write_mxfp4_checkpoint(src, root / "mxfp4"),
        "awq": write_awq_checkpoint(ckpts["llama"], root / "awq"),
        "gptq": write_gptq_checkpoint(ckpts["llama"], root / "gptq"),
    }


@pytest.mark.parametrize("kind,scheme,block", [
    ("ct_int4", "int4_pack", (1, 32)), ("ct_fp8", "fp8_channel", None), ("ct_fp8_tensor", "fp8_tensor", None),
    ("nvfp4", "nvfp4", (1, 16)), ("awq", "awq", (1, 32)), ("gptq", "gptq", (1, 32)),
])
def test_quantized_formats(quantized, ckpts, kind, scheme, block):
    src = ckpts["llama" if kind in ("awq", "gptq") else "deepseek_v3"]
    expected = _linear_weights(src)
    report = inspect_checkpoint(str(quantized[kind]))
    mods = _mods(report)
    assert set(mods) == set(expected)
    sd = load_state_dict(src)
    n_quant = 0
    for name, shape in expected.items():
        m = mods[name]
        assert m.shape == shape, name  # logical [out, in] recovered from the packed storage
        if is_quantizable_linear(name + ".weight", sd[name + ".weight"]):
            assert (m.scheme, m.block_size, m.treated_as, m.declared_quantized) == (scheme, block, "quantized", True), name
            n_quant += 1
        else:
            assert m.treated_as == "unquantized" and m.scheme == "fp32", name
            assert not m.declared_quantized, name
    assert n_quant > 0
    assert [f for f in report.findings if f.severity == "error"] == []


def test_mxfp4_gpt_oss_experts(quantized):
    report = inspect_checkpoint(str(quantized["mxfp4"]))
    mods = _mods(report)
    up = mods["model.layers.1.mlp.experts.gate_up_proj"]
    # 8 experts x (2 x moe_intermediate 32) x hidden 64, stored U8 [8, 64, 2, 16]
    assert (up.scheme, up.shape, up.treated_as, up.declared_quantized) == ("mxfp4", (8, 64, 64), "quantized", True)
    assert mods["model.layers.1.mlp.experts.down_proj"].shape == (8, 64, 32)
    assert not mods["model.layers.1.self_attn.q_a_proj"].declared_quantized  # self_attn excluded by glob
    assert not mods["model.layers.1.mlp.shared_experts.up_proj"].declared_quantized  # only routed experts
    assert [f for f in report.findings if f.severity == "error"] == []


def test_nvfp4_hf_quant_config_and_scale_check(quantized):
    report = inspect_checkpoint(str(quantized["nvfp4"]))
    m = _mods(report)["model.layers.1.self_attn.q_a_proj"]
    assert m.shape == (32, 64) and m.dtype == "U8"
    tensors = dict(report.tensors)
    name = "model.layers.1.self_attn.q_a_proj.weight_scale"
    t = tensors[name]
    tensors[name] = TensorInfo(name, t.dtype, (32, 2), t.file, (0, 64))  # K/32 instead of K/16
    r = build_report("x", report.config, tensors)
    assert any(f.code == "scale-shape-mismatch" and f.module == "model.layers.1.self_attn.q_a_proj" for f in r.findings)


def test_awq_gptq_without_config_use_shape_rule(quantized):
    for kind in ("awq", "gptq"):
        report = inspect_checkpoint(str(quantized[kind]))
        cfg = {k: v for k, v in report.config.items() if k != "quantization_config"}
        r = build_report("x", cfg, report.tensors)
        assert _mods(r)["model.layers.0.self_attn.q_proj"].scheme == kind
        assert _mods(r)["model.layers.0.self_attn.k_proj"].shape == (32, 64)


def test_float_with_companions_and_orphans(fp8):
    base = inspect_checkpoint(str(fp8))
    tensors = dict(base.tensors)
    w = tensors["model.layers.0.self_attn.o_proj.weight"]
    tensors[w.name] = TensorInfo(w.name, "BF16", w.shape, w.file, (0, 2 * w.numel))
    tensors.pop("model.layers.1.self_attn.o_proj.weight")
    r = build_report("x", base.config, tensors)
    f = {x.code: x for x in r.findings}
    assert f["float-with-companions"].module == "model.layers.0.self_attn.o_proj"
    assert _mods(r)["model.layers.0.self_attn.o_proj"].treated_as == "unquantized"
    assert f["orphan-companion"].module == "model.layers.1.self_attn.o_proj"


def test_float_dtype_differs(ckpts):
    report = inspect_checkpoint(str(ckpts["llama"]))
    cfg = dict(report.config, dtype="bfloat16")
    r = build_report("x", cfg, report.tensors)
    f = [x for x in r.findings if x.code == "float-dtype-differs"]
    warn = [x for x in f if x.severity == "warning"]
    info = [x for x in f if x.severity == "info"]
    # 2 layers x (input + post-attention norm) + the final norm: F32 norms are kept, not a lossy cast
    n_norms = 2 * 2 + 1
    assert len(warn) == 1 and "F32 -> BF16" in warn[0].message
    assert warn[0].message.startswith(f"{len(report.tensors) - n_norms} tensor(s) stored F32")
    assert len(info) == 1 and info[0].message.startswith(f"{n_norms} norm weight(s) stored F32")


def test_unknown_scheme(ckpts):
    report = inspect_checkpoint(str(ckpts["llama"]))
    tensors = dict(report.tensors)
    w = tensors["model.layers.0.mlp.up_proj.weight"]
    tensors[w.name] = TensorInfo(w.name, "I16", w.shape, w.file, (0, 2 * w.numel))
    r = build_report("x", report.config, tensors)
    f = [x for x in r.findings if x.code == "unknown-scheme"]
    assert len(f) == 1 and f[0].severity == "error" and "I16" in f[0].message


# ----------------------------------------------------------------------------- exclusion semantics


@pytest.mark.parametrize("qcfg,entry,name,expected", [
    ({"quant_method": "fp8", "modules_to_not_convert": []}, "mlp.gate", "model.layers.3.mlp.gate_up_proj", True),
    ({"quant_method": "fp8"}, "model.layers.3.self_attn.indexers_proj", "model.layers.3.self_attn.indexer.weights_proj", True),
    ({"quant_method": "compressed-tensors"}, "re:visual.*", "model.visual.blocks.0", False),  # re.match anchors
    ({"quant_method": "compressed-tensors"}, "re:.*visual.*", "model.visual.blocks.0", True),
    ({"quant_method": "compressed-tensors"}, "lm_head", "lm_head", True),
    ({"quant_method": "compressed-tensors"}, "lm_head", "model.lm_head_x", False),
    ({"quant_method": "modelopt"}, "model.layers.*.self_attn*", "model.layers.4.self_attn.q_a_proj", True),
    ({"quant_method": "modelopt"}, "model.layers.0.self_attn.indexer*", "model.layers.0.self_attn.indexer.wk", True),
    ({"quant_method": "modelopt"}, "model.layers.0.self_attn.indexer*", "model.layers.10.self_attn.indexer.wk", False),
    ({"quant_method": "mxfp4"}, "model.layers.*.self_attn", "model.layers.7.self_attn.q_proj", True),
    ({"quant_method": "awq"}, "q_proj", "model.layers.0.self_attn.q_proj", True),
])
def test_exclusion_semantics(qcfg, entry, name, expected):
    spec = parse_quant_config(qcfg)
    assert exclusion_matches(spec, entry, name) is expected


def test_json_roundtrip_of_fixture(ckpts, tmp_path):
    from atomtool.inspect.report import to_json

    obj = to_json(inspect_checkpoint(str(ckpts["glm_moe_dsa"])))
    text = json.dumps(obj)
    assert json.loads(text)["dsa"]["layers"][2] == {"layer": 2, "role": "shared"}


def test_ct_multiple_config_groups_and_modelopt_mixed_precision(quantized):
    """Real mixed configs: several compressed-tensors groups / ModelOpt MIXED_PRECISION quantized_layers."""
    int4 = inspect_checkpoint(str(quantized["ct_int4"]))
    cfg = json.loads(json.dumps(int4.config))
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_1"] = {"targets": ["re:.*self_attn.*"], "format": "float-quantized",
                         "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    groups["group_0"]["format"] = "pack-quantized"
    r = build_report("x", cfg, int4.tensors)
    assert not [f for f in r.findings if f.code == "scheme-mismatch"]
    # only the FP8 self_attn group left: attention stored int4 is a mismatch, experts are not targeted at all
    cfg["quantization_config"]["config_groups"] = {"group_0": groups["group_1"]}
    r = build_report("x", cfg, int4.tensors)
    mism = {f.module for f in r.findings if f.code == "scheme-mismatch"}
    untargeted = {f.module for f in r.findings if f.code == "excluded-but-stored-quantized"}
    assert "model.layers.1.self_attn.q_a_proj" in mism and "model.layers.1.mlp.experts.0.up_proj" not in mism
    assert "model.layers.1.mlp.experts.0.up_proj" in untargeted

    nv = inspect_checkpoint(str(quantized["nvfp4"]))
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "exclude_modules": ["lm_head"],
             "quantized_layers": {"model.layers.1.self_attn.q_a_proj": {"quant_algo": "NVFP4"},
                                  "model.layers.1.self_attn.o_proj": {"quant_algo": "FP8"}}}
    cfg = dict(nv.config, quantization_config=mixed)
    r = build_report("x", cfg, nv.tensors, hf_quant_config=None)
    mods = _mods(r)
    assert mods["model.layers.1.self_attn.q_a_proj"].declared_quantized
    assert not mods["model.layers.1.self_attn.kv_b_proj"].declared_quantized  # not listed
    mism = [f for f in r.findings if f.code == "scheme-mismatch"]
    assert [f.module for f in mism] == ["model.layers.1.self_attn.o_proj"]  # stored nvfp4, declared FP8
    assert "declares fp8_tensor" in mism[0].message


def test_mxfp8_ignored_layers_prefix_semantics():
    spec = parse_quant_config({"quant_method": "mxfp8", "weight_block_size": [1, 32],
                               "ignored_layers": ["vision_tower", "model.layers.1.mlp.gate"]})
    assert spec.scheme == "mxfp8"
    assert exclusion_matches(spec, "vision_tower", "vision_tower.blocks.0.attn.qkv")
    assert not exclusion_matches(spec, "model.layers.1.mlp.gate", "model.layers.1.mlp.gate_proj")
