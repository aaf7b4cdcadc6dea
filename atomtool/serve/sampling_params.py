"""Sampling parameters of one request (vLLM-like)."""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

from atomtool.errors import InvalidArgumentError, InvalidRequestError


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON Schema (a dict, or its JSON text); the output is one JSON value it accepts.
    - ``json_object``: True; the output is one JSON object (OpenAI's ``response_format`` ``json_object``).
    - ``regex``: the output matches this regular expression (whole output).
    - ``choice``: a non-empty list of strings; the output is exactly one of them.
    - ``grammar``: an EBNF grammar (GBNF / xgrammar dialect, start rule ``root``).

    The engine compiles it with xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
    Generation Engine for Large Language Models") and masks, at every step, the tokens that cannot continue
    a valid output; once the output is complete only EOS may follow, and the request stops with
    ``finish_reason`` "stop" (a ``max_tokens`` cut before that is "length", the output then incomplete).

    Raises:
        InvalidRequestError: from :meth:`validate` (``param="structured_outputs"``): none or several set, a value
            of the wrong type, or a schema that is not JSON (a set in it, nested too deeply for Python's json);
            the engine raises it too for a schema / regex / grammar xgrammar refuses.
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def validate(self) -> StructuredOutputsParams:
        """Check that exactly one constraint is set, with the right type; returns self."""
        def bad(message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param="structured_outputs")

        names = [f.name for f in fields(self)]
        given = [n for n in names if getattr(self, n) not in (None, False)]
        if len(given) != 1:
            raise bad(f"structured outputs need exactly one of {', '.join(names)}; got "
                      f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except RecursionError:  # json.loads recurses once per level
                    raise bad("the json schema is nested too deeply to be read") from None
                except ValueError as exc:
                    raise bad(f"the json schema is not valid JSON: {exc}") from None
            else:
                schema = self.json
            if not isinstance(schema, (Mapping, bool)):
                raise bad(f"the json schema must be a JSON object, got {_short(self.json)}")
            if not isinstance(self.json, str):  # key() writes it as JSON text for the compiler
                try:
                    json.dumps(schema)
                except RecursionError:
                    raise bad("the json schema is nested too deeply to be written as JSON") from None
                except (TypeError, ValueError) as exc:
                    raise bad(f"the json schema is not JSON: {exc}") from None
        if self.json_object not in (None, True, False):
            raise bad(f"json_object must be true or false, got {_short(self.json_object)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(f"{name} must be a non-empty string, got {_short(value)}")
        if self.choice is not None:
            if (isinstance(self.choice, (str, bytes, Mapping)) or not isinstance(self.choice, Iterable)
                    or not (choices := list(self.choice))):
                raise bad(f"choice must be a non-empty list of strings, got {_short(self.choice)}")
            if any(not isinstance(c, str) for c in choices):
                raise bad(f"choice must be a list of strings, got {_short(choices)}")
            self.choice = choices
        return self

    def key(self) -> tuple[str, str]:
        """``(kind, text)``: which constraint and its canonical text (a compiled-grammar cache key)."""
        if self.json is not None:
            # key order is kept: a schema's property order is the order the output writes them in
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar or ""


#: most completions per prompt (``SamplingParams.n``), as the server's ``n``
MAX_N = 128


def seed_generators(seed: int, name: str = "seed") -> None:
    """vLLM's engine seed (``LLM(seed=)``, ``serve --seed``): seed Python's and torch's global generators, so
    requests without their own seed sample the same from one run to the next. Raises InvalidArgumentError
    (named ``name``) for a value torch cannot take: not an integer in the int64 / uint64 range."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64:
        raise InvalidArgumentError(f"{name} must be an integer in the int64 / uint64 range, got {seed!r}")
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of completion ``choice`` of a request seeded ``seed`` (README: choice i samples with ``seed + i``),
    wrapped into the int64 range the seed came from; None stays None. The server's ``n`` and ``LLM.generate``'s
    ``SamplingParams.n`` both use it."""
    return None if seed is None else ((seed + choice + 2**63) % 2**64) - 2**63


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    max_tokens: the most tokens to generate (None: until the context is full, as in vLLM). n: completions per
    prompt (:meth:`atomtool.serve.llm.LLM.generate` returns them as ``RequestOutput.outputs``; choice i samples
    with ``seed + i`` when a seed is given, as the server does; the engine itself runs one per request).
    temperature 0 means greedy (so does a temperature below 1e-5, vLLM's rule: dividing the logits by it would
    overflow). top_k 0 or -1 disables top-k; top_p 1.0 disables nucleus sampling.
    seed: per-request generator seed (reproducible sampling). logprobs: number of top log-probs
    to return per generated token (None: none). stop: strings that end generation (not included in the
    text); stop_token_ids: extra token ids that end generation. min_tokens: EOS/stop are ignored before
    this many tokens: EOS and stop_token_ids are masked for the first min_tokens tokens, and stop strings are
    looked for only in the text after them. include_stop_str_in_output (vLLM's extra of that name): a stop
    string that ends generation stays at the end of the text (the text after it is still dropped); stop
    tokens (EOS, stop_token_ids) are unaffected, they are never in the text. skip_special_tokens (vLLM's field
    of that name, default True): special tokens (chat markup, tool-call tags) are left out of the text; False
    keeps their text (as ``tokenizer.decode(ids, skip_special_tokens=False)`` writes it).

    prompt_logprobs (vLLM's field of that name): number of top log-probs to return for every prompt token
    (None: none; 0..20). The engine then computes the logits of every prompt position during prefill and
    returns ``RequestOutput.prompt_logprobs`` (None for the first token, which nothing predicts). Such a
    request does not read the prefix cache (a cached position has no hidden state to take logits from; vLLM
    skips the cache for these requests too); it still fills it for others.

    Penalties and min_p follow vLLM (and OpenAI for presence/frequency). ``repetition_penalty`` (1.0: off;
    > 1 discourages repeats) divides the positive raw logits and multiplies the non-positive ones of every
    token seen in the prompt or the output so far (transformers' RepetitionPenaltyLogitsProcessor over
    prompt + output ids). ``frequency_penalty`` and ``presence_penalty`` (0.0: off; in [-2, 2]) subtract
    ``frequency_penalty * count + presence_penalty * (count > 0)`` from the raw logit of each token, ``count``
    its occurrences in the output so far (the prompt does not count). Penalties apply before temperature and
    to greedy requests too. ``min_p`` (0.0: off; in [0, 1]) drops, after temperature, every token whose
    probability is below ``min_p`` times the most likely token's (transformers' MinPLogitsWarper); it does
    not change greedy picks. Returned log-probs are always those of the raw logits.

    output_kind (vLLM's ``RequestOutputKind``): what the engine returns for the request each step.
    ``"cumulative"`` (default): after every step that produced a token, the whole state so far (all token
    ids, all stable text, all log-probs). ``"delta"``: only what this step added (its token ids, the text
    that became stable in it, its log-probs; ``RequestOutput.delta`` is True). ``"final_only"``: one output
    when the request finishes or is aborted, equal to the cumulative one of that step. Cumulative outputs
    copy the whole output every step (O(output length) per step); delta and final_only do not.

    ``logit_bias`` (OpenAI's parameter; vLLM's ``logit_bias``): token id -> bias in [-100, 100], added to that
    token's raw logit before anything else in sampling (so it moves greedy picks too: +100 all but forces a
    token, -100 all but bans it); keys may be ints or decimal strings (OpenAI's wire format, JSON object keys
    are strings), at most :data:`MAX_LOGIT_BIAS_ENTRIES` of them. ``allowed_token_ids`` (vLLM's extra): only
    these ids may be picked (every other logit becomes ``-inf``, EOS included unless listed); non-empty.
    Both are checked against the model's vocabulary by :meth:`check_vocab` when the engine takes the request.
    The sampler applies them first, then the ``min_tokens`` EOS/stop ban, then the penalties, then
    temperature, min-p, top-k and top-p (vLLM's v1 sampler order).

    ``structured_outputs`` (:class:`StructuredOutputsParams`, or its dict form): constrain the output to a JSON
    schema, any JSON object, a regex, one of several strings or a grammar; its mask is applied with the
    allowed-token mask (log-probs stay the raw model's).

    Raises:
        InvalidRequestError: from :meth:`validate` for out-of-range or wrongly typed values.
    """

    max_tokens: int | None = 16
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    output_kind: str = "cumulative"
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def validate(self) -> SamplingParams:
        """Check every field's type and range (bools are not integers here; numpy scalars are numbers and are
        turned into Python ones); normalises ``stop`` given as one string to a list and a temperature below
        1e-5 to 0 (greedy). Returns self. Raises InvalidRequestError naming the field (``param``)."""
        def bad(name: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=name)

        if self.max_tokens is not None:  # None: until the context is full (vLLM's meaning)
            if not _is_int(self.max_tokens) or self.max_tokens < 1:
                raise bad("max_tokens", f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
            self.max_tokens = int(self.max_tokens)
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _is_number(self.temperature) or not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise bad("temperature", f"temperature must be >= 0 and finite, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, float(value))
        if not _is_number(self.repetition_penalty) or not (
                self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise bad("repetition_penalty", f"repetition_penalty must be > 0 and finite, got "
                      f"{self.repetition_penalty!r}")
        self.repetition_penalty = float(self.repetition_penalty)
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        self.min_p = float(self.min_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        if self.logprobs is not None:
            if not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20:
                raise bad("logprobs", f"logprobs must be between 0 and 20, got {self.logprobs!r}")
            self.logprobs = int(self.logprobs)
        if self.prompt_logprobs is not None:
            if not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20:
                raise bad("prompt_logprobs",
                          f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs!r}")
            self.prompt_logprobs = int(self.prompt_logprobs)
        if (not _is_int(self.min_tokens) or self.min_tokens < 0
                or (self.max_tokens is not None and self.min_tokens > self.max_tokens)):
            raise bad("min_tokens", f"min_tokens must be in [0, max_tokens] (max_tokens = {self.max_tokens}), got "
                      f"{self.min_tokens!r}")
        self.min_tokens = int(self.min_tokens)
        if self.seed is not None:
            if not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63:
                raise bad("seed", f"seed must be an integer in the int64 range, got {self.seed!r}")
            self.seed = int(self.seed)
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        given = self.stop  # named as the client sent it
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", f"stop must be a non-empty string or a list of non-empty strings, got {given!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, str) or self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got "
                      f"{self.output_kind!r}")
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
                raise bad("allowed_token_ids", f"allowed_token_ids must be a list of token ids, got {_short(ids)}")
            ids = list(ids)
            if not ids:
                raise bad("allowed_token_ids", "allowed_token_ids must not be empty (no token could be generated)")
            wrong = [t for t in ids if not _is_int(t) or not 0 <= t < 2**63]
            if wrong:
                raise bad("allowed_token_ids", f"allowed_token_ids must be non-negative integer token ids, got "
                          f"{', '.join(_short(t) for t in wrong[:10])}")
            self.allowed_token_ids = sorted({int(t) for t in ids})
        if self.structured_outputs is not None:
            so = self.structured_outputs
            if isinstance(so, Mapping):  # the JSON form (vLLM's extra body): {"json": {...}} etc.
                unknown = sorted(set(so) - {f.name for f in fields(StructuredOutputsParams)})
                if unknown:
                    raise bad("structured_outputs", f"unknown structured_outputs field(s): {', '.join(unknown)}")
                so = StructuredOutputsParams(**so)
            if not isinstance(so, StructuredOutputsParams):
                raise bad("structured_outputs", f"structured_outputs must be StructuredOutputsParams or a dict, "
                          f"got {_short(so)}")
            self.structured_outputs = so.validate()
        return self

    def check_vocab(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        """Checks that need the model: every ``logit_bias`` key and ``allowed_token_ids`` entry is in
        ``[0, vocab_size)`` (vLLM validates both against the vocabulary), and ``allowed_token_ids`` leaves a
        token to pick while ``min_tokens`` bans EOS (``eos_token_ids`` unless ``ignore_eos``) and
        ``stop_token_ids``. Call after :meth:`validate`; the engine does, in ``add_request``.

        Raises:
            InvalidRequestError: ``param`` ``logit_bias`` or ``allowed_token_ids``.
        """
        for name, ids in (("logit_bias", list(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            outside = [t for t in ids if not 0 <= t < vocab_size]
            if outside:
                raise InvalidRequestError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): "
                                          f"{outside[:10]}", param=name)
        if self.allowed_token_ids is not None and self.min_tokens > 0:
            banned = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
            if set(self.allowed_token_ids) <= banned:
                raise InvalidRequestError(
                    f"allowed_token_ids {self.allowed_token_ids[:10]} only allows tokens that end generation (EOS "
                    f"or stop_token_ids), which min_tokens = {self.min_tokens} bans for the first "
                    f"{self.min_tokens} tokens: no token could be generated", param="allowed_token_ids")


#: RequestOutput kinds a request may ask for (vLLM's RequestOutputKind: CUMULATIVE, DELTA, FINAL_ONLY)
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


#: most ``logit_bias`` entries one request may send: a bound on the per-step host work of building the bias
#: (OpenAI refuses large objects as well). vLLM has no bound; ``allowed_token_ids`` has none here either (its
#: ids are deduplicated and must be in the vocabulary).
MAX_LOGIT_BIAS_ENTRIES = 1024

#: largest |bias| (OpenAI: "values between -100 and 100")
MAX_LOGIT_BIAS = 100.0


def _checked_logit_bias(bias) -> dict[int, float] | None:
    """``logit_bias`` as ``{token id: float bias}`` (None for None or an empty mapping); keys may be ints or
    decimal strings ("50256", OpenAI's JSON form). Raises InvalidRequestError (param ``logit_bias``)."""
    def bad(message: str) -> InvalidRequestError:
        return InvalidRequestError(message, param="logit_bias")

    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise bad(f"logit_bias must be an object mapping token ids to biases, got {_short(bias)}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if _is_int(key) and 0 <= key < 2**63:
            tid = int(key)
        elif isinstance(key, str) and re.fullmatch(r"[0-9]{1,18}", key):  # int() of 5000 digits would raise
            tid = int(key)
        else:
            shown = repr(key) if isinstance(key, str) and len(key) <= 40 else f"{type(key).__name__} {_short(key)}"
            raise bad(f"logit_bias keys must be token ids (non-negative integers, as strings in JSON), got {shown}")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad(f"logit_bias values must be numbers in [-100, 100], got {_short(value)} for token {tid}")
        if tid in out:
            raise bad(f"logit_bias names token {tid} twice ({key!r} is a second spelling of it)")
        out[tid] = float(value)
    return out or None


#: temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow float32 to inf
SAMPLING_EPS = 1e-5


def _short(v) -> str:
    """``repr(v)`` cut to 40 characters (a key or value sent by a client can be arbitrarily long; the repr of
    an int with more than 4300 digits raises, so such ints are described instead)."""
    if isinstance(v, int) and abs(v) >= 10**40:
        return "a very large integer"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(v) -> bool:
    """An integer (numpy's included), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A real number (numpy's float and integer scalars included), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)
