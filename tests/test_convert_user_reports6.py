"""User reports 6 (convert/verify break-it pass): reproducers for defects, fixed since.

- ``convert SRC OUT --overwrite`` where a SRC shard is a symlink into the old layout at OUT: the atomic
  swap deletes the old OUT, and with it the source's only weights (SRC is left with a dangling
  symlink). README: "the source is never modified"; the OUT-inside-SRC check resolves the directories
  only, not the files SRC's symlinks point at.
- ``verify`` passes ("OK") a layout whose shard has trailing bytes after its data section, or a hole
  between two tensors (every tensor's bytes still hash right), while ``generate``/``serve`` refuse the
  same layout ("data section has N trailing bytes that belong to no tensor" / "hole in the data
  section"): verify accepts a layout the loader rejects.
"""

from __future__ import annotations

import json
import shutil
import struct

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


def _append_junk(shard):
    with open(shard, "ab") as f:
        f.write(b"TRAILINGJUNK")


def _insert_hole(shard):
    """Shift the last tensor of the data section 8 bytes up, leaving 8 bytes that belong to no tensor."""
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start + 8, end + 8]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data[:start] + bytes(8) + data[start:])


@pytest.mark.parametrize("tamper, word", [(_append_junk, "trailing"), (_insert_hole, "hole")])
def test_verify_reports_bytes_that_belong_to_no_tensor(layout, tmp_path, tamper, word):
    tampered = tmp_path / "tampered"
    shutil.copytree(layout, tampered)
    shard = next(tampered.glob("model-*.safetensors"))
    tamper(shard)
    code, out = cli("verify", tampered)
    assert code == 1, out
    assert word in out and shard.name in out


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_a_source_that_shrinks_mid_copy_is_named(tmp_path, kernel_copy):
    """A source shard truncated while convert copies from it: the error names the file (was: 'copy_file_range
    copied nothing at source offset N'), for the in-kernel copy and the read/write fallback alike."""
    import os

    from atomtool.convert.writer import _AsyncWriter

    src = tmp_path / "model-00001.safetensors"
    src.write_bytes(b"x" * 10)
    w = _AsyncWriter()
    w._kernel_copy = kernel_copy and hasattr(os, "copy_file_range")
    fd = os.open(src, os.O_RDONLY)
    try:
        with open(tmp_path / "out.bin", "wb") as f, pytest.raises(OSError) as exc:
            w._copy(f, fd, 4, 100)
    finally:
        os.close(fd)
        w.close()
    assert str(src) in str(exc.value) and "ends before offset 104" in str(exc.value)
