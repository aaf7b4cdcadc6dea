"""``atomtool serve`` as users run it: flag errors through the CLI (exit 1, one-line message), and a real
subprocess that drains an in-flight streaming request on SIGTERM and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.errors import ConfigError
from atomtool.serve.api.chat import load_chat_template
from tests.checkpoints import write_hf_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str):
    result = runner.invoke(app, ["serve", *args])
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes is not None else "")


# ----------------------------------------------------------------------------------------- flag errors
@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "2"], "error: --tensor-parallel-size 2 is not supported yet"),
    (["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["--max-num-seqs", "0"], "error: --max-num-seqs must be >= 1, got 0"),
    (["--port", "70000"], "error: --port must be in [0, 65535], got 70000"),
    (["--chat-template", "no/such/template.jinja"], "looks like a file path, but no such file exists"),
    (["--kv-cache-memory", "-5"], "error: --kv-cache-memory must be a positive number of bytes, got -5"),
    (["--kv-cache-memory", "0"], "error: --kv-cache-memory must be a positive number of bytes, got 0"),
    (["--served-model-name", ""], "error: --served-model-name must not be empty"),
    (["--served-model-name", "  "], "error: --served-model-name must not be empty"),
])
def test_bad_flags_fail_before_loading(ckpt, flags, message, monkeypatch):
    import atomtool.serve.engine.llm_engine as llm_engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "from_model", no_load)
    code, out = run_cli(ckpt, *flags)
    assert code == 1
    assert message in out
    assert len(set(out.strip().splitlines())) == 1, out  # one line (run_cli may hold it twice), no traceback


def test_busy_port_is_a_clear_error(ckpt):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = run_cli(ckpt, "--port", str(port))
    assert code == 1
    assert f"error: cannot listen on 127.0.0.1:{port}" in out


def test_missing_model_dir_is_a_clear_error(tmp_path):
    code, out = run_cli(str(tmp_path / "nope"), "--port", "0", "--device", "cpu")
    assert code == 1
    assert "error:" in out and "nope" in out
    assert "Traceback" not in out


def test_load_chat_template_file_string_and_bad_path(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}!")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}!"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    assert load_chat_template(None) is None
    with pytest.raises(ConfigError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


# ----------------------------------------------------------------------------------------- SIGTERM drain
def wait_healthy(url: str, proc: subprocess.Popen, log_path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited early ({proc.returncode}):\n{open(log_path).read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"server did not become healthy:\n{open(log_path).read()}")


def test_sigterm_finishes_in_flight_stream_then_exits_0(tmp_path):
    """``atomtool serve`` with no MODEL serves the built-in demo model; ATOMTOOL_API_KEY turns auth on;
    SIGTERM during a streaming request lets it finish, refuses new connections, and exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "atomtool.cli", "serve", "--port", str(port), "--device", "cpu"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ATOMTOOL_API_KEY": "k3y"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    auth = {"Authorization": "Bearer k3y"}
    try:
        wait_healthy(url, proc, log_path)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert [m["id"] for m in httpx.get(url + "/v1/models", headers=auth).json()["data"]] == ["atomtool-demo"]
        arrivals: list[tuple[float, str]] = []
        first = threading.Event()

        def reader() -> None:
            body = {"model": "atomtool-demo", "prompt": "Beautiful is better than", "max_tokens": 150, "n": 2, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append((time.monotonic(), line[6:]))
                        first.set()

        t = threading.Thread(target=reader)
        t.start()
        assert first.wait(60), open(log_path).read()
        proc.send_signal(signal.SIGTERM)
        # the listening socket closes: new connections are refused while the stream goes on
        deadline = time.monotonic() + 30
        refused_at = None
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/health", timeout=1)
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                # refused, or accepted by the kernel backlog in the instant before the listener closed and
                # dropped unanswered: either way no new request is served
                refused_at = time.monotonic()
                break
            time.sleep(0.02)
        assert refused_at is not None, "server kept accepting connections after SIGTERM"
        t.join(120)
        assert proc.wait(60) == 0, open(log_path).read()
    finally:
        if proc.poll() is None:
            proc.kill()
    payloads = [p for _, p in arrivals]
    assert payloads[-1] == "[DONE]"
    usage = json.loads(payloads[-2])["usage"]
    assert usage["completion_tokens"] == 2 * 150  # every choice ran to max_tokens
    finishes = [c["finish_reason"] for p in payloads[:-2] for c in json.loads(p)["choices"] if c["finish_reason"]]
    assert finishes == ["length"] * 2
    assert arrivals[-1][0] > refused_at  # tokens kept streaming after the server stopped accepting
    log = open(log_path).read()
    assert "shut down cleanly" in log
    assert "Traceback" not in log
