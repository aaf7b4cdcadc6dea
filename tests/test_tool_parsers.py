"""Tool-call parsers (``atomtool serve --tool-call-parser``): the model's tool-call markup as OpenAI's
``message.tool_calls`` and streaming tool-call deltas.

Oracles: model outputs written by hand in each format as its chat template renders calls (Qwen3's for
``hermes``, GLM-4.6's for ``glm45``, DeepSeek-V3.1's, DeepSeek-V3.2's DSML) with the expected calls written
beside them; streaming is checked against the non-streaming result for every split point, one-character
pieces and random small pieces; server answers are read back by the ``openai`` client (its own stream
accumulator assembles the streamed calls).
"""

from __future__ import annotations

import json
import random

import openai
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from typer.testing import CliRunner

from atomtool.errors import ConfigError
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.test_server_support import ScriptedEngine, byte_level_tokenizer

TC = "<tool_call>"
ETC = "</tool_call>"


def hermes_call(name: str, arguments) -> str:
    """One call as Qwen3's template writes it: the tags on their own lines around the JSON object."""
    return f"{TC}\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + f"\n{ETC}"


def glm_call(name: str, pairs: list[tuple[str, str]], *, newline: bool = True) -> str:
    """One call as GLM-4.6's template writes it (``newline`` False: GLM-4.7's name-then-first-key form)."""
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    return f"{TC}{name}" + ("\n" if newline else "") + body + ETC


