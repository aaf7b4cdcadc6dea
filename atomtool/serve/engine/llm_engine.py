"""``LLMEngine``: requests in, tokens out, one scheduling step at a time (vLLM / nano-vllm shape).

add_request -> Scheduler (continuous batching, chunked prefill, preemption) -> ModelRunner (ForwardBatch,
model forward over the paged KV pool) -> Sampler -> stop checks + incremental detokenization ->
``RequestOutput``. The HTTP server drives exactly this API from one thread.
"""

from __future__ import annotations

import json
import math
import operator
import threading
from pathlib import Path
from typing import Any

import torch

from atomtool.errors import EngineError, InvalidArgumentError, InvalidRequestError
from atomtool.serve.engine.block_manager import BlockManager
from atomtool.serve.engine.detokenizer import IncrementalDetokenizer
from atomtool.serve.engine.kv_cache import (
    KVCachePool,
    activation_reserve_bytes,
    bytes_per_block,
    kv_budget_bytes,
)
from atomtool.serve.engine.model_runner import ModelRunner
from atomtool.serve.engine.outputs import RequestOutput
from atomtool.serve.engine.prompt_logprobs import plan_prompt_logprobs
from atomtool.serve.engine.sampler import Sampler
from atomtool.serve.engine.scheduler import Scheduler
from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.engine.structured import GrammarBackend
from atomtool.serve.models.base import CausalLM
from atomtool.serve.sampling_params import SamplingParams


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value if v is not None}


def eos_token_ids(model_dir: Path | None, config: dict[str, Any], tokenizer) -> frozenset[int]:
    """EOS ids: generation_config.json's ``eos_token_id`` (int or list), config.json's, and the tokenizer's."""
    ids = _ids(config.get("eos_token_id"))
    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        # a malformed file adds nothing here; --generation-config auto then refuses it naming the file
        # (generation_defaults), --generation-config none ignores it
        try:
            gen = json.loads((model_dir / "generation_config.json").read_text())
            if isinstance(gen, dict):
                ids |= _ids(gen.get("eos_token_id"))
        except (json.JSONDecodeError, TypeError, ValueError):
            pass
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


