"""Prompt log-probabilities (vLLM's ``SamplingParams.prompt_logprobs``) and completions ``echo`` (what
lm-evaluation-harness' ``local-completions`` loglikelihood requests send: ``echo: true``, ``logprobs: k``,
``max_tokens: 0`` or 1, prompt as token ids).

Oracle: transformers' own forward pass of the same tiny random checkpoint (written with save_pretrained) in
float32: ``log_softmax(model(prompt).logits)`` row ``i - 1`` is prompt token ``i``'s distribution. Checked for
a dense (Llama) and an MLA+MoE (DeepSeek-V3) model, with whole and chunked prefill, with prefix caching on
(a request asking for prompt log-probs does not read the cache, so a warm cache changes nothing), in a batch
with other requests (whose outputs stay bit for bit what they are without it), through every output kind,
``LLM.generate`` and the OpenAI-compatible server (parsed by the real ``openai`` client).
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from atomtool.errors import InvalidRequestError
from atomtool.serve import LLM
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.engine.llm_engine import LLMEngine
from atomtool.serve.engine.prompt_logprobs import plan_prompt_logprobs
from atomtool.serve.engine.scheduler import SchedulerOutput
from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.sampling_params import SamplingParams
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import assert_no_leaks, load_hf, one_torch_thread  # noqa: F401
from tests.test_server_support import sse_events

ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory=4 << 20, max_model_len=96, block_size=4)
NAME = "tiny"
ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def model(request, tmp_path_factory):
    """(checkpoint dir, transformers model in float32) of one architecture."""
    ckpt = write_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    return str(ckpt), load_hf(ckpt)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    ckpt = write_hf_checkpoint(tmp_path_factory.mktemp("llama_srv"), "llama", seed=5)
    return str(ckpt), load_hf(ckpt)


def oracle(hf, ids: list[int]) -> torch.Tensor:
    """[P, vocab] float32 log-probs of transformers' forward over ``ids`` (row i: the token after i)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_against_oracle(entries, ids: list[int], lp: torch.Tensor, k: int) -> None:
    """Every prompt position's entry: None first, then the prompt token's log-prob and the top-k (ids in
    decreasing log-prob order, values) of transformers' distribution."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        e = entries[i]
        assert e["token_id"] == ids[i]
        assert e["logprob"] == pytest.approx(lp[i - 1, ids[i]].item(), abs=ATOL)
        vals, top_ids = torch.topk(lp[i - 1], k)
        assert list(e["top"]) == top_ids.tolist()
        assert list(e["top"].values()) == pytest.approx(vals.tolist(), abs=ATOL)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Add the requests, step to the end; {request id: [its outputs]}."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    assert_no_leaks(engine)
    return outs


PROMPT = [7, 40, 41, 52, 60, 33, 18, 90, 91, 12, 5, 77, 64, 23, 8, 99, 41, 52, 60, 31, 19, 70]


def test_sampling_params_prompt_logprobs_validation():
    assert SamplingParams(prompt_logprobs=0).validate().prompt_logprobs == 0
    assert SamplingParams().validate().prompt_logprobs is None
    for bad in (21, -1, True, 2.0, "3"):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs must be between 0 and 20") as exc:
            SamplingParams(prompt_logprobs=bad).validate()
        assert exc.value.param == "prompt_logprobs"


@pytest.mark.parametrize("chunk", [8192, 5])
def test_prompt_logprobs_equal_transformers(model, chunk):
    """Whole prefill and chunks of 5 tokens (a chunk boundary inside the prompt: each chunk's positions)."""
    ckpt, hf = model
    engine = LLMEngine.from_model(ckpt, **ENGINE_KW, max_num_batched_tokens=chunk)
    outs = run(engine, {"a": (PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5))})["a"]
    check_against_oracle(outs[0].prompt_logprobs, PROMPT, oracle(hf, PROMPT), 5)
    assert outs[-1].prompt_logprobs is outs[0].prompt_logprobs  # cumulative: every output carries them


