"""``LLM``: offline batch generation over :class:`LLMEngine` (vLLM-like ``LLM(model).generate(...)``)."""

from __future__ import annotations

import dataclasses
import logging
import numbers
from collections.abc import Sequence as Seq

from atomtool.errors import InvalidRequestError
from atomtool.serve.engine.llm_engine import LLMEngine
from atomtool.serve.engine.outputs import RequestOutput
from atomtool.serve.generation_defaults import load_generation_defaults
from atomtool.serve.sampling_params import SamplingParams


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
        ConfigError: a ``generation_config`` other than auto / none (before loading), or a malformed
            generation_config.json; the engine's load errors (:meth:`LLMEngine.from_model`).
    """

    def __init__(self, model: str, generation_config: str = "auto", **engine_kwargs) -> None:
        load_generation_defaults(None, generation_config)  # an unknown mode fails before the model loads
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

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion as one continuously batched workload.

        prompts: one prompt or a list (text, or token ids: a list / tuple of integers, numpy's included, or a
        1-d integer array / tensor). sampling_params: one for all, or one per prompt; None:
        :meth:`get_default_sampling_params` (the model's generation config defaults).
        Returns the final :class:`RequestOutput` of each prompt, in input order (cumulative: the whole output,
        whatever ``output_kind`` the params ask for; the engine runs the requests as ``"final_only"``), with
        ``prompt_logprobs`` when the params ask for them (``SamplingParams.prompt_logprobs``).

        Raises:
            InvalidRequestError: a bad prompt or sampling parameter (nothing is run then); of several prompts, a
                bad one is named by its index (``prompts[1]: the prompt has 39 tokens, ...``).
        """
        if _single_prompt(prompts):
            prompts = [prompts]
        elif not hasattr(prompts, "__iter__"):
            raise InvalidRequestError(f"prompts: text, token ids, or a list of them; got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        for p in params:
            p.validate()
        # only the final outputs are returned, so the engine builds no per-step ones (vLLM's LLM does the same);
        # copies, so the caller's SamplingParams are left as given
        params = [dataclasses.replace(p, output_kind="final_only") for p in params]
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                rid = f"gen-{self._next_id}"
                self._next_id += 1
                try:
                    self.engine.add_request(rid, prompt, p)
                except InvalidRequestError as exc:
                    if exc.param != "prompt" or len(prompts) == 1:
                        raise
                    # of several prompts, say which one (too long, empty, ids outside the vocabulary)
                    raise InvalidRequestError(f"prompts[{i}]: {exc}", param="prompt") from None
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:  # an error in a step or Ctrl-C: this call's requests leave the engine with it
            for rid in ids:
                if rid not in final:
                    self.engine.abort(rid)
            raise
        return [final[rid] for rid in ids]

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
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
        return self.generate(prompts, sampling_params)


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
    if isinstance(prompts, str) or getattr(prompts, "ndim", None) == 1:
        return True
    return isinstance(prompts, (list, tuple)) and len(prompts) > 0 and isinstance(prompts[0], numbers.Integral)
