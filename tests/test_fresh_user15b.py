"""Defects found by a fresh user (round 15b, session 14: inspect / convert / generate); each test reproduces one.

Oracles:
- ``save_pretrained``, ``huggingface-cli download --local-dir`` and ``cp -r`` fill an existing empty directory in
  place; an OUT that is a mount point (a Docker volume) cannot be renamed over (EBUSY), so convert fills it in
  place too, still never leaving a half-written layout that looks valid (the manifest moves in last).
- README: every error is one ``error:`` line; vLLM refuses a prompt whose token ids fall outside the model's
  vocabulary ("Token id N is out of vocabulary").
- research/dsa.md: a layer whose schedule role is ``shared`` owns no indexer; indexer tensors it stores anyway
  are unused (inspect warns), so they cannot make another shared layer "incomplete".
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

import atomtool.convert.writer as writer
from atomtool.cli import app
from atomtool.convert.layout import MANIFEST_NAME
from tests.checkpoints import write_hf_checkpoint

runner = CliRunner()


def cli_output(r) -> str:
    return r.output + (r.stderr if r.stderr_bytes is not None else "")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("q") / "q", "qwen3")


def _convert(*args):
    r = runner.invoke(app, ["convert", *map(str, args)])
    return r.exit_code, cli_output(r)


def _as_mount_point(monkeypatch, out):
    real = writer.stages_inside
    monkeypatch.setattr(writer, "stages_inside", lambda p: os.path.realpath(p) == os.path.realpath(out) or real(p))


# ---------------------------------------------------------------- OUT a mount point: filled in place
def test_an_empty_mount_point_is_filled_in_place(qwen, tmp_path, monkeypatch):
    out = tmp_path / "vol"
    out.mkdir()
    inode = out.stat().st_ino
    _as_mount_point(monkeypatch, out)
    code, text = _convert(qwen, out)
    assert code == 0, text  # observed: "writing m failed: Device or resource busy"
    assert out.stat().st_ino == inode  # the directory itself stays (a mount point cannot be replaced)
    assert (out / MANIFEST_NAME).is_file() and not list(out.glob(".atomtool.tmp-*"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".vol.tmp-")]  # nothing staged next to it
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0


def test_a_failed_move_into_a_mount_point_leaves_it_empty(qwen, tmp_path, monkeypatch):
    out = tmp_path / "vol"
    out.mkdir()
    _as_mount_point(monkeypatch, out)
    real_rename = os.rename

    def rename(a, b):
        if str(b).endswith(MANIFEST_NAME):
            raise OSError(5, "Input/output error", str(b))
        real_rename(a, b)

    monkeypatch.setattr(writer.os, "rename", rename)
    code, text = _convert(qwen, out)
    assert code == 1 and "nothing was written" in text
    assert list(out.iterdir()) == []  # every file moved in before the manifest went back, then the stage


def test_overwrite_of_a_full_mount_point_is_refused_and_stale_stages_are_cleaned(qwen, tmp_path, monkeypatch):
    out = tmp_path / "vol"
    out.mkdir()
    _as_mount_point(monkeypatch, out)
    stale = out / ".atomtool.tmp-dead0000"  # left by a killed conversion (no owner recorded, old)
    stale.mkdir()
    (stale / "x").write_bytes(b"0" * 100)
    old = 1_000_000_000
    os.utime(stale, (old, old))
    code, text = _convert(qwen, out)
    assert code == 0, text
    assert not stale.exists() and "removed the stale temporary directory" in text
    code, text = _convert(qwen, out, "--overwrite")
    assert code == 1 and "is a mount point" in text and "--overwrite is refused" in text
    assert (out / MANIFEST_NAME).is_file()  # the layout there is untouched


# ---------------------------------------------------------------- generate: a tokenizer larger than the model
def test_prompt_ids_past_the_models_vocabulary_are_one_error_line(tmp_path):
    ckpt = write_hf_checkpoint(tmp_path / "v", "llama", vocab_size=64)  # the fixture tokenizer has more ids
    r = runner.invoke(app, ["generate", str(ckpt), "--prompt", "Hello world, a longer prompt", "--max-tokens", "2",
                            "--device", "cpu"])
    out = cli_output(r)
    assert r.exit_code == 1, out  # observed: IndexError traceback from F.embedding
    assert "outside the model's vocabulary [0, 64)" in out and "Traceback" not in out


# ---------------------------------------------------------------- GLM: unused indexer tensors of a shared layer
def test_a_shared_layers_unused_indexer_does_not_make_another_shared_layer_incomplete(tmp_path):
    src = write_hf_checkpoint(tmp_path / "g", "glm_moe_dsa", indexer_types=["full", "full", "shared", "full"])
    cfg = json.loads((src / "config.json").read_text())
    cfg["indexer_types"] = ["full", "shared", "shared", "full"]  # layer 1 keeps indexer tensors it does not use
    (src / "config.json").write_text(json.dumps(cfg))
    code, text = _convert(src, tmp_path / "out")
    assert code == 0, text  # observed: "checkpoint lacks 5 tensor(s) ...: model.layers.2.self_attn.indexer..."
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert not manifest.get("forced")


# ---------------------------------------------------------------- unreadable sources
def test_an_unreadable_source_directory_is_one_error_line(qwen, monkeypatch):
    import atomtool.inspect.source as source

    real = os.listdir

    def listdir(p="."):
        if os.path.realpath(p) == os.path.realpath(qwen):
            raise PermissionError(13, "Permission denied", str(p))
        return real(p)

    monkeypatch.setattr(source.os, "listdir", listdir)
    for cmd in (["inspect", str(qwen)], ["convert", str(qwen), "/tmp/never-written-out"]):
        r = runner.invoke(app, cmd)
        out = cli_output(r)
        assert r.exit_code == 1 and "cannot read the directory (Permission denied)" in out, out
        assert "Traceback" not in out
    assert not os.path.exists("/tmp/never-written-out")


def test_a_source_file_that_cannot_be_read_is_named_as_a_read_failure(qwen, tmp_path, monkeypatch):
    def copy_extra_files(found, dst):
        raise PermissionError(13, "Permission denied", str(qwen / "tokenizer.json"))

    monkeypatch.setattr(writer, "copy_extra_files", copy_extra_files)
    code, text = _convert(qwen, tmp_path / "out")
    assert code == 1 and f"cannot read {qwen / 'tokenizer.json'} (Permission denied)" in text, text
    assert "writing" not in text and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- convert says why it found no weights
def test_no_weights_to_convert_says_why(qwen, tmp_path):
    pickle = tmp_path / "pickle"
    pickle.mkdir()
    shutil.copy(qwen / "config.json", pickle)
    (pickle / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    code, text = _convert(pickle, tmp_path / "o1")
    assert code == 1 and "no safetensors weights to convert" in text
    assert "pickle checkpoints" in text and "pytorch_model.bin" in text  # observed: only the first sentence
    sharded = tmp_path / "sharded"
    write_hf_checkpoint(sharded, "qwen3", max_shard_size="20KB")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    code, text = _convert(sharded, tmp_path / "o2")
    assert code == 1 and "model.safetensors.index.json" in text, text


# ---------------------------------------------------------------- FP8 weights with no quantization_config
def test_quantized_weights_without_a_quantization_config_are_named(tmp_path):
    from tests.checkpoints import write_fp8_block_checkpoint
    from tests.inspect_cli import inspect_json

    src = write_hf_checkpoint(tmp_path / "src", "deepseek_v32")
    fp8 = write_fp8_block_checkpoint(src, tmp_path / "fp8", block=16)
    declared, _ = inspect_json(fp8)
    assert not [f for f in declared["findings"] if f["code"] == "quantized-without-config"]
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    report, code = inspect_json(fp8)
    found = [f for f in report["findings"] if f["code"] == "quantized-without-config"]
    assert code == 0 and len(found) == 1, report["findings"]  # observed: "No findings"
    assert found[0]["severity"] == "warning" and "fp8_block" in found[0]["message"]
    assert "[16, 16]" in found[0]["message"] and "declare it in config.json" in found[0]["message"]


# ---------------------------------------------------------------- generation_config.json that is not an object
@pytest.mark.parametrize("mode, code", [("auto", 1), ("none", 0)])
def test_a_generation_config_that_is_not_an_object_is_named_or_ignored(tmp_path, mode, code):
    ckpt = write_hf_checkpoint(tmp_path / "q", "qwen3")
    (ckpt / "generation_config.json").write_text("[1]")
    r = runner.invoke(app, ["generate", str(ckpt), "--prompt", "a", "--max-tokens", "1", "--device", "cpu",
                            "--generation-config", mode])
    out = cli_output(r)
    assert "Traceback" not in out and "AttributeError" not in out, out  # observed: 'list' object has no 'get'
    assert r.exit_code == code, out
    if code:
        assert "generation_config.json" in out


def test_generate_notes_only_the_generation_defaults_it_takes(tmp_path):
    ckpt = write_hf_checkpoint(tmp_path / "q", "qwen3")
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 5}))
    base = ["generate", str(ckpt), "--prompt", "a", "--device", "cpu"]
    plain = cli_output(runner.invoke(app, base))
    assert "temperature=0.6" in plain and "top_p=0.95" in plain and "max_tokens=5" in plain
    flags = cli_output(runner.invoke(app, [*base, "--temperature", "0", "--max-tokens", "3"]))
    assert "top_p=0.95" in flags  # still taken
    assert "temperature=0.6" not in flags and "max_tokens=5" not in flags  # observed: named though overridden
