"""A demanding new user's reports on prompt log-probs (completions ``echo`` / vLLM's ``prompt_logprobs``), and
on request output kinds through the engine: each test reproduces what the user saw, against vLLM's documented
behaviour. Oracle: transformers' own forward pass of a tiny random checkpoint (save_pretrained), float32.

Defects found (each fixed; the tests below failed first): vLLM's ``prompt_logprobs`` said ``rank: null`` for a
prompt token outside the top k (vLLM always gives its vocabulary rank); an echo request with max_tokens 0 that
fills the context logged "stopped at the context limit ... output 1 tokens"; an engine abort's cumulative /
final_only output repeated the last step's ``new_token_ids``. Also pinned: lm-eval's local-completions
loglikelihood parse over a batch of token-id prompts (``is_greedy`` by exact float equality).
"""

from __future__ import annotations

import httpx
import pytest
import torch

from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.engine.llm_engine import LLMEngine
from atomtool.serve.sampling_params import SamplingParams
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import load_hf, one_torch_thread  # noqa: F401

ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory=4 << 20, max_model_len=64, block_size=4)
NAME = "tiny"
PROMPT = [7, 40, 41, 52, 60, 33, 18, 90, 91, 12, 5, 77, 64, 23]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(checkpoint dir, transformers model in float32)."""
    ckpt = write_hf_checkpoint(tmp_path_factory.mktemp("llama_fu9"), "llama", seed=9)
    return str(ckpt), load_hf(ckpt)


@pytest.fixture(scope="module")
def server(llama):
    engine = LLMEngine.from_model(llama[0], **ENGINE_KW)
    with ServerThread(create_app(engine, NAME)) as url:
        yield url, engine


def oracle(hf, ids: list[int]) -> torch.Tensor:
    """[P, vocab] float32 log-probs of transformers' forward over ``ids`` (row i: the token after i)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


# ------------------------------------------------------------------------------------------ prompt log-probs
@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_rank_of_the_prompt_token_is_its_vocabulary_rank(server, llama, k):
    # `{"prompt": ids, "prompt_logprobs": 0}` (the cheapest way to score a prompt, what vLLM users send) gave
    # `{"40": {"logprob": -4.6, "rank": null, ...}}` at every position: vLLM's prompt_logprobs always carry the
    # prompt token's rank in the vocabulary (1 = most likely; its Logprob.rank), top-k or not.
    url, _ = server
    lp = oracle(llama[1], PROMPT)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": k}
    for stream in (False, True):
        resp = httpx.post(url + "/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert resp.status_code == 200, resp.text
        if stream:
            from tests.test_server_support import sse_events

            (plp,) = [e["choices"][0]["prompt_logprobs"] for e in sse_events(resp.text.splitlines())
                      if isinstance(e, dict) and "prompt_logprobs" in e["choices"][0]]
        else:
            plp = resp.json()["choices"][0]["prompt_logprobs"]
        assert plp[0] is None
        outside = 0
        for i in range(1, len(PROMPT)):
            want = int((lp[i - 1] > lp[i - 1, PROMPT[i]]).sum()) + 1
            outside += want > k
            assert plp[i][str(PROMPT[i])]["rank"] == want, (i, plp[i])
        assert outside  # the case reported: prompt tokens outside the top k


def test_prompt_logprobs_rank_in_the_engine_with_chunked_prefill_and_row_slices(llama, monkeypatch):
    """The same in ``RequestOutput.prompt_logprobs`` (entries' ``rank``), for two requests asking different
    k in one batch, prefilled in chunks of 5 tokens, their rows projected 3 at a time (slices cut through
    both requests)."""
    import atomtool.serve.engine.prompt_logprobs as plp_mod

    monkeypatch.setattr(plp_mod, "ROWS_PER_SLICE", 3)
    ckpt, hf = llama
    engine = LLMEngine.from_model(ckpt, **{**ENGINE_KW, "max_num_batched_tokens": 5})
    prompts = {"k0": (PROMPT, 0), "k3": (PROMPT[3:] + PROMPT[:2], 3)}
    for rid, (ids, k) in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=1, prompt_logprobs=k))
    got = {}
    while engine.has_unfinished():
        got.update({o.request_id: o.prompt_logprobs for o in engine.step() if o.finished})
    for rid, (ids, k) in prompts.items():
        lp = oracle(hf, ids)
        assert got[rid][0] is None and len(got[rid]) == len(ids)
        for i in range(1, len(ids)):
            e = got[rid][i]
            assert e["token_id"] == ids[i] and len(e["top"]) == k
            assert e["rank"] == int((lp[i - 1] > lp[i - 1, ids[i]]).sum()) + 1


