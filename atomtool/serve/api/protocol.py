"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, stream chunks, errors).

Follows OpenAI's public API reference for ``/v1/completions`` and ``/v1/chat/completions`` and vLLM's
OpenAI-compatible server for the extra sampling parameters (``ignore_eos``, ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``, ``allowed_token_ids``,
``structured_outputs`` and the older ``guided_*`` names) and request-level chat template options; OpenAI's
``response_format`` (``json_object`` / ``json_schema``) is served by the same structured outputs
(:func:`structured_outputs_of`). Unknown
request fields are rejected, as OpenAI does ("Unrecognized request argument supplied: foo"), so a typo such as ``max_token`` is a 400
instead of a silent default; every field the official ``openai`` client can send for these endpoints is
declared (tests/test_server_protocol.py checks this against ``openai.types``). Parameters we accept but
cannot honour are rejected with a 400 by :func:`unsupported_fields` rather than silently dropped.

Tool calling follows OpenAI's chat format on the input side, as vLLM and SGLang do: the request's ``tools``
(function tools), assistant messages' ``tool_calls`` and ``tool`` messages' ``tool_call_id`` are validated
here (:class:`ToolDefinition`, :class:`ToolCall`, :func:`tool_message_problem`) and handed to the chat
template by :mod:`atomtool.serve.api.chat`. On the output side, ``atomtool serve --tool-call-parser NAME``
parses the calls the model writes into ``message.tool_calls`` (:mod:`atomtool.serve.api.tool_parsers`);
without it a call is whatever text the model writes, returned as ``content``. A forced call
(``tool_choice`` ``"required"`` or a named function) is served by structured outputs
(:mod:`atomtool.serve.api.forced_tools`); any other value than ``"none"`` without ``tools`` is a 400, as in vLLM.

Types are strict, as OpenAI's and vLLM's servers are: a boolean or a string is not an integer
(``"max_tokens": true`` or ``"5"`` is a 400, so is a token-id prompt ``[true, false]``), a string is not a
number or a boolean; an integer is accepted where a float is expected. ``null`` for an optional field
means its default (``"stream": null`` is ``false``), as in OpenAI's API.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from atomtool.errors import InvalidRequestError
from atomtool.serve.api.strict_json import MAX_JSON_DEPTH, BodyNotJSON, check_depth
from atomtool.serve.sampling_params import StructuredOutputsParams

#: Completions' ``max_tokens`` default when the client does not send it (OpenAI's legacy default).
COMPLETION_DEFAULT_MAX_TOKENS = 16

#: Chat roles accepted in ``messages`` (openai's ChatCompletionMessageParam; ``function`` is deprecated
#: there but still a valid message type the client can send).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: Roles whose messages must carry ``content`` (OpenAI marks it Required for them).
CONTENT_REQUIRED_ROLES = ("system", "developer", "user", "tool")
#: What a function tool's name may be (OpenAI's FunctionDefinition.name: "a-z, A-Z, 0-9, or contain
#: underscores and dashes, with a maximum length of 64").
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


