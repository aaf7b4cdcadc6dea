"""Every user-facing error of convert / verify / the layout reader: bad input in, one clear message out."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.convert.layout import is_layout, load_layout_specs, read_manifest
from atomtool.convert.materialize import iter_output_tensors
from atomtool.convert.plan import build_plan
from atomtool.errors import ConversionError, LayoutError, SourceError
from atomtool.inspect.classify import inspect_checkpoint
from tests.checkpoints import write_hf_checkpoint
from tests.test_convert_plan import dense_report, make_report, mla_config, mla_tensors

runner = CliRunner()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("err") / "llama", "llama", tokenizer=False)


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_unsupported_architecture_lists_supported(llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 1
    assert "error: unsupported architecture 'FancyNewForCausalLM'; supported: " in r.stderr
    assert "LlamaForCausalLM" in r.stderr and not (tmp_path / "out").exists()


def test_checkpoint_without_weights(llama, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(llama / "config.json", src / "config.json")
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 1 and "no safetensors weights to convert" in r.stderr


def test_src_is_a_file_and_revision_on_local_dir(llama, tmp_path):
    r = run("convert", llama / "config.json", tmp_path / "out")
    assert r.exit_code == 1 and "is a file; pass the checkpoint directory" in r.stderr
    r = run("convert", llama, tmp_path / "out", "--revision", "main")
    assert r.exit_code == 1 and "--revision applies to Hub repo ids" in r.stderr


def test_hub_download_failure_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub

    def boom(**kw):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", boom)
    r = run("convert", "org/model", tmp_path / "out")
    assert r.exit_code == 1
    assert r.stderr.strip() == ("error: org/model: not a local directory, and cannot download it from the "
                                "Hugging Face Hub (OSError: network unreachable)")


def test_incomplete_experts_and_name_clash_in_plan():
    t = mla_tensors(2, ["full", "full"], fp8=False, experts=4)
    for suffix in ("gate_proj", "up_proj", "down_proj"):
        del t[f"model.layers.1.mlp.experts.2.{suffix}.weight"]
    report = make_report(t, "GlmMoeDsaForCausalLM", mla_config(2, ["full", "full"], False), "deepseek_mla")
    with pytest.raises(ConversionError, match=r"model.layers.1.mlp.experts: expert indices are not 0..2"):
        build_plan(report)
    t = mla_tensors(2, ["full", "full"], fp8=False, experts=4)
    del t["model.layers.1.mlp.experts.1.up_proj.weight"]
    report = make_report(t, "GlmMoeDsaForCausalLM", mla_config(2, ["full", "full"], False), "deepseek_mla")
    with pytest.raises(ConversionError, match=r"model.layers.1.mlp.experts.1: expert lacks up_proj"):
        build_plan(report)
    report = dense_report(bias=False)
    clash = "model.layers.0.self_attn.qkv_proj.weight"
    report.tensors[clash] = report.tensors["model.layers.0.self_attn.o_proj.weight"].__class__(
        clash, "BF16", (8, 64), "model.safetensors")
    with pytest.raises(ConversionError, match="two output tensors are named model.layers.0.self_attn.qkv_proj"):
        build_plan(report)


def test_missing_shard_while_materializing(llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    plan = build_plan(inspect_checkpoint(str(src)))
    (src / "model.safetensors").unlink()
    with pytest.raises(SourceError, match=r"model.safetensors: cannot open shard"):
        list(iter_output_tensors(plan, src))


def test_layout_reader_errors(llama, tmp_path):
    out = tmp_path / "out"
    assert run("convert", llama, out).exit_code == 0
    manifest = json.loads((out / "atomtool.json").read_text())
    assert is_layout(out) and not is_layout(tmp_path) and not is_layout(tmp_path / "nope")
    (out / "atomtool.json").write_text("{not json")
    with pytest.raises(LayoutError, match="unreadable manifest"):
        read_manifest(out)
    (out / "atomtool.json").write_text(json.dumps({**manifest, "format": "other"}))
    with pytest.raises(LayoutError, match="format is not 'atomtool-layout'"):
        read_manifest(out)
    (out / "atomtool.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(LayoutError, match="layout version 99 is not supported"):
        load_layout_specs(out)
    bad = json.loads(json.dumps(manifest))
    del next(iter(bad["tensors"].values()))["shape"]
    (out / "atomtool.json").write_text(json.dumps(bad))
    with pytest.raises(LayoutError, match=r"malformed entry \(KeyError\('shape'\)\)"):
        load_layout_specs(out)
    r = run("verify", out)
    assert r.exit_code == 1 and "malformed entry" in r.stderr
    (out / "atomtool.json").write_text(json.dumps(manifest))
    (out / "model.safetensors.index.json").unlink()
    r = run("verify", out)
    assert r.exit_code == 1 and "model.safetensors.index.json: missing or malformed index" in r.stderr


def test_verify_reports_missing_and_extra_source_tensors(llama, tmp_path):
    out = tmp_path / "out"
    assert run("convert", llama, out).exit_code == 0
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    from safetensors.torch import save_file

    from tests.checkpoints import load_state_dict

    sd = load_state_dict(src)
    sd.pop("model.norm.weight")
    sd["extra.weight"] = sd["model.layers.0.input_layernorm.weight"].clone()
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = run("verify", out, "--source", src)
    assert r.exit_code == 1
    assert "problem: model.norm.weight: part model.norm.weight is not in the source" in r.stderr
    assert "problem: extra.weight: source tensor appears in no output tensor" in r.stderr


def test_disk_full_mid_write_is_an_error_and_leaves_nothing(llama, tmp_path, monkeypatch):
    import errno
    import os

    import atomtool.convert.writer as writer

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer.os, "copy_file_range", full)
    monkeypatch.setattr(writer, "_write_all", full)
    r = run("convert", llama, tmp_path / "out")
    assert r.exit_code == 1
    assert r.stderr.startswith("error: writing ") and "No space left on device; nothing was written" in r.stderr
    assert list(tmp_path.iterdir()) == []
