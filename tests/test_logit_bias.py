"""``logit_bias`` (OpenAI) and ``allowed_token_ids`` (vLLM's extra) in SamplingParams, the batched sampler, the
engine and the server.

Oracles, written here independently of atomtool's sampler: the bias is added to the raw logits token by token
in a Python loop, the allowed set masks everything else to ``-inf``, and the pick is ``argmax`` (greedy) or,
for sampled rows, membership of the allowed set. The whole-engine oracle is the HF model's own forward pass
step by step with the same hand-written bias / mask, argmax-ed. Log-probs stay those of the raw logits
(vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

import atomtool.serve.engine.sampler as sampler_mod
from atomtool.errors import InvalidRequestError
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.engine.sampler import Sampler, apply_allowed_token_ids, apply_logit_bias
from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import load_hf, make_engine, run_to_completion

V = 64


def seq_with(prompt: list[int], output: list[int] = (), eos: frozenset[int] = frozenset(), **kw) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(**kw).validate(), eos)
    for t in output:
        s.append_token(t)
    return s


def ref_bias(logits: torch.Tensor, bias: dict[int, float] | None, allowed: list[int] | None = None) -> torch.Tensor:
    """The oracle: the bias added token by token, then every id outside ``allowed`` set to -inf (one row [V])."""
    out = logits.clone()
    for t, b in (bias or {}).items():
        out[t] = float(logits[t]) + b
    if allowed is not None:
        for t in range(logits.shape[0]):
            if t not in allowed:
                out[t] = float("-inf")
    return out


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("kw, param, message", [
    (dict(logit_bias={"x": 1}), "logit_bias",
     "logit_bias keys must be token ids (non-negative integers, as strings in JSON), got 'x'"),
    (dict(logit_bias={"-3": 1}), "logit_bias", "got '-3'"),
    (dict(logit_bias={-3: 1}), "logit_bias", "got int -3"),
    (dict(logit_bias={"1.5": 1}), "logit_bias", "got '1.5'"),
    (dict(logit_bias={"9" * 5000: 1}), "logit_bias", "got str '99999"),
    (dict(logit_bias={True: 1}), "logit_bias", "got bool True"),
    (dict(logit_bias={"5": 100.5}), "logit_bias", "logit_bias values must be numbers in [-100, 100], got 100.5 "
                                                   "for token 5"),
    (dict(logit_bias={"5": -101}), "logit_bias", "got -101 for token 5"),
    (dict(logit_bias={"5": float("nan")}), "logit_bias", "got nan for token 5"),
    (dict(logit_bias={"5": "1"}), "logit_bias", "got '1' for token 5"),
    (dict(logit_bias={"5": True}), "logit_bias", "got True for token 5"),
    (dict(logit_bias={"5": 1, "05": 2}), "logit_bias", "logit_bias names token 5 twice ('05' is a second spelling"),
    (dict(logit_bias=[5]), "logit_bias", "logit_bias must be an object mapping token ids to biases, got [5]"),
    (dict(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}), "logit_bias",
     f"logit_bias has {MAX_LOGIT_BIAS_ENTRIES + 1} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids",
     "allowed_token_ids must be non-negative integer token ids, got -2"),
    (dict(allowed_token_ids=[1, True]), "allowed_token_ids", "got True"),
    (dict(allowed_token_ids=[2**70]), "allowed_token_ids", f"got {2**70}"),
    (dict(allowed_token_ids=[10**5000]), "allowed_token_ids", "got a very large integer"),
    (dict(allowed_token_ids="12"), "allowed_token_ids", "allowed_token_ids must be a list of token ids, got '12'"),
])
def test_validation_errors_name_the_field(kw, param, message):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kw).validate()
    assert message in str(info.value)
    assert info.value.param == param


def test_validation_normalises():
    p = SamplingParams(logit_bias={"7": 100, 3: -100.0, "12": 0.25}, allowed_token_ids=(9, 2, 9)).validate()
    assert p.logit_bias == {7: 100.0, 3: -100.0, 12: 0.25}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert p.allowed_token_ids == [2, 9]
    assert SamplingParams(logit_bias={}).validate().logit_bias is None  # an empty object is no bias
    d = SamplingParams().validate()
    assert d.logit_bias is None and d.allowed_token_ids is None


def test_check_vocab():
    SamplingParams(logit_bias={63: 1}, allowed_token_ids=[0, 63]).validate().check_vocab(64)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={"64": 1, "3": 2}).validate().check_vocab(64)
    assert str(info.value) == "logit_bias has token ids outside the vocabulary [0, 64): [64]"
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(allowed_token_ids=[1, 100, 64]).validate().check_vocab(64)
    assert str(info.value) == "allowed_token_ids has token ids outside the vocabulary [0, 64): [64, 100]"
    assert info.value.param == "allowed_token_ids"
    # only EOS / stop ids allowed while min_tokens bans them: no token could be picked
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(allowed_token_ids=[2, 5], stop_token_ids=[5], min_tokens=1).validate().check_vocab(64, {2})
    assert "which min_tokens = 1 bans for the first 1 tokens" in str(info.value)
    assert info.value.param == "allowed_token_ids"
    SamplingParams(allowed_token_ids=[2, 5], stop_token_ids=[5], min_tokens=1,
                   ignore_eos=True).validate().check_vocab(64, {2})
    SamplingParams(allowed_token_ids=[2, 5], stop_token_ids=[5]).validate().check_vocab(64, {2})


# ------------------------------------------------------------------------------------------ sampler
def test_apply_logit_bias_and_mask_match_the_oracle():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    bias = [{3: 2.5, 60: -7.0, 0: 100.0}, None, {63: -100.0}, {5: 0.125}]
    got = apply_logit_bias(logits, bias)
    for r in range(4):
        assert torch.equal(got[r], ref_bias(logits[r], bias[r]))
    allowed = [[1, 2, 40], None, [63], None]
    got = apply_allowed_token_ids(logits, [None if a is None else torch.tensor(a) for a in allowed])
    for r in range(4):
        assert torch.equal(got[r], ref_bias(logits[r], None, allowed[r]))


def test_greedy_plus_100_forces_and_minus_100_bans():
    g = torch.Generator().manual_seed(1)
    rows, seqs, want = [], [], []
    for r in range(10):
        logits = torch.randn(V, generator=g) * 4
        top = int(logits.argmax())
        low = int(logits.argmin())
        if r % 2:  # +100 on the least likely token forces it
            bias = {low: 100.0}
        else:  # -100 on the argmax bans it: the runner-up wins
            bias = {top: -100.0}
        rows.append(logits)
        seqs.append(seq_with([1], temperature=0.0, logit_bias=bias, logprobs=1))
        want.append(int(ref_bias(logits, bias).argmax()))
        assert want[-1] == (low if r % 2 else int(logits.topk(2).indices[1]))
    raw = torch.stack(rows)
    out = Sampler()(raw, seqs)
    assert [t for t, _ in out] == want
    for r, (tok, entry) in enumerate(out):  # log-probs stay those of the raw logits
        assert entry["logprob"] == pytest.approx(float(torch.log_softmax(raw[r], -1)[tok]), abs=1e-6)
        assert set(entry["top"]) == {int(raw[r].argmax())}


def test_greedy_with_random_bias_picks_the_oracles_argmax():
    g = torch.Generator().manual_seed(2)
    changed = 0
    for _ in range(20):
        logits = torch.randn(V, generator=g) * 2
        ids = torch.randperm(V, generator=g)[:8].tolist()
        bias = {t: float(torch.empty(()).uniform_(-6, 6, generator=g)) for t in ids}
        want = int(ref_bias(logits, bias).argmax())
        assert Sampler()(logits.unsqueeze(0), [seq_with([1], temperature=0.0, logit_bias=bias)])[0][0] == want
        changed += want != int(logits.argmax())
    assert changed >= 5


@pytest.mark.parametrize("extra", [dict(), dict(top_k=30), dict(top_p=0.999), dict(top_k=1500), dict(min_p=0.01)],
                         ids=["full-softmax", "top-k", "vocab-sort", "wide-top-k", "min-p"])
def test_sampled_rows_only_draw_allowed_ids(extra):
    g = torch.Generator().manual_seed(3)
    vocab = 2048 if extra.get("top_k", 0) > 1024 else 200
    logits = torch.randn(vocab, generator=g) * 2
    allowed = sorted(torch.randperm(vocab, generator=g)[:6].tolist())
    logits[allowed] = torch.randn(6, generator=g) * 0.5 - 3  # below most others: the mask decides, not top-k/p
    n = 600
    seqs = [seq_with([1], temperature=1.0, seed=100 + i, allowed_token_ids=allowed, **extra) for i in range(n)]
    drawn = [t for t, _ in Sampler()(logits.expand(n, -1).contiguous(), seqs)]
    assert set(drawn) <= set(allowed)
    probs = torch.softmax(ref_bias(logits, None, allowed), -1)  # the oracle's distribution over the allowed ids
    likely = {t for t in allowed if probs[t] > 0.02}
    assert len(likely) >= 3 and likely <= set(drawn)  # really sampled among them, not one forced id
    # greedy: the best allowed id
    assert Sampler()(logits.unsqueeze(0), [seq_with([1], temperature=0.0, allowed_token_ids=allowed)])[0][0] == \
        max(allowed, key=lambda t: float(logits[t]))


def test_sampled_rows_follow_the_biased_distribution():
    # a +3 bias on token 0 of uniform logits: p(0) = e^3 / (e^3 + V - 1)
    vocab, n = 16, 4000
    seqs = [seq_with([1], temperature=1.0, seed=i, logit_bias={0: 3.0}) for i in range(n)]
    drawn = [t for t, _ in Sampler()(torch.zeros(n, vocab), seqs)]
    p = torch.e ** 3 / (torch.e ** 3 + vocab - 1)
    assert abs(drawn.count(0) / n - p) < 0.03


def test_eos_only_allowed_when_listed_and_min_tokens_still_bans_it():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0]])  # 2 is EOS and by far the most likely
    assert Sampler()(logits, [seq_with([0], eos=frozenset({2}), temperature=0.0, allowed_token_ids=[1, 3])])[0][0] == 3
    assert Sampler()(logits, [seq_with([0], eos=frozenset({2}), temperature=0.0, allowed_token_ids=[1, 2])])[0][0] == 2
    # listed, but min_tokens bans EOS for the first token: the other allowed id
    s = seq_with([0], eos=frozenset({2}), temperature=0.0, allowed_token_ids=[1, 2], min_tokens=1)
    assert Sampler()(logits, [s])[0][0] == 1
    # the bias comes before the penalties: a penalised token's bias is penalised too (repetition divides the
    # biased positive logit), so token 3 (seen, 2 + 6 = 8 -> 8 / 4 = 2) loses to token 1 (1 + 1.5 = 2.5)
    s = seq_with([3], temperature=0.0, logit_bias={3: 6.0, 1: 1.5, 2: -100.0}, repetition_penalty=4.0)
    assert Sampler()(logits, [s])[0][0] == 1


def test_rows_without_bias_are_bitwise_unaffected_and_seeds_batch_invariant(monkeypatch):
    g = torch.Generator().manual_seed(5)
    plain = [dict(temperature=0.0), dict(temperature=1.0, seed=11), dict(temperature=0.7, top_k=5, seed=12),
             dict(temperature=1.2, top_p=0.8, seed=13), dict(temperature=0.9, seed=14, logprobs=3)]
    fancy = [dict(temperature=0.0, logit_bias={4: 3.0, 9: -2.0}),
             dict(temperature=1.0, seed=21, allowed_token_ids=[1, 2, 3, 250]),
             dict(temperature=0.8, seed=22, logit_bias={7: 1.0}, allowed_token_ids=[7, 8], top_k=3),
             dict(temperature=1.0, seed=23, logit_bias={0: 50.0}, presence_penalty=1.0)]
    seen = []
    real = sampler_mod.sample_rows

    def spy(x, *args, **kw):
        seen.append(x.clone())
        return real(x, *args, **kw)

    monkeypatch.setattr(sampler_mod, "sample_rows", spy)
    fancy_alone = Sampler()
    fancy_seqs = [seq_with([5, 6], **p) for p in fancy]  # drawn alone, step after step
    fancy_mixed = [seq_with([5, 6], **p) for p in fancy]  # the same requests, batched with the plain rows
    mixed_sampler = Sampler()
    for _ in range(3):
        logits = torch.randn(len(plain) + len(fancy), 300, generator=g)
        alone = [seq_with([5, 6], **p) for p in plain]
        mixed = fancy_mixed[:2] + [seq_with([5, 6], **p) for p in plain] + fancy_mixed[2:]
        order = [len(plain), len(plain) + 1, *range(len(plain)), len(plain) + 2, len(plain) + 3]
        mixed_logits = logits[order]  # plain rows sit at 2..6 among the biased ones
        a = Sampler()(logits[:len(plain)], alone)
        b = mixed_sampler(mixed_logits, mixed)
        assert b[2:2 + len(plain)] == a
        x_mixed = seen[-1]
        assert torch.equal(x_mixed[2:2 + len(plain)], logits[:len(plain)])  # bit for bit, untouched
        for j, r in enumerate((0, 1, 7, 8)):  # the biased rows match the oracle and each one drawn alone
            p = fancy[j]
            want = ref_bias(mixed_logits[r], p.get("logit_bias"), p.get("allowed_token_ids"))
            if j < 3:  # (the last row's presence penalty has nothing to act on: no output yet)
                assert torch.equal(x_mixed[r], want)
            one = fancy_alone(mixed_logits[r:r + 1], [fancy_seqs[j]])[0][0]
            assert b[r][0] == one
            assert p.get("allowed_token_ids") is None or one in p["allowed_token_ids"]
        for j, r in enumerate((0, 1, 7, 8)):
            fancy_seqs[j].append_token(b[r][0])
            fancy_mixed[j].append_token(b[r][0])


def test_bias_indexes_reach_the_device_as_python_lists(monkeypatch):
    """_host_list's pinned CUDA copy needs a Python list (torch.tensor(ndarray, pin_memory=True) raises on CUDA)."""
    real = sampler_mod._host_list

    def only_lists(values, *args, **kwargs):
        assert isinstance(values, list), type(values)
        return real(values, *args, **kwargs)

    monkeypatch.setattr(sampler_mod, "_host_list", only_lists)
    seqs = [seq_with([1], temperature=0.0, logit_bias={3: 5.0}, allowed_token_ids=[3, 4]),
            seq_with([1], temperature=1.0, seed=1), seq_with([1], temperature=0.5, allowed_token_ids=[9])]
    out = Sampler()(torch.randn(3, 20), seqs)
    assert out[0][0] == 3 and out[2][0] == 9


