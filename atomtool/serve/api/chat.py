"""Chat templates: load ``--chat-template`` and render OpenAI messages into prompt token ids.

Rendering uses the tokenizer's own Jinja chat template through transformers'
``apply_chat_template`` (the same path HF ``generate`` users and vLLM take); ``--chat-template``
or a request's ``chat_template`` replaces it. The rendered text already holds the template's special
tokens (BOS, role markers), so it is encoded with ``add_special_tokens=False``, as vLLM does.

Tool calling (input side) is handed to the template in the format transformers documents for tool-use
templates (https://huggingface.co/docs/transformers/chat_extras): the request's ``tools`` as
``apply_chat_template(tools=[{"type": "function", "function": {...}}])``; an assistant message's
``tool_calls`` as ``[{"id", "type": "function", "function": {"name", "arguments"}}]`` with ``arguments``
decoded from OpenAI's JSON string to a dict (an empty string is ``{}``; text that is not a JSON object
stays the string the client sent, so the model sees exactly what was written, and a template that needs
a mapping fails with a 400 instead of the server guessing; so does text holding ``NaN``/``Infinity``, which
Python's json accepts but JSON does not); a ``tool`` message keeps ``tool_call_id``. Arguments nested
deeper than :data:`MAX_ARGUMENT_DEPTH` levels, or whose decoded strings hold a lone UTF-16 surrogate (a
``\\ud800`` escape inside the JSON text; the tokenizer cannot encode it), are a 400 naming
``messages[i].tool_calls[j].function.arguments``. When the tokenizer ships several named templates,
transformers picks its ``tool_use`` one when tools are given; a template that never reads ``tools`` gets a
warning in the server log, once per template (:func:`template_reads_tools`).

Errors found here name the exact field as OpenAI's error ``param`` (``messages[1].content[0]``), as
OpenAI's own API does for content parts.

Rendering is bounded: a chat template is code a client can send (a request's ``chat_template``, accepted
only with ``--trust-request-chat-template``: the bounds below cannot stop one expression that allocates
gigabytes, such as ``{{ 'x' * 10**10 }}``, and a request's template is at most
:data:`MAX_REQUEST_TEMPLATE_CHARS` long, since compiling one is unbounded work too), and
Jinja's sandbox stops unsafe attribute access but not ``{% for i in range(99999) %}`` nested twice. So
the render counts the template's executed Python lines (``sys.settrace`` on the rendering thread, only
for frames compiled from a template, filename ``<template>``) and aborts past
:data:`MAX_TEMPLATE_STEPS`, or when the rendered text exceeds :data:`MAX_RENDERED_CHARS`. The server
calls :func:`render_chat` in a worker thread, never on the event loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from typing import Any

from atomtool.errors import ConfigError, InvalidRequestError

logger = logging.getLogger("atomtool.serve")

#: Executed template lines (loop iterations, statements) one render may take; a long real conversation
#: with a real template (e.g. DeepSeek-V3's, 1000 messages) takes well under 100k.
MAX_TEMPLATE_STEPS = 2_000_000
#: Characters the rendered prompt may have (far above any context window's worth of text).
MAX_RENDERED_CHARS = 64 << 20
#: Characters a request's own ``chat_template`` may have (the operator's ``--chat-template`` has no limit).
#: Jinja compiles a template with its pure-Python parser before any render bound acts, about 5 s of CPU per MiB
#: (holding the GIL), and transformers caches the last 128 compiled templates; real templates (Llama 3.1,
#: DeepSeek-V3, Qwen3, gpt-oss) are 2-20 KB.
MAX_REQUEST_TEMPLATE_CHARS = 64 << 10
#: Nesting levels (objects/arrays) a tool call's decoded ``arguments`` may have. Real arguments are a few
#: levels deep; the bound keeps a hostile value from exhausting Python's recursion limit in json.loads or
#: in the template's ``tojson`` (the request body's 16 MiB limit bounds the size).
MAX_ARGUMENT_DEPTH = 64


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int:
    """Characters a prompt may have and still fit ``max_model_len`` tokens, without tokenizing it: each token
    covers at most L characters (L = the longest string in the tokenizer's vocabulary, added tokens included;
    byte-level BPE vocabularies spell one byte per character, so decoded text is never longer), times 2 for
    normalizers that compose characters (NFC). A text above the limit cannot fit, so the server refuses it
    before spending seconds tokenizing megabytes (a request's ``chat_template`` can render 64M characters
    from a short body). 64 characters per token without a vocabulary."""
    try:
        longest = max((len(k) for k in tokenizer.get_vocab()), default=64)
    except Exception:  # a tokenizer without get_vocab (test doubles): a generous constant
        longest = 64
    return 2 * max(1, longest) * max(1, int(max_model_len))


class TemplateBudgetExceeded(InvalidRequestError):
    """A chat template ran longer than :data:`MAX_TEMPLATE_STEPS` steps (raised inside the render)."""

    param = "chat_template"  # the OpenAI error body's ``param``


def _bounded(fn: Any, max_steps: int) -> Any:
    """Run ``fn()`` in this thread, raising :class:`TemplateBudgetExceeded` once Jinja-compiled code
    (frames whose file is ``<template>``) has executed ``max_steps`` lines.

    Python's tracing hook is the only way to interrupt a pure-Python loop from outside without killing
    the thread; frames outside templates get no line tracer, so the rest of the work runs at full speed.
    """
    steps = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > max_steps:
                raise TemplateBudgetExceeded(f"chat_template: rendering exceeded {max_steps} steps "
                                             "(a loop that runs too long?)")
        return local

    def global_(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename == "<template>":
            return local
        return None

    previous = sys.gettrace()
    sys.settrace(global_)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def load_chat_template(value: str | None) -> str | None:
    """Resolve ``--chat-template``: a path to a Jinja file, or the template itself.

    Returns None for None. A value that names an existing file is read; a value containing Jinja
    syntax (``{``) or a newline is the template; anything else looks like a mistyped path.

    The template is compiled here (:func:`compile_chat_template`), so a broken one stops ``atomtool serve``
    at startup instead of turning every chat request into a 400.

    Raises:
        ConfigError: the value looks like a path but no such file exists, the file is unreadable, or the
            template does not compile (Jinja syntax error).
    """
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read chat template file {value}: {exc}") from exc
        compile_chat_template(text, origin=f"chat template file {value}")
        return text
    if "{" in value or "\n" in value:
        compile_chat_template(value, origin="--chat-template")
        return value
    raise ConfigError(f"chat template {value!r} looks like a file path, but no such file exists "
                      "(pass a Jinja template file or the template string itself)")


def compile_chat_template(template: str, *, origin: str = "chat template") -> None:
    """Compile ``template`` with the Jinja environment transformers' ``apply_chat_template`` renders with
    (sandboxed, ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``/``tojson``), so a
    template that compiles here is one the tokenizer accepts.

    Raises:
        ConfigError: a Jinja syntax error, as one line naming ``origin``, the line and the problem.
    """
    import jinja2

    try:  # transformers' own (cached) compile: the exact environment used when rendering
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_
    except ImportError:  # a private helper: fall back to an equivalent sandboxed environment
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        compile_ = env.from_string
    try:
        compile_(template)
    except jinja2.TemplateError as exc:
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        msg = " ".join(str(exc.message or exc).split())
        raise ConfigError(f"{origin} is not a valid Jinja template{where}: {msg}") from None


def _message_text(index: int, content: Any, role: str = "user") -> str:
    """A message's content as one string: OpenAI allows a string or a list of typed parts (``text`` parts,
    each with a ``text`` string; in an assistant message also ``refusal`` parts, each with a ``refusal``
    string, which are text the assistant said, as vLLM reads them).

    Raises:
        InvalidRequestError: a part of another type (image, audio, file: this server serves text only), or
            a part without its string; ``param`` is the part's path, ``messages[i].content[j]``.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    kinds = ("text", "refusal") if role == "assistant" else ("text",)
    parts = []
    for j, part in enumerate(content):
        path = f"messages[{index}].content[{j}]"
        kind = part.get("type")
        if kind not in kinds:
            what = f"a part of type {kind!r}" if isinstance(kind, str) else "a part without a 'type' string"
            allowed = " and ".join(kinds)
            raise _invalid(f"{path}: only {allowed} parts are supported, got {what}", path)
        if not isinstance(part.get(kind), str):
            raise _invalid(f"{path}: a {kind} part needs a {kind!r} string", path)
        parts.append(part[kind])
    return "\n".join(parts)  # as vLLM joins a message's text parts (its "string" content format)


