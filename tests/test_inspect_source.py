"""CheckpointSource on local directories: layouts, index.json checks, config.json errors, bad sources.

Fixtures are real checkpoints written by transformers' save_pretrained (tests/checkpoints.py); the
reference for what they contain is safetensors' own reader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from atomtool.errors import ConfigError, HeaderError, SourceError
from atomtool.inspect.source import CheckpointSource
from tests.checkpoints import write_hf_checkpoint


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("sharded"), "deepseek_v32", max_shard_size="40KB",
                               tokenizer=False)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("single"), "llama", tokenizer=False)


def reference_tensors(root: Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                out[k] = (f.name, sl.get_dtype(), tuple(sl.get_shape()))
    return out


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_single_file_checkpoint(single):
    src = CheckpointSource.open(str(single))
    assert src.files == ["model.safetensors"] and not src.is_remote and src.root == single
    assert src.config == json.loads((single / "config.json").read_text())
    assert {k: (t.file, t.dtype, t.shape) for k, t in src.tensors.items()} == reference_tensors(single)
    assert src.metadata["model.safetensors"].get("format") == "pt"
    assert src.index_metadata is None and src.warnings == []


def test_sharded_checkpoint(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2, "fixture should be sharded"
    src = CheckpointSource.open(str(sharded))
    assert src.files == sorted(set(index["weight_map"].values()))
    assert {k: t.file for k, t in src.tensors.items()} == index["weight_map"]
    assert {k: (t.file, t.dtype, t.shape) for k, t in src.tensors.items()} == reference_tensors(sharded)
    assert src.index_metadata == index["metadata"]
    assert set(src.metadata) == set(src.files)
    assert src.local_path(src.files[0]) == sharded / src.files[0]
    assert src.read_json("generation_config.json")["eos_token_id"] == 2
    assert src.read_json("hf_quant_config.json") is None


def test_index_names_missing_shard(sharded, tmp_path):
    d = copy(sharded, tmp_path)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(SourceError) as e:
        CheckpointSource.open(str(d))
    msg = one_line(e)
    assert str(d / "model.safetensors.index.json") in msg and f"'{victim.name}'" in msg and "does not exist" in msg


@pytest.mark.parametrize("evil", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                  "C:\\weights.safetensors", "..\\x.safetensors", ""])
def test_index_path_outside_checkpoint(sharded, tmp_path, evil):
    d = copy(sharded, tmp_path)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = evil
    index_path.write_text(json.dumps(index))
    (tmp_path / "outside.safetensors").write_bytes(b"")
    with pytest.raises(SourceError) as e:
        CheckpointSource.open(str(d))
    msg = one_line(e)
    assert str(index_path) in msg and repr(evil) in msg
    assert ("outside the checkpoint directory" in msg) or ("not a file name" in msg and evil == "")


def test_tensor_in_two_shards(tmp_path):
    d = tmp_path / "dup"
    d.mkdir()
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.zeros(2)}, d / "model-00001-of-00002.safetensors")
    save_file({"b.weight": torch.zeros(3)}, d / "model-00002-of-00002.safetensors")
    with pytest.raises(HeaderError) as e:
        CheckpointSource.open(str(d))  # no index: every *.safetensors file is read
    msg = one_line(e)
    assert "model-00002-of-00002.safetensors" in msg and "'b.weight'" in msg
    assert "also in shard 'model-00001-of-00002.safetensors'" in msg


def test_index_disagrees_with_headers(sharded, tmp_path):
    d = copy(sharded, tmp_path)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    names = sorted(index["weight_map"])
    a, b = names[0], next(n for n in names if index["weight_map"][n] != index["weight_map"][names[0]])
    index["weight_map"][a] = index["weight_map"][b]  # points at a shard that does not hold it
    index_path.write_text(json.dumps(index))
    with pytest.raises(SourceError) as e:
        CheckpointSource.open(str(d))
    assert f"maps tensor '{a}'" in one_line(e) and str(index_path) in str(e.value)


def test_stale_index_is_a_warning(sharded, tmp_path):
    d = copy(sharded, tmp_path)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    dropped = next(n for n in sorted(wm) if sum(f == wm[n] for f in wm.values()) > 1)  # its shard stays listed
    del index["weight_map"][dropped]
    index_path.write_text(json.dumps(index))
    src = CheckpointSource.open(str(d))
    assert dropped in src.tensors
    assert len(src.warnings) == 1 and "missing from weight_map" in src.warnings[0]


@pytest.mark.parametrize("text, needle", [("{not json", "not valid JSON"), ("[]", "not a JSON object"),
                                          ('{"weight_map": []}', "no 'weight_map' object"),
                                          ('{"weight_map": {"a": 3}}', "not a file name")])
def test_bad_index(single, tmp_path, text, needle):
    d = copy(single, tmp_path)
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(SourceError) as e:
        CheckpointSource.open(str(d))
    msg = one_line(e)
    assert msg.startswith(str(d / "model.safetensors.index.json") + ": ") and needle in msg


@pytest.mark.parametrize("text, needle", [('{"model_type": "llama",', "not valid JSON (Expecting"),
                                          ("[1, 2]", "top level is not a JSON object"),
                                          (b"\xff\xfe{}", "not valid UTF-8")])
def test_config_not_json(single, tmp_path, text, needle):
    d = copy(single, tmp_path)
    p = d / "config.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as e:
        CheckpointSource.open(str(d))
    msg = one_line(e)
    assert msg.startswith(f"{p}: ") and needle in msg


def test_config_only_directory(single, tmp_path):
    d = tmp_path / "cfg"
    d.mkdir()
    shutil.copy(single / "config.json", d / "config.json")
    src = CheckpointSource.open(str(d))
    assert src.tensors == {} and src.files == [] and src.config["model_type"] == "llama"


def test_neither_config_nor_weights(tmp_path):
    with pytest.raises(SourceError, match="no config.json and no \\*.safetensors weights$"):
        CheckpointSource.open(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(SourceError, match="found pytorch_model.bin"):
        CheckpointSource.open(str(tmp_path))


def test_hostile_shard_header_names_the_shard(sharded, tmp_path):
    d = copy(sharded, tmp_path)
    victim = sorted(d.glob("model-*.safetensors"))[-1]
    victim.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(HeaderError) as e:
        CheckpointSource.open(str(d))
    msg = one_line(e)
    assert msg.startswith(f"{victim}: ") and "exceeds" in msg


@pytest.mark.parametrize("source, needle", [("./does/not/exist", "no such directory"),
                                            ("/nonexistent-dir", "no such directory"),
                                            ("not a repo id!", "neither a local directory nor a valid Hub repo id")])
def test_bad_source_strings(source, needle):
    with pytest.raises(SourceError) as e:
        CheckpointSource.open(source)
    assert one_line(e) == f"{source}: {needle}"


def test_file_instead_of_directory_and_revision_on_local(single):
    with pytest.raises(SourceError, match="is a file; pass the checkpoint directory"):
        CheckpointSource.open(str(single / "model.safetensors"))
    with pytest.raises(SourceError, match="--revision applies to Hub repo ids"):
        CheckpointSource.open(str(single), revision="main")


def test_cli_source_errors_are_one_line(sharded, single, tmp_path):
    from typer.testing import CliRunner

    from atomtool.cli import app

    d = copy(sharded, tmp_path)
    gone = sorted(d.glob("model-*.safetensors"))[0]
    gone.unlink()
    bad_cfg = tmp_path / "badcfg"
    shutil.copytree(single, bad_cfg)
    (bad_cfg / "config.json").write_text("{,}")
    cases = [
        (d, f"error: {d / 'model.safetensors.index.json'}: names shard '{gone.name}', which does not exist"),
        (bad_cfg, f"error: {bad_cfg / 'config.json'}: not valid JSON"),
        (tmp_path / "nowhere" / "x", "error: "),
    ]
    for path, prefix in cases:
        result = CliRunner().invoke(app, ["inspect", str(path)])
        assert result.exit_code == 1 and result.stdout == ""
        assert result.stderr.startswith(prefix) and result.stderr.count("\n") == 1, result.stderr
