"""Request-validation gaps a fresh-user tester found in ``/v1/chat/completions`` (and the body layer every
route shares), each fed its bad input and checked for status and message, next to the good request beside it:

1. an object *key* holding a lone UTF-16 surrogate is "invalid JSON body: ..." naming the object (it was
   "the request body must be a JSON object", or pydantic's "unable to parse raw data");
2. a compressed body (``Content-Encoding`` other than ``identity``) is a 415 naming the coding, with
   ``Accept-Encoding: identity`` (the body was read as if uncompressed);
3. tool calls in history follow OpenAI's rules: a call's function name matches ``^[a-zA-Z0-9_-]{1,64}$``,
   every call is answered by the tool messages right after it, and a tool message answers a call of the
   assistant message it follows (messages quoted from OpenAI's API errors in the code's docs);
4. audio (an assistant message's ``audio``, ``input_audio`` parts, the ``audio``/``modalities`` parameters)
   is refused naming the field; an assistant's ``refusal`` reaches the template as what it said.

Runs on the tool-calling server of tests/test_server_tools.py (scripted engine, byte-level tokenizer, its
hand-readable TOOL_TEMPLATE: ``[role] content`` per message), so the prompt the engine got decodes back to
the rendered text; the expected prompts are written by hand from that template.
"""

# ruff: noqa: F811 -- the fixtures `served` and `tok` imported below are the tests' parameters

from __future__ import annotations

import gzip
import json
import zlib

import httpx
import pytest

from tests.test_server_robustness import http_count
from tests.test_server_tools import CONVO, TOOLS, _call, chat, error_of, prompt_text, served, tok  # noqa: F401

USER = [{"role": "user", "content": "q"}]
GOOD = {"model": "m", "max_tokens": 1, "messages": USER}


def post_raw(url: str, raw: bytes, path: str = "/v1/chat/completions", **headers: str) -> httpx.Response:
    return httpx.post(url + path, content=raw, headers={"content-type": "application/json", **headers})


def body_with(fragment: str) -> bytes:
    """GOOD as JSON text with ``fragment`` (raw JSON text: escapes stay as written) added at the top level."""
    return (json.dumps(GOOD)[:-1] + ", " + fragment + "}").encode()


# ------------------------------------------------------------------------------ 1. surrogates in keys
SURROGATE_HINT = "(an unpaired \\u escape; send well-formed UTF-16 pairs)"


@pytest.mark.parametrize("fragment, message, param", [
    ('"\\ud800": 1', "the top-level key '\\ud800' is not valid Unicode: lone surrogate \\ud800 at character 0",
     None),
    ('"metadata": {"ok": "v", "x\\udc00": "v"}',
     "metadata: the object key 'x\\udc00' is not valid Unicode: lone surrogate \\udc00 at character 1", "metadata"),
    ('"chat_template_kwargs": {"a": [{"\\udbff": 1}]}',
     "chat_template_kwargs.a[0]: the object key '\\udbff' is not valid Unicode: lone surrogate \\udbff at "
     "character 0", "chat_template_kwargs"),
])
def test_lone_surrogate_in_a_key_is_invalid_json_naming_the_object(served, fragment, message, param):
    err = error_of(post_raw(served[0], body_with(fragment)))
    assert err["message"] == f"invalid JSON body: {message} {SURROGATE_HINT}"
    assert err["param"] == param


def test_lone_surrogate_key_inside_a_message(served):
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "q", "\\ud800x": 1}]}'
    err = error_of(post_raw(served[0], raw))
    assert err["message"] == ("invalid JSON body: messages[0]: the object key '\\ud800x' is not valid Unicode: lone "
                              f"surrogate \\ud800 at character 0 {SURROGATE_HINT}")
    assert err["param"] == "messages"


