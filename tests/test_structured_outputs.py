"""Structured outputs (vLLM's ``StructuredOutputsParams``; OpenAI's ``response_format``): the engine masks every
token that cannot continue a valid output, so whatever the model would say, the text is valid.

Oracles: the constraint itself, checked by an independent validator on the output (``json.loads`` plus a
hand check of the schema; ``re.fullmatch``; membership in the choices), on the demo model (trained to recite
the Zen of Python, so unconstrained it never writes JSON: the constraint is what makes the output valid). Also
the unconstrained request for the same prompt (it must differ: the mask acted) and the engine's own invariants
(finish_reason "stop" once the output is complete; "length" when max_tokens cuts it first).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from atomtool.errors import InvalidRequestError
from atomtool.serve import SamplingParams, StructuredOutputsParams
from atomtool.serve.demo import DEMO_CHAT_MESSAGE, DEMO_PROMPT, demo_model_path
from atomtool.serve.llm import LLM
from tests.test_server_support import demo_model_client

pytest.importorskip("xgrammar")

ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory=1 << 22, max_model_len=512)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM(str(demo_model_path()), **ENGINE_KW)


def gen(llm, so=None, **kw):
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 120), temperature=kw.pop("temperature", 0),
                            structured_outputs=so, **kw)
    return llm.generate([DEMO_PROMPT], params)[0]


def check_schema(obj) -> None:
    """SCHEMA checked by hand (not by the library that built the mask)."""
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "tags"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"a", "b"}


@pytest.mark.parametrize("rows", [[0, 2, 3], [0, 1, 2, 3, 4]])
def test_apply_token_bitmask_against_a_bit_by_bit_reference(rows):
    from atomtool.serve.engine.structured import apply_token_bitmask

    g = torch.Generator().manual_seed(len(rows))
    vocab = 77  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), 3), generator=g, dtype=torch.int32)
    out = apply_token_bitmask(logits, rows, bitmask)
    expect = logits.clone()
    for j, r in enumerate(rows):
        for t in range(vocab):
            if not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                expect[r, t] = float("-inf")
    assert torch.equal(out, expect) and out.data_ptr() != logits.data_ptr()
    assert not torch.isinf(logits).any()  # the input is not modified


def test_unconstrained_demo_output_is_not_json(llm):
    out = gen(llm)
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema(llm, temperature):
    out = gen(llm, StructuredOutputsParams(json=SCHEMA), temperature=temperature, seed=3, max_tokens=200)
    assert out.finish_reason == "stop", out.text
    check_schema(json.loads(out.text))


def test_json_schema_as_text_and_dict_form(llm):
    a = gen(llm, StructuredOutputsParams(json=json.dumps(SCHEMA)), max_tokens=200)
    b = gen(llm, {"json": SCHEMA}, max_tokens=200)
    assert a.text == b.text
    check_schema(json.loads(a.text))


def test_json_object(llm):
    out = gen(llm, StructuredOutputsParams(json_object=True), max_tokens=200, temperature=1.0, seed=0)
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by max_tokens: a prefix of a JSON object
        assert out.finish_reason == "length" and out.text.lstrip().startswith("{")


def test_regex(llm):
    pattern = r"(Zen|Python) [0-9]{2,4}-[a-z]{1,6}"
    for seed in range(3):
        out = gen(llm, StructuredOutputsParams(regex=pattern), temperature=1.0, seed=seed, max_tokens=60)
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, out.text), out.text


def test_choice(llm):
    choices = ["yes", "no", 'a "quoted" \\ ünïcode answer']
    seen = set()
    for seed in range(12):
        out = gen(llm, StructuredOutputsParams(choice=choices), temperature=1.5, seed=seed)
        assert out.finish_reason == "stop" and out.text in choices, out.text
        seen.add(out.text)
    assert len(seen) >= 2  # sampling picks among the choices, it does not always take the same one


def test_grammar(llm):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    out = gen(llm, StructuredOutputsParams(grammar=grammar), temperature=1.0, seed=1, max_tokens=40)
    assert out.finish_reason == "stop"
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.text), out.text


def test_max_tokens_cut_gives_length_and_a_valid_prefix(llm):
    out = gen(llm, StructuredOutputsParams(json=SCHEMA), max_tokens=3)
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")


def test_ignore_eos_still_ends_a_complete_output(llm):
    out = gen(llm, StructuredOutputsParams(choice=["yes", "no"]), ignore_eos=True, max_tokens=50)
    assert out.finish_reason == "stop" and out.text in ("yes", "no")
    assert len(out.token_ids) < 50


def test_batch_mixes_constrained_and_free_rows(llm):
    free = SamplingParams(max_tokens=20, temperature=0)
    params = [free, SamplingParams(max_tokens=200, temperature=0, structured_outputs={"json": SCHEMA}),
              free, SamplingParams(max_tokens=20, temperature=0, structured_outputs={"choice": ["x", "y"]})]
    outs = llm.generate([DEMO_PROMPT] * 4, params)
    alone = gen(llm, max_tokens=20)
    assert outs[0].text == outs[2].text == alone.text  # the mask touched only its own rows
    check_schema(json.loads(outs[1].text))
    assert outs[3].text in ("x", "y")


def test_logprobs_stay_the_models(llm):
    free = gen(llm, logprobs=3, max_tokens=1)
    forced = gen(llm, StructuredOutputsParams(choice=["zzz"]), logprobs=3, max_tokens=1)
    # the forced first token is not the model's favourite, and its reported top-3 are the model's own
    assert forced.token_ids[0] != free.token_ids[0]
    assert forced.logprobs[0]["top"] == free.logprobs[0]["top"]


@pytest.mark.parametrize("so, message", [
    (StructuredOutputsParams(), "exactly one of"),
    (StructuredOutputsParams(json=SCHEMA, regex="a"), "got json, regex"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(json=[1, 2]), "must be a JSON object"),
    (StructuredOutputsParams(choice=[]), "non-empty list"),
    (StructuredOutputsParams(choice="yes"), "non-empty list"),
    (StructuredOutputsParams(choice=["a", 1]), "list of strings"),
    (StructuredOutputsParams(regex=""), "non-empty string"),
    ({"jsn": {}}, "unknown structured_outputs field(s): jsn"),
    ("json", "must be StructuredOutputsParams or a dict"),
    (StructuredOutputsParams(regex="(unclosed"), "cannot compile the regex constraint"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "cannot compile the grammar constraint"),
    (StructuredOutputsParams(json={"type": "nonsense"}), "cannot compile the json constraint"),
])
def test_bad_constraints_are_refused_naming_the_field(llm, so, message):
    with pytest.raises(InvalidRequestError) as ei:
        gen(llm, so)
    assert message in str(ei.value) and ei.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished()


# -- through the OpenAI-compatible server -------------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    with demo_model_client(**ENGINE_KW) as c:
        yield c


def chat(client, stream=False, **kw):
    kw = dict(model="m", messages=[{"role": "user", "content": DEMO_CHAT_MESSAGE}], max_tokens=200,
              temperature=0) | kw
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), finish[-1]
    choice = client.chat.completions.create(**kw).choices[0]
    return choice.message.content, choice.finish_reason


JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def test_chat_response_format_json_schema_streamed_and_not(client):
    text, finish = chat(client, response_format=JSON_SCHEMA_FORMAT)
    assert finish == "stop"
    check_schema(json.loads(text))
    assert chat(client, stream=True, response_format=JSON_SCHEMA_FORMAT) == (text, "stop")
    free, _ = chat(client)
    assert free != text


def test_chat_response_format_json_object_and_text(client):
    text, finish = chat(client, response_format={"type": "json_object"}, temperature=1.0, seed=2)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length" and text.startswith("{")
    assert chat(client, response_format={"type": "text"}) == chat(client)


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": ["red", "green", "blue"]}},
                                   {"guided_choice": ["red", "green", "blue"]}])
def test_completions_choice_vllm_fields(client, extra):
    out = client.completions.create(model="m", prompt=DEMO_PROMPT, max_tokens=10, temperature=1.0, seed=5, n=4,
                                    extra_body=extra)
    assert [c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in out.choices] == [True] * 4


def test_completions_guided_regex_and_json(client):
    out = client.completions.create(model="m", prompt=DEMO_PROMPT, max_tokens=30, temperature=0,
                                    extra_body={"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{3}"}).choices[0]
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{3}", out.text) and out.finish_reason == "stop"
    out = client.completions.create(model="m", prompt=DEMO_PROMPT, max_tokens=200, temperature=0,
                                    extra_body={"guided_json": SCHEMA}).choices[0]
    check_schema(json.loads(out.text))


@pytest.mark.parametrize("kw, param, message", [
    (dict(response_format={"type": "xml"}), "response_format", "response_format type 'xml' is not supported"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format",
     "needs a 'json_schema' object with a 'schema'"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "response_format",
     "only one of guided_regex, response_format may constrain the output"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs",
     "exactly one of"),
    (dict(extra_body={"structured_outputs": {"jsn": {}}}), "structured_outputs", "unknown structured_outputs"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "non-empty list"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex", "cannot compile the regex constraint"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format", "cannot compile the json constraint"),
])
def test_bad_constraints_are_a_400_naming_the_field(client, kw, param, message):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kw)
    assert info.value.status_code == 400 and message in info.value.message
    assert info.value.body["param"] == param
    assert chat(client, max_tokens=5)[1] == "length"  # the server still serves


# -- atomtool generate -------------------------------------------------------------------------------------

def run_cli(*args):
    from typer.testing import CliRunner

    from atomtool.cli import app

    return CliRunner().invoke(app, ["generate", str(demo_model_path()), "--prompt", DEMO_PROMPT, "--device", "cpu",
                                    "--dtype", "float32", "--temperature", "0", *args])


def test_generate_cli_json_schema_file_and_choice(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(SCHEMA))
    res = run_cli("--json-schema", str(path), "--max-tokens", "200", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)[0]
    assert out["finish_reason"] == "stop"
    check_schema(json.loads(out["text"]))
    res = run_cli("--json-schema", json.dumps(SCHEMA), "--max-tokens", "200", "--json")
    assert json.loads(res.stdout)[0]["text"] == out["text"]  # schema as text: same
    res = run_cli("--choice", "left", "--choice", "right", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)[0]["text"] in ("left", "right")


@pytest.mark.parametrize("args, message", [
    (["--regex", "a+", "--choice", "a"], "only one of --regex, --choice may constrain the output"),
    (["--json-schema", "no/such/schema.json"], "--json-schema no/such/schema.json: cannot read the schema file"),
    (["--json-schema", "{not json"], "not valid JSON"),
    (["--regex", "(unclosed"], "cannot compile the regex constraint"),
])
def test_generate_cli_bad_constraint_is_one_line_and_exit_1(args, message):
    res = run_cli(*args)
    assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output, res.output


def test_server_compiles_constraints_off_the_engine_thread(client, monkeypatch):
    """A new constraint is compiled (and a first one builds the vocabulary tables) in a worker thread: on the
    engine thread it would stall every running request's decode for that long. The engine thread's
    ``add_request`` compiles it again, which xgrammar's compiler cache answers."""
    import threading

    from atomtool.serve.engine.structured import GrammarBackend

    compiled_on: list[str] = []
    inner = GrammarBackend.compile

    def spy(self, params):
        compiled_on.append(threading.current_thread().name)
        return inner(self, params)

    monkeypatch.setattr(GrammarBackend, "compile", spy)
    schema = {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}
    text, finish = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "q",
                                                                                        "schema": schema}})
    assert finish == "stop" and isinstance(json.loads(text)["q"], int)
    assert len(compiled_on) == 2 and compiled_on[0] != "atomtool-engine" and compiled_on[1] == "atomtool-engine"