def test_scoring_a_prompt_that_fills_the_context_logs_no_context_limit_warning(server, caplog):
    # lm-eval's rolling loglikelihood scores windows as long as the context with echo and max_tokens 0 (the
    # README's prompt-scoring request). Each such request logged "request ... stopped at the context limit
    # (max_model_len 64): prompt 64 + output 1 tokens; finish_reason 'length'", while the client asked for no
    # output and got none (completion_tokens 0): the one-token engine request behind it is not what the
    # client sees. An ordinary request that does run into the context limit still logs it.
    url, engine = server
    ids = (PROMPT * 5)[:engine.max_model_len]
    with caplog.at_level("WARNING", logger="atomtool.serve"):
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                                      "logprobs": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0
        # no max_tokens: OpenAI's default 16 is cut to the 2 tokens left in the context
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ids[:-2], "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    warned = [m.getMessage() for m in caplog.records if "context limit" in m.getMessage()]
    assert len(warned) == 1 and f"prompt {len(ids) - 2} + output 2 tokens" in warned[0], warned


# ------------------------------------------------------------------------------------------ output kinds
@pytest.mark.parametrize("kind", ["cumulative", "final_only"])
def test_abort_output_generates_no_new_tokens(llama, kind):
    # Streaming from the engine by appending each output's new_token_ids ("ids generated in this step"), the
    # user aborted a request after 3 steps and the abort output's new_token_ids was the third step's token
    # again: the stream got that token twice. An abort generates nothing (the delta kind's abort output
    # already has no new ids).
    engine = LLMEngine.from_model(llama[0], **ENGINE_KW)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                   output_kind=kind))
    streamed = []
    for _ in range(3):
        for out in engine.step():
            streamed += out.new_token_ids
    final = engine.abort("r")
    assert final.finish_reason == "abort" and len(final.token_ids) == 3
    assert final.new_token_ids == []
    if kind == "cumulative":
        assert streamed + final.new_token_ids == final.token_ids


def lm_eval_parse_logprobs(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness' ``LocalCompletionsAPI.parse_logprobs`` (local-completions loglikelihood): per
    choice in index order, the sum of ``token_logprobs[ctxlen:-1]`` and whether every one of those equals the
    largest value of its ``top_logprobs`` (exact float equality, as lm-eval compares)."""
    res = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs, strict=True))
        res.append((sum(tokens_logprobs), is_greedy))
    return res


def test_lm_eval_batched_loglikelihood_with_a_greedy_continuation(server, llama):
    # What lm-eval sends for a batch of loglikelihood(context, continuation) requests: token-id prompts, echo,
    # logprobs 1, max_tokens 1, temperature 0, seed 1234. The continuation that is transformers' own greedy
    # path must come back is_greedy True (its log-prob equal, bit for bit, to the top one), another one not.
    url, _ = server
    hf = llama[1]
    ctx = PROMPT[:8]
    greedy = list(ctx)
    for _ in range(4):
        lp = oracle(hf, greedy)[-1]
        top2 = torch.topk(lp, 2).values
        assert top2[0] - top2[1] > 1e-3  # a clear argmax: the engine's float rounding cannot flip it
        greedy.append(int(lp.argmax()))
    other = ctx + [PROMPT[9], PROMPT[3], PROMPT[12]]
    prompts, ctxlens = [greedy, other], [len(ctx), len(ctx)]
    body = {"model": NAME, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    got = lm_eval_parse_logprobs(resp.json(), ctxlens)
    for (total, is_greedy), ids in zip(got, prompts, strict=True):
        lp = oracle(hf, ids)
        want = sum(lp[j - 1, ids[j]].item() for j in range(len(ctx), len(ids)))
        assert total == pytest.approx(want, abs=1e-4)
        assert is_greedy == all(lp[j - 1].argmax().item() == ids[j] for j in range(len(ctx), len(ids)))
    assert [g for _, g in got] == [True, False]
