"""The OpenAI-compatible server against the REAL engine on a tiny random Llama, through the real ``openai``
client (and raw httpx where the client hides the wire format), on a live uvicorn server on loopback.

Oracles: the engine's own offline API (``atomtool.serve.LLM``) for generated text, and HF transformers'
forward pass for log-probabilities. Each error status (400, 401, 404) gets its message checked.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from atomtool.serve import LLM, SamplingParams
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.engine.llm_engine import LLMEngine
from tests.checkpoints import write_hf_checkpoint
from tests.test_server_support import byte_level_tokenizer, sse_events

ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory=4 << 20, max_model_len=128)
NAME = "tiny-llama"
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4", "def f(x):", "zzz"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, **ENGINE_KW)


@pytest.fixture(scope="module")
def server(ckpt):
    engine = LLMEngine.from_model(ckpt, **ENGINE_KW)
    app = create_app(engine, NAME)
    with ServerThread(app) as url:
        yield url, engine, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def greedy(offline, prompt, max_tokens=12, **kw):
    return offline.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))[0]


def metric_samples(url):
    """{(name, frozenset(labels)): value} from /metrics, parsed with prometheus_client's own parser."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def assert_openai_error(resp: httpx.Response, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


# ---------------------------------------------------------------------------------------------- basics
def test_health_and_models(server, client):
    url, engine = server[:2]
    assert httpx.get(url + "/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].max_model_len == engine.max_model_len == 128


def test_completions_equal_offline_greedy(client, offline):
    for prompt in PROMPTS[:3]:
        ref = greedy(offline, prompt)
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)

        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        text_chunks = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].text for c in text_chunks) == ref.text
        assert text_chunks[-1].choices[0].finish_reason == ref.finish_reason
        assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_completions_batch_of_prompts_and_token_ids(client, offline, server):
    refs = [greedy(offline, p, max_tokens=6, ignore_eos=True) for p in PROMPTS]
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in r.choices] == [ref.text for ref in refs]
    assert r.usage.prompt_tokens == sum(len(ref.prompt_token_ids) for ref in refs)
    # a prompt given as token ids is the same request
    # n choices per prompt: choice index = prompt index * n + i
    r = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[0].text, refs[0].text, refs[1].text, refs[1].text]
    assert r.usage.prompt_tokens == len(refs[0].prompt_token_ids) + len(refs[1].prompt_token_ids)
    assert r.usage.completion_tokens == 4 * 6
    ids = refs[0].prompt_token_ids
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == refs[0].text


def chat_prompt_ids(offline, messages):
    tok = offline.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_chat_equal_offline_greedy(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    ref = greedy(offline, chat_prompt_ids(offline, messages), max_tokens=10)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)

    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref.text
    assert body[-1].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    # the default max_tokens of chat is the rest of the context
    r = client.chat.completions.create(model=NAME, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 128


def test_raw_sse_wire_format(server):
    url = server[0]
    with httpx.stream("POST", url + "/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = sse_events(raw.splitlines())
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])


# ---------------------------------------------------------------------------------------- sampling
def test_n_and_seed(client, offline):
    kw = dict(model=NAME, prompt="Once upon", max_tokens=10, temperature=1.0, seed=7, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.text for c in b.choices]  # seeded: reproducible
    assert len(set(texts)) > 1  # choice i samples with seed + i
    for i in range(3):
        ref = offline.generate("Once upon", SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i))[0]
        assert texts[i] == ref.text
    streamed = ["", "", ""]
    for c in client.completions.create(**kw, stream=True):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == texts
    # top_k=1 sampling is greedy
    r = client.completions.create(model=NAME, prompt="Once upon", max_tokens=10, temperature=1.0,
                                  extra_body={"top_k": 1})
    assert r.choices[0].text == greedy(offline, "Once upon", max_tokens=10).text


