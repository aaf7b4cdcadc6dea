"""A chat request's own ``chat_template`` is refused unless the server runs with
``--trust-request-chat-template`` (vLLM's flag of that name, off by default there too).

Why: a client's Jinja template is code the server runs. The render is bounded (steps, characters: see
``atomtool.serve.api.chat``), but one expression such as ``{{ 'x' * 10**10 }}`` allocates gigabytes before
any bound can look. So by default the request gets a 400 (OpenAI's error body, ``param: "chat_template"``)
before anything compiles or renders the template; ``--chat-template`` (the operator's template) is unaffected.

Oracles: vLLM's documented behaviour (a 400 naming the flag when the flag is off; the request template used
when on) and OpenAI's error object shape. Uses the scripted engine (tests/test_server_support.py) with a real
byte-level tokenizer, so the prompt the engine received shows which template rendered it.
"""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

import atomtool.serve.api.app as app_module
from atomtool.cli import app as cli_app
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from tests.test_server_support import ScriptedEngine, byte_level_tokenizer

OWN = "{% for m in messages %}<own>{{ m.content }}{% endfor %}"  # the tokenizer's template
OPERATOR = "{% for m in messages %}<operator>{{ m.content }}{% endfor %}"  # --chat-template
REQUEST = "{% for m in messages %}<request>{{ m.content }}{% endfor %}"  # sent by the client
BOMB = "{{ 'x' * 10**10 }}"  # 10 GB in one expression: must never be rendered
USER = [{"role": "user", "content": "hi"}]


class SpyTokenizer:
    """The tokenizer, counting ``apply_chat_template`` calls (each one renders a template)."""

    def __init__(self, tok) -> None:
        self._tok, self.renders = tok, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def apply_chat_template(self, convo, *a, **k):
        self.renders.append(k.get("chat_template"))
        return self._tok.apply_chat_template(convo, *a, **k)


@pytest.fixture(scope="module")
def tok():
    t = byte_level_tokenizer()
    t.chat_template = OWN
    return t


@pytest.fixture
def render_calls(monkeypatch):
    """Every render_chat call the app makes, by its chat_template; a request template (or the bomb) never
    reaches the real render, so a broken refusal fails the test instead of allocating gigabytes."""
    calls, real = [], app_module.render_chat

    def spy(tokenizer, messages, *, chat_template, **kw):
        calls.append(chat_template)
        if chat_template in (REQUEST, BOMB, ""):
            raise AssertionError(f"the request's chat_template {chat_template!r} reached render_chat")
        return real(tokenizer, messages, chat_template=chat_template, **kw)

    monkeypatch.setattr(app_module, "render_chat", spy)
    return calls


def serve(tok, **kw):
    engine = ScriptedEngine(SpyTokenizer(tok), tok.encode("ok", add_special_tokens=False), max_model_len=128)
    return engine, ServerThread(create_app(engine, "m", **kw))


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 1, **body},
                      timeout=30)


def prompt_text(engine, tok, r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return tok.decode(engine.prompts[r.json()["id"] + "-0"])


# ------------------------------------------------------------------------------------- default: refused
@pytest.mark.parametrize("operator", [None, OPERATOR])
@pytest.mark.parametrize("body", [{"chat_template": REQUEST}, {"chat_template": BOMB},
                                  {"chat_template": BOMB, "stream": True}, {"chat_template": ""},
                                  {"chat_template": REQUEST, "tools": [{"type": "function", "function": {
                                      "name": "f", "parameters": {"type": "object"}}}]}])
def test_request_chat_template_is_refused_by_default_before_rendering(tok, render_calls, operator, body):
    engine, server = serve(tok, chat_template=operator)
    with server as url:
        r = chat(url, **body)
        assert r.status_code == 400, r.text
        assert set(r.json()) == {"error"}
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["param"] == "chat_template"
        assert err["code"] is None
        assert "does not accept a chat_template in requests" in err["message"]
        assert "--trust-request-chat-template" in err["message"]
        assert render_calls == [] and engine.tokenizer.renders == []  # nothing compiled or rendered
        assert engine.prompts == {}  # nothing reached the engine either
        # the same server still serves requests without a template, with its own template
        text = prompt_text(engine, tok, chat(url))
        assert text == ("<operator>hi" if operator else "<own>hi")
        assert prompt_text(engine, tok, chat(url, chat_template=None)) == text  # null: not sent
    assert render_calls == [operator, operator]


def test_create_app_flag_is_keyword_only_and_off_by_default():
    import inspect

    param = inspect.signature(create_app).parameters["trust_request_chat_template"]
    assert param.kind is param.KEYWORD_ONLY and param.default is False


# --------------------------------------------------------------------------------------- trusted: used
@pytest.mark.parametrize("operator", [None, OPERATOR])
def test_trusted_request_chat_template_is_rendered(tok, operator):
    engine, server = serve(tok, chat_template=operator, trust_request_chat_template=True)
    with server as url:
        assert prompt_text(engine, tok, chat(url, chat_template=REQUEST)) == "<request>hi"
        assert prompt_text(engine, tok, chat(url)) == ("<operator>hi" if operator else "<own>hi")
        # the existing bounds still apply to a trusted template
        r = chat(url, chat_template="{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                                    "{% endfor %}")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template"
        assert "rendering exceeded" in r.json()["error"]["message"]
    assert engine.tokenizer.renders[0] == REQUEST


# ------------------------------------------------------------------------------------------------- CLI
def test_serve_help_lists_the_flag():
    result = CliRunner().invoke(cli_app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1",
                                                                    "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    assert "--trust-request-chat-template" in result.output
    assert "--no-trust-request-chat-template" not in result.output  # a plain on-switch, as vLLM's
    assert "Off by default" in result.output


class _Stop(Exception):
    """Raised by the create_app stand-in: the test has what it needs, no server is started."""


@pytest.mark.parametrize("flags, trusted", [([], False), (["--trust-request-chat-template"], True)])
def test_serve_flag_reaches_create_app(tok, monkeypatch, flags, trusted):
    """``atomtool serve`` -> run_serve -> create_app, with the model load and the app stubbed out."""
    import atomtool.serve.api.server as server_module
    import atomtool.serve.engine.llm_engine as llm_engine

    seen = {}

    def fake_create_app(engine, name, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(llm_engine.LLMEngine, "from_model",
                        lambda *a, **k: ScriptedEngine(tok, [0], max_model_len=128))
    monkeypatch.setattr(app_module, "create_app", fake_create_app)
    monkeypatch.setattr(server_module, "bind_socket", lambda host, port: None)  # no port taken
    result = CliRunner().invoke(cli_app, ["serve", "--port", "0", *flags])
    assert isinstance(result.exception, _Stop), result.output
    assert seen["trust_request_chat_template"] is trusted
