"""Defects a fresh-user tester found in ``atomtool serve`` / ``atomtool generate``, each fed its bad input:

- a request whose chat template loops (nested ``range(99999)``; accepted with --trust-request-chat-template)
  is a 400 and never freezes the server;
  template rendering and tokenization run off the event loop (``/health`` answers meanwhile);
- request bodies above the limit are a 413;
- lone surrogates in text are a 400 naming the field (not a TypeError 500), every status incl. 500 is
  counted in ``atomtool:http_requests_total``, and an internal error logs no ASGI traceback;
  ``atomtool generate --prompt $'\\xff'`` is a one-line error, exit 1;
- ``--api-key ''`` and ``ATOMTOOL_API_KEY=''`` are both refused at startup;
- a forced shutdown (second Ctrl-C) says so and exits 130 without a traceback;
- strict types (bool/str are not integers), ``null`` means the default, ``GET /v1/models/{id}``.

Most use the scripted engine (tests/test_server_support.py) with a real tokenizer; the CLI ones run the
real command (CliRunner or a subprocess on the built-in demo model).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from atomtool.cli import app as cli_app
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from tests.checkpoints import make_tokenizer
from tests.test_server_cli import free_port, wait_healthy
from tests.test_server_support import ScriptedEngine

DEMO = os.path.join(os.path.dirname(__file__), "..", "atomtool", "demo_model")
LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"
USER = [{"role": "user", "content": "hi"}]


class SlowTokenizer:
    """The tokenizer, but ``encode`` / ``apply_chat_template`` sleep ``delay`` s when the text holds "slow"
    (stands in for a huge prompt or an expensive template, at a known cost)."""

    def __init__(self, tok, delay: float) -> None:
        self._tok, self.delay = tok, delay

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, *a, **k):
        if isinstance(text, str) and "slow" in text:
            time.sleep(self.delay)
        return self._tok.encode(text, *a, **k)

    def apply_chat_template(self, convo, *a, **k):
        if any("slow" in m["content"] for m in convo):
            time.sleep(self.delay)
        return self._tok.apply_chat_template(convo, *a, **k)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def served(tok):
    engine = ScriptedEngine(SlowTokenizer(tok, 3.0), tok.encode("ok", add_special_tokens=False))
    # request templates trusted: the render bounds under test apply to those (off, they are refused unrendered)
    with ServerThread(create_app(engine, "m", max_body_bytes=4096, trust_request_chat_template=True)) as url:
        yield url, engine


def http_count(url: str, endpoint: str, status: int) -> float:
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == "atomtool:http_requests_total" and s.labels == {"endpoint": endpoint,
                                                                         "status": str(status)}:
                return s.value
    return 0.0


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ------------------------------------------------------------------------------- 1. event loop, templates
def test_looping_chat_template_is_a_400_and_server_stays_responsive(served):
    url, _ = served
    result = {}

    def bad() -> None:
        result["r"] = httpx.post(url + "/v1/chat/completions", timeout=60,
                                 json={"model": "m", "messages": USER, "chat_template": LOOPS})

    t = threading.Thread(target=bad)
    t.start()
    t0 = time.monotonic()
    assert httpx.get(url + "/health", timeout=2).status_code == 200
    t.join(60)
    assert time.monotonic() - t0 < 30
    err = error_of(result["r"], 400)
    assert err["type"] == "invalid_request_error" and err["param"] == "chat_template"
    assert "chat_template: rendering exceeded 2000000 steps" in err["message"]
    # a normal per-request template still works, and renders what it says
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "m", "messages": USER, "max_tokens": 1,
        "chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"})
    assert r.status_code == 200, r.text
    rid = r.json()["id"] + "-0"
    assert served[1].prompts[rid] == served[1].tokenizer.encode("[hi]", add_special_tokens=False)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "m", "prompt": "slow prompt", "max_tokens": 1}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "slow"}], "max_tokens": 1,
                              "chat_template": "{{ messages[0].content }}"}),
])
def test_tokenization_and_rendering_do_not_block_the_event_loop(served, path, body):
    """The slow part (3 s) runs in a worker thread: /health answers at once while it runs."""
    url, _ = served
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(url + path, json=body, timeout=60)))
    t.start()
    time.sleep(0.5)  # the request is inside the slow call now
    t0 = time.monotonic()
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 1.5
    assert t.is_alive()  # precondition: /health answered while the slow call was still running
    t.join(60)
    assert result["r"].status_code == 200, result["r"].text


def test_body_over_the_limit_is_a_413(served):
    url, _ = served
    before = http_count(url, "/v1/completions", 413)
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x" * 5000})
    err = error_of(r, 413)
    assert err["message"] == ("request body too large: the limit is 4096 bytes (atomtool serve "
                              "--max-request-bytes)")

    def chunks():  # no Content-Length: the limit is enforced while the body arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert "request body too large" in error_of(r, 413)["message"]
    assert http_count(url, "/v1/completions", 413) == before + 2
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "user": "u" * 3800, "max_tokens": 1})
    assert r.status_code == 200, r.text  # just under the limit


# ------------------------------------------------------------------------------ 2. surrogates, 500 count
@pytest.mark.parametrize("path, raw, param, field", [
    ("/v1/completions", '{"model": "m", "prompt": "\\ud800 hi"}', "prompt", "prompt"),
    ("/v1/completions", '{"model": "m", "prompt": ["ok", "a\\udfff"]}', "prompt", "prompt[1]"),
    ("/v1/completions", '{"model": "m", "prompt": "ok", "stop": ["\\ud800"]}', "stop", "stop[0]"),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "\\ud800 hi"}]}',
     "messages", "messages[0].content"),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": "x\\udc80"}]}]}', "messages", "messages[0].content[0].text"),
    # the model name is checked before the 404 that would quote it
    ("/v1/completions", '{"model": "\\udc00", "prompt": "hi"}', "model", "model"),
    ("/v1/chat/completions", '{"model": "x\\udc00y", "messages": [{"role": "user", "content": "q"}]}',
     "model", "model"),
])
def test_lone_surrogate_is_a_400_naming_the_field(served, path, raw, param, field):
    url, _ = served
    before = http_count(url, path, 400)
    r = httpx.post(url + path, content=raw.encode(), headers={"Content-Type": "application/json"})
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].startswith(f"{field}: the text is not valid Unicode: lone surrogate \\u")
    assert http_count(url, path, 400) == before + 1


def test_error_message_quoting_a_lone_surrogate_is_escaped():
    """An error whose message quotes client text holding a lone surrogate still serializes (as \\udc00)."""
    from atomtool.serve.api.errors import APIError

    r = APIError(404, "The model `\udc00` does not exist.", param="model").response()
    assert json.loads(r.body)["error"]["message"] == "The model `\\udc00` does not exist."


def test_internal_error_is_a_counted_500_without_asgi_traceback(tok):
    class Broken(SlowTokenizer):
        def encode(self, text, *a, **k):
            if text == "boom":
                raise RuntimeError("tokenizer exploded")
            return super().encode(text, *a, **k)

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    uv = logging.getLogger("uvicorn.error")
    uv.addHandler(handler)
    try:
        engine = ScriptedEngine(Broken(tok, 0), tok.encode("ok", add_special_tokens=False))
        with ServerThread(create_app(engine, "m")) as url:
            r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "boom"})
            err = error_of(r, 500)
            assert err == {"message": "internal server error: RuntimeError: tokenizer exploded",
                           "type": "server_error", "param": None, "code": None}
            assert http_count(url, "/v1/completions", 500) == 1
            assert httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "fine"}).status_code == 200
    finally:
        uv.removeHandler(handler)
    assert not [rec for rec in records if "Exception in ASGI application" in rec.getMessage()]


def test_generate_with_invalid_utf8_prompt_is_a_one_line_error():
    r = subprocess.run([sys.executable, "-m", "atomtool.cli", "generate", DEMO, "--device", "cpu",
                        "--prompt", b"Beautiful \xff\xfe"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "error: --prompt is not valid UTF-8 text: byte 0xff at character 10"
    assert r.stdout == ""


# ------------------------------------------------------------------------------------------ 3. empty key
runner = CliRunner()


@pytest.mark.parametrize("args, env", [
    (["--api-key", ""], {}),
    (["--api-key", "  "], {}),
    ([], {"ATOMTOOL_API_KEY": ""}),
])
def test_empty_api_key_is_refused_at_startup(args, env, monkeypatch):
    import atomtool.serve.engine.llm_engine as llm_engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "from_model", no_load)
    result = runner.invoke(cli_app, ["serve", DEMO, "--port", "0", *args], env=env)
    out = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == 1, out
    assert "error: --api-key (or ATOMTOOL_API_KEY) must not be empty; leave it unset to serve without " \
           "authentication" in out
    assert "Traceback" not in out


def test_api_key_help_documents_the_empty_key():
    result = runner.invoke(cli_app, ["serve", "--help"], terminal_width=200)
    text = " ".join(result.output.split())
    assert "Unset: no authentication" in text and "is an error" in text
    assert "--max-request-bytes" in text and "413" in text


# ------------------------------------------------------------------------------------- 5. strict types
@pytest.mark.parametrize("path, extra, needle", [
    ("/v1/completions", {"max_tokens": True}, "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"n": "2"}, "n: Input should be a valid integer"),
    ("/v1/completions", {"stream": "true"}, "stream: Input should be a valid boolean"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature: Input should be a valid number"),
    ("/v1/completions", {"stop_token_ids": [True]}, "stop_token_ids[0]: Input should be a valid integer"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt: must be a string, a list of strings, a list of "
                                                   "token ids (integers) or a list of token-id lists"),
    ("/v1/completions", {"prompt": [[1, True]]}, "prompt: must be a string"),
    ("/v1/chat/completions", {"max_completion_tokens": False},
     "max_completion_tokens: Input should be a valid integer"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs: Input should be a valid boolean"),
])
def test_bools_and_strings_are_not_numbers(served, path, extra, needle):
    url, _ = served
    body = {"model": "m", **({"prompt": "hi"} if path == "/v1/completions" else
                             {"messages": USER, "chat_template": "{{ messages[0].content }}"}), **extra}
    err = error_of(httpx.post(url + path, json=body), 400)
    assert needle in err["message"]
    assert err["param"] == needle.split(":")[0].split("[")[0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_null_means_the_default(served, path):
    url, _ = served
    nulls = {"stream": None, "n": None, "ignore_eos": None, "min_tokens": None, "max_tokens": None,
             "temperature": None, "stop": None}
    if path.endswith("chat/completions"):
        body = {"messages": USER, "chat_template": "{{ messages[0].content }}", "logprobs": None,
                "add_generation_prompt": None, **nulls, "max_tokens": 2}
    else:
        body = {"prompt": "hi", "echo": None, **nulls}
    r = httpx.post(url + path, json={"model": "m", **body})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 1  # n: null -> 1, and not a stream
    if path == "/v1/completions":
        assert out["usage"]["completion_tokens"] == 16  # max_tokens: null -> OpenAI's default 16
    # a required field stays required
    required = "prompt" if path == "/v1/completions" else "messages"
    err = error_of(httpx.post(url + path, json={"model": "m", **body, required: None}), 400)
    assert err["param"] == required


def test_retrieve_model(tok):
    engine = ScriptedEngine(tok, [5])
    with ServerThread(create_app(engine, "org/tiny", model_root="/models/tiny")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        card = client.models.retrieve("org/tiny")
        assert (card.id, card.object, card.owned_by) == ("org/tiny", "model", "atomtool")
        assert card.model_extra["max_model_len"] == engine.max_model_len
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("gpt-4")
        assert e.value.body["message"] == "The model `gpt-4` does not exist."
        assert e.value.body["code"] == "model_not_found"
        assert http_count(url, "/v1/models/{model}", 404) == 1


# ----------------------------------------------------------------------------------- 4. forced shutdown
@contextlib.contextmanager
def demo_server_process(tmp_path: Path):
    """``atomtool serve`` on the demo model (CPU) in a subprocess, output to ``tmp_path / "server.log"``;
    yields (url, proc, log_path) once /health answers; kills the process if the test left it running."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "atomtool.cli", "serve", "--port", str(port), "--device", "cpu"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(url, proc, log_path)
        yield url, proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()


