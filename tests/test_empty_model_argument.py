"""An empty MODEL argument (an unset ``"$MODEL"``) to ``generate`` / ``serve`` / ``LLM`` is refused by name.

``Path("")`` is the current directory, so it used to be read as a checkpoint there ("config.json: no
config.json ..."); inspect / convert / verify refuse empty path arguments the same way.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.errors import SourceError

EXPECTED = "MODEL is an empty string; pass an atomtool layout, a checkpoint directory or a Hub repo id"


@pytest.mark.parametrize("cmd", [["generate", "", "--prompt", "hi", "--device", "cpu"],
                                 ["serve", "", "--port", "0", "--device", "cpu"]])
def test_empty_model_argument_is_refused(cmd, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")  # a checkpoint-looking cwd must not be read either
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, cmd)
    assert res.exit_code == 1, res.output
    assert res.stderr == f"error: {EXPECTED}\n"  # before loading anything or binding the port
    assert "Traceback" not in res.output


def test_llm_api_refuses_an_empty_model():
    from atomtool.serve.llm import LLM

    with pytest.raises(SourceError, match=f"^{EXPECTED}$"):
        LLM("", device="cpu")
