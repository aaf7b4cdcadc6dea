"""Request validation and wire format of the OpenAI-compatible server, against OpenAI's API and vLLM:

- a malformed or non-JSON body is a plain 400 sentence (no JSON position as ``param``);
- unknown request fields are 400 "Unrecognized request argument supplied: <field>" (OpenAI's words), chat
  roles outside OpenAI's set and user/system messages without content are 400;
- every parameter the official ``openai`` client can send for these endpoints is declared (checked
  against ``openai.types``), so a real client never gets a 400 for a valid field;
- completions without ``max_tokens`` get OpenAI's default 16, cut to the room left in the context
  instead of a 400 about a parameter the client never sent; an explicit value is still checked;
- streamed chat deltas leave out None fields (``role`` only in the first chunk), as OpenAI and vLLM do.

Runs on :class:`tests.test_server_support.ScriptedEngine` (fast; no model).
"""

from __future__ import annotations

import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from atomtool.serve.api.app import create_app
from atomtool.serve.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions
from atomtool.serve.api.server import ServerThread
from tests.checkpoints import make_tokenizer
from tests.test_server_support import ScriptedEngine, sse_events

MAX_LEN = 64
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    return ScriptedEngine(tok, tok.encode("abcdefgh", add_special_tokens=False), max_model_len=MAX_LEN,
                          num_blocks=256)


@pytest.fixture(scope="module")
def url(engine):
    with ServerThread(create_app(engine, "m", chat_template=TEMPLATE)) as base:
        yield base


def error_of(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return err


def prompt_of_length(tok, n: int) -> list[int]:
    """A token-id prompt of exactly ``n`` tokens (ids the tokenizer knows)."""
    ids = tok.encode("hello world " * n, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


# ---------------------------------------------------------------------------------------------- bodies
def test_malformed_json_body_is_a_plain_400(url):
    r = httpx.post(url + "/v1/completions", content=b'{"model": "m", "prompt": ',
                   headers={"content-type": "application/json"})
    err = error_of(r)
    assert err["message"] == "invalid JSON body: Expecting value at position 25"
    assert err["param"] is None


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body, message", [
    (b'{"model": "m", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}",
     "invalid JSON body: nesting too deep (arrays/objects nested more levels than the parser allows)"),
    (b'{"model": "m", "prompt": "\xff\xfe"}',
     "invalid JSON body: the body is not UTF-8 text (invalid start byte at byte 26)"),
])
def test_json_body_the_parser_cannot_take_is_the_same_plain_400(url, endpoint, body, message):
    """Bodies json.loads fails on with something other than a JSONDecodeError (RecursionError, a
    UnicodeDecodeError) get the same "invalid JSON body: ..." 400 as any malformed body, not FastAPI's
    "There was an error parsing the body"."""
    err = error_of(httpx.post(url + endpoint, content=body, headers={"content-type": "application/json"}))
    assert err["message"] == message
    assert err["param"] is None


@pytest.mark.parametrize("kw", [
    {"data": {"model": "m", "prompt": "hi"}},  # curl -d without a Content-Type: form-encoded
    {"content": b"[1, 2]", "headers": {"content-type": "application/json"}},
    {"content": b""},
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_body_that_is_not_a_json_object_is_a_400(url, path, kw):
    err = error_of(httpx.post(url + path, **kw))
    assert err["message"] == "the request body must be a JSON object (Content-Type: application/json)"
    assert err["param"] is None


# ---------------------------------------------------------------------------------------- unknown fields
@pytest.mark.parametrize("path, body, name, param", [
    ("/v1/completions", {"prompt": "hi", "foo": 1}, "foo", "foo"),
    ("/v1/completions", {"prompt": "hi", "max_token": 3}, "max_token", "max_token"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usge": True}},
     "stream_options.include_usge", "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_token": 3}, "max_token",
     "max_token"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "contnet": "y"}]},
     "messages[0].contnet", "messages"),
])
def test_unknown_fields_are_rejected_by_name(url, path, body, name, param):
    err = error_of(httpx.post(url + path, json={"model": "m", **body}))
    assert err["message"] == f"Unrecognized request argument supplied: {name}"
    assert err["param"] == param


