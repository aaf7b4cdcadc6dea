"""``LLM``: offline batch generation over :class:`LLMEngine` (vLLM-like ``LLM(model).generate(...)``)."""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
from collections.abc import Sequence as Seq

from atomtool.errors import InvalidArgumentError, InvalidRequestError
from atomtool.serve.engine.llm_engine import LLMEngine
from atomtool.serve.engine.outputs import RequestOutput
from atomtool.serve.generation_defaults import load_generation_defaults
from atomtool.serve.sampling_params import SamplingParams, choice_seed, seed_generators


class LLM:
    """Load a model once, then generate for batches of prompts.

    ``LLM(model_path, **engine_kwargs)`` accepts :meth:`LLMEngine.from_model`'s keyword arguments: ``dtype``
    (``auto`` | ``bfloat16`` | ``float16`` | ``float32``), ``device`` (``auto`` | ``cpu`` | ``cuda``),
    ``fp8_activations`` (``auto`` | ``dynamic`` | ``weight-only``: W8A8 or weight-only for FP8 block
    checkpoints), ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_memory``,
    ``gpu_memory_utilization``, ``block_size``, ``enforce_eager``, ``enable_prefix_caching``, ``backend``
    (``auto`` | ``torch`` | ``triton``). ``llm.engine.act_quant`` says whether W8A8 runs.

    ``generation_config``: ``auto`` (default, as vLLM's): the model's generation_config.json gives the
    default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as
    max_tokens) of :meth:`generate` calls without ``sampling_params``; ``none``: SamplingParams' own defaults. An explicit
    SamplingParams is used as given (as in vLLM). ``llm.generation_defaults`` holds what was read
    (:mod:`atomtool.serve.generation_defaults`); its ``describe()`` is logged at INFO.

    Raises:
        InvalidArgumentError (a ValueError, as vLLM raises, and a ConfigError / EngineError): an argument out of
            range or unsupported (``generation_config`` other than auto / none, ``dtype``, ``max_model_len``,
            ``tensor_parallel_size`` other than 1, ...), before or while loading.
        ConfigError: a malformed generation_config.json; the engine's load errors (:meth:`LLMEngine.from_model`).
        TypeError: an unknown keyword argument.
    """

    def __init__(self, model: str, generation_config: str = "auto", *, seed: int | None = None,
                 tensor_parallel_size: int = 1, trust_remote_code: bool = False, tokenizer: str | None = None,
                 revision: str | None = None, quantization: str | None = None, **engine_kwargs) -> None:
        if not isinstance(model, (str, os.PathLike)):  # (an empty path: the loader's own message)
            raise InvalidArgumentError(f"LLM: model must be a checkpoint or layout path, got {model!r}")
        load_generation_defaults(None, generation_config)  # an unknown mode fails before the model loads
        if tensor_parallel_size != 1:
            raise InvalidArgumentError(f"tensor_parallel_size {tensor_parallel_size} is not supported yet: atomtool "
                                       "runs a model on one device (use 1)")
        if tokenizer is not None and os.path.realpath(tokenizer) != os.path.realpath(model):
            raise InvalidArgumentError(f"tokenizer {tokenizer!r}: the model's own tokenizer files are used; "
                                       "another tokenizer is not supported (leave tokenizer unset)")
        if revision is not None:
            raise InvalidArgumentError(f"revision {revision!r}: LLM loads a local checkpoint or layout directory; "
                                       "download that revision first (huggingface-cli download REPO --revision REV "
                                       "--local-dir DIR)")
        if quantization is not None:
            raise InvalidArgumentError(f"quantization {quantization!r}: the quantization is read from the "
                                       "checkpoint (inspect shows it); leave quantization unset")
        # trust_remote_code: accepted, no effect (atomtool never runs a checkpoint's own Python code)
        for name in _VLLM_NO_EFFECT:  # vLLM resource / logging knobs with no counterpart here
            engine_kwargs.pop(name, None)
        for name, only in _VLLM_ONLY_VALUE.items():  # vLLM knobs whose only value here is what we always do
            if name in engine_kwargs and engine_kwargs.pop(name) not in (only, None):  # (None: vLLM's default)
                raise InvalidArgumentError(f"{name}: only {only!r} is supported ({_VLLM_ONLY_WHY[name]})")
        unknown = sorted(set(engine_kwargs) - _ENGINE_KWARGS)
        if unknown:
            accepted = _ENGINE_KWARGS | {"generation_config", "seed", "tensor_parallel_size", "trust_remote_code",
                                         "tokenizer", "revision", "quantization"}
            raise TypeError(f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; accepted: "
                            f"{', '.join(sorted(accepted))}; and, with no effect here, "
                            f"{', '.join(sorted([*_VLLM_NO_EFFECT, *_VLLM_ONLY_VALUE]))}")
        if "dtype" in engine_kwargs:
            engine_kwargs["dtype"] = _DTYPE_ALIASES.get(engine_kwargs["dtype"], engine_kwargs["dtype"])
        if seed is not None:  # vLLM's engine seed: requests without their own seed are reproducible run to run
            seed_generators(seed)
        self.engine = LLMEngine.from_model(model, **engine_kwargs)
        self.generation_defaults = load_generation_defaults(self.engine.model_dir, generation_config)
        note = self.generation_defaults.describe()
        if note:
            logging.getLogger(__name__).info(note)
        self._next_id = 0

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams :meth:`generate` uses when given none: SamplingParams' defaults with the model's
        generation config over them (vLLM's ``LLM.get_default_sampling_params``)."""
        return self.generation_defaults.sampling_params({})

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's ``LLM.llm_engine``; also ``llm.engine``)."""
        return self.engine

    def generate(self, prompts: str | list[int] | dict | Seq[str | list[int] | dict],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 use_tqdm: bool = False, lora_request: None = None) -> list[RequestOutput]:
        """Run every prompt to completion as one continuously batched workload.

        prompts: one prompt or a list; a prompt is text, token ids (a list / tuple of integers, numpy's included,
        or a 1-d integer array / tensor), or vLLM's dict forms ``{"prompt": text}`` (``TextPrompt``) and
        ``{"prompt_token_ids": [...]}`` (``TokensPrompt``). sampling_params: one for all, or one per prompt;
        None: :meth:`get_default_sampling_params` (the model's generation config defaults). ``n`` > 1 runs n
        completions of the prompt (choice i with ``seed + i`` when a seed is given). use_tqdm: a progress bar
        (tqdm, on stderr) over the finished prompts. lora_request: vLLM's; only None (no LoRA adapters).
        Returns the final :class:`RequestOutput` of each prompt, in input order (cumulative: the whole output,
        whatever ``output_kind`` the params ask for; the engine runs the requests as ``"final_only"``), with
        ``prompt_logprobs`` when the params ask for them (``SamplingParams.prompt_logprobs``); its ``outputs``
        are vLLM's per-completion view (every one of the ``n``), its top-level text / token ids / log-probs
        those of completion 0, and ``prompt`` the prompt's text when it was given as text.

        Raises:
            InvalidRequestError: a bad prompt or sampling parameter (nothing is run then); of several prompts, a
                bad one is named by its index (``prompts[1]: the prompt has 39 tokens, ...``), a bad one of
                several SamplingParams likewise (``sampling_params[1]: ...``).
        """
        if lora_request is not None:
            raise InvalidRequestError("lora_request: LoRA adapters are not supported", param="lora_request")
        if _single_prompt(prompts):
            prompts = [prompts]
        elif isinstance(prompts, bytes) or not hasattr(prompts, "__iter__"):
            raise InvalidRequestError(f"prompts: text, token ids, or a list of them; got {type(prompts).__name__}")
        prompts = list(prompts)
        texts = [None] * len(prompts)
        for i, p in enumerate(prompts):
            prompts[i], texts[i] = _unwrapped(p, f"prompts[{i}]" if len(prompts) > 1 else "prompt")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
        else:
            raise InvalidRequestError("sampling_params: a SamplingParams or a list of them (one per prompt); got "
                                      f"{type(sampling_params).__name__}", param="sampling_params")
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # only the final outputs are returned, so the engine builds no per-step ones (vLLM's LLM does the same);
        # copies, so the caller's SamplingParams are left as given
        params = [dataclasses.replace(p, output_kind="final_only") for p in params]
        for i, p in enumerate(params):
            try:
                p.validate()
            except InvalidRequestError as exc:
                if len(params) == 1:
                    raise
                raise InvalidRequestError(f"sampling_params[{i}]: {exc}", param=exc.param) from None
        groups: list[list[str]] = []  # per prompt, the engine request of each of its n choices
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                groups.append([])
                for c in range(p.n):
                    rid = f"gen-{self._next_id}"
                    self._next_id += 1
                    one = dataclasses.replace(p, n=1, seed=choice_seed(p.seed, c)) if p.n > 1 else p
                    try:
                        self.engine.add_request(rid, prompt, one)
                    except InvalidRequestError as exc:
                        if len(prompts) == 1:
                            raise
                        # of several prompts, say which one (too long, empty, ids outside the vocabulary, ...)
                        where = "prompts" if exc.param == "prompt" else "sampling_params"
                        raise InvalidRequestError(f"{where}[{i}]: {exc}", param=exc.param) from None
                    groups[-1].append(rid)
        except Exception:
            for rid in (r for g in groups for r in g):
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=sum(len(g) for g in groups), desc="Processed prompts", unit="req")
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # an error in a step or Ctrl-C: this call's requests leave the engine with it
            for rid in (r for g in groups for r in g):
                if rid not in final:
                    self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        decode = self._token_text
        results = []
        for group, text in zip(groups, texts, strict=True):
            first = final[group[0]]
            first.prompt = text
            first.completions = [final[rid].as_completion(c, decode) for c, rid in enumerate(group)]
            results.append(first)
        return results

    def _token_text(self, token_id: int) -> str | None:
        tok = self.engine.tokenizer
        return None if tok is None else tok.decode([token_id])

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, use_tqdm: bool = False,
             lora_request: None = None) -> list[RequestOutput]:
        """Generate replies to chat conversations (vLLM's ``LLM.chat``): each conversation (a list of OpenAI-style
        message dicts; or a list of such lists) is checked by the server's request models (``ChatMessage``,
        ``ToolDefinition``: roles, content, tool calls) and rendered by the model's chat template as the
        server renders a ``/v1/chat/completions`` request (:func:`atomtool.serve.api.chat.render_chat`, with
        its bounds), then run by :meth:`generate`.

        ``chat_template``: a template string replacing the tokenizer's; ``tools``: function tools (JSON-schema
        dicts) given to the template; ``chat_template_kwargs``: extra template variables. Returns one
        :class:`RequestOutput` per conversation, in order.

        Raises:
            InvalidRequestError: no chat template, a message or conversation the template or the checks refuse
                (of several conversations, named by index: ``conversation 1: messages[0]: ...``), or what :meth:`generate`
                raises.
        """
        from atomtool.serve.api.chat import render_chat
        from atomtool.serve.api.protocol import ChatMessage, ToolDefinition

        if not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise InvalidRequestError("the model's tokenizer has no chat template: pass chat_template=... or "
                                      "call generate() with the prompt text", param="chat_template")
        if messages is None or isinstance(messages, (str, bytes, dict)) or not hasattr(messages, "__iter__"):
            raise InvalidRequestError("messages: a conversation (a list of message dicts) or a list of "
                                      f"conversations; got {type(messages).__name__}", param="messages")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise InvalidRequestError("chat_template_kwargs must be a dict of template variables, got "
                                      f"{type(chat_template_kwargs).__name__}", param="chat_template_kwargs")
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise InvalidRequestError(f"tools must be a list of function tools, got {type(tools).__name__}",
                                      param="tools")
        tool_defs = _validated("tools", tools or [], ToolDefinition)
        single = isinstance(messages, (list, tuple)) and (not messages or isinstance(messages[0], dict))
        convos = [messages] if single else list(messages)
        prompts = []
        for i, convo in enumerate(convos):
            if not isinstance(convo, (list, tuple)) or not convo:
                where = "messages" if single else f"conversation {i}"
                raise InvalidRequestError(f"{where}: a conversation is a non-empty list of message dicts",
                                          param="messages")
            try:  # the server's request model checks every message before rendering (roles, content, ...)
                checked = _validated("messages", convo, ChatMessage)
                prompts.append(render_chat(self.tokenizer, checked, chat_template=chat_template,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           template_kwargs=chat_template_kwargs, tools=tool_defs or None))
            except InvalidRequestError as exc:
                if single:
                    raise
                raise InvalidRequestError(f"conversation {i}: {exc}", param=exc.param) from None
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, ids in zip(outputs, prompts, strict=True):  # vLLM's chat outputs carry the rendered prompt
            if out.prompt is None:
                out.prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
        return outputs


