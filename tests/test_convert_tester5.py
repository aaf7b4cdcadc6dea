"""Defects a fresh-user tester found where ``atomtool convert`` wrote a layout the engine then refused, or
refused what transformers loads. Each case is fed through the CLI (message, exit code); where the input is
now handled, ``generate`` from the layout (and from the raw directory) gives transformers' own float32
greedy tokens on the same checkpoint.

1. What transformers loads, convert + generate load the same way:
   (a) ``tie_word_embeddings: true`` with a stored ``lm_head.weight``: equal to the embedding -> tied (left
       out, a note); different -> transformers does not tie them (``tie_weights`` warns), so the stored
       lm_head is the output projection and the layout says ``tie_word_embeddings: false`` (a warning);
   (b) legacy ``rotary_emb.inv_freq`` buffers: left out (a note);
   (c) tensors of layers beyond ``num_hidden_layers`` in a family without MTP layers: left out (a warning
       naming them; inspect's ``extra-layers`` says the same);
   (d) a tensor in a shard header that model.safetensors.index.json does not list: the index is
       authoritative, the tensor is left out and convert prints inspect's warning.
2. An FP8 block DeepSeek-V3 with one routed expert per MoE layer left BF16: inspect warns
   (``experts-disagree``) instead of "No findings", and convert / generate dequantize the layer's FP8 experts
   and stack them in BF16 (exact in float32 with ``--dtype float32``) instead of an unloadable layout.
3. convert on an atomtool layout: refused (also with --force / --dry-run) with a clear message;
   ``missing_tensors`` recognises stacked experts.
4. Plain-float parts of one fusion stored in different dtypes are fused (``--dtype`` given: in it; ``auto``:
   widened to F32, lossless); an FP8/float disagreement is refused by generate with convert's reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.convert.plan import missing_tensors
from atomtool.inspect.classify import inspect_checkpoint
from atomtool.inspect.families import family_for
from atomtool.inspect.quant import expert_scheme_findings
from atomtool.inspect.types import ModuleInfo, TensorInfo
from tests.checkpoints import (
    dequantize_fp8_block_checkpoint,
    load_state_dict,
    write_fp8_block_checkpoint,
    write_hf_checkpoint,
    write_state_dict,
)
from tests.inspect_cli import inspect_json
from tests.test_config_weight_agreement import generate_error, greedy_tokens, hf_greedy_tokens

runner = CliRunner()


def run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


def convert_ok(src: Path, out: Path, *extra: str):
    res = run("convert", src, out, *extra)
    assert res.exit_code == 0, (res.output, res.exception)
    return res


def refused(*args) -> str:
    """The one ``error:`` line of a refused command (exit 1, no traceback), without the prefix."""
    res = run(*args)
    assert res.exit_code == 1, (res.output, res.exception)
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, res.stderr
    return lines[0].removeprefix("error: ")


def manifest_tensors(layout: Path) -> dict:
    return json.loads((layout / "atomtool.json").read_text())["tensors"]


def variant(src: Path, dst: Path, edit) -> Path:
    """A copy of single-file checkpoint ``src`` whose state dict ``edit(sd)`` changed in place."""
    shutil.copytree(src, dst)
    sd = load_state_dict(dst)
    edit(sd)
    (dst / "model.safetensors").unlink()
    write_state_dict(dst, sd)
    return dst


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Tiny checkpoints written once per module, by name."""
    root = tmp_path_factory.mktemp("t5")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            if name == "qwen3_tied":
                made[name] = write_hf_checkpoint(root / name, "qwen3", seed=3, tie_word_embeddings=True)
            elif name == "dsv3":
                made[name] = write_hf_checkpoint(root / name, "deepseek_v3", seed=5)
            elif name == "glm":
                made[name] = write_hf_checkpoint(root / name, "glm_moe_dsa", seed=5, dtype=torch.bfloat16)
            else:
                made[name] = write_hf_checkpoint(root / name, name, seed=3)
        return made[name]

    return get


# ------------------------------------------------------------------------ 1a. tied embeddings + stored lm_head


