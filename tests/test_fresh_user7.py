"""Fresh-user pass 7 (inspect / convert / verify on real-looking checkpoints): reproducers for defects found.

Each test was a strict-xfail reproducer; the defects are fixed and the tests keep them fixed.

- A float-stored weight with a stray quantization companion (``weight_scale_inv`` / ``input_scale`` left
  over by an export tool): inspect warns "treated as unquantized, companions ignored" (transformers ignores
  them too), but convert copies the companions into the layout and, on a module that fuses or stacks,
  gives up the fusion (``q_a_proj`` stays separate, the MoE experts stay unstacked). convert says "wrote"
  and exits 0; the layout (and generate/serve on the raw checkpoint, same plan) then fails to load
  ("missing tensors ... fused_qkv_a_proj.weight ...; unexpected tensors ... weight_scale_inv").
- inspect's ``float-dtype-differs`` on F16 tensors in a BF16 model says "F16 -> BF16: lossy cast, may
  overflow above 65504": BF16 holds every F16 value's magnitude, nothing can overflow in that direction.
- A sharded checkpoint whose index does not list a shard file (a stale index.json): inspect reports
  "the checkpoint has no lm_head.weight" while ``model-000NN.safetensors`` holds it, and says nothing about
  the file it did not read.
- A shard that the index places in a subfolder (``weights/model-00003-of-00012.safetensors``) is read and
  converted, yet convert says "not carried: ... (safetensors in a subfolder (not converted))".
- ``weight_block_size: "128"`` / ``128`` / ``[128]`` (transformers refuses them) silently read as per-tensor FP8:
  one scheme-mismatch error per module instead of one line naming the field.
- ``modules_to_not_convert: "lm_head"`` (a string) is read character by character: every module is excluded.
- config.json without ``architectures``: "unknown architecture 'unknown' (neither atomtool nor transformers
  knows it)"; convert: "unsupported architecture 'unknown'".
- An empty SRC / OUT / LAYOUT argument (``"$OUT"`` unset) is the current directory: ``convert SRC ""`` writes
  the layout into the working directory.
- ``convert SRC .`` renames the finished layout over the working directory: the shell is left in a deleted
  directory and ``ls`` shows nothing where "wrote ..." was just printed.
- A local directory with both ``model.safetensors`` and ``model.safetensors.index.json``: atomtool converts the
  index's shards, transformers' ``from_pretrained`` loads ``model.safetensors`` (another model).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from atomtool.cli import app
from tests.checkpoints import write_hf_checkpoint


@pytest.fixture(scope="module")
def v32_src(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("fresh7") / "v32", "deepseek_v32", dtype=torch.bfloat16)


def _layout_tensors(out) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                got[k] = fh.get_tensor(k)
    return got


def test_stray_scales_on_float_weights_are_left_out_and_fusions_kept(v32_src, tmp_path):
    import shutil

    src = tmp_path / "stray"
    shutil.copytree(v32_src, src)
    t = load_file(str(src / "model.safetensors"))
    stray = {
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(2, 4),  # a part of fused_qkv_a_proj
        "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv": torch.ones(2, 4),  # a stacked expert
        "model.layers.1.self_attn.o_proj.input_scale": torch.ones(()),
        "lm_head.weight_scale_inv": torch.ones(8, 4),
    }
    t.update(stray)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    runner = CliRunner()
    clean = runner.invoke(app, ["convert", str(v32_src), str(tmp_path / "clean")])
    assert clean.exit_code == 0, clean.output
    res = runner.invoke(app, ["convert", str(src), str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "weight_scale_inv" in res.output  # the user is told what was left out
    want, got = _layout_tensors(tmp_path / "clean"), _layout_tensors(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    ver = runner.invoke(app, ["verify", str(tmp_path / "out"), "--source", str(src)])
    assert ver.exit_code == 0, ver.output
    manifest = json.loads((tmp_path / "out" / "atomtool.json").read_text())
    assert set(stray) <= set(manifest.get("dropped_sources") or {})
    # the raw checkpoint runs through the same plan
    gen = [runner.invoke(app, ["generate", str(p), "--prompt", "Hi", "--max-tokens", "3", "--json",
                               "--device", "cpu"]) for p in (v32_src, src)]
    assert gen[1].exit_code == 0, gen[1].output
    assert json.loads(gen[1].stdout)[0]["token_ids"] == json.loads(gen[0].stdout)[0]["token_ids"]


def _float_dtype_messages(src) -> list[str]:
    res = CliRunner().invoke(app, ["inspect", str(src), "--json"])
    return [f["message"] for f in json.loads(res.stdout)["findings"] if f["code"] == "float-dtype-differs"]


def test_f16_tensors_in_bf16_model_do_not_claim_overflow(tmp_path):
    src = write_hf_checkpoint(tmp_path / "mixed", "llama", dtype=torch.bfloat16, tokenizer=False)
    t = load_file(str(src / "model.safetensors"))
    t = {k: (v.to(torch.float16) if "layers.1." in k else v) for k, v in t.items()}
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    (msg,) = _float_dtype_messages(src)
    assert "F16 -> BF16" in msg and "overflow" not in msg, msg
    # the other direction can overflow and still says so
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = "float16"
    (src / "config.json").write_text(json.dumps(cfg))
    (msg,) = _float_dtype_messages(src)
    assert "BF16 -> F16" in msg and "overflow above 65504" in msg, msg


def test_inspect_names_a_shard_file_the_index_does_not_list(tmp_path):
    src = write_hf_checkpoint(tmp_path / "sharded", "llama", dtype=torch.bfloat16, max_shard_size="20KB",
                              tokenizer=False)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop("lm_head.weight")
    assert shard not in index["weight_map"].values()  # lm_head has a shard of its own
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    res = CliRunner().invoke(app, ["inspect", str(src)])
    assert res.exit_code == 1  # the model has no output projection as transformers loads it
    assert shard in res.output, res.output


def test_index_shard_in_a_subfolder_is_converted_not_reported_left_out(tmp_path):
    src = write_hf_checkpoint(tmp_path / "sharded", "llama", dtype=torch.bfloat16, max_shard_size="20KB",
                              tokenizer=False)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[2]
    (src / "weights").mkdir()
    (src / shard).rename(src / "weights" / shard)
    index["weight_map"] = {k: (f"weights/{v}" if v == shard else v) for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "not carried" not in res.output, res.output  # the shard was read and converted
    manifest = json.loads((tmp_path / "out" / "atomtool.json").read_text())
    assert manifest["not_carried"] == []
    assert not (tmp_path / "out" / "weights").exists()  # not copied as an extra file either
    assert CliRunner().invoke(app, ["verify", str(tmp_path / "out"), "--source", str(src)]).exit_code == 0


def test_mistral_consolidated_file_beside_an_index_is_not_called_a_stale_index(tmp_path):
    src = write_hf_checkpoint(tmp_path / "sharded", "llama", dtype=torch.bfloat16, max_shard_size="40KB",
                              tokenizer=False)
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(src / "consolidated.safetensors"))
    res = CliRunner().invoke(app, ["inspect", str(src), "--json"])
    assert res.exit_code == 0, res.output
    assert not [f for f in json.loads(res.stdout)["findings"] if f["code"] == "source-warning"]


def _llama_with_config(tmp_path, edit):
    """A tiny Llama checkpoint whose config.json ``edit`` (a function of the config dict) changed in place."""
    src = write_hf_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def _refused_by_inspect_and_convert(tmp_path, src):
    """``inspect`` and ``convert`` of ``src``: each exits 1 without a traceback; their outputs."""
    outputs = []
    for cmd in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "out")]):
        res = CliRunner().invoke(app, cmd)
        assert res.exit_code == 1, res.output
        assert "Traceback" not in res.output, res.output
        outputs.append(res.output)
    return outputs


@pytest.mark.parametrize("wbs", ["128", 128, [128], [128, 128, 128]])
def test_malformed_weight_block_size_is_named_not_read_as_per_tensor(tmp_path, wbs):
    src = _llama_with_config(tmp_path, lambda cfg: cfg.update(quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": wbs}))
    for output in _refused_by_inspect_and_convert(tmp_path, src):
        assert "weight_block_size must be two positive integers" in output, output


def test_exclusion_list_given_as_a_string_is_a_config_error(tmp_path):
    src = _llama_with_config(tmp_path, lambda cfg: cfg.update(quantization_config={
        "quant_method": "fp8", "weight_block_size": [16, 16], "modules_to_not_convert": "lm_head"}))
    res = CliRunner().invoke(app, ["inspect", str(src)])
    assert res.exit_code == 1, res.output
    assert "modules_to_not_convert must be a list of module names" in res.output, res.output
    assert "Traceback" not in res.output


def test_config_without_architectures_is_named_as_such(tmp_path):
    src = _llama_with_config(tmp_path, lambda cfg: cfg.pop("architectures"))
    for output in _refused_by_inspect_and_convert(tmp_path, src):
        assert "no 'architectures'" in output and "model_type 'llama'" in output, output
        assert "'unknown'" not in output, output
    (src / "config.json").unlink()
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out")])
    assert res.exit_code == 1 and "no config.json" in res.output, res.output


def test_empty_path_arguments_are_refused_not_read_as_the_current_directory(tmp_path, monkeypatch):
    src = write_hf_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    work = tmp_path / "cwd"  # an empty working directory: convert "" would write the layout into it
    work.mkdir()
    monkeypatch.chdir(work)
    runner = CliRunner()
    for cmd in (["convert", str(src), ""], ["convert", "", "out"], ["inspect", ""], ["verify", ""]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 1, (cmd, res.output)
        assert "empty" in res.output and "Traceback" not in res.output, (cmd, res.output)
    assert list(work.iterdir()) == []


def test_convert_into_the_current_directory_is_refused(tmp_path, monkeypatch):
    import os

    src = write_hf_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    work = tmp_path / "layout"
    work.mkdir()
    monkeypatch.chdir(work)
    before = os.stat(".").st_ino
    res = CliRunner().invoke(app, ["convert", str(src), "."])
    assert res.exit_code == 1, res.output
    assert "current directory" in res.output and "Traceback" not in res.output, res.output
    assert os.stat(str(work)).st_ino == before and list(work.iterdir()) == []


def test_model_safetensors_beside_an_index_is_read_as_transformers_does(tmp_path):
    import shutil

    single = write_hf_checkpoint(tmp_path / "single", "llama", seed=1, tokenizer=False)
    both = write_hf_checkpoint(tmp_path / "both", "llama", seed=2, max_shard_size="40KB", tokenizer=False)
    shutil.copy(single / "model.safetensors", both / "model.safetensors")
    # transformers' from_pretrained loads model.safetensors when both are there (modeling_utils checks it first)
    runner = CliRunner()
    assert runner.invoke(app, ["convert", str(single), str(tmp_path / "want")]).exit_code == 0
    res = runner.invoke(app, ["convert", str(both), str(tmp_path / "got")])
    assert res.exit_code == 0, res.output
    assert "model.safetensors" in res.output and "index" in res.output, res.output  # the choice is said
    want, got = _layout_tensors(tmp_path / "want"), _layout_tensors(tmp_path / "got")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    manifest = json.loads((tmp_path / "got" / "atomtool.json").read_text())
    assert all(e["reason"].startswith("safetensors next to model.safetensors") for e in manifest["not_carried"])
