"""``SamplingParams.output_kind`` (vLLM's RequestOutputKind): cumulative (default), delta, final_only.

The spec is the cumulative output, the engine's behaviour before output kinds existed (its own tests pin
it): for the same request, a delta request's outputs joined step by step (token ids, text, log-probs) equal
the cumulative output of that step, and a final_only request gets exactly one output, equal to the
cumulative final one. Checked on a scripted model (a real LLMEngine whose sampler plays a token script, so
stop strings, held-back stop-string prefixes, include_stop_str_in_output, min_tokens, skipped special
tokens, multi-byte characters split over byte tokens and a max_tokens cut inside one happen at known
places) and on the demo model (real forward passes, greedy and seeded sampling). ``LLM.generate`` (which
now runs final_only) returns what the cumulative engine returns; the server's stream text
(``StreamText``) is the same from either kind.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from atomtool.errors import InvalidRequestError
from atomtool.serve.api.text_output import StreamText
from atomtool.serve.sampling_params import SamplingParams
from benchmarks.engine_host_bench import scripted_engine
from tests.engine_fixtures import assert_no_leaks, one_torch_thread  # noqa: F401
from tests.test_server_support import byte_level_tokenizer

KINDS = ("cumulative", "delta", "final_only")


@pytest.fixture(scope="module")
def byte_tok():
    return byte_level_tokenizer()


def byte_ids(tok, data: bytes) -> list[int]:
    """The byte-level tokenizer's token ids of ``data``, one per byte (``<s>`` = 0, ``</s>`` = 1)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    return tok.convert_tokens_to_ids([alphabet[b] for b in data])


def run_kinds(engine, prompt, params: SamplingParams, abort_after: int | None = None):
    """The same request once per kind, in one engine; returns ``{kind: [outputs of each step]}`` where each
    step's list holds that kind's output (or None when it got none). ``abort_after``: abort all three after
    that many steps (the abort outputs are the last step's)."""
    for kind in KINDS:
        engine.add_request(kind, prompt, dataclasses.replace(params, output_kind=kind))
    steps = []
    while engine.has_unfinished():
        if abort_after is not None and len(steps) == abort_after:
            steps.append({k: engine.abort(k) for k in KINDS})
            break
        outs = {o.request_id: o for o in engine.step()}
        steps.append({k: outs.get(k) for k in KINDS})
    assert_no_leaks(engine)
    return steps


def check_kinds(steps) -> None:
    """The property: delta outputs join to the cumulative ones at every step, final_only is the last one."""
    ids, text, lps = [], "", []
    cum_final = None
    for step in steps:
        cum, delta, final = step["cumulative"], step["delta"], step["final_only"]
        assert (cum is None) == (delta is None)
        if cum is None:
            continue
        assert delta.delta and not cum.delta
        assert delta.new_token_ids == delta.token_ids == cum.new_token_ids or cum.finish_reason == "abort"
        ids += delta.token_ids
        text += delta.text
        if delta.logprobs is not None:
            lps += delta.logprobs
        assert ids == cum.token_ids
        assert text == cum.text
        assert (lps if cum.logprobs is not None else None) == cum.logprobs
        assert delta.logprobs is None or len(delta.logprobs) == len(delta.token_ids)
        assert delta.num_output_tokens == cum.num_output_tokens == len(cum.token_ids)
        for f in ("finished", "finish_reason", "stop_reason", "context_limit", "prompt_token_ids",
                  "num_cached_tokens"):
            assert getattr(delta, f) == getattr(cum, f), f
        if cum.finished:
            cum_final = cum
        else:
            assert final is None
    assert cum_final is not None and steps[-1]["cumulative"] is cum_final
    finals = [s["final_only"] for s in steps if s["final_only"] is not None]
    assert len(finals) == 1
    assert dataclasses.replace(finals[0], request_id="cumulative") == cum_final
    assert not finals[0].delta


