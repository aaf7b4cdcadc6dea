"""Defects found by a fresh user coming from vLLM's offline API (round 15c, session 14); each test reproduces one.

Oracle: vLLM's ``LLM`` / ``SamplingParams`` / ``RequestOutput`` (``outputs: list[CompletionOutput]`` with
``text``, ``token_ids``, ``cumulative_logprob``, ``logprobs`` as ``{token id: Logprob}``, ``finish_reason``,
``stop_reason``; ``SamplingParams.n``; ``max_tokens=None`` = until the context is full; dict prompts
``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``; ``use_tqdm``; ``get_tokenizer()``; ``llm_engine``;
errors are ``ValueError``s).
"""

from __future__ import annotations

import dataclasses

import pytest

from atomtool.errors import ConfigError, InvalidRequestError
from atomtool.serve.demo import demo_model_path
from atomtool.serve.llm import LLM
from atomtool.serve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0)
KW = dict(device="cpu", dtype="float32", kv_cache_memory=1 << 22, max_model_len=128)


@pytest.fixture(scope="module")
def llm():
    return LLM(str(demo_model_path()), **KW)


def test_dict_prompts_are_vllms_text_and_tokens_prompts(llm):
    ids = llm.tokenizer.encode("Beautiful is better than")
    want = llm.generate("Beautiful is better than", GREEDY)[0]
    by_ids = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]  # observed: ran the text 'prompt_token_ids'
    by_text = llm.generate([{"prompt": "Beautiful is better than"}], GREEDY)[0]
    assert by_ids.prompt_token_ids == ids and by_ids.token_ids == want.token_ids
    assert by_text.token_ids == want.token_ids and by_text.prompt == "Beautiful is better than"
    for bad, message in (({"text": "x"}, "a dict prompt holds 'prompt'"), (b"hi", "bytes are not a prompt")):
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate(bad, GREEDY)


def test_outputs_are_vllms_completion_outputs(llm):
    out = llm.generate("Beautiful is better than", GREEDY)[0]
    (c,) = out.outputs  # observed: AttributeError 'outputs'
    assert (c.index, c.text, c.token_ids, c.finish_reason) == (0, out.text, out.token_ids, out.finish_reason)
    assert c.cumulative_logprob is None and c.logprobs is None  # not requested, as in vLLM
    lp = llm.generate("Beautiful is better than", dataclasses.replace(GREEDY, logprobs=2))[0].outputs[0]
    assert len(lp.logprobs) == 4 and all(len(d) >= 2 for d in lp.logprobs)
    first = lp.logprobs[0][lp.token_ids[0]]  # greedy: the sampled token is the most likely one
    assert first.rank == 1 and first.decoded_token == llm.tokenizer.decode([lp.token_ids[0]])
    pairs = zip(lp.logprobs, lp.token_ids, strict=True)
    assert lp.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in pairs))


def test_n_completions_per_prompt_with_seed_plus_i(llm):
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3)  # observed: TypeError 'n'
    out = llm.generate(["Beautiful is", "Simple is"], sp)
    assert [len(o.outputs) for o in out] == [3, 3] and [c.index for c in out[0].outputs] == [0, 1, 2]
    alone = llm.generate("Beautiful is", SamplingParams(max_tokens=6, temperature=1.0, seed=8))[0]
    assert out[0].outputs[1].token_ids == alone.token_ids  # choice 1 samples with seed + 1
    assert out[0].token_ids == out[0].outputs[0].token_ids
    assert sp.n == 3 and sp.seed == 7  # the caller's params are left as given


def test_max_tokens_none_runs_to_the_context_limit(llm):
    out = llm.generate("Beautiful is", SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length"  # observed: "max_tokens must be an integer >= 1, got None"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 128


def test_vllm_methods_and_arguments(llm):
    assert llm.get_tokenizer() is llm.tokenizer and llm.llm_engine is llm.engine
    out = llm.generate("Beautiful is", GREEDY, use_tqdm=True)  # observed: unexpected keyword 'use_tqdm'
    assert len(out) == 1
    chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert chat[0].outputs[0].text == chat[0].text
    with pytest.raises(InvalidRequestError, match="LoRA adapters are not supported"):
        llm.generate("x", GREEDY, lora_request=object())


def test_errors_are_value_errors_that_name_the_input(llm):
    with pytest.raises(ValueError, match="prompt has"):  # observed: not a ValueError
        llm.generate("x " * 400, GREEDY)
    with pytest.raises(InvalidRequestError, match="sampling_params: a SamplingParams or a list"):
        llm.generate("a", {"max_tokens": 3})  # observed: AttributeError 'str' object has no attribute 'validate'
    with pytest.raises(InvalidRequestError, match=r"sampling_params\[1\]: max_tokens"):
        llm.generate(["a", "b"], [GREEDY, SamplingParams(max_tokens=0)])
    caller = SamplingParams(stop="x", temperature=1e-7, max_tokens=2)
    llm.generate("a", caller)
    assert caller.stop == "x" and caller.temperature == 1e-7  # observed: ['x'] and 0.0


def test_constructor_takes_vllms_arguments():
    path = str(demo_model_path())
    llm = LLM(path, seed=0, tensor_parallel_size=1, trust_remote_code=True, swap_space=4, disable_log_stats=True,
              **{**KW, "dtype": "float"})  # observed: TypeError from LLMEngine.from_model, 'unknown dtype float'
    assert llm.generate("Beautiful is", GREEDY)[0].token_ids
    with pytest.raises(TypeError, match=r"LLM\(\) got unexpected keyword argument\(s\) 'no_such_option'"):
        LLM(path, no_such_option=1, **KW)
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 is not supported"):
        LLM(path, tensor_parallel_size=2, **KW)
    with pytest.raises(ConfigError, match="model must be a checkpoint or layout path"):
        LLM(None)
