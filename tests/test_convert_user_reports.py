"""Defects a new user hit in convert / verify, each fed its bad input: the message and the exit code.

1. Ctrl-C landing inside the writer's queue hand-off must not hang the cleanup.
2. verify --source of a checkpoint that is not the converted one: problem lines, not a traceback.
3. verify of a truncated shard and of a layout with an extra, unreferenced shard.
4. Tokenizer remote-code side files (tokenization_*.py, tiktoken.model, *.tiktoken) are copied; modeling
   code is not.
5. Sizes and rates in human units (no "0.00 GB").
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import threading
import time

import pytest
import torch
from typer.testing import CliRunner

import atomtool.convert.writer as writer
from atomtool.cli import app
from atomtool.convert.layout import is_layout
from atomtool.convert.plan import build_plan
from atomtool.inspect.classify import inspect_checkpoint
from tests.checkpoints import write_fp8_block_checkpoint, write_hf_checkpoint
from tests.fake_hub import record_snapshot_downloads

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


# ------------------------------------------------------------------ 2. verify against another source


@pytest.fixture(scope="module")
def fp8_layout(llama, tmp_path_factory):
    """(FP8 layout, its FP8 source, the BF16 original that was NOT converted)."""
    root = tmp_path_factory.mktemp("fp8")
    fp8 = write_fp8_block_checkpoint(llama, root / "fp8", block=16)
    bf16 = write_hf_checkpoint(root / "bf16", "llama", dtype=torch.bfloat16)
    out = root / "layout"
    assert run("convert", fp8, out).exit_code == 0
    return out, fp8, bf16


def test_verify_against_a_source_that_was_not_converted(fp8_layout):
    out, fp8, bf16 = fp8_layout
    assert run("verify", out, "--source", fp8).exit_code == 0
    r = run("verify", out, "--source", bf16)
    assert r.exit_code == 1 and not isinstance(r.exception, Exception), r.output  # SystemExit(1), no crash
    assert "Traceback" not in r.output and "NotImplementedError" not in r.output
    # obviously another checkpoint (the BF16 original: other dtypes, no scales): one error, no listing
    assert "problem:" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {bf16} is not the source of {out}: only ")
    assert re.search(r"e\.g\. model\.layers\.\d+\.\S+ is BF16 \[(\d+, \d+)\] there, F8_E4M3 \[\1\] in the "
                     r"manifest\); converted from ", r.stderr), r.stderr
    assert "lacks e.g. model.layers.0.mlp.down_proj.weight_scale_inv" in r.stderr


def test_verify_without_recorded_source_dtypes_still_reports_not_crashes(fp8_layout, tmp_path):
    """A manifest without source_dtype/source_shape (hand-edited or older) falls through to the value
    comparison; casting the BF16 source to FP8 must give a problem line, not NotImplementedError."""
    out, _, bf16 = fp8_layout
    copy = tmp_path / "layout"
    shutil.copytree(out, copy)
    manifest = json.loads((copy / "atomtool.json").read_text())
    for entry in manifest["tensors"].values():
        for part in entry["parts"]:
            part.pop("source_dtype", None)
            part.pop("source_shape", None)
    (copy / "atomtool.json").write_text(json.dumps(manifest))
    r = run("verify", copy, "--source", bf16)
    assert r.exit_code == 1 and not isinstance(r.exception, Exception), r.output
    assert r.stderr.splitlines()[-1].startswith("problem: ... and ")  # listing capped; --json has them all
    r = run("verify", copy, "--source", bf16, "--json")
    assert r.exit_code == 1 and not isinstance(r.exception, Exception), r.output
    assert ("model.layers.1.self_attn.qkv_proj.weight: part model.layers.1.self_attn.v_proj.weight does "
            "not reproduce the source (as F8_E4M3)") in json.loads(r.stdout)["problems"]


def test_checked_cast_to_fp8_checks_overflow():
    from atomtool.convert.cast import checked_cast
    from atomtool.errors import ConversionError

    ok = checked_cast(torch.tensor([1.0, -2.0], dtype=torch.bfloat16), torch.float8_e4m3fn, name="w")
    assert ok.dtype == torch.float8_e4m3fn and ok.float().tolist() == [1.0, -2.0]
    with pytest.raises(ConversionError, match=r"w: casting BF16 -> F8_E4M3 overflows \(\|value\| up to 1000"):
        checked_cast(torch.tensor([1.0, 1000.0], dtype=torch.bfloat16), torch.float8_e4m3fn, name="w")


# ------------------------------------------------------------ 3. truncated shard, unreferenced shard


@pytest.fixture()
def layout(llama, tmp_path):
    out = tmp_path / "layout"
    assert run("convert", llama, out, "--shard-size", "60KB").exit_code == 0
    return out


def test_verify_truncated_shard_is_one_problem(llama, layout):
    shard = sorted(layout.glob("model-*.safetensors"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 1000)
    for args in ([], ["--source", llama]):
        r = run("verify", layout, *args)
        assert r.exit_code == 1, r.output
        problems = [ln for ln in r.stderr.splitlines() if ln.startswith("problem:")]
        assert problems == [f"problem: shard {shard.name} is truncated: {size - 1000} bytes, "
                            f"header declares {size}"], r.stderr
        assert "sha256" not in r.stderr and "unreadable" not in r.stderr
        assert r.stdout.startswith("FAILED (1 problem): ")


def test_verify_reports_an_unreferenced_safetensors_file(layout):
    shard = sorted(layout.glob("model-*.safetensors"))[0]
    shutil.copy(shard, layout / "model-extra.safetensors")
    r = run("verify", layout)
    assert r.exit_code == 1
    assert r.stderr.splitlines() == [
        "problem: model-extra.safetensors: a safetensors file the index does not reference (not part of this "
        "layout; loaders that read every *.safetensors would pick it up)"]


# ------------------------------------------------------------------ 4. tokenizer remote-code side files

KIMI_TOKENIZER_CODE = """from typing import Any