#: from_model's keyword arguments, the ones LLM passes on
_ENGINE_KWARGS = frozenset({"dtype", "device", "fp8_activations", "max_model_len", "max_num_seqs",
                            "max_num_batched_tokens", "kv_cache_memory", "gpu_memory_utilization", "block_size",
                            "enforce_eager", "enable_prefix_caching", "backend"})
#: vLLM constructor knobs (resources, logging, compilation) that change no result here: accepted, no effect
_VLLM_NO_EFFECT = ("swap_space", "disable_log_stats", "max_seq_len_to_capture", "disable_custom_all_reduce",
                   "cpu_offload_gb", "compilation_config", "load_format", "download_dir", "distributed_executor_backend")
#: vLLM constructor knobs with one value here (what atomtool always does): that value accepted, others refused
_VLLM_ONLY_VALUE = {"enable_chunked_prefill": True, "kv_cache_dtype": "auto", "tokenizer_mode": "auto",
                    "max_logprobs": 20}
_VLLM_ONLY_WHY = {"enable_chunked_prefill": "chunked prefill is always on, max_num_batched_tokens sets the chunk",
                  "kv_cache_dtype": "the KV cache is kept in the model's dtype",
                  "tokenizer_mode": "the model's fast tokenizer is used",
                  "max_logprobs": "requests may ask for up to 20 log-probs"}