V31_BEGIN, V31_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def v31_call(name: str, arguments: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>"


D = "｜DSML｜"


def dsml_invoke(name: str, params: list[tuple[str, bool, str]]) -> str:
    ps = "\n".join(f'<{D}parameter name="{k}" string="{"true" if s else "false"}">{v}</{D}parameter>'
                   for k, s, v in params)
    return f'<{D}invoke name="{name}">\n{ps}\n</{D}invoke>'


def dsml_block(*invokes: str) -> str:
    return f"\n\n<{D}function_calls>\n" + "\n".join(invokes) + f"\n</{D}function_calls>"


NESTED = {"query": 'say "hi" {not a brace} \\ end', "filter": {"tags": ["a", "}", "{"], "deep": {"x": [1, {"y": None}]}},
          "ok": True, "n": -1.5e3}

#: (parser, model output, expected content, expected calls as (name, arguments object))
CASES = [
    ("hermes", hermes_call("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("hermes", "Let me check both.\n" + hermes_call("get_weather", {"city": "Paris"}) + "\n"
     + hermes_call("get_time", {"tz": "Europe/Oslo", "days": 3}),
     "Let me check both.\n\n", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Oslo", "days": 3})]),
    ("hermes", "Before. " + hermes_call("f", {}) + " After.", "Before.  After.", [("f", {})]),
    ("hermes", hermes_call("search", NESTED), None, [("search", NESTED)]),
    ("hermes", "Météo 🌧: " + hermes_call("meteo", {"ville": "Zürich", "note": "雨 ☔"}), "Météo 🌧: ",
     [("meteo", {"ville": "Zürich", "note": "雨 ☔"})]),
    # the end tag never came (a stop string or EOS cut it) but the JSON is complete: vLLM takes it too
    ("hermes", f'{TC}\n{{"name": "f", "arguments": {{"a": 1}}}}\n', None, [("f", {"a": 1})]),
    # arguments sent as a JSON string holding an object
    ("hermes", f'{TC}{{"name": "f", "arguments": "{{\\"a\\": [1, 2]}}"}}{ETC}', None, [("f", {"a": [1, 2]})]),
    # plain text, a lookalike tag, a lone "<"
    ("hermes", "a < b and <tool_cal> is not a tag <", "a < b and <tool_cal> is not a tag <", []),
    ("hermes", "", "", []),
    ("glm45", glm_call("get_weather", [("city", "Beijing"), ("date", "2024-06-27")]), None,
     [("get_weather", {"city": "Beijing", "date": "2024-06-27"})]),
    ("glm45", "I'll look.\n" + glm_call("f", [("n", "3"), ("xs", '[1, "two", {"k": null}]'), ("o", '{"a": "}"}'),
                                              ("flag", "true"), ("text", "hello world")]),
     "I'll look.\n", [("f", {"n": 3, "xs": [1, "two", {"k": None}], "o": {"a": "}"}, "flag": True,
                             "text": "hello world"})]),
    ("glm47", glm_call("f", [("a", "x"), ("b", "2")], newline=False) + glm_call("g", [], newline=False), None,
     [("f", {"a": "x", "b": 2}), ("g", {})]),
    ("glm45", "天气：" + glm_call("tianqi", [("城市", "北京")]), "天气：", [("tianqi", {"城市": "北京"})]),
    ("deepseek_v31", "Checking." + V31_BEGIN + v31_call("get_weather", '{"city": "Paris"}')
     + v31_call("get_time", json.dumps(NESTED)) + V31_END, "Checking.",
     [("get_weather", {"city": "Paris"}), ("get_time", NESTED)]),
    ("deepseek_v32", "Sure." + dsml_block(
        dsml_invoke("get_weather", [("location", True, "杭州"), ("days", False, "3")]),
        dsml_invoke("search", [("q", True, 'a "quoted" {x}'), ("opts", False, '{"k": [1, 2]}')])),
     "Sure.\n\n", [("get_weather", {"location": "杭州", "days": 3}), ("search", {"q": 'a "quoted" {x}', "opts": {"k": [1, 2]}})]),
]

#: Malformed calls: the whole text comes back as content and no call is made (vLLM's answer to invalid JSON).
MALFORMED = [
    ("hermes", f'{TC}\n{{"name": "f", "arguments": {{"a": 1}}\n{ETC}'),  # a brace missing
    ("hermes", f'{TC}\n{{"arguments": {{}}}}\n{ETC}'),  # no name
    ("hermes", f'{TC}\n{{"name": "f", "arguments": [1]}}\n{ETC}'),  # arguments not an object
    ("hermes", f'{TC}\n{{"name": "f", "arguments": {{"a": NaN}}}}\n{ETC}'),  # not JSON
    ("hermes", f'Cut off: {TC}\n{{"name": "f", "argu'),  # the text ended inside the call
    ("glm45", f"{TC}f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\nstray text\n{ETC}"),
    ("glm45", f"{TC}\n<arg_key>a</arg_key><arg_value>1</arg_value>{ETC}"),  # no name
    ("glm45", f"{TC}f\n<arg_key>a</arg_key>\n<arg_val"),
    ("deepseek_v31", V31_BEGIN + v31_call("f", '{"a": 1') + V31_END),
    # names no tool can have (OpenAI's ^[a-zA-Z0-9_-]{1,64}$): the answer could not be sent back in history
    ("hermes", "Météo 🌧: " + hermes_call("météo", {"ville": "Zürich"})),
    ("glm45", "天气：" + glm_call("天气", [("城市", "北京")])),
    ("deepseek_v31", V31_BEGIN + v31_call("f", "{}") + v31_call("web.search", "{}") + V31_END),
    ("deepseek_v32", dsml_block(dsml_invoke("get weather", [("q", True, "x")]))),
    ("deepseek_v32", f"<{D}function_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"a\">1</{D}parameter>\n"
                     f"</{D}invoke>\n</{D}function_calls>"),  # no string attribute
]


def calls_of(extracted) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name, text, content, calls):
    got = get_tool_parser(name).extract(text)
    assert got.content == content
    assert calls_of(got) == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got.tool_calls)
    assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_calls_are_content(name, text):
    got = get_tool_parser(name).extract(text)
    assert got.content == text
    assert got.tool_calls == []


def test_a_malformed_call_beside_good_ones_is_content_and_the_good_ones_are_calls():
    bad = f'{TC}\n{{"name": "f", "arguments": {{\n{ETC}'
    got = get_tool_parser("hermes").extract(hermes_call("a", {"x": 1}) + bad + hermes_call("b", {}))
    assert calls_of(got) == [("a", {"x": 1}), ("b", {})]
    assert got.content == bad


def test_glm_string_parameters_of_the_tool_schema_stay_text():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}}}}}]
    text = glm_call("f", [("code", " 123 "), ("n", "123"), ("other", "[1]")])
    assert calls_of(get_tool_parser("glm45").extract(text, tools)) == [("f", {"code": " 123 ", "n": 123, "other": [1]})]
    assert calls_of(get_tool_parser("glm45").extract(text)) == [("f", {"code": 123, "n": 123, "other": [1]})]