def test_prompt_logprobs_zero_top_and_one_token_prompt(llama):
    ckpt, hf = llama
    engine = LLMEngine.from_model(ckpt, **ENGINE_KW)
    outs = run(engine, {"zero": (PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0)),
                        "one": ([9], SamplingParams(max_tokens=1, prompt_logprobs=3))})
    lp = oracle(hf, PROMPT)
    zero = outs["zero"][0].prompt_logprobs
    assert zero[0] is None and all(e["top"] == {} for e in zero[1:])
    assert [e["logprob"] for e in zero[1:]] == pytest.approx(
        [lp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))], abs=ATOL)
    assert outs["one"][0].prompt_logprobs == [None]


def test_prefix_cache_is_not_read_and_results_are_identical(llama):
    """A warm prefix cache holding the whole prompt: the prompt-logprobs request computes every position
    anyway (num_cached_tokens 0) and gets exactly what a cold engine gives; its blocks still serve others."""
    ckpt, hf = llama
    cold = run(LLMEngine.from_model(ckpt, **ENGINE_KW, enable_prefix_caching=False),
               {"a": (PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4))})["a"]
    engine = LLMEngine.from_model(ckpt, **ENGINE_KW, enable_prefix_caching=True)
    run(engine, {"warm": (PROMPT, SamplingParams(max_tokens=2, temperature=0))})
    hits = engine.stats()["prefix_cache_hit_tokens"]
    warm = run(engine, {"a": (PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4))})["a"]
    assert warm[0].num_cached_tokens == 0 and engine.stats()["prefix_cache_hit_tokens"] == hits
    assert warm[0].prompt_logprobs == cold[0].prompt_logprobs
    assert warm[-1].token_ids == cold[-1].token_ids
    check_against_oracle(warm[0].prompt_logprobs, PROMPT, oracle(hf, PROMPT), 4)
    again = run(engine, {"b": (PROMPT, SamplingParams(max_tokens=1))})["b"]
    assert again[0].num_cached_tokens > 0  # without prompt_logprobs the cache is read as before


@pytest.mark.parametrize("budget", [9, 4])
def test_batch_with_other_requests(model, budget):
    """A prompt-logprobs request prefilled (in chunks) next to other prefills and decodes: its entries equal
    the oracle's, and the others' outputs (tokens, log-probs, text) are bit for bit those of the same batch
    without prompt log-probs. Budget 4 beside 3 decodes: the prompt goes one token per step, in batches
    where every sequence has one query token (shaped like a decode batch, which a CUDA graph would replay)."""
    ckpt, hf = model
    others = {f"o{i}": ([3 + i, 50, 51 + i, 9, 70 - i, 11][: 3 + i], SamplingParams(
        max_tokens=30, temperature=0.8, seed=i, logprobs=2, ignore_eos=True)) for i in range(3)}

    def all_outputs(with_prompt_lps: bool):
        engine = LLMEngine.from_model(ckpt, **ENGINE_KW, max_num_batched_tokens=budget,
                                      enable_prefix_caching=False)
        got = {rid: [] for rid in [*others, "long"]}
        for rid, (ids, p) in others.items():
            engine.add_request(rid, ids, p)
        for o in engine.step():
            got[o.request_id].append(o)
        engine.add_request("long", PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                          prompt_logprobs=3 if with_prompt_lps else None))
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id].append(o)
        return got

    a, b = all_outputs(True), all_outputs(False)
    check_against_oracle(a["long"][0].prompt_logprobs, PROMPT, oracle(hf, PROMPT), 3)
    for rid in [*others, "long"]:
        strip = [dataclasses.replace(o, prompt_logprobs=None) for o in a[rid]]
        assert strip == b[rid]
    assert a["long"][0].prompt_logprobs is not None and b["long"][0].prompt_logprobs is None