#: vLLM's dtype spellings
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _unwrapped(prompt: object, where: str) -> tuple[object, str | None]:
    """(the engine prompt, its text when given as text) of one prompt, vLLM's dict forms unwrapped.

    Raises:
        InvalidRequestError: a dict without exactly one of ``prompt`` / ``prompt_token_ids``, or bytes.
    """
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"], prompt["prompt"]
        if keys == {"prompt_token_ids"}:
            return prompt["prompt_token_ids"], None
        raise InvalidRequestError(f"{where}: a dict prompt holds 'prompt' (text) or 'prompt_token_ids' (token ids), "
                                  f"one of them; got keys {sorted(map(str, keys))}", param="prompt")
    if isinstance(prompt, (bytes, bytearray)):
        raise InvalidRequestError(f"{where}: bytes are not a prompt; decode them to text first", param="prompt")
    return prompt, prompt if isinstance(prompt, str) else None


def _validated(field: str, items: Seq, model) -> list:
    """``items`` validated by the server's pydantic ``model``, a failure as the server words it (``messages[0].role:
    unknown role 'robot'; ...``). Raises InvalidRequestError."""
    from pydantic import ValidationError

    from atomtool.serve.api.errors import validation_error

    out = []
    for j, item in enumerate(items):
        try:
            out.append(model.model_validate(item))
        except ValidationError as exc:
            err = validation_error([{**e, "loc": (field, j, *e["loc"])} for e in exc.errors()])
            raise InvalidRequestError(err.message, param=err.param) from None
    return out


def _single_prompt(prompts: object) -> bool:
    """True for one prompt (text, a list / tuple starting with an integer, a 1-d array or tensor), False for
    a list of prompts."""
    if isinstance(prompts, (str, dict, bytes, bytearray)) or getattr(prompts, "ndim", None) == 1:
        return True
    return isinstance(prompts, (list, tuple)) and len(prompts) > 0 and isinstance(prompts[0], numbers.Integral)
