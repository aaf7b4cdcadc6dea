"""``atomtool demo``: end to end through the real CLI (inspect -> convert -> serve -> openai client -> SIGTERM),
and its error paths (each a one-line ``error:`` and exit code 1)."""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.serve import demo


def _zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    text = codecs.decode(this.s, "rot13")
    return text[text.index("Beautiful"):].splitlines()


def _run_cli(args: list[str], tmp_path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp_path), COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "atomtool.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_demo_end_to_end(tmp_path):
    res = _run_cli(["demo"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for stage in ("1. inspect", "2. convert", "3. serve", "4. query", "5. shut down"):
        assert stage in out
    assert "DeepseekV32ForCausalLM" in out and "index_topk 32" in out and "0:full, 1:full" in out
    for line in _zen_lines():  # the reply, printed line by line
        assert line in out
    assert "server stopped cleanly" in out and "demo ok" in out
    assert not list(tmp_path.glob("atomtool-demo-*"))  # the temporary layout and the server log are gone


def test_demo_busy_port_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = CliRunner().invoke(app, ["demo", "--port", str(port)])
    assert res.exit_code == 1
    assert f"error: serve: cannot use port {port} on 127.0.0.1: Address already in use" in res.output


def test_server_that_exits_early_is_a_clear_error(tmp_path):
    """A child server that dies before /health answers (here: no layout there) -> its log tail in the error."""
    server = demo.ServerProcess(tmp_path / "no-such-layout", demo.free_port(), tmp_path / "server.log")
    try:
        with pytest.raises(demo.DemoError, match="serve: the server exited with code 1 before it was ready") as ei:
            server.start(timeout=300)
    finally:
        server.stop()
    assert "no-such-layout" in str(ei.value)  # the server's own error line, from its log


def test_demo_bad_port():
    res = CliRunner().invoke(app, ["demo", "--port", "70000"])
    assert res.exit_code == 1
    assert "error: --port must be in 0..65535, got 70000" in res.output


def test_demo_missing_model_files(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "demo_model_path", lambda: tmp_path)
    res = CliRunner().invoke(app, ["demo"])
    assert res.exit_code == 1
    assert "is incomplete (missing model.safetensors, tokenizer.json, tokenizer_config.json)" in res.output
    assert "scripts/train_demo.py" in res.output


def test_query_stage_without_server_fails_clearly():
    from rich.console import Console

    url = f"http://127.0.0.1:{demo.free_port()}"
    with pytest.raises(demo.DemoError, match=f"query: request to {url} failed"):
        demo.query_stage(url, Console(file=io.StringIO()))


def test_check_reply():
    demo.check_reply(demo.expected_continuation())
    with pytest.raises(demo.DemoError, match=r"^query: .*not the Zen of Python; got: ' ugly.\\nExplicit is worse"):
        demo.check_reply(" ugly.\nExplicit is worse than implicit.")


@pytest.mark.parametrize("text", ['{"principle": "x", "rank": 20}', '{"principle": "x"}', "not json",
                                  '{"principle": "x", "rank": true}', '{"principle": "x", "rank": 3, "y": 1}'])
def test_check_structured_refuses_what_the_schema_does_not_accept(text):
    with pytest.raises(demo.DemoError, match="does not follow the schema"):
        demo.check_structured(text)
    demo.check_structured('{"principle": "Flat is better", "rank": 5}')