def test_structured_bench_runs_and_times_its_parts():
    from benchmarks.structured_bench import run, synthetic_tokenizer

    tok = synthetic_tokenizer(600)
    assert len(tok) == 600 and tok.eos_token_id == 1
    free = run(tok, structured=False, batch=4, tokens=12)
    con = run(tok, structured=True, batch=4, tokens=40)
    assert free["steps"] == 12 and free["fill ms"] == 0 and free["apply ms"] == 0
    assert con["fill ms"] > 0 and con["apply ms"] > 0 and con["accept ms"] > 0


@pytest.mark.parametrize("so, cause", [
    (StructuredOutputsParams(regex="(unclosed"), "cannot compile the regex constraint: Regex parsing error at "
                                                 "position 10: The parenthesis is not closed."),
    (StructuredOutputsParams(grammar="root ::= nope"), 'cannot compile the grammar constraint: EBNF parser error at '
                                                       'line 1, column 10: Rule "nope" is not defined'),
])
def test_compile_errors_are_the_cause_without_xgrammar_log_prefix(llm, so, cause):
    with pytest.raises(InvalidRequestError) as ei:
        gen(llm, so)
    assert str(ei.value) == cause  # not "... [04:07:02] /project/cpp/regex_converter.cc:94: Regex ..."