def _invalid(message: str, param: str) -> InvalidRequestError:
    """An InvalidRequestError whose OpenAI error body names ``param``."""
    return InvalidRequestError(message, param=param)


def _not_json_constant(name: str) -> Any:
    """``parse_constant`` for json.loads: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON."""
    raise ValueError(f"{name} is not JSON")


def _json_problem(value: Any, *, text: bool) -> str | None:
    """Why a decoded JSON value cannot be accepted, or None: nesting deeper than :data:`MAX_ARGUMENT_DEPTH`,
    or (with ``text``: the value reaches the template) a key or string holding a lone UTF-16 surrogate.

    Iterative (an explicit stack), so a deep value cannot overflow Python's recursion limit here.
    """
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str) and text:
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return (f"the text is not valid Unicode: lone surrogate \\u{ord(item[exc.start]):04x} (an "
                        "unpaired \\u escape in the JSON; send well-formed UTF-16 pairs)")
        elif isinstance(item, dict | list):
            if depth >= MAX_ARGUMENT_DEPTH:
                return f"the JSON is nested too deeply (more than {MAX_ARGUMENT_DEPTH} levels)"
            if isinstance(item, dict):
                stack.extend((k, depth + 1) for k in item)
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
    return None


def template_arguments(arguments: Any, path: str = "arguments") -> Any:
    """A tool call's ``arguments`` as the chat template gets them (see the module doc).

    ``arguments``: OpenAI's JSON text (str). Returns a dict when the text is a JSON object (``""`` is
    ``{}``, as vLLM treats it), else the text unchanged (also text that is not strict JSON: ``NaN``,
    ``Infinity``); a value that is already not a string is returned as is (the server's request model
    only lets strings through). ``path`` names the field in errors (``messages[1].tool_calls[0].function.
    arguments``).

    Raises:
        InvalidRequestError: (``param`` = ``path``) the JSON is nested more than :data:`MAX_ARGUMENT_DEPTH`
            levels (or too deep for json.loads at all), or a decoded key or string is a lone surrogate.
    """
    if not isinstance(arguments, str):
        return arguments
    if not arguments.strip():
        return {}
    try:
        decoded = json.loads(arguments, parse_constant=_not_json_constant)
    except RecursionError:  # json's C scanner stops at the interpreter's recursion limit
        raise _invalid(f"{path}: the JSON is nested too deeply (more than {MAX_ARGUMENT_DEPTH} levels)",
                       path) from None
    except ValueError:  # not JSON (e.g. cut off): the model sees the text it wrote
        return arguments
    # Depth counts whatever the JSON is; the text check only matters for what the template gets (a dict).
    problem = _json_problem(decoded, text=isinstance(decoded, dict))
    if problem is not None:
        raise _invalid(f"{path}: {problem}", path)
    return decoded if isinstance(decoded, dict) else arguments