# ------------------------------------------------------------------------------------------ scripted model
def scripted(tok, script: list[int]):
    """A scripted engine every request of which plays ``script`` (then ``a`` bytes)."""
    filler = byte_ids(tok, b"a")[0]
    return scripted_engine(tok, lambda seq: script[seq.num_output_tokens] if seq.num_output_tokens < len(script)
                           else filler, vocab_size=len(tok), max_model_len=128, max_num_seqs=8)


#: (name, script as bytes / EOS markers, SamplingParams fields): each case's point is in its name
EOS = None
CASES = [
    ("multibyte-split", [b"ab \xe6\x9d\xb1\xe4\xba\xac \xc3\xa9\xf0\x9f\x99\x82 end"], {"max_tokens": 20}),
    ("max-tokens-cuts-a-character", [b"xy\xe6\x9d\xb1\xe4\xba\xac"], {"max_tokens": 4}),
    ("stop-string-spans-tokens", [b"one two STOP three"], {"max_tokens": 30, "stop": ["STOP"]}),
    ("stop-prefix-held-then-released", [b"a ST STO S STOP x"], {"max_tokens": 30, "stop": ["STOP"]}),
    ("include-stop-str", [b"one ST two STOP three"], {"max_tokens": 30, "stop": ["STOP"],
                                                      "include_stop_str_in_output": True}),
    ("stop-inside-multibyte", [b"q \xe6\x9d\xb1\xe4\xba\xac r"], {"max_tokens": 30, "stop": ["\u4eac"]}),
    ("two-stops-overlapping", [b"abcabd"], {"max_tokens": 30, "stop": ["cab", "abd", "bca"]}),
    ("min-tokens-hides-an-early-stop", [b"STOP is early, then STOP"], {"max_tokens": 40, "stop": ["STOP"],
                                                                        "min_tokens": 6}),
    ("skipped-special-tokens", [b"hi", EOS, EOS, b" there", EOS, b"!"], {"max_tokens": 12, "ignore_eos": True}),
    ("eos-ends-after-min-tokens", [b"ab", EOS, b"cd", EOS, b"ef"], {"max_tokens": 12, "min_tokens": 3}),
    ("stop-token-id", [b"abc", EOS, b"def"], {"max_tokens": 12, "stop_token_ids": [5], "ignore_eos": True}),
    ("held-back-fffd", [b"\x80S", b"Tx \x80 STOP"], {"max_tokens": 12, "stop": ["STOP"]}),
    ("logprobs", [b"lo \xc3\xa9 STOP gone"], {"max_tokens": 20, "stop": ["STOP"], "logprobs": 2}),
]


def case_script(tok, parts) -> list[int]:
    ids = []
    for p in parts:
        ids += [1] if p is EOS else byte_ids(tok, p)
    return ids


def run_case(tok, name, parts, fields):
    """A :data:`CASES` entry run once per kind (:func:`run_kinds`); returns (script, steps)."""
    script = case_script(tok, parts)
    if name == "stop-token-id":
        fields = {**fields, "stop_token_ids": [script[4]]}  # a byte token ("d"), not EOS
    return script, run_kinds(scripted(tok, script), byte_ids(tok, b"P:"), SamplingParams(**fields))


@pytest.mark.parametrize("name,parts,fields", CASES, ids=[c[0] for c in CASES])
def test_delta_joins_to_cumulative_and_final_only_is_the_final(byte_tok, name, parts, fields):
    script, steps = run_case(byte_tok, name, parts, fields)
    check_kinds(steps)
    final = steps[-1]["cumulative"]
    # preconditions: each case reaches the situation it names
    if "stop" in name and name not in ("stop-token-id",):
        assert final.finish_reason == "stop" and isinstance(final.stop_reason, str), final
    if name == "max-tokens-cuts-a-character":
        assert final.finish_reason == "length" and final.text.endswith("\ufffd")
    if name == "stop-prefix-held-then-released":
        held = [s["cumulative"].text for s in steps]
        assert any(t.endswith("a ") for t in held) and "a ST STO S " == final.text
    if name == "include-stop-str":
        assert final.text == "one ST two STOP"
    if name == "min-tokens-hides-an-early-stop":
        assert final.text == "STOP is early, then "
    if name == "skipped-special-tokens":
        assert final.text == "hi there!" and final.token_ids.count(1) == 3
    if name == "eos-ends-after-min-tokens":
        assert (final.text, final.finish_reason, final.token_ids[-1]) == ("abcd", "stop", 1)
    if name == "stop-token-id":
        assert (final.text, final.finish_reason, final.stop_reason) == ("abc", "stop", script[4])
    if name == "held-back-fffd":
        assert any(s["cumulative"].text.endswith("\ufffd") for s in steps[:-1])  # the stream rule's case
    if name == "logprobs":
        assert len(final.logprobs) == len(final.token_ids)