def test_output_kinds_deliver_prompt_logprobs_once(llama):
    ckpt, _ = llama
    engine = LLMEngine.from_model(ckpt, **ENGINE_KW, max_num_batched_tokens=6)
    base = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = run(engine, {kind: (PROMPT, dataclasses.replace(base, output_kind=kind))
                        for kind in ("cumulative", "delta", "final_only")})
    ref = outs["cumulative"][0].prompt_logprobs
    assert len(ref) == len(PROMPT)
    assert all(o.prompt_logprobs is ref for o in outs["cumulative"])
    # the three prompts share the step budget, so their chunks differ: equal up to float rounding
    assert_close(outs["delta"][0].prompt_logprobs, ref)
    assert all(o.prompt_logprobs is None for o in outs["delta"][1:]) and len(outs["delta"]) == 4
    assert len(outs["final_only"]) == 1
    assert_close(outs["final_only"][0].prompt_logprobs, ref)


def assert_close(entries, ref) -> None:
    assert len(entries) == len(ref) and entries[0] is None
    for e, r in zip(entries[1:], ref[1:], strict=True):
        assert e["token_id"] == r["token_id"] and list(e["top"]) == list(r["top"])
        assert e["logprob"] == pytest.approx(r["logprob"], abs=ATOL)
        assert list(e["top"].values()) == pytest.approx(list(r["top"].values()), abs=ATOL)


def test_abort_during_prefill_has_no_prompt_logprobs(llama):
    ckpt, _ = llama
    engine = LLMEngine.from_model(ckpt, **ENGINE_KW, max_num_batched_tokens=5)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert engine.step() == []  # first chunk only
    out = engine.abort("a")
    assert out.finish_reason == "abort" and out.prompt_logprobs is None
    assert not engine._prompt_logprobs_pending
    assert_no_leaks(engine)


def test_plan_skips_positions_already_computed():
    """A preempted request recomputes its prompt from position 0: positions whose entries it already has get
    no rows (no duplicates); the last prompt position (it predicts the first generated token) never does."""
    seq = Sequence("r", list(range(10, 22)), SamplingParams(prompt_logprobs=1).validate())
    seq.prompt_logprobs += [{"token_id": t} for t in seq.token_ids[1:7]]  # tokens 1..6 done
    other = Sequence("o", [1, 2, 3], SamplingParams().validate())
    plan = plan_prompt_logprobs(SchedulerOutput(seqs=[other, seq], num_new_tokens=[3, 12]))
    assert plan.seqs == [seq] and plan.counts == [5]
    assert plan.rows == [3 + j for j in range(6, 11)]  # positions 6..10 of seq, after other's 3 tokens
    assert plan.targets == seq.token_ids[7:12]
    assert plan_prompt_logprobs(SchedulerOutput(seqs=[other], num_new_tokens=[3])) is None