from .tool_declaration_ts import encode_tools_to_typescript_style
from transformers import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
"""


def test_tokenizer_and_model_remote_code_files_are_copied(llama, tmp_path):
    """Every non-weight file travels with the layout (config.json's auto_map keeps working with
    trust_remote_code); copied code is never executed by convert (modeling_kimi.py exits if imported)."""
    src = tmp_path / "kimi"
    shutil.copytree(llama, src)
    files = {
        "tiktoken.model": b"IQ== 0\nIg== 1\n",
        "extra.tiktoken": b"Iw== 2\n",
        "tokenization_kimi.py": KIMI_TOKENIZER_CODE.encode(),
        "tool_declaration_ts.py": b"def encode_tools_to_typescript_style(tools):\n    return ''\n",
    }
    for name, data in files.items():
        (src / name).write_bytes(data)
    (src / "modeling_kimi.py").write_text("raise SystemExit('convert must not import remote model code')\n")
    (src / "configuration_kimi.py").write_text("x = 1\n")
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.output
    for name, data in files.items():
        assert (out / name).read_bytes() == data, name
    for name in ("modeling_kimi.py", "configuration_kimi.py"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert run("verify", out, "--source", src).exit_code == 0


def test_hub_download_includes_code_and_excludes_pickle_weights(llama, tmp_path, monkeypatch):
    from fnmatch import fnmatch

    calls = record_snapshot_downloads(monkeypatch, llama)
    assert run("convert", "moonshotai/Kimi-K2-Instruct", tmp_path / "out").exit_code == 0
    allow, ignore = calls[0]["allow_patterns"], calls[0]["ignore_patterns"]

    def fetched(name):
        return any(fnmatch(name, p) for p in allow) and not any(fnmatch(name, p) for p in ignore or [])

    for name in ("tiktoken.model", "tokenization_kimi.py", "tool_declaration_ts.py", "a.tiktoken",
                 "model-00001-of-00002.safetensors", "tokenizer_config.json"):
        assert fetched(name), name
    assert fetched("modeling_deepseek.py") and not fetched("pytorch_model.bin")


# ------------------------------------------------------------------------------- 5. human-readable sizes


def test_human_bytes():
    assert [writer.human_bytes(n) for n in (10, 1536, 3 * 2**20, 3 * 2**30 + 2**29)] == \
        ["10 B", "1.50 KiB", "3.00 MiB", "3.50 GiB"]


def test_disk_space_refusal_of_a_small_model_says_kib_not_zero_gb(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 10, 10))
    r = run("convert", llama, tmp_path / "out")
    assert r.exit_code == 1
    assert re.fullmatch(rf"error: not enough free disk space for {re.escape(str(tmp_path / 'out'))}: needs "
                        rf"\d+\.\d\d KiB, 10 B free on {re.escape(str(tmp_path))}\n", r.stderr), r.stderr
    assert not (tmp_path / "out").exists()


def test_convert_summary_rate_is_not_zero_gb_per_s(llama, tmp_path):
    r = run("convert", llama, tmp_path / "out")
    assert r.exit_code == 0, r.output
    m = re.search(r"shard\(s\), (\d+\.\d\d) KiB in \d+\.\d\ds \((\d+(?:\.\d\d)?) (B|KiB|MiB|GiB)/s\)\n$", r.stdout)
    assert m, r.stdout
    assert float(m.group(2)) > 0 and "GB/s" not in r.stdout
    size = sum(p.stat().st_size for p in llama.glob("*.safetensors"))  # F32 copies: about the source data
    assert abs(float(m.group(1)) * 1024 - size) < 0.01 * size
