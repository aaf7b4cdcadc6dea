"""The shared machinery of the tool-call parsers: the parsed call, OpenAI's streaming tool-call delta, and
:class:`TaggedToolCallStream`, an incremental parser for formats whose calls sit between a start and an end
tag in the generated text.

Output shape follows OpenAI's chat completions API: a non-streaming ``message.tool_calls`` entry is
``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON text; in a
stream, a call's first delta is ``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}``
and the following ones ``{"index", "function": {"arguments": piece}}``, the pieces concatenating to the
arguments text.

Streaming and non-streaming give the same result by construction: :meth:`ToolParser.extract` is the stream
fed the whole text at once, and the stream's result does not depend on how the text is split (every split
point is tested). A call's arguments are sent in one piece when the call's end tag arrives, as the JSON text
the non-streaming answer holds (a call whose markup turns out malformed could otherwise not be taken back);
text that may be the beginning of a start tag is held back until it is known not to be one.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from atomtool.serve.api.protocol import TOOL_NAME_PATTERN


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: ``id`` (``call_`` + 24 hex digits, as vLLM's), the function ``name`` and its
    ``arguments`` as JSON text (an object, ``ensure_ascii=False``)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """The call as an entry of OpenAI's ``message.tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """A fresh tool-call id, ``call_`` + 24 hex digits (the form vLLM and OpenAI use)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class StreamDelta:
    """What one :meth:`TaggedToolCallStream.feed` (or ``finish``) produced: ``content`` text to send (``""``:
    none) and ``tool_calls``, OpenAI streaming tool-call deltas in order (see the module doc)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ExtractedToolCalls:
    """A whole generated text split into ``content`` (the text outside tool calls; None when there are calls
    and it is empty or whitespace only) and ``tool_calls``."""

    content: str | None
    tool_calls: list[ToolCall]


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses ``NaN``/``Infinity`` (Python's json accepts them, JSON does not: they
    would make the arguments text invalid JSON for the client), numbers beyond a double's range
    (``1e400``: Python reads it as ``inf``, which would be written back as ``Infinity``), and strings holding
    a lone UTF-16 surrogate (a ``\\ud800`` escape without its pair: the text could not be sent as UTF-8, and
    the server refuses such arguments in a request's history).

    Raises:
        ValueError: ``text`` is not strict JSON (json.JSONDecodeError is a ValueError).
    """
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def finite(number: str) -> float:
        value = float(number)
        if not math.isfinite(value):
            raise ValueError(f"{number} is out of a double's range")
        return value

    value = json.loads(text, parse_constant=refuse, parse_float=finite)
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string holds a lone UTF-16 surrogate (a \\u escape without its pair)") from None
    return value


def dump_arguments(arguments: dict[str, Any]) -> str:
    """Arguments as the JSON text OpenAI's ``function.arguments`` holds (non-ASCII kept as is, as vLLM)."""
    return json.dumps(arguments, ensure_ascii=False)


def partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (text that may be the
    beginning of ``tag`` once more arrives)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


#: A parsed call body: (function name, arguments object) per call, or None when the body is malformed.
ParsedBody = list[tuple[str, dict[str, Any]]] | None


