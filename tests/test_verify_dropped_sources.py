"""verify --source of layouts whose conversion left source tensors out on purpose (manifest ``dropped_sources``,
the plan's ``dropped``) or whose source has a tensor its index.json does not list: OK, not "source tensor
appears in no output tensor". Goes with dropped_sources_writer_verify.patch."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from atomtool.cli import app
from tests.checkpoints import load_state_dict, write_hf_checkpoint, write_state_dict


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_verify_source_accepts_what_convert_left_out(tmp_path):
    src = write_hf_checkpoint(tmp_path / "src", "qwen3", tie_word_embeddings=True)
    sd = load_state_dict(src)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # tied: left out
    sd.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(8) for i in range(2)})
    sd.update({k.replace("model.layers.1.", "model.layers.2."): v.clone()
               for k, v in list(sd.items()) if k.startswith("model.layers.1.")})  # beyond num_hidden_layers
    (src / "model.safetensors").unlink()
    write_state_dict(src, sd, shards=2)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"]["model.norm.weight"]
    part = load_file(str(shard))
    part["model.norm.bias"] = torch.ones_like(part["model.norm.weight"])  # in a header, not in the index
    save_file(part, str(shard), metadata={"format": "pt"})
    res = run("convert", src, tmp_path / "out")
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "out" / "atomtool.json").read_text())
    assert manifest["dropped_sources"]["lm_head.weight"] == "tied to model.embed_tokens.weight"
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in manifest["dropped_sources"]
    assert "model.layers.2.mlp.down_proj.weight" in manifest["dropped_sources"]
    res = run("verify", tmp_path / "out", "--source", src)
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("OK: ") and "appears in no output tensor" not in res.output


def test_verify_source_checks_dequantized_expert_parts(tmp_path):
    """An FP8 MoE layer with a BF16 expert is stacked in BF16 (FP8 parts dequantized with their scales,
    PartSpec.scale); verify --source compares each part with the dequantized source, and a changed scale is
    caught. Goes with dequantized_parts_layout_verify.patch."""
    from tests.checkpoints import write_fp8_block_checkpoint

    src = write_fp8_block_checkpoint(
        write_hf_checkpoint(tmp_path / "dsv3", "deepseek_v3", seed=5), tmp_path / "fp8x", block=16,
        leave_float=["experts.3."], modules_to_not_convert=["model.layers.1.mlp.experts.3",
                                                            "model.layers.2.mlp.experts.3"])
    for dtype in ("auto", "float32"):
        res = run("convert", src, tmp_path / dtype, "--dtype", dtype)
        assert res.exit_code == 0, res.output
        manifest = json.loads((tmp_path / dtype / "atomtool.json").read_text())
        part = manifest["tensors"]["model.layers.1.mlp.experts.w13.weight"]["parts"][0]
        assert part["scale"] == "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"
        assert part["scale_block"] == [16, 16]
        res = run("verify", tmp_path / dtype, "--source", src)
        assert res.exit_code == 0 and res.stdout.startswith("OK: "), res.output
    sd = load_state_dict(src)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"
    sd[name] = sd[name] * 2
    (src / "model.safetensors").unlink()
    write_state_dict(src, sd)
    res = run("verify", tmp_path / "float32", "--source", src)
    assert res.exit_code == 1
    assert ("model.layers.1.mlp.experts.w13.weight: part model.layers.1.mlp.experts.0.gate_proj.weight does not "
            "reproduce the source") in res.output
