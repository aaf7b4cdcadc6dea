"""Defects found by a fresh user (round 16, session 15); each test reproduces one.

Oracles:
- README: ``--json`` is the machine-readable output; a script reading stdout must learn why there is no
  result, so a refusal or failure prints ``{"error": {"type", "message", "exit_code"}}`` there (the ``error:``
  line stays on stderr, the exit code is unchanged).
- ``convert``'s own rule (``--overwrite`` replaces only an atomtool layout): an OUT that is not a layout must
  not be answered with "pass --overwrite", which would only be refused next.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from tests.checkpoints import write_hf_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("q") / "q", "qwen3")


def _json_error(r) -> dict:
    (line,) = r.stdout.strip().splitlines()
    return json.loads(line)["error"]


def test_convert_json_refusal_prints_a_json_error_on_stdout(qwen, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = runner.invoke(app, ["convert", str(qwen), str(out), "--json"])
    assert r.exit_code == 1
    err = _json_error(r)
    assert err["type"] == "ConversionError" and err["exit_code"] == 1
    assert err["message"].startswith(f"OUT {out} is not empty and not an atomtool layout")
    assert f"error: {err['message']}" in r.stderr
    assert (out / "notes.txt").read_text() == "keep me"


def test_convert_into_a_non_layout_does_not_suggest_overwrite_first(qwen, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = runner.invoke(app, ["convert", str(qwen), str(out)])
    assert r.exit_code == 1 and "pass --overwrite" not in r.stderr
    assert "--overwrite replaces only an atomtool layout" in r.stderr
    layout = tmp_path / "layout"
    assert runner.invoke(app, ["convert", str(qwen), str(layout)]).exit_code == 0
    r = runner.invoke(app, ["convert", str(qwen), str(layout)])
    assert r.exit_code == 1 and "is not empty (an atomtool layout); pass --overwrite to replace it" in r.stderr


@pytest.mark.parametrize("command,kind,message", [
    (["inspect", "{missing}", "--json"], "SourceError", "{missing}: no such directory"),
    (["verify", "{tmp}", "--json"], "LayoutError", "{tmp}: not an atomtool layout (atomtool.json missing)"),
    (["convert", "{missing}", "{tmp}/new", "--json"], "SourceError", "{missing}: no such directory"),
])
def test_json_commands_print_their_failure_as_json(tmp_path, command, kind, message):
    fill = {"missing": str(tmp_path / "nope"), "tmp": str(tmp_path)}
    r = runner.invoke(app, [c.format(**fill) for c in command])
    assert r.exit_code == 1
    assert _json_error(r) == {"type": kind, "message": message.format(**fill), "exit_code": 1}


def test_without_json_stdout_stays_empty_on_failure(tmp_path):
    r = runner.invoke(app, ["inspect", str(tmp_path / "nope")])
    assert r.exit_code == 1 and r.stdout == "" and r.stderr.startswith("error: ")


def test_progress_in_a_log_ends_at_100_percent(qwen, tmp_path):
    """``convert --progress 2> log``: the log's last bar state is the finished one (it was the first, 0%, then
    erased: the bar was cleared for the summary line as on a terminal)."""
    r = runner.invoke(app, ["convert", str(qwen), str(tmp_path / "layout"), "--progress"])
    assert r.exit_code == 0, r.output
    states = [s for s in r.stderr.replace("\r", "\n").splitlines() if "convert shard" in s]
    assert states and "100%" in states[-1], r.stderr