def test_arguments_text_is_json_with_unicode_kept():
    got = get_tool_parser("hermes").extract(hermes_call("f", {"v": "é 😀"}))
    assert got.tool_calls[0].arguments == '{"v": "é 😀"}'
    assert got.tool_calls[0].openai() == {"id": got.tool_calls[0].id, "type": "function",
                                          "function": {"name": "f", "arguments": '{"v": "é 😀"}'}}


# ------------------------------------------------------------------------------------------ streaming
def run_stream(name: str, pieces: list[str], tools=None):
    """Feed ``pieces``; return (content pieces, tool-call deltas in order, calls assembled from the deltas)."""
    s = get_tool_parser(name).stream(tools)
    contents, deltas = [], []
    for piece in pieces:
        d = s.feed(piece)
        contents.append(d.content)
        deltas += d.tool_calls
    d = s.finish()
    contents.append(d.content)
    deltas += d.tool_calls
    calls: dict[int, dict] = {}
    for delta in deltas:
        i = delta["index"]
        if i not in calls:  # a call's first delta: index, id, type, name (OpenAI's streaming shape)
            assert set(delta) == {"index", "id", "type", "function"} and delta["type"] == "function"
            assert delta["function"]["name"] and i == len(calls)
            calls[i] = {"id": delta["id"], "name": delta["function"]["name"], "arguments": ""}
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
        calls[i]["arguments"] += delta["function"].get("arguments", "")
    return [c for c in contents if c], deltas, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


def splits(text: str):
    yield [text]
    yield list(text)  # one character at a time
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for seed in range(5):
        rng, pieces, pos = random.Random(seed), [], 0
        while pos < len(text):
            n = rng.randint(1, 4)
            pieces.append(text[pos:pos + n])
            pos += n
        yield pieces


@pytest.mark.parametrize("name, text", [(n, t) for n, t, _, _ in CASES] + MALFORMED)
def test_stream_gives_the_non_streaming_result_for_every_split(name, text):
    want = get_tool_parser(name).extract(text)
    want_content = want.content or ""
    for pieces in splits(text):
        contents, _, calls = run_stream(name, pieces)
        assert "".join(contents) == want_content, pieces
        assert calls == calls_of(want), pieces


def test_text_that_may_be_a_tag_is_held_back_then_sent():
    s = get_tool_parser("hermes").stream()
    assert s.feed("Hello <tool").content == "Hello "
    assert s.feed("_ca").content == ""
    assert s.feed("r>!").content == "<tool_car>!"  # not a tag after all
    assert s.feed(" <").content == " "
    assert s.finish().content == "<"


def test_a_call_is_announced_when_its_end_tag_arrives():
    s = get_tool_parser("hermes").stream()
    assert s.feed("Hi " + TC + '\n{"name": "f", "arguments": {"a": 1}}\n').tool_calls == []
    d = s.feed(ETC)
    assert d.content == ""
    assert d.tool_calls == [{"index": 0, "id": s.calls[0].id, "type": "function",
                             "function": {"name": "f", "arguments": ""}},
                            {"index": 0, "function": {"arguments": '{"a": 1}'}}]
    d = s.feed("\n" + hermes_call("g", {}))
    assert [t["index"] for t in d.tool_calls] == [1, 1]
    assert s.finish().content == ""  # whitespace-only content beside calls is dropped (content null)