class LLMEngine:
    """The serving engine over one model on one device.

    Build with :meth:`from_model` (loads weights, tokenizer, sizes the KV pool). Not thread-safe: one
    caller drives ``add_request`` / ``step`` / ``abort``.
    """

    def __init__(self, model: CausalLM, tokenizer, config: dict[str, Any], *, device: torch.device | str,
                 model_dir: str | Path | None = None, max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, block_size: int = 16, enforce_eager: bool = False,
                 enable_prefix_caching: bool = True) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 1):
            # 0 would build an engine refusing every prompt, a negative value a bogus "KV budget" error
            raise InvalidArgumentError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise InvalidArgumentError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = torch.device(device)
        self.act_quant: str | None = None  # W8A8 mode of FP8 block layers, set by from_model
        self.act_quant_note: str | None = None  # why an explicit --fp8-activations dynamic did not apply
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.enforce_eager = enforce_eager
        self.vocab_size = int(config.get("vocab_size", 0))
        self.eos_token_ids = eos_token_ids(self.model_dir, config, tokenizer)

        limit = int(config.get("max_position_embeddings") or 1 << 20)
        model_max = limit
        capped_by = None  # the model's reason when its context_limit is below max_position_embeddings
        if getattr(model, "context_limit", None) and model.context_limit < limit:
            limit = model.context_limit
            capped_by = getattr(model, "context_limit_reason", None) or "the model's context limit"
        if max_model_len is not None and max_model_len > limit:
            why = f" ({capped_by})" if capped_by else ""
            raise InvalidArgumentError(f"max_model_len {max_model_len} exceeds what the model supports ({limit} tokens{why})")
        want_len = max_model_len or limit
        planes = model.kv_plane_specs()
        reserve = activation_reserve_bytes(config, getattr(model, "dtype", torch.bfloat16), max_num_batched_tokens,
                                           max_num_seqs) if self.device.type == "cuda" else 0
        budget = kv_budget_bytes(self.device, kv_cache_memory=kv_cache_memory,
                                 gpu_memory_utilization=gpu_memory_utilization, activation_reserve=reserve)
        max_blocks = max_num_seqs * math.ceil(want_len / block_size)
        num_blocks = KVCachePool.num_blocks_for(planes, block_size, budget, max_blocks)
        capacity = num_blocks * block_size
        if num_blocks < 1:
            raise EngineError(f"the KV cache budget ({budget} bytes) cannot hold one block of {block_size} tokens "
                              f"({bytes_per_block(planes, block_size)} bytes); raise --kv-cache-memory / "
                              "--gpu-memory-utilization")
        #: why max_model_len is below the model's limit when the caller did not choose it (None: it is not);
        #: the CLI prints it as a warning, as vLLM does
        self.max_model_len_note: str | None = None
        if max_model_len is None:
            max_model_len = min(limit, capacity)
            if capped_by and max_model_len == limit:
                self.max_model_len_note = (f"max_model_len {model_max} -> {limit}: {capped_by}")
            if capacity < limit:
                self.max_model_len_note = (
                    f"max_model_len {limit} -> {max_model_len}: the KV cache holds {capacity} tokens ({num_blocks} "
                    f"blocks of {block_size}); raise --kv-cache-memory/--gpu-memory-utilization or pass "
                    "--max-model-len")
        if capacity < max_model_len:
            raise EngineError(f"the KV cache budget ({budget} bytes) holds {capacity} tokens, fewer than "
                              f"max_model_len {max_model_len}; raise the KV budget or lower max_model_len")
        self.max_model_len = int(max_model_len)
        self.kv_pool = KVCachePool(planes, num_blocks, block_size, self.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv_pool, self.device, enforce_eager=enforce_eager,
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        self.sampler = Sampler()
        self.requests: dict[str, Sequence] = {}
        self.num_generated_tokens = 0
        #: requests whose prompt log-probs are not all computed: a step plans them only while this is non-empty
        self._prompt_logprobs_pending: set[str] = set()
        self._grammars: GrammarBackend | None = None  # built on the first structured-outputs request
        self._grammars_lock = threading.Lock()  # grammar_backend() may be called from a server worker thread

    @classmethod
    def from_model(cls, model_path: str | Path, *, dtype: str = "auto", device: str = "auto",
                   max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                   kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9, block_size: int = 16,
                   enforce_eager: bool = False, enable_prefix_caching: bool = True,
                   backend: str | None = None, fp8_activations: str = "auto") -> LLMEngine:
        """Load a layout or raw HF checkpoint directory and build the engine.

        fp8_activations: ``auto`` | ``dynamic`` (W8A8) | ``weight-only`` for FP8 block layers
            (:mod:`atomtool.serve.layers.fp8_activations`).

        backend: op backend (``auto`` | ``torch`` | ``triton`` | ``aiter``; see :mod:`atomtool.serve.ops`);
            process-wide, the models resolve their ops when built.

        Raises:
            SourceError / ConfigError / UnsupportedArchitectureError / EngineError (see
            :func:`atomtool.serve.loader.load_model`); EngineError for a missing tokenizer or KV budget too small.
        """
        from atomtool.serve import ops
        from atomtool.serve.loader import load_model

        ops.set_backend(backend)  # None / "auto": ATOMTOOL_BACKEND or automatic selection
        loaded = load_model(model_path, dtype=dtype, device=device, fp8_activations=fp8_activations)
        tokenizer = load_tokenizer(loaded.model_dir)
        engine = cls(loaded.model, tokenizer, loaded.config, device=loaded.device, model_dir=loaded.model_dir,
                     max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                     gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
                     enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching)
        engine.act_quant = loaded.act_quant  # what FP8 block layers run (None: weight-only or none)
        engine.act_quant_note = loaded.act_quant_note
        return engine

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request. ``prompt``: text (tokenized with the model's tokenizer, special tokens added) or ids.

        Raises:
            InvalidRequestError: duplicate id, empty prompt, token id outside the vocabulary, prompt longer
                than ``max_model_len``, or invalid sampling parameters (``logit_bias`` / ``allowed_token_ids``
                ids outside the vocabulary included).
        """
        params = (params or SamplingParams()).validate()
        if params.n != 1:
            raise InvalidRequestError(f"n={params.n}: the engine runs one completion per request; LLM.generate and "
                                      "the server run n of them", param="n")
        params.check_vocab(self.vocab_size, self.eos_token_ids)  # logit_bias / allowed_token_ids ids in range
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer; pass the prompt as token ids")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = prompt_token_ids(prompt)
        text = isinstance(prompt, str)
        # a text prompt's ids are checked only against a known vocab_size (a config without one serves text)
        bad = [t for t in ids if not 0 <= t < self.vocab_size] if self.vocab_size > 0 or not text else []
        if bad and text:  # a tokenizer larger than the model's embedding (a mismatched tokenizer.json)
            raise InvalidRequestError(
                f"the tokenizer turned the prompt into token ids outside the model's vocabulary [0, "
                f"{self.vocab_size}): {bad[:10]}; the tokenizer has {len(self.tokenizer)} tokens but config.json "
                f"says vocab_size {self.vocab_size}: is it the model's own tokenizer?", param="prompt")
        if bad:
            raise InvalidRequestError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): "
                                      f"{bad[:10]}", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens, more than max_model_len "
                                      f"{self.max_model_len}", param="prompt")
        seq = Sequence(request_id, ids, params, self.eos_token_ids)
        if params.structured_outputs is not None:
            seq.grammar = self.grammar_backend().matcher(params.structured_outputs, list(self.eos_token_ids))
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                               skip_special_tokens=params.skip_special_tokens,
                                               include_stop_str=params.include_stop_str_in_output)
        self.requests[request_id] = seq
        if seq.needs_prompt_logprobs:
            self._prompt_logprobs_pending.add(request_id)
        self.scheduler.add(seq)

    def grammar_backend(self) -> GrammarBackend:
        """The engine's structured-outputs compiler, built on first use (reading a large vocabulary takes
        seconds). Thread-safe, unlike the rest of the engine: the server builds it and compiles a request's
        constraint in a worker thread first (``GrammarBackend.compile`` caches), so ``add_request`` on the
        engine thread only makes the matcher and running requests do not stall.

        Raises:
            InvalidRequestError: no tokenizer, or xgrammar not installed (``param="structured_outputs"``).
        """
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured outputs need the model's tokenizer; this engine has "
                                              "none", param="structured_outputs")
                self._grammars = GrammarBackend(self.tokenizer, self.vocab_size)
            return self._grammars

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output (``"abort"``, of the request's
        ``output_kind``, with no ``new_token_ids``: a delta one carries the text still held back and no tokens)
        or None if unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self._prompt_logprobs_pending.discard(request_id)
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        seq.new_token_ids = []  # an abort generates nothing: every token already went out with its step's output
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for each request that produced a token or finished,
        except the unfinished ones of ``output_kind="final_only"`` requests (see :class:`RequestOutput` for
        what each kind's output holds)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        batch = self.runner.prepare(sched)
        plan = plan_prompt_logprobs(sched) if self._prompt_logprobs_pending else None
        if plan is None:
            logits = self.runner.run(batch)
        else:
            logits, prompt_entries = self.runner.run_with_prompt_logprobs(batch, plan)
            for seq, entries in zip(plan.seqs, prompt_entries, strict=True):
                seq.prompt_logprobs.extend(entries)
                if not seq.needs_prompt_logprobs:
                    self._prompt_logprobs_pending.discard(seq.request_id)
        rows, to_sample = [], []
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens, strict=True)):
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                rows.append(i)
                to_sample.append(seq)
        if not to_sample:
            return []
        sampled = self.sampler(logits[rows], to_sample)
        outputs = []
        for seq, (token, entry) in zip(to_sample, sampled, strict=True):
            seq.new_token_ids = []
            seq.append_token(token)
            if entry is not None:
                seq.logprobs.append(entry)
            self.num_generated_tokens += 1
            self._check_stop(seq, token)
            if seq.finish_reason is not None or seq.params.output_kind != "final_only":
                outputs.append(self._output(seq))
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        # the sampler masks EOS / stop_token_ids for the first min_tokens tokens; stop strings are looked for
        # only in the text after them (vLLM's rule)
        may_stop = seq.num_output_tokens > p.min_tokens
        eos = may_stop and not p.ignore_eos and token in seq.eos_token_ids
        stop_id = may_stop and token in p.stop_token_ids
        # structured outputs: the grammar ends the request once it accepted a stop token (the output is complete;
        # ignore_eos cannot go on past that) or if it refuses the token (only when every token was masked, e.g.
        # min_tokens banning the EOS a complete output needs); that token is then a stop token
        grammar_end = seq.grammar is not None and (not seq.grammar.accept(token) or seq.grammar.is_terminated)
        # a stop token's (EOS's, a stop_token_ids one's) id is kept in token_ids but its text is not, unless
        # include_stop_str_in_output asks for it (vLLM's v1 detokenizer; stop strings are cut the same way)
        keep_text = p.include_stop_str_in_output and not grammar_end
        hit = (seq.detok.add([token], check_stop=may_stop)
               if seq.detok is not None and (keep_text or not (eos or stop_id or grammar_end)) else None)
        reason = stop_reason = None
        if eos:
            reason = "stop"
        elif stop_id:
            reason, stop_reason = "stop", token
        elif grammar_end:
            reason = "stop"
        elif hit is not None:
            reason, stop_reason = "stop", hit
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            reason = "length"  # OpenAI's (and vLLM's) reason for both; context_limit tells them apart
            if seq.num_tokens >= self.max_model_len:
                seq.context_limit = self.max_model_len
        if reason is None:
            return
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.detok is not None and hit is None:
            seq.detok.flush()
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        """The request's output after this step, of its ``output_kind``: cumulative copies (O(output length))
        for "cumulative" / "final_only", this step's part only (O(new tokens + new text)) for "delta"."""
        finished = seq.finish_reason is not None
        # prompt log-probs go out once complete (from the first output on): cumulative / final_only outputs
        # carry the list itself (complete, never changed again), a delta request only its first output
        prompt_lps = None if seq.needs_prompt_logprobs else seq.prompt_logprobs
        if seq.params.output_kind == "delta":
            if seq.prompt_logprobs_sent:
                prompt_lps = None
            elif prompt_lps is not None:
                seq.prompt_logprobs_sent = True
            new = seq.new_token_ids  # a fresh list every step (step() replaces it), so it is not copied
            text = seq.detok.text_since(seq.num_text_sent, final=finished) if seq.detok is not None else ""
            seq.num_text_sent += len(text)
            lps = seq.logprobs
            if lps is not None:
                lps = lps[len(lps) - len(new):] if new else []
            return RequestOutput(
                request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=new,
                new_token_ids=list(new), text=text, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                context_limit=seq.context_limit, logprobs=lps, finished=finished,
                num_cached_tokens=seq.num_cached_tokens, delta=True, num_output_tokens=seq.num_output_tokens,
                prompt_logprobs=prompt_lps)
        text = seq.detok.text(final=finished) if seq.detok is not None else ""
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), new_token_ids=list(seq.new_token_ids), text=text,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, context_limit=seq.context_limit,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None, finished=finished,
            num_cached_tokens=seq.num_cached_tokens, num_output_tokens=seq.num_output_tokens,
            prompt_logprobs=prompt_lps)

    # -- introspection -----------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: running/waiting requests, KV usage (0..1), preemptions, prefix-hit tokens."""
        total = self.num_total_blocks()
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": total, "kv_blocks_free": self.num_free_blocks(),
            "kv_usage": (total - self.num_free_blocks()) / total if total else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.block_manager.prefix_hits,
            "generated_tokens": self.num_generated_tokens,
        }