def _tool_name(name: str) -> str:
    """``name`` if it is a valid function name (:data:`TOOL_NAME_PATTERN`, OpenAI's rule for tool definitions
    and the calls that name them), else ValueError (pydantic's message for the field)."""
    if not re.fullmatch(TOOL_NAME_PATTERN, name):
        raise ValueError(f"must match {TOOL_NAME_PATTERN} (letters, digits, underscores and dashes, at most "
                         f"64 characters), got {name!r}")
    return name


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages (``an object``, ``null``...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return "a string" if isinstance(value, str) else type(value).__name__


class OpenAIModel(BaseModel):
    """Base of every request model: unknown fields are rejected (OpenAI: "Unrecognized request argument"),
    types are strict (no bool/str -> int coercion), and ``null`` for a field with a non-null default means
    that default (see the module doc)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required() and fields[k].default is not None)}


# ----------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ----------------------------------------------------------------------------------------------- shared
class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk carries the usage so far
    include_obfuscation: bool | None = None  # OpenAI's stream padding; accepted, nothing to obfuscate


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions (OpenAI names, vLLM extras at the end)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI; torch rejects more
    presence_penalty: float | None = None  # [-2, 2], checked by SamplingParams (400 with param)
    frequency_penalty: float | None = None  # [-2, 2]
    # token id (a string key, as JSON objects have) -> bias in [-100, 100]; checked by SamplingParams, the ids
    # against the vocabulary by the engine (400 with param logit_bias)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # end-user id: accepted and ignored (bookkeeping only, as in vLLM)
    # vLLM extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None  # [0, 1]; unset: the model's generation_config.json min_p, else 0 (off)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False  # a stop string that ends generation stays in the text
    repetition_penalty: float | None = None  # > 0; unset: the generation config's, else 1.0 (off)
    allowed_token_ids: list[int] | None = None  # only these ids may be generated (EOS only if listed)
    # structured outputs (vLLM's extra body): {"json": schema} | {"json_object": true} | {"regex": ...} |
    # {"choice": [...]} | {"grammar": EBNF}; and vLLM's earlier names for the same (one of them per request)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's request extras
    skip_special_tokens: bool = True  # False: special tokens' text stays in the output
    spaces_between_special_tokens: bool = True  # only slow (Python) tokenizers read it; ours are fast: no effect
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the prompt's last k tokens (-1: max_model_len)
    request_id: str | None = None  # the response id becomes cmpl-/chatcmpl-<request_id>
    priority: int = 0  # priority scheduling is not enabled: only 0 (vLLM refuses others the same way)
    use_beam_search: bool = False  # beam search is not supported: only false
    length_penalty: float = 1.0  # beam search's; without it, no effect (as in vLLM)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_keeps_a_token(cls, k: int | None) -> int | None:
        if k == 0:
            raise ValueError("must be -1 (the model's context length) or at least 1 (tokens of the prompt to keep)")
        return k

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# ------------------------------------------------------------------------------------------ completions
class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a token-id list or a list of those."""

    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        """One clear message instead of pydantic's four union branches; booleans are not token ids."""
        def is_id(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if isinstance(prompt, str) or (isinstance(prompt, list) and (
                all(isinstance(x, str) for x in prompt) or all(is_id(x) for x in prompt)
                or all(isinstance(x, list) and all(is_id(t) for t in x) for x in prompt))):
            return prompt
        raise ValueError("must be a string, a list of strings, a list of token ids (integers) or a list of "
                         "token-id lists")
    # OpenAI's legacy default is 16; when the client leaves it out the server clamps it to the room left in
    # the context instead of failing (see app.check_length); explicit values are checked, never clamped.
    # 0 only with echo (a prompt-scoring request: the prompt alone is returned, as vLLM does); refused otherwise
    max_tokens: int | None = Field(COMPLETION_DEFAULT_MAX_TOKENS, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM extra: top log-probs of every prompt token, returned as the choice's ``prompt_logprobs`` (0..20,
    # checked by SamplingParams: a 400 naming prompt_logprobs)
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's: false tokenizes a text prompt without BOS / special tokens
    response_format: dict[str, Any] | None = None  # as chat's (vLLM accepts it on completions too)


class CompletionLogProbs(BaseModel):
    """The legacy completions log-prob format (parallel lists, one entry per generated token; with ``echo``
    the prompt's tokens come first, the first of them with ``null`` token_logprob and top_logprobs, as in
    OpenAI's and vLLM's responses)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One candidate of a prompt position in vLLM's ``prompt_logprobs`` format (vLLM's ``Logprob``): rank is
    its 1-based place in the vocabulary by log-prob (ties: lower id first), the prompt token's too."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    """One choice of a completions response. ``prompt_logprobs`` (vLLM's extra, only when the request sent
    ``prompt_logprobs``; left out of the JSON otherwise): per prompt token None (the first) or
    ``{token id: PromptLogprob}`` holding that token and the top ``prompt_logprobs`` tokens."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it, else None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    @model_serializer(mode="wrap")
    def _omit_unrequested(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("prompt_logprobs") is None:
            out.pop("prompt_logprobs", None)
        return out


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------------------------ tools
class FunctionCall(OpenAIModel):
    """The function an assistant message's tool call invoked (openai's ``Function`` of
    ``ChatCompletionMessageFunctionToolCallParam``): ``arguments`` is the JSON text the model wrote, a
    string as OpenAI sends it (:mod:`atomtool.serve.api.chat` decodes it for the template). ``name`` must be
    a function name as in ``tools`` (:data:`TOOL_NAME_PATTERN`): a call can only name a function that could
    have been defined, and OpenAI refuses any other name in history too.
    """

    name: str = Field(min_length=1)
    arguments: str

    _name = field_validator("name")(_tool_name)

    @field_validator("arguments", mode="before")
    @classmethod
    def _json_text(cls, arguments: Any) -> Any:
        """A clear message for the usual mistake of sending the arguments object itself."""
        if not isinstance(arguments, str):
            raise ValueError("must be a string holding the arguments as JSON text (OpenAI's format, e.g. "
                             f"'{{\"city\": \"Paris\"}}'), got {_json_type(arguments)}")
        return arguments


class _FunctionTyped(OpenAIModel):
    """Base of the tool models whose ``type`` must be ``"function"``: OpenAI's other kind, custom
    (free-text) tools, has no place in chat templates, which only know function tools and calls."""

    type: str
    _what: ClassVar[str] = "tools"

    @field_validator("type")
    @classmethod
    def _function_only(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f"only 'function' {cls._what} are supported, got {kind!r}")
        return kind


class ToolCall(_FunctionTyped):
    """One entry of an assistant message's ``tool_calls`` (openai's
    ``ChatCompletionMessageFunctionToolCallParam``: ``id``, ``type`` ``"function"``, ``function``)."""

    _what: ClassVar[str] = "tool calls"
    id: str
    function: FunctionCall


class FunctionDefinition(OpenAIModel):
    """A function tool's schema (openai's ``FunctionDefinition``): ``parameters`` is a JSON Schema object.

    ``name`` must match :data:`TOOL_NAME_PATTERN`, as OpenAI requires (and refuses otherwise with a 400).
    """

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _name = field_validator("name")(_tool_name)


class ToolDefinition(_FunctionTyped):
    """One entry of the request's ``tools`` (openai's ``ChatCompletionFunctionToolParam``), handed to the
    chat template as the JSON-schema dict transformers' ``apply_chat_template(tools=...)`` documents."""

    function: FunctionDefinition


# ------------------------------------------------------------------------------------------------- chat
class ChatMessage(OpenAIModel):
    """One chat message. ``content`` may be a string or a list of parts; only text parts are accepted.

    ``role`` must be one of :data:`CHAT_ROLES`; ``content`` is required for :data:`CONTENT_REQUIRED_ROLES`
    (an assistant message may omit it). ``tool_calls`` (assistant messages only) and ``tool_call_id``
    (required on, and only on, ``tool`` messages) reach the chat template with role, content and name.
    The deprecated ``function_call`` is refused (send ``tool_calls``). ``audio`` (openai's reference to an
    earlier audio reply) is refused: this server serves text only, and dropping it would hide from the model
    what the assistant said. ``refusal`` (assistant messages only, as in OpenAI's API, which accepts it in
    history) is what the assistant said when it declined: :mod:`atomtool.serve.api.chat` renders it as the
    message's content when the message has no content of its own.
    """

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}")
        return role

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.role in CONTENT_REQUIRED_ROLES and self.content is None:
            raise ValueError(f"a {self.role!r} message must have content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages may have tool_calls, not a {self.role!r} message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message must have tool_call_id (the id of the tool call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"only 'tool' messages may have tool_call_id, not a {self.role!r} message")
        if self.function_call is not None:
            raise ValueError("function_call in messages (deprecated by OpenAI) is not supported; send "
                             "the call as tool_calls")
        if self.refusal is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages may have refusal, not a {self.role!r} message")
        return self

    @field_validator("audio", mode="before")  # before: any non-null value gets this message, not a type error
    @classmethod
    def _no_audio(cls, audio: Any) -> Any:
        if audio is not None:
            raise ValueError("audio is not supported: this server serves text only (send what the assistant "
                             "said as content, e.g. the audio's transcript)")
        return audio


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions (OpenAI) plus vLLM's ``chat_template``/``chat_template_kwargs``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # vLLM's: true adds the tokenizer's special tokens (BOS) to the rendered chat
    # The rest of openai's chat CompletionCreateParams. Bookkeeping, caching and routing hints are
    # accepted and ignored (as vLLM does); those that would change the output are refused by
    # unsupported_fields when set.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # false: only the first parsed tool call is sent (tool_parsers)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_value(cls, choice: Any) -> Any:
        """OpenAI's values: the strings below or an object with a ``type`` string naming a kind of choice
        (whether it is served is :func:`unsupported_fields`' call); one message instead of pydantic's two
        union branches."""
        named = isinstance(choice, dict) and isinstance(choice.get("type"), str)  # {"type": ..., ...}
        if not (choice is None or named or choice in ("none", "auto", "required")):
            if isinstance(choice, dict):
                shown = "an object without a 'type' string"
            else:
                shown = repr(choice) if isinstance(choice, str) else _json_type(choice)
            raise ValueError(f"must be 'none', 'auto', 'required' or an object naming a tool, got {shown}")
        return choice


class ChatLogProbEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogProb(ChatLogProbEntry):
    top_logprobs: list[ChatLogProbEntry] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: list[ChatTokenLogProb] | None = None


class ChatResponseMessage(BaseModel):
    """A non-streaming choice's ``message``. ``tool_calls`` (OpenAI's ``{"id", "type": "function", "function":
    {"name", "arguments"}}`` entries, from ``--tool-call-parser``) is left out of the JSON when None."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it, else None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    """A stream chunk's ``delta``: fields that are None are left out of the JSON, as OpenAI and vLLM do
    (the first chunk carries ``role``, later ones only ``content``, the last one may be ``{}``)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's streaming tool-call deltas (--tool-call-parser)

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it, else None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------------------------------- models
class TokenizeRequest(OpenAIModel):
    """POST /tokenize (vLLM's): a text ``prompt`` tokenized as /v1/completions does (``add_special_tokens``
    default true), or chat ``messages`` rendered by the chat template as /v1/chat/completions does (the
    template places its own special tokens: ``add_special_tokens`` may only be false). One of the two."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize (vLLM's): token ids back to text (special tokens kept, as vLLM decodes them)."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "atomtool"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def unsupported_fields(req: _SamplingFields) -> tuple[str, str] | None:
    """The first accepted-but-unsupported parameter set to a non-default value, as (param, message).

    The engine has no suffix yet; refusing such fields is clearer than ignoring them (a client would silently
    get other behaviour).
    """
    if req.priority != 0:
        return "priority", "priority scheduling is not enabled on this server: priority must be 0"
    if req.use_beam_search:
        return "use_beam_search", "beam search is not supported by this server"
    if isinstance(req, CompletionRequest):
        if req.suffix:
            return "suffix", "suffix is not supported by this server"
        if req.best_of is not None and req.best_of != req.n:
            return "best_of", "best_of different from n is not supported"
    if isinstance(req, ChatCompletionRequest):
        if req.tool_choice not in (None, "none") and not req.tools:  # as vLLM: "none" needs no tools
            return "tool_choice", "tool_choice is only allowed when tools are specified"
        if req.top_logprobs is not None and not req.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        if req.functions or req.function_call is not None:
            param = "functions" if req.functions else "function_call"
            return param, (f"{param} (OpenAI's deprecated function calling) is not supported by this server; "
                           "send the functions as tools (tools: [{\"type\": \"function\", \"function\": {...}}]) "
                           "and tool_choice instead")
        if req.modalities and any(m != "text" for m in req.modalities):
            other = ", ".join(repr(m) for m in req.modalities if m != "text")
            return "modalities", f"only the 'text' modality is supported (this server serves text only), got {other}"
        if req.audio is not None:
            return "audio", "audio output is not supported by this server (it serves text only)"
        for name in ("prediction", "reasoning_effort", "verbosity", "web_search_options", "moderation"):
            if getattr(req, name) is not None:
                return name, f"{name} is not supported by this server"
    return None


#: the request fields that ask for structured outputs, with the StructuredOutputsParams field each one sets
#: (``structured_outputs`` is the whole object; ``response_format`` is read by structured_outputs_of)
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def structured_outputs_of(req: _SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the request field it came from, or ``(None, None)``.

    Sources: vLLM's ``structured_outputs`` object and its ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar`` fields, and OpenAI's ``response_format`` (chat; completions too, as vLLM): ``{"type": "text"}``
    (no constraint), ``{"type": "json_object"}`` (one JSON object) or ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}}`` (the schema; ``name`` is required, as OpenAI and vLLM
    require it, though serving does not use it; ``strict`` changes nothing: the output always follows the schema).

    Raises:
        InvalidRequestError: (``param`` = the field) several sources at once, an unknown ``response_format``
            type, a ``json_schema`` without a ``schema`` object, a constraint of the wrong shape, or a schema
            sent as JSON text that nests deeper than the request body may (:data:`MAX_JSON_DEPTH`).
    """
    given: list[tuple[str, dict[str, Any]]] = []
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for name, key in GUIDED_FIELDS.items():
        if getattr(req, name) is not None:
            given.append((name, {key: getattr(req, name)}))
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        kind = fmt.get("type", "text")
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequestError("response_format json_schema needs a 'json_schema' object with a "
                                          "'schema' (the JSON Schema the output must follow)",
                                          param="response_format")
            if not isinstance(spec.get("name"), str) or not spec["name"]:  # required by OpenAI and vLLM
                raise InvalidRequestError("response_format json_schema needs a 'name' (a string naming the "
                                          "schema, e.g. \"answer\")", param="response_format.json_schema.name")
            given.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise InvalidRequestError(f"response_format type {kind!r} is not supported; use 'text', "
                                      "'json_object' or 'json_schema'", param="response_format")
    if len(given) > 1:
        raise InvalidRequestError(f"only one of {', '.join(n for n, _ in given)} may constrain the output",
                                  param=given[1][0])
    if not given:
        return None, None
    field, spec = given[0]
    try:
        unknown = sorted(set(spec) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise InvalidRequestError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        params = StructuredOutputsParams(**spec).validate()
        if isinstance(params.json, str):  # JSON text: the body's nesting limit applies to it as to an object
            try:
                check_depth(json.loads(params.json))
            except BodyNotJSON:
                raise InvalidRequestError(f"the json schema text is nested more than {MAX_JSON_DEPTH} levels deep "
                                          "(the server's limit for arrays/objects in a request)") from None
        return params, field
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param=field) from None


def tool_definition_problem(tools: list[ToolDefinition] | None) -> str | None:
    """Why the request's ``tools`` cannot be served together, or None: two tools with the same name (OpenAI
    refuses this; a chat template would list both and the model could not tell which one a call means).
    Returns the message of the 400, naming the repeated ``tools[i].function.name``. An empty list is served as
    no tools (as vLLM does; OpenAI refuses it), since some clients send ``tools=[]`` when none are bound."""
    first: dict[str, int] = {}
    for i, tool in enumerate(tools or ()):
        name = tool.function.name
        if name in first:
            return (f"tools[{i}].function.name: {name!r} is already the name of tools[{first[name]}] (tool names "
                    "must be unique)")
        first[name] = i
    return None


def tool_message_problem(messages: list[ChatMessage], *, calls_may_end: bool = False) -> str | None:
    """Why the conversation's tool calls and ``tool`` messages do not pair up, or None when they do.

    OpenAI's API rules, which it enforces with a 400 (and the chat templates of tool-calling models
    assume): an assistant message with ``tool_calls`` must be followed by ``tool`` messages answering each
    of its calls (``tool_call_id`` = the call's ``id``, in any order) before any other message or the end of
    the conversation ("The following tool_call_ids did not have response messages"); a ``tool`` message
    must be one of those answers ("must be a response to a preceding message with 'tool_calls'"): a typo'd
    or stale id would render a result the model cannot connect to any call. Tool call ids are unique in
    the conversation, or a result could not say which call it answers. An assistant message whose
    ``tool_calls`` is empty has no calls to answer. Returns the message of the 400, naming the message
    (``messages[i]``) and the id.

    ``calls_may_end``: the conversation may end with unanswered calls (the request has
    ``add_generation_prompt`` false, vLLM's extension: the last assistant turn is rendered as it is, or
    continued with ``continue_final_message``, rather than followed by a new turn that would need the
    results). OpenAI has no such request, so by default unanswered calls at the end are refused too.
    """
    seen: set[str] = set()
    calls: dict[str, int] = {}  # the open assistant message's call ids -> their index in its tool_calls
    unanswered: list[str] = []  # of those, the ones no tool message has answered yet
    asked = -1  # index of the assistant message whose calls are open (-1: none)

    def missing(before: str) -> str:
        ids = ", ".join(f"{cid!r} (messages[{asked}].tool_calls[{calls[cid]}])" for cid in unanswered)
        return (f"messages[{asked}]: an assistant message with tool_calls must be followed by tool messages "
                f"answering each of its calls (tool_call_id = the call's id) before {before}; no tool message "
                f"answers {ids}")

    for i, msg in enumerate(messages):
        if msg.role == "tool":
            if asked < 0:
                before = f"messages[{i - 1}] has role {messages[i - 1].role!r}" if i else "it is the first message"
                return (f"messages[{i}]: a 'tool' message must answer a tool call of the assistant message "
                        f"just before it (or before the tool messages that follow that one); {before}")
            if msg.tool_call_id not in calls:
                known = ", ".join(repr(x) for x in calls)
                return (f"messages[{i}]: tool_call_id {msg.tool_call_id!r} does not match the id of any tool "
                        f"call in the assistant message it follows (messages[{asked}] has tool call ids {known})")
            if msg.tool_call_id in unanswered:
                unanswered.remove(msg.tool_call_id)
            continue
        if unanswered:
            return missing(f"another message (messages[{i}] has role {msg.role!r})")
        calls, asked = {}, -1
        if msg.role == "assistant" and msg.tool_calls:
            for j, call in enumerate(msg.tool_calls):
                if call.id in seen:  # a tool message answering it could not say which call it answers
                    return (f"messages[{i}].tool_calls[{j}].id: {call.id!r} is already the id of an earlier tool "
                            "call (tool call ids must be unique in a conversation)")
                seen.add(call.id)
                calls[call.id] = j
            unanswered, asked = list(calls), i
    if unanswered and not calls_may_end:
        return missing("the end of the conversation (or send add_generation_prompt false to render the "
                       "assistant's turn as it is)")
    return None