def test_stop_strings_stop_token_ids_min_tokens(client, offline):
    ref = greedy(offline, "Hello", max_tokens=20, ignore_eos=True)
    assert len(ref.text) >= 8
    stop = ref.text[5:7]
    cut = ref.text.index(stop)
    for stop_arg in (stop, [stop, "\x00never"]):
        r = client.completions.create(model=NAME, prompt="Hello", max_tokens=20, temperature=0, stop=stop_arg,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text[:cut]
        assert r.choices[0].finish_reason == "stop"
    third = ref.token_ids[2]
    first_at = ref.token_ids.index(third)
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [third]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first_at + 1
    # min_tokens keeps stop tokens out of the first 6 (vLLM masks them): same as the offline engine
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=20, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [third], "min_tokens": 6})
    want = greedy(offline, "Hello", max_tokens=20, ignore_eos=True, stop_token_ids=[third], min_tokens=6)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.completion_tokens > first_at + 1
    assert offline.tokenizer.decode([third]) not in r.choices[0].logprobs.tokens[:6]


def hf_logprobs(ckpt, prompt_ids, gen_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + gen_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    rows = lp[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(gen_ids)]
    return rows


def test_logprobs_match_transformers(client, offline, ckpt):
    ref = greedy(offline, "Hello", max_tokens=6, ignore_eos=True)
    rows = hf_logprobs(ckpt, ref.prompt_token_ids, ref.token_ids)
    tok = offline.tokenizer
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in ref.token_ids]
    for i, t in enumerate(ref.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(rows[i, t].item(), abs=1e-4)
        top3 = torch.topk(rows[i], 3)
        expect = {tok.decode([j]): v for j, v in zip(top3.indices.tolist(), top3.values.tolist(), strict=True)}
        assert set(lp.top_logprobs[i]) == set(expect)
        for k, v in expect.items():
            assert lp.top_logprobs[i][k] == pytest.approx(v, abs=1e-4)
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(6)]
    # streamed log-probs are the same entries, split over the chunks, with running text offsets
    tokens, logps, offsets = [], [], []
    for chunk in client.completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0, logprobs=3,
                                           stream=True, extra_body={"ignore_eos": True}):
        clp = chunk.choices[0].logprobs
        tokens += clp.tokens
        logps += clp.token_logprobs
        offsets += clp.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert logps == pytest.approx(lp.token_logprobs, abs=1e-6)

    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top token
        assert entry.token == entry.top_logprobs[0].token and entry.bytes == list(entry.token.encode())
    streamed = []
    for chunk in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                                stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


def slow_steps(monkeypatch, engine, seconds=0.02):
    """Make each engine step take at least ``seconds`` so a request is reliably still running."""
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow)


# ---------------------------------------------------------------------------------------- concurrency
def test_32_concurrent_streaming_clients(server, offline, monkeypatch):
    url, engine, app = server
    slow_steps(monkeypatch, engine, 0.03)  # steps slower than request arrival, so batching is observable
    prompts = [f"client {i}: " + "abcdefghij"[: i % 10] for i in range(32)]
    refs = offline.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))

    async def one(aclient, prompt):
        text, reasons = "", []
        stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        return text, reasons[-1]

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    snapshot = app.state.async_engine.snapshot
    steps_before = snapshot.steps
    results = asyncio.run(main())
    assert [t for t, _ in results] == [r.text for r in refs]
    assert all(reason == "length" for _, reason in results)
    # they were batched together: far fewer engine steps than 32 requests x 8 tokens one at a time
    assert snapshot.steps - steps_before < 32 * 8 / 2
    assert not engine.has_unfinished()


