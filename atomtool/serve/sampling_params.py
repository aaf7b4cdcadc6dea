"""Sampling parameters of one request (vLLM-like)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from atomtool.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1.0 disables nucleus sampling.
    seed: per-request generator seed (reproducible sampling). logprobs: number of top log-probs
    to return per generated token (None: none). stop: strings that end generation (not included in the
    text); stop_token_ids: extra token ids that end generation. min_tokens: EOS/stop are ignored before
    this many tokens.

    Raises:
        InvalidRequestError: from :meth:`validate` for out-of-range values.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def validate(self) -> SamplingParams:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise InvalidRequestError(f"logprobs must be between 0 and 20, got {self.logprobs!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be an integer in the int64 range, got {self.seed!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        return self