def test_whitespace_only_text_without_calls_is_kept():
    assert get_tool_parser("hermes").extract("\n\n").content == "\n\n"
    assert run_stream("hermes", ["\n", "\n"])[0] == ["\n\n"]


def test_registry_and_unknown_name():
    assert set(TOOL_PARSERS) == {"hermes", "glm45", "glm47", "deepseek_v31", "deepseek_v32"}
    with pytest.raises(ConfigError, match="unknown tool-call parser 'qwen'; choose one of: hermes, glm45"):
        get_tool_parser("qwen")


# ------------------------------------------------------------------------------------------ server
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
TEMPLATE = "{% if tools %}[tools]\n{% endif %}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
TWO_CALLS = ("Checking.\n" + hermes_call("get_weather", {"city": "Paris"}) + "\n"
             + hermes_call("get_weather", {"city": "Oslo", "days": 3}))
WANT = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 3})]
STOP = "<END>"  # the script ends with it: the request stops on it, finish_reason "stop" (EOS-like)


@pytest.fixture(scope="module")
def tok():
    t = byte_level_tokenizer()
    t.chat_template = TEMPLATE
    return t


def serve(tok, parser: str | None):
    engine = ScriptedEngine(tok, [0], max_model_len=4096, num_blocks=1 << 20)
    return engine, ServerThread(create_app(engine, "m", tool_call_parser=parser))


@pytest.fixture(scope="module")
def hermes_server(tok):
    engine, thread = serve(tok, "hermes")
    with thread as url:
        yield engine, openai.OpenAI(base_url=url + "/v1", api_key="x")


def ask(engine, client, text: str, *, stream: bool = False, **kw):
    engine.script = engine.tokenizer.encode(text + STOP, add_special_tokens=False)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": len(engine.script) + 1, "stop": [STOP],
            **({"tools": TOOLS} | kw)}
    if not stream:
        return client.chat.completions.create(**body)
    state = ChatCompletionStreamState()
    chunks = list(client.chat.completions.create(stream=True, **body))
    for chunk in chunks:
        if chunk.choices:
            state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


def calls_from(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_server_non_streaming_tool_calls(hermes_server):
    r = ask(*hermes_server, TWO_CALLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n\n"
    assert calls_from(choice.message) == WANT
    assert choice.message.tool_calls[0].type == "function" and choice.message.tool_calls[0].id.startswith("call_")
    assert r.usage.completion_tokens == len((TWO_CALLS + STOP).encode())  # byte-level: one token per byte


def test_server_content_is_null_beside_calls(hermes_server):
    r = ask(*hermes_server, hermes_call("get_weather", {"city": "Paris"}))
    assert r.choices[0].message.content is None
    assert calls_from(r.choices[0].message) == WANT[:1]


def test_server_streaming_tool_calls_assembled_by_the_client(hermes_server):
    final, chunks = ask(*hermes_server, TWO_CALLS, stream=True, stream_options={"include_usage": True})
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n\n"
    assert calls_from(choice.message) == WANT
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert not any(d.content and ("<" in d.content or "{" in d.content) for d in deltas)  # no markup as content
    firsts = [t for d in deltas for t in d.tool_calls or [] if t.id is not None]
    assert [(t.index, t.type, t.function.name) for t in firsts] == [(0, "function", "get_weather"),
                                                                     (1, "function", "get_weather")]
    assert chunks[-1].usage.completion_tokens == len((TWO_CALLS + STOP).encode())
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_server_streaming_content_null_beside_calls(hermes_server):
    final, chunks = ask(*hermes_server, hermes_call("get_weather", {"city": "Paris"}), stream=True)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert calls_from(final.choices[0].message) == WANT[:1]


def test_server_malformed_call_is_content_not_an_error(hermes_server):
    text = f'{TC}\n{{"name": "get_weather", "arguments": {{"city": "Paris"\n{ETC}'
    r = ask(*hermes_server, text)
    assert r.choices[0].message.content == text
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    final, _ = ask(*hermes_server, text, stream=True)
    assert final.choices[0].message.content == text and not final.choices[0].message.tool_calls


def test_server_cut_by_max_tokens_stays_length(hermes_server):
    engine, client = hermes_server
    text = hermes_call("get_weather", {"city": "Paris"}) + " and more text"
    engine.script = engine.tokenizer.encode(text, add_special_tokens=False)
    r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=len(engine.script))
    assert r.choices[0].finish_reason == "length"
    assert calls_from(r.choices[0].message) == WANT[:1]


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS, "tool_choice": "none"}])
def test_server_without_tools_or_with_tool_choice_none_returns_the_text(hermes_server, extra):
    engine, client = hermes_server
    engine.script = engine.tokenizer.encode(TWO_CALLS + STOP, add_special_tokens=False)
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=len(engine.script), stop=[STOP],
                                       **extra)
    assert r.choices[0].message.content == TWO_CALLS
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_server_streaming_several_choices_and_logprobs(hermes_server):
    final, chunks = ask(*hermes_server, TWO_CALLS, stream=True, n=2, logprobs=True)
    assert [calls_from(c.message) for c in final.choices] == [WANT, WANT]
    assert [c.finish_reason for c in final.choices] == ["tool_calls", "tool_calls"]
    for i in (0, 1):  # every generated token's log-prob is streamed once, tool-call text included
        n = sum(len(c.choices[0].logprobs.content) for c in chunks
                if c.choices and c.choices[0].index == i and c.choices[0].logprobs)
        assert n == len((TWO_CALLS + STOP).encode())