def test_llm_generate_passes_prompt_logprobs(llama):
    ckpt, hf = llama
    llm = LLM(ckpt, **ENGINE_KW)
    text = "Hello, world"
    out = llm.generate(text, SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    check_against_oracle(out.prompt_logprobs, ids, oracle(hf, ids), 3)
    assert llm.generate(text, SamplingParams(max_tokens=2))[0].prompt_logprobs is None


# ------------------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server(llama):
    engine = LLMEngine.from_model(llama[0], **ENGINE_KW)
    with ServerThread(create_app(engine, NAME)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def expected_prompt_part(tok, ids, lp, k):
    """OpenAI's echo log-probs of a prompt: tokens, token_logprobs (first null), top_logprobs (first null;
    the top k plus the token itself), text_offset (running lengths of the decoded text, special tokens
    taking no room as in the echoed text)."""
    tokens = [tok.decode([t]) for t in ids]
    logps = [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    tops = [None]
    for i in range(1, len(ids)):
        vals, top_ids = torch.topk(lp[i - 1], k)
        top = {tok.decode([j]): v for j, v in zip(top_ids.tolist(), vals.tolist(), strict=True)}
        top.setdefault(tokens[i], logps[i])
        tops.append(top)
    offsets = [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]  # as the text
    return tokens, logps, tops, offsets


def assert_logprobs(lp, tokens, logps, tops, offsets):
    assert lp.tokens == tokens and lp.text_offset == offsets
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(logps[1:], abs=ATOL)
    for got, want in zip(lp.top_logprobs[1:], tops[1:], strict=True):
        assert set(got) == set(want)
        for key, v in want.items():
            assert got[key] == pytest.approx(v, abs=ATOL)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_max_tokens_0_text_prompt(server, client, llama, stream):
    """The prompt-scoring request: the text is the prompt, the log-probs cover exactly its tokens, nothing is
    generated (finish_reason length, 0 completion tokens); streamed, one chunk carries it all."""
    tok = server[1].tokenizer
    prompt = "The cat sat on the mat."
    ids = tok.encode(prompt)
    want = expected_prompt_part(tok, ids, oracle(llama[1], ids), 2)
    kw = dict(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    if not stream:
        r = client.completions.create(**kw)
        (choice,) = r.choices
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    else:
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 0 and not chunks[-1].choices
        (choice,) = [c.choices[0] for c in chunks if c.choices]  # a single chunk: prompt, log-probs, finish
    assert choice.text == prompt and choice.finish_reason == "length"
    assert_logprobs(choice.logprobs, *want)


def test_echo_with_generation_equals_prompt_then_completion(server, client, llama):
    """echo with max_tokens 3: prompt part as above, then exactly the non-echo response's generated part
    (offsets shifted by the prompt's length); the stream's chunks join to the same, the first one holding
    the prompt and the first generated text (vLLM's stream)."""
    tok = server[1].tokenizer
    prompt = "Once upon"
    ids = tok.encode(prompt)
    kw = dict(model=NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    echo = client.completions.create(**kw, echo=True).choices[0]
    assert echo.text == prompt + plain.text
    n = len(ids)
    # (openai's Logprobs type declares list[float]; its parser keeps OpenAI's own nulls of echo, so no validation)
    head = SimpleNamespace(tokens=echo.logprobs.tokens[:n], token_logprobs=echo.logprobs.token_logprobs[:n],
                               top_logprobs=echo.logprobs.top_logprobs[:n], text_offset=echo.logprobs.text_offset[:n])
    assert_logprobs(head, *expected_prompt_part(tok, ids, oracle(llama[1], ids), 3))
    assert echo.logprobs.tokens[n:] == plain.logprobs.tokens
    assert echo.logprobs.token_logprobs[n:] == plain.logprobs.token_logprobs
    assert echo.logprobs.top_logprobs[n:] == plain.logprobs.top_logprobs
    assert echo.logprobs.text_offset[n:] == [o + len(prompt) for o in plain.logprobs.text_offset]

    chunks = [c.choices[0] for c in client.completions.create(**kw, echo=True, stream=True)]
    assert chunks[0].text.startswith(prompt) and len(chunks[0].logprobs.tokens) > n
    assert "".join(c.text for c in chunks) == echo.text
    joined = [t for c in chunks for t in c.logprobs.tokens]
    assert joined == echo.logprobs.tokens
    assert [o for c in chunks for o in c.logprobs.text_offset] == echo.logprobs.text_offset
    assert [v for c in chunks for v in c.logprobs.token_logprobs] == echo.logprobs.token_logprobs

    no_lp = client.completions.create(**{**kw, "logprobs": None}, echo=True).choices[0]
    assert no_lp.text == echo.text and no_lp.logprobs is None


def test_echo_batched_token_id_prompts_and_n(server, llama):
    """Token-id prompts, two of them, n=2: each choice echoes its own prompt (decoded) and its log-probs."""
    url, engine = server
    tok = engine.tokenizer
    prompts = [PROMPT[:9], PROMPT[5:17]]
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": prompts, "max_tokens": 0, "echo": True,
                                                  "logprobs": 1, "n": 2}, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for c in r["choices"]:
        ids = prompts[c["index"] // 2]
        assert c["text"] == tok.decode(ids, skip_special_tokens=True)
        lp = SimpleNamespace(**c["logprobs"])
        assert_logprobs(lp, *expected_prompt_part(tok, ids, oracle(llama[1], ids), 1))
    assert r["usage"] == {"prompt_tokens": 9 + 12, "completion_tokens": 0, "total_tokens": 21}


def test_lm_eval_loglikelihood(server, llama):
    """lm-evaluation-harness' local-completions request for loglikelihood(context, continuation): token ids
    context + continuation, echo, logprobs 1, max_tokens 1; it sums token_logprobs[ctxlen:-1] and calls the
    continuation greedy when each token's log-prob is the top one. Both equal transformers'."""
    url, _ = server
    ctx, cont = PROMPT[:12], PROMPT[12:17]
    body = {"model": NAME, "prompt": [ctx + cont], "max_tokens": 1, "echo": True, "logprobs": 1,
            "temperature": 0, "seed": 1234}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(ctx) + len(cont) + 1
    lp = oracle(llama[1], ctx + cont)
    want = sum(lp[len(ctx) + j - 1, cont[j]].item() for j in range(len(cont)))
    assert sum(token_logprobs[len(ctx):-1]) == pytest.approx(want, abs=1e-4)
    tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
    greedy = all(t == max(top.values()) for t, top in zip(token_logprobs[len(ctx):-1], tops, strict=True))
    assert greedy == all(lp[len(ctx) + j - 1].argmax().item() == cont[j] for j in range(len(cont)))
    # the same with max_tokens 0: nothing generated, so no trailing entry to drop
    body["max_tokens"] = 0
    token_logprobs0 = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0][
        "logprobs"]["token_logprobs"]
    assert token_logprobs0 == token_logprobs[:-1]


def test_vllm_prompt_logprobs_field(server, llama):
    """vLLM's ``prompt_logprobs`` request extra: the choice's ``prompt_logprobs`` (None, then {token id:
    {logprob, rank, decoded_token}} with the top k and the prompt token); absent from the JSON otherwise."""
    url, engine = server
    ids = PROMPT[:8]
    lp = oracle(llama[1], ids)
    for stream in (False, True):
        resp = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 2,
                                                         "prompt_logprobs": 2, "stream": stream}, timeout=60)
        if stream:
            choices = [e["choices"][0] for e in sse_events(resp.text.splitlines()) if isinstance(e, dict)]
            with_plp = [c for c in choices if "prompt_logprobs" in c]
            assert len(with_plp) == 1
            plp = with_plp[0]["prompt_logprobs"]
        else:
            plp = resp.json()["choices"][0]["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            vals, top_ids = torch.topk(lp[i - 1], 2)
            for r, (j, v) in enumerate(zip(top_ids.tolist(), vals.tolist(), strict=True)):
                assert plp[i][str(j)]["rank"] == r + 1
                assert plp[i][str(j)]["logprob"] == pytest.approx(v, abs=ATOL)
                assert plp[i][str(j)]["decoded_token"] == engine.tokenizer.decode([j])
            assert plp[i][str(ids[i])]["logprob"] == pytest.approx(lp[i - 1, ids[i]].item(), abs=ATOL)
    plain = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 2}, timeout=60)
    assert "prompt_logprobs" not in plain.json()["choices"][0]


def test_prompt_filling_the_context_with_max_tokens_0(server):
    url, engine = server
    ids = (PROMPT * 5)[:engine.max_model_len]
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                                  "logprobs": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == engine.max_model_len
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ids + [5], "max_tokens": 0,
                                                  "echo": True}, timeout=60)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert_no_leaks(engine)


@pytest.mark.parametrize("body, needle, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20, got 21", "prompt_logprobs"),
    ({"prompt_logprobs": -1, "echo": True, "logprobs": 2}, "prompt_logprobs must be between 0 and 20, got -1",
     "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs", "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens must be at least 1 (0 is allowed only with echo", "max_tokens"),
    ({"max_tokens": 0, "echo": True, "min_tokens": 2}, "min_tokens must be in [0, max_tokens] (max_tokens = 0), "
     "got 2", "min_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens", "max_tokens"),
    ({"echo": True, "logprobs": 21}, "logprobs", "logprobs"),
])
def test_errors_are_400(server, body, needle, param):
    url, engine = server
    for stream in (False, True):
        resp = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, **body,
                                                         "stream": stream}, timeout=60)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert needle in err["message"] and err["param"] == param
    assert_no_leaks(engine)


def test_chat_keeps_refusing_echo(server):
    resp = httpx.post(server[0] + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "echo": True}, timeout=60)
    assert resp.status_code == 400 and "echo" in json.dumps(resp.json())
