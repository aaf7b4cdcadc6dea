"""Defects found by a tester: races on OUT, a late Ctrl-C, an unwritable OUT.

- Two conversions into the same OUT: exactly one wins; the other gets a one-line error, exit 1, its
  temporary directory removed, and the winner's layout untouched (no silent replace without --overwrite).
- ``--overwrite`` replaces the old layout only with the new one in place (atomic exchange, or a fallback
  that restores the old one on failure).
- A SIGINT/SIGTERM landing after the final rename does not fail a complete conversion (exit 0).
- An OUT whose parent cannot be written says ``cannot write to DIR: reason``, not "0 B free".
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.convert import writer
from atomtool.convert.layout import is_layout, read_manifest
from atomtool.convert.writer import SLEEP_ENV
from tests.checkpoints import write_hf_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("races") / "src", "qwen3")


def run(*args: str):
    result = CliRunner().invoke(app, ["convert", *map(str, args)])
    return result.exit_code, result.output  # click mixes stderr into output


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def dtype_policy(out: Path) -> str:
    return read_manifest(out)["dtype_policy"]


# ------------------------------------------------------------------------------------------ 1. races
def test_out_created_during_conversion_is_not_replaced(src, tmp_path, monkeypatch):
    """A second conversion completes OUT after our up-front check and before our rename: we lose."""
    out = tmp_path / "race"
    real = writer._write_shards
    winner: dict[str, dict[str, str]] = {}

    def write_then_lose_the_race(plan, src_, tmp, shards, progress):
        done = real(plan, src_, tmp, shards, progress)
        if not winner:  # the other process: a float32 conversion into the same OUT, finishing first
            winner["x"] = {}
            code, output = run(src, out, "--dtype", "float32")
            assert code == 0, output
            winner.update(tree_digest(out))
        return done

    monkeypatch.setattr(writer, "_write_shards", write_then_lose_the_race)
    code, output = run(src, out)
    assert code == 1, output
    assert output.strip() == (f"error: OUT {out} was created by another process while converting (another "
                              "convert into the same OUT?); it was left as is and nothing was written; "
                              "pass --overwrite to replace it")
    del winner["x"]
    assert tree_digest(out) == winner and dtype_policy(out) == "float32"  # the winner's layout intact
    assert [p.name for p in tmp_path.iterdir()] == ["race"]  # the loser's temporary directory is gone


def test_two_concurrent_converts_one_wins(src, tmp_path):
    """The tester's reproduction with real processes: exactly one exit 0, the other exit 1 (refused up
    front or at the rename, depending on timing), and OUT is the winner's complete layout."""
    out = tmp_path / "race"
    env = {**os.environ, SLEEP_ENV: "0.2"}
    cmds = [[sys.executable, "-m", "atomtool.cli", "convert", str(src), str(out), "--shard-size", "16KB", *extra]
            for extra in ([], ["--dtype", "float32"])]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 1], results
    (win,) = [i for i, r in enumerate(results) if r[0] == 0]
    lose = results[1 - win]
    assert "wrote" in results[win][1] and "wrote" not in lose[1]
    # the loser may first have seen the winner's temporary directory: named as live, left alone
    err = [ln for ln in lose[2].splitlines() if not (ln.startswith("warning: .race.tmp-")
                                                      and ln.endswith("may still be running; left alone "
                                                                      "(remove it yourself if none is)"))]
    assert len(err) == 1 and err[0].startswith(f"error: OUT {out} "), lose
    assert "pass --overwrite" in err[0]
    assert "removed" not in lose[2] + results[win][2]  # a live conversion's directory is never removed
    assert dtype_policy(out) == ("auto" if win == 0 else "float32")
    verify = CliRunner().invoke(app, ["verify", str(out)])
    assert verify.exit_code == 0 and "OK:" in verify.output, verify.output
    assert [p.name for p in tmp_path.iterdir()] == ["race"]


