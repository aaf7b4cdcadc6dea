"""OpenAI tool calling on the input side of ``/v1/chat/completions``, as vLLM and SGLang serve it:

- the request's ``tools``, assistant messages' ``tool_calls`` and ``tool`` messages' ``tool_call_id`` reach
  the chat template in the format transformers documents for tool-use templates (``tools=`` JSON schemas,
  ``arguments`` as a dict); the oracle is the expected prompt written by hand from the template below, and
  transformers' own ``apply_chat_template`` on the documented format gives the same text;
- arguments that are not a JSON object reach the template as the client's string (``""`` as ``{}``);
- a tokenizer with named templates gets its ``tool_use`` one when tools are sent;
- every malformed tool input is a 400 with OpenAI's error body naming the field (never a 500, never
  dropped; a fuzz test feeds arbitrary JSON in their place), a tool result must answer an earlier call, and
  a forced ``tool_choice`` is refused (it needs guided decoding).

Runs on :class:`tests.test_server_support.ScriptedEngine` with a byte-level tokenizer, so the prompt the
engine received decodes back to exactly the rendered text.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from tests.test_server_support import ScriptedEngine, byte_level_tokenizer

NL = "{{ '\\n' }}"  # a newline from an expression: trim_blocks would eat a literal one after a tag
#: A tool-use chat template in the style of Qwen's/Hermes': tools listed first, each call rendered from the
#: arguments *dict* (``.items()`` fails on a string), tool results by ``tool_call_id``.
TOOL_TEMPLATE = (
    "{% if tools %}[tools]{% for t in tools %} {{ t.function.name }}{{ t.function.parameters | tojson }}"
    "{% endfor %}" + NL + "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}[assistant]{{ m.content }}"
    "{% for c in m.tool_calls %}[call {{ c.id }}] {{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}){% endfor %}" + NL +
    "{% elif m.role == 'tool' %}[result {{ m.tool_call_id }}] {{ m.content }}" + NL +
    "{% else %}[{{ m.role }}] {{ m.content }}" + NL + "{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
#: Renders each call's arguments with ``tojson``: shows exactly what the template was given.
ARGS_TEMPLATE = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }};"
                 "{% endfor %}{% endfor %}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object"}}}]
CONVO = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "-2C"}]},
]
#: TOOL_TEMPLATE applied to TOOLS and CONVO, by hand.
EXPECTED = ('[tools] get_weather{"type": "object"}\n'
            "[user] Weather in Paris and Oslo?\n"
            '[assistant][call call_1] get_weather(city="Paris")[call call_2] get_weather(city="Oslo", days=3)\n'
            "[result call_1] 18C\n"
            "[result call_2] -2C\n"
            "[assistant]")


def _engine(tok) -> ScriptedEngine:
    return ScriptedEngine(tok, tok.encode("ok", add_special_tokens=False), max_model_len=4096,
                          num_blocks=1 << 20)


@pytest.fixture(scope="module")
def tok():
    t = byte_level_tokenizer()
    t.chat_template = TOOL_TEMPLATE
    return t


@pytest.fixture(scope="module")
def served(tok):
    engine = _engine(tok)
    with ServerThread(create_app(engine, "m", trust_request_chat_template=True)) as url:  # request templates
        yield url, engine


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 1, **body})


def prompt_text(engine: ScriptedEngine, tok, response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return tok.decode(engine.prompts[response.json()["id"] + "-0"])


# ------------------------------------------------------------------------------------------ rendering
def test_tools_tool_calls_and_results_reach_the_template(served, tok):
    url, engine = served
    assert prompt_text(engine, tok, chat(url, messages=CONVO, tools=TOOLS)) == EXPECTED


def test_expected_prompt_is_what_transformers_renders_from_its_documented_format(tok):
    """The hand-written oracle agrees with transformers on the format its docs give (arguments as dicts)."""
    documented = [dict(m) for m in CONVO]
    documented[1] = {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}}]}
    documented[3] = {"role": "tool", "tool_call_id": "call_2", "content": "-2C"}
    assert tok.apply_chat_template(documented, tools=TOOLS, tokenize=False, add_generation_prompt=True) == EXPECTED


def test_through_the_openai_client(served, tok):
    url, engine = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model="m", messages=CONVO, tools=TOOLS, tool_choice="auto",
                                         parallel_tool_calls=True, max_tokens=1)
    assert tok.decode(engine.prompts[out.id + "-0"]) == EXPECTED
    assert out.choices[0].message.tool_calls is None  # no output-side parsing: the text is the answer
    assert out.choices[0].message.content == "o"


@pytest.mark.parametrize("tool_choice", ["none", "auto", None])
def test_unforced_tool_choice_is_served_with_the_tools_in_the_prompt(served, tok, tool_choice):
    url, engine = served
    assert prompt_text(engine, tok, chat(url, messages=CONVO, tools=TOOLS, tool_choice=tool_choice)) == EXPECTED


def test_without_tools_the_template_gets_none(served, tok):
    url, engine = served
    assert prompt_text(engine, tok, chat(url, messages=CONVO)) == EXPECTED.split("\n", 1)[1]
    assert prompt_text(engine, tok, chat(url, messages=CONVO, tools=[])) == EXPECTED.split("\n", 1)[1]


def test_arguments_that_are_not_a_json_object_reach_the_template_as_sent(served, tok):
    url, engine = served
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": a}}
             for i, a in enumerate(['{"a": 1}', "", "{bad", "[1, 2]", '"s"'])]
    r = chat(url, chat_template=ARGS_TEMPLATE, add_generation_prompt=False,
             messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls}])
    assert prompt_text(engine, tok, r) == '{"a": 1};{};"{bad";"[1, 2]";"\\"s\\"";'


def test_arguments_a_template_cannot_use_are_a_400_not_a_500(served):
    url, _ = served
    convo = [dict(m) for m in CONVO]
    convo[1] = {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{cut off"}}]}
    err = error_of(chat(url, messages=convo[:3]))
    assert err["message"].startswith("the chat template could not render these messages: ")


def test_named_templates_pick_tool_use_when_tools_are_sent():
    tok = byte_level_tokenizer()
    tok.chat_template = {"default": "{% for m in messages %}[plain] {{ m.content }}{% endfor %}",
                         "tool_use": TOOL_TEMPLATE}
    engine = _engine(tok)
    with ServerThread(create_app(engine, "m")) as url:
        assert prompt_text(engine, tok, chat(url, messages=CONVO, tools=TOOLS)) == EXPECTED
        plain = chat(url, messages=[{"role": "user", "content": "hi"}])
        assert prompt_text(engine, tok, plain) == "[plain] hi"


def test_server_chat_template_gets_the_tools_too():
    tok = byte_level_tokenizer()  # no template of its own: --chat-template supplies it
    engine = _engine(tok)
    with ServerThread(create_app(engine, "m", chat_template=TOOL_TEMPLATE)) as url:
        assert prompt_text(engine, tok, chat(url, messages=CONVO, tools=TOOLS)) == EXPECTED


# ----------------------------------------------------------------------------------------- bad input
def error_of(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return err


def _call(**function) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", **function}}


def _with_calls(calls) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}]


@pytest.mark.parametrize("messages, message", [
    (_with_calls([_call(arguments={"city": "Paris"})]),
     "messages[1].tool_calls[0].function.arguments: must be a string holding the arguments as JSON text "
     "(OpenAI's format, e.g. '{\"city\": \"Paris\"}'), got an object"),
    (_with_calls([_call(arguments=7)]), "messages[1].tool_calls[0].function.arguments: must be a string "),
    (_with_calls([_call(arguments=None)]), "function.arguments: must be a string holding the arguments as JSON "
                                           "text (OpenAI's format, e.g. '{\"city\": \"Paris\"}'), got null"),
    (_with_calls([{"id": "c1", "type": "function", "function": {"name": "f"}}]),
     "messages[1].tool_calls[0].function.arguments: Field required"),
    (_with_calls([{"type": "function", "function": {"name": "f", "arguments": "{}"}}]),
     "messages[1].tool_calls[0].id: Field required"),
    (_with_calls([{"id": "c1", "type": "function"}]), "messages[1].tool_calls[0].function: Field required"),
    (_with_calls([{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]),
     "messages[1].tool_calls[0].type: Field required"),
    (_with_calls([_call(name="")]), "messages[1].tool_calls[0].function.name: String should have at least 1"),
    (_with_calls([{"id": "c1", "type": "custom", "custom": {"name": "f", "input": "x"}}]),
     "messages[1].tool_calls[0].type: only 'function' tool calls are supported, got 'custom'"),
    (_with_calls([{**_call(), "extra": 1}]), "Unrecognized request argument supplied: messages[1].tool_calls[0].extra"),
    (_with_calls({"id": "c1"}), "messages[1].tool_calls: Input should be a valid list"),
    (_with_calls(["c1"]), "messages[1].tool_calls[0]: Input should be a valid dictionary"),
    ([{"role": "user", "content": "q", "tool_calls": [_call()]}],
     "messages[0]: only assistant messages may have tool_calls, not a 'user' message"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}],
     "messages[1]: a 'tool' message must have tool_call_id (the id of the tool call it answers)"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r", "tool_call_id": None}],
     "messages[1]: a 'tool' message must have tool_call_id"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r", "tool_call_id": 5}],
     "messages[1].tool_call_id: Input should be a valid string"),
    ([{"role": "user", "content": "q", "tool_call_id": "c1"}],
     "messages[0]: only 'tool' messages may have tool_call_id, not a 'user' message"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}][:1] + [
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}],
     "messages[1]: function_call in messages (deprecated by OpenAI) is not supported; send the call as tool_calls"),
])
def test_malformed_tool_messages_are_400(served, messages, message):
    err = error_of(chat(served[0], messages=messages))
    assert message in err["message"], err["message"]
    assert err["param"] == "messages"


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r", "tool_call_id": "c1"}],
     "messages[1]: a 'tool' message must answer a tool call of the assistant message just before it (or before "
     "the tool messages that follow that one); messages[0] has role 'user'"),
    (_with_calls([_call()])[:2] + [{"role": "tool", "content": "r", "tool_call_id": "c2"}],
     "messages[2]: tool_call_id 'c2' does not match the id of any tool call in the assistant message it follows "
     "(messages[1] has tool call ids 'c1')"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r", "tool_call_id": "c1"},
      {"role": "assistant", "tool_calls": [_call()]}], "messages[1]: a 'tool' message must answer a tool call"),
])
def test_tool_result_must_answer_an_earlier_call(served, messages, message):
    err = error_of(chat(served[0], messages=messages))
    assert err["message"] == message or err["message"].startswith(message), err["message"]
    assert err["param"] == "messages"


@pytest.mark.parametrize("tools, message", [
    ([{"type": "function"}], "tools[0].function: Field required"),
    ([{"function": {"name": "f"}}], "tools[0].type: Field required"),
    ([{"type": "custom", "custom": {"name": "f"}}], "tools[0].type: only 'function' tools are supported, got 'custom'"),
    ([{"type": "function", "function": {"description": "d"}}], "tools[0].function.name: Field required"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "tools[0].function.parameters: Input should be a valid dictionary"),
    ([{"type": "function", "function": {"name": "f", "paramters": {}}}],
     "Unrecognized request argument supplied: tools[0].function.paramters"),
    ({"type": "function", "function": {"name": "f"}}, "tools: Input should be a valid list"),
])
def test_malformed_tools_are_400(served, tools, message):
    err = error_of(chat(served[0], messages=[{"role": "user", "content": "q"}], tools=tools))
    assert message in err["message"], err["message"]
    assert err["param"] == "tools"


@pytest.mark.parametrize("tool_choice, message", [
    ({"type": "function", "function": {"name": "get_time"}},
     "tool_choice names function 'get_time', which is not in tools ('get_weather'"),
    ({"type": "function", "function": "get_weather"}, "tool_choice {'type': 'function'} needs 'function': {'name': NAME}"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}},
     "tool_choice of type 'allowed_tools' is not supported"),
    ("sometimes", "tool_choice: must be 'none', 'auto', 'required' or an object naming a tool, got 'sometimes'"),
    (3, "tool_choice: must be 'none', 'auto', 'required' or an object naming a tool, got a number"),
    (["auto"], "tool_choice: must be 'none', 'auto', 'required' or an object naming a tool, got an array"),
    ({}, "tool_choice: must be 'none', 'auto', 'required' or an object naming a tool, got an object without a "
         "'type' string"),
    ({"function": {"name": "get_weather"}}, "tool_choice: must be 'none', 'auto', 'required' or an object naming "
                                            "a tool, got an object without a 'type' string"),
])
def test_invalid_tool_choice_is_400(served, tool_choice, message):
    err = error_of(chat(served[0], messages=CONVO, tools=TOOLS, tool_choice=tool_choice))
    assert message in err["message"], err["message"]
    assert err["param"] == "tool_choice"


@pytest.mark.parametrize("key", ["tools", "add_generation_prompt", "chat_template"])
def test_chat_template_kwargs_may_not_repeat_the_requests_own_arguments(served, key):
    err = error_of(chat(served[0], messages=CONVO, chat_template_kwargs={key: TOOLS}))
    assert err["message"] == f"chat_template_kwargs may not set {key!r}: the server sets it (from the request's own fields)"
    assert err["param"] == "chat_template_kwargs"


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=2)
                     | st.dictionaries(st.sampled_from(["id", "type", "function", "name", "arguments"]), inner,
                                       max_size=3), max_leaves=6)
_function = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["f", ""]) | _json, "arguments": st.sampled_from(['{"a": 1}', "", "{bad", "[1]"]) | _json})
_tool_call = st.fixed_dictionaries({}, optional={
    "id": st.sampled_from(["c1", "c2"]) | _json, "type": st.sampled_from(["function", "custom"]) | _json,
    "function": _function | _json})


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(_tool_call, max_size=3) | _json, answer=st.sampled_from(["c1", "c2", None]) | _json,
       tools=st.none() | st.lists(st.fixed_dictionaries({"type": st.just("function")}, optional={
           "function": st.fixed_dictionaries({"name": st.just("f")}, optional={"parameters": _json})}), max_size=2))
def test_any_tool_input_is_answered_200_or_400_never_500(served, calls, answer, tools):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": calls},
                {"role": "tool", "tool_call_id": answer, "content": "r"}]
    r = chat(served[0], messages=messages, tools=tools, chat_template=ARGS_TEMPLATE, add_generation_prompt=False)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        error_of(r)


@pytest.mark.parametrize("field, body", [
    ("messages[1].tool_calls[0].function.arguments", {"messages": _with_calls([_call(arguments='{"a": "\ud800"}')])}),
    ("tools[0].function.description", {"messages": CONVO, "tools": [
        {"type": "function", "function": {"name": "f", "description": "x\ud800"}}]}),
])
def test_tool_text_that_is_not_unicode_is_400(served, field, body):
    raw = httpx.post(served[0] + "/v1/chat/completions", headers={"content-type": "application/json"},
                     content=json.dumps({"model": "m", "max_tokens": 1, **body}).encode())
    err = error_of(raw)
    assert err["message"].startswith(f"{field}: the text is not valid Unicode: lone surrogate \\ud800"), err
    assert err["param"] == field.split("[")[0]


# ---------------------------------------------------------------------- hostile or odd tool-call arguments
ARGS = "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("arguments", [
    "[" * 1000 + "]" * 1000,  # deeper than json.loads can go (RecursionError)
    '{"a": ' + "[" * 70 + "]" * 70 + "}",  # parses, but deeper than MAX_ARGUMENT_DEPTH
    "[" * 100 + "]" * 100,  # not an object (it would reach the template as text), still refused
    "[" * 100000,  # an unclosed 100k-deep prefix: still the nesting error, never a 500
])
def test_deeply_nested_arguments_are_400(served, arguments):
    from atomtool.serve.api.chat import MAX_ARGUMENT_DEPTH

    err = error_of(chat(served[0], messages=_with_calls([_call(arguments=arguments)])))
    assert err["message"] == f"{ARGS}: the JSON is nested too deeply (more than {MAX_ARGUMENT_DEPTH} levels)"
    assert err["param"] == ARGS


def test_arguments_nested_to_the_limit_reach_the_template(served, tok):
    from atomtool.serve.api.chat import MAX_ARGUMENT_DEPTH

    inner = MAX_ARGUMENT_DEPTH - 1  # the object itself is one level
    args = '{"a": ' + "[" * inner + "]" * inner + "}"
    r = chat(served[0], chat_template=ARGS_TEMPLATE, add_generation_prompt=False,
             messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [_call(arguments=args)]}])
    assert prompt_text(served[1], tok, r) == '{"a": ' + "[" * inner + "]" * inner + "};"


@pytest.mark.parametrize("arguments, char", [
    ('{"a": "\\ud800"}', "ud800"),  # a lone high surrogate escape in a value
    ('{"\\udc00": 1}', "udc00"),  # ... in a key
    ('{"a": [{"b": ["ok", "x\\udbff"]}]}', "udbff"),  # ... deep inside
])
def test_lone_surrogate_escapes_inside_arguments_are_400(served, arguments, char):
    """The JSON text itself is valid Unicode (the escape is six ASCII characters), but json.loads turns it
    into a lone surrogate that the tokenizer cannot encode: refused after decoding, naming the field."""
    r = chat(served[0], messages=_with_calls([_call(arguments=arguments)]), tools=TOOLS)
    err = error_of(r)
    assert err["message"] == (f"{ARGS}: the text is not valid Unicode: lone surrogate \\{char} (an unpaired \\u "
                              "escape in the JSON; send well-formed UTF-16 pairs)")
    assert err["param"] == ARGS


def test_a_surrogate_pair_escape_is_fine(served, tok):
    r = chat(served[0], chat_template=ARGS_TEMPLATE, add_generation_prompt=False,
             messages=[{"role": "user", "content": "x"},
                       {"role": "assistant", "tool_calls": [_call(arguments='{"e": "\\ud83d\\ude00"}')]}])
    assert json.loads(prompt_text(served[1], tok, r).rstrip(";")) == {"e": "\U0001F600"}


@pytest.mark.parametrize("arguments", ['{"x": NaN}', '{"x": Infinity}', '{"x": [-Infinity]}'])
def test_nan_and_infinity_are_not_json_so_the_template_gets_the_text(served, tok, arguments):
    """OpenAI's arguments are JSON text and NaN/Infinity are not JSON (Python's json.loads accepts them):
    like any other text that is not a JSON object, the model sees exactly what was written."""
    r = chat(served[0], chat_template=ARGS_TEMPLATE, add_generation_prompt=False,
             messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [_call(arguments=arguments)]}])
    assert prompt_text(served[1], tok, r) == json.dumps(arguments) + ";"


# --------------------------------------------------------------------------- tools a template ignores
def test_tools_a_template_ignores_are_logged_once(caplog):
    """The template below never reads ``tools``: the definitions are not in the prompt, which the server
    says in its log (once per template, not per request); a template that reads them gets no warning."""
    tok = byte_level_tokenizer()
    tok.chat_template = "{# ignores-tools-1 #}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    engine = _engine(tok)
    plain = [{"role": "user", "content": "hi"}]
    with ServerThread(create_app(engine, "m", trust_request_chat_template=True)) as url, \
            caplog.at_level("WARNING", logger="atomtool.serve"):
        assert prompt_text(engine, tok, chat(url, messages=plain, tools=TOOLS)) == "[user] hi"
        assert prompt_text(engine, tok, chat(url, messages=plain, tools=TOOLS)) == "[user] hi"
        prompt_text(engine, tok, chat(url, messages=plain))  # no tools: nothing to warn about
        prompt_text(engine, tok, chat(url, messages=CONVO, tools=TOOLS, chat_template=TOOL_TEMPLATE))
    warnings = [r.getMessage() for r in caplog.records if r.name == "atomtool.serve" and "tools" in r.getMessage()]
    assert warnings == ["a request sent tools, but the chat template does not reference `tools`, so the tool "
                        "definitions are not part of the prompt (the model never sees them); give a tool-aware "
                        "template (serve: --chat-template, or the request's chat_template with "
                        "--trust-request-chat-template; LLM.chat: chat_template=)"]


@pytest.mark.parametrize("template, reads", [
    (TOOL_TEMPLATE, True),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ("{% set t = tools or [] %}{{ t | length }}", True),
    ("{% macro f() %}{{ tools | tojson }}{% endmacro %}{{ f() }}", True),
    ("{{ 'tools' }}{# tools #}{% for m in messages %}{{ m.tools }}{% endfor %}", False),  # a string, a comment,
    ("{% for tools in messages %}{{ tools }}{% endfor %}", False),  # an attribute, a loop variable
])
def test_template_reads_tools_looks_at_the_variable_not_the_word(template, reads):
    from atomtool.serve.api.chat import template_reads_tools

    assert template_reads_tools(template) is reads


# --------------------------------------------------------------------------------- content parts, kwargs
@pytest.mark.parametrize("content, message", [
    ([{"type": "text"}], "messages[0].content[0]: a text part needs a 'text' string"),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": 5}],
     "messages[0].content[1]: a text part needs a 'text' string"),
    ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     "messages[0].content[0]: only text parts are supported, got a part of type 'image_url'"),
    ([{"text": "a"}], "messages[0].content[0]: only text parts are supported, got a part without a 'type' string"),
])
def test_content_parts_that_are_not_text_are_400_naming_the_part(served, content, message):
    err = error_of(chat(served[0], messages=[{"role": "user", "content": content}]))
    assert err["message"] == message
    assert err["param"] == message.split(":")[0]


@pytest.mark.parametrize("key", ["messages", "conversation", "conversations", "tokenize", "continue_final_message"])
def test_chat_template_kwargs_may_not_set_the_conversation(served, key):
    err = error_of(chat(served[0], messages=CONVO, chat_template_kwargs={key: [{"role": "user", "content": "x"}]}))
    assert err["message"] == f"chat_template_kwargs may not set {key!r}: the server sets it (from the request's own fields)"
    assert err["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("key", ["return_dict", "padding", "max_length", "tokenizer_kwargs", "self"])
def test_chat_template_kwargs_may_not_set_apply_chat_template_parameters(served, key):
    err = error_of(chat(served[0], messages=CONVO, chat_template_kwargs={key: True}))
    assert err["message"] == (f"chat_template_kwargs may not set {key!r}: it is a parameter of transformers' "
                              "apply_chat_template, not a template variable")
    assert err["param"] == "chat_template_kwargs"


def test_reserved_template_kwargs_cover_transformers_signatures():
    """Every parameter of apply_chat_template / render_jinja_template, except ``documents`` (a template
    variable) and the catch-all ``**kwargs``, is refused in chat_template_kwargs: a new transformers
    parameter would otherwise be swallowed, or collide with the server's own argument."""
    import inspect

    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    from atomtool.serve.api.chat import _OWN_TEMPLATE_ARGS, _RENDER_PARAMS

    names = set()
    for fn in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template):
        names |= {p.name for p in inspect.signature(fn).parameters.values() if p.kind != p.VAR_KEYWORD}
    assert names - {"documents"} <= set(_OWN_TEMPLATE_ARGS) | set(_RENDER_PARAMS)


