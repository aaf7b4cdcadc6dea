"""Forced tool calls: chat ``tool_choice`` ``"required"`` or a named function, served by structured outputs.

OpenAI's chat API lets a request force a call: ``"required"`` (at least one call, to any of ``tools``) or
``{"type": "function", "function": {"name": NAME}}`` (one call of NAME). Like vLLM and SGLang, the server does
not rely on the model's own call markup here: the output is constrained to JSON (structured outputs) and that
JSON *is* the call, whatever the model's format or whether a ``--tool-call-parser`` is set:

- named: the output is the function's arguments, a JSON value of its ``parameters`` schema (``{}`` when the
  tool has none: OpenAI's empty parameter list); ``message.tool_calls`` holds one call of NAME with that text as ``arguments``, and the
  finish_reason is the engine's (``"stop"``: OpenAI answers a forced named call with ``"stop"`` too).
- required: the output is a JSON array of at least one ``{"name": ..., "parameters": {...}}`` (one of the
  tools each, its own schema; at most one when ``parallel_tool_calls`` is false); each becomes a call, and the
  finish_reason is ``"tool_calls"`` once complete. The tools' ``$defs`` (and draft-07 ``definitions``) move to
  the top of the array schema, so their ``#/$defs/...`` references resolve there (vLLM's
  ``get_tool_schema_defs``); two tools defining one name differently are a 400. Each call's ``arguments`` is
  its ``parameters`` written back as JSON; a value JSON cannot hold (a number beyond a double's range such as
  ``1e400``, a lone surrogate escape ``"\\ud800"``) leaves the whole output as ``content``, as a tool-call
  parser does with such a call.

``max_tokens`` cutting the JSON first leaves finish_reason ``"length"``: a named call then carries the
incomplete arguments (as vLLM returns them), a required one returns the text as ``content`` (nothing can be
parsed from an unfinished array). Streaming: a named call streams its arguments as they are generated
(OpenAI's deltas: the first carries ``index``, ``id``, ``type`` and ``function.name``); the calls of a required
choice are sent whole once the array is complete.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from atomtool.errors import InvalidRequestError
from atomtool.serve.api.protocol import ChatResponseMessage, DeltaMessage
from atomtool.serve.api.tool_parsers.base import dump_arguments, new_call_id, strict_json
from atomtool.serve.sampling_params import StructuredOutputsParams

#: the schema of a function's arguments when its tool declares no ``parameters`` (OpenAI: "omitting parameters
#: defines a function with an empty parameter list"): the empty object
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def forced_function(req: Any) -> str | None:
    """The function name a named ``tool_choice`` forces, or None (any other choice)."""
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        return fn.get("name") if isinstance(fn, dict) else None
    return None


def forced_choice_problem(req: Any) -> str | None:
    """Why the request's forced ``tool_choice`` cannot be served, or None: a named choice must be
    ``{"type": "function", "function": {"name": NAME}}`` with NAME one of ``tools``."""
    choice = req.tool_choice
    if not isinstance(choice, dict):
        return None
    if choice.get("type") != "function":
        return (f"tool_choice of type {choice.get('type')!r} is not supported; use 'none', 'auto', 'required' "
                "or {'type': 'function', 'function': {'name': ...}}")
    name = forced_function(req)
    if not isinstance(name, str):
        return "tool_choice {'type': 'function'} needs 'function': {'name': NAME}"
    names = [t.function.name for t in req.tools or ()]
    if name not in names:
        return f"tool_choice names function {name!r}, which is not in tools ({', '.join(map(repr, names))})"
    return None


def _parameters(tool: Any) -> dict[str, Any]:
    params = tool.function.parameters
    return params if isinstance(params, dict) and params else NO_PARAMETERS


#: the keywords a schema's reusable definitions sit under (``#/$defs/NAME``; draft-07: ``#/definitions/NAME``)
DEFS_KEYWORDS = ("$defs", "definitions")


def _hoisted_defs(tools: list[Any]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Each tool's parameters schema without its definitions, and those definitions gathered by keyword, for the
    required choice's array schema (vLLM's ``get_tool_schema_defs``): a tool's ``#/$defs/NAME`` then resolves
    at the array's top. The request's own schemas are not modified.

    Raises:
        InvalidRequestError: (``param="tools"``) two tools define the same name differently.
    """
    schemas: list[dict[str, Any]] = []
    defs: dict[str, dict[str, Any]] = {}
    owner: dict[tuple[str, str], str] = {}
    for tool in tools:
        params = dict(_parameters(tool))
        for keyword in DEFS_KEYWORDS:
            found = params.pop(keyword, None)
            if not isinstance(found, dict):
                continue
            merged = defs.setdefault(keyword, {})
            for name, schema in found.items():
                if name in merged and merged[name] != schema:
                    raise InvalidRequestError(
                        f"tools {owner[keyword, name]!r} and {tool.function.name!r} both define {keyword} "
                        f"{name!r}, differently; tool_choice 'required' needs one schema per definition name",
                        param="tools")
                merged[name] = schema
                owner.setdefault((keyword, name), tool.function.name)
        schemas.append(params)
    return schemas, defs


