"""Defects found by a fresh user exercising ``atomtool generate`` / ``serve`` / the ``LLM`` API (round 6b).

Each test was a strict-xfail reproducer of a defect; the defects are fixed and the tests keep them fixed.

Oracles:
- ``LLM.generate``'s docstring: "prompts: one prompt or a list (text, or token ids) ... Raises:
  InvalidRequestError: a bad prompt or sampling parameter"; vLLM's ``LLM.generate`` accepts token ids that
  are numpy integers (``np.int64`` from a tokenizer called with ``return_tensors="np"``).
- ``SamplingParams.validate``: "temperature must be >= 0 and finite": a value that *is* >= 0 and finite
  must not be refused with that message.
- OpenAI's error object: ``param`` names the request field at fault; the server already does so for every
  schema error (``n``, ``max_tokens``, ``temperature`` ...), so the range checks that ``SamplingParams``
  makes (``top_k``, ``stop_token_ids``, ``stop``) must name theirs too.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from atomtool.cli import app as cli_app
from atomtool.errors import InvalidRequestError
from atomtool.serve import LLM, SamplingParams
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.demo import demo_model_path
from tests.checkpoints import write_hf_checkpoint
from tests.test_server_support import ScriptedEngine

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def url():
    tok = AutoTokenizer.from_pretrained(str(demo_model_path()))
    ids = tok.encode("ok", add_special_tokens=False)
    app = create_app(ScriptedEngine(tok, ids, max_model_len=128), "m", chat_template=TEMPLATE)
    with ServerThread(app) as u:
        yield u


def test_llm_generate_accepts_numpy_integer_token_ids(llm):
    params = SamplingParams(max_tokens=3, temperature=0)
    ref = llm.generate([5, 6, 7], params)[0]
    out = llm.generate([np.int64(5), np.int64(6), np.int64(7)], params)[0]
    assert list(out.token_ids) == list(ref.token_ids)


def test_llm_generate_tuple_of_ids_is_run_or_refused_clearly(llm):
    try:
        out = llm.generate((5, 6, 7), SamplingParams(max_tokens=2, temperature=0))
    except InvalidRequestError:
        return
    assert len(out) == 1
    assert not llm.engine.has_unfinished()


def test_numpy_float_temperature_is_not_refused_as_out_of_range():
    try:
        SamplingParams(temperature=np.float32(0.5), top_p=np.float32(0.9)).validate()
    except InvalidRequestError as e:
        assert ">= 0 and finite, got np.float32(0.5)" not in str(e)


@pytest.mark.parametrize("field, value", [("top_k", -2), ("stop_token_ids", [-1]), ("stop", [""])])
def test_sampling_range_errors_name_their_param(url, field, value):
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2, field: value},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field, err


class _SizeCheckingTokenizer:
    """The demo tokenizer, refusing (instead of spending seconds on) an ``encode`` of more than ``limit``
    characters, and recording the longest text it was asked to encode."""

    def __init__(self, tok, limit: int) -> None:
        self._tok = tok
        self.limit = limit
        self.longest = 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, *args, **kwargs):
        self.longest = max(self.longest, len(text))
        if len(text) > self.limit:
            raise AssertionError(f"asked to tokenize {len(text)} characters")
        return self._tok.encode(text, *args, **kwargs)


def test_request_chat_template_cannot_make_the_server_tokenize_megabytes():
    tok = _SizeCheckingTokenizer(AutoTokenizer.from_pretrained(str(demo_model_path())), limit=1 << 20)
    ids = tok.encode("ok", add_special_tokens=False)
    app = create_app(ScriptedEngine(tok, ids, max_model_len=128), "m", chat_template=TEMPLATE,
                     trust_request_chat_template=True)  # the bound under test applies to trusted templates
    with ServerThread(app) as u:
        r = httpx.post(u + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{{ 'ab ' * 3000000 }}"}, timeout=60)
        ok = httpx.post(u + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    # a 128-token context never needs a megabyte of text: the server must refuse it before tokenizing
    assert tok.longest <= 1 << 20


def test_min_tokens_error_names_the_effective_max_tokens(url):
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "min_tokens": 20}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "16" in err["message"], err  # vLLM: "min_tokens must be less than or equal to max_tokens=16, got 20"
    assert err["param"] == "min_tokens", err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_say_a_file_is_a_file(tmp_path, command):
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    result = CliRunner().invoke(cli_app, [command, str(cfg), *extra])
    assert result.exit_code == 1, result.output
    assert "does not exist" not in result.output, result.output
    assert "is a file" in result.output, result.output


@pytest.mark.parametrize("ids", [[1.5, 2.7], [True], ["7"]], ids=["float", "bool", "str"])
def test_llm_generate_refuses_non_integer_token_ids(llm, ids):
    with pytest.raises(InvalidRequestError):
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("prompts", [[5, "a"], ["a", 5]], ids=["id-then-text", "text-then-id"])
def test_llm_generate_mixed_prompt_list_is_an_invalid_request(llm, prompts):
    with pytest.raises(InvalidRequestError):
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    assert not llm.engine.has_unfinished()


def test_tool_choice_without_tools_is_a_400(url):
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tool_choice": "auto"},
        timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and "tools" in err["message"], err