@pytest.mark.parametrize("encode", [
    lambda text: text.encode("utf-8", "surrogatepass"),  # the surrogate's 3 UTF-8 bytes (invalid UTF-8)
    lambda text: text.encode("utf-16-le", "surrogatepass"),  # UTF-16 JSON carries it without an escape
], ids=["utf8-bytes", "utf16"])
def test_lone_surrogate_key_without_an_escape(served, encode):
    text = json.dumps(GOOD)[:-1] + ', "metadata": {"\ud800": "v"}}'  # a real lone surrogate, not "\\ud800"
    err = error_of(post_raw(served[0], encode(text)))
    assert err["message"].startswith("invalid JSON body: metadata: the object key '\\ud800' is not valid Unicode")


def test_surrogate_pairs_in_keys_and_lone_ones_in_values_are_unchanged(served):
    ok = post_raw(served[0], body_with('"metadata": {"e\\ud83d\\ude00": "v", "\U0001F600": "w"}'))
    assert ok.status_code == 200, ok.text
    err = error_of(post_raw(served[0], body_with('"metadata": {"k": "\\ud800"}')))  # a value: the field's 400
    assert err["message"].startswith("metadata.k: the text is not valid Unicode: lone surrogate \\ud800")


def test_check_keys_needs_no_recursion():
    from atomtool.serve.api.strict_json import BodyNotJSON, check_keys

    deep: dict = {"\udfff": 1}
    for _ in range(20_000):
        deep = {"a": deep}
    with pytest.raises(BodyNotJSON, match="the object key '\\\\udfff' is not valid Unicode") as info:
        check_keys({"k": deep})
    assert info.value.param == "k"


# ----------------------------------------------------------------------------------- 2. Content-Encoding
@pytest.mark.parametrize("coding, body, named", [
    ("gzip", gzip.compress(json.dumps(GOOD).encode()), "'gzip'"),
    ("gzip", json.dumps(GOOD).encode(), "'gzip'"),  # not even compressed: still refused, never parsed
    ("deflate", zlib.compress(json.dumps(GOOD).encode()), "'deflate'"),
    ("br", b"\x0b\x02\x80{}\x03", "'br'"),
    ("GZip", b"x", "'gzip'"),
    ("identity, gzip", b"x", "'gzip'"),
    ("x-custom, zstd", b"x", "'x-custom', 'zstd'"),
])
def test_compressed_body_is_415_naming_the_coding(served, coding, body, named):
    url = served[0]
    before = http_count(url, "/v1/chat/completions", 415)
    r = post_raw(url, body, **{"content-encoding": coding})
    assert r.status_code == 415, r.text
    assert r.headers["accept-encoding"] == "identity"  # RFC 7694: what the server does accept
    err = r.json()["error"]
    assert err == {"message": f"Content-Encoding {named} is not supported: send the request body uncompressed "
                              "(no Content-Encoding header, or 'identity')",
                   "type": "invalid_request_error", "param": None, "code": "unsupported_content_encoding"}
    assert http_count(url, "/v1/chat/completions", 415) == before + 1


def test_compressed_completions_body_is_415_too(served):
    raw = gzip.compress(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode())
    r = post_raw(served[0], raw, "/v1/completions", **{"content-encoding": "gzip"})
    assert r.status_code == 415 and "Content-Encoding 'gzip' is not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("coding", ["identity", "Identity", "identity,  identity", ""])
def test_identity_or_empty_content_encoding_is_served(served, coding):
    r = post_raw(served[0], json.dumps(GOOD).encode(), **{"content-encoding": coding})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------- 3. tool calls
NAME_RULE = "must match ^[a-zA-Z0-9_-]{1,64}$ (letters, digits, underscores and dashes, at most 64 characters)"


def _answered(*calls: dict) -> list[dict]:
    """user, an assistant message with ``calls``, a tool message answering each."""
    return [*USER, {"role": "assistant", "tool_calls": list(calls)},
            *({"role": "tool", "tool_call_id": c["id"], "content": "r"} for c in calls)]


