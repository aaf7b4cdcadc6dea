"""``atomtool serve --enable-prefix-caching/--no-enable-prefix-caching`` (vLLM's flag pair): listed in the
help and passed through to the engine builder (on by default)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.errors import AtomtoolError

runner = CliRunner()


def test_serve_help_lists_the_flag_pair():
    result = runner.invoke(app, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "--enable-prefix-caching" in result.output
    assert "--no-enable-prefix-caching" in result.output


class _Stop(AtomtoolError):
    """Raised by the fake engine builder once it has recorded its arguments."""


@pytest.mark.parametrize("flags, expected", [([], True), (["--enable-prefix-caching"], True),
                                             (["--no-enable-prefix-caching"], False)])
def test_flag_reaches_the_engine_config(tmp_path, monkeypatch, flags, expected):
    import atomtool.serve.engine.llm_engine as llm_engine

    seen = {}

    def fake_from_model(model, **kwargs):
        seen.update(kwargs)
        raise _Stop("stopped after the engine builder")

    monkeypatch.setattr(llm_engine.LLMEngine, "from_model", fake_from_model)
    result = runner.invoke(app, ["serve", str(tmp_path), "--port", "0", "--device", "cpu", *flags])
    assert result.exit_code == 1, result.output
    assert "stopped after the engine builder" in result.output
    assert seen["enable_prefix_caching"] is expected