def template_message(index: int, message: Any) -> dict[str, Any]:
    """One OpenAI chat message (pydantic ``ChatMessage`` or a dict) as the dict the chat template renders:
    ``role``, ``content`` (text; an assistant's ``refusal`` when it has no content; ``""`` when absent), and
    when present ``name``, ``tool_calls`` (arguments decoded by :func:`template_arguments`) and
    ``tool_call_id``.

    Raises:
        InvalidRequestError: the content holds a non-text part, or a tool call's arguments are a 400 for
            :func:`template_arguments`.
    """
    m = message if isinstance(message, dict) else message.model_dump(exclude_none=True)
    item: dict[str, Any] = {"role": m["role"], "content": _message_text(index, m.get("content"), m["role"])}
    if not item["content"] and m.get("refusal"):
        # An assistant's refusal (OpenAI sends it instead of content) is what it said: the model must see
        # it, or the turn would read as an empty reply. Chat templates have no refusal field, so it is the
        # content; a message with content of its own keeps that (OpenAI never sends both).
        item["content"] = m["refusal"]
    if m.get("name"):
        item["name"] = m["name"]
    if m.get("tool_calls"):  # an empty list is no call: the template takes its plain assistant path
        item["tool_calls"] = [
            {"id": call.get("id"), "type": call.get("type", "function"),
             "function": {"name": call["function"]["name"],
                          "arguments": template_arguments(call["function"].get("arguments"),
                                                          f"messages[{index}].tool_calls[{j}].function.arguments")}}
            for j, call in enumerate(m["tool_calls"])]
    if m.get("tool_call_id") is not None:
        item["tool_call_id"] = m["tool_call_id"]
    return item