def test_documents_pass_through_chat_template_kwargs(served, tok):
    r = chat(served[0], messages=[{"role": "user", "content": "x"}], chat_template_kwargs={
        "documents": [{"title": "t", "text": "d"}]}, chat_template="{{ documents[0].text }}")
    assert prompt_text(served[1], tok, r) == "d"


# ------------------------------------------------------------------------------------------- tool names
@pytest.mark.parametrize("tools, message", [
    ([{"type": "function", "function": {"name": "get weather"}}],
     "tools[0].function.name: must match ^[a-zA-Z0-9_-]{1,64}$ (letters, digits, underscores and dashes, at most "
     "64 characters), got 'get weather'"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "a" * 65}}],
     "tools[1].function.name: must match ^[a-zA-Z0-9_-]{1,64}$"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name: must match"),
    ([{"type": "function", "function": {"name": "ns.f"}}], "tools[0].function.name: must match"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}},
      {"type": "function", "function": {"name": "f", "description": "again"}}],
     "tools[2].function.name: 'f' is already the name of tools[0] (tool names must be unique)"),
])
def test_tool_names_must_be_openai_names_and_unique(served, tools, message):
    err = error_of(chat(served[0], messages=[{"role": "user", "content": "q"}], tools=tools))
    assert err["message"].startswith(message), err["message"]
    assert err["param"] == "tools"


