"""Defects found by a fresh user (round 15, session 14): each test reproduces one, now fixed.

Oracles (vLLM's OpenAI-compatible server, which the README says ``atomtool serve`` follows):
- CORS: vLLM adds Starlette's ``CORSMiddleware`` (``--allowed-origins`` / ``--allowed-methods`` /
  ``--allowed-headers`` as JSON lists, default ``["*"]``; ``--allow-credentials``); a preflight ``OPTIONS``
  needs no API key.
- ``stop_reason`` on every choice (completions, chat, their stream chunks): the stop string or stop token id
  that ended the output, else null (EOS, length).
- ``POST /tokenize`` (``prompt`` or chat ``messages``; ``count``, ``max_model_len``, ``tokens``, optional
  ``token_strs``), ``POST /detokenize`` (``tokens`` -> ``prompt``), ``GET /version``, ``GET|POST /ping``.
- ``python -m atomtool`` runs the command line, as ``python -m vllm.entrypoints...`` users expect a module form.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from atomtool.cli import app as cli_app
from atomtool.serve.api.app import create_app
from atomtool.serve.api.middleware import CorsPolicy
from atomtool.serve.api.server import ServerThread
from atomtool.serve.demo import demo_model_path
from tests.test_server_support import ScriptedEngine, sse_events

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(demo_model_path()))


def _app(tok, ids, **kw):
    return create_app(ScriptedEngine(tok, ids, max_model_len=128), "m", chat_template=TEMPLATE, **kw)


# ---------------------------------------------------------------- CORS
def test_cors_preflight_and_responses_allow_any_origin_by_default_without_the_api_key(tok):
    ids = tok.encode(" ugly", add_special_tokens=False)
    with ServerThread(_app(tok, ids, api_key="k")) as url:
        pre = httpx.options(url + "/v1/chat/completions", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        models = httpx.get(url + "/v1/models", headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
    assert pre.status_code == 200  # observed: 405 without a key check, 401 with one
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"


def test_cors_policy_limits_origins(tok):
    ids = tok.encode(" ugly", add_special_tokens=False)
    policy = CorsPolicy(allowed_origins=("https://app.example",))
    with ServerThread(_app(tok, ids, cors=policy)) as url:
        ok = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example"})
        other = httpx.get(url + "/v1/models", headers={"Origin": "https://evil.example"})
        pre = httpx.options(url + "/v1/completions", headers={"Origin": "https://evil.example",
                                                               "Access-Control-Request-Method": "POST"})
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in other.headers
    assert pre.status_code == 400


@pytest.mark.parametrize("flag, value", [("--allowed-origins", "*"), ("--allowed-methods", '{"a": 1}'),
                                         ("--allowed-headers", "[1]")])
def test_cors_flags_must_be_json_lists_of_strings(flag, value, monkeypatch):
    import atomtool.serve.engine.llm_engine as llm_engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "from_model", no_load)
    r = CliRunner().invoke(cli_app, ["serve", "--port", "0", flag, value])
    assert r.exit_code == 1, r.output  # a bad flag value, as every serve flag check (tests/test_server_cli.py)
    assert f"{flag} must be a JSON list of strings" in r.output


# ---------------------------------------------------------------- stop_reason
@pytest.fixture(scope="module")
def demo_url():
    from atomtool.serve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_model(str(demo_model_path()), device="cpu", dtype="float32", kv_cache_memory=1 << 22,
                                  max_model_len=256)
    with ServerThread(create_app(engine, "m")) as url:
        yield url


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_output(tok, demo_url):
    # the demo model recites the Zen of Python: "Beautiful is better than" -> " ugly.\nExplicit is better ..."
    stop_id = tok.encode(" better", add_special_tokens=False)[0]

    def complete(path, extra, stream=False):
        body = {"model": "m", "max_tokens": 12, "temperature": 0, "stream": stream, **extra}
        text = "Beautiful is better than"
        body.update({"prompt": text} if "chat" not in path else
                    {"messages": [{"role": "user", "content": "Recite the Zen of Python."}]})
        r = httpx.post(demo_url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]
        return [c for e in sse_events(r.text.splitlines()) if e != "[DONE]" for c in e["choices"]][-1]

    for stream in (False, True):
        by_string = complete("/v1/completions", {"stop": ["Explicit"]}, stream)
        assert (by_string["finish_reason"], by_string["stop_reason"]) == ("stop", "Explicit")  # observed: no field
        by_token = complete("/v1/completions", {"stop_token_ids": [stop_id]}, stream)
        assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", stop_id)
        by_length = complete("/v1/completions", {"max_tokens": 2}, stream)
        assert by_length["finish_reason"] == "length" and by_length["stop_reason"] is None
        chat = complete("/v1/chat/completions", {"stop_token_ids": [stop_id]}, stream)
        assert (chat["finish_reason"], chat["stop_reason"]) == ("stop", stop_id)


# ---------------------------------------------------------------- /tokenize, /detokenize, /version, /ping
def test_tokenize_and_detokenize_like_vllm(tok):
    ids = tok.encode(" ugly", add_special_tokens=False)
    with ServerThread(_app(tok, ids, api_key="k")) as url:  # not under /v1: no key, as in vLLM
        t = httpx.post(url + "/tokenize", json={"model": "m", "prompt": "Beautiful is", "return_token_strs": True})
        chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        d = httpx.post(url + "/detokenize", json={"model": "m", "tokens": t.json()["tokens"]})
        bad = httpx.post(url + "/detokenize", json={"tokens": [len(tok) + 5]})
        both = httpx.post(url + "/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
        wrong_model = httpx.post(url + "/tokenize", json={"model": "other", "prompt": "a"})
        version = httpx.get(url + "/version")
        pings = [httpx.get(url + "/ping"), httpx.post(url + "/ping")]
    want = tok.encode("Beautiful is")
    assert t.status_code == 200, t.text  # observed: 404
    assert t.json() == {"count": len(want), "max_model_len": 128, "tokens": want,
                        "token_strs": tok.convert_ids_to_tokens(want)}
    assert chat.json()["tokens"] == tok.encode(TEMPLATE.replace("{% for m in messages %}{{ m.role }}: "
                                                                "{{ m.content }}\n{% endfor %}", "user: hi\n"),
                                               add_special_tokens=False)
    assert d.json() == {"prompt": tok.decode(want)}
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    assert both.status_code == 400 and wrong_model.status_code == 404
    from atomtool import __version__

    assert version.json() == {"version": __version__}
    assert [p.status_code for p in pings] == [200, 200]


# ---------------------------------------------------------------- python -m atomtool
def test_python_dash_m_atomtool_runs_the_command_line():
    r = subprocess.run([sys.executable, "-m", "atomtool", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr  # observed: No module named atomtool.__main__
    assert "inspect" in r.stdout and "serve" in r.stdout


# ---------------------------------------------------------------- vLLM's request extras
def _post(url, path, body):
    return httpx.post(url + path, json={"model": "m", **body}, timeout=60)


def test_skip_special_tokens_false_keeps_their_text_streamed_or_not(tok, demo_url):
    user = tok.convert_tokens_to_ids("<|user|>")
    body = {"prompt": "Beautiful is", "max_tokens": 3, "temperature": 0, "logit_bias": {str(user): 100},
            "logprobs": 1}
    kept = _post(demo_url, "/v1/completions", {**body, "skip_special_tokens": False})
    assert kept.status_code == 200, kept.text  # observed: 400 "Unrecognized request argument"
    choice = kept.json()["choices"][0]
    assert choice["text"] == "<|user|>" * 3
    assert choice["logprobs"]["text_offset"] == [0, 8, 16]
    skipped = _post(demo_url, "/v1/completions", body).json()["choices"][0]
    assert skipped["text"] == "" and skipped["logprobs"]["text_offset"] == [0, 0, 0]
    streamed = _post(demo_url, "/v1/completions", {**body, "skip_special_tokens": False, "stream": True})
    chunks = [c for e in sse_events(streamed.text.splitlines()) if e != "[DONE]" for c in e["choices"]]
    assert "".join(c["text"] for c in chunks) == "<|user|>" * 3


def test_add_special_tokens_truncation_and_request_id(tok, demo_url):
    plain = _post(demo_url, "/v1/completions", {"prompt": "Beautiful is better", "max_tokens": 1})
    no_bos = _post(demo_url, "/v1/completions", {"prompt": "Beautiful is better", "max_tokens": 1,
                                                  "add_special_tokens": False})
    n = len(tok.encode("Beautiful is better"))
    assert plain.json()["usage"]["prompt_tokens"] == n and no_bos.json()["usage"]["prompt_tokens"] == n - 1
    cut = _post(demo_url, "/v1/completions", {"prompt": "Beautiful is better", "max_tokens": 1,
                                               "truncate_prompt_tokens": 2, "echo": True})
    assert cut.json()["usage"]["prompt_tokens"] == 2
    assert cut.json()["choices"][0]["text"].startswith(tok.decode(tok.encode("Beautiful is better")[-2:]))
    chat = _post(demo_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1, "truncate_prompt_tokens": 3,
                                                     "request_id": "abc"})
    assert chat.json()["usage"]["prompt_tokens"] == 3 and chat.json()["id"] == "chatcmpl-abc"
    same = [_post(demo_url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "request_id": "r1"})
            for _ in range(2)]  # the same id twice: the engine's own ids stay unique
    assert [r.json()["id"] for r in same] == ["cmpl-r1", "cmpl-r1"]
    zero = _post(demo_url, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "truncate_prompt_tokens"


def test_vllm_fields_accepted_or_refused_as_vllm_does(demo_url):
    ok = _post(demo_url, "/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": 0, "use_beam_search": False,
                                              "length_penalty": 1.0, "spaces_between_special_tokens": False})
    assert ok.status_code == 200, ok.text
    for field, value, message in (("priority", 1, "priority scheduling is not enabled"),
                                  ("use_beam_search", True, "beam search is not supported")):
        r = _post(demo_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        assert message in r.json()["error"]["message"]
    js = _post(demo_url, "/v1/completions", {"prompt": "A JSON object:", "max_tokens": 8, "temperature": 0,
                                              "response_format": {"type": "json_object"}})
    assert js.status_code == 200, js.text  # observed: 400 "Unrecognized request argument"
    assert js.json()["choices"][0]["text"].lstrip().startswith("{")


def test_serve_takes_the_model_as_vllms_model_option_too(monkeypatch):
    import atomtool.serve.api.server as server

    seen = {}
    monkeypatch.setattr(server, "run_serve", lambda model, **kw: seen.setdefault("model", model) and 0)
    r = CliRunner().invoke(cli_app, ["serve", "--model", "some/model"])
    assert seen["model"] == "some/model", r.output  # observed: "No such option: --model"
    r = CliRunner().invoke(cli_app, ["serve", "a/model", "--model", "other/model"])
    assert r.exit_code == 1 and "disagree" in r.output


def test_a_405_names_the_allowed_methods(tok):
    with ServerThread(_app(tok, tok.encode(" ugly", add_special_tokens=False))) as url:
        r = httpx.delete(url + "/v1/models")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["allow"] == "GET"  # observed: no Allow header
