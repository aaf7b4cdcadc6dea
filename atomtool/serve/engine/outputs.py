"""What the engine returns per request per step (vLLM-like ``RequestOutput``), and vLLM's per-completion view of
it (``CompletionOutput``, ``Logprob``) that :class:`atomtool.serve.llm.LLM` returns as ``RequestOutput.outputs``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability, its 1-based rank when known, and its text when known."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt, vLLM's ``CompletionOutput``: ``index`` (0..n-1), ``text``, ``token_ids``,
    ``cumulative_logprob`` (the sum of the sampled tokens' log-probs; None unless log-probs were requested, as in
    vLLM), ``logprobs`` (None unless requested; per generated token ``{token id: Logprob}`` holding the sampled
    token and the top ones), ``finish_reason`` and ``stop_reason``."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step in which it produced tokens (or finished).

    request_id: the caller's id. prompt_token_ids: the prompt as token ids. token_ids: all generated ids so
    far (stop tokens included, e.g. EOS). new_token_ids: ids generated in this step. text: the full stable
    generated text so far (never shrinks; text that could still turn out to be part of a stop string, or an
    incomplete UTF-8 character, is held back until it is resolved); stop strings are not included.
    finish_reason: None while running, ``"stop"`` (EOS, stop token or stop string), ``"length"``
    (max_tokens or max_model_len) or ``"abort"``. stop_reason: the stop string or token id that ended it.
    context_limit: the engine's max_model_len when the request ended because prompt + output filled the
    context (finish_reason ``"length"``; also when max_tokens ran out at the same token), else None.
    OpenAI's API has one ``"length"`` for both causes (vLLM keeps it), so this is the only way to tell
    them apart.
    logprobs: None unless requested; else one dict per generated token:
    ``{"token_id": int, "logprob": float, "top": {token_id: logprob, ...}}`` (raw model log-probabilities,
    ``top`` holds the requested number of most likely tokens, ties broken by lower id).

    prompt_logprobs: None unless requested (``SamplingParams.prompt_logprobs``); else one item per prompt token:
    None for the first (nothing predicts it), then ``{"token_id", "logprob", "top", "rank"}``: as in
    ``logprobs``, the log-probability of that prompt token given the tokens before it (vLLM's
    ``prompt_logprobs``), and ``rank`` its 1-based place in the vocabulary (ties: lower id first; vLLM's
    ``Logprob.rank``). They are
    complete when the prompt's prefill is, i.e. from the request's first output: cumulative outputs carry them
    every time (the same list, not a copy), a delta request's only in its first output (later ones: None), a
    final_only request's in its one output. An output made before the prefill finished (an abort) has None.

    What the fields hold depends on the request's ``SamplingParams.output_kind`` (vLLM's RequestOutputKind):
    ``"cumulative"`` (default) and ``"final_only"`` outputs are as above (``delta`` False); a final_only
    request gets only its last output (finished or aborted). A ``"delta"`` request's outputs have ``delta``
    True and hold only what this step added: ``token_ids`` and ``new_token_ids`` are this step's ids,
    ``text`` is the text that became stable in this step (held-back text, e.g. a possible stop-string
    prefix, arrives in the step that resolves it; the last output carries whatever was still held back),
    ``logprobs`` this step's entries. Joining a delta request's ``token_ids`` / ``text`` / ``logprobs`` over
    all its outputs gives exactly its cumulative final ``token_ids`` / ``text`` / ``logprobs``.
    num_output_tokens: generated tokens so far, whatever the kind (filled from ``token_ids`` when not
    given for a cumulative output).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    context_limit: int | None = None
    delta: bool = False
    num_output_tokens: int = -1
    prompt_logprobs: list[dict | None] | None = None
    #: vLLM's ``RequestOutput.prompt`` (the prompt text when given as text; filled by LLM.generate / LLM.chat)
    prompt: str | None = None
    #: every completion of the prompt (``SamplingParams.n`` of them; filled by LLM.generate), see :attr:`outputs`
    completions: list[CompletionOutput] | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's ``RequestOutput.outputs``: the prompt's completions (:class:`CompletionOutput`), one unless
        ``n`` > 1; for a single engine output, its own fields as one completion."""
        return self.completions if self.completions is not None else [self.as_completion(0)]

    def as_completion(self, index: int, decode=None) -> CompletionOutput:
        """This output as vLLM's :class:`CompletionOutput` number ``index``; ``decode``: token id -> text, for
        the log-probs' ``decoded_token`` (None: left None)."""
        lps = None
        cumulative = None
        if self.logprobs is not None:
            lps = []
            for e in self.logprobs:
                top = e.get("top") or {}
                ranked = sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))
                entry = {int(t): Logprob(float(v), r + 1, decode(int(t)) if decode else None)
                         for r, (t, v) in enumerate(ranked)}
                tid = int(e["token_id"])
                if tid not in entry:
                    entry = {tid: Logprob(float(e["logprob"]), None, decode(tid) if decode else None), **entry}
                lps.append(entry)
            cumulative = float(sum(e["logprob"] for e in self.logprobs))
        return CompletionOutput(index, self.text, list(self.token_ids), cumulative, lps, self.finish_reason,
                                self.stop_reason)

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0 and not self.delta:
            self.num_output_tokens = len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