def test_special_token_tags_are_warned_about(caplog):
    t = byte_level_tokenizer()
    t.add_special_tokens({"additional_special_tokens": [TC]})
    with caplog.at_level("WARNING", logger="atomtool.serve"):
        create_app(ScriptedEngine(t, [0]), "m", tool_call_parser="hermes")
    assert ("--tool-call-parser hermes: this tokenizer's decoded text leaves special tokens out and '<tool_call>' "
            "becomes '' there" in caplog.text)
    caplog.clear()
    with caplog.at_level("WARNING", logger="atomtool.serve"):
        create_app(ScriptedEngine(byte_level_tokenizer(), [0]), "m", tool_call_parser="hermes")
    assert "special token" not in caplog.text


def test_server_without_a_parser_is_unchanged(tok):
    engine, thread = serve(tok, None)
    with thread as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        r = ask(engine, client, TWO_CALLS, tool_choice="auto")
        final, _ = ask(engine, client, TWO_CALLS, stream=True)
    assert r.choices[0].message.content == TWO_CALLS
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "tool_calls" not in r.choices[0].message.model_dump(exclude_unset=True)  # not even as null
    assert final.choices[0].message.content == TWO_CALLS and final.choices[0].finish_reason == "stop"


def test_server_glm45_types_values_by_the_tool_schema(tok):
    engine, thread = serve(tok, "glm45")
    text = glm_call("get_weather", [("city", "123"), ("days", "3")])
    with thread as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        r = ask(engine, client, text)
        final, _ = ask(engine, client, text, stream=True)
    want = [("get_weather", {"city": "123", "days": 3})]  # city is a string in TOOLS: kept as text
    assert calls_from(r.choices[0].message) == want and calls_from(final.choices[0].message) == want
    assert r.choices[0].finish_reason == final.choices[0].finish_reason == "tool_calls"


def test_create_app_refuses_an_unknown_parser(tok):
    with pytest.raises(ConfigError, match="unknown tool-call parser 'nope'"):
        create_app(ScriptedEngine(tok, [0]), "m", tool_call_parser="nope")


# ------------------------------------------------------------------------------------------ CLI
def test_cli_unknown_parser_is_a_usage_error():
    from atomtool.cli import app

    r = CliRunner().invoke(app, ["serve", "--tool-call-parser", "qwen"])
    assert r.exit_code == 2
    assert "'qwen' is not one of 'hermes', 'glm45', 'glm47', 'deepseek_v31', 'deepseek_v32'" in r.output


