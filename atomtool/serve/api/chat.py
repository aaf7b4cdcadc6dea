"""Chat templates: load ``--chat-template`` and render OpenAI messages into prompt token ids.

Rendering uses the tokenizer's own Jinja chat template through transformers'
``apply_chat_template`` (the same path HF ``generate`` users and vLLM take); ``--chat-template``
or a request's ``chat_template`` replaces it. The rendered text already holds the template's special
tokens (BOS, role markers), so it is encoded with ``add_special_tokens=False``, as vLLM does.

Rendering is bounded: a chat template is code a client can send (a request's ``chat_template``), and
Jinja's sandbox stops unsafe attribute access but not ``{% for i in range(99999) %}`` nested twice. So
the render counts the template's executed Python lines (``sys.settrace`` on the rendering thread, only
for frames compiled from a template, filename ``<template>``) and aborts past
:data:`MAX_TEMPLATE_STEPS`, or when the rendered text exceeds :data:`MAX_RENDERED_CHARS`. The server
calls :func:`render_chat` in a worker thread, never on the event loop.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from atomtool.errors import ConfigError, InvalidRequestError

#: Executed template lines (loop iterations, statements) one render may take; a long real conversation
#: with a real template (e.g. DeepSeek-V3's, 1000 messages) takes well under 100k.
MAX_TEMPLATE_STEPS = 2_000_000
#: Characters the rendered prompt may have (far above any context window's worth of text).
MAX_RENDERED_CHARS = 64 << 20


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


def _message_text(index: int, content: Any) -> str:
    """A message's content as one string: OpenAI allows a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"messages[{index}].content: only text parts are supported, "
                                      f"got a part of type {kind!r}")
        parts.append(part["text"])
    return "".join(parts)


def render_chat(tokenizer: Any, messages: list[Any], *, chat_template: str | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None, max_steps: int = MAX_TEMPLATE_STEPS) -> list[int]:
    """Render chat ``messages`` (pydantic ChatMessage or dicts) to prompt token ids.

    Blocking (template + tokenizer): the server runs it in a worker thread. ``max_steps`` bounds the
    template's work (see the module doc).

    Raises:
        InvalidRequestError: no chat template is available, the template rejects the conversation
            (``raise_exception`` in the template, e.g. roles that do not alternate), a message holds a
            non-text part, or rendering exceeded ``max_steps`` steps / :data:`MAX_RENDERED_CHARS`
            characters ("chat_template: rendering exceeded N steps").
    """
    convo = []
    for i, msg in enumerate(messages):
        m = msg if isinstance(msg, dict) else msg.model_dump(exclude_none=True)
        item = {"role": m["role"], "content": _message_text(i, m.get("content"))}
        if m.get("name"):
            item["name"] = m["name"]
        convo.append(item)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("the model's tokenizer has no chat template; start the server with "
                                  "--chat-template FILE_OR_STRING or use /v1/completions")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
    try:
        text = _bounded(lambda: tokenizer.apply_chat_template(
            convo, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {})), max_steps)
    except InvalidRequestError:
        raise
    except Exception as exc:  # jinja2 TemplateError, ValueError from transformers
        raise InvalidRequestError(f"the chat template could not render these messages: {exc}") from exc
    if not isinstance(text, str):
        raise InvalidRequestError("the chat template did not render to a string")
    if len(text) > MAX_RENDERED_CHARS:
        raise InvalidRequestError(f"chat_template: the rendered prompt has {len(text)} characters, more than "
                                  f"the limit of {MAX_RENDERED_CHARS}")
    return list(tokenizer.encode(text, add_special_tokens=False))