#: Keys chat_template_kwargs may not set: the arguments render_chat sets itself (from the request's own
#: fields), ``messages`` (the variable the template gets the conversation in: Template.render would get
#: it twice), and the other parameters of transformers' apply_chat_template / render_jinja_template, which
#: those functions consume instead of handing them to the template (``documents`` is not here: it is a
#: template variable, passed through as such). tests/test_server_tools.py checks this list against
#: transformers' signatures.
_OWN_TEMPLATE_ARGS = ("messages", "conversation", "conversations", "chat_template", "tools", "tokenize",
                      "add_generation_prompt", "continue_final_message")
_RENDER_PARAMS = ("self", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                  "return_assistant_tokens_mask", "tokenizer_kwargs")

#: sha256 of template sources already looked at by :func:`warn_if_tools_unused` -> whether they read
#: ``tools``. Digests, not sources, so a client sending many large request-level templates cannot make the
#: server keep them; bounded: past :data:`_MAX_TOOL_CHECKS` templates no new ones are checked or reported.
_TOOL_CHECKS: dict[str, bool] = {}
_MAX_TOOL_CHECKS = 256


def template_reads_tools(source: str) -> bool:
    """Whether the chat template ``source`` reads the ``tools`` variable.

    Checked on the template's syntax tree (jinja2.meta.find_undeclared_variables, parsed with the
    environment transformers renders with), not by rendering with and without tools: that would double
    every render's cost and compare texts that can differ for other reasons (dates, random ids); a
    template that names ``tools`` only inside a string literal or comment, as an attribute
    (``m.tools``) or as its own loop variable is not counted as reading it. Falls back to looking for the
    word ``tools`` in the source if the template cannot be parsed (the render then reports the problem).
    """
    import jinja2.meta

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(source).environment
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except Exception:  # a private transformers helper, or a template that does not compile
        return "tools" in source


def warn_if_tools_unused(tokenizer: Any, chat_template: str | None, tools: list[Any] | None) -> None:
    """Log a warning (``atomtool.serve`` logger, once per template) when a request sends ``tools`` but the
    chat template that will render it (transformers' choice: ``chat_template``, else the tokenizer's
    ``tool_use`` or default one) never reads ``tools``: the tool definitions are then silently left out
    of the prompt, so the model cannot know them. Each template is parsed once (see :data:`_TOOL_CHECKS`)."""
    if not tools:
        return
    try:
        source = tokenizer.get_chat_template(chat_template, tools)
    except Exception:  # no template at all: render_chat reports it
        return
    if not isinstance(source, str):
        return
    digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
    if digest in _TOOL_CHECKS or len(_TOOL_CHECKS) >= _MAX_TOOL_CHECKS:
        return
    _TOOL_CHECKS[digest] = reads = template_reads_tools(source)
    if not reads:
        logger.warning("a request sent tools, but the chat template does not reference `tools`, so the tool "
                       "definitions are not part of the prompt (the model never sees them); give a tool-aware "
                       "template (serve: --chat-template, or the request's chat_template with "
                       "--trust-request-chat-template; LLM.chat: chat_template=)")


