"""Defects found by a new user stress-testing ``atomtool serve`` (user reports, round 6), fixed since: chat
log-prob ``bytes`` are the tokens' raw bytes, completions ``text_offset`` comes from the engine's own
incremental detokenizer (split characters, skipped special tokens, stop-string cuts), ``seed + i`` wraps in
int64, and ``stop`` lists are capped.

Runs on :class:`tests.test_server_support.ScriptedEngine` with the demo model's own tokenizer (byte-level
BPE: ``é`` is the two tokens ``Ã`` ``©``; chat markers such as ``<|end|>`` are special tokens), so each
reproducer emits exactly the tokens the live server emitted when the defect was seen (fast; no model).

Oracles are OpenAI's API reference:
- chat ``logprobs.content[i].bytes`` is "the UTF-8 bytes representation of the token ... useful in
  instances where characters are represented by multiple tokens and their byte representations must be
  combined to generate the correct text representation";
- completions (legacy) ``logprobs.text_offset[i]`` is the character offset in ``text`` where token i starts;
- ``seed`` is any int64; the README says choice *i* of ``n`` samples gets ``seed + i``.
"""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.demo import demo_model_path
from tests.test_server_support import ScriptedEngine

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(demo_model_path()))


def serve(tok, text_or_ids):
    """A server whose engine emits ``text_or_ids`` (a string is encoded without special tokens)."""
    ids = tok.encode(text_or_ids, add_special_tokens=False) if isinstance(text_or_ids, str) else text_or_ids
    return ServerThread(create_app(ScriptedEngine(tok, ids, max_model_len=128), "m", chat_template=TEMPLATE))


def test_precondition_demo_tokenizer_splits_e_acute_over_two_byte_tokens(tok):
    ids = tok.encode("é", add_special_tokens=False)
    assert len(ids) == 2
    assert [tok.decode([i]) for i in ids] == ["\ufffd", "\ufffd"]
    assert tok.decode(ids) == "é"


def test_chat_logprob_bytes_of_a_split_character_join_to_the_content(tok):
    ids = tok.encode("é!", add_special_tokens=False)
    assert len(ids) == 3  # Ã © !
    with serve(tok, ids) as url:
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": len(ids),
            "logprobs": True, "top_logprobs": 1}, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "é!"
    entries = choice["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in entries)
    assert joined == "é!".encode()  # observed: b'\xef\xbf\xbd\xef\xbf\xbd!'
    assert all(bytes(t["bytes"]) == bytes(e["bytes"]) for e in entries for t in e["top_logprobs"])


def test_completion_text_offset_after_a_split_character_points_at_the_token(tok):
    ids = tok.encode("éa b", add_special_tokens=False)
    assert len(ids) == 4  # Ã © a Ġb
    with serve(tok, ids) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": len(ids),
                                                      "logprobs": 0}, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == "éa b"
    assert lp["tokens"][-2:] == ["a", " b"]
    offsets = lp["text_offset"]
    assert text[offsets[-2]:].startswith("a")  # observed: offsets [0, 1, 2, 3] -> text[2:] == ' b'
    assert text[offsets[-1]:].startswith(" b")


def test_completion_text_offset_after_a_special_token_points_at_the_token(tok):
    end = tok.convert_tokens_to_ids("<|end|>")
    ids = tok.encode("a b", add_special_tokens=False)
    assert len(ids) == 2  # a Ġb
    with serve(tok, [ids[0], end, ids[1]]) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1 + len(ids),
                                                      "logprobs": 0}, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == "a b"
    assert lp["tokens"][-1] == " b"
    assert all(o <= len(text) for o in lp["text_offset"]), (lp["text_offset"], text)
    assert text[lp["text_offset"][-1]:].startswith(lp["tokens"][-1])


def test_completion_logprob_offsets_stay_inside_text_when_a_stop_string_cuts_it(tok):
    with serve(tok, " ugly.\nExplicit is better") as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 10,
                                                      "stop": "plicit", "logprobs": 0}, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert (text, choice["finish_reason"]) == (" ugly.\nEx", "stop")
    assert all(o < len(text) for o in lp["text_offset"]), (lp["text_offset"], len(text))


def test_largest_int64_seed_with_n_2_is_served(tok):
    with serve(tok, "ab") as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2, "n": 2,
                                                      "seed": 2**63 - 1, "temperature": 1.0}, timeout=30)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_an_unbounded_stop_list_is_refused(tok):
    stops = [f"zz{i:06d}" for i in range(20_000)]
    with serve(tok, "ab") as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2,
                                                      "stop": stops}, timeout=30)
    assert r.status_code == 400, r.text[:200]
    assert r.json()["error"]["param"] == "stop"
