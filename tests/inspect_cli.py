"""Helpers for tests that run ``atomtool inspect`` in-process on config-only directories."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from atomtool.cli import app


def run_inspect(*args: str):
    """``atomtool inspect ARGS`` through typer's CliRunner, on a 240-column terminal (no table wrapping)."""
    return CliRunner().invoke(app, ["inspect", *args], env={"COLUMNS": "240"})


def inspect_json(path: Path, *args: str) -> tuple[dict, int]:
    """(the ``--json`` report, exit code) of ``atomtool inspect PATH --json ARGS``."""
    res = run_inspect(str(path), "--json", *args)
    return json.loads(res.stdout), res.exit_code


def config_only(tmp_path: Path, cfg: dict, name: str = "m") -> Path:
    """A directory ``tmp_path / name`` holding only ``config.json`` = ``cfg``."""
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d