class TaggedToolCallStream:
    """Incremental parser of one generated text for a format whose tool calls are written between
    ``start_tag`` and ``end_tag`` (one call, or a block of several, per tagged region).

    Subclasses set the tags and :meth:`parse_body`. Text outside the regions is content; a region whose body
    :meth:`parse_body` refuses is given back as content, markup included (vLLM answers a call it cannot parse
    with the text as content, never an error); so is a region naming a function no tool can have (a name
    outside OpenAI's :data:`~atomtool.serve.api.protocol.TOOL_NAME_PATTERN`, which the request's tools match
    and which the server requires of the calls in a request's history, so the answer can be sent back). A
    region still open when the text ends counts when its body parses as complete (the end tag may be cut by
    a stop string or EOS); else it is content too. A format whose bodies cannot tell they are complete
    (every prefix of a GLM call after its name parses) sets :attr:`open_region_counts` False: its open
    region is always content, so a call cut by ``max_tokens`` is never sent with the arguments written so
    far. Content that is whitespace only is held back until other content arrives, and dropped when calls
    were made (OpenAI's ``content`` is null beside tool calls).

    Args:
        tools: the request's tool definitions (OpenAI's ``{"type": "function", "function": {...}}`` dicts),
            for formats whose values are typed by the tool's JSON schema; None: no schema.
    """

    start_tag: ClassVar[str]
    end_tag: ClassVar[str]
    #: Whether a region the text ends inside may count as calls (when its body parses); see the class doc.
    open_region_counts: ClassVar[bool] = True

    def __init__(self, tools: list[dict[str, Any]] | None = None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.tools = tools or []
        self._new_id = new_id
        self._buf = ""  # text not yet handled: a possible partial start tag, or an open region's body
        self._in_call = False
        self._scanned = 0  # how much of an open region's body is known not to hold the end tag
        self._pending_ws = ""  # whitespace-only content held back (see the class doc)
        self._content_sent = False  # content with a non-whitespace character went out
        self._finished = False
        self.calls: list[ToolCall] = []  # every call parsed so far, in order

    # ------------------------------------------------------------------ format hooks
    def parse_body(self, body: str) -> ParsedBody:
        """The calls of one region's ``body`` (the text between the tags), or None when it is malformed."""
        raise NotImplementedError

    # ------------------------------------------------------------------ feeding
    def feed(self, text: str) -> StreamDelta:
        """Take the next piece of generated text; return what can be sent now."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out = StreamDelta()
        self._buf += text
        while True:
            if not self._in_call:
                i = self._buf.find(self.start_tag)
                if i < 0:
                    keep = partial_prefix_len(self._buf, self.start_tag)
                    self._content(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(out, self._buf[:i])
                self._buf = self._buf[i + len(self.start_tag):]
                self._in_call, self._scanned = True, 0
            else:
                j = self._buf.find(self.end_tag, self._scanned)  # not from 0: a long call stays linear
                if j < 0:
                    self._scanned = max(0, len(self._buf) - len(self.end_tag) + 1)
                    return out
                body = self._buf[:j]
                self._buf = self._buf[j + len(self.end_tag):]
                self._in_call = False
                self._region(out, body, self.start_tag + body + self.end_tag)

    def finish(self) -> StreamDelta:
        """The text has ended: flush what was held back (a partial start tag, an open region)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        out = StreamDelta()
        if self._in_call and self.open_region_counts:
            self._region(out, self._buf, self.start_tag + self._buf)
        elif self._in_call:
            self._content(out, self.start_tag + self._buf)
        else:
            self._content(out, self._buf)
        self._buf = ""
        self._finished = True
        if self._pending_ws and not self.calls:
            out.content += self._pending_ws
            self._pending_ws = ""
        return out

    def _region(self, out: StreamDelta, body: str, raw: str) -> None:
        try:
            parsed = self.parse_body(body)
        except (ValueError, TypeError, RecursionError):
            parsed = None
        if not parsed or not all(re.fullmatch(TOOL_NAME_PATTERN, name) for name, _ in parsed):
            self._content(out, raw)
            return
        for name, arguments in parsed:
            call = ToolCall(self._new_id(), name, dump_arguments(arguments))
            index = len(self.calls)
            self.calls.append(call)
            out.tool_calls.append({"index": index, "id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}})
            out.tool_calls.append({"index": index, "function": {"arguments": call.arguments}})

    def _content(self, out: StreamDelta, text: str) -> None:
        if not text:
            return
        if self._content_sent:
            out.content += text
        elif text.strip():
            out.content += self._pending_ws + text
            self._pending_ws = ""
            self._content_sent = True
        else:
            self._pending_ws += text


class ToolParser:
    """A registered tool-call format: ``name`` (the ``--tool-call-parser`` value), ``stream_class`` (its
    :class:`TaggedToolCallStream`) and ``source`` (the chat template / parser it was checked against)."""

    def __init__(self, name: str, stream_class: type[TaggedToolCallStream], source: str) -> None:
        self.name, self.stream_class, self.source = name, stream_class, source

    def stream(self, tools: list[dict[str, Any]] | None = None) -> TaggedToolCallStream:
        """A fresh incremental parser for one generated text (one choice)."""
        return self.stream_class(tools)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> ExtractedToolCalls:
        """Split a whole generated ``text`` into content and tool calls (the stream fed ``text`` at once)."""
        s = self.stream(tools)
        content = s.feed(text).content + s.finish().content
        if s.calls and not content.strip():
            return ExtractedToolCalls(None, list(s.calls))
        return ExtractedToolCalls(content, list(s.calls))