# ------------------------------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=13)
    return path, load_hf(path)


PROMPT = [5, 17, 40, 41, 42, 90, 33]


@torch.no_grad()
def hf_biased_greedy(hf, prompt: list[int], n: int, bias=None, allowed=None) -> tuple[list[int], list[float]]:
    """Greedy decoding with the HF model's own forward, each step's logits through the oracle; returns the
    tokens and each one's raw log-prob."""
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
        tok = int(torch.argmax(ref_bias(logits, bias, allowed)))
        out.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return out, lps


def test_engine_greedy_with_bias_and_allowed_ids_matches_the_hf_oracle(ckpt):
    path, hf = ckpt
    n = 8
    plain, _ = hf_biased_greedy(hf, PROMPT, n)
    # a bias forcing a token sequence: +100 on the tokens of a target in turn is a per-step change; with one
    # static bias, +100 forces one token every step, and a mix of moderate biases steers the whole sequence
    forced = 77 if 77 not in plain else 78
    steer = {t: -100.0 for t in set(plain)} | {3: 1.0, 11: 2.0}
    allowed = sorted({3, 11, 19, 64, 100, forced})
    reqs = {"plain": {}, "force": dict(logit_bias={str(forced): 100}), "steer": dict(logit_bias=steer),
            "allowed": dict(allowed_token_ids=allowed),
            "both": dict(allowed_token_ids=allowed, logit_bias={"19": 5.0, "100": -100})}
    engine = make_engine(path, dtype="float32")
    out = run_to_completion(engine, {k: (PROMPT, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                                logprobs=0, **kw)) for k, kw in reqs.items()})
    assert out["plain"].token_ids == plain
    want, lps = hf_biased_greedy(hf, PROMPT, n, bias={forced: 100.0})
    assert out["force"].token_ids == want == [forced] * n
    # log-probs returned stay the raw model's (the forced token is unlikely under the model)
    got_lps = [e["logprob"] for e in out["force"].logprobs]
    assert got_lps == pytest.approx(lps, abs=1e-4)
    assert max(got_lps) < -1.0
    want, _ = hf_biased_greedy(hf, PROMPT, n, bias=steer)
    assert out["steer"].token_ids == want and not set(want) & set(plain)
    want, _ = hf_biased_greedy(hf, PROMPT, n, allowed=allowed)
    assert out["allowed"].token_ids == want and set(want) <= set(allowed)
    want, _ = hf_biased_greedy(hf, PROMPT, n, bias={19: 5.0, 100: -100.0}, allowed=allowed)
    assert out["both"].token_ids == want and 100 not in want


