"""Defects a new user hit in convert / verify, each fed its bad input: the message and the exit code.

1. Ctrl-C landing inside the writer's queue hand-off must not hang the cleanup.
2. verify --source of a checkpoint that is not the converted one: problem lines, not a traceback.
3. verify of a truncated shard and of a layout with an extra, unreferenced shard.
4. Tokenizer remote-code side files (tokenization_*.py, tiktoken.model, *.tiktoken) are copied; modeling
   code is not.
5. Sizes and rates in human units (no "0.00 GB").
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
from typer.testing import CliRunner

import atomtool.convert.writer as writer
from atomtool.cli import app
from atomtool.convert.layout import is_layout
from atomtool.convert.plan import build_plan
from atomtool.inspect.classify import inspect_checkpoint
from tests.checkpoints import write_hf_checkpoint

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("user") / "llama", "llama")


# ------------------------------------------------------------------------------------ 1. Ctrl-C race


class _InterruptedQueue(queue.SimpleQueue):
    """Replays the reported race: the KeyboardInterrupt lands inside ``put`` after the item is queued (in
    ``queue.Queue`` that is inside ``Condition.notify``), and the wake-up meant for the stop sentinel is
    lost, so the writer thread never receives ``None``."""

    interrupt_at = 3

    def __init__(self):
        super().__init__()
        self.puts = 0

    def put(self, item, block=True, timeout=None):
        if item is None:
            return  # the lost wake-up: the sentinel never reaches the writer thread
        super().put(item, block, timeout)
        self.puts += 1
        if self.puts == self.interrupt_at:
            raise KeyboardInterrupt


def test_ctrl_c_inside_queue_put_does_not_hang(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(writer._AsyncWriter, "_queue_type", _InterruptedQueue)
    monkeypatch.setattr(writer._AsyncWriter, "CLOSE_TIMEOUT_S", 2.0)
    plan = build_plan(inspect_checkpoint(str(llama)))
    out = tmp_path / "out"
    raised: list[BaseException] = []

    def convert():
        try:
            writer.write_layout(plan, llama, out, shard_size=20_000, progress=False)
        except BaseException as exc:  # noqa: BLE001 -- the test inspects it
            raised.append(exc)

    t = threading.Thread(target=convert, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(20)
    assert not t.is_alive(), "write_layout hung in cleanup after the interrupt"
    assert time.monotonic() - start < 15
    assert len(raised) == 1 and isinstance(raised[0], KeyboardInterrupt)
    assert not out.exists() and not is_layout(out)
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone too


def test_writer_close_is_bounded_even_if_the_thread_never_sees_the_sentinel(tmp_path, monkeypatch):
    """close(abandon=True) returns although the stop sentinel is lost; the thread stops on the event."""
    monkeypatch.setattr(writer._AsyncWriter, "_queue_type", _InterruptedQueue)
    w = writer._AsyncWriter()
    with open(tmp_path / "f", "wb", buffering=0) as f:
        w.write(f, memoryview(b"abc"))
        w.sync()
        start = time.monotonic()
        w.close(abandon=True)
    assert time.monotonic() - start < 5
    assert not w._thread.is_alive()
    assert (tmp_path / "f").read_bytes() == b"abc"
