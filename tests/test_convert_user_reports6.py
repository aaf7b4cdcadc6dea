"""User reports 6 (convert/verify break-it pass): reproducers for defects, xfail until fixed.

- ``convert SRC OUT --overwrite`` where a SRC shard is a symlink into the old layout at OUT: the atomic
  swap deletes the old OUT, and with it the source's only weights (SRC is left with a dangling
  symlink). README: "the source is never modified"; the OUT-inside-SRC check resolves the directories
  only, not the files SRC's symlinks point at.
- ``verify`` passes ("OK") a layout whose shard has trailing bytes after its data section, while
  ``generate``/``serve`` refuse the same layout ("data section has N trailing bytes that belong to no
  tensor"): verify accepts a layout the loader rejects.
"""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from tests.checkpoints import write_hf_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("reports6") / "llama", "llama")


def cli(*args: object):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.mark.xfail(strict=True, reason="convert --overwrite deletes source weights that symlink into OUT")
def test_overwrite_never_deletes_a_source_shard_that_lives_in_out(llama, tmp_path):
    old = tmp_path / "layout"
    code, out = cli("convert", llama, old)
    assert code == 0, out
    # the user keeps the raw weights next to the old layout and points a source directory at them
    shutil.copy(llama / "model.safetensors", old / "raw.safetensors")
    src = tmp_path / "src"
    src.mkdir()
    for f in llama.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, src / f.name)
    (src / "model.safetensors").symlink_to(old / "raw.safetensors")
    weights = (old / "raw.safetensors").read_bytes()

    code, out = cli("convert", src, old, "--overwrite")

    # expected: refused up front (a source file resolves inside OUT), the source left readable
    assert (src / "model.safetensors").exists(), "the source's weights were deleted by --overwrite"
    assert (src / "model.safetensors").read_bytes() == weights
    assert code == 1 and "error:" in out


@pytest.fixture(scope="module")
def layout(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("reports6_layout") / "layout"
    code, text = cli("convert", llama, out)
    assert code == 0, text
    return out


@pytest.mark.xfail(strict=True, reason="verify says OK for a shard with trailing bytes that the loader refuses")
def test_verify_reports_trailing_bytes_in_a_layout_shard(layout, tmp_path):
    tampered = tmp_path / "tampered"
    shutil.copytree(layout, tampered)
    shard = next(tampered.glob("model-*.safetensors"))
    with open(shard, "ab") as f:
        f.write(b"TRAILINGJUNK")
    code, out = cli("verify", tampered)
    assert code == 1, out
    assert "trailing" in out and shard.name in out
