"""One request's state inside the engine: tokens, KV blocks, progress, sampling state."""

from __future__ import annotations

import enum
import itertools

import torch

from atomtool.serve.sampling_params import SamplingParams

_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request being served.

    token_ids: prompt + generated ids. num_computed_tokens: how many leading tokens have their KV in the
    cache (prefix-cache hits included); the scheduler feeds ``token_ids[num_computed_tokens:]`` in chunks.
    block_table: physical KV block ids, one per ``block_size`` tokens. generator: per-request RNG
    (``params.seed``), so sampling does not depend on the other requests in the batch. context_limit:
    the engine's max_model_len when prompt + output filled it (finish_reason ``"length"``), else None.
    prompt_logprobs: None unless ``params.prompt_logprobs`` is set; else the entries computed so far, one per
    prompt token from the first (None: nothing predicts it), filled chunk by chunk during prefill
    (:mod:`atomtool.serve.engine.prompt_logprobs`); complete once it holds ``num_prompt_tokens`` entries.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.seq_id = next(_counter)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first scheduling
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.context_limit: int | None = None  # max_model_len, when reaching it ended the request ("length")
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[dict | None] | None = [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False  # a delta output already carried them (they go out once)
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        self.detok = None  # IncrementalDetokenizer, set by the engine
        self.grammar = None  # structured.GrammarMatcher of a structured-outputs request, set by the engine
        self.new_token_ids: list[int] = []
        self.num_text_sent = 0  # characters of stable text already returned (output_kind "delta")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """The request asks for prompt log-probs and some prompt positions are not computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.new_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