@pytest.mark.parametrize("name", ["get weather", "a" * 65, "f.g", "naïve", "f(x)"])
def test_tool_call_with_an_invalid_function_name_is_400(served, name):
    err = error_of(chat(served[0], messages=_answered(_call(name=name))))
    assert err["message"] == f"messages[1].tool_calls[0].function.name: {NAME_RULE}, got {name!r}"
    assert err["param"] == "messages"


@pytest.mark.parametrize("name", ["a" * 64, "get_weather-2", "F"])
def test_tool_call_with_a_valid_function_name_is_served(served, name):
    r = chat(served[0], messages=_answered(_call(name=name)))
    assert r.status_code == 200, r.text


def _c(cid: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _tool(cid: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": "r"}


UNANSWERED = ("an assistant message with tool_calls must be followed by tool messages answering each of its calls "
              "(tool_call_id = the call's id) before ")


@pytest.mark.parametrize("messages, message", [
    ([*USER, {"role": "assistant", "tool_calls": [_c("c1")]}, *USER],
     f"messages[1]: {UNANSWERED}another message (messages[2] has role 'user'); no tool message answers 'c1' "
     "(messages[1].tool_calls[0])"),
    ([*USER, {"role": "assistant", "tool_calls": [_c("c1"), _c("c2"), _c("c3")]}, _tool("c2"),
      {"role": "assistant", "content": "done"}],
     f"messages[1]: {UNANSWERED}another message (messages[3] has role 'assistant'); no tool message answers "
     "'c1' (messages[1].tool_calls[0]), 'c3' (messages[1].tool_calls[2])"),
    ([*USER, {"role": "assistant", "tool_calls": [_c("c1")]}],
     f"messages[1]: {UNANSWERED}the end of the conversation (or send add_generation_prompt false to render the "
     "assistant's turn as it is); no tool message answers 'c1' (messages[1].tool_calls[0])"),
    ([*USER, {"role": "assistant", "tool_calls": [_c("c1")]}, {"role": "assistant", "tool_calls": [_c("c2")]},
      _tool("c2")],
     f"messages[1]: {UNANSWERED}another message (messages[2] has role 'assistant'); no tool message answers "
     "'c1'"),
    # a result for an older call: OpenAI's "must be a response to a preceding message with 'tool_calls'"
    ([*_answered(_c("c1")), *USER, _tool("c1")],
     "messages[4]: a 'tool' message must answer a tool call of the assistant message just before it (or before "
     "the tool messages that follow that one); messages[3] has role 'user'"),
    ([_tool("c1"), *USER], "messages[0]: a 'tool' message must answer a tool call of the assistant message just "
                           "before it (or before the tool messages that follow that one); it is the first message"),
    ([*_answered(_c("c1")), {"role": "assistant", "tool_calls": [_c("c2")]}, _tool("c1")],
     "messages[4]: tool_call_id 'c1' does not match the id of any tool call in the assistant message it follows "
     "(messages[3] has tool call ids 'c2')"),
])
def test_tool_calls_and_results_must_pair_up_as_openai_requires(served, messages, message):
    err = error_of(chat(served[0], messages=messages))
    if message.endswith("'c1'"):
        assert err["message"].startswith(message), err["message"]
    else:
        assert err["message"] == message
    assert err["param"] == "messages"


def test_results_in_any_order_and_empty_tool_calls_are_served(served, tok):
    url, engine = served
    reordered = [*CONVO[:2], CONVO[3], CONVO[2]]
    assert prompt_text(engine, tok, chat(url, messages=reordered, tools=TOOLS)).endswith(
        "[result call_2] -2C\n[result call_1] 18C\n[assistant]")
    r = chat(url, messages=[*USER, {"role": "assistant", "content": "no call", "tool_calls": []}, *USER])
    assert prompt_text(engine, tok, r) == "[user] q\n[assistant] no call\n[user] q\n[assistant]"


def test_unanswered_calls_may_end_a_turn_rendered_as_it_is(served, tok):
    """vLLM's extension: with no generation prompt the last assistant turn is rendered (or continued) as it
    is, so its calls need no results yet; OpenAI has no such request."""
    messages = [*USER, {"role": "assistant", "tool_calls": [_c("c1")]}]
    r = chat(served[0], messages=messages, add_generation_prompt=False)
    assert prompt_text(served[1], tok, r) == "[user] q\n[assistant][call c1] f()\n"
    r = chat(served[0], messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert r.status_code == 200, r.text


# -------------------------------------------------------------------------------------- 4. audio, refusal
@pytest.mark.parametrize("audio", [{"id": "audio_abc"}, "audio_abc", {}])
def test_assistant_audio_is_400_naming_the_field(served, audio):
    messages = [*USER, {"role": "assistant", "content": "hello", "audio": audio}, *USER]
    err = error_of(chat(served[0], messages=messages))
    assert err["message"] == ("messages[1].audio: audio is not supported: this server serves text only (send what "
                              "the assistant said as content, e.g. the audio's transcript)")
    assert err["param"] == "messages"
    r = chat(served[0], messages=[*USER, {"role": "assistant", "content": "hello", "audio": None}, *USER])
    assert r.status_code == 200, r.text  # null is no audio


def test_audio_input_part_is_400_naming_the_part(served):
    part = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    err = error_of(chat(served[0], messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]))
    assert err["message"] == "messages[0].content[1]: only text parts are supported, got a part of type 'input_audio'"
    assert err["param"] == "messages[0].content[1]"


@pytest.mark.parametrize("extra, param, message", [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio",
     "audio output is not supported by this server (it serves text only)"),
    ({"modalities": ["text", "audio"]}, "modalities",
     "only the 'text' modality is supported (this server serves text only), got 'audio'"),
    ({"modalities": ["audio"]}, "modalities",
     "only the 'text' modality is supported (this server serves text only), got 'audio'"),
])
def test_audio_output_parameters_are_400_naming_them(served, extra, param, message):
    err = error_of(chat(served[0], messages=USER, **extra))
    assert (err["message"], err["param"]) == (message, param)
    assert chat(served[0], messages=USER, modalities=["text"]).status_code == 200


REFUSED = "I can't help with that."


@pytest.mark.parametrize("assistant, said", [
    ({"content": None, "refusal": REFUSED}, REFUSED),  # what OpenAI returns for a refusal
    ({"refusal": REFUSED}, REFUSED),
    ({"content": "", "refusal": REFUSED}, REFUSED),
    ({"content": "Sure.", "refusal": REFUSED}, "Sure."),  # content of its own wins (OpenAI never sends both)
    ({"content": [{"type": "refusal", "refusal": "No."}]}, "No."),  # a refusal part (assistant messages only)
    # parts joined by a newline, as vLLM joins them
    ({"content": [{"type": "text", "text": "Well,"}, {"type": "refusal", "refusal": "no."}]}, "Well,\nno."),
])
def test_assistant_refusal_reaches_the_template_as_what_it_said(served, tok, assistant, said):
    messages = [*USER, {"role": "assistant", **assistant}, {"role": "user", "content": "why?"}]
    r = chat(served[0], messages=messages)
    assert prompt_text(served[1], tok, r) == f"[user] q\n[assistant] {said}\n[user] why?\n[assistant]"


@pytest.mark.parametrize("messages, param, message", [
    ([{"role": "user", "content": "q", "refusal": "no"}], "messages",
     "messages[0]: only assistant messages may have refusal, not a 'user' message"),
    ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}], "messages[0].content[0]",
     "messages[0].content[0]: only text parts are supported, got a part of type 'refusal'"),
    ([*USER, {"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}], "messages[1].content[0]",
     "messages[1].content[0]: a refusal part needs a 'refusal' string"),
    ([*USER, {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[1].content[0]",
     "messages[1].content[0]: only text and refusal parts are supported, got a part of type 'image_url'"),
])
def test_misplaced_refusals_are_400(served, messages, param, message):
    err = error_of(chat(served[0], messages=messages))
    assert (err["message"], err["param"]) == (message, param)
