"""A chat request's generated text as OpenAI's tool-calling output, through a tool-call parser: the
non-streaming ``message`` (``content`` + ``tool_calls``) and the stream's deltas, with finish_reason
``"tool_calls"`` (OpenAI's chat completions API, as vLLM's ``--tool-call-parser`` serves it).

Parsing applies to a request that sends ``tools`` and does not set ``tool_choice`` ``"none"`` (vLLM does the
same); any other request's text is ``content`` as without a parser. finish_reason is ``"tool_calls"`` when at
least one call was parsed and the model stopped by itself (EOS or a stop string: the engine's ``"stop"``); a
response cut by ``max_tokens`` or the context stays ``"length"``, so a client can tell it was cut. A request
with ``parallel_tool_calls`` false gets only the first call (index 0), streamed or not, as vLLM's
``maybe_filter_parallel_tool_calls`` does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from atomtool.serve.api.protocol import ChatResponseMessage, DeltaMessage
from atomtool.serve.api.tool_parsers.base import StreamDelta, TaggedToolCallStream, ToolParser

logger = logging.getLogger("atomtool.serve")


def tool_finish_reason(engine_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish_reason for a choice: ``"tool_calls"`` when it has calls and the engine says
    ``"stop"``, else the engine's reason."""
    return "tool_calls" if has_calls and engine_reason == "stop" else engine_reason


class ToolCallOutput:
    """The tool-call view of one chat request's choices: one incremental parser per choice (engine
    request id) when streaming, :meth:`ToolParser.extract` otherwise.

    Args:
        parser: the server's parser.
        tools: the request's tools as OpenAI JSON dicts (for formats typed by the tool's schema).
        parallel: False: only the first call of a choice is sent (the request's ``parallel_tool_calls``).
    """

    def __init__(self, parser: ToolParser, tools: list[dict[str, Any]], parallel: bool = True) -> None:
        self.parser, self.tools, self.parallel = parser, tools, parallel
        self._streams: dict[str, TaggedToolCallStream] = {}

    @classmethod
    def for_request(cls, parser: ToolParser | None, req: Any) -> ToolCallOutput | None:
        """The view for a ``ChatCompletionRequest``, or None when its text is not parsed (no parser, no
        ``tools``, or ``tool_choice`` ``"none"``)."""
        if parser is None or not req.tools or req.tool_choice == "none":
            return None
        return cls(parser, [t.model_dump(mode="json", exclude_none=True) for t in req.tools],
                   parallel=req.parallel_tool_calls is not False)

    @staticmethod
    def warn_if_tags_skipped(parser: ToolParser, tokenizer: Any) -> None:
        """Log a warning when the parser's start tag does not survive detokenization: the engine's text leaves
        special tokens out (``skip_special_tokens``, as vLLM's default), so calls whose tag is (or holds) a
        special token could not be seen. Checked the way the text is made: the tag encoded, then decoded
        without special tokens."""
        tag = parser.stream_class.start_tag
        try:
            ids = tokenizer.encode(tag, add_special_tokens=False)
            kept = tokenizer.decode(ids, skip_special_tokens=True)
        except Exception:  # a tokenizer that cannot say: nothing to warn about
            return
        if kept != tag:
            logger.warning("--tool-call-parser %s: this tokenizer's decoded text leaves special tokens out and "
                           "%r becomes %r there, so tool calls cannot be parsed", parser.name, tag, kept)

    def message(self, out: Any) -> tuple[ChatResponseMessage, str | None]:
        """A finished choice (a ``RequestOutput`` with the whole ``text``) as its ``message`` and finish_reason."""
        ex = self.parser.extract(out.text, self.tools)
        calls = [c.openai() for c in ex.tool_calls[:None if self.parallel else 1]] or None
        return (ChatResponseMessage(content=ex.content, tool_calls=calls),
                tool_finish_reason(out.finish_reason, bool(ex.tool_calls)))

    def stream_deltas(self, out: Any, delta: str, lp: Any) -> Iterator[tuple[DeltaMessage, str | None, bool]]:
        """The stream chunks one engine output makes: ``(delta, finish_reason, carries the log-probs)`` each.

        ``delta`` is the output's new text. Content and each tool-call delta go in chunks of their own, in
        text order; the log-probs of the step ride on the first chunk; the finish_reason on the last one of a
        finished output (an empty delta after tool-call deltas, or when nothing else is left to send)."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            stream = self._streams[out.request_id] = self.parser.stream(self.tools)
        got = stream.feed(delta) if delta else StreamDelta()
        if out.finished:
            tail = stream.finish()
            got.content += tail.content
            got.tool_calls += tail.tool_calls
        if not self.parallel:
            got.tool_calls = [tc for tc in got.tool_calls if tc["index"] == 0]
        messages = [DeltaMessage(content=got.content)] if got.content else []
        messages += [DeltaMessage(tool_calls=[tc]) for tc in got.tool_calls]
        if not messages and (out.finished or (lp is not None and lp.content)):
            messages = [DeltaMessage()]
        elif out.finished and messages[-1].tool_calls:  # OpenAI ends a call stream with an empty delta
            messages.append(DeltaMessage())
        reason = tool_finish_reason(out.finish_reason, bool(stream.calls)) if out.finished else None
        for i, m in enumerate(messages):
            yield m, reason if i == len(messages) - 1 else None, i == 0