#: files any transformers tokenizer is loaded from (fast, sentencepiece, BPE/WordPiece vocabularies, tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "merges.txt", "*.tiktoken")


def load_tokenizer(model_dir: Path):
    """transformers ``AutoTokenizer`` from the model directory.

    The tokenizer's ``model_max_length`` is lifted: the engine checks prompt length against its own
    ``max_model_len`` (one error line), so transformers' "Token indices sequence length is longer ..." warning
    would only print ahead of it.

    Raises:
        EngineError: (one line) no tokenizer files in ``model_dir``, or transformers cannot load them.
    """
    from transformers import AutoTokenizer

    if not any(any(Path(model_dir).glob(pattern)) for pattern in TOKENIZER_FILES):
        raise EngineError(f"{model_dir}: cannot load a tokenizer: no tokenizer files found "
                          f"({', '.join(TOKENIZER_FILES)}); copy them from the original checkpoint")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a missing/broken tokenizer
        detail = " ".join(str(exc).split())  # transformers' messages span several lines; ours is one
        raise EngineError(f"{model_dir}: cannot load a tokenizer ({type(exc).__name__}: {detail})") from exc
    tokenizer.model_max_length = int(1e30)  # transformers' own "no limit" value (VERY_LARGE_INTEGER)
    return tokenizer


def prompt_token_ids(prompt: object) -> list[int]:
    """A prompt given as token ids -> a list of Python ints. Accepts any iterable of integers (numpy / torch
    integer scalars included: ``operator.index``); refuses bools, floats, strings and non-iterables.

    Raises:
        InvalidRequestError: naming the first value that is not a token id (``param="prompt"``).
    """
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise InvalidRequestError(f"a prompt is text or a list of token ids, got {type(prompt).__name__} "
                                  f"{prompt!r:.50}", param="prompt")
    ids = []
    for t in prompt:
        if isinstance(t, bool) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
            raise InvalidRequestError(f"prompt token ids must be integers, got {t!r}", param="prompt")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise InvalidRequestError(f"prompt token ids must be integers, got {type(t).__name__} {t!r:.50}",
                                      param="prompt") from None
    return ids