def render_chat(tokenizer: Any, messages: list[Any], *, chat_template: str | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None, tools: list[Any] | None = None,
                max_steps: int = MAX_TEMPLATE_STEPS, max_chars: int = MAX_RENDERED_CHARS,
                add_special_tokens: bool = False) -> list[int]:
    """Render chat ``messages`` (pydantic ChatMessage or dicts) to prompt token ids.

    ``chat_template``: a template replacing the tokenizer's own (None: the tokenizer's; when it has several
    named ones, transformers picks ``tool_use`` if ``tools`` are given, else ``default``). ``tools``: the
    request's function tools (pydantic ``ToolDefinition`` or JSON-schema dicts), passed to the template as
    ``tools`` (a template that never reads them is logged, :func:`warn_if_tools_unused`). Blocking (template
    + tokenizer): the server runs it in a worker thread. ``max_steps`` bounds the template's work (see the
    module doc); ``max_chars`` the rendered text (the server passes :func:`prompt_char_limit`, so a text that
    cannot fit the context is refused before it is tokenized; never above :data:`MAX_RENDERED_CHARS`).
    ``add_special_tokens`` (vLLM's chat field, default false: the template writes its own BOS and markup):
    true also adds the tokenizer's special tokens when the rendered text is tokenized.

    Raises:
        InvalidRequestError: no chat template is available, the template rejects the conversation
            (``raise_exception`` in the template, e.g. roles that do not alternate), a message holds a
            non-text part, a tool call's arguments are unusable (:func:`template_arguments`),
            ``template_kwargs`` sets a reserved key (an argument the request sets itself, e.g. ``tools``,
            or ``messages``; param ``chat_template_kwargs``), rendering exceeded ``max_steps`` steps
            ("chat_template: rendering exceeded N steps"), or the rendered text exceeds ``max_chars``
            characters (param ``messages``).
    """
    convo = [template_message(i, msg) for i, msg in enumerate(messages)]
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidRequestError("the model's tokenizer has no chat template; start the server with "
                                  "--chat-template FILE_OR_STRING or use /v1/completions")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
    for key in template_kwargs or {}:
        if key in _OWN_TEMPLATE_ARGS:
            raise _invalid(f"chat_template_kwargs may not set {key!r}: the server sets it (from the request's "
                           "own fields)", "chat_template_kwargs")
        if key in _RENDER_PARAMS:
            raise _invalid(f"chat_template_kwargs may not set {key!r}: it is a parameter of transformers' "
                           "apply_chat_template, not a template variable", "chat_template_kwargs")
    tool_schemas = None
    if tools:  # [] is no tools (it would select a tokenizer's "tool_use" template)
        tool_schemas = [t if isinstance(t, dict) else t.model_dump(exclude_none=True) for t in tools]
        warn_if_tools_unused(tokenizer, chat_template, tool_schemas)
    try:
        text = _bounded(lambda: tokenizer.apply_chat_template(
            convo, chat_template=chat_template, tools=tool_schemas, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(template_kwargs or {})), max_steps)
    except InvalidRequestError:
        raise
    except Exception as exc:  # jinja2 TemplateError, ValueError from transformers
        raise InvalidRequestError(f"the chat template could not render these messages: {exc}") from exc
    if not isinstance(text, str):
        raise InvalidRequestError("the chat template did not render to a string")
    limit = min(max_chars, MAX_RENDERED_CHARS)
    if len(text) > limit:
        # the same code as a prompt over max_model_len tokens: clients test for it (this text is known too
        # long before it is tokenized, so the message counts characters)
        raise InvalidRequestError(f"This model's maximum context length is exceeded: the rendered chat prompt has "
                                  f"{len(text)} characters, more than the model's context can hold (at most {limit} "
                                  "characters). Please reduce the length of the messages.", param="messages",
                                  code="context_length_exceeded")
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
