"""Forced tool calls (chat ``tool_choice`` ``"required"`` or a named function), served by structured outputs.

Oracles: OpenAI's chat API (a named choice returns one call of that function, finish_reason "stop"; "required"
returns at least one call, finish_reason "tool_calls"; streamed calls arrive as ``tool_calls`` deltas: the
first of a call carries ``index``, ``id``, ``type`` and ``function.name``, later ones ``function.arguments``
pieces), each tool's own JSON Schema checked by hand on the arguments, the non-streamed response for the
streamed one (greedy: same calls), and the server's own history check (the calls sent back with their results
are accepted). The demo model (it recites the Zen of Python) never writes a call by itself: the calls below
exist only because the constraint forces them.
"""

from __future__ import annotations

import json

import pytest

from atomtool.serve.demo import DEMO_CHAT_MESSAGE
from tests.test_server_support import demo_model_client

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any object
]
MESSAGES = [{"role": "user", "content": DEMO_CHAT_MESSAGE}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_arguments(name: str, arguments: str) -> None:
    """The call's arguments against its tool's schema, by hand."""
    args = json.loads(arguments)
    assert isinstance(args, dict)
    if name == "get_weather":
        assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 12
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    elif name == "get_time":
        assert args in ({"tz": "UTC"}, {"tz": "CET"})
    else:
        assert name == "ping" and args == {}


@pytest.fixture(scope="module")
def client():
    with demo_model_client(device="cpu", dtype="float32", kv_cache_memory=1 << 22, max_model_len=512) as c:
        yield c


def create(client, **kw):
    return client.chat.completions.create(**({"model": "m", "messages": MESSAGES, "tools": TOOLS,
                                              "max_tokens": 200, "temperature": 0} | kw))


def streamed(client, **kw) -> tuple[list[dict], str | None, str]:
    """The stream's calls joined by index (id, name, arguments), finish_reason, and content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in create(client, stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name  # a call's first delta
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def test_named_function(client):
    choice = create(client, tool_choice=NAMED).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_arguments("get_weather", call.function.arguments)
    calls, finish, content = streamed(client, tool_choice=NAMED)
    assert finish == "stop" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_named_function_without_parameters_gets_the_empty_object(client):
    choice = create(client, tool_choice={"type": "function", "function": {"name": "ping"}}).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "ping" and json.loads(call.function.arguments) == {}


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_required(client, temperature):
    choice = create(client, tool_choice="required", temperature=temperature, seed=4).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) >= 1 and len({c.id for c in calls}) == len(calls)
    for c in calls:
        assert c.function.name in ("get_weather", "get_time", "ping")
        check_arguments(c.function.name, c.function.arguments)
    if temperature == 0:
        s_calls, finish, content = streamed(client, tool_choice="required")
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in s_calls] == [(c.function.name, c.function.arguments)
                                                                   for c in calls]


def test_required_without_parallel_calls_makes_one(client):
    for seed in range(3):
        choice = create(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                        seed=seed).choices[0]
        assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"


def test_cut_by_max_tokens(client):
    choice = create(client, tool_choice="required", max_tokens=4).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("[")
    calls, finish, content = streamed(client, tool_choice="required", max_tokens=4)
    assert (calls, finish, content) == ([], "length", choice.message.content)
    named = create(client, tool_choice=NAMED, max_tokens=3).choices[0]  # the incomplete arguments, as vLLM
    assert named.finish_reason == "length" and named.message.tool_calls[0].function.arguments.startswith("{")


def test_calls_and_results_go_back_into_the_conversation(client):
    calls = create(client, tool_choice="required", n=2, temperature=1.0, seed=1).choices[1].message.tool_calls
    history = MESSAGES + [{"role": "assistant", "content": None,
                           "tool_calls": [c.model_dump(exclude_none=True) for c in calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in calls]
    out = create(client, messages=history, max_tokens=5)
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kw, param, message", [
    (dict(tool_choice=NAMED, response_format={"type": "json_object"}), "response_format",
     "forces a tool call (its arguments are the output's constraint); it cannot be combined with response_format"),
    (dict(tool_choice="required", extra_body={"guided_regex": "a"}), "guided_regex", "cannot be combined"),
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "tool_choice names function 'nope', which is not in tools ('get_weather', 'get_time', 'ping')"),
])
def test_bad_forced_choice_is_a_400(client, kw, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kw)
    assert message in info.value.message and info.value.body["param"] == param
