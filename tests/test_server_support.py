"""Support for the server tests (no tests here): a scripted engine with the LLMEngine API, SSE helpers.

:class:`ScriptedEngine` implements exactly the API the server uses (``add_request``, ``step``, ``abort``,
``has_unfinished``, ``num_free_blocks``, ``num_total_blocks``, ``max_model_len``, ``stats``, ``tokenizer``)
with a real tokenizer and the engine's own :class:`IncrementalDetokenizer`, but the "model" emits a
chosen token script. It exists for what a random tiny model cannot be made to do on demand: emit a
multi-byte character split over tokens at a known place, fail inside ``step()``, or step slowly.
Everything else is tested against the real engine.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from atomtool.errors import InvalidRequestError
from atomtool.serve.engine.detokenizer import IncrementalDetokenizer
from atomtool.serve.engine.outputs import RequestOutput


@dataclass
class _Req:
    rid: str
    prompt_ids: list[int]
    params: object
    detok: IncrementalDetokenizer
    out_ids: list[int] = field(default_factory=list)
    blocks: int = 0


class ScriptedEngine:
    """Engine stand-in: request ``i`` generates ``script`` (token ids) cyclically, one token per step.

    ``fail_on_step``: raise RuntimeError on that step number (1-based), once. ``step_delay``: seconds
    slept per step. Blocks: ``ceil((prompt + generated) / block_size)`` per running request.
    """

    def __init__(self, tokenizer, script: list[int], *, max_model_len: int = 256, num_blocks: int = 64,
                 block_size: int = 4, fail_on_step: int | None = None, step_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.model_dir = None  # as LLMEngine.model_dir; no checkpoint on disk, so no generation_config defaults
        self.script = script
        self.max_model_len = max_model_len
        self.block_size = block_size
        self._total = num_blocks
        self._reqs: dict[str, _Req] = {}
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.step_delay = step_delay
        self.prompts: dict[str, list[int]] = {}  # request id -> prompt ids, as received

    def add_request(self, request_id: str, prompt, params) -> None:
        params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.prompts[request_id] = ids
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}")
        self._reqs[request_id] = _Req(request_id, ids, params,
                                      IncrementalDetokenizer(self.tokenizer, ids, params.stop))

    def abort(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def num_total_blocks(self) -> int:
        return self._total

    def num_free_blocks(self) -> int:
        return self._total - sum(r.blocks for r in self._reqs.values())

    def stats(self) -> dict:
        return {"num_running": len(self._reqs), "num_waiting": 0}

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_on_step is not None and self.steps == self.fail_on_step:
            raise RuntimeError("injected step failure")
        outs = []
        for rid, r in list(self._reqs.items()):
            tok = self.script[len(r.out_ids) % len(self.script)]
            r.out_ids.append(tok)
            r.blocks = math.ceil((len(r.prompt_ids) + len(r.out_ids)) / self.block_size)
            hit = r.detok.add([tok])
            done = len(r.out_ids) >= r.params.max_tokens or hit is not None
            if done:
                r.detok.flush()
            lp = [{"token_id": tok, "logprob": -0.5, "top": {tok: -0.5}}] if r.params.logprobs is not None else None
            outs.append(RequestOutput(rid, r.prompt_ids, list(r.out_ids), [tok], r.detok.text(final=done),
                                      finish_reason=("stop" if hit else "length") if done else None,
                                      stop_reason=hit, logprobs=lp, finished=done))
            if done:
                del self._reqs[rid]
        return outs


def byte_level_tokenizer():
    """A byte-level BPE tokenizer with no merges: ``<s>``=0, ``</s>``=1, then one token per UTF-8 byte (GPT-2's
    base alphabet), so every non-ASCII character is split over 2-4 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def sse_events(lines) -> list:
    """Parse SSE ``data:`` lines into JSON objects; the final ``[DONE]`` becomes the string "[DONE]"."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@contextlib.contextmanager
def demo_model_client(**engine_kw) -> Iterator:
    """An ``openai.OpenAI`` client of a server (uvicorn in a thread) serving the built-in demo model as ``"m"``
    with a real :class:`LLMEngine` (``engine_kw``: its ``from_model`` arguments, e.g. device, dtype, KV size)."""
    import openai

    from atomtool.serve.api.app import create_app
    from atomtool.serve.api.server import ServerThread
    from atomtool.serve.demo import demo_model_path
    from atomtool.serve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_model(str(demo_model_path()), **engine_kw)
    with ServerThread(create_app(engine, "m")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
