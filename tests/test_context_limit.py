"""A completion cut by the context limit (max_model_len) keeps OpenAI's ``finish_reason: "length"`` (as vLLM does)
and says so: ``RequestOutput.context_limit`` in the engine, a one-line stderr note in ``atomtool generate``, a
warning in the server log. A completion cut by ``max_tokens`` is "length" without any of them.

Oracles: the prompt length from the checkpoint's own tokenizer (transformers), and the limits we set.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.serve import LLM, SamplingParams
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.engine.llm_engine import LLMEngine
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import one_torch_thread  # noqa: F401

CONTEXT = 24  # the checkpoint's max_position_embeddings: the engine's max_model_len
PROMPT = "Hello world"
ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory=4 << 20)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return str(write_hf_checkpoint(tmp_path_factory.mktemp("ctx") / "llama", "llama",
                                   max_position_embeddings=CONTEXT))


@pytest.fixture(scope="module")
def prompt_len(ckpt) -> int:
    return len(AutoTokenizer.from_pretrained(ckpt).encode(PROMPT))


def generate(ckpt: str, *args: str):
    r = CliRunner().invoke(app, ["generate", ckpt, "--prompt", PROMPT, "--device", "cpu", "--ignore-eos", *args])
    assert r.exit_code == 0, r.output
    return r.stdout, r.stderr


def test_engine_marks_context_limit(ckpt, prompt_len):
    llm = LLM(ckpt, **ENGINE_KW)
    assert llm.engine.max_model_len == CONTEXT
    cut, short = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=100, ignore_eos=True),
                                                 SamplingParams(max_tokens=3, ignore_eos=True)])
    assert cut.finish_reason == "length" and cut.context_limit == CONTEXT
    assert len(cut.token_ids) == CONTEXT - prompt_len
    assert short.finish_reason == "length" and short.context_limit is None and len(short.token_ids) == 3


def test_generate_notes_the_context_limit(ckpt, prompt_len):
    out, err = generate(ckpt, "--max-tokens", "100", "--json")
    [res] = json.loads(out)
    assert res["finish_reason"] == "length" and len(res["token_ids"]) == CONTEXT - prompt_len
    assert err == (f"note: stopped at the context limit (max_model_len {CONTEXT}): prompt {prompt_len} + "
                   f"output {CONTEXT - prompt_len} tokens\n")
    # several prompts: the note names the one that was cut
    _, err = generate(ckpt, "--max-tokens", str(CONTEXT - prompt_len), "--prompt", PROMPT)
    assert err.splitlines() == [f"note: [{i}] stopped at the context limit (max_model_len {CONTEXT}): prompt "
                                f"{prompt_len} + output {CONTEXT - prompt_len} tokens" for i in (0, 1)]


def test_generate_max_tokens_has_no_note(ckpt):
    out, err = generate(ckpt, "--max-tokens", "4", "--json")
    [res] = json.loads(out)
    assert res["finish_reason"] == "length" and len(res["token_ids"]) == 4
    assert err == ""


@pytest.fixture(scope="module")
def server(ckpt):
    engine = LLMEngine.from_model(ckpt, **ENGINE_KW)
    with ServerThread(create_app(engine, "tiny")) as url:
        yield url


def limit_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "atomtool.serve" and "context limit" in r.getMessage()]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_server_logs_the_context_limit(server, prompt_len, caplog, route):
    caplog.set_level(logging.WARNING, logger="atomtool.serve")
    if route == "completions":  # no max_tokens: OpenAI's default 16 is clamped to the room left
        body = {"prompt": [0] * (CONTEXT - 5), "ignore_eos": True, "temperature": 0}
        n_prompt = CONTEXT - 5
    else:  # no max_tokens: the room left (vLLM)
        body = {"messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True, "temperature": 0}
        n_prompt = None
    r = httpx.post(f"{server}/v1/{'chat/' if route == 'chat' else ''}completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["choices"][0]["finish_reason"] == "length"
    usage = res["usage"]
    assert usage["total_tokens"] == CONTEXT  # what a client can check against /v1/models' max_model_len
    n_prompt = n_prompt or usage["prompt_tokens"]
    [msg] = limit_warnings(caplog)
    assert msg.startswith("request ") and msg.endswith(
        f" stopped at the context limit (max_model_len {CONTEXT}): prompt {n_prompt} + output "
        f"{CONTEXT - n_prompt} tokens; finish_reason 'length'")


def test_server_max_tokens_logs_nothing(server, caplog):
    caplog.set_level(logging.WARNING, logger="atomtool.serve")
    r = httpx.post(f"{server}/v1/completions", json={"prompt": [0, 1, 2], "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 3
    assert limit_warnings(caplog) == []
