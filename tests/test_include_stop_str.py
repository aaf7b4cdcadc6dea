"""vLLM's ``include_stop_str_in_output`` (a SamplingParams extra, default False): a stop *string* that ends
generation stays at the end of the text, and so does the text of a stop *token* (vLLM's v1 detokenizer
decodes the stop token too when the flag is set: ``if stop_terminated and not include_stop_str_in_output``
is its only case that leaves it out).

Oracle: vLLM's documented semantics, checked against the same request without the flag on the demo model
(greedy: it recites the Zen of Python), so the expected text is ``text without the flag + stop string``.
The stop string spans tokens and ends inside one ("...plicit is bet" in "Explicit is better"); streamed
text (server, completions and chat) must equal the non-streamed text.
"""

from __future__ import annotations

import pytest

from atomtool.serve.demo import DEMO_CHAT_MESSAGE, DEMO_PROMPT, demo_model_path
from atomtool.serve.llm import LLM
from atomtool.serve.sampling_params import SamplingParams
from tests.test_server_support import demo_model_client

STOP = "plicit is bet"
ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory=1 << 22, max_model_len=256)


@pytest.fixture(scope="module")
def llm():
    return LLM(str(demo_model_path()), **ENGINE_KW)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 40, "temperature": 0, **kw})


def test_llm_keeps_a_stop_string_that_spans_tokens(llm):
    without = llm.generate(DEMO_PROMPT, greedy(stop=[STOP]))[0]
    with_ = llm.generate(DEMO_PROMPT, greedy(stop=[STOP], include_stop_str_in_output=True))[0]
    assert without.finish_reason == with_.finish_reason == "stop"
    assert without.stop_reason == with_.stop_reason == STOP
    assert without.text and STOP not in without.text
    assert with_.text == without.text + STOP
    # precondition: the stop string spans tokens and ends inside the last one (text after it is dropped)
    tok = llm.tokenizer
    last = tok.decode(with_.token_ids[-1:])
    assert len(last) < len(STOP) and not tok.decode(with_.token_ids).endswith(STOP)


def test_llm_keeps_a_stop_tokens_text_with_the_flag(llm):
    first = llm.generate(DEMO_PROMPT, greedy(max_tokens=8))[0]
    stop_id = first.token_ids[3]
    without = llm.generate(DEMO_PROMPT, greedy(stop_token_ids=[stop_id]))[0]
    with_ = llm.generate(DEMO_PROMPT, greedy(stop_token_ids=[stop_id], include_stop_str_in_output=True))[0]
    assert (without.finish_reason, without.stop_reason) == ("stop", stop_id)
    assert (with_.token_ids, with_.stop_reason) == (without.token_ids, stop_id)
    piece = llm.tokenizer.decode([stop_id])
    assert piece and with_.text == without.text + piece  # before: the flag left the stop token's text out


def test_sampling_params_validates_the_flag():
    from atomtool.errors import InvalidRequestError

    assert SamplingParams().include_stop_str_in_output is False
    with pytest.raises(InvalidRequestError, match="include_stop_str_in_output must be true or false"):
        SamplingParams(include_stop_str_in_output="yes").validate()


@pytest.fixture(scope="module")
def client():
    with demo_model_client(**ENGINE_KW) as c:
        yield c


def _completion(client, stream: bool, **extra) -> str:
    kw = dict(model="m", prompt=DEMO_PROMPT, max_tokens=40, temperature=0, stop=[STOP], extra_body=extra)
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    out = client.completions.create(**kw).choices[0]
    assert out.finish_reason == "stop"
    return out.text


def _chat(client, stream: bool, **extra) -> str:
    kw = dict(model="m", messages=[{"role": "user", "content": DEMO_CHAT_MESSAGE}], max_tokens=60,
              temperature=0, stop=[STOP], extra_body=extra)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "stop"
    return out.message.content


@pytest.mark.parametrize("call", [_completion, _chat], ids=["completions", "chat"])
def test_server_keeps_the_stop_string_streamed_and_not(client, call):
    without = call(client, False)
    assert without and STOP not in without
    with_ = call(client, False, include_stop_str_in_output=True)
    assert with_ == without + STOP
    assert call(client, True, include_stop_str_in_output=True) == with_
    assert call(client, True) == without
