"""``atomtool --help`` / ``--version`` and click usage errors, as a new user sees them at 80 columns."""

from __future__ import annotations

import pytest
import typer
from typer.core import TyperOption
from typer.testing import CliRunner

from atomtool import __version__
from atomtool.cli import app

COMMANDS = ["inspect", "convert", "verify", "generate", "serve", "demo"]


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "80"}, terminal_width=80)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_flag_whole_at_80_columns(command):
    res = _invoke(command, "--help")
    assert res.exit_code == 0, res.output
    cmd = typer.main.get_command(app).commands[command]
    flags = [o for p in cmd.params if isinstance(p, TyperOption) for o in (*p.opts, *p.secondary_opts)]
    assert flags
    for flag in flags:
        assert flag in res.output.split(), flag  # a whole word, never cut
    assert "…" not in res.output and "<bool>" not in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80


def test_serve_long_flags_whole():  # the tester's report: '--served-model-n…'
    out = _invoke("serve", "--help").output
    for flag in ("--served-model-name", "--max-num-batched-tokens", "--gpu-memory-utilization",
                 "--tensor-parallel-size", "--enforce-eager"):
        assert flag in out


def test_top_level_help_lists_commands_untruncated():
    res = _invoke("--help")
    assert res.exit_code == 0
    assert "--version" in res.output
    for command in COMMANDS:
        line = next(x for x in res.output.splitlines() if x.strip().startswith(command + " "))
        assert not line.rstrip().endswith("...")


def test_version():
    assert __version__ == "0.1.0"
    res = _invoke("--version")
    assert res.exit_code == 0 and res.stdout == "atomtool 0.1.0\n"


def test_missing_argument_exit_2_names_the_problem():
    res = _invoke("inspect")
    assert res.exit_code == 2
    assert "Missing argument 'SOURCE'" in res.output and "atomtool inspect --help" in res.output


def test_bad_choice_exit_2_names_the_problem():
    res = _invoke("convert", "a", "b", "--dtype", "int8")
    assert res.exit_code == 2
    assert "--dtype" in res.output and "'int8' is not one of" in res.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_and_argument_has_help(command):
    """A new user reads what each flag means (units, defaults, 0/-1 conventions) in ``--help``."""
    cmd = typer.main.get_command(app).commands[command]
    assert (cmd.help or "").strip(), command
    missing = [p.name for p in cmd.params if not (getattr(p, "help", None) or "").strip()]
    assert not missing, f"{command}: no help text for {missing}"


@pytest.mark.parametrize("command, phrases", [
    ("serve", ["Hub repo id", "0 = any free port", "float32 on CPU", "in bytes", "Most sequences",
               "/v1/models"]),
    ("generate", ["Hub repo id", "0 or -1 = off", "float32 on CPU", "0 = greedy"]),
    ("verify", ["JSON object"]),
])
def test_help_explains_conventions(command, phrases):
    out = " ".join(_invoke(command, "--help").output.split())  # unwrap click's line breaks
    for phrase in phrases:
        assert phrase in out, (command, phrase)
