"""A new user's reports on the serving side under pressure: a tiny KV pool forcing preemption, requests at and
beyond ``max_model_len`` (``LLM.generate``, ``atomtool generate``, the HTTP server), streaming clients that
disconnect, many concurrent requests, and ``n`` / ``seed`` / ``stop`` / ``max_tokens`` / ``logprobs`` / usage.

Defects found (each test failed first, marked strict xfail):

- ``LLM(..., max_model_len=0)`` built an engine that refused every prompt ("the prompt has 5 tokens, more than
  max_model_len 0"), and ``max_model_len=-3`` failed with "the KV cache budget (1073741824 bytes) cannot hold
  one block", blaming a 1 GiB budget. Oracle: the engine's own rule for its other sizes ("max_num_seqs must
  be a positive integer, got 0") and ``atomtool serve --max-model-len 0`` ("--max-model-len must be >= 1").
- Chat: a ``max_completion_tokens`` that does not fit the context was a 400 with ``param: "max_tokens"``, a
  field the client never sent. Oracle: README ("a 400 naming the field it came from"; "chat: also
  ``max_completion_tokens`` ... a value the client sends that does not fit is a 400").
- ``LLM.generate`` / ``atomtool generate`` with several prompts, one of them longer than ``max_model_len``:
  "error: the prompt has 2101 tokens, more than max_model_len 1024" did not say which prompt, while the
  context-limit notes of the same command do (``note: [i] stopped at the context limit``). Oracle: README
  ("Every command prints ``error: <what is wrong>``"); the error now starts with ``prompts[i]:`` when there
  are several prompts.

Tried and found as documented (or as vLLM does): greedy and seeded sampled outputs (with penalties, logprobs,
prompt_logprobs) under a pool of 5-8 blocks with chunked prefill, block sizes 1/2/3/16, prefix caching on and
off and small max_num_seqs equal those of a 16384-block pool, every block free afterwards; an explicit
``--max-model-len`` the pool cannot hold is an error, a default one is lowered with a warning; prompts longer
than the context, prompt == max_model_len and prompt + max_tokens over it are 400s with vLLM's message and
``code: context_length_exceeded`` on both endpoints (completions' default max_tokens is clamped, echo with
max_tokens 0 may fill the context); ``atomtool generate`` stops at the context limit with its note;
streaming and non-streaming clients that disconnect (mid-stream, or while queued behind ``--max-num-seqs 1``)
are aborted, /metrics goes back to 0 running / waiting / KV usage and the server keeps answering; 40
concurrent mixed requests on a 6-block pool all succeed; ``n`` with and without ``seed`` (choice i = seed + i,
as vLLM), stop strings spanning token boundaries, straddling the prompt (not matched, as vLLM), held back and
flushed at ``length``, ``include_stop_str_in_output``; ``max_tokens`` 0 (400 unless echo) and 1; logprobs with
n > 1, echo and stop strings, streamed and not (same tokens, offsets and values); usage on both endpoints
with n, several prompts, echo and streaming equal to the non-streamed usage.

Left as they are: completions' legacy log-probs keep the token that holds a stop string (its start is before
the cut), chat's keep every generated token (as vLLM's); the context-limit note / log line is printed also
when max_tokens ended the request at the same token (``context_limit`` is documented as "prompt + output
filled it").
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from atomtool.errors import EngineError, InvalidRequestError
from atomtool.serve import LLM, SamplingParams
from atomtool.serve.demo import DEMO_CHAT_MESSAGE, demo_model_path
from atomtool.serve.engine.llm_engine import LLMEngine
from tests.test_server_support import demo_model_client

openai = pytest.importorskip("openai")


@pytest.mark.parametrize("value", [0, -3])
def test_engine_refuses_a_max_model_len_below_one(value):
    """Expected: an EngineError naming max_model_len (as for max_num_seqs), before any KV budget talk."""
    with pytest.raises(EngineError, match=rf"max_model_len must be a positive integer, got {value}"):
        LLMEngine.from_model(str(demo_model_path()), device="cpu", max_model_len=value)


@pytest.fixture(scope="module")
def client():
    with demo_model_client(device="cpu", dtype="float32", kv_cache_memory=10240 * 4, max_model_len=64) as c:
        yield c


def test_chat_max_completion_tokens_over_the_context_names_that_field(client):
    """Expected: 400 context_length_exceeded with ``param: "max_completion_tokens"`` (the field sent)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": DEMO_CHAT_MESSAGE}],
                                       max_completion_tokens=64)
    assert info.value.body["code"] == "context_length_exceeded"
    assert info.value.body["param"] == "max_completion_tokens"
    # max_tokens keeps its own name
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": DEMO_CHAT_MESSAGE}],
                                       max_tokens=64)
    assert info.value.body["param"] == "max_tokens"


@pytest.fixture(scope="module")
def small_llm():
    return LLM(str(demo_model_path()), device="cpu", max_model_len=32, kv_cache_memory=10240 * 2)


def test_batch_error_names_the_prompt_that_is_too_long(small_llm):
    """Expected: ``prompts[1]: the prompt has 39 tokens, more than max_model_len 32``; nothing left running."""
    sp = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(InvalidRequestError, match=r"^prompts\[1\]: the prompt has 39 tokens, more than "
                                                  r"max_model_len 32$"):
        small_llm.generate([list(range(1, 5)), list(range(1, 40))], sp)
    assert not small_llm.engine.has_unfinished()
    # one prompt: the message stays as it was
    with pytest.raises(InvalidRequestError, match=r"^the prompt has 39 tokens"):
        small_llm.generate(list(range(1, 40)), sp)


def test_generate_cli_names_the_prompt_that_is_too_long():
    """Expected: one ``error: prompts[1]: the prompt has N tokens, more than max_model_len 1024`` line, exit 1."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "atomtool.cli", "generate", str(demo_model_path()), "--prompt", "x",
                             "--prompt", "Beautiful is better than " * 300, "--max-tokens", "2", "--device", "cpu"],
                            capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert errors[0].startswith("error: prompts[1]: the prompt has "), errors[0]
    assert errors[0].endswith("more than max_model_len 1024"), errors[0]