def test_tied_lm_head_equal_to_embedding_is_left_out_and_tied(base, tmp_path):
    src = variant(base("qwen3_tied"), tmp_path / "src",
                  lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"].clone()))
    report, rc = inspect_json(src)
    found = [f for f in report["findings"] if f["code"] == "lm-head-with-tied-embeddings"]
    assert rc == 0 and report["servable"] and [f["severity"] for f in found] == ["info"]
    assert "tied if their values are equal" in found[0]["message"]
    res = convert_ok(src, tmp_path / "out")
    assert "note: lm_head.weight equals model.embed_tokens.weight and config.json ties them" in res.stderr
    assert "lm_head.weight" not in manifest_tensors(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True
    ours = greedy_tokens(tmp_path / "out")
    assert len(ours) == 4
    assert ours == greedy_tokens(src) == hf_greedy_tokens(src)


def test_tied_lm_head_that_differs_is_kept_untied_as_transformers_does(base, tmp_path):
    gen = torch.Generator().manual_seed(11)
    src = variant(base("qwen3_tied"), tmp_path / "src", lambda sd: sd.__setitem__(
        "lm_head.weight", torch.randn(sd["model.embed_tokens.weight"].shape, generator=gen)))
    res = convert_ok(src, tmp_path / "out")
    assert ("warning: config.json sets tie_word_embeddings: true but the stored lm_head.weight differs from "
            "model.embed_tokens.weight; as transformers does (it warns and does not tie them), lm_head.weight is "
            "kept as the output projection and the layout's config.json says tie_word_embeddings: false"
            in res.stderr), res.stderr
    assert "lm_head.weight" in manifest_tensors(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    ours = greedy_tokens(tmp_path / "out")
    assert ours == greedy_tokens(src) == hf_greedy_tokens(src)
    assert ours != greedy_tokens(base("qwen3_tied"))  # the stored head is used: not the tied model's output


def test_tied_checkpoint_storing_only_lm_head_uses_it_as_the_embedding(base, tmp_path):
    src = variant(base("qwen3_tied"), tmp_path / "src",
                  lambda sd: sd.__setitem__("lm_head.weight", sd.pop("model.embed_tokens.weight")))
    report, rc = inspect_json(src)
    assert rc == 0 and report["servable"], report["findings"]
    res = convert_ok(src, tmp_path / "out")
    assert ("note: config.json ties the embeddings (tie_word_embeddings: true) and the checkpoint stores only "
            "lm_head.weight: written as model.embed_tokens.weight") in res.stderr
    assert manifest_tensors(tmp_path / "out")["model.embed_tokens.weight"]["parts"][0]["source"] == "lm_head.weight"
    assert "lm_head.weight" not in manifest_tensors(tmp_path / "out")
    ours = greedy_tokens(tmp_path / "out")
    assert ours == greedy_tokens(src) == hf_greedy_tokens(src) == greedy_tokens(base("qwen3_tied"))


# ------------------------------------------------------------------------------------- 1b. rotary inv_freq


def test_legacy_inv_freq_buffers_are_left_out(base, tmp_path):
    src = variant(base("llama"), tmp_path / "src", lambda sd: sd.update(
        {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(8) for i in range(2)}))
    res = convert_ok(src, tmp_path / "out")
    assert ("note: left out 2 rotary_emb.inv_freq buffer(s) (model.layers.0.self_attn.rotary_emb.inv_freq, "
            "model.layers.1.self_attn.rotary_emb.inv_freq): not weights") in res.stderr
    assert not any("inv_freq" in n for n in manifest_tensors(tmp_path / "out"))
    assert greedy_tokens(tmp_path / "out") == greedy_tokens(src) == hf_greedy_tokens(src)


def test_inv_freq_in_one_layer_only_is_not_a_missing_tensor_of_the_others(base, tmp_path):
    src = variant(base("llama"), tmp_path / "src", lambda sd: sd.__setitem__(
        "model.layers.0.self_attn.rotary_emb.inv_freq", torch.rand(8)))
    assert missing_tensors(inspect_checkpoint(str(src))) == []
    convert_ok(src, tmp_path / "out")


# ----------------------------------------------------------------------------- 1c. layers beyond the config


def _add_layer_2(sd: dict) -> None:
    sd.update({k.replace("model.layers.1.", "model.layers.2."): v.clone() * 3
               for k, v in list(sd.items()) if k.startswith("model.layers.1.")})


def test_extra_dense_layers_are_left_out_with_a_warning_naming_them(base, tmp_path):
    src = variant(base("llama"), tmp_path / "src", _add_layer_2)
    report, rc = inspect_json(src)
    found = [f for f in report["findings"] if f["code"] == "extra-layers"]
    assert rc == 0 and report["servable"] and len(found) == 1 and found[0]["severity"] == "warning"
    assert "9 tensor(s) of layer(s) 2 beyond the 2 layers config.json declares" in found[0]["message"]
    res = convert_ok(src, tmp_path / "out")
    assert f"warning: {found[0]['message']}" in res.stderr
    assert "model.layers.2.mlp.down_proj.weight" in res.stderr
    assert not any(n.startswith("model.layers.2.") for n in manifest_tensors(tmp_path / "out"))
    assert greedy_tokens(tmp_path / "out") == greedy_tokens(src) == hf_greedy_tokens(src)


def test_mtp_layer_of_a_deepseek_checkpoint_is_not_called_extra(base):
    report = inspect_checkpoint(str(base("dsv3")))
    assert report.config_flat["num_nextn_predict_layers"] == 1  # fixture: the MTP layer index 3 may exist
    assert not [f for f in report.findings if f.code == "extra-layers"]


# --------------------------------------------------------------------- 1d. a tensor the index does not list


def test_tensor_missing_from_the_index_is_left_out_and_the_warning_carried(base, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(base("llama"), src)
    sd = load_state_dict(src)
    (src / "model.safetensors").unlink()
    write_state_dict(src, sd, shards=2)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"]["model.layers.0.self_attn.o_proj.weight"]
    part = load_file(str(shard))
    rows = part["model.layers.0.self_attn.o_proj.weight"].shape[0]
    part["model.layers.0.self_attn.o_proj.bias"] = torch.full((rows,), 5.0)  # would change every token
    save_file(part, str(shard), metadata={"format": "pt"})  # in the shard's header, not in the index
    res = convert_ok(src, tmp_path / "out")
    assert "tensor(s) in shard headers are missing from weight_map (stale index?): " \
           "model.layers.0.self_attn.o_proj.bias; they are ignored" in res.stderr, res.stderr
    assert "model.layers.0.self_attn.o_proj.bias" not in manifest_tensors(tmp_path / "out")
    assert greedy_tokens(tmp_path / "out") == greedy_tokens(src) == hf_greedy_tokens(src)


# ---------------------------------------------------------------------------- 2. FP8 experts + one BF16 expert


@pytest.fixture(scope="module")
def fp8x(base, tmp_path_factory):
    """FP8 block DeepSeek-V3 (block 16) that leaves routed expert 3 of each MoE layer BF16, listed in
    ``modules_to_not_convert``; and the same weights dequantized into a plain float checkpoint (the oracle)."""
    root = tmp_path_factory.mktemp("fp8x")
    src = write_fp8_block_checkpoint(
        base("dsv3"), root / "fp8x", block=16, leave_float=["experts.3."],
        modules_to_not_convert=["model.layers.1.mlp.experts.3", "model.layers.2.mlp.experts.3"])
    return src, dequantized_copy(src, root / "dequantized")


def dequantized_copy(fp8: Path, dst: Path) -> Path:
    """A plain-float copy of FP8 block checkpoint ``fp8`` (every FP8 weight exactly dequantized to float32,
    no ``quantization_config``; side files copied): the oracle transformers loads without FP8 support."""
    shutil.copytree(fp8, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    write_state_dict(dst, dequantize_fp8_block_checkpoint(fp8))
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_fp8_moe_layer_with_a_bf16_expert_is_dequantized_and_stacked(fp8x, tmp_path):
    src, deq = fp8x
    report, rc = inspect_json(src)
    found = [f for f in report["findings"] if f["code"] == "experts-disagree"]
    assert rc == 0 and report["servable"], report["findings"]
    assert [(f["module"], f["severity"]) for f in found] == [("model.layers.1.mlp.experts", "warning"),
                                                             ("model.layers.2.mlp.experts", "warning")]
    assert "routed experts stored in different schemes (fp8_block: 7 of 8 experts; bf16: expert 3)" \
        in found[0]["message"]
    res = convert_ok(src, tmp_path / "bf16")
    assert ("warning: model.layers.1.mlp.experts: routed experts mix fp8_block and bf16 (expert 3 not quantized); "
            "the engine runs a layer's experts as one tensor of one scheme, so the FP8 experts are dequantized to "
            "BF16 (rounded to BF16; --dtype float32 keeps them exact) and the layer stacked in BF16: ") in res.stderr
    tensors = manifest_tensors(tmp_path / "bf16")
    assert tensors["model.layers.1.mlp.experts.w13.weight"]["dtype"] == "BF16"
    assert "model.layers.1.mlp.experts.w13.weight_scale_inv" not in tensors
    assert tensors["model.layers.0.mlp.gate_up_proj.weight"]["dtype"] == "F8_E4M3"  # other layers stay FP8
    assert len(greedy_tokens(tmp_path / "bf16")) == 4
    res = convert_ok(src, tmp_path / "f32", "--dtype", "float32")
    assert "dequantized to F32 (exact) and the layer stacked in F32" in res.stderr
    # float32: every dequantized value is exact, so the layout is the dequantized checkpoint
    ours = greedy_tokens(tmp_path / "f32")
    assert ours == greedy_tokens(src) == greedy_tokens(deq) == hf_greedy_tokens(deq)


# ----------------------------------------------------------------------------- 3. convert on a layout


def test_converting_a_layout_again_is_refused(base, tmp_path):
    glm_fp8 = write_fp8_block_checkpoint(base("glm"), tmp_path / "glm_fp8", block=24)
    layout = tmp_path / "L1"
    convert_ok(glm_fp8, layout)
    want = f"{layout} is already an atomtool layout (it has atomtool.json): serve it as it is"
    for extra in ((), ("--force",), ("--dry-run",)):
        line = refused("convert", layout, tmp_path / "L2", *extra)
        assert line.startswith(want) and "run convert on the Hugging Face checkpoint" in line, line
        assert not (tmp_path / "L2").exists()
    # the stacked experts and fused projections of the layout are no "missing" tensors
    report = inspect_checkpoint(str(layout))
    assert report.layout and any(n.endswith("mlp.experts.w13.weight") for n in report.tensors)
    assert missing_tensors(report) == []


# ---------------------------------------------------------------------- 4. float dtypes disagreeing in a fusion


@pytest.fixture(scope="module")
def mixed(base, tmp_path_factory):
    """Llama (F32) whose layer-0 k_proj alone is stored BF16."""
    return variant(base("llama"), tmp_path_factory.mktemp("mixed") / "mixed", lambda sd: sd.__setitem__(
        "model.layers.0.self_attn.k_proj.weight", sd["model.layers.0.self_attn.k_proj.weight"].bfloat16()))


@pytest.mark.parametrize("dtype, tag", [("float32", "F32"), ("auto", "F32")])
def test_float_parts_of_one_fusion_in_different_dtypes_are_fused(mixed, tmp_path, dtype, tag):
    res = convert_ok(mixed, tmp_path / "out", "--dtype", dtype)
    assert "note: 1 tensor cast BF16 -> F32 (lossless widening), e.g. model.layers.0.self_attn.k_proj.weight" \
        in res.stderr
    assert manifest_tensors(tmp_path / "out")["model.layers.0.self_attn.qkv_proj.weight"]["dtype"] == tag
    assert greedy_tokens(tmp_path / "out") == greedy_tokens(mixed) == hf_greedy_tokens(mixed)


def test_inspect_calls_a_float_dtype_mix_in_a_fusion_info(mixed):
    report, rc = inspect_json(mixed)
    found = [f for f in report["findings"] if f["code"] == "fused-shards-disagree"]
    assert rc == 0 and report["servable"] and [f["severity"] for f in found] == ["info"]
    assert "parts stored in different float dtypes (q_proj=fp32, k_proj=bf16, v_proj=fp32)" in found[0]["message"]


def test_fp8_and_float_parts_of_one_fusion_are_refused_by_generate_with_converts_reason(base, tmp_path):
    src = write_fp8_block_checkpoint(base("dsv3"), tmp_path / "fp8q", block=16,
                                     leave_float=["layers.0.self_attn.kv_a_proj_with_mqa"])
    report, _ = inspect_json(src)
    msg = next(f["message"] for f in report["findings"] if f["code"] == "fused-shards-disagree")
    assert "model.layers.0.self_attn.fused_qkv_a_proj: parts disagree in storage" in msg
    assert refused("convert", src, tmp_path / "out").startswith(
        f"{src} would not convert into a servable layout: fused-shards-disagree: {msg}")
    line = generate_error(src)
    assert line.startswith(f"{src}: fused-shards-disagree: {msg}") and "missing tensors" not in line


def test_experts_in_schemes_that_do_not_convert_exactly_are_an_error():
    """Any mix other than FP8 block + plain float (here int4_pack next to bf16) stays an error: nothing
    converts the schemes into each other exactly. (Unservable schemes are refused earlier by serve; inspect
    still names the layer.)"""
    def mod(e: int, x: str, scheme: str) -> ModuleInfo:
        name = f"model.layers.1.mlp.experts.{e}.{x}_proj"
        return ModuleInfo(name, scheme, "BF16", (8, 8), {"weight": TensorInfo(name + ".weight", "BF16", (8, 8), "f")})

    modules = {m.name: m for e in range(6) for x in ("gate", "up", "down")
               for m in [mod(e, x, "bf16" if e == 5 else "int4_pack")]}
    (f,) = expert_scheme_findings(modules, family_for("DeepseekV3ForCausalLM"))
    assert (f.code, f.severity, f.module) == ("experts-disagree", "error", "model.layers.1.mlp.experts")
    assert f.message.startswith("model.layers.1.mlp.experts: routed experts stored in different schemes "
                                "(int4_pack: 5 of 6 experts; bf16: expert 5)")
    assert "store the layer's experts in one scheme (int4_pack, as most are)" in f.message
    # FP8 block + BF16: a warning (convert dequantizes); BF16 + F32: no finding (stacked in one float dtype)
    for scheme, want in (("fp8_block", ["warning"]), ("fp32", [])):
        mixed = {n: ModuleInfo(m.name, scheme if "experts.5." not in n else "bf16", m.dtype, m.shape, m.tensors)
                 for n, m in modules.items()}
        assert [x.severity for x in expert_scheme_findings(mixed, family_for("DeepseekV3ForCausalLM"))] == want