class ForcedToolCalls:
    """The forced-call view of one chat request (see the module doc): its output constraint, the finished
    choice's ``message``, and the stream's deltas (one state per choice, by engine request id).

    Args:
        req: the ``ChatCompletionRequest`` (``tools`` set, ``tool_choice`` forced; checked by
            :func:`forced_choice_problem`).
    """

    def __init__(self, req: Any) -> None:
        self.name = forced_function(req)
        tools = list(req.tools or ())
        if self.name is not None:
            schema = _parameters(next(t for t in tools if t.function.name == self.name))
        else:
            params, defs = _hoisted_defs(tools)
            items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                       "parameters": p},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for t, p in zip(tools, params, strict=True)]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **defs}
            if req.parallel_tool_calls is False:
                schema["maxItems"] = 1
        self.constraint = StructuredOutputsParams(json=schema).validate()
        #: each tool's own parameters schema as a constraint, labelled as OpenAI names it
        #: (``tools[i].function.parameters``): compiled one by one when ``constraint`` fails, to tell which
        self.tool_constraints = [
            (f"tools[{i}].function.parameters (function {t.function.name!r})",
             StructuredOutputsParams(json=_parameters(t)).validate())
            for i, t in enumerate(tools) if self.name is None or t.function.name == self.name]
        self._ids: dict[str, str] = {}  # engine request id -> the named call's id (streaming)
        self._texts: dict[str, str] = {}  # engine request id -> a required choice's text so far (streaming)

    @classmethod
    def for_request(cls, req: Any) -> ForcedToolCalls | None:
        """The view when the request forces a call (``tool_choice`` ``"required"`` or named, with tools), else
        None."""
        if not req.tools or not (req.tool_choice == "required" or forced_function(req) is not None):
            return None
        return cls(req)

    def _calls(self, text: str) -> list[dict[str, Any]] | None:
        """A finished output's calls in OpenAI's form, or None when ``text`` is not a complete array (cut) or
        holds a value JSON text cannot carry back (``strict_json``: ``1e400``, a lone surrogate escape)."""
        if self.name is not None:
            return [{"id": new_call_id(), "type": "function", "function": {"name": self.name, "arguments": text}}]
        try:
            items = strict_json(text)
        except ValueError:
            return None
        return [{"id": new_call_id(), "type": "function",
                 "function": {"name": it["name"], "arguments": dump_arguments(it["parameters"])}}
                for it in items]

    def _reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.name is None and engine_reason == "stop" else engine_reason

    def message(self, out: Any) -> tuple[ChatResponseMessage, str | None]:
        """A finished choice as its ``message`` (``tool_calls``, no content) and finish_reason."""
        calls = self._calls(out.text) if (self.name is not None or out.finish_reason == "stop") else None
        if calls is None:
            return ChatResponseMessage(content=out.text), out.finish_reason
        return ChatResponseMessage(content=None, tool_calls=calls), self._reason(out.finish_reason)

    def stream_deltas(self, out: Any, delta: str, lp: Any) -> Iterator[tuple[DeltaMessage, str | None, bool]]:
        """The stream chunks one engine output makes: ``(delta, finish_reason, carries the log-probs)`` each
        (the same contract as ``ToolCallOutput.stream_deltas``); ``delta`` is the output's new text."""
        messages: list[DeltaMessage] = []
        if self.name is not None:
            if out.request_id not in self._ids:
                self._ids[out.request_id] = call_id = new_call_id()
                messages.append(DeltaMessage(tool_calls=[{"index": 0, "id": call_id, "type": "function",
                                                          "function": {"name": self.name, "arguments": ""}}]))
            if delta:
                messages.append(DeltaMessage(tool_calls=[{"index": 0, "function": {"arguments": delta}}]))
        else:
            text = self._texts.get(out.request_id, "") + delta
            self._texts[out.request_id] = text
            if out.finished:
                calls = self._calls(text) if out.finish_reason == "stop" else None
                if calls is None:
                    messages.append(DeltaMessage(content=text or None))
                else:
                    messages += [DeltaMessage(tool_calls=[{"index": i, **c}]) for i, c in enumerate(calls)]
        if out.finished and (not messages or messages[-1].tool_calls):
            messages.append(DeltaMessage())  # OpenAI ends a call stream with an empty delta
        elif not messages:
            if lp is None or not lp.content:
                return
            messages = [DeltaMessage()]  # this step's log-probs, with nothing else to send yet
        reason = self._reason(out.finish_reason) if out.finished else None
        for i, m in enumerate(messages):
            yield m, reason if i == len(messages) - 1 else None, i == 0