def test_overwrite_swaps_atomically_and_leaves_nothing_behind(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert run(src, out)[0] == 0
    calls = []
    real = writer._renameat2
    monkeypatch.setattr(writer, "_renameat2", lambda a, b, f: calls.append(f) or real(a, b, f))
    code, output = run(src, out, "--dtype", "float32", "--overwrite")
    assert code == 0, output
    assert calls == [writer.RENAME_EXCHANGE]
    assert dtype_policy(out) == "float32" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_overwrite_fallback_restores_the_old_layout_when_the_new_one_cannot_move_in(src, tmp_path,
                                                                                     monkeypatch):
    out = tmp_path / "out"
    assert run(src, out)[0] == 0
    before = tree_digest(out)
    monkeypatch.setattr(writer, "_renameat2", lambda a, b, f: False)  # no renameat2: rename aside + in
    real = os.rename

    def fail_moving_in(a, b):
        if Path(a).name.startswith(".out.tmp-"):
            raise OSError(errno.EIO, "Input/output error", str(b))
        real(a, b)

    monkeypatch.setattr(writer.os, "rename", fail_moving_in)
    code, output = run(src, out, "--dtype", "float32", "--overwrite")
    assert code == 1 and output.startswith(f"error: writing {out} failed: Input/output error"), output
    assert tree_digest(out) == before  # the old layout is back, whole
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_overwrite_refuses_an_out_that_became_a_non_layout(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = writer._write_shards

    def someone_writes_out(*a):
        done = real(*a)
        out.mkdir()
        (out / "precious.txt").write_text("keep me")
        return done

    monkeypatch.setattr(writer, "_write_shards", someone_writes_out)
    code, output = run(src, out, "--overwrite")
    assert code == 1 and f"refusing to --overwrite {out}: it is not an atomtool layout" in output, output
    assert [p.name for p in out.iterdir()] == ["precious.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ------------------------------------------------------------------------------------ 2. late Ctrl-C
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_interrupt_right_after_the_rename_still_succeeds(src, tmp_path, monkeypatch, sig, overwrite):
    out = tmp_path / "out"
    handler_before = signal.getsignal(signal.SIGINT)  # not always Python's default (e.g. under nohup: ignored)
    if overwrite:
        assert run(src, out)[0] == 0
    real = writer._commit

    def commit_then_interrupt(*a, **k):
        real(*a, **k)
        os.kill(os.getpid(), sig)  # delivered at the next bytecode: between the rename and the summary

    monkeypatch.setattr(writer, "_commit", commit_then_interrupt)
    code, output = run(src, out, "--dtype", "float32", *(["--overwrite"] if overwrite else []))
    assert code == 0, output
    assert f"wrote {out}" in output
    assert "note: interrupted after the conversion had completed; the layout is complete" in output
    assert dtype_policy(out) == "float32" and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert signal.getsignal(signal.SIGINT) is handler_before  # handlers restored


def test_interrupt_during_the_summary_still_succeeds(src, tmp_path, monkeypatch):
    import atomtool.convert.commands as commands

    out = tmp_path / "out"
    real = commands.human_bytes

    def interrupt_while_printing(n):
        os.kill(os.getpid(), signal.SIGINT)
        return real(n)

    monkeypatch.setattr(commands, "human_bytes", interrupt_while_printing)
    code, output = run(src, out)
    assert code == 0 and f"wrote {out}" in output, output
    assert is_layout(out)


# ------------------------------------------------------------------------------- 4. unwritable OUT
def test_unwritable_out_says_cannot_write(src):
    code, output = run(src, "/proc/x")
    assert code == 1, output
    assert output.startswith("error: cannot write to /proc: "), output
    assert "disk space" not in output and output.count("\n") == 1


def test_out_under_a_file_says_cannot_write(src, tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    code, output = run(src, f / "a" / "out")
    assert code == 1
    assert output.strip() == f"error: cannot write to {f}: Not a directory"
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]


def test_disk_space_refusal_removes_the_directories_it_created(src, tmp_path, monkeypatch):
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 10, 10))
    code, output = run(src, tmp_path / "a" / "b" / "out")
    assert code == 1 and "not enough free disk space" in output, output
    assert list(tmp_path.iterdir()) == []
