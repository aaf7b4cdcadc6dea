"""An interrupted conversion leaves no OUT that looks valid and never touches SRC.

A real ``atomtool convert`` subprocess writes tiny shards and sleeps after each one (the writer's
``ATOMTOOL_CONVERT_TEST_SLEEP_PER_SHARD`` hook), and is killed once a few shards are on disk.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.convert.layout import is_layout
from atomtool.convert.writer import SLEEP_ENV
from tests.checkpoints import write_hf_checkpoint


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("interrupt") / "src", "qwen3")


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT's default action, as in a terminal (a test run started in the background
    or under nohup passes SIGINT ignored to its children, and Python would then ignore Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill"])
def test_killed_mid_write_leaves_no_layout(src, tmp_path, sig):
    before = tree_digest(src)
    mtimes = {p: p.stat().st_mtime_ns for p in src.iterdir()}
    out = tmp_path / "out"
    env = {**os.environ, SLEEP_ENV: "0.5"}
    proc = subprocess.Popen([sys.executable, "-m", "atomtool.cli", "convert", str(src), str(out),
                             "--shard-size", "16KB"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    deadline = time.monotonic() + 120
    tmp = None
    while time.monotonic() < deadline and proc.poll() is None:
        tmps = list(tmp_path.glob(".out.tmp-*"))
        if tmps and len(list(tmps[0].glob("model-*.safetensors"))) >= 2:
            tmp = tmps[0]
            break
        time.sleep(0.05)
    assert tmp is not None, f"conversion never got mid-write: {proc.communicate()}"
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert not out.exists() and not is_layout(out)
    assert tree_digest(src) == before
    assert {p: p.stat().st_mtime_ns for p in src.iterdir()} == mtimes
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        # only a hidden temporary directory may remain, and it has no manifest
        assert [p.name for p in tmp_path.iterdir()] == [tmp.name]
        assert not (tmp / "atomtool.json").exists()
    else:
        assert proc.returncode == 130, stderr
        assert "error: interrupted" in stderr
        assert list(tmp_path.iterdir()) == []  # temporary directory cleaned up
    # a new conversion next to the leftovers succeeds
    rerun = CliRunner().invoke(app, ["convert", str(src), str(out)])
    assert rerun.exit_code == 0, rerun.output
    assert is_layout(out)
    if sig == signal.SIGKILL:  # the killed conversion's leftovers are named and removed by the next run
        assert f"warning: removed the stale temporary directory {tmp.name}" in rerun.stderr, rerun.stderr
        assert "reclaimed" in rerun.stderr and not tmp.exists()


def test_sigterm_becomes_keyboard_interrupt_during_convert():
    """SIGTERM takes the Ctrl-C path (temporary directory removed) while a conversion runs, and the previous
    handler is restored afterwards."""
    from atomtool.errors import sigterm_as_interrupt

    old = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is old