def test_random_scripts_with_stop_strings(byte_tok):
    """Random byte scripts (ASCII around a stop string's letters, multi-byte characters, EOS under
    ignore_eos) with random stop strings, min_tokens, include_stop_str and log-probs."""
    rng = random.Random(7)
    pieces = [b"S", b"T", b"O", b"P", b"ST", b" ", b"x", "\u00e9".encode(), "\u6771".encode(), "\U0001f642".encode()]
    for _ in range(25):
        parts = [rng.choice(pieces) if rng.random() < 0.9 else EOS for _ in range(rng.randint(3, 14))]
        stops = rng.sample(["STOP", "TO", "S x", "\u00e9S", "PP", "\u6771 "], rng.randint(0, 2))
        max_tokens = rng.randint(1, 40)
        params = SamplingParams(max_tokens=max_tokens, stop=stops, ignore_eos=rng.random() < 0.5,
                                min_tokens=rng.randint(0, min(max_tokens, 5)),
                                include_stop_str_in_output=rng.random() < 0.5,
                                logprobs=rng.choice([None, 0, 1]))
        check_kinds(run_kinds(scripted(byte_tok, case_script(byte_tok, parts)), [2, 3], params))


@pytest.mark.parametrize("at", [2, 5])
def test_abort_emits_what_is_held_back(byte_tok, at):
    """An abort's delta output carries the text still held back (here a stop-string prefix) and no tokens;
    the abort outputs of the three kinds still agree."""
    script = byte_ids(byte_tok, b"abSTO")
    steps = run_kinds(scripted(byte_tok, script), [2, 3], SamplingParams(max_tokens=30, stop=["STOP"]),
                      abort_after=at)
    check_kinds(steps)
    last = steps[-1]
    assert last["delta"].finish_reason == "abort" and last["delta"].token_ids == []
    if at == 5:
        assert last["cumulative"].text == "abSTO" and last["delta"].text == "STO"


# -------------------------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def demo_engine():
    from atomtool.serve.demo import demo_model_path
    from atomtool.serve.engine.llm_engine import LLMEngine

    return LLMEngine.from_model(str(demo_model_path()), device="cpu", dtype="float32", kv_cache_memory=1 << 22,
                                max_model_len=256)


#: (SamplingParams fields, how the greedy request ends: the case's precondition; None: sampled, any end).
#: The demo model recites the Zen of Python after DEMO_PROMPT ("... Beautiful is better than"): " ugly."
#: comes first, "Explicit is better than implicit." (the stop string spans tokens) later.
REAL = [
    ({"max_tokens": 40, "temperature": 0, "logprobs": 2}, "length"),
    ({"max_tokens": 60, "temperature": 0, "stop": ["plicit is bet"]}, "plicit is bet"),
    ({"max_tokens": 60, "temperature": 0, "stop": ["Simple", "plicit is bet"], "include_stop_str_in_output": True,
      "logprobs": 1}, "plicit is bet"),
    ({"max_tokens": 40, "temperature": 0, "stop": ["ugly"], "min_tokens": 4}, "length"),  # " ugly" is token 1
    ({"max_tokens": 30, "temperature": 1.0, "seed": 3, "logprobs": 1, "stop": ["is"]}, None),
]


