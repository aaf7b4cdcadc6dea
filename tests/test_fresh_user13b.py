"""Fresh-user pass 13b (convert -> damaged layout -> load, on CPU): reproducers for defects found.

Each test was a strict-xfail reproducer; the defects are fixed and the tests keep them fixed.

- A manifest (``atomtool.json``) that no longer matches the shards loaded silently: a tensor entry whose
  ``dtype`` or ``file`` was edited, a tensor dropped from / added to the manifest, or the whole manifest copied
  from another model (a Llama manifest next to Qwen3 shards) -- ``generate`` printed text and exited 0. The
  loader took names, dtypes and shapes from the index and the shard headers and never compared them with the
  manifest it builds the model from (``atomtool verify`` does, but only when run).
- A fused tensor's parts edited in the manifest (``qkv_proj``'s ``k_proj`` / ``v_proj`` row ranges swapped,
  or the parts listed out of order) loaded without a word and generated different text: the Llama/Qwen
  attention splits ``qkv_proj`` by the parts' positions in the list, never checking which source each is.
- ``"version": true`` in the manifest was accepted as layout version 1 (``True == 1`` in Python).
- convert whose final directory sync fails after the rename (an fsync of OUT's parent returning EIO) said
  ``error: writing OUT failed ...; nothing was written`` and exited 1 although OUT was complete and in place;
  with ``--overwrite`` the previous layout had already been deleted.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch
from typer.testing import CliRunner

from atomtool.cli import app
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import convert_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fresh13b")
    qwen3 = write_hf_checkpoint(root / "qwen3", "qwen3", dtype=torch.bfloat16)
    llama = write_hf_checkpoint(root / "llama", "llama", dtype=torch.bfloat16)
    res = CliRunner().invoke(app, ["convert", str(qwen3), str(root / "L_qwen3"), "--shard-size", "20KB"])
    assert res.exit_code == 0, res.output
    return {"qwen3": qwen3, "L_qwen3": root / "L_qwen3", "L_llama": convert_checkpoint(llama, root / "L_llama")}


def _copy(layout, tmp_path):
    out = tmp_path / "layout"
    shutil.copytree(layout, out)
    return out


def _edit_manifest(layout, fn):
    path = layout / "atomtool.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def _generate(model):
    return CliRunner().invoke(app, ["generate", str(model), "--prompt", "abcdefghijkl", "--max-tokens", "6",
                                    "--ignore-eos", "--json"])


def _assert_refused(layout, *needles):
    res = _generate(layout)
    assert res.exit_code == 1, res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error: "), res.output
    assert "Traceback" not in res.output
    for n in needles:
        assert n in line, line
    return line


DOWN = "model.layers.0.mlp.down_proj.weight"
QKV = "model.layers.0.self_attn.qkv_proj.weight"


@pytest.mark.parametrize("dtype", ["F32", "F16", "X9"])
def test_manifest_dtype_edit_is_refused_naming_tensor_and_file(ckpts, tmp_path, dtype):
    """A manifest entry whose dtype differs from the shard header's: a LayoutError naming the tensor, the
    shard and both dtypes (the model is built from the manifest, the bytes come from the shard)."""
    out = _copy(ckpts["L_qwen3"], tmp_path)
    _edit_manifest(out, lambda m: m["tensors"][DOWN].update(dtype=dtype))
    line = _assert_refused(out, DOWN, dtype, "BF16")
    assert ".safetensors" in line


def test_manifest_file_edit_is_refused(ckpts, tmp_path):
    """The manifest says another shard than the index (and the shard header) does: refused, both named."""
    out = _copy(ckpts["L_qwen3"], tmp_path)
    actual = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][DOWN]
    other = next(f.name for f in sorted(out.glob("*.safetensors")) if f.name != actual)
    _edit_manifest(out, lambda m: m["tensors"][DOWN].update(file=other))
    _assert_refused(out, DOWN, other, actual)


def test_tensor_dropped_from_or_added_to_the_manifest_is_refused(ckpts, tmp_path):
    """A tensor the index lists but the manifest does not (or the reverse): refused, the tensor named."""
    out = _copy(ckpts["L_qwen3"], tmp_path)
    _edit_manifest(out, lambda m: m["tensors"].pop("model.layers.0.self_attn.q_norm.weight"))
    _assert_refused(out, "model.layers.0.self_attn.q_norm.weight", "manifest")
    out2 = _copy(ckpts["L_qwen3"], tmp_path / "b")
    _edit_manifest(out2, lambda m: m["tensors"].__setitem__("model.layers.0.extra.weight", m["tensors"][DOWN]))
    _assert_refused(out2, "model.layers.0.extra.weight", "index")


def test_manifest_from_another_model_is_refused(ckpts, tmp_path):
    """Llama's atomtool.json copied over a Qwen3 layout's: refused (the tensor sets differ), not loaded."""
    out = _copy(ckpts["L_qwen3"], tmp_path)
    shutil.copy(ckpts["L_llama"] / "atomtool.json", out / "atomtool.json")
    _assert_refused(out, "atomtool.json")


def _swap_kv_rows(m):
    parts = m["tensors"][QKV]["parts"]
    parts[1]["rows"], parts[2]["rows"] = parts[2]["rows"], parts[1]["rows"]


def _reorder_parts(m):
    parts = m["tensors"][QKV]["parts"]
    parts[1], parts[2] = parts[2], parts[1]


@pytest.mark.parametrize("edit", [_swap_kv_rows, _reorder_parts], ids=["rows-swapped", "parts-reordered"])
def test_fused_parts_edited_in_the_manifest_are_refused(ckpts, tmp_path, edit):
    """k_proj / v_proj rows swapped, or the parts listed v before k: the manifest no longer describes the
    shard's bytes (convert writes parts in row order, in the family's fusion order); refused, the fused
    tensor named -- never split at the wrong rows."""
    out = _copy(ckpts["L_qwen3"], tmp_path)
    _edit_manifest(out, edit)
    _assert_refused(out, QKV)


def test_boolean_manifest_version_is_refused(ckpts, tmp_path):
    """``"version": true`` is not layout version 1."""
    out = _copy(ckpts["L_qwen3"], tmp_path)
    _edit_manifest(out, lambda m: m.update(version=True))
    _assert_refused(out, "version")


def test_undamaged_layout_matches_the_raw_checkpoint(ckpts):
    """Control: the checks above do not refuse a good layout, and it generates what the raw checkpoint does."""
    a, b = _generate(ckpts["L_qwen3"]), _generate(ckpts["qwen3"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert json.loads(a.stdout)[0]["token_ids"] == json.loads(b.stdout)[0]["token_ids"]


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_directory_sync_failing_after_the_rename_does_not_claim_nothing_was_written(ckpts, tmp_path, monkeypatch,
                                                                                    overwrite):
    """Once OUT is renamed into place the layout is complete: an fsync of OUT's parent that fails afterwards
    is a warning, exit 0, and OUT loads; with --overwrite the new layout is in place (the old one is gone
    either way, so "nothing was written" would be false twice)."""
    import atomtool.convert.writer as W

    out = tmp_path / "out"
    if overwrite:
        assert CliRunner().invoke(app, ["convert", str(ckpts["qwen3"]), str(out)]).exit_code == 0
        _edit_manifest(out, lambda m: m.update(created="old"))
    orig, parent = os.fsync, os.stat(out.resolve().parent)

    def fsync(fd):  # the disk fails the fsync of OUT's parent directory (the real sync path runs)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (parent.st_dev, parent.st_ino):
            raise OSError(errno.EIO, "Input/output error")
        return orig(fd)

    monkeypatch.setattr(W.os, "fsync", fsync)
    res = CliRunner().invoke(app, ["convert", str(ckpts["qwen3"]), str(out)] + (["--overwrite"] if overwrite else []))
    monkeypatch.undo()
    assert "nothing was written" not in res.output
    assert res.exit_code == 0, res.output
    assert "warning:" in res.output and "Input/output error" in res.output
    assert json.loads((out / "atomtool.json").read_text())["created"] != "old"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert _generate(out).exit_code == 0