def test_cli_auto_tool_choice_needs_a_parser():
    from atomtool.cli import app

    r = CliRunner().invoke(app, ["serve", "--enable-auto-tool-choice"])
    assert r.exit_code == 1
    assert "error: --enable-auto-tool-choice requires --tool-call-parser" in r.output


def test_cli_parser_reaches_run_serve(monkeypatch):
    import atomtool.serve.api.server as server
    from atomtool.cli import app

    seen = {}

    def fake_run_serve(model, **kw):
        seen.update(kw)
        return 0

    monkeypatch.setattr(server, "run_serve", fake_run_serve)
    r = CliRunner().invoke(app, ["serve", "--tool-call-parser", "glm47", "--enable-auto-tool-choice"])
    assert r.exit_code == 0, r.output
    assert seen["tool_call_parser"] == "glm47" and seen["enable_auto_tool_choice"] is True


# ------------------------------------------------------------------------------------------ template round trip
# Assistant tool calls rendered by chat-template fragments written from each format's rendering rule (GLM: a
# string value as is, any other value ``tojson``; DSML: ``string="true"`` and the text for a string, JSON
# otherwise) must parse back to the same calls: what a model trained on these templates writes is read right.
GLM_CALLS = ("{% for m in messages %}{% for tc in m.tool_calls %}{{ '<tool_call>' + tc.function.name }}{{ SEP }}"
             "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>{{ SEP }}<arg_value>"
             "{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{{ SEP }}{% endfor %}"
             "</tool_call>{% endfor %}{% endfor %}")
DSML_CALLS = ("{% set D = '｜DSML｜' %}{% for m in messages %}<{{ D }}function_calls>{% for tc in m.tool_calls %}\n"
              "<{{ D }}invoke name=\"{{ tc.function.name }}\">\n{% for k, v in tc.function.arguments.items() %}"
              "<{{ D }}parameter name=\"{{ k }}\" string=\"{{ 'true' if v is string else 'false' }}\">"
              "{{ v if v is string else v | tojson(ensure_ascii=False) }}</{{ D }}parameter>\n{% endfor %}"
              "</{{ D }}invoke>{% endfor %}\n</{{ D }}function_calls>{% endfor %}")

_keys = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12).filter(lambda t: "</" not in t)
_json = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | _text,
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(_keys, c, max_size=3), max_leaves=6)
_args = st.dictionaries(_keys, _text | _json, max_size=4)


def render_calls(template: str, calls: list[tuple[str, dict]], **kw) -> str:
    tok = byte_level_tokenizer()
    messages = [{"role": "assistant", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]}]
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)


def schema_of(calls: list[tuple[str, dict]]) -> list[dict]:
    """Tools whose schema types each string-valued argument ``string`` (as a real tool list would)."""
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
        k: {"type": "string" if isinstance(v, str) else "object"} for k, v in a.items()}}}} for n, a in calls]


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["get_weather", "f", "run_code"]), _args), min_size=1, max_size=3),
       newline=st.booleans())
def test_glm_template_rendering_parses_back(calls, newline):
    names = [n for n, _ in calls]
    assume(len(set(names)) == len(names))  # the schema is per function name
    text = render_calls(GLM_CALLS.replace("{{ SEP }}", "{{ '\\n' }}" if newline else ""), calls)
    got = get_tool_parser("glm45").extract(text, schema_of(calls))
    assert calls_of(got) == calls and got.content is None
    _, _, streamed = run_stream("glm47", list(text), schema_of(calls))
    assert streamed == calls


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["get_weather", "f"]), _args), min_size=1, max_size=3))
def test_dsml_template_rendering_parses_back(calls):
    text = render_calls(DSML_CALLS, calls)
    got = get_tool_parser("deepseek_v32").extract(text)
    assert calls_of(got) == calls and got.content is None