def test_engine_refuses_ids_outside_the_vocabulary(ckpt):
    path, _ = ckpt
    engine = make_engine(path, dtype="float32")
    vocab = engine.vocab_size
    for kw, param in ((dict(logit_bias={str(vocab): 1.0}), "logit_bias"),
                      (dict(allowed_token_ids=[0, vocab + 5]), "allowed_token_ids")):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("r", PROMPT, SamplingParams(**kw))
        assert "outside the vocabulary" in str(info.value) and info.value.param == param
    assert not engine.has_unfinished()


# ------------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def served(ckpt):
    path, hf = ckpt
    engine = make_engine(path, dtype="float32", max_model_len=64)
    with ServerThread(create_app(engine, "m", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
                      ) as url:
        yield url, engine


def post(url: str, route: str, **fields) -> httpx.Response:
    body = {"model": "m", "max_tokens": 4, "temperature": 0, **fields}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    body.setdefault("prompt", PROMPT)
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_server_applies_logit_bias_and_allowed_token_ids(served, route):
    url, engine = served
    forced = engine.tokenizer.encode("zq", add_special_tokens=False)[0]
    r = post(url, route, logit_bias={str(forced): 100})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"] if route == "chat" else r.json()["choices"][0]["text"]
    assert text == engine.tokenizer.decode([forced] * 4)
    r = post(url, route, allowed_token_ids=[forced])
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"] if route == "chat" else r.json()["choices"][0]["text"]
    assert text == engine.tokenizer.decode([forced] * 4)
    # streamed too
    r = post(url, route, logit_bias={str(forced): 100}, stream=True)
    assert r.status_code == 200 and engine.tokenizer.decode([forced]) in r.text


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("fields, param, message", [
    (dict(logit_bias={"5": 150}), "logit_bias", "logit_bias values must be numbers in [-100, 100], got 150"),
    (dict(logit_bias={"abc": 1}), "logit_bias", "logit_bias keys must be token ids"),
    (dict(logit_bias={"5": "x"}), "logit_bias", "logit_bias"),
    (dict(logit_bias={"1000000": 1}), "logit_bias", "logit_bias has token ids outside the vocabulary [0, "),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=[3, 1000000]), "allowed_token_ids",
     "allowed_token_ids has token ids outside the vocabulary [0, "),
    (dict(allowed_token_ids=[True]), "allowed_token_ids", "allowed_token_ids"),
])
def test_server_bad_values_are_400_with_param(served, route, fields, param, message):
    url, engine = served
    for stream in (False, True):
        r = post(url, route, stream=stream, **fields)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert message in err["message"], err
        assert err["param"] == param and err["type"] == "invalid_request_error"
    assert not engine.has_unfinished()


def test_openai_client_round_trip(served):
    url, engine = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    forced = engine.tokenizer.encode("zq", add_special_tokens=False)[0]
    # the python client takes int keys too; JSON turns them into strings
    c = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={forced: 100}, logprobs=1)
    assert c.choices[0].text == engine.tokenizer.decode([forced] * 3)
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, extra_body={"allowed_token_ids": [forced]})
    assert chat.choices[0].message.content == engine.tokenizer.decode([forced] * 3)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=3, logit_bias={str(engine.vocab_size): 1})
    assert "logit_bias has token ids outside the vocabulary" in str(info.value)


def test_readme_documents_logit_bias_and_no_longer_lists_it_as_refused():
    import re
    from pathlib import Path

    text = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    refused = re.search(r"Parameters the engine cannot honour yet \(([^)]*)\)", text)
    assert refused is not None and "logit_bias" not in refused.group(1)
    assert "`logit_bias` (token id" in text and "`allowed_token_ids` (only these ids" in text