def test_unknown_field_through_the_openai_client(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="m", prompt="hi", extra_body={"max_token": 3})
    assert "Unrecognized request argument supplied: max_token" in str(exc.value)


@pytest.mark.parametrize("message, needle", [
    ({"role": "wizard", "content": "x"}, "messages[0].role: unknown role 'wizard'; expected one of system, "
                                         "developer, user, assistant, tool"),
    ({"role": "user"}, "messages[0]: a 'user' message must have content"),
    ({"role": "system", "content": None}, "messages[0]: a 'system' message must have content"),
    ({"content": "x"}, "messages[0].role: Field required"),
])
def test_bad_chat_messages_are_400(url, message, needle):
    err = error_of(httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": [message]}))
    assert needle in err["message"]
    assert err["param"] == "messages"


def test_assistant_message_without_content_and_tool_message_are_valid(url):
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
                {"role": "user", "content": "and?"}]
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def _typed_dict_keys(td: type) -> set[str]:
    return set(typing.get_type_hints(td, include_extras=False))


def test_every_openai_client_parameter_is_declared():
    completion = _typed_dict_keys(completion_create_params.CompletionCreateParamsBase) | {"stream"}
    chat = _typed_dict_keys(chat_create_params.CompletionCreateParamsBase) | {"stream"}
    assert completion - set(CompletionRequest.model_fields) == set()
    assert chat - set(ChatCompletionRequest.model_fields) == set()
    from openai.types.chat import ChatCompletionStreamOptionsParam
    assert _typed_dict_keys(ChatCompletionStreamOptionsParam) - set(StreamOptions.model_fields) == set()
    from openai.types.chat import chat_completion_message_param as mp
    members = typing.get_args(mp.ChatCompletionMessageParam)
    assert len(members) >= 5  # the union really was enumerated
    for member in members:
        assert _typed_dict_keys(member) - set(ChatMessage.model_fields) == set(), member


def test_openai_client_bookkeeping_parameters_are_accepted(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2, user="u1",
        metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=False, safety_identifier="s",
        prompt_cache_key="p", modalities=["text"], stream_options=None, tool_choice="none")
    assert out.choices[0].finish_reason == "length"
    out = client.completions.create(model="m", prompt="hi", max_tokens=2, user="u1", best_of=1)
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, param", [
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
])
def test_declared_parameters_we_cannot_honour_are_400(url, extra, param):
    err = error_of(httpx.post(url + "/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "x"}], **extra}))
    assert err["param"] == param
    assert "not supported" in err["message"] or "only the 'text' modality" in err["message"]


# ------------------------------------------------------------------------------------------- max_tokens
def test_completion_default_max_tokens_is_16(url, tok):
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt_of_length(tok, 5)})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("body", [{}, {"max_tokens": None}])
def test_completion_default_max_tokens_is_clamped_to_the_context(url, tok, body):
    prompt = prompt_of_length(tok, MAX_LEN - 3)
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, **body})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == MAX_LEN - 3
    assert usage["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_completion_explicit_max_tokens_over_the_context_is_still_a_400(url, tok):
    prompt = prompt_of_length(tok, MAX_LEN - 3)
    err = error_of(httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 16}))
    assert (f"However, you requested {MAX_LEN + 13} tokens ({MAX_LEN - 3} in the prompt, 16 in the "
            "completion)") in err["message"]
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"


def test_chat_default_max_tokens_is_the_rest_of_the_context(url, tok, engine):
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user",
                                                                                     "content": "hi"}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == MAX_LEN - usage["prompt_tokens"]


# ------------------------------------------------------------------------------------------------ stream
def test_streamed_chat_deltas_omit_none_fields(url):
    with httpx.stream("POST", url + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert len(deltas) >= 3
    for d in deltas[1:]:
        assert "role" not in d, d
        assert None not in d.values(), d
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # choice-level nulls stay, as in OpenAI's chunks
    assert "finish_reason" in events[1]["choices"][0] and events[1]["choices"][0]["finish_reason"] is None