def test_client_disconnect_mid_stream_frees_kv_blocks(server, monkeypatch):
    url, engine = server[:2]
    slow_steps(monkeypatch, engine)
    free_before = engine.num_free_blocks()
    aborted_before = metric(metric_samples(url), "atomtool:request_success_total", model_name=NAME,
                            finished_reason="abort")
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": NAME, "prompt": "x" * 40, "max_tokens": 80, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got == 2:
                break
        assert engine.num_free_blocks() < free_before  # the request holds KV blocks now
        assert engine.has_unfinished()
    deadline = time.monotonic() + 10
    while (engine.num_free_blocks() != free_before or engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_free_blocks() == free_before
    assert not engine.has_unfinished()
    assert metric(metric_samples(url), "atomtool:request_success_total", model_name=NAME,
                  finished_reason="abort") == aborted_before + 1


# ---------------------------------------------------------------------------------------- errors
def test_unknown_model_is_404(server, client):
    url = server[0]
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4", prompt="hi")
    assert "The model `gpt-4` does not exist." in str(exc.value)
    err = assert_openai_error(httpx.post(url + "/v1/chat/completions", json={
        "model": "nope", "messages": [{"role": "user", "content": "hi"}]}), 404, "The model `nope` does not exist.")
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert_openai_error(httpx.get(url + "/v1/nothing"), 404, "Not Found")


@pytest.mark.parametrize("body, needle, param", [
    ({"temperature": -1}, "temperature", "temperature"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"n": 0}, "n: Input should be greater than or equal to 1", "n"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"top_k": -5}, "top_k must be -1, 0 or a positive integer", "top_k"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens must be in [0, max_tokens] (max_tokens = 4), got 9",
     "min_tokens"),
    ({"logprobs": 21}, "logprobs", "logprobs"),
    ({"seed": 2**64}, "seed: Input should be less than or equal to", "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5", "presence_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty must be > 0 and finite, got -1", "repetition_penalty"),
    ({"min_p": 2}, "min_p must be in [0, 1], got 2", "min_p"),
    ({"max_tokens": 0, "echo": False}, "0 is allowed only with echo", "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20", "prompt_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options can only be set when stream is true",
     "stream_options"),
    ({"prompt": None}, "prompt", "prompt"),
    ({"prompt": [999999]}, "outside the vocabulary", None),
    ({"prompt": []}, "prompt must not be empty", "prompt"),
])
def test_invalid_completion_parameters_are_400(server, body, needle, param):
    url = server[0]
    req = {"model": NAME, "prompt": "hi", "max_tokens": 4, **body}
    err = assert_openai_error(httpx.post(url + "/v1/completions", json=req), 400, needle)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    # streamed requests fail the same way, before any event
    req["stream"] = True
    req.pop("stream_options", None)
    if "stream_options" not in body:
        assert_openai_error(httpx.post(url + "/v1/completions", json=req), 400, needle)


def test_invalid_chat_requests_are_400(server, client):
    url = server[0]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    assert "top_logprobs requires logprobs to be true" in str(exc.value)
    assert_openai_error(httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": []}), 400,
                        "messages")
    assert_openai_error(httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400,
        "only text parts are supported")
    assert_openai_error(httpx.post(url + "/v1/chat/completions", content=b"{not json",
                                   headers={"content-type": "application/json"}), 400, "JSON")
    assert_openai_error(httpx.post(url + "/v1/chat/completions", json={"model": NAME, "tools": [{"type": "function"}],
                                                                       "messages": [{"role": "user", "content": "x"}]}),
                        400, "tools[0].function: Field required")