def test_second_ctrl_c_forces_shutdown_exit_130_without_traceback(tmp_path):
    with demo_server_process(tmp_path) as (url, proc, log_path):
        first = threading.Event()
        lines: list[str] = []

        def reader() -> None:
            body = {"model": "atomtool-demo", "prompt": "Beautiful is", "max_tokens": 400, "stream": True,
                    "ignore_eos": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        lines.append(line)
                        first.set()
            except httpx.HTTPError:
                pass  # the forced shutdown cuts the stream

        t = threading.Thread(target=reader)
        t.start()
        assert first.wait(60), open(log_path).read()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # still draining the stream
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
        t.join(30)
    log = open(log_path).read()
    assert code == 130, log
    assert "atomtool serve: forced shutdown (second Ctrl-C): aborted 1 in-flight request" in log
    assert "shut down cleanly" not in log
    assert "Traceback" not in log and "CancelledError" not in log
    assert "[DONE]" not in lines  # the stream really was cut
    assert json.loads(lines[0][6:])["choices"]  # it had started


# --------------------------------------------- 5. deep nesting, strict JSON, log prefix, non-finite sampling
def _nest(depth: int) -> dict:
    """A JSON object nested ``depth`` levels deep: ``{"a": {"a": ... "x"}}``."""
    value: object = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


def _nest_text(depth: int) -> str:
    """``_nest(depth)`` as JSON text, written without json.dumps (which recurses, as deep as the body)."""
    return '{"a": ' * depth + '"x"' + "}" * depth


@pytest.fixture(scope="module")
def served_unlimited(tok):
    """The scripted server with the default (16 MiB) body limit: deep bodies are larger than 4 KiB."""
    engine = ScriptedEngine(tok, tok.encode("ok", add_special_tokens=False))
    with ServerThread(create_app(engine, "m")) as url:
        yield url


def _chat_with(field: str, depth: int) -> str:
    """A chat request body (JSON text) with an object ``depth`` levels deep inside ``field``."""
    if field == "tools":
        inner = '"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]'
    else:
        inner = '"chat_template_kwargs": {"k": %s}'
    return '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, %s}' % (
        inner % _nest_text(depth))


def _post(url: str, path: str, body: str) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("field, path", [
    ("chat_template_kwargs", "chat_template_kwargs.k.a.a.a.a.a.a..."),
    ("tools", "tools[0].function.parameters.a.a.a.a..."),
])
@pytest.mark.parametrize("depth", [150, 940, 950, 960])
def test_deeply_nested_body_is_a_400_not_a_recursion_500(served_unlimited, field, path, depth):
    """~950 levels used to pass the JSON parser and then overflow the recursive Unicode check (a 500
    RecursionError); any nesting beyond the limit is now a 400 naming the field where it happens."""
    r = _post(served_unlimited, "/v1/chat/completions", _chat_with(field, depth))
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("invalid JSON body: "), err
    if depth < 900:  # deeper bodies may already stop the parser ("nesting too deep")
        assert err["message"] == (f"invalid JSON body: {path}: nested more than 100 levels deep (the server's "
                                  "limit for arrays/objects in a request)")
        assert err["param"] == field
    assert _post(served_unlimited, "/v1/chat/completions", _chat_with(field, 1)).status_code == 200


def test_nesting_limit_is_exactly_100_levels(served_unlimited):
    # body (1) > chat_template_kwargs (2) > k's objects: 98 more make 100 levels
    ok = _post(served_unlimited, "/v1/chat/completions", _chat_with("kwargs", 98))
    assert ok.status_code == 200, ok.text
    bad = _post(served_unlimited, "/v1/chat/completions", _chat_with("kwargs", 99))
    assert "nested more than 100 levels deep" in error_of(bad, 400)["message"]
    nested_list = {"model": "m", "prompt": "hi", "max_tokens": 1, "stop": json.loads("[" * 120 + "]" * 120)}
    msg = error_of(httpx.post(served_unlimited + "/v1/completions", json=nested_list), 400)["message"]
    assert msg.startswith("invalid JSON body: stop[0][0][0][0][0][0][0]...: nested more than 100 levels")


def test_unicode_check_walks_any_depth_without_recursion():
    from atomtool.serve.api.app import check_unicode
    from atomtool.serve.api.errors import APIError

    deep = _nest(20_000)
    inner = deep
    for _ in range(19_999):
        inner = inner["a"]
    inner["a"] = "bad \ud800"
    with pytest.raises(APIError) as info:
        check_unicode({"chat_template_kwargs": deep})
    assert "lone surrogate \\ud800 at character 4" in info.value.body().error.message
    assert info.value.body().error.param == "chat_template_kwargs"


@pytest.mark.parametrize("path, fragment, constant", [
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}], "temperature": NaN', "NaN"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity', "Infinity"),
    ("/v1/completions", '"prompt": "hi", "temperature": NaN', "NaN"),
    ("/v1/completions", '"prompt": "hi", "max_tokens": -Infinity', "-Infinity"),
    ("/v1/completions", '"prompt": "hi", "logit_bias": {"1": NaN}', "NaN"),
])
def test_nan_and_infinity_are_not_json(served_unlimited, path, fragment, constant):
    r = httpx.post(served_unlimited + path, content='{"model": "m", ' + fragment + "}",
                   headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["message"] == (f"invalid JSON body: {constant} is not valid JSON (JSON has no NaN or Infinity; "
                              "send a finite number)")
    assert "less than or equal" not in err["message"]


@pytest.mark.parametrize("fragment, message", [
    ('"prompt": "a\tb"', "invalid JSON body: Invalid control character at position "),  # no "at at"
    ('"prompt": "hi", "seed": ' + "7" * 5000, "invalid JSON body: an integer with 5000 digits (at most 4300)"),
])
def test_json_body_messages_are_plain(served_unlimited, fragment, message):
    r = httpx.post(served_unlimited + "/v1/completions", content='{"model": "m", ' + fragment + "}",
                   headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["message"].startswith(message), err["message"]
    assert "set_int_max_str_digits" not in err["message"]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_generate_refuses_non_finite_temperature(value):
    res = runner.invoke(cli_app, ["generate", DEMO, "--device", "cpu", "--prompt", "hi", f"--temperature={value}"])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    assert res.stderr.strip().splitlines() == [
        f"error: temperature must be >= 0 and finite, got {float(value)!r}"]


def test_serve_log_lines_carry_the_server_prefix():
    """The warning about tools a template ignores is logged (logger ``atomtool.serve``); `atomtool serve`
    prints it as it prints its own warnings: ``atomtool serve: warning: ...``."""
    import io
    import logging

    from atomtool.serve.api.server import serve_log_handler

    stream = io.StringIO()
    handler = serve_log_handler(stream)
    log = logging.getLogger("atomtool.serve")
    log.addHandler(handler)
    try:
        log.warning("a request sent tools, but %s", "x")
        log.info("not shown")
    finally:
        log.removeHandler(handler)
    assert stream.getvalue() == "atomtool serve: warning: a request sent tools, but x\n"


def test_serve_prints_the_tools_warning_with_its_prefix(tmp_path):
    with demo_server_process(tmp_path) as (url, proc, log_path):
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "atomtool-demo", "messages": USER, "max_tokens": 1, "tools": tools})
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    lines = open(log_path).read().splitlines()
    warned = [line for line in lines if "does not reference `tools`" in line]
    assert len(warned) == 1 and warned[0].startswith("atomtool serve: warning: a request sent tools"), lines