def test_repeated_tool_call_ids_are_400(served):
    """Two calls with one id: a tool message answering it could not say which call it answers."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "r1"},
                {"role": "assistant", "tool_calls": [dict(call, function={"name": "g", "arguments": "{}"})]},
                {"role": "tool", "tool_call_id": "c1", "content": "r2"}]
    err = error_of(chat(served[0], messages=messages))
    assert err["message"] == ("messages[3].tool_calls[0].id: 'c1' is already the id of an earlier tool call "
                              "(tool call ids must be unique in a conversation)")
    assert err["param"] == "messages"
    same_message = [messages[0], {"role": "assistant", "tool_calls": [call, call]}]
    assert error_of(chat(served[0], messages=same_message))["message"].startswith("messages[1].tool_calls[1].id")


def test_longest_tool_name_is_served_and_tool_choice_needs_tools(served, tok):
    """A 64-character tool name is served; tool_choice without tools is a 400 (OpenAI, vLLM), except "none"."""
    name = "A-z_09" + "x" * 58
    r = chat(served[0], messages=[{"role": "user", "content": "q"}],
             tools=[{"type": "function", "function": {"name": name, "parameters": {}}}])
    assert prompt_text(served[1], tok, r).startswith(f"[tools] {name}{{}}\n")
    err = error_of(chat(served[0], messages=[{"role": "user", "content": "q"}], tool_choice="auto"))
    assert err["param"] == "tool_choice" and "only allowed when tools are specified" in err["message"]
    r = chat(served[0], messages=[{"role": "user", "content": "q"}], tool_choice="none")
    assert prompt_text(served[1], tok, r) == "[user] q\n[assistant]"


def test_tools_warning_bookkeeping_is_bounded(monkeypatch, caplog):
    """Once per template (kept as a digest), and at most _MAX_TOOL_CHECKS templates ever looked at: a client
    sending many request-level templates can neither grow the server's memory nor flood its log."""
    from atomtool.serve.api import chat as chat_module

    monkeypatch.setattr(chat_module, "_TOOL_CHECKS", {})
    monkeypatch.setattr(chat_module, "_MAX_TOOL_CHECKS", 2)
    tok = byte_level_tokenizer()
    with caplog.at_level("WARNING", logger="atomtool.serve"):
        for template in ["{{ 1 }}", "{{ 1 }}", "{{ tools }}", "{{ 2 }}", "{{ 3 }}"]:
            chat_module.warn_if_tools_unused(tok, template, TOOLS)
    assert len([r for r in caplog.records if "does not reference `tools`" in r.getMessage()]) == 1
    assert len(chat_module._TOOL_CHECKS) == 2 and all(len(k) == 64 for k in chat_module._TOOL_CHECKS)
