"""Defects found by a fresh user of the HTTP API and the Python API (round 14b, session 13), each now fixed.

Oracles: vLLM's OpenAI server (``vllm/entrypoints/chat_utils.py`` joins a message's text parts with a newline;
``JsonSchemaResponseFormat.name`` is required, as in OpenAI's API) and the server's own error for a prompt over
``max_model_len`` tokens (``code: "context_length_exceeded"``, which clients test for). Runs on the tool tests'
byte-level scripted server, whose template renders ``[role] content`` lines.
"""

# ruff: noqa: F811 -- the fixtures `served` and `tok` imported below are the tests' parameters

from __future__ import annotations

import pytest

from tests.test_server_tools import chat, error_of, prompt_text, served, tok  # noqa: F401


def test_text_parts_are_joined_with_a_newline_as_vllm_joins_them(served, tok):
    url, engine = served
    parts = [{"type": "text", "text": "Recite"}, {"type": "text", "text": " the Zen"}]
    r = chat(url, messages=[{"role": "user", "content": parts}])
    assert prompt_text(engine, tok, r).startswith("[user] Recite\n the Zen")  # observed: "Recite the Zen"


def test_chat_prompt_too_long_before_tokenizing_has_the_context_length_code(served):
    url, _ = served
    err = error_of(chat(url, messages=[{"role": "user", "content": "hello " * 200_000}]))
    # observed: code null and another wording than a prompt over max_model_len tokens
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert err["message"].startswith("This model's maximum context length is exceeded")


def test_json_schema_without_a_name_is_400_as_in_openai_and_vllm(served):
    url, _ = served
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "boolean"}}}
    err = error_of(chat(url, messages=[{"role": "user", "content": "x"}], response_format=fmt))
    assert err["param"] == "response_format.json_schema.name" and "needs a 'name'" in err["message"]


def test_deprecated_functions_point_to_tools(served):
    url, _ = served
    err = error_of(chat(url, messages=[{"role": "user", "content": "x"}], functions=[{"name": "f"}]))
    assert err["param"] == "functions" and "send the functions as tools" in err["message"]


def test_empty_stop_string_is_named_as_sent():
    from atomtool.errors import InvalidRequestError
    from atomtool.serve.sampling_params import SamplingParams

    with pytest.raises(InvalidRequestError, match=r"non-empty string or a list of non-empty strings, got ''$"):
        SamplingParams(stop="").validate()  # observed: "got ['']"