@pytest.mark.parametrize("fields,ends", REAL, ids=[f"real{i}" for i in range(len(REAL))])
def test_real_model_delta_and_final_only(demo_engine, fields, ends):
    from atomtool.serve.demo import DEMO_PROMPT

    steps = run_kinds(demo_engine, DEMO_PROMPT, SamplingParams(**fields))
    check_kinds(steps)
    final = steps[-1]["cumulative"]
    assert final.text and len(final.token_ids) > 3
    if ends == "length":
        assert final.finish_reason == "length"
    elif ends is not None:
        assert (final.finish_reason, final.stop_reason) == ("stop", ends)
    if "min_tokens" in fields:
        assert "ugly" in final.text  # the stop string inside min_tokens did not stop it


def test_llm_generate_is_unchanged():
    """``LLM.generate`` (final_only inside) returns what the cumulative engine returns for the same requests,
    whatever output_kind the caller's params ask for, and leaves the caller's params as given."""
    from atomtool.serve.demo import DEMO_PROMPT, demo_model_path
    from atomtool.serve.llm import LLM

    llm = LLM(str(demo_model_path()), device="cpu", dtype="float32", kv_cache_memory=1 << 22, max_model_len=256)
    engine = llm.engine
    params = [SamplingParams(max_tokens=30, temperature=0, logprobs=1, stop=["ugly"]),
              SamplingParams(max_tokens=25, temperature=0.8, seed=11, output_kind="delta"),
              SamplingParams(max_tokens=20, temperature=0, min_tokens=5, stop=["is"])]
    before = [dataclasses.replace(p) for p in params]
    got = llm.generate([DEMO_PROMPT] * 3, params)
    assert [dataclasses.replace(p) for p in params] == before  # output_kind "delta" stays the caller's
    for i, p in enumerate(params):
        engine.add_request(f"ref{i}", DEMO_PROMPT, dataclasses.replace(p, output_kind="cumulative"))
    ref = {}
    while engine.has_unfinished():
        ref.update({o.request_id: o for o in engine.step() if o.finished})
    for i, out in enumerate(got):
        assert not out.delta and out.finished
        # LLM.generate adds vLLM's view (prompt text, outputs): the engine's own fields are unchanged
        assert out.prompt == DEMO_PROMPT and out.outputs[0].token_ids == out.token_ids
        assert dataclasses.replace(out, request_id=f"ref{i}", prompt=None, completions=None) == ref[f"ref{i}"]


# -------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("bad", ["Delta", "streaming", "", 1, None, True])
def test_output_kind_is_validated(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(output_kind=bad).validate()
    assert e.value.param == "output_kind"
    assert str(e.value) == f"output_kind must be one of cumulative, delta, final_only, got {bad!r}"


def test_engine_refuses_a_bad_output_kind(byte_tok):
    engine = scripted(byte_tok, [5])
    with pytest.raises(InvalidRequestError, match="output_kind must be one of") as e:
        engine.add_request("r", [2, 3], SamplingParams(output_kind="final"))
    assert e.value.param == "output_kind" and not engine.has_unfinished()


def test_default_is_cumulative():
    assert SamplingParams().output_kind == "cumulative"
    for kind in KINDS:
        assert SamplingParams(output_kind=kind).validate().output_kind == kind


# ---------------------------------------------------------------------------------------------- server
@pytest.mark.parametrize("name,parts,fields", CASES, ids=[c[0] for c in CASES])
def test_server_stream_chunks_are_the_same_from_either_kind(byte_tok, name, parts, fields):
    """``StreamText`` (the SSE text chunks) gives the same chunks from a cumulative and a delta request,
    including a held-back U+FFFD (the cumulative rule: a trailing U+FFFD waits until the next chunk)."""
    _, steps = run_case(byte_tok, name, parts, fields)
    a, b = StreamText(), StreamText()
    chunks_a = [a.next(s["cumulative"]) for s in steps]
    chunks_b = [b.next(s["delta"]) for s in steps]
    assert chunks_a == chunks_b
    assert "".join(chunks_a) == steps[-1]["cumulative"].text
