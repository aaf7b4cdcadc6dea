"""Server behaviour that needs an engine on a leash (tests/test_server_support.ScriptedEngine):

- a multi-byte UTF-8 character split over byte-level tokens is never split across streamed pieces;
- an engine step that raises fails the requests in flight with an OpenAI error, and the server keeps
  serving the next request;
- a rejected ``add_request`` (InvalidRequestError) is a 400 and leaves no request behind;
- a slow engine lets us disconnect a non-streaming request and see it aborted.

The real engine is used for everything else (tests/test_server_api.py).
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from tests.checkpoints import make_tokenizer
from tests.test_server_support import ScriptedEngine, byte_level_tokenizer, sse_events

TEXT = "añb€c😀 dóne"


def test_streaming_never_splits_a_multibyte_character():
    tok = byte_level_tokenizer()
    script = tok.encode(TEXT, add_special_tokens=False)
    assert len(script) > len(TEXT) + 5  # precondition: characters really are split over tokens
    assert "\ufffd" in tok.decode(script[:2])  # a lone lead byte decodes to U+FFFD
    engine = ScriptedEngine(tok, script)
    with ServerThread(create_app(engine, "m")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        pieces = [c.choices[0].text for c in client.completions.create(
            model="m", prompt="x", max_tokens=len(script), stream=True)]
        full = client.completions.create(model="m", prompt="x", max_tokens=len(script)).choices[0].text
    assert full == TEXT
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) >= len(TEXT) - 1  # streamed piece by piece, not in one lump


def test_chat_without_template_is_a_400():
    tok = byte_level_tokenizer()
    with ServerThread(create_app(ScriptedEngine(tok, [5]), "m")) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert "no chat template" in r.json()["error"]["message"]
    assert "--chat-template" in r.json()["error"]["message"]


def test_step_failure_fails_requests_in_flight_and_server_keeps_serving():
    tok = make_tokenizer()
    engine = ScriptedEngine(tok, tok.encode("abcdef", add_special_tokens=False), fail_on_step=3)
    with ServerThread(create_app(engine, "m")) as url:
        with httpx.stream("POST", url + "/v1/completions",
                          json={"model": "m", "prompt": "hi", "max_tokens": 6, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        # two tokens arrived, then the error event and [DONE]
        assert [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
        assert events[2]["error"]["type"] == "server_error"
        assert "injected step failure" in events[2]["error"]["message"]
        assert events[-1] == "[DONE]"
        assert engine.num_free_blocks() == engine.num_total_blocks()  # aborted: blocks back
        # the next request is served normally
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        assert client.completions.create(model="m", prompt="hi", max_tokens=4).choices[0].text == "abcd"
        assert httpx.get(url + "/health").status_code == 200
        # a non-streaming request hit by a failing step gets a 500 in OpenAI's error format
        engine.fail_on_step = engine.steps + 2
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 6})
        assert r.status_code == 500
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "injected step failure" in r.json()["error"]["message"]
        metrics = httpx.get(url + "/metrics").text
        assert 'atomtool:request_success_total{finished_reason="error",model_name="m"} 2.0' in metrics


def test_add_request_rejection_is_a_400_and_aborts_siblings():
    tok = make_tokenizer()
    engine = ScriptedEngine(tok, [10], max_model_len=8)
    with ServerThread(create_app(engine, "m")) as url:
        # the server's own length check passes (8 > 7 tokens), the engine's InvalidRequestError is a 400
        engine.max_model_len = 4
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "abcdef", "max_tokens": 1, "n": 3})
        assert r.status_code == 400, r.text
        assert "max_model_len is 4" in r.json()["error"]["message"]
        time.sleep(0.2)
        assert not engine.has_unfinished()


def test_non_streaming_disconnect_aborts_the_request():
    tok = make_tokenizer()
    engine = ScriptedEngine(tok, [10], step_delay=0.02, max_model_len=100_000)
    with ServerThread(create_app(engine, "m")) as url:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up (closes the connection) after 2 s
            httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 10_000,
                                                      "ignore_eos": True}, timeout=httpx.Timeout(2.0, connect=30))
        assert engine.steps > 0  # it was running
        deadline = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished()
        assert engine.steps < 10_000
        assert 'finished_reason="abort"' in httpx.get(url + "/metrics").text


def test_server_chat_template_overrides_the_tokenizers(tmp_path):
    tok = make_tokenizer()
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}=>{% endif %}")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    for value in (str(template), template.read_text()):  # a file or the template itself
        engine = ScriptedEngine(tok, [10])
        with ServerThread(create_app(engine, "m", chat_template=value)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x")
            client.chat.completions.create(model="m", messages=messages, max_tokens=1)
            client.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                           extra_body={"add_generation_prompt": False})
        prompts = [tok.decode(p) for p in engine.prompts.values()]
        assert prompts == ["<system>s<user>hi=>", "<system>s<user>hi"]
    # without an override the tokenizer's own template renders the conversation
    engine = ScriptedEngine(tok, [10])
    with ServerThread(create_app(engine, "m")) as url:
        openai.OpenAI(base_url=url + "/v1", api_key="x").chat.completions.create(
            model="m", messages=messages, max_tokens=1)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert list(engine.prompts.values()) == [tok.encode(rendered, add_special_tokens=False)]


def test_engine_thread_death_fails_requests_and_health():
    """A bug outside step() kills the engine thread: waiting clients get an error (not a hang), /health
    reports 503 and new requests are refused with 503."""
    tok = make_tokenizer()
    engine = ScriptedEngine(tok, [10], step_delay=0.01, max_model_len=10_000)
    calls = {"n": 0}
    real = engine.has_unfinished

    def broken():
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("scheduler invariant violated")
        return real()

    engine.has_unfinished = broken
    with ServerThread(create_app(engine, "m")) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 50}, timeout=30)
        assert r.status_code == 500
        assert "scheduler invariant violated" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 5}, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "the engine is not running"


def test_unexpected_add_request_exception_is_a_500_for_that_request_only():
    tok = make_tokenizer()
    engine = ScriptedEngine(tok, tok.encode("ok", add_special_tokens=False))
    real = engine.add_request

    def flaky(request_id, prompt, params):
        if prompt == tok.encode("boom"):  # the server hands the engine token ids (it tokenizes off the loop)
            raise RuntimeError("tokenizer exploded")
        return real(request_id, prompt, params)

    engine.add_request = flaky
    with ServerThread(create_app(engine, "m")) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "boom", "max_tokens": 2})
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "RuntimeError: tokenizer exploded", "type": "server_error",
                                     "param": None, "code": None}
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "fine", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