def test_prompt_longer_than_context_is_400(server, client, offline):
    url = server[0]
    long_prompt = "y" * 200
    n = len(offline.tokenizer.encode(long_prompt))
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=NAME, prompt=long_prompt, max_tokens=4)
    assert (f"This model's maximum context length is 128 tokens. However, your request has {n} input tokens. "
            "Please reduce the length of the input prompt.") in str(exc.value)
    mid = "y" * 100
    m = len(offline.tokenizer.encode(mid))
    err = assert_openai_error(httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": mid,
                                                                        "max_tokens": 50}),
                              400, f"However, you requested {m + 50} tokens ({m} in the prompt, 50 in the "
                                   "completion)")
    assert err["code"] == "context_length_exceeded"
    err = assert_openai_error(httpx.post(url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": long_prompt}]}), 400, "maximum context length is 128")
    assert err["code"] == "context_length_exceeded"


def test_api_key(ckpt):
    engine = LLMEngine.from_model(ckpt, **ENGINE_KW)
    with ServerThread(create_app(engine, NAME, api_key="s3cret")) as url:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            err = assert_openai_error(httpx.post(url + "/v1/completions", json=body, headers=headers), 401,
                                      "missing or incorrect API key")
            assert err["code"] == "invalid_api_key"
        assert_openai_error(httpx.get(url + "/v1/models"), 401, "API key")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list().data] == [NAME]
        assert good.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        # health and metrics stay open (load balancers, Prometheus)
        assert httpx.get(url + "/health").status_code == 200
        assert 'atomtool:http_requests_total{endpoint="/v1/completions",status="401"} 4.0' in \
            httpx.get(url + "/metrics").text


# ---------------------------------------------------------------------------------------- metrics
def test_metrics_present_and_moving(server, offline, monkeypatch):
    url, engine = server[:2]
    before = metric_samples(url)
    for name in ("atomtool:num_requests_running", "atomtool:num_requests_waiting", "atomtool:kv_cache_usage_perc",
                 "atomtool:time_to_first_token_seconds_count", "atomtool:time_per_output_token_seconds_count",
                 "atomtool:prompt_tokens_total", "atomtool:generation_tokens_total"):
        assert any(n == name for n, _ in before), name
    prompt = "metrics please"
    n_prompt = len(offline.tokenizer.encode(prompt))
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = metric_samples(url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("atomtool:prompt_tokens_total", model_name=NAME) == n_prompt
    assert delta("atomtool:generation_tokens_total", model_name=NAME) == 5
    assert delta("atomtool:time_to_first_token_seconds_count", model_name=NAME) == 1
    assert delta("atomtool:time_per_output_token_seconds_count", model_name=NAME) == 4
    assert delta("atomtool:request_success_total", model_name=NAME, finished_reason="length") == 1
    assert delta("atomtool:http_requests_total", endpoint="/v1/completions", status="200") == 1

    # while a request streams, it is running and holds KV blocks
    slow_steps(monkeypatch, engine)
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": NAME, "prompt": "z" * 50, "max_tokens": 60, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
        next(line for line in lines if line.startswith("data: "))
        during = metric_samples(url)
    assert metric(during, "atomtool:num_requests_running") >= 1
    assert 0 < metric(during, "atomtool:kv_cache_usage_perc") <= 1
    assert metric(during, "atomtool:num_kv_blocks_total") == engine.num_total_blocks()


@pytest.fixture(scope="module")
def trusting_server(ckpt):
    """A server started with --trust-request-chat-template (the module's ``server`` refuses request templates)."""
    with ServerThread(create_app(LLMEngine.from_model(ckpt, **ENGINE_KW), NAME,
                                 trust_request_chat_template=True)) as url:
        yield url


def test_request_level_chat_template(trusting_server, offline):
    url = trusting_server
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 2, "chat_template": template})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(offline.tokenizer.encode("[abc]", add_special_tokens=False))
    bad = "{% for m in messages %}{{ raise_exception('no user turns') }}{% endfor %}"
    assert_openai_error(httpx.post(url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "abc"}], "chat_template": bad}), 400, "no user turns")


def test_json_nan_free_bodies(server):
    """Bodies are strict JSON (no NaN/Infinity), which some clients reject."""
    url = server[0]
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 3, "logprobs": 20})
    assert r.status_code == 200
    json.loads(r.text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


# ---------------------------------------------------------------------------------------- UTF-8
def test_streaming_never_splits_utf8_with_a_byte_level_tokenizer(tmp_path):
    """Real engine + a tokenizer whose tokens are single bytes: sampled text contains multi-byte characters
    whose bytes arrive in different steps; the streamed pieces still concatenate to the exact decode."""
    path = write_hf_checkpoint(tmp_path / "bytes", "llama", tokenizer=False, vocab_size=258)
    tok = byte_level_tokenizer()
    tok.save_pretrained(path)
    kw = dict(ENGINE_KW, max_model_len=256)
    params = dict(max_tokens=100, temperature=1.0, seed=0, ignore_eos=True)
    ref = LLM(str(path), **kw).generate("héllo", SamplingParams(**params))[0]
    expected = tok.decode(ref.token_ids, skip_special_tokens=True)
    assert [c for c in expected if ord(c) > 127 and c != "\ufffd"]  # precondition: multi-byte chars were sampled
    engine = LLMEngine.from_model(str(path), **kw)
    with ServerThread(create_app(engine, NAME)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        whole = client.completions.create(model=NAME, prompt="héllo", extra_body={"ignore_eos": True}, **{
            k: v for k, v in params.items() if k != "ignore_eos"}).choices[0].text
        pieces = [c.choices[0].text for c in client.completions.create(
            model=NAME, prompt="héllo", stream=True, extra_body={"ignore_eos": True},
            **{k: v for k, v in params.items() if k != "ignore_eos"})]
    assert whole == expected
    assert "".join(pieces) == expected
    assert len([p for p in pieces if p]) > 20
